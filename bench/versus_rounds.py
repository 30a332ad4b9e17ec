"""Every round's merged checkpoint of a finished demo run against each skill's first-round specialist, paired task by
task: the table `skillswarm demo` prints, for a run saved before the demo printed it (or at another `--n`).

Each checkpoint vN (the coordinator's copies) and each skill's first-round specialist (its worker's model trained on
v0) play the first `--n` held-out tasks; per skill and version: both accuracies, the tasks each wins from the other,
and the one-sided sign test p that the merge is worse ("at or above" unless p <= AT_OR_ABOVE_P).

    .venv/bin/python bench/versus_rounds.py --run runs/demo1 --run runs/demo2 [--n 1000] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, action="append", required=True, help="a demo's --out (repeatable)")
    parser.add_argument("--n", type=int, default=None, help="held-out tasks per skill (default: the run's re-measure)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from remerge import demo_run

    from skillswarm.node.demo import versus_first_specialists
    from skillswarm.node.demo.retention import AT_OR_ABOVE_P

    torch.set_num_threads(1)
    out: dict[str, dict] = {}
    for run in args.run:
        report, _ = demo_run(run)
        n = args.n or report["retention_n"]
        versus = versus_first_specialists(run, list(report["skills"]), report["final_version"], n)
        out[str(run)] = {"n": n, "skills": {k: [{**asdict(x), "at_or_above": x.at_or_above} for x in rows]
                                            for k, rows in versus.items()},
                         "every_skill_at_or_above": {f"v{v}": all(x.at_or_above for rows in versus.values()
                                                                   for x in rows if x.version == v)
                                                     for v in sorted({x.version for r in versus.values() for x in r})}}
        print(f"{run.name} done", file=sys.stderr)
    if args.json:
        print(json.dumps({"at_or_above_p": AT_OR_ABOVE_P, "runs": out}, indent=2))
        return 0
    from skillswarm.node.cli.common import console
    from skillswarm.node.cli.demo_cmd import versus_table

    for run, row in out.items():
        console.print(f"{run}:")
        console.print(versus_table(row["skills"], row["n"], AT_OR_ABOVE_P))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

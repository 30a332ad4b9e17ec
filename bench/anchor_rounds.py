"""One demo worker's round trained again under other retain settings: what its delta does to every skill.

A demo worker keeps each round's settings (`run.json`) and its starting checkpoint. This script trains that round
again from the same checkpoint with the same settings and seed, once per variant (`NAME:KEY=VALUE,...`, KEY a
TrainConfig field, e.g. `retain_fragile=0`), and evaluates every skill of the network greedily on the first `--n`
held-out tasks, beside the starting checkpoint on the same tasks. The first variant is the peer of the others: the
change of each skill is printed against the start and against that variant, so a worker-side change can be judged
on what one round's delta costs the other skills (the saturated ones above all) without a whole demo.

    .venv/bin/python bench/anchor_rounds.py --run runs/demo1 --skill sort --version 2 \\
        --variant random:retain_fragile=0 --variant fragile:retain_fragile=0.5 --n 1000 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def round_settings(run: Path, skill: str, version: int) -> tuple[dict[str, Any], list[str]]:
    """The TrainConfig fields of `skill`'s worker's round on checkpoint `version` of demo `run`, and the network's
    skills (its retain skills)."""
    from skillswarm.node.demo import specialist_dir
    from skillswarm.node.rl.config import TrainConfig

    run_json = specialist_dir(run / "nodes" / f"worker-{skill}", skill, version).parent / "run.json"
    if not run_json.is_file():
        raise SystemExit(f"{run_json} is missing: {run} has no worker of {skill} that trained on v{version}")
    saved = json.loads(run_json.read_text())
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in fields}
    if not Path(settings["model_dir"]).is_dir():  # the run was moved: its worker's own copy of the checkpoint
        moved = run_json.parent.parent.parent / "checkpoints" / f"v{version}"
        if not moved.is_dir():
            raise SystemExit(f"{settings['model_dir']} (the round's starting checkpoint) is gone, and {moved} too")
        settings["model_dir"] = str(moved)
    return settings, list(settings.get("retain_skills") or (skill,))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="a demo's --out")
    parser.add_argument("--skill", required=True, help="whose worker's round to train again")
    parser.add_argument("--version", type=int, required=True, help="the checkpoint the round started from")
    parser.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE,... (repeatable; first: the peer)")
    parser.add_argument("--seed", type=int, help="another seed than the round's")
    parser.add_argument("--n", type=int, default=1000, help="held-out tasks per skill")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from remerge import held_out
    from rl_recipe import parse_variant

    from skillswarm.node.rl.config import TrainConfig
    from skillswarm.node.rl.run import train

    settings, skills = round_settings(args.run, args.skill, args.version)
    variants = [parse_variant(v) for v in args.variant or ["as-run:"]]
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    if bad := sorted({k for _, changes in variants for k in changes} - fields):
        raise SystemExit(f"--variant: {', '.join(bad)} is not a TrainConfig field")

    def accuracies(model: Path) -> dict[str, float]:
        return held_out(model, skills, args.n)["accuracy"]

    start = accuracies(Path(settings["model_dir"]))
    rows = []
    for name, changes in variants:
        with tempfile.TemporaryDirectory(prefix="anchor-rounds-") as tmp:
            cfg = TrainConfig(**{**settings, "out_dir": Path(tmp) / "run", "resume": False, "codec": None,
                                 "save_every": 0, **({"seed": args.seed} if args.seed is not None else {}), **changes})
            t0 = time.monotonic()
            result = train(cfg, progress=False)
            rows.append({"variant": name, "changes": changes, "seconds": round(time.monotonic() - t0, 1),
                         "accuracy": accuracies(result.model_dir)})
        print(f"  {name}: {rows[-1]['accuracy']}", file=sys.stderr)
    peer = rows[0]["accuracy"]
    for row in rows:
        row["change"] = {k: round(100 * (row["accuracy"][k] - start[k]), 1) for k in skills}
        row["versus_peer"] = {k: round(100 * (row["accuracy"][k] - peer[k]), 1) for k in skills}
    report = {"run": str(args.run), "skill": args.skill, "version": args.version, "seed": settings["seed"]
              if args.seed is None else args.seed, "n": args.n, "start": start, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.skill}'s round on v{args.version} of {args.run}, trained again (greedy, n={args.n}; "
                        f"points against the start, and against {rows[0]['variant']})")
    table.add_column("variant")
    for k in skills:
        table.add_column(f"{k} ({100 * start[k]:.1f})", justify="right")
    table.add_column("seconds", justify="right")
    for row in rows:
        table.add_row(row["variant"], *(f"{100 * row['accuracy'][k]:.1f} ({row['change'][k]:+.1f}; "
                                        f"{row['versus_peer'][k]:+.1f})" for k in skills), f"{row['seconds']:.0f}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Re-merge a finished demo run's rounds with other merge settings, and judge the coordinator's lambda search.

For each round of `skillswarm demo --out DIR`, the deltas the coordinator included are merged again onto that
round's parent with every `--merge` variant (by the round's recipe, `merge.round_merge`: each delta at the weight and in
the layers the coordinator merged it), and each merge is evaluated greedily on the first `--eval-n` held-out
tasks per skill, against the round's specialists (parent + that skill's delta alone, as its worker measured it):
how much of each specialist's accuracy the merge keeps, per skill, summed and at the worst skill. `--lambdas`
plays the coordinator's search (node/roles/rounds/scale_search.py) on each round's own first-look tasks (its eval seed)
and reports the lambda it would keep and what that merge scores on the held-out tasks, beside lambda 1's.

    .venv/bin/python bench/remerge.py --run runs/demo --merge ties=ties:density=0.3 --merge ties5=ties:density=0.5
    .venv/bin/python bench/remerge.py --run runs/demo1 --run runs/demo2 --lambdas 1,1.25,1.5 --json

Figures are this machine's evaluation of the saved deltas; nothing is trained.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

NETWORK = "demo"


def demo_run(run: Path) -> tuple[dict[str, Any], Path]:
    """A finished demo run's report.json and its coordinator's checkpoints directory (a clear exit otherwise)."""
    cks = run / "nodes" / "coordinator" / "cache" / "networks" / NETWORK / "checkpoints"
    if not (run / "report.json").is_file() or not (run / "network.toml").is_file() or not cks.is_dir():
        raise SystemExit(f"{run}: not a finished demo run (no report.json, network.toml or coordinator checkpoints); "
                         "give the --out of a `skillswarm demo` that ran to the end")
    return json.loads((run / "report.json").read_text()), cks


def delta_file(run: Path, blob: str, version: int) -> Path:
    """Where a round's delta blob lies in the run's node caches (a clear exit when none holds it)."""
    found = sorted(run.glob(f"nodes/*/cache/blobs/{blob}"))
    if not found:
        raise SystemExit(f"{run}: delta {blob[:12]} of v{version} is in no node's cache; was the run cleaned?")
    return found[0]


def rounds_of(run: Path) -> list[dict[str, Any]]:
    """Each merged round of a demo run: parent dir, included deltas (files, weights, layers: what the coordinator
    merged), eval seed, specialists."""
    import msgspec

    from skillswarm.merge.rounds import included_deltas
    from skillswarm.protocol.records import CheckpointManifest

    report, cks = demo_run(run)
    out = []
    for v in range(1, report["final_version"] + 1):
        m = msgspec.msgpack.decode((cks / f"v{v}" / "manifest.msgpack").read_bytes(), type=CheckpointManifest)
        deltas = included_deltas(m, lambda ref: delta_file(run, ref.blob, v))
        if deltas:
            out.append({"version": v, "parent": cks / f"v{v - 1}", "deltas": deltas, "eval_seed": m.eval_seed,
                        "specialist": {s: x["after"] for s, x in report["specialists"][str(v - 1)].items()}})
    return out


def merged_into(parent: Path, deltas: list[Any], method: str, params: dict[str, Any], out: Path, seed: int) -> Path:
    """The round's merge of `deltas` onto `parent` (`merge.round_merge`) by `method` at `params`, with the network's
    aggregator within a skill."""
    from skillswarm.merge.rounds import round_merge
    from skillswarm.merge.streaming import MergeSpec
    from skillswarm.protocol.records import MergePolicy

    round_merge(parent, deltas, MergeSpec(method, params, MergePolicy().aggregator, MergePolicy().trim_fraction), out,
                seed=seed)
    return out


def held_out(model: Path, skills: list[str], n: int, seed: int | None = None) -> dict[str, Any]:
    """Per skill: accuracy on the first `n` held-out tasks and, with `seed`, rewards on that seed's tasks."""
    from skillswarm.node.rl.engines.hf import HFEngine
    from skillswarm.node.rl.evaluation import evaluate
    from skillswarm.node.roles.rounds.paired import scores

    engine = HFEngine.load(model)
    out: dict[str, Any] = {"accuracy": {s: evaluate(engine, s, n=n).accuracy for s in skills}}
    if seed is not None:
        out["first_look"] = {s: scores(engine, s, n, seed) for s in skills}
    return out


def main() -> int:
    from skillswarm.protocol.records import EVAL_N

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, action="append", required=True, help="a demo's --out (repeatable)")
    parser.add_argument("--merge", action="append", default=[], help="LABEL=METHOD:KEY=VALUE,... (repeatable)")
    parser.add_argument("--lambdas", default="", help="comma-separated lambdas for the search, the first the network's")
    parser.add_argument("--eval-n", type=int, default=EVAL_N)
    parser.add_argument("--confidence", type=float, default=None, help="the search's (default: the network's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from interference import parse_merge

    from skillswarm.node.roles.rounds.scale_search import choose, pooled
    from skillswarm.protocol.records import MergePolicy, ScreenPolicy

    torch.set_num_threads(1)
    merges = dict(parse_merge(m) for m in args.merge)
    lambdas = [float(x) for x in args.lambdas.split(",") if x]
    if not merges and not lambdas:
        raise SystemExit("give --merge LABEL=METHOD:... and/or --lambdas 1,1.25,1.5")
    confidence = args.confidence if args.confidence is not None else ScreenPolicy().confidence
    network = MergePolicy()  # the merge the search scales: the network's method and density
    rows = []
    for run in args.run:
        for r in rounds_of(run):
            skills = sorted(r["specialist"])
            row: dict[str, Any] = {"run": str(run), "version": r["version"], "specialist": r["specialist"], "merges": {}}
            with tempfile.TemporaryDirectory(prefix="remerge-") as tmp:
                for label, (method, params) in merges.items():
                    d = merged_into(r["parent"], r["deltas"], method, params, Path(tmp) / label, r["version"] - 1)
                    row["merges"][label] = held_out(d, skills, args.eval_n)["accuracy"]
                if lambdas:
                    tried = []
                    for lam in lambdas:
                        d = merged_into(r["parent"], r["deltas"], network.method, {"density": network.density, "scale": lam},
                                        Path(tmp) / f"lambda{lam:g}", r["version"] - 1)
                        tried.append((lam, held_out(d, skills, args.eval_n, r["eval_seed"])))
                    alpha = (1 - confidence) / max(1, len(lambdas) - 1)
                    looks = [pooled(got["first_look"]) for _, got in tried]
                    keep, tests = choose(looks[0], looks[1:], alpha)
                    # without the sign test: the highest total reward on the first-look tasks (ties: the first)
                    highest = max(range(len(looks)), key=lambda i: (sum(r for r, _ in looks[i]), -i))
                    row["search"] = {"kept": tried[keep][0], "highest": tried[highest][0],
                                     "tests": {f"{lam:g}": {"wins": t.wins, "losses": t.losses, "p": t.p_better}
                                               for (lam, _), t in zip(tried[1:], tests)},
                                     "accuracy": {f"{lam:g}": got["accuracy"] for lam, got in tried}}
            rows.append(row)
            print(f"{run.name} v{r['version']} done", file=sys.stderr)

    def short(acc: dict[str, float], spec: dict[str, float]) -> list[float]:
        return [100 * (acc[s] - spec[s]) for s in sorted(spec)]

    summary: dict[str, Any] = {}
    for label in merges:
        gaps = [short(row["merges"][label], row["specialist"]) for row in rows]
        summary[label] = {"sum": sum(map(sum, gaps)) / len(gaps), "worst": sum(map(min, gaps)) / len(gaps)}
    if lambdas:
        for name, pick in (("lambda 1st", lambda row: f"{lambdas[0]:g}"), ("searched", lambda row: f"{row['search']['kept']:g}"),
                           ("highest, no test", lambda row: f"{row['search']['highest']:g}")):
            gaps = [short(row["search"]["accuracy"][pick(row)], row["specialist"]) for row in rows]
            summary[name] = {"sum": sum(map(sum, gaps)) / len(gaps), "worst": sum(map(min, gaps)) / len(gaps)}
    report = {"runs": [str(r) for r in args.run], "eval_n": args.eval_n, "rows": rows, "summary": summary}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"merged minus specialist, points (n={args.eval_n}; mean over {len(rows)} rounds)")
    for col in ("merge", "summed over skills", "worst skill"):
        table.add_column(col)
    for label, s in summary.items():
        table.add_row(label, f"{s['sum']:+.2f}", f"{s['worst']:+.2f}")
    Console().print(table)
    for row in rows:
        if "search" in row:
            tests = ", ".join(f"{k}: {t['wins']}/{t['losses']} p={t['p']:.3g}" for k, t in row["search"]["tests"].items())
            Console().print(f"{Path(row['run']).name} v{row['version']}: kept lambda {row['search']['kept']:g} ({tests})",
                            highlight=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

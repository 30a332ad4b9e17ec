"""How much a skill learns in the demo's budget, per training recipe: held-out gain after R rounds of S steps.

Each run plays a worker that trains alone: round r starts from round r-1's trained model with a fresh
optimizer (as a worker starts from each new checkpoint), so warm-up and restarts cost what they cost in the
demo, without the merge. Every variant and seed starts from the same model and is evaluated greedily on
the same first `--eval-n` held-out tasks. `gain` is points over the start after the last round.

    .venv/bin/python bench/rl_recipe.py --skill arith --variant default: --variant b32:batch=32 --seeds 0,1
    .venv/bin/python bench/rl_recipe.py --skill arith --variant lr:lr=5e-4,warmup_steps=0 --json

A variant is NAME:KEY=VALUE,... with KEY a TrainConfig field (numbers and true/false are parsed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """`NAME:k=v,k=v` -> (NAME, {k: v}), values as int, float, bool or str."""
    name, _, body = text.partition(":")
    changes: dict[str, Any] = {}
    for part in filter(None, body.split(",")):
        key, _, raw = part.partition("=")
        value: Any = raw
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                continue
        if raw in ("true", "false"):
            value = raw == "true"
        changes[key.strip()] = value
    return name or "default", changes


def run_rounds(model: Path, skill: str, rounds: int, steps: int, eval_n: int, seed: int, changes: dict[str, Any],
               work: Path) -> dict[str, Any]:
    """Train `rounds` rounds of `steps` from `model`; the accuracy after each round and the wall time."""
    from skillswarm.node.demo import DemoConfig
    from skillswarm.node.rl.config import TrainConfig, default_of
    from skillswarm.node.rl.run import train

    accuracy, start, seconds = [], None, 0.0
    for r in range(rounds):
        settings = {"group_size": default_of(DemoConfig, "group_size"), "threads": 1, "eval_every": 0, "save_every": 0,
                    "codec": None, **changes}
        cfg = TrainConfig(model_dir=model, skill=skill, steps=steps, out_dir=work / f"round{r}", eval_n=eval_n,
                          seed=seed * 1000 + r, **settings)
        t0 = time.monotonic()
        result = train(cfg, progress=False)
        seconds += time.monotonic() - t0
        start = result.stats.accuracy_before if start is None else start
        accuracy.append(result.stats.accuracy_after)
        model = result.model_dir
    return {"start": start, "rounds": accuracy, "gain": round(100 * (accuracy[-1] - start), 1),
            "seconds": round(seconds, 1), "batch": cfg.batch}


def main() -> int:
    from skillswarm.protocol.records import EVAL_N

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skill", default="arith")
    parser.add_argument("--model", type=Path, help="starting model (default: the nano base, built if needed)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50, help="steps per round (the demo's)")
    parser.add_argument("--eval-n", type=int, default=EVAL_N)
    parser.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE,... (repeatable)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, one run each")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from skillswarm.skills.nano.build import build_base

    model = args.model or build_base()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for text in args.variant or ["default:"]:
        name, changes = parse_variant(text)
        runs = []
        for seed in seeds:
            with tempfile.TemporaryDirectory(prefix="rl-recipe-") as tmp:
                runs.append(run_rounds(model, args.skill, args.rounds, args.steps, args.eval_n, seed, changes,
                                       Path(tmp)))
            if not args.json:
                r = runs[-1]
                print(f"{name} seed {seed}: {100 * r['start']:.1f}% -> "
                      + " -> ".join(f"{100 * a:.1f}%" for a in r["rounds"]) + f" ({r['gain']:+.1f}, {r['seconds']:.0f} s)",
                      file=sys.stderr)
        gains = [r["gain"] for r in runs]
        rows.append({"variant": name, "changes": changes, "runs": runs, "mean_gain": round(statistics.mean(gains), 1),
                     "min_gain": min(gains)})
    report = {"skill": args.skill, "model": str(model), "rounds": args.rounds, "steps": args.steps,
              "eval_n": args.eval_n, "seeds": seeds, "variants": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.skill}: held-out gain after {args.rounds} x {args.steps} steps (n={args.eval_n}, greedy)")
    for col in ("variant", "tasks/step", "start", "after each round", "gain (mean, min)", "seconds"):
        table.add_column(col)
    for row in rows:
        first = row["runs"][0]
        table.add_row(row["variant"] + (f" {row['changes']}" if row["changes"] else ""), str(first["batch"]),
                      f"{100 * first['start']:.1f}%",
                      " / ".join(" ".join(f"{100 * a:.0f}" for a in r["rounds"]) for r in row["runs"]),
                      f"{row['mean_gain']:+.1f}, {row['min_gain']:+.1f}",
                      " ".join(f"{r['seconds']:.0f}" for r in row["runs"]))
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What one round's deltas of different skills do to each other, with and without the retain loss.

From one model, each skill trains one round alone (the demo's round: S steps, G=8, B=8), as a worker on a
network of all the skills does; then every skill is evaluated (greedy, the first `--eval-n` held-out tasks)
on: its own specialist (start + its delta), the other skills' deltas summed at lambda 1 without its own
(`others`: the harm a round's other deltas do to it), and the merge of all four deltas with each method.
`harm` is the sum over skills of (others - start); `merged gain` the sum of (merged - start), against
`specialist gain`, the sum of (specialist - start): the part of the specialists' gain the merge keeps.

    .venv/bin/python bench/interference.py --model runs/demo/nodes/coordinator/.../v3 --variant none:retain=0 \\
        --variant retain1:retain=1 --seeds 0,1 --json

A variant is NAME:KEY=VALUE,... with KEY a TrainConfig field (see bench/rl_recipe.py). `--merge
LABEL=METHOD:KEY=VALUE,...` (repeatable) replaces the default merges, KEY a parameter of the method, e.g.
`--merge ties-sum=ties:density=0.3,normalize=false`; the deltas are trained once and every merge reuses them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

SKILLS = ["arith", "calc", "reverse", "sort"]
MERGES = {"task_arithmetic@0.6": ("task_arithmetic", {"scale": 0.6}), "task_arithmetic@1": ("task_arithmetic", {}),
          "ties@1": ("ties", {"density": 0.3})}


def parse_merge(text: str) -> tuple[str, tuple[str, dict[str, Any]]]:
    """`LABEL=METHOD:k=v,...` -> (LABEL, (METHOD, {k: v})), checked against the method's parameters before
    any training, so a typo fails in a second rather than after the deltas are trained."""
    from rl_recipe import parse_variant

    from skillswarm.merge.methods import get_method
    from skillswarm.protocol.errors import MergeError

    label, _, body = text.partition("=")
    if not label or not body:
        raise SystemExit(f"bad --merge {text!r}: use LABEL=METHOD:KEY=VALUE,..., e.g. ties-sum=ties:normalize=false")
    method, params = parse_variant(body)
    try:
        entry = get_method(method)
        entry.make_params(params)
    except (MergeError, TypeError, ValueError) as e:
        raise SystemExit(f"bad --merge {text!r}: {e}") from None
    if entry.kind != "gta":
        raise SystemExit(f"bad --merge {text!r}: {method} interpolates between models; use a task-vector method")
    return label, (method, params)


def round_deltas(model: Path, changes: dict[str, Any], seed: int, steps: int, eval_n: int, work: Path) -> dict[str, Any]:
    """Train one round of each skill from `model`; the deltas and each specialist's accuracy on its skill."""
    from safetensors.torch import load_file

    from skillswarm.node.demo import DemoConfig
    from skillswarm.node.rl.config import TrainConfig, default_of
    from skillswarm.node.rl.run import train

    start = load_file(model / "model.safetensors")
    deltas, specialist, before = {}, {}, {}
    for i, skill in enumerate(SKILLS):
        settings = {"group_size": default_of(DemoConfig, "group_size"), "batch": default_of(DemoConfig, "batch"),
                    "threads": 1, "eval_every": 0, "save_every": 0, "codec": None, "retain_skills": tuple(SKILLS),
                    **changes}
        cfg = TrainConfig(model_dir=model, skill=skill, steps=steps, out_dir=work / skill, eval_n=eval_n,
                          seed=seed * 1000 + i, **settings)
        result = train(cfg, progress=False)
        trained = load_file(result.model_dir / "model.safetensors")
        deltas[skill] = {k: trained[k] - start[k] for k in start}
        before[skill], specialist[skill] = result.stats.accuracy_before, result.stats.accuracy_after
        print(f"  {skill}: {100 * before[skill]:.1f}% -> {100 * specialist[skill]:.1f}%", file=sys.stderr)
    return {"start": start, "deltas": deltas, "before": before, "specialist": specialist}


def measure(model: Path, r: dict[str, Any], eval_n: int, merges: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Each skill under the others' deltas, and under each merge of all four."""
    import torch

    from skillswarm.merge.methods import merge
    from skillswarm.node.rl.engines.hf import HFEngine
    from skillswarm.node.rl.evaluation import evaluate

    engine = HFEngine.load(model)
    start, deltas = r["start"], r["deltas"]

    def accuracy(weights: dict[str, torch.Tensor], skills: list[str]) -> dict[str, float]:
        engine.load_state_dict(weights, 0)
        return {k: evaluate(engine, k, n=eval_n).accuracy for k in skills}

    others = {k: accuracy({n: start[n] + sum(deltas[t][n] for t in SKILLS if t != k) for n in start}, [k])[k]
              for k in SKILLS}
    merged = {}
    for label, (method, params) in merges.items():
        merged[label] = accuracy({n: start[n] + merge(method, [deltas[t][n] for t in SKILLS], **params) for n in start},
                                 SKILLS)
    return {"others": others, "merged": merged}


def main() -> int:
    from skillswarm.protocol.records import EVAL_N

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="starting model (default: the nano base, built if needed)")
    parser.add_argument("--steps", type=int, default=50, help="steps of the round (the demo's)")
    parser.add_argument("--eval-n", type=int, default=EVAL_N)
    parser.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE,... (repeatable)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, one round each")
    parser.add_argument("--merge", action="append", default=[], help="LABEL=METHOD:KEY=VALUE,... (repeatable)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from rl_recipe import parse_variant

    merges = dict(parse_merge(m) for m in args.merge) if args.merge else MERGES

    from skillswarm.skills.nano.build import build_base

    model = args.model or build_base()
    rows = []
    for text in args.variant or ["none:retain=0", "retain1:retain=1"]:
        name, changes = parse_variant(text)
        for seed in (int(s) for s in args.seeds.split(",")):
            print(f"{name} seed {seed}", file=sys.stderr)
            with tempfile.TemporaryDirectory(prefix="interference-") as tmp:
                r = round_deltas(model, changes, seed, args.steps, args.eval_n, Path(tmp))
                m = measure(model, r, args.eval_n, merges)
            start = r["before"]
            rows.append({"variant": name, "changes": changes, "seed": seed, "start": start,
                         "specialist": r["specialist"], "others": m["others"], "merged": m["merged"],
                         "specialist_gain": round(100 * sum(r["specialist"][k] - start[k] for k in SKILLS), 1),
                         "harm": round(100 * sum(m["others"][k] - start[k] for k in SKILLS), 1),
                         "merged_gain": {label: round(100 * sum(acc[k] - start[k] for k in SKILLS), 1)
                                         for label, acc in m["merged"].items()}})
    report = {"model": str(model), "steps": args.steps, "eval_n": args.eval_n, "skills": SKILLS, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"one round of {args.steps} steps per skill from {model.name} (points summed over "
                        f"{len(SKILLS)} skills, n={args.eval_n}, greedy)")
    for col in ("variant", "seed", "specialist gain", "harm of the others' deltas", *(f"merged gain, {m}" for m in merges)):
        table.add_column(col)
    for row in rows:
        table.add_row(row["variant"], str(row["seed"]), f"{row['specialist_gain']:+.1f}", f"{row['harm']:+.1f}",
                      *(f"{row['merged_gain'][m]:+.1f}" for m in merges))
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

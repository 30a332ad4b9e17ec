"""What a delta codec costs: wire bytes against dense bf16, and the merged model's held-out accuracy per
skill against the same merge of dense bf16 deltas, on the demo's setup.

Setup (the demo's first round): one specialist per demo skill, trained from the nano base with
`skillswarm train --steps <the demo's steps per round>` (or reused from `--runs DIR`, where an earlier run
of this bench left them); each specialist's delta (tuned - base) encoded with each codec; the four merged
onto the base with the demo's policy (DemoConfig: method and lambda); the merged model evaluated greedy on
the first `--eval-n` held-out tasks of each skill, the same tasks for every codec. Printed per codec:
the bytes of the four delta files, compression against dense bf16 (`x_smaller`), accuracy per skill,
points lost against dense bf16 per skill (`lost`; negative is a gain) and the worst of them (`max_lost`).
The goal the network default is chosen by: >= 8x smaller than dense bf16 at <= 1 point lost.

    .venv/bin/python bench/codecs.py [--runs DIR] [--eval-n 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# (label, codec, params): dense bf16 first, it is the reference the others are measured against.
CODECS: list[tuple[str, str, dict[str, float]]] = [
    ("dense_bf16", "dense_bf16", {}),
    ("dense_fp16", "dense_fp16", {}),
    ("int8", "int8", {}),
    ("topk 0.3", "topk", {"density": 0.3}),
    ("topk 0.1", "topk", {"density": 0.1}),
    ("topk 0.05", "topk", {"density": 0.05}),
    ("topk 0.1 + int8", "topk", {"density": 0.1, "value_bits": 8}),
    ("topk 0.05 + int8", "topk", {"density": 0.05, "value_bits": 8}),
    ("lora r4", "lora", {"rank": 4}),
    ("lora r16", "lora", {"rank": 16}),
]


def _train(base: Path, skill: str, steps: int, out: Path) -> Path:
    """A specialist of the demo's first round (reused when `out` already holds one)."""
    if (out / "model" / "config.json").is_file():
        return out / "model"
    cmd = [shutil.which("skillswarm") or str(Path(sys.executable).with_name("skillswarm")), "-q", "train",
           "--skill", skill, "--model", str(base), "--steps", str(steps), "--eval-n", "0", "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out / "model"


def main() -> None:
    from skillswarm.protocol.records import EVAL_N

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, help="where the specialists are trained (kept, and reused next time)")
    parser.add_argument("--eval-n", type=int, default=EVAL_N, help="held-out tasks per skill")
    parser.add_argument("--only", nargs="*", help="codec labels to run (default: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from skillswarm.merge import compute_delta, merge_checkpoint
    from skillswarm.node.demo import DemoConfig
    from skillswarm.node.rl.adapter import model_targets
    from skillswarm.node.rl.evaluation import evaluate
    from skillswarm.protocol.errors import SkillswarmError
    from skillswarm.protocol.records import MergePolicy
    from skillswarm.skills.nano.build import build_base
    from skillswarm.skills.nano.recipe import DEFAULT_RECIPE

    skills = list(DEFAULT_RECIPE.skills)  # the demo's skills
    demo = DemoConfig(out=Path(tempfile.gettempdir()), skills=skills)  # only its defaults are read
    policy = MergePolicy(method=demo.method, density=demo.density, scale=demo.scale)  # type: ignore[arg-type]
    console = Console(stderr=True)
    codecs = [c for c in CODECS if not args.only or c[0] in args.only]
    try:
        base = build_base()
        runs = args.runs or Path(tempfile.mkdtemp(prefix="codecs-bench-"))
        specialists = {}
        for skill in skills:
            console.log(f"specialist {skill}: {demo.steps_per_round} steps")
            specialists[skill] = _train(base, skill, demo.steps_per_round, runs / skill)
        base_acc = {s: evaluate(base, s, args.eval_n).accuracy for s in skills}
        rows = []
        with tempfile.TemporaryDirectory(prefix="codecs-") as tmp:
            for label, codec, params in codecs:
                console.log(f"codec {label}")
                work = Path(tmp) / label.replace(" ", "_")
                work.mkdir()
                groups, size = {}, 0
                for skill, tuned in specialists.items():
                    # LoRA travels as a PEFT adapter of the linear layers, as a network ships it
                    extra = {"adapter_targets": model_targets(base)} if codec == "lora" else {}
                    info = compute_delta(base, tuned, work / f"{skill}.safetensors", codec, **extra, **params)
                    size += info.size
                    groups[skill] = [(work / f"{skill}.safetensors", 1.0)]
                merge_checkpoint(base, groups, policy, work / "merged", progress=False)
                acc = {s: evaluate(work / "merged", s, args.eval_n).accuracy for s in skills}
                rows.append({"codec": label, "name": codec, "params": params, "bytes": size, "accuracy": acc})
                shutil.rmtree(work / "merged")
    except (SkillswarmError, subprocess.CalledProcessError) as e:
        sys.exit(f"error: {e}")
    dense = rows[0] if rows and rows[0]["codec"] == "dense_bf16" else None
    for r in rows:
        if dense:
            r["x_smaller"] = dense["bytes"] / r["bytes"]
            r["lost"] = {s: 100 * (dense["accuracy"][s] - r["accuracy"][s]) for s in skills}
            r["max_lost"] = max(r["lost"].values())
    out = {"skills": skills, "eval_n": args.eval_n, "steps": demo.steps_per_round, "base_accuracy": base_acc,
           "policy": {"method": policy.method, "lambda": policy.scale}, "runs": str(runs), "codecs": rows}
    if args.json:
        print(json.dumps(out))
        return
    table = Table(title=f"codecs on the demo's first round ({args.eval_n} held-out tasks per skill; "
                        f"base {', '.join(f'{s} {100 * a:.1f}%' for s, a in base_acc.items())})")
    for col in ("codec", "bytes", "x smaller", *skills, "max lost"):
        table.add_column(col, justify="left" if col == "codec" else "right")
    for r in rows:
        cells = [f"{100 * r['accuracy'][s]:.1f}%" + (f" ({-r['lost'][s]:+.1f})" if dense and r is not dense else "")
                 for s in skills]
        table.add_row(r["codec"], f"{r['bytes']:,}", f"{r.get('x_smaller', 1):.1f}", *cells,
                      f"{r['max_lost']:+.1f}" if dense and r is not dense else "")
    Console().print(table)


if __name__ == "__main__":
    main()

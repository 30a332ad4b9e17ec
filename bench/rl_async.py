"""Async vs lock-step GRPO throughput: the same run (model, skill, steps, seed) once with `--sync` and
once async (generation in its own process by default), on this machine's cores.

Prints samples/s (episodes generated and consumed by the trainer per second) and tokens/s (tokens of
those episodes per second) for each mode, the ratio async/sync, and the async run's staleness
distribution. The first `--warmup` steps are left out of the rates (they include the generator
process's start). `--json` prints one object with sync_samples_s, async_samples_s and ratio.

    .venv/bin/python bench/rl_async.py [--model DIR] [--skill arith] [--steps 40] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _rates(metrics_path: Path, warmup: int) -> dict[str, Any]:
    from skillswarm.node.rl.rundir import read_metrics

    steps = [r for r in read_metrics(metrics_path) if r.get("kind") == "step"]
    if len(steps) <= warmup:
        raise SystemExit(f"only {len(steps)} steps ran; ask for more than --warmup {warmup}")
    counted = steps[warmup:]
    seconds = counted[-1]["time"] - steps[warmup - 1]["time"] if warmup else counted[-1]["time"]
    episodes = sum(r["episodes"] for r in counted)
    tokens = sum(r["gen_tokens"] for r in counted)
    trained = sum(r["batch_samples"] for r in counted)
    hist: dict[str, int] = {}
    for r in counted:
        for k, v in (r.get("staleness") or {}).items():
            hist[k] = hist.get(k, 0) + v
    return {"steps": len(counted), "seconds": round(seconds, 3), "samples_s": round(episodes / seconds, 3),
            "tokens_s": round(tokens / seconds, 1), "trained_samples_s": round(trained / seconds, 3),
            "step_s": round(seconds / len(counted), 4),
            "gen_s_per_step": round(sum(r["gen_seconds"] for r in counted) / len(counted), 4),
            "train_s_per_step": round(sum(r["train_seconds"] for r in counted) / len(counted), 4),
            "staleness": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
            "stale_groups": sum(r["stale_groups"] for r in counted)}


def _run(model: Path, args: argparse.Namespace, sync: bool, out: Path) -> dict[str, Any]:
    from skillswarm.node.rl.config import TrainConfig
    from skillswarm.node.rl.run import train

    cfg = TrainConfig(model_dir=model, skill=args.skill, steps=args.steps, out_dir=out, sync=sync,
                      async_mode=args.async_mode, group_size=args.group_size, batch=args.batch,
                      max_staleness=args.max_staleness, lr=args.lr, eval_n=0, eval_every=0, save_every=0,
                      seed=args.seed, threads=args.threads, codec=None, max_new_tokens=args.max_new_tokens)
    train(cfg, progress=False)
    return _rates(out / "metrics.jsonl", args.warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="model directory (default: the nano base model, built if needed)")
    parser.add_argument("--skill", default="arith")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process")
    parser.add_argument("--async-mode", default="auto", choices=["auto", "process", "thread"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    if args.model is None:
        from skillswarm.skills.nano.build import build_base

        args.model = build_base()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rl-async-") as tmp:
        start = time.monotonic()
        sync = _run(args.model, args, True, Path(tmp) / "sync")
        asyn = _run(args.model, args, False, Path(tmp) / "async")
        wall = time.monotonic() - start
    ratio = asyn["samples_s"] / sync["samples_s"] if sync["samples_s"] else float("nan")
    result = {"sync_samples_s": sync["samples_s"], "async_samples_s": asyn["samples_s"], "ratio": round(ratio, 3),
              "sync_tokens_s": sync["tokens_s"], "async_tokens_s": asyn["tokens_s"],
              "tokens_ratio": round(asyn["tokens_s"] / sync["tokens_s"], 3) if sync["tokens_s"] else None,
              "staleness": asyn["staleness"], "sync": sync, "async": asyn, "skill": args.skill,
              "cores": os.cpu_count(), "load_before": [round(x, 2) for x in load_before],
              "load_after": [round(x, 2) for x in os.getloadavg()], "wall_seconds": round(wall, 1)}
    if args.json:
        sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
        return
    print(f"GRPO on {args.skill}, {args.steps} steps ({args.warmup} warm-up steps not counted), "
          f"G={args.group_size} B={args.batch}, {os.cpu_count()} cores, load {load_before[0]:.2f} before")
    for name, r in (("sync", sync), ("async", asyn)):
        print(f"  {name:5s}: {r['samples_s']:8.2f} samples/s  {r['tokens_s']:9.1f} tokens/s  "
              f"{r['step_s']:.3f} s/step (gen {r['gen_s_per_step']:.3f} s, train {r['train_s_per_step']:.3f} s)")
    print(f"  ratio async/sync: {ratio:.2f}x samples/s, {result['tokens_ratio']}x tokens/s")
    total = sum(asyn["staleness"].values()) or 1
    print("  async staleness: " + ", ".join(f"{k}: {v} ({v / total:.0%})" for k, v in asyn["staleness"].items())
          + f"; dropped as stale: {asyn['stale_groups']}")


if __name__ == "__main__":
    main()

"""The poisoning drill: the demo's setup (nano model, four skills, one honest RL delta per skill, the demo's
task-arithmetic merge) with an adversary among the workers, screened by the network's default round
strategy (manifest checks, caps, file checks, consensus, the usefulness test, reputation weights).

    .venv/bin/python bench/poison.py [--steps 50] [--eval-n 300] [--json]

Attacks, each published from fresh keys (no reputation: the worst case), against the skill with the
largest honest gain (`target`) unless said otherwise:
- sign_flip: -1 x the honest delta;  scale_x5 / scale_x100: the honest delta scaled up;
- random_direction: a random delta with the honest delta's norm;
- backdoor: the honest delta plus a delta trained *against* another skill (gradient ascent on its
  demonstrations, i.e. a reward that punishes the right answer) at half the honest norm, published as
  the target skill (it still helps the target; it hurts the other skill);
- sybil_k2: two keys publishing the same backdoor, agreeing with each other.
For each: whether the attacker was included, and per skill the merged model's held-out accuracy (n =
--eval-n, greedy, the fixed eval split) minus the clean merge's, in points. `unscreened` is what the
same attack does when only the old screening runs (file checks and a norm outlier test against the
round's median). Noise: at n = 300 one accuracy's standard error is at most 2.9 points; an attack that is
rejected leaves the merge bit-identical to the clean one (0 points exactly).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.sft: the supervised (and adversarial) training helper

SKILLS = ["arith", "calc", "reverse", "sort"]


def _honest(base: Path, work: Path, steps: int, minutes: float) -> dict[str, Path]:
    """One RL round per skill on the base, as the demo's workers run it."""
    from skillswarm.node.rl.config import TrainConfig
    from skillswarm.node.rl.run import train

    out = {}
    for skill in SKILLS:
        done = work / f"train-{skill}" / "delta.safetensors"
        if done.is_file():  # a kept --work directory: reuse the round
            out[skill] = done
            continue
        cfg = TrainConfig(model_dir=base, skill=skill, steps=steps, out_dir=work / f"train-{skill}", group_size=8,
                          batch=8, threads=1, eval_n=0, eval_every=0, save_every=0, codec="dense_fp32",
                          max_minutes=minutes)
        result = train(cfg, progress=False)
        out[skill] = result.delta.path
        print(f"trained {skill}: {result.stats.steps} steps in {result.stats.seconds:.0f} s", file=sys.stderr)
    return out


def _values(path: Path) -> dict[str, Any]:
    from skillswarm.merge.deltas import read_delta

    with read_delta(path) as f:
        return dict(f.items())


def _write(values: dict[str, Any], path: Path, **meta: str) -> Path:
    from skillswarm.merge.deltas import encode_delta

    return encode_delta(values, path, "dense_fp32", **meta).path


class Drill:
    """The round context and the clean baseline; `run` screens and merges one set of candidates."""

    def __init__(self, base: Path, work: Path, eval_n: int) -> None:
        from skillswarm.node.rl.evaluation import evaluate
        from skillswarm.protocol.hashing import weights_hash
        from skillswarm.protocol.identity import Identity
        from skillswarm.protocol.records import CheckpointManifest, FileEntry, MergePolicy, NetworkSpec

        self.base, self.work, self.eval_n, self.evaluate = base, work, eval_n, evaluate
        self.base_hash = weights_hash(base)
        coordinator = Identity.generate()
        self.spec = NetworkSpec(network="drill", base_model=str(base), base_hash=self.base_hash, skills=SKILLS,
                                coordinators=[coordinator.public_key_hex], codec="dense_fp32",
                                merge=MergePolicy(method="task_arithmetic", scale=0.6))
        self.parent = CheckpointManifest(network="drill", version=0, weights_hash=self.base_hash,
                                         files=[FileEntry(path="config.json", sha256="0" * 64, size=1)])
        self.n = 0
        self.cache: dict[tuple, dict[str, float]] = {}

    def candidate(self, path: Path, skill: str, key: Any = None) -> Any:
        from skillswarm.merge.deltas import read_delta
        from skillswarm.node.rounds import Candidate
        from skillswarm.protocol.hashing import sha256_file
        from skillswarm.protocol.identity import Identity
        from skillswarm.protocol.records import DeltaManifest

        with read_delta(path) as f:
            norm, n = f.norm(), len(f.names())
        manifest = (key or Identity.generate()).sign_record(DeltaManifest(
            network="drill", skill=skill, base_version=0, base_hash=self.base_hash, blob=sha256_file(path),
            size=path.stat().st_size, codec="dense_fp32", norm=norm, num_tensors=n))
        return Candidate(manifest, path=path)

    def run(self, candidates: list[Any], screened: bool = True) -> tuple[list[Any], dict[str, float], dict]:
        """Screen (the default steps, or only the old file checks), merge, evaluate every skill."""
        from skillswarm.node.rounds import RoundContext, RoundStrategy
        from skillswarm.node.rounds.strategy import default_steps
        from skillswarm.protocol.transport.blobs import BlobStore

        steps = [s for s in default_steps() if s.name != "fetch"] if screened else [_OldScreen()]
        ctx = RoundContext(spec=self.spec, parent=self.parent, base_dir=self.base, blobs=BlobStore(self.work / "blobs"),
                           history=[self.parent], eval_seed=1234)
        strategy = RoundStrategy(steps=steps)
        accepted = strategy.screen(ctx, candidates)
        info = {"seconds": dict(ctx.seconds), "rejected": [r.reason for _, r in ctx.rejected]}
        key = (screened, frozenset(c.manifest.blob for c in accepted))
        if key in self.cache:  # the same deltas merge to the same bits: the same accuracies
            return accepted, self.cache[key], info
        self.n += 1
        out = self.work / f"merged-{self.n}"
        strategy.merge(ctx, strategy.groups(accepted), out, self.work / f"merged-{self.n}.delta")
        accuracy = {s: self.evaluate(out, s, n=self.eval_n).accuracy for s in SKILLS}
        shutil.rmtree(out)
        self.cache[key] = accuracy
        return accepted, accuracy, info


class _OldScreen:
    """What screening did before the trust work: file checks and norm <= 5x the round's median."""

    name = "old_screen"

    def __call__(self, ctx: Any, candidates: list[Any]) -> list[Any]:
        from skillswarm.merge.screening import DeltaCandidate, screen_deltas

        r = screen_deltas(ctx.base_dir, [DeltaCandidate(c.path, key=c.manifest.blob, base_hash=c.manifest.base_hash)
                                         for c in candidates],
                          base_hash=ctx.parent.weights_hash, max_norm_ratio=5.0)
        ok = {a.candidate.key for a in r.accepted}
        return [c for c in candidates if c.manifest.blob in ok]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="Base model (default: the nano model, built if needed).")
    ap.add_argument("--steps", type=int, default=50, help="RL steps of each honest worker (the demo's round).")
    ap.add_argument("--minutes", type=float, default=2.0, help="Time cap of each honest round (the demo's).")
    ap.add_argument("--eval-n", type=int, default=300, help="Held-out tasks per skill for the merged accuracies.")
    ap.add_argument("--work", type=Path, default=None, help="Work directory, kept (reuses trained deltas found there).")
    ap.add_argument("--json", action="store_true", help="Print one JSON object.")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from skillswarm.node.rl.evaluation import evaluate
    from skillswarm.skills.nano.build import build_base
    from tests.sft import sft_delta

    t0 = time.monotonic()
    torch.set_num_threads(1)
    base = args.model or build_base()
    work = args.work or Path(tempfile.mkdtemp(prefix="skillswarm-poison-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        honest = _honest(base, work, args.steps, args.minutes)
        drill = Drill(base, work, args.eval_n)
        base_acc = {s: evaluate(base, s, n=args.eval_n).accuracy for s in SKILLS}
        clean_cands = [drill.candidate(p, s) for s, p in honest.items()]
        clean_in, clean, clean_info = drill.run(clean_cands)
        _, old_clean, _ = drill.run([drill.candidate(p, s) for s, p in honest.items()], screened=False)
        specialist = {s: evaluate_with(base, honest[s], s, args.eval_n, work) for s in SKILLS}
        target = max(SKILLS, key=lambda s: specialist[s] - base_acc[s])
        other = max((s for s in SKILLS if s != target), key=lambda s: base_acc[s])  # the most to lose
        t_vals = _values(honest[target])
        g = torch.Generator().manual_seed(0)
        noise = {k: torch.randn(v.shape, generator=g) for k, v in t_vals.items()}
        norm = sum(float((v.double() ** 2).sum()) for v in t_vals.values()) ** 0.5
        noise_norm = sum(float((v.double() ** 2).sum()) for v in noise.values()) ** 0.5
        against = sft_delta(base, other, work / "against.safetensors", steps=30, lr=3e-4, against=True)
        mix = 0.5 * norm / against.norm  # the poison at half the honest delta's norm: it still helps its skill
        backdoor = {k: v + mix * w for (k, v), w in zip(t_vals.items(), _values(against.path).values())}
        attacks = {
            "sign_flip": [{k: -v for k, v in t_vals.items()}],
            "scale_x5": [{k: v * 5 for k, v in t_vals.items()}],
            "scale_x100": [{k: v * 100 for k, v in t_vals.items()}],
            "random_direction": [{k: v * (norm / noise_norm) for k, v in noise.items()}],
            "backdoor": [backdoor],
            "sybil_k2": [backdoor, backdoor],
        }
        results = []
        for name, deltas in attacks.items():
            paths = [_write(d, work / f"{name}-{i}.safetensors") for i, d in enumerate(deltas)]
            if name == "sybil_k2":  # two keys, the same values in two distinct files (other metadata)
                paths[1] = _write(deltas[1], work / "sybil-copy.safetensors", skill=target)
            attackers = [drill.candidate(p, target) for p in paths]
            blobs = {a.manifest.blob for a in attackers}
            accepted, acc, info = drill.run([drill.candidate(p, s) for s, p in honest.items()] + attackers)
            included = any(c.manifest.blob in blobs for c in accepted)
            old_in, old_acc, _ = drill.run([drill.candidate(p, s) for s, p in honest.items()]
                                           + [drill.candidate(p, target) for p in paths], screened=False)
            per_skill = {s: round(100 * (acc[s] - clean[s]), 2) for s in SKILLS}
            results.append({
                "name": name, "included": included, "max_loss_pts": round(max(0.0, -min(per_skill.values())), 2),
                "per_skill": per_skill, "eval_seconds": round(info["seconds"].get("usefulness", 0.0), 1),
                "rejected": info["rejected"],
                "unscreened": {"included": any(c.manifest.blob in blobs for c in old_in),
                               "max_loss_pts": round(max(0.0, -min(100 * (old_acc[s] - old_clean[s]) for s in SKILLS)), 2)},
            })
            print(f"{name}: included={included} max loss {results[-1]['max_loss_pts']} pts "
                  f"(unscreened: {results[-1]['unscreened']})", file=sys.stderr)
        report = {
            "attacks": results,
            "clean": {"accuracy": clean, "included": len(clean_in), "base": base_acc, "specialist": specialist,
                      "unscreened_accuracy": old_clean,
                      "eval_seconds": round(clean_info["seconds"].get("usefulness", 0.0), 1),
                      "rejected": clean_info["rejected"]},
            "target": target, "backdoor_against": other, "eval_n": args.eval_n,
            "seconds": round(time.monotonic() - t0, 1),
        }
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=1, sort_keys=True))
        return
    print(f"clean merge: {report['clean']}")
    for r in report["attacks"]:
        print(f"{r['name']:17s} included={r['included']!s:5s} max loss {r['max_loss_pts']:6.2f} pts  "
              f"unscreened: included={r['unscreened']['included']!s:5s} loss {r['unscreened']['max_loss_pts']:6.2f} pts  "
              f"eval {r['eval_seconds']} s")
    print(f"{report['seconds']:.0f} s in all")


def evaluate_with(base: Path, delta: Path, skill: str, n: int, work: Path) -> float:
    """A specialist's accuracy: base + its delta alone."""
    from skillswarm.merge import apply_delta
    from skillswarm.node.rl.evaluation import evaluate

    out = work / f"specialist-{skill}"
    apply_delta(base, delta, out, progress=False)
    try:
        return evaluate(out, skill, n=n).accuracy
    finally:
        shutil.rmtree(out)


if __name__ == "__main__":
    main()

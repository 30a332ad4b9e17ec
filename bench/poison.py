"""The poisoning drill: the demo's setup (nano model, four skills, one honest RL round per skill with the demo
workers' settings, the network's default merge) with an adversary among the workers, screened by the network's
default round strategy (manifest checks, caps, file checks, consensus, the usefulness test, reputation weights)
and merged under the merge guard.

    .venv/bin/python bench/poison.py [--steps N] [--eval-n 300] [--reputed] [--json]

The network screens as `net init` writes it (saturation and credit rules on). Attacks, each published from fresh
keys (no reputation: weight 0.5, and no credit for an inconclusive delta) or, with --reputed, from keys with a
record (weight 2/3, credit: an inconclusive delta that hurts no skill goes in; every honest key has one too),
against the skill with the largest honest gain (`target`) unless said otherwise:
- sign_flip: -1 x the honest delta;  scale_x5 / scale_x100: the honest delta scaled up;
- random_direction: a random delta with the honest delta's norm;
- backdoor: the honest delta plus a delta trained *against* another skill (gradient ascent on its
  demonstrations, i.e. a reward that punishes the right answer) at half the honest norm, published as
  the target skill (it still helps the target; it hurts the other skill);
- sybil_k2: two keys publishing the same backdoor, agreeing with each other;
- collusion_k3: three keys, each publishing for one of the three skills other than the backdoor's victim that
  skill's honest delta plus a share of the backdoor's poison (`collusion_share`: 1/3, halved until one such delta
  alone costs the victim less than 0.8 x `max_other_drop`): each passes the per-delta tolerance; merged, their
  costs add up, which is what the merge guard is for;
- copycat: two keys claiming the target's honest delta as their own work: the same file re-signed (the same blob),
  and the delta x 0.98 re-encoded (another blob), for the honest worker's weight and credit twice over.
The coordinator sees the honest deltas first (`RoundInputs.first_seen`): every attack but the random direction is made
from them, so it can only be published after them. Attackers are told apart from honest workers by key (a re-signed
copy has the honest blob).
For each: whether the attacker was included (`screened_in`: past the per-delta screening, before the guard), and per skill the merged model's held-out accuracy (n =
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
    """One RL round per skill on the base, as the demo's workers run it (group size, batch, retain)."""
    from skillswarm.node.demo import DemoConfig
    from skillswarm.node.rl.config import TrainConfig, default_of
    from skillswarm.node.rl.run import train

    out = {}
    for skill in SKILLS:
        done = work / f"train-{skill}" / "delta.safetensors"
        if done.is_file():  # a kept --work directory: reuse the round
            out[skill] = done
            continue
        cfg = TrainConfig(model_dir=base, skill=skill, steps=steps, out_dir=work / f"train-{skill}",
                          group_size=default_of(DemoConfig, "group_size"), batch=default_of(DemoConfig, "batch"),
                          retain=default_of(DemoConfig, "retain"), retain_skills=tuple(k for k in SKILLS if k != skill),
                          threads=1, eval_n=0, eval_every=0, save_every=0, codec="dense_fp32", max_minutes=minutes)
        result = train(cfg, progress=False)
        out[skill] = result.delta.path
        print(f"trained {skill}: {result.stats.steps} steps in {result.stats.seconds:.0f} s", file=sys.stderr)
    return out


def _values(path: Path) -> dict[str, Any]:
    from skillswarm.merge.deltas import read_delta

    with read_delta(path) as f:
        return dict(f.items())


def _plus(values: dict[str, Any], poison: dict[str, Any], scale: float) -> dict[str, Any]:
    """`values` + `scale` x `poison`, tensor by tensor (both deltas of the same model)."""
    return {k: v + scale * poison[k] for k, v in values.items()}


def _write(values: dict[str, Any], path: Path, **meta: str) -> Path:
    from skillswarm.merge.deltas import encode_delta

    return encode_delta(values, path, "dense_fp32", **meta).path


class Drill:
    """The round context and the clean baseline; `run` screens and merges one set of candidates."""

    def __init__(self, base: Path, work: Path, eval_n: int, reputed: bool = False) -> None:
        from skillswarm.node.rl.evaluation import evaluate
        from skillswarm.protocol.hashing import weights_hash
        from skillswarm.protocol.identity import Identity
        from skillswarm.protocol.netspec import new_network
        from skillswarm.protocol.records import CheckpointManifest, FileEntry

        self.base, self.work, self.eval_n, self.evaluate = base, work, eval_n, evaluate
        self.base_hash = weights_hash(base)
        coordinator = Identity.generate()
        self.spec = new_network("drill", str(base), self.base_hash, SKILLS, [coordinator.public_key_hex],
                                codec="dense_fp32")  # the policies as `net init` writes them
        self.reputed = reputed  # every key comes with a record (one earned inclusion): credit applies to all
        self.parent = CheckpointManifest(network="drill", version=0, weights_hash=self.base_hash,
                                         files=[FileEntry(path="config.json", sha256="0" * 64, size=1)])
        self.n = 0
        self.cache: dict[tuple, dict[str, float]] = {}

    def candidate(self, path: Path, skill: str, key: Any = None) -> Any:
        from skillswarm.merge.deltas import read_delta
        from skillswarm.node.roles.rounds import Candidate
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
        """Screen (the default steps, or only the old file checks), merge (under the guard when screened), evaluate
        every skill; the coordinator saw `candidates` in their order, one second apart. info["screened_in"] holds the
        keys of the candidates past the screening steps, before the guard."""
        from skillswarm.node.roles.rounds import RoundInputs, RoundStrategy
        from skillswarm.node.roles.rounds.guard import MergeGuard
        from skillswarm.node.roles.rounds.strategy import default_steps
        from skillswarm.protocol.transport.blobs import BlobStore

        steps = [s for s in default_steps() if s.name != "fetch"] if screened else [_OldScreen()]
        inputs = RoundInputs(spec=self.spec, parent=self.parent, base_dir=self.base,
                             blobs=BlobStore(self.work / "blobs"), history=[self.parent, *self._records(candidates)],
                             eval_seed=1234,
                             first_seen={(c.author, c.manifest.blob): float(i) for i, c in enumerate(candidates)})
        # the unscreened round is the merge before any of this: no guard, and the network's lambda
        strategy = RoundStrategy(steps=steps, guard=MergeGuard() if screened else None,
                                 **({} if screened else {"search": None}))
        passed = strategy.screen(inputs, candidates)
        self.n += 1
        out = self.work / f"merged-{self.n}"
        shutil.rmtree(out, ignore_errors=True)  # a kept --work directory may hold an interrupted drill's merge
        _, state = strategy.merge_guarded(inputs, passed, out, self.work / f"merged-{self.n}.delta")
        accepted = list(state.candidates)
        info = {"seconds": dict(state.seconds), "rejected": [r.rejection.reason for r in state.rejected],
                "screened_in": {c.author for c in passed.candidates}}
        key = (screened, tuple(sorted((c.manifest.blob, c.weight) for c in accepted)))
        if key not in self.cache:  # the same deltas merge to the same bits: the same accuracies
            self.cache[key] = {s: self.evaluate(out, s, n=self.eval_n).accuracy for s in SKILLS} if accepted else \
                {s: self.evaluate(self.base, s, n=self.eval_n).accuracy for s in SKILLS}
        shutil.rmtree(out, ignore_errors=True)
        return accepted, self.cache[key], info


    def _records(self, candidates: list[Any]) -> list[Any]:
        """With --reputed, an earlier checkpoint in which every candidate's key had a delta merged (for a skill
        outside the network, so no skill's norm history or consensus reads it): each key has a record."""
        from skillswarm.protocol.records import CheckpointManifest, DeltaRef

        if not self.reputed:
            return []
        refs = [DeltaRef(blob=f"{i:064x}", author=c.author, skill="earlier") for i, c in enumerate(candidates)]
        return [CheckpointManifest(network="drill", version=0, weights_hash=self.base_hash, files=self.parent.files,
                                   included=refs)]


class _OldScreen:
    """What screening did before the trust work: file checks and norm <= 5x the round's median."""

    name = "old_screen"

    def __call__(self, inputs: Any, state: Any) -> Any:
        from skillswarm.merge.screening import DeltaCandidate, screen_deltas
        from skillswarm.node.roles.rounds import Verdict

        candidates = state.candidates
        r = screen_deltas(inputs.base_dir, [DeltaCandidate(c.path, key=c.manifest.blob, base_hash=c.manifest.base_hash)
                                            for c in candidates],
                          base_hash=inputs.parent.weights_hash, max_norm_ratio=5.0)
        ok = {a.candidate.key for a in r.accepted}
        return Verdict(tuple(c for c in candidates if c.manifest.blob in ok))


def main() -> None:
    from skillswarm.node.demo import DemoConfig
    from skillswarm.node.rl.config import EVAL_N, default_of

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="Base model (default: the nano model, built if needed).")
    ap.add_argument("--steps", type=int, default=default_of(DemoConfig, "steps_per_round"),
                    help="RL steps of each honest worker (default: the demo's round).")
    ap.add_argument("--minutes", type=float, default=default_of(DemoConfig, "minutes_per_round"),
                    help="Time cap of each honest round (default: the demo's).")
    ap.add_argument("--eval-n", type=int, default=EVAL_N, help="Held-out tasks per skill for the merged accuracies.")
    ap.add_argument("--reputed", action="store_true",
                    help="Every key, honest or hostile, has a record (an earlier inclusion), so the network's credit "
                         "rule applies to the attackers too: a proven key turned hostile.")
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
        drill = Drill(base, work, args.eval_n, args.reputed)
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
        poison = _values(against.path)
        backdoor = _plus(t_vals, poison, mix)
        attacks = {
            "sign_flip": [{k: -v for k, v in t_vals.items()}],
            "scale_x5": [{k: v * 5 for k, v in t_vals.items()}],
            "scale_x100": [{k: v * 100 for k, v in t_vals.items()}],
            "random_direction": [{k: v * (norm / noise_norm) for k, v in noise.items()}],
            "backdoor": [backdoor],
            "sybil_k2": [backdoor, backdoor],
        }
        # three keys, three skills (not the backdoor's victim), each its honest delta plus a share of the poison
        # small enough that one alone costs the victim under the network's tolerance
        colluders = [s for s in SKILLS if s != other]
        share = _share_under_tolerance(base, work, honest[colluders[0]], poison, mix, other, base_acc[other],
                                       drill.spec.screen.max_other_drop, args.eval_n)
        attacks["collusion_k3"] = [_plus(_values(honest[s]), poison, share * mix) for s in colluders]
        attacks["copycat"] = [None, {k: v * 0.98 for k, v in t_vals.items()}]  # None: the honest file, re-signed
        results = []
        for name, deltas in attacks.items():
            skills = colluders if name == "collusion_k3" else [target] * len(deltas)
            paths = [honest[k] if d is None else _write(d, work / f"{name}-{i}.safetensors", skill=k)
                     for i, (d, k) in enumerate(zip(deltas, skills))]
            if name == "sybil_k2":  # two keys, the same values in two distinct files (other metadata)
                paths[1] = _write(deltas[1], work / "sybil-copy.safetensors", skill=target, base_hash=drill.base_hash)
            attackers = [drill.candidate(p, k) for p, k in zip(paths, skills)]
            keys = {a.author for a in attackers}
            accepted, acc, info = drill.run([drill.candidate(p, s) for s, p in honest.items()] + attackers)
            included = any(c.author in keys for c in accepted)
            old_attackers = [drill.candidate(p, k) for p, k in zip(paths, skills)]
            old_in, old_acc, _ = drill.run([drill.candidate(p, s) for s, p in honest.items()] + old_attackers,
                                           screened=False)
            old_keys = {a.author for a in old_attackers}
            per_skill = {s: round(100 * (acc[s] - clean[s]), 2) for s in SKILLS}
            results.append({
                "name": name, "included": included, "screened_in": len(keys & info["screened_in"]),
                "attackers": len(keys), "max_loss_pts": round(max(0.0, -min(per_skill.values())), 2),
                "per_skill": per_skill, "eval_seconds": round(info["seconds"].get("usefulness", 0.0), 1),
                "guard_seconds": round(info["seconds"].get("guard", 0.0), 1),
                "lambda_seconds": round(info["seconds"].get("lambda", 0.0), 1),  # the search's merges and evaluations
                "rejected": info["rejected"],
                "unscreened": {"included": any(c.author in old_keys for c in old_in),
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
            "target": target, "backdoor_against": other, "eval_n": args.eval_n, "collusion_share": share,
            "seconds": round(time.monotonic() - t0, 1), "reputed": args.reputed,
        }
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=1, sort_keys=True))
        return
    print(f"clean merge: {report['clean']}")
    for r in report["attacks"]:
        print(f"{r['name']:17s} included={r['included']!s:5s} (past screening {r['screened_in']}/{r['attackers']}) "
              f"max loss {r['max_loss_pts']:6.2f} pts  "
              f"unscreened: included={r['unscreened']['included']!s:5s} loss {r['unscreened']['max_loss_pts']:6.2f} pts  "
              f"eval {r['eval_seconds']} s, lambda search {r['lambda_seconds']} s, guard {r['guard_seconds']} s")
    print(f"{report['seconds']:.0f} s in all")


def _share_under_tolerance(base: Path, work: Path, honest: Path, poison: dict[str, Any], mix: float, victim: str,
                           victim_base: float, tolerance: float, n: int) -> float:
    """The largest share of the poison (1/3, halved up to 6 times) with which `honest` plus it costs `victim` less
    than 0.8 x `tolerance` alone."""
    share = 1 / 3
    for _ in range(6):
        probe = _write(_plus(_values(honest), poison, share * mix), work / "collusion-probe.safetensors")
        cost = victim_base - evaluate_with(base, probe, victim, n, work)
        print(f"collusion share {share:.4f}: one delta alone costs {victim} {100 * cost:.1f} points", file=sys.stderr)
        if cost < 0.8 * tolerance:
            break
        share /= 2
    return share


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

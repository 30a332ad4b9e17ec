"""Screening a fetched delta's file: is it what its manifest says, is it sane, does it point the way the
skill's trusted contributors point.

`Inspect` runs the merge package's structural screening (format, base, names, shapes, dtypes, finite
values), checks the measured norm against the manifest's claim, and bounds it against the norms of the
skill's recent included deltas. Never against this round's own deltas: their median is the attacker's to
move (one x100 delta makes an honest one look tiny; two tiny sybils make it look huge), so a skill with
no history yet has no norm bound and the usefulness test decides. `Consensus` rejects a delta
whose direction disagrees with the consensus of the skill's other deltas (cosine below `min_cosine`),
where the consensus counts only keys with a record (reputation above a fresh key's): k fresh sybil keys
that agree with each other have no say in it, so they cannot vote an honest delta out. Nor can one key with a
record: a delta is voted out only by a majority, the others' say summed above its own key's, so a proven key
turned hostile (a sign flip, a random direction) cannot take out an honest delta of equal standing; the
usefulness test judges the two (bench/poison.py --reputed).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from skillswarm.merge.screening import DeltaCandidate, consensus_cosines, norm_outlier, screen_deltas
from skillswarm.node.rounds.admission import skill_norm_history
from skillswarm.node.rounds.context import Candidate, RoundContext
from skillswarm.node.rounds.reputation import reputation_of, reputations

CLAIM_TOLERANCE = 1e-3  # relative difference allowed between a manifest's norm and the file's


@dataclass
class Inspect:
    """Structure, finiteness, the norm claim, and norm bounds (see the module docstring)."""

    name: str = "inspect"

    def __call__(self, ctx: RoundContext, candidates: list[Candidate]) -> list[Candidate]:
        spec, parent = ctx.spec, ctx.parent
        screened = screen_deltas(ctx.base_dir, [DeltaCandidate(c.path, key=c.manifest.blob, skill=c.skill,
                                                               base_hash=c.manifest.base_hash) for c in candidates],
                                 base_hash=parent.weights_hash, max_norm_ratio=None)
        by_blob = {c.manifest.blob: c for c in candidates}
        for r in screened.rejected:
            ctx.reject(by_blob[r.candidate.key], self.name, r.reason)
        passed = []
        for a in screened.accepted:
            c = by_blob[a.candidate.key]
            c.norm = a.norm
            c.figures["norm"] = a.norm
            claimed = c.manifest.norm
            if abs(claimed - a.norm) > CLAIM_TOLERANCE * max(a.norm, 1e-12):
                ctx.reject(c, self.name, f"its manifest claims norm {claimed:.6g}, the file's is {a.norm:.6g}")
            elif c.manifest.codec not in (spec.codec, "lora"):  # a LoRA worker's adapter is its exact delta
                ctx.reject(c, self.name, f"encoded with {c.manifest.codec}; the network's codec is {spec.codec}")
            else:
                passed.append(c)
        out = []
        for c in passed:
            history = skill_norm_history(ctx.history, c.skill, spec.screen.history_rounds)
            why = norm_outlier(c.norm or 0.0, history, spec.screen.min_norm_ratio, spec.merge.max_norm_ratio)
            if why is None:
                out.append(c)
            else:
                ctx.reject(c, self.name, why, {**c.figures, "history_median": statistics.median(history)})
        return out


@dataclass
class Consensus:
    """Direction against the skill's reputable consensus (see the module docstring)."""

    name: str = "consensus"

    def __call__(self, ctx: RoundContext, candidates: list[Candidate]) -> list[Candidate]:
        table = reputations(ctx.history, ctx.spec.trust.reputation_rounds)
        out = []
        for skill in sorted({c.skill for c in candidates}):
            group = [c for c in candidates if c.skill == skill]
            say = [reputation_of(table, c.author).say for c in group]
            cosines = consensus_cosines(ctx.base_dir, [c.path for c in group], say) if len(group) > 1 else [None]
            for c, cos, own in zip(group, cosines, say):
                if cos is not None:
                    c.figures["cosine"] = cos
                outvoted = sum(say) - own > own  # the others carry more say than its own key
                if cos is not None and cos < ctx.spec.screen.min_cosine and outvoted:
                    ctx.reject(c, self.name, f"its direction disagrees with the skill's consensus of reputable keys "
                                             f"(cosine {cos:.3f} < {ctx.spec.screen.min_cosine:g})")
                else:
                    out.append(c)
        return sorted(out, key=lambda c: c.manifest.blob)

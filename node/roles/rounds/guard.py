"""The merge guard: a merged checkpoint must leave no skill significantly worse than its parent.

The usefulness test judges each delta alone and tolerates a cost to other skills of up to `max_other_drop` per
delta. Deltas that each stay under it can still cost a skill far more together: honest ones through
interference, hostile ones by design (several keys, each just under the tolerance). So once the merge is
written, the guard plays the merged model on the usefulness test's first-look tasks (the same seeded list, paired
with the parent's recorded scores) and tests every skill with a one-sided sign test at the network's confidence
shared among the skills (Bonferroni: when the merge changes nothing, at most 1 - confidence of rounds are stopped
in error). When a skill is worse, the accepted delta that cost it the most alone (the usefulness test's figures)
is taken out and the rest merged again.
A saturated skill's deltas sit out the round (usefulness.py) and cannot help it; when the merge leaves that very
skill worse (in the demo, sort's deltas cost reverse at 98-99% 6-9 tasks of 300 in 5 of 6 runs, and were taken out),
its deltas held in reserve are judged like any other delta first, and those that pass are merged in before anything
is taken out. Each pass takes one delta out or brings one skill's reserve in, once: a round merges at most once per
delta and once per saturated skill. A network with `repair_layers` has no reserve: its saturated skills' deltas were
judged, and merged, as repairs of the first layers (usefulness.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from skillswarm.node.roles.rounds.paired import Paired
from skillswarm.node.roles.rounds.reputation import Weigh
from skillswarm.node.roles.rounds.state import Candidate, Evidence, GuardVerdict, RoundInputs, RoundState, reject
from skillswarm.node.roles.rounds.usefulness import Usefulness

log = logging.getLogger(__name__)


def worst_regression(merged: dict[str, Paired], level: float) -> tuple[str, Paired] | None:
    """The skill the merged model is significantly worse at (more tasks lost than won, p <= `level`), the one with
    the largest accuracy drop first; None when there is none."""
    worse = [(s, p) for s, p in merged.items() if p.losses > p.wins and p.p_worse <= level]
    return min(worse, key=lambda sp: (sp[1].gain, sp[1].p_worse, sp[0]), default=None)


def costliest(accepted: Sequence[Candidate], measured: Mapping[str, Mapping[str, Paired]], skill: str) -> Candidate:
    """The accepted delta that cost `skill` the most when measured alone: another skill's when there is one (the
    skill's own deltas each improved it), a delta measured without figures counting as no change."""
    others = [c for c in accepted if c.skill != skill] or list(accepted)

    def alone(c: Candidate) -> float:
        p = measured.get(c.manifest.blob, {}).get(skill)
        return p.gain if p is not None else 0.0

    return min(others, key=lambda c: (alone(c), c.manifest.blob))


def from_reserve(inputs: RoundInputs, state: RoundState, skill: str) -> tuple[tuple[Candidate, ...], Evidence]:
    """`skill`'s deltas held in reserve for saturation that pass the usefulness test with saturation set aside
    (shown gain, or credit: from a key with a record, no other skill hurt beyond the tolerance, with no floor on the
    tasks it changes, since repairing the skill is the gain), weighed by reputation, and what the test measured. One
    that does not pass stays out for saturation, as first recorded (this test's rejections are not kept)."""
    reserve = state.reserve.get(skill, ())
    if not reserve:
        return (), Evidence()
    judged = Usefulness(reserve=True)(inputs, state.but(candidates=reserve))
    back = Weigh()(inputs, RoundState(judged.passed))  # saturation kept them from the round's weighing
    return back.passed, Evidence(measured=judged.evidence.measured)


@dataclass
class MergeGuard:
    """Tests the merged model against its parent on every skill; takes out the costliest delta when one is worse."""

    name: str = "guard"

    def __call__(self, inputs: RoundInputs, state: RoundState, merged_dir: Path) -> GuardVerdict:
        """The merge in `merged_dir` of `state.candidates` stands when it leaves no skill significantly worse than the
        parent; else the worst-off skill's reserve (`from_reserve`) comes in when any of it passes, or the delta that
        cost that skill the most goes out, rejected with the figures."""
        accepted = state.candidates
        policy = inputs.spec.screen
        if policy.eval_n == 0 or not accepted:
            return GuardVerdict(accepted)
        t0 = time.monotonic()
        skills = list(inputs.spec.skills)
        # the parent's first look: the usefulness test's, or measured now when no usefulness test ran
        fresh = {} if all(s in state.parent_scores for s in skills) else inputs.first_look(inputs.base_dir)
        parent = {**state.parent_scores, **fresh}
        after = state.merged_scores or inputs.first_look(merged_dir)  # the lambda search's measurement of this merge
        merged = {s: Paired.compare(parent[s], after[s]) for s in skills}
        seconds = time.monotonic() - t0
        alpha = 1.0 - policy.confidence
        found = worst_regression(merged, alpha / len(skills))
        if found is None:
            log.info("round v%d: the merge of %d delta(s) leaves no skill worse (%s)", inputs.parent.version,
                     len(accepted), ", ".join(f"{s} {p.gain:+.1%}" for s, p in merged.items()))
            return GuardVerdict(accepted, evidence=Evidence(parent_scores=fresh), seconds=seconds)
        skill, p = found
        if skill in state.reserve:
            back, judged = from_reserve(inputs, state.but(parent_scores=parent), skill)
            if back:
                log.info("round v%d: the merge leaves %s worse than the parent (%d tasks worse, %d better of %d): its "
                         "delta(s) held in reserve for saturation are judged and merged in: %s", inputs.parent.version,
                         skill, p.losses, p.wins, p.n, ", ".join(c.manifest.blob[:12] for c in back))
                return GuardVerdict((*accepted, *back), restored=back, released=skill,
                                    evidence=Evidence(parent_scores=fresh, measured=judged.measured), seconds=seconds)
        else:
            judged = Evidence()
        culprit = costliest(accepted, {**state.measured, **judged.measured}, skill)
        alone = {**state.measured, **judged.measured}.get(culprit.manifest.blob, {}).get(skill)
        alone_text = f"alone it changed {skill} by {alone.gain:+.1%}" if alone else "it was not measured alone"
        figures = {"merged_gain": p.gain, "p_worse": p.p_worse, "deltas": float(len(accepted)),
                   **({"alone_gain": alone.gain} if alone else {}),
                   **{k: v for k, v in culprit.figures.items() if k in ("gain", "p_better")}}
        out = reject(inputs, culprit, self.name,
                     f"the merge with it leaves {skill} worse than the parent: {p.losses} tasks worse, {p.wins} better "
                     f"of {p.n} (accuracy {p.accuracy_before:.1%} -> {p.accuracy_after:.1%}, p={p.p_worse:.3g}); "
                     f"{alone_text}, the most of the {len(accepted)} merged", figures,
                     harmful=alone is not None and alone.gain < 0 and alone.p_worse <= alpha)
        return GuardVerdict(tuple(c for c in accepted if c is not culprit), (out,),
                            released=skill if skill in state.reserve else None,
                            evidence=Evidence(parent_scores=fresh, measured=judged.measured), seconds=seconds)

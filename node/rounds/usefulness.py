"""The usefulness test: a delta enters a merge only if it measurably helps its own skill and does not
cost any other skill more than the network tolerates.

The coordinator evaluates the parent and each candidate (parent + delta) greedily on the same `eval_n`
held-out tasks per skill, drawn from the skill's fixed eval split with a seed it picks at screening time,
after every delta was published (recorded in the manifest as `eval_seed`), so no one could tune a delta
to the exact tasks. Comparisons are paired, task by task, with a one-sided sign test on the rewards:
- own skill: the delta must win more tasks than it loses, with p <= 1 - confidence under "no better";
- every other skill: rejected when it loses significantly (same confidence) *and* its accuracy drops by
  more than `max_other_drop`.
Evaluation figures are this coordinator's measurement on its hardware; they decide inclusion and are
published, but only the merge of what was included is bit-reproducible by others.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from skillswarm.node.rounds.context import Candidate, RoundContext


def sign_test_p(wins: int, losses: int) -> float:
    """One-sided exact sign test: P(at least `wins` successes of wins + losses fair coin flips)."""
    n = wins + losses
    if n == 0:
        return 1.0
    return math.fsum(math.comb(n, k) for k in range(wins, n + 1)) / 2.0 ** n


@dataclass(frozen=True)
class Paired:
    """A skill's tasks scored on the parent and on a candidate."""

    wins: int  # tasks where the candidate's reward is higher
    losses: int
    n: int
    accuracy_before: float
    accuracy_after: float

    @classmethod
    def compare(cls, before: list[tuple[float, bool]], after: list[tuple[float, bool]]) -> "Paired":
        """Pair per-task (reward, correct) lists of the same tasks."""
        wins = sum(a[0] > b[0] for a, b in zip(after, before))
        losses = sum(a[0] < b[0] for a, b in zip(after, before))
        n = len(before)
        return cls(wins, losses, n, sum(b[1] for b in before) / n, sum(a[1] for a in after) / n)

    @property
    def gain(self) -> float:
        """Accuracy after minus before."""
        return self.accuracy_after - self.accuracy_before

    @property
    def p_better(self) -> float:
        """p-value of "no better" (small: it is better)."""
        return sign_test_p(self.wins, self.losses)

    @property
    def p_worse(self) -> float:
        """p-value of "no worse" (small: it is worse)."""
        return sign_test_p(self.losses, self.wins)


def _scores(engine, skill: str, n: int, seed: int) -> list[tuple[float, bool]]:
    from skillswarm.node.rl.evaluation import evaluate

    result = evaluate(engine, skill, n=n, task_seed=seed)
    return [(r.reward, bool(r.episode.correct)) for r in result.rollouts]


@dataclass
class Usefulness:
    """Paired held-out evaluation of each candidate (see the module docstring)."""

    name: str = "usefulness"

    def __call__(self, ctx: RoundContext, candidates: list[Candidate]) -> list[Candidate]:
        policy = ctx.spec.screen
        if policy.eval_n == 0 or not candidates:
            return candidates
        import torch

        from skillswarm.merge.deltas import DeltaFile
        from skillswarm.node.rl.engines.hf import HFEngine

        alpha = 1.0 - policy.confidence
        engine = HFEngine.load(ctx.base_dir)
        parent = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        skills = list(ctx.spec.skills)
        before = {s: _scores(engine, s, policy.eval_n, ctx.eval_seed) for s in skills}
        out = []
        for c in candidates:
            t0 = time.monotonic()
            with DeltaFile(c.path) as f, torch.no_grad():
                changed = {n: parent[n] + f.get(n).to(parent[n].dtype) for n in f.names() if n in parent}
            engine.load_state_dict(changed, 0)
            try:
                after = {s: Paired.compare(before[s], _scores(engine, s, policy.eval_n, ctx.eval_seed)) for s in skills}
            finally:
                engine.load_state_dict({n: parent[n] for n in changed}, 0)
            own = after[c.skill]
            c.figures.update({"gain": own.gain, "p_better": own.p_better, "eval_s": time.monotonic() - t0})
            others = [(s, p) for s, p in after.items() if s != c.skill]
            worst = min(others, key=lambda sp: sp[1].gain, default=None)
            if worst is not None:
                c.figures.update({"worst_other_gain": worst[1].gain, "p_worse": worst[1].p_worse})
            hurt = [(s, p) for s, p in others if -p.gain > policy.max_other_drop and p.p_worse <= alpha]
            if not (own.wins > own.losses and own.p_better <= alpha):
                ctx.reject(c, self.name, f"it does not improve {c.skill} with {policy.confidence:.0%} confidence: "
                                         f"{own.wins} tasks better, {own.losses} worse of {own.n} "
                                         f"(accuracy {own.accuracy_before:.1%} -> {own.accuracy_after:.1%}, "
                                         f"p={own.p_better:.3g})", harmful=own.p_worse <= alpha or bool(hurt))
            elif hurt:
                s, p = min(hurt, key=lambda sp: sp[1].gain)
                ctx.reject(c, self.name, f"it costs {s} {-p.gain:.1%} of accuracy ({p.accuracy_before:.1%} -> "
                                         f"{p.accuracy_after:.1%}, p={p.p_worse:.3g}); the network tolerates "
                                         f"{policy.max_other_drop:.1%}")
            else:
                out.append(c)
        return out

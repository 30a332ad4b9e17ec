"""Paired comparisons of two models on the same tasks: a one-sided sign test, and Pocock's level for two looks.
The usefulness test pairs each candidate with its parent; the merge guard pairs the merged model with it."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

Scores = list[tuple[float, bool]]  # (reward, correct) per task, in the seeded list's order


def _normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


@functools.lru_cache(maxsize=16)
def pocock_level(alpha: float, looks: int = 2) -> float:
    """The nominal one-sided level of each of two equally spaced looks at the data whose overall chance of a
    false positive is `alpha` (Pocock's boundary: the statistics of the looks correlate by sqrt(1/2))."""
    if looks == 1:
        return alpha
    if looks != 2:
        raise ValueError("pocock_level handles one or two looks")
    rho = math.sqrt(0.5)

    def both_below(c: float, steps: int = 2000) -> float:  # P(Z1 <= c and Z2 <= c), Simpson's rule over z1
        lo, h = -9.0, (c + 9.0) / steps
        f = lambda z: math.exp(-z * z / 2) / math.sqrt(2 * math.pi) * _normal_cdf((c - rho * z) / math.sqrt(1 - rho**2))  # noqa: E731
        return h / 3 * sum((1 if i in (0, steps) else 4 if i % 2 else 2) * f(lo + i * h) for i in range(steps + 1))

    low, high = 0.0, 6.0
    for _ in range(60):  # bisection on the boundary c
        mid = (low + high) / 2
        low, high = (mid, high) if 1.0 - both_below(mid) > alpha else (low, mid)
    return 1.0 - _normal_cdf(high)


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

    def __add__(self, other: "Paired") -> "Paired":
        """Both looks' tasks together."""
        n = self.n + other.n
        return Paired(self.wins + other.wins, self.losses + other.losses, n,
                      (self.accuracy_before * self.n + other.accuracy_before * other.n) / n,
                      (self.accuracy_after * self.n + other.accuracy_after * other.n) / n)

    @classmethod
    def compare(cls, before: Scores, after: Scores) -> "Paired":
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


def scores(engine: Any, skill: str, n: int, seed: int, look: int = 0) -> Scores:
    """(reward, correct) per task of look `look` (0, 1): the `n` tasks after the first `look * n` of the list."""
    from skillswarm.node.rl.evaluation import evaluate

    result = evaluate(engine, skill, n=n, task_seed=seed, offset=look * n)
    return [(r.reward, bool(r.episode.correct)) for r in result.rollouts]

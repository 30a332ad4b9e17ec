"""How much of a specialist's gain a merged model keeps, and how sure one run's figure is.

retention = (merged - base) / (specialist - base), each an accuracy on the same held-out tasks. At a few
hundred tasks and a gain of 15-25 points its sampling error is large (one task in 300 moves a 20-point gain's
retention by 1.7%), so the demo also reports a paired bootstrap interval: the tasks are resampled together
for the three models, which keeps what they have in common out of the interval.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

LEVEL = 0.9  # the interval's coverage
RESAMPLES = 2000


def retention(base: float | None, specialist: float | None, merged: float | None) -> float | None:
    """The share of the specialist's gain the merged model keeps; None without a gain to keep."""
    if base is None or specialist is None or merged is None or specialist <= base:
        return None
    return round((merged - base) / (specialist - base), 4)


def retention_interval(base: Sequence[bool], specialist: Sequence[bool], merged: Sequence[bool], level: float = LEVEL,
                       resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float] | None:
    """A paired percentile-bootstrap interval of retention from per-task correctness of the three models on the
    same tasks; None when the specialist gains nothing, or when a tenth of the resamples show no gain."""
    n = len(base)
    if n == 0 or not len(specialist) == len(merged) == n:
        raise ValueError("retention_interval needs the same tasks, at least one, scored for all three models")
    scores = torch.tensor([list(base), list(specialist), list(merged)], dtype=torch.float64)  # 3 x n
    if scores[1].mean() <= scores[0].mean():
        return None
    gen = torch.Generator().manual_seed(seed)
    means = scores[:, torch.randint(n, (resamples, n), generator=gen)].mean(-1)  # 3 x resamples
    gain = means[1] - means[0]
    ok = gain > 0
    if ok.sum() < 0.9 * resamples:
        return None
    values = ((means[2] - means[0])[ok] / gain[ok]).sort().values
    lo, hi = values[int((1 - level) / 2 * (len(values) - 1))], values[int((1 + level) / 2 * (len(values) - 1))]
    return round(lo.item(), 4), round(hi.item(), 4)


def correct_per_task(model: Any, skill: str, n: int) -> list[bool]:
    """Greedy correctness of `model` (a directory or an engine) on each of the first `n` held-out tasks of `skill`."""
    from skillswarm.node.rl.evaluation import evaluate

    return [bool(r.episode.correct) for r in evaluate(model, skill, n=n).rollouts]


def retention_intervals(base: Path, specialists: dict[str, Path], merged: Path, n: int,
                        level: float = LEVEL) -> dict[str, tuple[float, float] | None]:
    """Per skill, the interval of its retention, from base, specialist and merged model re-measured task by task."""
    from skillswarm.node.rl.engines.hf import HFEngine

    base_engine, merged_engine = HFEngine.load(base), HFEngine.load(merged)  # loaded once for every skill
    return {skill: retention_interval(*(correct_per_task(m, skill, n) for m in (base_engine, specialist, merged_engine)),
                                      level=level)
            for skill, specialist in specialists.items()}

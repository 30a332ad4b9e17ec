"""How much of a specialist's gain a merged model keeps, and how sure one run's figure is.

retention = (merged - base) / (specialist - base), each an accuracy on the same held-out tasks. At a few
hundred tasks and a gain of 15-25 points its sampling error is large (one task in 300 moves a 20-point gain's
retention by 1.7%), so the demo also reports a paired bootstrap interval: the tasks are resampled together
for the three models, which keeps what they have in common out of the interval. The demo re-measures the
three models on RETENTION_N tasks for that reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

LEVEL = 0.9  # the interval's coverage
RESAMPLES = 2000
# Held-out tasks per skill of the demo's re-measure. At 300 the demo runs' (docs/demo.md) 90% intervals of a 20-point gain's
# retention were 12-20 points wide, so an honest 95% often read below 90%; 1000 narrows them by sqrt(1000/300) = 1.8x
# and re-measuring three models on four skills took about 40 s on 2 cores.
RETENTION_N = 1000


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


# Per-task results already played, by (model directory, skill, n): the demo's re-measure and its round-by-round
# comparison share the final checkpoint and, in a one-round run, the specialist; each is played once.
Solved = dict[tuple[Path, str, int], list[bool]]


def _played(solved: Solved | None, path: Path, skill: str, n: int, load: Callable[[], Any]) -> list[bool]:
    """The per-task results on `skill` of the model in `path`, from `solved` when it holds them; else played now on
    `load()` (an engine or a directory) and kept there."""
    key = (path, skill, n)
    if solved is not None and key in solved:
        return solved[key]
    result = correct_per_task(load(), skill, n)
    if solved is not None:
        solved[key] = result
    return result


@dataclass(frozen=True)
class Remeasured:
    """One skill's base, specialist and merged accuracy on the same `n` held-out tasks, with the retention and its
    interval (None where the specialist gained nothing)."""

    n: int
    base: float
    specialist: float
    merged: float
    retention: float | None
    interval: tuple[float, float] | None


def remeasure(base: Path, specialists: dict[str, Path], merged: Path, n: int,
              level: float = LEVEL, solved: Solved | None = None) -> dict[str, Remeasured]:
    """Per skill, base, specialist and merged model re-measured task by task on the first `n` held-out tasks (the
    per-task results go into `solved` when given)."""
    from skillswarm.node.rl.engines.hf import HFEngine

    base_engine, merged_engine = HFEngine.load(base), HFEngine.load(merged)  # loaded once for every skill
    out = {}
    for skill, specialist in specialists.items():
        b, s, m = (_played(solved, path, skill, n, lambda model=model: model) for path, model in
                   ((base, base_engine), (specialist, specialist), (merged, merged_engine)))
        acc = [sum(x) / n for x in (b, s, m)]
        out[skill] = Remeasured(n, *acc, retention(*acc), retention_interval(b, s, m, level=level))
    return out


# A merged model counts as "at or above" a specialist unless the tasks it loses to it outnumber those it wins at
# p <= this (one-sided exact sign test): at 98-99% accuracy two equal models differ by a few tasks either way.
AT_OR_ABOVE_P = 0.05


@dataclass(frozen=True)
class Versus:
    """A merged checkpoint against a skill's specialist, task by task on the same `n` held-out tasks."""

    version: int
    merged: float
    specialist: float
    wins: int  # tasks the merged model solves and the specialist does not
    losses: int  # tasks the specialist solves and the merged model does not
    p_worse: float  # one-sided sign test that the merged model is the worse one

    @property
    def at_or_above(self) -> bool:
        """Not significantly below the specialist (see AT_OR_ABOVE_P)."""
        return self.p_worse > AT_OR_ABOVE_P


def versus_specialists(checkpoints: dict[int, Path], specialists: dict[str, Path], n: int,
                       solved: Solved | None = None) -> dict[str, list[Versus]]:
    """Per skill, every merged checkpoint (version -> directory) against that skill's specialist on the first `n`
    held-out tasks: whether the swarm's rounds add up to more than one specialist's round. Models whose results
    `solved` holds are not played again."""
    import functools

    from skillswarm.node.rl.engines.hf import HFEngine
    from skillswarm.node.roles.rounds.paired import sign_test_p

    first = {skill: _played(solved, path, skill, n, lambda path=path: path) for skill, path in specialists.items()}
    out: dict[str, list[Versus]] = {skill: [] for skill in specialists}
    for version, path in sorted(checkpoints.items()):
        engine = functools.cache(lambda path=path: HFEngine.load(path))  # loaded once, and only if played
        for skill, s in first.items():
            m = _played(solved, path, skill, n, engine)
            wins = sum(a and not b for a, b in zip(m, s))
            losses = sum(b and not a for a, b in zip(m, s))
            out[skill].append(Versus(version, sum(m) / n, sum(s) / n, wins, losses, sign_test_p(losses, wins)))
    return out

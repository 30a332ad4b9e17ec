"""Retention and its paired bootstrap interval, on per-task correctness vectors."""

from __future__ import annotations

import pytest

from skillswarm.node.demo.retention import retention, retention_interval


def test_retention_is_the_share_of_the_gain_kept() -> None:
    assert retention(0.2, 0.6, 0.5) == 0.75
    assert retention(0.2, 0.6, 0.7) == 1.25  # the merge can beat the specialist
    assert retention(0.2, 0.2, 0.5) is None and retention(0.3, 0.2, 0.5) is None  # no gain to keep
    assert retention(None, 0.6, 0.5) is None


def test_the_interval_is_exact_when_the_models_agree_and_shrinks_with_more_tasks() -> None:
    base = [False] * 60 + [True] * 40
    better = [True] * 30 + [False] * 30 + [True] * 40  # +30 points
    assert retention_interval(base, better, better) == (1.0, 1.0)  # merged = specialist on every task
    assert retention_interval(base, better, base) == (0.0, 0.0)  # merged = base on every task
    assert retention_interval(base, base, better) is None  # the specialist gained nothing
    half = [True] * 15 + [False] * 45 + [True] * 40  # keeps the first half of the gain: retention 0.5
    lo, hi = retention_interval(base, better, half)
    assert lo < 0.5 < hi and 0.2 < lo and hi < 0.8
    lo4, hi4 = retention_interval(base * 4, better * 4, half * 4)  # the same figures on 4x the tasks
    assert lo < lo4 < 0.5 < hi4 < hi
    assert retention_interval(base, better, half) == (lo, hi)  # reproducible for a seed
    lo1, hi1 = retention_interval(base, better, half, seed=1)  # another seed's resamples: still around 0.5
    assert 0.2 < lo1 < 0.5 < hi1 < 0.8


def test_the_interval_needs_the_same_tasks_for_all_three_models() -> None:
    with pytest.raises(ValueError, match="same tasks"):
        retention_interval([True, False], [True, True], [True])
    with pytest.raises(ValueError, match="same tasks"):
        retention_interval([], [], [])

"""Merge methods and aggregators against values computed by hand on small tensors."""

from __future__ import annotations

import pytest
import torch

from skillswarm.merge.aggregate import AGGREGATOR_FUNCS, aggregate, clipped_mean, median, trimmed_mean
from skillswarm.merge.codecs import DEFAULT_PARAMS
from skillswarm.merge.methods import METHODS, get_method, merge
from skillswarm.merge.methods.sparsify import kth_largest_magnitudes, rng_key, sparsify, uniform53
from skillswarm.protocol.errors import MergeError
from skillswarm.protocol.records import AGGREGATORS, CODECS, MERGE_METHODS

T = torch.tensor


def test_registry_names_match_the_protocol() -> None:
    assert tuple(METHODS) == MERGE_METHODS
    assert tuple(AGGREGATOR_FUNCS) == AGGREGATORS
    assert tuple(DEFAULT_PARAMS) == CODECS


def test_linear_and_task_arithmetic() -> None:
    a, b = T([1.0, 2.0]), T([3.0, 6.0])
    assert torch.equal(merge("linear", [a, b], [1.0, 3.0]), T([2.5, 5.0]))  # (1*1 + 3*3) / 4, (2 + 18) / 4
    assert torch.equal(merge("linear", [a, b], [1.0, 3.0], scale=2.0), T([5.0, 10.0]))
    assert torch.equal(merge("task_arithmetic", [a, b], [1.0, 0.5], **{"lambda": 0.5}), T([1.25, 2.5]))


def test_ties_trims_by_magnitude_elects_by_mass_and_takes_the_disjoint_mean() -> None:
    a = T([4.0, -1.0, 0.5, -3.0])   # density 0.5 keeps 2 of 4: [4, 0, 0, -3]
    b = T([-2.0, -2.0, 0.1, 1.0])   # ties at the threshold are kept: [-2, -2, 0, 0]
    c = T([-1.5, 3.0, -0.2, 0.1])   # [-1.5, 3, 0, 0]
    # column 0: two of three are negative, but the mass 4 - 2 - 1.5 is positive, so + wins and only a counts
    assert torch.equal(merge("ties", [a, b, c], density=0.5), T([4.0, 3.0, 0.0, -3.0]))
    # weights [1, 1, 2]: column 0's mass 4 - 2 - 3 < 0 elects -, mean of b and c over their weights: -5/3
    got = merge("ties", [a, b, c], [1.0, 1.0, 2.0], density=0.5)
    assert torch.allclose(got, T([-5.0 / 3.0, 3.0, 0.0, -3.0]))
    # normalize off: the disjoint sum; lambda scales the result
    assert torch.equal(merge("ties", [a, b, c], [1.0, 1.0, 2.0], density=0.5, normalize=False, scale=0.5),
                       T([-2.5, 3.0, 0.0, -1.5]))


def test_breadcrumbs_drops_outliers_and_small_entries() -> None:
    a, b = T([1.0, -2.0, 3.0, 0.5]), T([-1.0, -1.0, 1.0, 2.0])
    # n=4, density 0.5 keeps 2, gamma 0.25 drops the largest: a keeps [1, -2], b keeps 1 <= |x| < 2
    assert torch.equal(merge("breadcrumbs", [a, b], density=0.5, gamma=0.25), T([0.0, -3.0, 1.0, 0.0]))


def _splitmix_reference(key: int, j: int) -> int:
    mask = (1 << 64) - 1
    z = (key + (j + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 11


def test_dare_masks_are_seeded_exact_and_rescaled() -> None:
    key = rng_key(7, "w", "0")
    assert [int(v) for v in uniform53(key, 5, 6)] == [_splitmix_reference(key, j) for j in range(5, 11)]
    # chunking does not change the stream
    assert torch.equal(uniform53(key, 0, 1000), torch.cat([uniform53(key, 0, 300), uniform53(key, 300, 700)]))
    x = torch.arange(1.0, 9.0)
    keep = [_splitmix_reference(key, j) < int(0.5 * 2**53) for j in range(8)]
    expected = T([v * 2.0 if k else 0.0 for v, k in zip(x.tolist(), keep)])  # survivors rescaled by 1/(1-p)
    assert 0 < sum(keep) < 8
    assert torch.equal(sparsify("random", x, density=0.5, key=key), expected)
    big = torch.ones(200_000)
    kept = sparsify("random", big, density=0.3, key=key)
    assert set(kept.unique().tolist()) <= {0.0, float(torch.tensor(1.0) / 0.3)} and abs(float((kept > 0).float().mean()) - 0.3) < 0.01
    d1, d2 = torch.randn(64), torch.randn(64)
    one = merge("dare_linear", [d1, d2], density=0.5, seed=1)
    assert torch.equal(one, merge("dare_linear", [d1, d2], density=0.5, seed=1))
    assert not torch.equal(one, merge("dare_linear", [d1, d2], density=0.5, seed=2))
    m1 = sparsify("random", d1, density=0.5, key=rng_key(1, "", "0"))
    m2 = sparsify("random", d2, density=0.5, key=rng_key(1, "", "1"))
    assert torch.equal(one, m1 + m2)
    # dare_ties: the same masks, then sign election by mass (disjoint sum: mergekit's default)
    mass = m1 + m2
    agree = lambda m: torch.where(torch.sign(m) == torch.where(mass >= 0, 1.0, -1.0), m, 0.0)  # noqa: E731
    assert torch.equal(merge("dare_ties", [d1, d2], density=0.5, seed=1), agree(m1) + agree(m2))


def test_exact_thresholds_over_chunks_equal_the_whole_tensor() -> None:
    g = torch.Generator().manual_seed(0)
    for x in (torch.randn(1000, 37, generator=g), torch.randn(5000, generator=g).bfloat16().float()):
        n = x.numel()
        chunks = lambda: (x.reshape(-1)[i:i + 999] for i in range(0, n, 999))  # noqa: E731
        ks = [1, 2, n // 5, n // 2, n]
        assert kth_largest_magnitudes(chunks, ks) == kth_largest_magnitudes(x, ks)
        assert kth_largest_magnitudes(x, ks) == [float(torch.sort(x.abs().reshape(-1), descending=True).values[k - 1])
                                                 for k in ks]


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(MergeError, match="no parameter 'density'"):
        merge("task_arithmetic", [T([1.0])], density=0.5)
    with pytest.raises(MergeError, match="density must be in"):
        merge("ties", [T([1.0])], density=1.5)
    with pytest.raises(MergeError, match="unknown merge method"):
        get_method("karcher")
    with pytest.raises(MergeError, match="different shapes"):
        merge("linear", [T([1.0]), T([1.0, 2.0])])


def test_aggregators() -> None:
    xs = [T([1.0, 0.0]), T([10.0, 0.0]), T([2.0, 0.0]), T([3.0, 0.0]), T([100.0, 0.0])]
    assert torch.equal(aggregate("mean", xs[:2], [3.0, 1.0]), T([3.25, 0.0]))  # (3 + 10) / 4
    assert torch.equal(trimmed_mean(xs, 0.2), T([5.0, 0.0]))  # drop 1 and 100: (2 + 3 + 10) / 3
    assert torch.equal(trimmed_mean(xs, 0.1), T([23.2, 0.0]))  # floor(0.5) = 0 dropped: plain mean
    assert torch.equal(median(xs), T([3.0, 0.0]))
    assert torch.equal(median(xs[:4]), T([2.5, 0.0]))  # even count: mean of 2 and 3
    # norms 5, 10, 1: the median 5 clips the second to half, then the mean
    ys = [T([3.0, 4.0]), T([6.0, 8.0]), T([0.0, 1.0])]
    assert torch.equal(clipped_mean(ys), T([2.0, 3.0]))
    assert torch.equal(aggregate("clipped_mean", ys, norms=[5.0, 10.0, 1.0]), T([2.0, 3.0]))
    assert aggregate("median", [xs[0]]) is xs[0]
    with pytest.raises(MergeError, match="unknown aggregator"):
        aggregate("krum", xs)

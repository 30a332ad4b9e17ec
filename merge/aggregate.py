"""Intra-skill aggregators: how several deltas of the same skill become one task vector before the
cross-skill merge (Flower-style robust aggregation; plain functions over same-shape float32 tensors).

- mean: weighted mean.
- trimmed_mean: per coordinate, drop the floor(trim_fraction * n) lowest and highest values, average the rest.
- median: coordinate-wise median (the mean of the two middle values for even n).
- clipped_mean: scale each delta down to the median of the deltas' norms (on this tensor), then the
  weighted mean; one outsized delta cannot pull the result further than a typical one.

trimmed_mean and median ignore weights (order statistics are about counting peers, not trusting them).
All sums run input by input in a fixed order and norms are exact (exact.py), so results are bit-identical
across threads, chunkings and machines.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Sequence

import torch

from skillswarm.merge.exact import canonical_zeros, l2_norm
from skillswarm.protocol.errors import MergeError
from skillswarm.protocol.records import AGGREGATORS


def mean(xs: Sequence[torch.Tensor], weights: Sequence[float] | None = None) -> torch.Tensor:
    """sum_i w_i x_i / sum_i w_i (one input comes back unchanged)."""
    if len(xs) == 1:
        return xs[0]
    w = [1.0] * len(xs) if weights is None else [float(v) for v in weights]
    total = math.fsum(w)
    if total <= 0:
        raise MergeError(f"aggregation weights must sum to a positive number, got {w}")
    acc = xs[0] * w[0]
    for x, wi in zip(xs[1:], w[1:]):
        acc += x * wi
    return acc / total


def _sorted(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.sort(canonical_zeros(torch.stack(list(xs))), dim=0).values  # -0.0 and 0.0 sort as equals


def trimmed_mean(xs: Sequence[torch.Tensor], trim_fraction: float = 0.1) -> torch.Tensor:
    """Coordinate-wise mean after dropping floor(trim_fraction * n) values at each end."""
    if not 0.0 <= trim_fraction < 0.5:
        raise MergeError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
    n = len(xs)
    cut = int(trim_fraction * n)
    if n == 1:
        return xs[0]
    s = _sorted(xs)[cut:n - cut]
    acc = s[0].clone()
    for row in s[1:]:
        acc += row
    return acc / float(n - 2 * cut)


def median(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Coordinate-wise median; for an even count, the mean of the two middle values."""
    n = len(xs)
    if n == 1:
        return xs[0]
    s = _sorted(xs)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) * 0.5


def clip_factors(norms: Sequence[float]) -> list[float]:
    """Per-input scale min(1, median(norms) / norm_i) (1 for a zero norm)."""
    c = statistics.median(norms)
    return [1.0 if n <= c or n == 0 else c / n for n in norms]


def clipped_mean(xs: Sequence[torch.Tensor], weights: Sequence[float] | None = None,
                 norms: Sequence[float] | None = None) -> torch.Tensor:
    """Weighted mean of the inputs, each first scaled down to the median norm. `norms` are the inputs'
    norms over the whole tensor (a caller that passes row chunks computes them first); by default the
    norms of `xs` themselves."""
    if len(xs) == 1:
        return xs[0]
    if norms is None:
        norms = [l2_norm(x) for x in xs]
    return mean([x * f if f != 1.0 else x for x, f in zip(xs, clip_factors(norms))], weights)


def aggregate(name: str, xs: Sequence[torch.Tensor], weights: Sequence[float] | None = None, *,
              trim_fraction: float = 0.1, norms: Sequence[float] | None = None) -> torch.Tensor:
    """Apply the aggregator called `name` (one of `skillswarm.protocol.records.AGGREGATORS`)."""
    if not xs:
        raise MergeError("nothing to aggregate")
    if name == "mean":
        return mean(xs, weights)
    if name == "trimmed_mean":
        return trimmed_mean(xs, trim_fraction)
    if name == "median":
        return median(xs)
    if name == "clipped_mean":
        return clipped_mean(xs, weights, norms)
    raise MergeError(f"unknown aggregator {name!r}; choose one of {', '.join(AGGREGATORS)}")


AGGREGATOR_FUNCS: dict[str, Callable[..., torch.Tensor]] = {
    "mean": mean, "trimmed_mean": trimmed_mean, "median": median, "clipped_mean": clipped_mean,
}

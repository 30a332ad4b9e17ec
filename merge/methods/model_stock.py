"""model_stock (Jang et al. 2024, as mergekit implements it): per tensor, the mean cosine between the
models' task vectors o_i = w_i - w_0 over all pairs, cos, gives the interpolation ratio

    t = N cos / (1 + (N - 1) cos)        (0 where the denominator is ~0)
    out = t * mean_i(w_i) + (1 - t) * w_0

so near-orthogonal task vectors pull the result toward the base. Needs the base and at least two
models; takes no weights. Dot products and norms are exact (exact.ProductSum), t is computed in float64
from them and rounded to float32, so the merge is bit-stable."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from skillswarm.merge.exact import ProductSum, to_float32
from skillswarm.merge.methods.base import Method
from skillswarm.protocol.errors import MergeError


@dataclass(frozen=True)
class ModelStockParams:
    filter_wise: bool = False  # mergekit's per-row variant; only False is supported


METHOD = Method("model_stock", ModelStockParams, sparsifier="none", consensus=False, kind="model_stock",
                summary="interpolate toward the models' mean by the angle between their task vectors",
                paper="https://arxiv.org/abs/2403.19522")


def _pairs(n: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(n) for j in range(i, n)]


def model_stock_stats(offsets: Sequence[torch.Tensor], into: list[ProductSum] | None = None) -> list[ProductSum]:
    """Add every o_i . o_j (i <= j) of (a chunk of) the task vectors into `into` (exact sums)."""
    xs = [o.to(torch.float32) for o in offsets]
    pairs = _pairs(len(xs))
    sums = into or [ProductSum() for _ in pairs]
    for s, (i, j) in zip(sums, pairs):
        s.add(xs[i], xs[j])
    return sums


def model_stock_t(n: int, sums: list[ProductSum]) -> float:
    """The interpolation ratio t (a float32 value) of n task vectors from their exact dot products."""
    if n < 2:
        raise MergeError(f"model_stock needs at least two models besides the base, got {n}")
    dots = {p: s.value() for p, s in zip(_pairs(n), sums)}
    cosines = []
    for i in range(n):
        for j in range(i + 1, n):
            norm_product = math.sqrt(dots[i, i]) * math.sqrt(dots[j, j])
            cosines.append(min(1.0, max(-1.0, dots[i, j] / max(norm_product, 1e-6))))
    cos = math.fsum(cosines) / len(cosines)
    denominator = 1.0 + (n - 1) * cos
    return 0.0 if abs(denominator) < 1e-6 else to_float32(n * cos / denominator)


def model_stock_rows(base: torch.Tensor, models: Sequence[torch.Tensor], t: float) -> torch.Tensor:
    """t * mean(models) + (1 - t) * base in float32, in mergekit's order of operations."""
    total = models[0].to(torch.float32).clone()
    for m in models[1:]:
        total += m.to(torch.float32)
    total /= float(len(models))
    total *= t
    total += base.to(torch.float32) * to_float32(1.0 - t)
    return total


def model_stock(base: torch.Tensor, models: Sequence[torch.Tensor]) -> torch.Tensor:
    """The model_stock merge of whole same-shape tensors (float32)."""
    b = base.to(torch.float32)
    offsets = [m.to(torch.float32) - b for m in models]
    return model_stock_rows(b, models, model_stock_t(len(models), model_stock_stats(offsets)))

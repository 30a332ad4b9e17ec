"""slerp: spherical interpolation between the base model (t = 0) and one other model (t = 1), per tensor,
as mergekit does it: the angle between the two flattened tensors, then

    out = sin((1 - t) theta) / sin(theta) * base + sin(t theta) / sin(theta) * other

or plain linear interpolation (1 - t) * base + t * other where the tensors are nearly parallel
(|cos theta| > 0.9995, which a fine-tune of the base usually is). The angle comes from exact dot products
(exact.ProductSum) and the coefficients from machine-independent acos / sin, rounded to float32, so the
merge is bit-stable; the interpolation itself is two float32 products and one sum per entry."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from skillswarm.merge.exact import ProductSum, exact_acos, exact_sin, to_float32
from skillswarm.merge.methods.base import Method

DOT_THRESHOLD = 0.9995  # mergekit's: above it, interpolate linearly
EPS = 1e-8  # a norm below it counts as 1 (mergekit's guard against zero tensors)


@dataclass(frozen=True)
class SlerpParams:
    t: float = 0.5  # 0: the base, 1: the other model


METHOD = Method("slerp", SlerpParams, sparsifier="none", consensus=False, kind="slerp",
                summary="spherical interpolation between the base and one model",
                paper="https://en.wikipedia.org/wiki/Slerp")


def slerp_stats(base: torch.Tensor, other: torch.Tensor, into: list[ProductSum] | None = None) -> list[ProductSum]:
    """Add (|base|^2, |other|^2, base . other) of (a chunk of) a tensor into `into` (exact sums)."""
    sums = into or [ProductSum(), ProductSum(), ProductSum()]
    a, b = base.to(torch.float32), other.to(torch.float32)
    sums[0].add(a, a)
    sums[1].add(b, b)
    sums[2].add(a, b)
    return sums


def slerp_coefficients(t: float, sums: list[ProductSum]) -> tuple[float, float]:
    """(coefficient of the base, coefficient of the other model), float32 values."""
    t = to_float32(float(t))
    na, nb = math.sqrt(sums[0].value()), math.sqrt(sums[1].value())
    na, nb = (na if na > EPS else 1.0), (nb if nb > EPS else 1.0)
    dot = sums[2].value()
    cos = dot / na / nb if math.isfinite(dot) else 1.0
    cos = min(1.0, max(-1.0, cos))
    if abs(cos) > DOT_THRESHOLD:
        return to_float32(1.0 - t), t
    theta = exact_acos(cos)
    s = exact_sin(theta)
    return to_float32(exact_sin((1.0 - t) * theta) / s), to_float32(exact_sin(t * theta) / s)


def slerp_rows(base: torch.Tensor, other: torch.Tensor, coefs: tuple[float, float]) -> torch.Tensor:
    """coef_base * base + coef_other * other in float32 (two products, one sum: no FMA)."""
    out = base.to(torch.float32) * coefs[0]
    out += other.to(torch.float32) * coefs[1]
    return out


def slerp(base: torch.Tensor, other: torch.Tensor, t: float = 0.5) -> torch.Tensor:
    """The slerp of two whole same-shape tensors (float32)."""
    return slerp_rows(base, other, slerp_coefficients(t, slerp_stats(base, other)))

"""Merge methods, one per file, found by name: a pure function on tensors and a small parameter struct each.

`METHODS` maps the names of `skillswarm.protocol.records.MERGE_METHODS` to their `Method` entries;
`merge(name, deltas, weights, **params)` is the one-call form.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from skillswarm.merge.methods import breadcrumbs, dare, linear, task_arithmetic, ties
from skillswarm.merge.methods.base import Method, merge_tensors
from skillswarm.protocol.errors import MergeError

METHODS: dict[str, Method] = {m.name: m for m in (
    linear.METHOD, task_arithmetic.METHOD, ties.METHOD, dare.DARE_LINEAR, dare.DARE_TIES, breadcrumbs.METHOD)}


def get_method(name: str) -> Method:
    """The registry entry of a method name (MergeError listing the choices otherwise)."""
    try:
        return METHODS[name]
    except KeyError:
        raise MergeError(f"unknown merge method {name!r}; choose one of {', '.join(METHODS)}") from None


def merge(name: str, deltas: Sequence[torch.Tensor], weights: Sequence[float] | None = None, *, seed: int = 0,
          **params: Any) -> torch.Tensor:
    """Merge whole task vectors with the named method, e.g. merge("ties", [d1, d2], density=0.5)."""
    m = get_method(name)
    return merge_tensors(m, deltas, weights, m.make_params(params), seed=seed)


__all__ = ["METHODS", "Method", "get_method", "merge", "merge_tensors"]

"""Merge methods, one per file, found by name: a pure function on tensors and a small parameter struct each.

`METHODS` maps the names of `skillswarm.protocol.records.MERGE_METHODS` (what a network may use) to their
`Method` entries; `ALL_METHODS` adds the methods only plain merges and recipes take (breadcrumbs_ties, della,
della_linear, slerp, model_stock). `merge(name, deltas, weights, **params)` is the one-call form of the
task-vector methods; slerp and model_stock need the base (`slerp.slerp`, `model_stock.model_stock`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from skillswarm.merge.methods import breadcrumbs, dare, della, linear, model_stock, slerp, task_arithmetic, ties
from skillswarm.merge.methods.base import Method, merge_tensors
from skillswarm.protocol.errors import MergeError

METHODS: dict[str, Method] = {m.name: m for m in (
    linear.METHOD, task_arithmetic.METHOD, ties.METHOD, dare.DARE_LINEAR, dare.DARE_TIES, breadcrumbs.METHOD)}
ALL_METHODS: dict[str, Method] = {**METHODS, **{m.name: m for m in (
    breadcrumbs.TIES_METHOD, della.DELLA, della.DELLA_LINEAR, slerp.METHOD, model_stock.METHOD)}}


def get_method(name: str) -> Method:
    """The registry entry of a method name (MergeError listing the choices otherwise)."""
    try:
        return ALL_METHODS[name]
    except KeyError:
        raise MergeError(f"unknown merge method {name!r}; choose one of {', '.join(ALL_METHODS)}") from None


def merge(name: str, deltas: Sequence[torch.Tensor], weights: Sequence[float] | None = None, *, seed: int = 0,
          **params: Any) -> torch.Tensor:
    """Merge whole task vectors with the named method, e.g. merge("ties", [d1, d2], density=0.5)."""
    m = get_method(name)
    if m.kind != "gta":
        raise MergeError(f"{name} interpolates between the base and the models: call "
                         f"skillswarm.merge.methods.{name}.{name}(base, ...) instead")
    return merge_tensors(m, deltas, weights, m.make_params(params), seed=seed)


__all__ = ["ALL_METHODS", "METHODS", "Method", "get_method", "merge", "merge_tensors"]

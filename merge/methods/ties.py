"""ties (Yadav et al. 2023): trim each task vector to its largest-magnitude `density` fraction, elect each
coordinate's sign by total mass, and average only the entries that agree with it (the disjoint mean)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from skillswarm.merge.methods.base import Method, merge_tensors


@dataclass(frozen=True)
class TiesParams:
    density: float = 0.2  # fraction of each task vector kept
    scale: float = 1.0  # lambda
    normalize: bool = True  # disjoint mean (False: disjoint sum)


METHOD = Method("ties", TiesParams, sparsifier="magnitude", consensus=True,
                summary="trim by magnitude, elect signs, disjoint mean", paper="https://arxiv.org/abs/2306.01708")


def ties(deltas: Sequence[torch.Tensor], weights: Sequence[float] | None = None,
         params: TiesParams = TiesParams()) -> torch.Tensor:
    """The TIES-merged task vector."""
    return merge_tensors(METHOD, deltas, weights, params)

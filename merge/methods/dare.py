"""dare_linear and dare_ties (Yu et al. 2024): drop each entry of each task vector with probability
p = 1 - density and rescale the survivors by 1 / (1 - p), then add (dare_linear) or elect signs as TIES
does (dare_ties). As in mergekit, neither divides by the weights unless normalize is set. The masks come
from a seeded counter-based generator (see sparsify.py): the same seed gives the same merge anywhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from skillswarm.merge.methods.base import Method, merge_tensors


@dataclass(frozen=True)
class DareParams:
    density: float = 0.2  # keep probability, 1 - p
    scale: float = 1.0  # lambda
    normalize: bool = False


DARE_LINEAR = Method("dare_linear", DareParams, sparsifier="random", consensus=False,
                     summary="random drop + 1/(1-p) rescale, then add", paper="https://arxiv.org/abs/2311.03099")
DARE_TIES = Method("dare_ties", DareParams, sparsifier="random", consensus=True,
                   summary="random drop + 1/(1-p) rescale, then TIES sign election",
                   paper="https://arxiv.org/abs/2311.03099")


def dare_linear(deltas: Sequence[torch.Tensor], weights: Sequence[float] | None = None,
                params: DareParams = DareParams(), *, seed: int = 0, name: str = "") -> torch.Tensor:
    """DARE then weighted sum; `seed` and `name` key the masks."""
    return merge_tensors(DARE_LINEAR, deltas, weights, params, seed=seed, name=name)


def dare_ties(deltas: Sequence[torch.Tensor], weights: Sequence[float] | None = None,
              params: DareParams = DareParams(), *, seed: int = 0, name: str = "") -> torch.Tensor:
    """DARE then TIES sign election; `seed` and `name` key the masks."""
    return merge_tensors(DARE_TIES, deltas, weights, params, seed=seed, name=name)

"""della and della_linear (Deep et al. 2024, as mergekit implements them): drop each entry of each task
vector with a probability that falls with its magnitude rank in its row (keep probability from
density - epsilon for the smallest to density + epsilon for the largest), rescale the survivors so the
tensor's L1 norm is unchanged (`rescale`), then elect signs as TIES does (della) or add (della_linear).
The masks come from the same seeded counter-based generator as DARE's: the same seed gives the same merge
anywhere; mergekit draws them with torch.bernoulli, so the two agree in distribution, not bit for bit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from skillswarm.merge.methods.base import Method, merge_tensors


@dataclass(frozen=True)
class DellaParams:
    density: float = 0.5  # mean keep probability
    epsilon: float = 0.15  # keep probabilities span density +- epsilon by magnitude rank
    scale: float = 1.0  # lambda
    normalize: bool = True  # disjoint mean (mergekit's default for della)
    rescale: bool = True  # restore each trimmed tensor's L1 norm


@dataclass(frozen=True)
class DellaLinearParams:
    density: float = 0.5
    epsilon: float = 0.15
    scale: float = 1.0
    normalize: bool = False
    rescale: bool = True


DELLA = Method("della", DellaParams, sparsifier="della", consensus=True,
               summary="magnitude-ranked random drop + L1 rescale, then TIES sign election",
               paper="https://arxiv.org/abs/2406.11617")
DELLA_LINEAR = Method("della_linear", DellaLinearParams, sparsifier="della", consensus=False,
                      summary="magnitude-ranked random drop + L1 rescale, then add", paper="https://arxiv.org/abs/2406.11617")


def della(deltas: Sequence[torch.Tensor], weights: Sequence[float] | None = None, params: DellaParams = DellaParams(),
          *, seed: int = 0, name: str = "") -> torch.Tensor:
    """DELLA then TIES sign election; `seed` and `name` key the masks."""
    return merge_tensors(DELLA, deltas, weights, params, seed=seed, name=name)

"""linear: the weighted average of the task vectors (= of the models), scaled by lambda."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from skillswarm.merge.methods.base import Method, merge_tensors


@dataclass(frozen=True)
class LinearParams:
    scale: float = 1.0  # lambda
    normalize: bool = True  # divide by the sum of weights (a weighted mean)


METHOD = Method("linear", LinearParams, sparsifier="none", consensus=False,
                summary="weighted average of the inputs", paper="https://arxiv.org/abs/2203.05482")


def linear(deltas: Sequence[torch.Tensor], weights: Sequence[float] | None = None,
           params: LinearParams = LinearParams()) -> torch.Tensor:
    """lambda * sum_i w_i d_i / sum_i w_i."""
    return merge_tensors(METHOD, deltas, weights, params)

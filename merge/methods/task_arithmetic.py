"""task_arithmetic (Ilharco et al. 2023): add the weighted task vectors, scaled by lambda."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from skillswarm.merge.methods.base import Method, merge_tensors


@dataclass(frozen=True)
class TaskArithmeticParams:
    scale: float = 1.0  # lambda
    normalize: bool = False


METHOD = Method("task_arithmetic", TaskArithmeticParams, sparsifier="none", consensus=False,
                summary="base + lambda * sum of weighted task vectors", paper="https://arxiv.org/abs/2212.04089")


def task_arithmetic(deltas: Sequence[torch.Tensor], weights: Sequence[float] | None = None,
                    params: TaskArithmeticParams = TaskArithmeticParams()) -> torch.Tensor:
    """lambda * sum_i w_i d_i."""
    return merge_tensors(METHOD, deltas, weights, params)

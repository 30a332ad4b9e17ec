"""breadcrumbs (Davari & Belilovsky 2024): per task vector, drop the largest-magnitude `gamma` fraction
(outliers) and the smallest entries so that `density` remains, then add the weighted vectors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from skillswarm.merge.methods.base import Method, merge_tensors


@dataclass(frozen=True)
class BreadcrumbsParams:
    density: float = 0.2  # fraction kept
    gamma: float = 0.01  # fraction of largest magnitudes dropped
    scale: float = 1.0  # lambda
    normalize: bool = False


METHOD = Method("breadcrumbs", BreadcrumbsParams, sparsifier="band", consensus=False,
                summary="drop outliers and small entries, then add", paper="https://arxiv.org/abs/2312.06795")


def breadcrumbs(deltas: Sequence[torch.Tensor], weights: Sequence[float] | None = None,
                params: BreadcrumbsParams = BreadcrumbsParams()) -> torch.Tensor:
    """The breadcrumbs-merged task vector."""
    return merge_tensors(METHOD, deltas, weights, params)

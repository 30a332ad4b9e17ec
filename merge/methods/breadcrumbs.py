"""breadcrumbs (Davari & Belilovsky 2024): per task vector, drop the largest-magnitude `gamma` fraction
(outliers) and the smallest entries so that `density` remains, then add the weighted vectors
(breadcrumbs) or elect signs as TIES does (breadcrumbs_ties)."""

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


@dataclass(frozen=True)
class BreadcrumbsTiesParams:
    density: float = 0.2  # fraction kept
    gamma: float = 0.01  # fraction of largest magnitudes dropped
    scale: float = 1.0  # lambda
    normalize: bool = False  # mergekit's default: the disjoint sum


TIES_METHOD = Method("breadcrumbs_ties", BreadcrumbsTiesParams, sparsifier="band", consensus=True,
                     summary="drop outliers and small entries, then TIES sign election",
                     paper="https://arxiv.org/abs/2312.06795")


def breadcrumbs_ties(deltas: Sequence[torch.Tensor], weights: Sequence[float] | None = None,
                     params: BreadcrumbsTiesParams = BreadcrumbsTiesParams()) -> torch.Tensor:
    """The breadcrumbs-trimmed, sign-elected task vector."""
    return merge_tensors(TIES_METHOD, deltas, weights, params)

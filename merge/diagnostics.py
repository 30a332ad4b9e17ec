"""Diagnostics of deltas: norms, the fraction of parameters each changes, and cosine similarity between
every pair, per tensor and over the whole model (`skillswarm merge analyze`). Deltas of different skills
should be nearly orthogonal (cosine ~ 0); that is what lets a merge add them with little interference.
Streams row chunks: the N deltas' chunks of one tensor are in memory at a time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from skillswarm.merge.deltas import DeltaFile
from skillswarm.merge.pipeline import CHUNK_ELEMS
from skillswarm.merge.progress import progress_bar
from skillswarm.merge.tensorfile import numel, row_chunks
from skillswarm.protocol.atomic import atomic_open
from skillswarm.protocol.errors import MergeError


@dataclass(frozen=True)
class TensorReport:
    """One tensor across the deltas (absent = zero)."""

    name: str
    numel: int
    norms: list[float]
    changed: list[float]  # fraction of entries that are non-zero
    cosine: list[list[float]]


@dataclass(frozen=True)
class DeltaReport:
    """The deltas as a whole, and per tensor."""

    paths: list[str]
    skills: list[str | None]
    codecs: list[str]
    sizes: list[int]
    norms: list[float]
    changed: list[float]
    cosine: list[list[float]]
    tensors: list[TensorReport]

    def to_json(self) -> dict[str, Any]:
        """Plain data for `--json`."""
        return asdict(self)


def _cosines(gram: torch.Tensor) -> list[list[float]]:
    norms = gram.diagonal().clamp_min(0).sqrt()
    denom = norms[:, None] * norms[None, :]
    cos = torch.where(denom > 0, gram / torch.where(denom > 0, denom, 1.0), 0.0)
    return [[round(float(v), 6) for v in row] for row in cos]


def analyze_deltas(paths: Sequence[Path | str], *, chunk_elems: int = CHUNK_ELEMS, progress: bool = False) -> DeltaReport:
    """Norms, changed fractions and pairwise cosine similarities of the given delta files."""
    if not paths:
        raise MergeError("no deltas to analyze")
    files = [DeltaFile(p) for p in paths]
    try:
        shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            for n in f.names():
                if shapes.setdefault(n, f.shape(n)) != f.shape(n):
                    raise MergeError(f"`{n}` has shape {list(f.shape(n))} in {f.path} but {list(shapes[n])} elsewhere; "
                                     "these deltas are for different models")
        k = len(files)
        total_gram = torch.zeros(k, k, dtype=torch.float64)
        total_nnz, total_n = torch.zeros(k, dtype=torch.float64), 0
        tensors = []
        with progress_bar(len(shapes), "analyzing", enabled=progress) as advance:
            for name in sorted(shapes):
                shape = shapes[name]
                gram = torch.zeros(k, k, dtype=torch.float64)
                nnz = torch.zeros(k, dtype=torch.float64)
                for r0, r1 in row_chunks(shape, chunk_elems):
                    rows = [f.rows(name, r0, r1) for f in files]
                    m = max((x.numel() for x in rows if x is not None), default=0)
                    x = torch.stack([r.reshape(-1).to(torch.float64) if r is not None else torch.zeros(m, dtype=torch.float64)
                                     for r in rows])
                    gram += x @ x.T
                    nnz += (x != 0).sum(dim=1).to(torch.float64)
                n = numel(shape)
                total_gram += gram
                total_nnz += nnz
                total_n += n
                tensors.append(TensorReport(name, n, [float(v) for v in gram.diagonal().sqrt()],
                                            [float(v) / n if n else 0.0 for v in nnz], _cosines(gram)))
                advance()
        return DeltaReport(
            paths=[str(p) for p in paths], skills=[f.skill for f in files], codecs=[f.codec for f in files],
            sizes=[f.path.stat().st_size for f in files], norms=[float(v) for v in total_gram.diagonal().sqrt()],
            changed=[float(v) / total_n if total_n else 0.0 for v in total_nnz], cosine=_cosines(total_gram),
            tensors=tensors)
    finally:
        for f in files:
            f.close()


def plot_report(report: DeltaReport, png: Path | str, max_tensors: int = 48) -> Path:
    """Write a heatmap PNG: the global cosine matrix, and beside it each pair's cosine per tensor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [Path(p).stem[:18] for p in report.paths]
    k = len(labels)
    pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
    fig, axes = plt.subplots(1, 2 if pairs else 1, figsize=(12 if pairs else 6, 5.5), squeeze=False)
    ax = axes[0][0]
    im = ax.imshow(report.cosine, vmin=-1, vmax=1, cmap="coolwarm")
    ax.set_xticks(range(k), labels, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(k), labels, fontsize=8)
    for i in range(k):
        for j in range(k):
            ax.text(j, i, f"{report.cosine[i][j]:.2f}", ha="center", va="center", fontsize=7)
    ax.set_title("cosine similarity (whole delta)")
    fig.colorbar(im, ax=ax, fraction=0.046)
    if pairs:
        top = sorted(report.tensors, key=lambda t: -max(t.norms, default=0.0))[:max_tensors]
        grid = [[t.cosine[i][j] for (i, j) in pairs] for t in top]
        ax2 = axes[0][1]
        ax2.imshow(grid, vmin=-1, vmax=1, cmap="coolwarm", aspect="auto")
        ax2.set_xticks(range(len(pairs)), [f"{labels[i]} / {labels[j]}" for i, j in pairs], rotation=45, ha="right",
                       fontsize=7)
        ax2.set_yticks(range(len(top)), [t.name[-40:] for t in top], fontsize=6)
        ax2.set_title(f"per-tensor cosine ({len(top)} largest tensors)")
    fig.tight_layout()
    with atomic_open(png, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return Path(png)


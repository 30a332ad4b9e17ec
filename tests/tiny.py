"""A three-tensor "model" for round-step tests that need real files but no real network: its shapes and its base."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES = {"emb": (40, 8), "w": (8, 8), "norm": (8,)}


def write_base(root: Path) -> Path:
    """A base checkpoint of SHAPES (seeded values, an empty config) in `root / "base"`."""
    g = torch.Generator().manual_seed(0)
    d = root / "base"
    d.mkdir()
    save_file({k: torch.randn(s, generator=g) for k, s in SHAPES.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text("{}")
    return d

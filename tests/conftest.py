"""Shared fixtures: an isolated SKILLSWARM_HOME per test, and helpers to run the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKILLSWARM = Path(sys.executable).with_name("skillswarm")


@pytest.fixture(autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keys, caches and state of every test live in a fresh directory, never in the user's."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("SKILLSWARM_HOME", str(home))
    monkeypatch.delenv("SKILLSWARM_KEY", raising=False)
    return home


def run_cli(*args: str, check: bool = True, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the installed `skillswarm` console script as a user would."""
    proc = subprocess.run(
        [str(SKILLSWARM), *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"skillswarm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def tiny_model_dir(tmp_path: Path) -> Path:
    """A minimal HF-style directory with safetensors weights (enough to hash as a base model)."""
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "tiny-model"
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file({"w": torch.randn(4, 3, generator=g), "b": torch.zeros(3)}, str(d / "model.safetensors"))
    (d / "config.json").write_text('{"model_type": "tiny"}')
    return d


@pytest.fixture(scope="session")
def nano_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real nano model (HF directory), built once per test session with the test recipe: the same
    code path as `skillswarm base build`, a shorter warm-up. For every test that needs a real model."""
    from skillswarm.skills.nano.build import build_base
    from skillswarm.skills.nano.recipe import TEST_RECIPE

    return build_base(tmp_path_factory.mktemp("nano") / "model", recipe=TEST_RECIPE, cache=False)

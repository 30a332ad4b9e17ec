"""Shared fixtures: an isolated SKILLSWARM_HOME per test, and helpers to run the real CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
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


# The nano model's build trains on one pinned thread in a process of its own (`skills.nano.build_process`),
# so it starts as soon as collection shows a test needs it and runs beside the first tests on the other core.
_nano_build: Future[Path] | None = None
_nano_dir: Path | None = None


def _start_nano_build() -> Future[Path]:
    """Start the test nano model's build on a background thread, once; its future."""
    global _nano_build, _nano_dir
    if _nano_build is None:
        from skillswarm.skills.nano.build import build_base
        from skillswarm.skills.nano.recipe import TEST_RECIPE

        _nano_dir = Path(tempfile.mkdtemp(prefix="skillswarm-test-nano-"))
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nano-build")
        _nano_build = pool.submit(build_base, _nano_dir / "model", recipe=TEST_RECIPE, cache=False)
        pool.shutdown(wait=False)
    return _nano_build


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building the test nano model in the background when a collected test uses it."""
    if not session.config.option.collectonly and any(
            "nano_model" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_nano_build()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Wait for a build still running (its process is ours to end), then remove it."""
    if _nano_build is not None:
        _nano_build.exception()
    if _nano_dir is not None:
        shutil.rmtree(_nano_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def nano_model() -> Path:
    """A real nano model (HF directory), built once per test session with the test recipe: the same
    code path as `skillswarm base build`, a shorter warm-up. For every test that needs a real model."""
    return _start_nano_build().result()  # started at collection unless a test asks for it at run time

"""Packaging and architecture rules: the wheel holds every package folder and installs cleanly in a
new venv; dependencies point one way; files stay small."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = ("protocol", "node", "merge", "skills")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(out), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )
    (path,) = out.glob("skillswarm-*.whl")
    return path


def _source_files(pkg: str) -> list[Path]:
    return [p for p in (ROOT / pkg).rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]


def test_wheel_contains_every_package_folder(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [
        str(p.relative_to(ROOT)) for pkg in PACKAGES for p in _source_files(pkg)
        if f"skillswarm/{pkg}/{p.relative_to(ROOT / pkg).as_posix()}" not in names
    ]
    assert not missing, f"files the wheel would not contain (add their package to pyproject.toml): {missing}"
    assert not any(n.startswith("skillswarm/__init__") for n in names), "skillswarm must stay a PEP 420 namespace"


def test_wheel_installs_into_a_new_venv_and_runs(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--quiet", str(wheel)], check=True, timeout=300,
                   capture_output=True)
    # Reuse this environment's third-party packages (a path entry, not a site dir: its editable-install hook
    # is not processed), so only the wheel can provide skillswarm.
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run(
        [str(py), "-c", "import skillswarm.protocol as p, skillswarm.node.cli.app; print(p.__file__)"],
        check=True, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )
    assert probe.stdout.strip().startswith(str(site)), probe.stdout
    helped = subprocess.run([str(venv / "bin" / "skillswarm", ), "--help"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path, env={**env, "COLUMNS": "200"})
    assert helped.returncode == 0 and "Usage" in helped.stdout, helped.stderr


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


@pytest.mark.parametrize("pkg, forbidden", [
    ("protocol", ("skillswarm.node", "skillswarm.merge", "skillswarm.skills")),
    ("skills", ("skillswarm.node", "skillswarm.merge")),
    ("merge", ("skillswarm.node", "skillswarm.skills", "hivemind", "huggingface_hub", "socket", "http", "urllib", "requests",
               "skillswarm.protocol.transport.dht", "skillswarm.protocol.transport.blobs")),
])
def test_dependencies_point_one_way(pkg: str, forbidden: tuple[str, ...]) -> None:
    bad = [
        f"{p.relative_to(ROOT)} imports {m}" for p in (ROOT / pkg).rglob("*.py") for m in _imports(p)
        if any(m == f or m.startswith(f + ".") for f in forbidden)
    ]
    assert not bad, bad


def test_no_relative_imports_and_no_huge_files() -> None:
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            text = p.read_text()
            assert len(text.splitlines()) <= 550, f"{p.relative_to(ROOT)} is over ~500 lines; split it"
            tree = ast.parse(text)
            assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level], f"{p}: use absolute imports"


def _modules() -> dict[str, Path]:
    """Every module of the four packages by its dotted name (a package by its __init__)."""
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = [part for part in p.relative_to(ROOT / pkg).with_suffix("").parts if part != "__init__"]
            out[".".join([f"skillswarm.{pkg}", *parts])] = p
    return out


def _module_level_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports when it is imported: top-level statements, inside `if` (TYPE_CHECKING
    included) and `try` blocks, not inside functions. `from pkg import sub` depends on pkg.sub alone."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for n in body:
            if isinstance(n, ast.Import):
                found.update(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom) and n.module:
                subs = [f"{n.module}.{a.name}" for a in n.names if f"{n.module}.{a.name}" in modules]
                found.update(subs)
                if len(subs) < len(n.names):
                    found.add(n.module)
            elif isinstance(n, (ast.If, ast.Try)):
                visit(n.body)
                visit(n.orelse)
                for handler in getattr(n, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    resolved = set()
    for name in found:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            resolved.add(name)
    return resolved


def test_no_import_cycles_even_under_type_checking() -> None:
    modules = _modules()
    graph = {m: _module_level_imports(p, modules) - {m} for m, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, cycles

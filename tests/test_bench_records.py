"""Recorded figures: `bench/record.py` saves a command's JSON with what reproduces it, and `bench/render.py`
keeps docs/results.md and the README's headline table in step with the committed records."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_a_record_holds_the_figures_with_command_commit_machine_and_date(tmp_path: Path) -> None:
    record = _bench("record")
    code = "import json; print('warming up'); print(json.dumps({'ratio': 1.5, 'runs': [{'name': 'a', 'x': 2}]}))"
    path = record.run("toy", [sys.executable, "-c", code], tmp_path)
    saved = json.loads(path.read_text())
    assert path == tmp_path / "toy.json" and saved["name"] == "toy"
    assert saved["figures"] == {"ratio": 1.5, "runs": [{"name": "a", "x": 2}]}
    assert saved["command"] == shlex.join([sys.executable, "-c", code])
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert saved["commit"].removesuffix("-dirty") == head
    assert saved["machine"]["cores"] >= 1 and saved["machine"]["python"] and saved["date"].endswith("Z")
    assert [p.name for p in tmp_path.iterdir()] == ["toy.json"]  # no temp file left beside it


def test_a_failed_command_or_one_without_json_saves_nothing(tmp_path: Path) -> None:
    record = _bench("record")
    (tmp_path / "toy.json").write_text("{}")
    with pytest.raises(record.RecordError, match="exited 3; nothing saved"):
        record.run("toy", [sys.executable, "-c", "import sys; print('{\"a\": 1}'); sys.exit(3)"], tmp_path)
    with pytest.raises(record.RecordError, match="no JSON object"):
        record.run("toy", [sys.executable, "-c", "print('[1, 2]')"], tmp_path)
    with pytest.raises(record.RecordError, match="bad name"):
        record.run("../toy", [sys.executable, "-c", "print('{}')"], tmp_path)
    assert (tmp_path / "toy.json").read_text() == "{}"  # the earlier record stands


def test_the_committed_results_page_and_readme_table_are_what_the_records_give() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "render.py"), "--check"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr  # rerun bench/render.py after recording
    assert (ROOT / "bench" / "results").is_dir() and any((ROOT / "bench" / "results").glob("*.json"))


def test_rendering_names_a_broken_record_and_reads_every_figure(tmp_path: Path) -> None:
    render = _bench("render")
    good = {"name": "sandbox", "command": "c", "commit": "0" * 40, "date": "2026-01-01T00:00:00Z",
            "machine": {"cores": 2}, "figures": {"sandbox_ms_p50": 40.0, "bare_ms_p50": 8.0, "ratio": 5.0,
                                                 "calls_per_s": 24.0, "n": 200}}
    (tmp_path / "sandbox.json").write_text(json.dumps(good))
    records = render.load(tmp_path)
    doc = render.render_doc(records)
    assert "| `ratio` | 5 |" in doc and "40.0 ms (p50) against 8.0 ms" in doc
    assert "40.0 ms (p50)" in render.render_table(records)
    (tmp_path / "sandbox.json").write_text(json.dumps({**good, "figures": {"ratio": 5.0}}))
    with pytest.raises(render.RenderError, match="sandbox.json does not hold the figures its headline reads"):
        render.render_doc(render.load(tmp_path))
    (tmp_path / "sandbox.json").write_text("{not json")
    with pytest.raises(render.RenderError, match="sandbox.json is not a JSON record"):
        render.load(tmp_path)
    with pytest.raises(render.RenderError, match="must hold one"):
        render.splice("no markers here", "| table |")

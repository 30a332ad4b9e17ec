"""`skillswarm skills list|show`, and a third-party skill package found through its entry point."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli

PLUGIN = ROOT / "tests" / "plugins" / "skillswarm_toy_skill"


def test_skills_list_and_show() -> None:
    listed = json.loads(run_cli("skills", "list", "--json").stdout)["skills"]
    by_name = {s["name"]: s for s in listed}
    assert {"arith", "calc", "reverse", "sort"} <= set(by_name)
    assert by_name["calc"]["tools"] == ["calc"] and by_name["calc"]["multi_turn"] and by_name["arith"]["origin"] == "builtin"
    assert "reverse" in run_cli("skills", "list").stdout

    calc = json.loads(run_cli("skills", "show", "calc", "--samples", "4", "--json").stdout)
    assert len(calc["samples"]) == 4 and calc["tools"][0]["name"] == "calc"
    assert {f["name"]: f["per_turn"] for f in calc["rubric"]} == {"exact_answer": False, "good_call": True, "tool_calls_made": False}
    roles = [m["role"] for m in calc["reference_episode"]]
    assert roles[:3] == ["system", "user", "assistant"] and "tool" in roles
    text = run_cli("skills", "show", "calc").stdout
    assert "rubric" in text and "good_call" in text and "<result>" in text
    proc = run_cli("skills", "show", "nope", check=False)
    assert proc.returncode == 1 and "unknown skill 'nope'" in proc.stderr


@pytest.mark.slow
def test_third_party_skill_is_found_through_its_entry_point(tmp_path: Path) -> None:
    pip = [sys.executable, "-m", "pip"]
    source = shutil.copytree(PLUGIN, tmp_path / "plugin")  # the build leaves files beside the source
    subprocess.run([*pip, "install", "--quiet", "--no-deps", "--no-build-isolation", str(source)],
                   check=True, capture_output=True, timeout=300)
    try:
        listed = json.loads(run_cli("skills", "list", "--json").stdout)["skills"]
        toy = next(s for s in listed if s["name"] == "toy_echo")
        assert toy["origin"] == "skillswarm-toy-skill" and toy["version"] == "0.1.0"
        shown = json.loads(run_cli("skills", "show", "toy_echo", "--json").stdout)
        assert shown["reference_episode"][-1]["content"] == f"<answer>{shown['samples'][0]['answer']}</answer>"
        probe = subprocess.run(
            [sys.executable, "-c", "from skillswarm.skills.registry import get_skill\n"
             "s = get_skill('toy_echo'); t = s.tasks.eval_tasks(3)[0]\n"
             "print(s.demonstration(t).reward, s.tasks.is_eval(t))"],
            capture_output=True, text=True, timeout=120, check=True)
        assert probe.stdout.split() == ["1.0", "True"]
    finally:
        subprocess.run([*pip, "uninstall", "--quiet", "--yes", "skillswarm-toy-skill"], capture_output=True, timeout=300)
    assert "toy_echo" not in run_cli("skills", "list").stdout

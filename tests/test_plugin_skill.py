"""A third-party multi-turn skill from zero: the guide's `count_vowels` plugin, pip-installed, warmed up into
a nano base through its reference player (`base build --skill`), trained with GRPO from the CLI; and the
network file pinning its version, so that a node with another version (or none) refuses to start."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from skillswarm.protocol.errors import SkillError
from skillswarm.protocol.netspec import load_spec
from skillswarm.protocol.records import SkillVersion
from skillswarm.skills.environment import Environment
from skillswarm.skills.rubric import Rubric
from skillswarm.skills.skill import Skill
from skillswarm.skills.taskbank import Task, TaskBank
from skillswarm.skills.toolcall import format_answer
from tests.conftest import ROOT, run_cli

PLUGIN = ROOT / "tests" / "plugins" / "skillswarm_vowels_skill"
DIST, PIN = "skillswarm-vowels-skill", SkillVersion(version="0.1.0", distribution="skillswarm-vowels-skill",
                                                    distribution_version="0.1.0")

# Built in a subprocess (it must see the freshly installed entry point): the plugin alone, a short warm-up
# (enough to call the tool and pass its reply on: the held-out accuracy lands near 30%).
BUILD = """
import json, sys
from skillswarm.skills.nano.build import build_base, build_info
from skillswarm.skills.nano.recipe import TEST_RECIPE
plugin = TEST_RECIPE.with_(skills=("count_vowels",), weights=(1.0,), steps=150, batch_size=16)
print(json.dumps(build_info(build_base(sys.argv[1] + "/plugin", recipe=plugin, cache=False))))
"""


@pytest.fixture(scope="module")
def vowels_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The plugin pip-installed into this venv for the module's tests, uninstalled afterwards."""
    pip = [sys.executable, "-m", "pip"]
    source = shutil.copytree(PLUGIN, tmp_path_factory.mktemp("vowels") / "plugin")  # the build writes beside it
    subprocess.run([*pip, "install", "--quiet", "--no-deps", "--no-build-isolation", str(source)],
                   check=True, capture_output=True, timeout=300)
    try:
        yield source
    finally:
        subprocess.run([*pip, "uninstall", "--quiet", "--yes", DIST], capture_output=True, timeout=300)


def test_readme_shows_the_plugin_as_it_is() -> None:
    readme = (ROOT / "docs" / "writing-a-skill.md").read_text()
    code = (PLUGIN / "skillswarm_vowels_skill" / "__init__.py").read_text()
    assert f"```python\n{code}```" in readme  # the guide's example is the tested package, verbatim
    entry = re.search(r'\[project\.entry-points\."skillswarm\.skills"\]\n.*\n', (PLUGIN / "pyproject.toml").read_text())
    assert entry is not None and entry.group(0) in readme


def test_warm_up_refuses_skills_it_cannot_imitate_or_write() -> None:
    from skillswarm.skills.nano.recipe import require_reference
    from skillswarm.skills.nano.tokenizer import build_tokenizer
    from skillswarm.skills.nano.warmup import collate

    class Accents(TaskBank):
        def draw(self, rng: random.Random) -> Task:
            return Task(id=f"accents:{rng.random()}", prompt="café", answer="café")

    silent = Skill(name="silent", version="1", description="no reference", tasks=Accents(), env=Environment(),
                   rubric=Rubric([]))
    with pytest.raises(SkillError, match=r"skill silent \(from some-dist\) has no reference player.*reference="):
        require_reference(silent, "some-dist")
    accents = Skill(name="accents", version="1", description="non-ascii", tasks=Accents(), env=Environment(),
                    rubric=Rubric([]), reference=lambda task, messages: format_answer(task.answer))
    with pytest.raises(SkillError, match=r"accents skill writes text .* 'é'.*printable ASCII"):
        collate(accents, build_tokenizer(), accents.tasks.train_tasks(2, seed=0), random.Random(0))
    proc = run_cli("base", "build", "--skill", "nope", "--steps", "1", check=False)
    assert proc.returncode == 1 and "unknown skill 'nope'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_plugin_skill_trains_from_zero_once_warmed_up(vowels_plugin: Path, tmp_path: Path, nano_model: Path) -> None:
    from skillswarm.skills.nano.build import build_info

    built = json.loads(subprocess.run([sys.executable, "-c", BUILD, str(tmp_path)], check=True, capture_output=True,
                                      text=True, timeout=300).stdout)
    assert built["recipe"]["plugins"] == {"count_vowels": {"version": "0.1.0", "distribution": DIST,
                                                           "distribution_version": "0.1.0"}}
    assert "plugins" not in build_info(nano_model)["recipe"]  # built-in recipes hash as they always did
    # The control: the tests' base, warmed up on the built-ins only, solves none of the plugin's tasks, so
    # GRPO would have nothing to start from.
    plain = json.loads(run_cli("eval", "--model", str(nano_model), "--skill", "count_vowels", "--n", "16",
                               "--json").stdout)
    assert plain["accuracy"] == 0.0
    run = json.loads(run_cli("train", "--model", str(tmp_path / "plugin"), "--skill", "count_vowels", "--steps", "4",
                             "--group-size", "4", "--batch", "2", "--max-new-tokens", "24", "--eval-n", "48",
                             "--out", str(tmp_path / "run"), "--json", timeout=300).stdout)
    stats = run["stats"]
    assert stats["steps"] == 4 and stats["eval_n"] == 48
    assert stats["accuracy_before"] > 0 and stats["accuracy_after"] > 0


@pytest.mark.slow
def test_base_build_adds_installed_plugins_pinned_to_their_version(vowels_plugin: Path, tmp_path: Path) -> None:
    from skillswarm.skills.nano.recipe import DEFAULT_RECIPE

    first = json.loads(run_cli("base", "build", "--skill", "count_vowels", "--steps", "1", "--out", str(tmp_path / "m"),
                               "--json", timeout=300).stdout)
    assert first["cached"] is False and first["skills"] == [*DEFAULT_RECIPE.skills, "count_vowels"]
    assert first["plugins"]["count_vowels"] == {"version": "0.1.0", "distribution": DIST, "distribution_version": "0.1.0"}
    assert first["recipe_hash"] != DEFAULT_RECIPE.with_(steps=1).hash()
    again = json.loads(run_cli("base", "build", "--with-plugins", "--steps", "1", "--json").stdout)
    assert again["cached"] is True and again["recipe_hash"] == first["recipe_hash"]
    recorded = json.loads((tmp_path / "m" / "nano_recipe.json").read_text())["recipe"]
    assert recorded["plugins"] == first["plugins"] and recorded["weights"][-1] == DEFAULT_RECIPE.added_weight


@pytest.mark.slow
def test_network_file_pins_plugin_versions_and_nodes_refuse_others(vowels_plugin: Path, tmp_path: Path,
                                                                    tiny_model_dir: Path) -> None:
    net = tmp_path / "net.toml"
    run_cli("net", "init", "--name", "vow", "--model", str(tiny_model_dir), "--skill", "arith", "--skill", "count_vowels",
            "--out", str(net))
    spec = load_spec(net)  # signed, and it verifies
    assert spec.skills == ["arith", "count_vowels"] and spec.plugin_versions() == {"count_vowels": PIN}
    assert "count_vowels 0.1.0" in run_cli("net", "show", str(net)).stdout
    missing = run_cli("net", "init", "--name", "vow", "--model", str(tiny_model_dir), "--skill", "ghost",
                      "--out", str(tmp_path / "ghost.toml"), check=False)
    assert missing.returncode == 1 and "'ghost' is not installed" in missing.stderr

    # another version of the plugin in the file (unsigned: edited by hand), then a plugin nobody installed
    unsigned = "\n".join(line for line in net.read_text().splitlines() if not line.startswith("signature"))
    newer = tmp_path / "newer.toml"
    newer.write_text(unsigned.replace('version = "0.1.0"', 'version = "0.2.0"'))
    peers = ["--peers", "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"]
    for cmd in (["node", "run", "--skill", "count_vowels"], ["coordinator", "run"]):
        proc = run_cli(*cmd, "--network", str(newer), *peers, check=False, timeout=60)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert (f"network vow trains skill count_vowels version 0.2.0 from distribution {DIST}; this machine has "
                f"0.1.0: pip install '{DIST}==0.2.0'") in " ".join(proc.stderr.split())
    ghost = tmp_path / "ghost.toml"
    ghost.write_text(unsigned.replace("count_vowels", "ghost_skill").replace(DIST, "ghost-dist"))
    proc = run_cli("node", "run", "--skill", "ghost_skill", "--network", str(ghost), *peers, check=False, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert ("trains skill ghost_skill version 0.1.0 from distribution ghost-dist; this machine does not have it: "
            "pip install 'ghost-dist==0.1.0'") in " ".join(proc.stderr.split())

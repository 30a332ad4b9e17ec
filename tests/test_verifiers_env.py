"""`train --skill verifiers:ENV_ID`: a real verifiers environment (tests/plugins/vf_reverse_env, installed
for the test) plays its rollouts against the recording endpoint over HTTP, and the run trains on them."""

from __future__ import annotations

import asyncio
import importlib
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.conftest import ROOT, run_cli

PLUGIN = ROOT / "tests" / "plugins" / "vf_reverse_env"
ENV_ID = "vf-reverse-env"
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)

pytestmark = pytest.mark.slow
SKIP_REASON = "the verifiers extra is not installed here (pip install 'skillswarm[verifiers]'; it needs Python >= 3.11)"
pytest.importorskip("verifiers", reason=SKIP_REASON)  # the package root only: importing verifiers.v1 takes seconds


@pytest.fixture(scope="module")
def reverse_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The test environment's package, installed into this venv for the module (uninstalled after)."""
    pytest.importorskip("verifiers.v1", reason=SKIP_REASON)
    pip = [sys.executable, "-m", "pip"]
    source = shutil.copytree(PLUGIN, tmp_path_factory.mktemp("vfenv") / "plugin")  # the build writes beside the source
    subprocess.run([*pip, "install", "--quiet", "--no-deps", "--no-build-isolation", str(source)],
                   check=True, capture_output=True, timeout=300)
    importlib.invalidate_caches()
    try:
        yield ENV_ID
    finally:
        subprocess.run([*pip, "uninstall", "--quiet", "--yes", "vf-reverse-env"], capture_output=True, timeout=300)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _check_trajectory(t: dict[str, Any]) -> None:
    """One recorded episode: the environment's reward agrees with its conversation, and the model's
    tokens (only those) are in the loss mask, with their sampling logprobs."""
    assert t["scored_by"] == "verifiers" and t["status"] == "scored"
    (seg,) = t["segments"]
    (_, (_, prompt), (_, reply)) = seg["conversation"]
    found = ANSWER.search(reply)
    assert t["reward"] == float(found is not None and found.group(1).strip() == prompt[::-1])
    assert t["metrics"]["reward_exact"] == t["reward"]
    (call,) = t["calls"]
    mask, logprobs = seg["loss_mask"], seg["logprobs"]
    assert len(mask) == len(seg["token_ids"]) == len(logprobs) == call["end"]
    assert mask == [0] * call["start"] + [1] * (call["end"] - call["start"]) and call["start"] > 0
    assert all(lp == 0.0 for lp in logprobs[:call["start"]]) and all(lp <= 0.0 for lp in logprobs[call["start"]:])
    assert call["temperature"] == 1.0


def test_train_on_a_verifiers_environment(nano_model: Path, reverse_env: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli("train", "--skill", f"verifiers:{reverse_env}", "--model", str(nano_model), "--steps", "2",
                   "--batch", "2", "--group-size", "4", "--out", str(out), "--json", timeout=300,
                   env={"HOME": str(tmp_path / "home")})  # verifiers keeps its runtimes' folders under ~/.cache
    result = json.loads(proc.stdout)
    assert result["stats"]["steps"] == 2 and result["stats"]["eval_n"] == 0
    steps = [r for r in _jsonl(out / "metrics.jsonl") if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2] and {r["mode"] for r in steps} == {"verifiers"}
    assert steps[0]["logp_diff_max"] < 1e-3  # the endpoint's recorded logprobs are the trainer's own
    assert steps[0]["groups"] >= 2 and steps[0]["episodes"] >= 8

    groups = _jsonl(out / "store" / "groups.jsonl")
    trajectories = [t for g in groups for t in g["trajectories"]]
    assert groups and all(g["name"] == f"verifiers:{reverse_env}" and g["reason"] == "complete" for g in groups)
    assert all(len(g["trajectories"]) == 4 and g["expired"] == 0 for g in groups)
    assert {t["reward"] for t in trajectories} == {0.0, 1.0}  # the model solves some: GRPO has signal
    for t in trajectories:
        _check_trajectory(t)
    assert not (out / "store" / "expired.jsonl").exists()
    assert list((tmp_path / "home" / ".cache" / "verifiers" / "runtimes" / "subprocess").iterdir()) == []

    bad = run_cli("train", "--skill", "verifiers:no-such-env", "--model", str(nano_model), "--steps", "1",
                  "--out", str(tmp_path / "bad"), check=False)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "verifiers environment 'no-such-env' is not installed" in " ".join(bad.stderr.split())


def test_rollouts_without_ids_are_matched_by_conversation(nano_model: Path, reverse_env: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import verifiers.v1.runtimes.subprocess as vf_subprocess

    from skillswarm.node.endpoint.serve import build_service, running
    from skillswarm.node.endpoint.verifiers_env import load_environment, play_groups, task_stream

    monkeypatch.setattr(vf_subprocess, "CACHE_DIR", tmp_path / "cache")  # not the user's ~/.cache
    threads = set(threading.enumerate())
    service = build_service(nano_model, tmp_path / "store", name="matched", max_new_tokens=16)
    env = load_environment(reverse_env)
    tasks = [next(task_stream(env.taskset, seed=0))]

    async def play(url: str) -> Any:
        async with env.serving():
            return await play_groups(env, reverse_env, tasks, 3, url, service.model_name, service.store, 1.0, 16,
                                     "t", by_id=False)

    with running(service) as url:
        counts = asyncio.run(play(url))
    assert counts == {"rollouts": 3, "scored": 3}
    (group,) = _jsonl(tmp_path / "store" / "groups.jsonl")
    assert group["id"] == "vf-t-g0" and len(group["trajectories"]) == 3 and group["expired"] == 0
    for t in group["trajectories"]:
        assert t["id"].startswith("traj-")  # named by the endpoint, not the runner
        _check_trajectory(t)
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - threads and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(threading.enumerate()) - threads  # the endpoint's, the engine's and verifiers' threads all ended

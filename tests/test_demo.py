"""`run_demo` end to end, shrunk: a bootstrap, a coordinator and two workers as real processes for one short
round; the report, the plot, the pulled checkpoint and a re-merge with a second method; nothing left running."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from skillswarm.node.demo import DemoConfig, run_demo, specialist_dir, versus_first_specialists
from skillswarm.protocol.records import MergePolicy, ScreenPolicy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _new_children(before: set[int]) -> list[psutil.Process]:
    # torch_shm_manager is torch's own helper of this (test) process, not something the demo started
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE and p.name() != "torch_shm_manager"]


def test_a_short_demo_reports_retention_and_stops_every_process(nano_model: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKILLSWARM_HOME", str(tmp_path / "home"))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    cfg = DemoConfig(out=tmp_path / "demo", skills=["reverse", "sort"], rounds=1, steps_per_round=3,
                     minutes_per_round=None, eval_n=8, retention_n=16, group_size=4, batch=2, compare=["task_arithmetic@1"], timeout_s=300,
                     retain=1.0, screen=ScreenPolicy(eval_n=0))  # 3-step deltas are too small to pass the usefulness test
    phases: list[str] = []
    report = run_demo(cfg, nano_model, on_status=lambda st: phases.append(st.phase))

    assert json.loads((cfg.out / "report.json").read_text()) == report
    assert (cfg.out / "report.png").stat().st_size > 1000
    assert set(report["skills"]) == {"reverse", "sort"} and report["rounds"] == 1
    for skill, row in report["skills"].items():
        for key in ("base", "specialist", "merged"):
            assert 0.0 <= row[key] <= 1.0
        if row["specialist"] > row["base"]:
            expected = (row["merged"] - row["base"]) / (row["specialist"] - row["base"])
            assert math.isclose(row["retention"], expected, abs_tol=1e-4)
        else:
            assert row["retention"] is None
        again = row["remeasured"]  # base, specialist and merged model re-measured on 16 tasks, the first 8 as above
        assert again["n"] == 16 and all(0.0 <= again[k] <= 1.0 for k in ("base", "specialist", "merged"))
        if again["specialist"] > again["base"]:
            expected = (again["merged"] - again["base"]) / (again["specialist"] - again["base"])
            assert math.isclose(again["retention"], expected, abs_tol=1e-4)
        else:
            assert again["retention"] is None and row["retention_interval"] is None
        versus, = row["versus_first_specialist"]  # v1 against the first-round specialist: the same two models,
        # reused from the re-measure; played afresh, they give the same row
        fresh, = versus_first_specialists(cfg.out, [skill], 1, 16)[skill]
        assert (fresh.merged, fresh.specialist, fresh.wins, fresh.losses) == (
            versus["merged"], versus["specialist"], versus["wins"], versus["losses"])
        assert versus["version"] == 1 and (versus["merged"], versus["specialist"]) == (again["merged"], again["specialist"])
        assert versus["wins"] - versus["losses"] == round(16 * (again["merged"] - again["specialist"]))
        if row["retention_interval"] is not None:
            lo, hi = row["retention_interval"]
            assert lo <= hi
    run = f"ties(density={MergePolicy().density:g}, lambda=1)"  # the network's default merge
    assert list(report["methods"]) == [run, "task_arithmetic(lambda=1)"]  # the run's, then the re-merge
    assert report["history"][0]["included"] == 2  # both skills' deltas went into v1
    assert phases[-1] == "done" and "comparing" in phases and "remeasuring" in phases
    assert report["interval_level"] == 0.9 and report["retain"] == 1.0 and report["retention_n"] == 16
    # each worker kept the network's other skill: the retain loss ran, and saw its policy move
    records = [json.loads(line) for line in
               (specialist_dir(cfg.out / "nodes" / "worker-reverse", "reverse", 0).parent / "metrics.jsonl").open()]
    assert records[0]["settings"]["retain_skills"] == ["reverse", "sort"]
    assert max(r.get("retain_kl", 0.0) for r in records if r.get("kind") == "step") > 0

    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(cfg.out / "final")
    AutoTokenizer.from_pretrained(cfg.out / "final")
    assert (cfg.out / "final" / "manifest.json").is_file()

    deadline = time.monotonic() + 15
    while _new_children(before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _new_children(before), "the demo left processes running"


def test_a_sigterm_to_the_demo_stops_its_swarm(nano_model: Path, tmp_path: Path) -> None:
    """`kill <demo>` (a scheduler, a CI timeout) must not leave the bootstrap, coordinator and workers running."""
    out = tmp_path / "demo"
    script = ("import sys; from pathlib import Path; from skillswarm.node.demo import DemoConfig, run_demo; "
              "run_demo(DemoConfig(out=Path(sys.argv[1]), skills=['reverse'], rounds=1, steps_per_round=1000, "
              "minutes_per_round=None, eval_n=8, retention_n=16, group_size=4, batch=2, timeout_s=300), Path(sys.argv[2]))")
    env = {**os.environ, "SKILLSWARM_HOME": str(tmp_path / "home")}
    demo = subprocess.Popen([sys.executable, "-c", script, str(out), str(nano_model)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    swarm: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        started: list[psutil.Process] = []
        while time.monotonic() < deadline and demo.poll() is None:
            started = [p for p in psutil.Process(demo.pid).children() if "run" in " ".join(p.cmdline())]
            if any("node" in p.cmdline() for p in started) and (out / "logs" / "worker-reverse.log").exists():
                break
            time.sleep(0.5)
        assert demo.poll() is None and any("node" in p.cmdline() for p in started), "the demo's worker never started"
        swarm += psutil.Process(demo.pid).children(recursive=True)
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(120) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(swarm, timeout=30)
        assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
    finally:  # whatever the outcome, nothing this test started outlives it
        for p in swarm:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        if demo.poll() is None:
            demo.kill()
            demo.wait(10)

"""Whole training runs on a real nano model: a killed run resumes from its checkpoint with the same
optimizer state and ends where an uninterrupted run ends; async generation in its own process
overlaps training and stops cleanly; `skillswarm train` and `skillswarm report` from the CLI."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from skillswarm.merge import read_delta
from skillswarm.node.rl.config import TrainConfig
from skillswarm.node.rl.run import train
from skillswarm.node.rl.rundir import load_checkpoint, read_metrics
from tests.conftest import run_cli

pytestmark = pytest.mark.slow

# arith: the test base solves about 1% of sampled episodes, so groups of 8 (not 4) give a step its signal in a few
# batches on every torch build (with 4, torch 2.4.1's sampling at seed 0 went 50 batches without one)
FAST = dict(skill="arith", group_size=8, batch=2, max_new_tokens=16, eval_n=8, lr=1e-4)


class Crash(RuntimeError):
    pass


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def test_a_killed_run_resumes_with_the_same_optimizer_state(nano_model: Path, tmp_path: Path) -> None:
    whole = train(TrainConfig(model_dir=nano_model, steps=3, out_dir=tmp_path / "whole", sync=True, save_every=0, **FAST),
                  progress=False)

    def crash_at_3(metrics: dict) -> None:
        if metrics["step"] == 3:
            raise Crash("killed")

    cfg = TrainConfig(model_dir=nano_model, steps=3, out_dir=tmp_path / "killed", sync=True, save_every=2, **FAST)
    with pytest.raises(Crash):
        train(cfg, progress=False, on_step=crash_at_3)
    saved = load_checkpoint(tmp_path / "killed")
    assert saved is not None and saved["step"] == 2
    seen: list[int] = []
    cfg.resume = True
    resumed = train(cfg, progress=False, on_step=lambda m: seen.append(m["step"]))
    assert seen == [3] and resumed.stats.steps == 3
    steps = [r["step"] for r in read_metrics(resumed.metrics_path) if r["kind"] == "step"]
    assert steps == [1, 2, 3]  # the crashed step 3 was cut from the log and redone once
    # the same end as the uninterrupted run: weights and every AdamW moment tensor
    a, b = load_checkpoint(tmp_path / "whole"), load_checkpoint(tmp_path / "killed")
    assert a["step"] == b["step"] == 3
    opt_a, opt_b = a["trainer"]["optimizer"]["state"], b["trainer"]["optimizer"]["state"]
    assert opt_a.keys() == opt_b.keys() and opt_a
    for k in opt_a:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt_a[k][name], opt_b[k][name], rtol=0, atol=1e-7)
    for name, w in _weights(whole.model_dir).items():
        torch.testing.assert_close(w, _weights(resumed.model_dir)[name], rtol=0, atol=1e-6)
    assert resumed.stats.accuracy_before == whole.stats.accuracy_before
    with pytest.raises(Exception, match="already holds a training run"):
        train(TrainConfig(model_dir=nano_model, steps=1, out_dir=tmp_path / "killed", sync=True, **FAST), progress=False)


def test_async_run_overlaps_generation_and_writes_model_and_delta(nano_model: Path, tmp_path: Path) -> None:
    records: list[dict] = []
    # a slow trainer (4 optimizer steps per batch, one sequence per pass) so the generator runs ahead of it
    result = train(TrainConfig(model_dir=nano_model, steps=5, out_dir=tmp_path / "run", save_every=2, max_staleness=3,
                               async_mode="process", mini_batches=4, micro_batch=1, **FAST),
                   progress=False, on_step=records.append)
    assert not multiprocessing.active_children()  # the generator process is gone
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and all(r["mode"] == "process" for r in records)
    staleness = [int(k) for r in records for k in r["staleness"]]
    assert max(staleness) >= 1  # batches were generated while the trainer trained on earlier ones
    stats = result.stats
    assert stats.steps == 5 and stats.samples > 0 and stats.tokens > 0 and stats.mean_staleness > 0
    assert stats.accuracy_before is not None and stats.accuracy_after is not None and stats.eval_n == 8
    assert stats.engine == "hf" and not stats.lora
    # the trained model is a loadable HF directory whose weights moved; the delta says by how much
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(result.model_dir)
    AutoTokenizer.from_pretrained(result.model_dir)
    base, tuned = _weights(nano_model), _weights(result.model_dir)
    assert any(not torch.equal(base[k], tuned[k]) for k in base)
    name = next(k for k in base if not torch.equal(base[k], tuned[k]))
    with read_delta(result.delta.path) as delta:
        torch.testing.assert_close(delta.get(name), (tuned[name] - base[name]).to(torch.bfloat16).float())
    summary = json.loads((result.run_dir / "result.json").read_text())
    assert summary["stats"]["steps"] == 5 and summary["delta"]["sha256"] == result.delta.sha256


def test_train_and_report_from_the_cli(nano_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli-run"
    proc = run_cli("train", "--model", str(nano_model), "--skill", "reverse", "--steps", "2", "--out", str(out),
                   "--group-size", "4", "--batch", "2", "--max-new-tokens", "16", "--eval-n", "6", "--lora",
                   "--lora-rank", "2", "--codec", "lora", "--async-mode", "thread", "--json", timeout=300)
    data = json.loads(proc.stdout)
    assert data["stats"]["steps"] == 2 and data["stats"]["lora"] is True and data["delta"]["codec"] == "lora"
    assert Path(data["model_dir"], "config.json").is_file()
    report = json.loads(run_cli("report", str(out), "--json").stdout)
    assert sorted(Path(p).name for p in report["plots"]) == ["accuracy.png", "outcomes.png", "reward.png", "staleness.png"]
    assert all(Path(p).read_bytes()[:4] == b"\x89PNG" for p in report["plots"])
    assert report["steps"] == 2 and [s for s, _ in report["accuracy"]] == [0, 2]
    bad = run_cli("train", "--model", str(nano_model), "--skill", "nope", "--steps", "1", "--out", str(tmp_path / "x"),
                  check=False)
    assert bad.returncode == 1 and "unknown skill" in bad.stderr
    missing = run_cli("report", str(tmp_path / "nothing"), check=False)
    assert missing.returncode == 1 and "no training metrics" in missing.stderr


def test_the_time_cap_counts_training_not_set_up(nano_model: Path, tmp_path: Path) -> None:
    """`max_minutes` caps the step loop: loading, the anchors and the first eval took calc's demo worker 30-60 s of
    a 2-minute round on a slow machine, so its rounds ended at 12 of 50 steps when they counted."""
    import time

    from skillswarm.node.rl.run import _Run

    cfg = TrainConfig(model_dir=nano_model, steps=3, out_dir=tmp_path / "run", max_minutes=0.001, **FAST)  # 60 ms
    run = _Run(cfg, 1, False, None, multiprocessing.Event())
    time.sleep(0.1)  # set-up outlasting the cap
    assert not run._deadline_passed()
    run.training_since = time.monotonic() - 0.1  # the step loop began 100 ms ago
    assert run._deadline_passed()

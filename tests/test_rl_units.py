"""The RL engine's bookkeeping without a model: group classification and advantages per variant, the
feed's dropping/filtering/counting, batch collation, run-directory rules and the metrics log."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch

from skillswarm.node.rl import groups as groups_mod
from skillswarm.node.rl.config import TrainConfig
from skillswarm.node.rl.groups import Batch, Feed, Group, Sample, make_group, split_groups
from skillswarm.node.rl.rollout import Rollout
from skillswarm.node.rl.rundir import MetricsLog, prepare_run_dir, read_metrics
from skillswarm.node.rl.trainer import collate
from skillswarm.protocol.errors import TrainError
from skillswarm.skills.episode import Episode
from skillswarm.skills.taskbank import Task

TASK = Task(id="arith:1+1", prompt="1+1", answer="2")


def _rollout(reward: float, outcome: str = "ok") -> Rollout:
    ep = Episode(skill="arith", task_id=TASK.id, seed=0, messages=[], turns=[], outcome=outcome,  # type: ignore[arg-type]
                 stop_reason="answer", correct=reward == 1.0, reward=reward)
    return Rollout(episode=ep, token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -0.5, -0.1], prompt_len=1)


def _sample(reward: float, outcome: str = "ok") -> Sample:
    return Sample([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.1], reward, reward == 1.0, outcome)


def _group(version: int, status: str = "ok", rewards: tuple[float, ...] = (1.0, 0.0)) -> Group:
    return Group("t", [_sample(r) for r in rewards], [0.7, -0.7], version, status)  # type: ignore[arg-type]


def test_group_advantages_by_variant_against_hand_values() -> None:
    s = 0.5 / math.sqrt(1 / 3)  # rewards 1,0,0,1: mean 0.5, unbiased std sqrt(1/3)
    rollouts = [_rollout(1.0), _rollout(0.0), _rollout(0.0), _rollout(1.0)]
    for variant, expected in (("grpo", [s, -s, -s, s]), ("dapo", [s, -s, -s, s]), ("dr_grpo", [0.5, -0.5, -0.5, 0.5])):
        g = make_group(TASK, rollouts, variant, policy_version=3)  # type: ignore[arg-type]
        assert g.status == "ok" and g.policy_version == 3
        assert g.advantages == pytest.approx(expected, rel=1e-5), variant
    # a timeout is kept, graded 0: it gets a negative advantage next to a success
    g = make_group(TASK, [_rollout(1.0), _rollout(0.0, "timeout")], "dr_grpo", 0)
    assert g.status == "ok" and g.advantages == pytest.approx([0.5, -0.5]) and g.samples[1].outcome == "timeout"


def test_env_error_and_zero_variance_groups_are_classified() -> None:
    g = make_group(TASK, [_rollout(1.0), _rollout(0.0, "env_error")], "grpo", 0)
    assert g.status == "env_error" and g.advantages == [0.0, 0.0]
    g = make_group(TASK, [_rollout(1.0), _rollout(1.0), _rollout(1.0)], "grpo", 0)
    assert g.status == "zero_variance" and g.advantages == [0.0, 0.0, 0.0]
    g = make_group(TASK, [_rollout(0.0, "timeout"), _rollout(0.0, "tool_error")], "grpo", 0)
    assert g.status == "zero_variance"


class ListSource:
    """Prepared batches, in order (what an orchestrator would have produced)."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = list(batches)

    async def next_batch(self) -> Batch:
        return self.batches.pop(0)


def test_stale_groups_are_dropped_and_everything_is_counted() -> None:
    parts = split_groups([_group(2), _group(3), _group(5), _group(5, "env_error"), _group(5, "zero_variance")],
                         version=5, max_staleness=2)
    assert [g.policy_version for g in parts["ok"]] == [3, 5] and [g.policy_version for g in parts["stale"]] == [2]
    assert len(parts["env_error"]) == 1 and len(parts["zero_variance"]) == 1

    batches = [Batch(0, [_group(2), _group(5, "env_error"), _group(4)], 2, tokens=10),
               Batch(1, [_group(5, "zero_variance", (0.0, 0.0)), _group(5)], 5, tokens=20),
               Batch(2, [_group(5)], 5)]
    feed = Feed(ListSource(batches), max_staleness=1)
    data = asyncio.run(feed.take(2, version=5, should_stop=lambda: False))
    assert data is not None and data.batches == 2 and data.last_batch == 1  # whole batches until 2 usable groups
    assert [g.policy_version for g in data.groups] == [4, 5]
    summary = data.summary()
    assert summary["stale_groups"] == 1 and summary["env_error_groups"] == 1 and summary["zero_variance_groups"] == 1
    assert summary["episodes"] == 10 and summary["staleness"] == {1: 1, 0: 1} and summary["gen_tokens"] == 30
    c = feed.counters
    assert (c["stale_groups"], c["env_error_groups"], c["zero_variance_groups"], c["ok_groups"]) == (1, 1, 1, 2)
    assert c["samples"] == 4 and c["tokens"] == 8 and c["episodes"] == 10 and c["staleness_hist"] == {"1": 1, "0": 1}
    resumed = Feed(ListSource([]), 1, json.loads(json.dumps(c)))  # counters survive a checkpoint round trip
    assert resumed.counters == c


def test_feed_stops_when_asked_and_gives_up_without_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    assert asyncio.run(Feed(ListSource([]), 2).take(1, 0, should_stop=lambda: True)) is None
    monkeypatch.setattr(groups_mod, "MAX_BARREN_BATCHES", 3)
    barren = [Batch(i, [_group(0, "zero_variance")], 0) for i in range(5)]
    with pytest.raises(TrainError, match="no group with reward variance"):
        asyncio.run(Feed(ListSource(barren), 2).take(1, 0, should_stop=lambda: False))


def test_collate_shifts_masks_and_behaviour_logprobs_onto_targets() -> None:
    a = Sample([5, 6, 7, 8], [0, 0, 1, 1], [0.0, 0.0, -0.3, -0.4], 1.0, True, "ok")
    b = Sample([5, 9], [0, 1], [0.0, -0.9], 0.0, False, "ok")
    batch = collate([a, b], [1.0, -1.0], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [5, 9, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1], [1, 0, 0]]  # column t: is token t+1 the model's?
    torch.testing.assert_close(batch.behaviour_logp, torch.tensor([[0.0, -0.3, -0.4], [-0.9, 0.0, 0.0]]))
    assert batch.advantages.tolist() == [1.0, -1.0] and batch.lengths == [4, 2]
    with pytest.raises(ValueError, match="differ in length"):
        collate([Sample([1, 2], [0], [0.0], 0.0, False, "ok")], [0.0], 0)


def test_bad_settings_and_run_directories_are_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(TrainError, match="loss must be one of"):
        TrainConfig(model_dir=tiny_model_dir, skill="arith", loss="ppo").validate()
    with pytest.raises(TrainError, match="not a model directory"):
        TrainConfig(model_dir=tmp_path / "nope", skill="arith").validate()
    with pytest.raises(TrainError, match="codec"):
        TrainConfig(model_dir=tiny_model_dir, skill="arith", codec="zip").validate()
    if not torch.cuda.is_available():
        with pytest.raises(TrainError, match="vllm engine cannot run here"):
            TrainConfig(model_dir=tiny_model_dir, skill="arith", engine="vllm").validate()
    settings = TrainConfig(model_dir=tiny_model_dir, skill="arith", out_dir=tmp_path / "run").settings()
    assert prepare_run_dir(tmp_path / "run", settings, resume=False) is False
    with pytest.raises(TrainError, match="pass --resume"):
        prepare_run_dir(tmp_path / "run", settings, resume=False)
    with pytest.raises(TrainError, match="skill: 'arith' -> 'sort'"):
        prepare_run_dir(tmp_path / "run", {**settings, "skill": "sort"}, resume=True)
    assert prepare_run_dir(tmp_path / "run", {**settings, "steps": 10_000}, resume=True) is False  # no checkpoint yet


def test_metrics_log_survives_a_torn_line_and_truncates_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    m = MetricsLog(path)
    for step in range(1, 5):
        m.write({"kind": "step", "step": step, "reward": float("nan") if step == 2 else 0.5})
    m.write({"kind": "eval", "step": 4, "accuracy": 0.3})
    m.close()
    with path.open("a") as f:
        f.write('{"kind": "step", "st')  # killed mid-write
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 4] and records[1]["reward"] is None
    kept = MetricsLog.truncate(path, 2)
    assert [r["step"] for r in kept] == [1, 2] and [r["step"] for r in read_metrics(path)] == [1, 2]


def _write_and_die(q) -> None:  # a generator killed while its queue's feeder thread writes a batch
    import os as _os
    import time as _time

    q.put(b"x" * 4_000_000)
    _time.sleep(0.3)  # the feeder has written the first 64 KiB and waits for a reader
    _os._exit(0)


def test_draining_a_half_written_batch_does_not_hang() -> None:
    import multiprocessing
    import time

    from skillswarm.node.rl.sources import drain

    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_write_and_die, args=(q,), daemon=True)
    p.start()
    p.join(30)
    assert p.exitcode == 0
    t = time.monotonic()
    assert drain(q, timeout=1.0) is False  # the rest of the message never comes: the caller is not blocked
    assert time.monotonic() - t < 10
    empty = ctx.Queue()
    assert drain(empty, timeout=1.0) is True

"""Weight-0 rubric metrics and experiment trackers: what metrics.jsonl holds, `eval` shows, and
`--report-to tensorboard|wandb` sends (read back from the files the trackers wrote)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.slow


def test_rubric_metrics_reach_eval_metrics_and_trackers(nano_model: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from skillswarm.node.rl.config import TrainConfig
    from skillswarm.node.rl.run import train

    shown = json.loads(run_cli("eval", "--skill", "calc", "--model", str(nano_model), "--n", "8", "--json").stdout)
    assert {"exact_answer", "good_call", "tool_calls_made"} <= set(shown["rubric"])  # tool_calls_made: weight 0

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    result = train(TrainConfig(model_dir=nano_model, skill="calc", steps=2, batch=2, group_size=4, eval_n=4, eval_every=0,
                               out_dir=tmp_path / "run", sync=True, report_to=("tensorboard", "wandb")), progress=False)
    records = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert "tool_calls_made" in steps[0]["rubric"] and "tool_calls_made" in evals[-1]["rubric"]

    board = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {"train/reward", "train/loss", "train/rubric/tool_calls_made", "eval/accuracy",
            "eval/rubric/tool_calls_made"} <= tags
    assert [e.step for e in board.Scalars("train/reward")] == [1, 2]
    assert [e.value for e in board.Scalars("train/reward")] == pytest.approx([s["reward"] for s in steps])

    # an offline wandb run: its history records (protobuf, in the run's .wandb file) name every scalar
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    held = run_file.read_bytes()
    assert held.startswith(b":W&B") and all(k.encode() in held for k in ("train/reward", "train/rubric/tool_calls_made",
                                                                          "eval/accuracy", "eval/rubric/good_call"))

    proc = run_cli("train", "--skill", "calc", "--model", str(nano_model), "--report-to", "mlflow", "--out", str(tmp_path / "x"),
                   check=False)
    assert proc.returncode == 1 and "--report-to 'mlflow' is not a tracker" in " ".join(proc.stderr.split())

"""A worker's training settings: one typed WorkerSettings from `node run`'s flags or its --settings file, through the
Worker to its round's TrainConfig; a bad file is one clear line naming the file."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from skillswarm.node.rl.config import TrainConfig, WorkerSettings, default_of, load_settings, save_settings
from skillswarm.protocol.errors import TrainError
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.netspec import new_network, save_spec
from skillswarm.protocol.records import CheckpointManifest
from tests.conftest import run_cli

CHANGED = WorkerSettings(engine="vllm", lora=True, steps_per_round=7, minutes_per_round=2.5, group_size=4, batch=3,
                         lr=1e-3, threads=1, eval_n=16, retain=0.5, report_to=("tensorboard",))


def _network(tmp_path: Path) -> Path:
    spec = new_network("n", "base", "ab" * 32, ["arith", "sort"], [Identity.generate().public_key_hex])
    return save_spec(spec, tmp_path / "net.toml")


@pytest.mark.parametrize("name", ["settings.toml", "settings.json"])
def test_a_settings_file_round_trips(tmp_path: Path, name: str) -> None:
    assert load_settings(save_settings(CHANGED, tmp_path / name)) == CHANGED
    assert load_settings(save_settings(WorkerSettings(), tmp_path / name)) == WorkerSettings()
    (tmp_path / "partial.toml").write_text("group_size = 4\n")  # a field left out keeps its default
    assert load_settings(tmp_path / "partial.toml") == WorkerSettings(group_size=4)


def test_every_setting_defaults_to_train_configs() -> None:
    defaults = WorkerSettings()
    for name in ("engine", "lora", "group_size", "batch", "lr", "threads", "eval_n", "retain", "report_to"):
        assert getattr(defaults, name) == default_of(TrainConfig, name), name


@pytest.mark.parametrize("text, problem", [
    ("group_size = 1\n", "setting `group_size`: Expected `int` >= 2"),
    ("batch = 'eight'\n", "setting `batch`: Expected `int`, got `str`"),
    ("groupsize = 8\n", "unknown setting `groupsize`"),
    ("engine = 'tpu'\n", "engine must be one of hf, vllm"),
    ("group_size = [\n", "is not valid TOML"),
])
def test_a_bad_settings_file_is_one_line_naming_the_file(tmp_path: Path, text: str, problem: str) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(TrainError, match="settings file"):
        load_settings(bad)
    proc = run_cli("node", "run", "--network", str(_network(tmp_path)), "--skill", "arith", "--settings", str(bad),
                   check=False)
    line = " ".join(proc.stderr.split())
    assert proc.returncode == 1 and f"settings file {bad}" in line and problem in line, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 2  # one line (rich may wrap it)
    missing = run_cli("node", "run", "--network", str(_network(tmp_path)), "--skill", "arith", "--settings",
                      str(tmp_path / "none.toml"), check=False)
    assert missing.returncode == 1 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr


def _run_node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *args: str) -> Any:
    """`skillswarm node run ARGS` in this process with the network and the worker faked: the WorkerOptions it built."""
    import skillswarm.node.network.session as session
    import skillswarm.node.roles.worker as worker
    from typer.testing import CliRunner

    from skillswarm.node.cli.app import app

    network = _network(tmp_path)
    built: list[Any] = []

    @contextlib.contextmanager
    def open_session(path: Path, **kwargs: Any) -> Iterator[Any]:
        from skillswarm.protocol.netspec import load_spec

        yield SimpleNamespace(spec=load_spec(path), identity=SimpleNamespace(peer_id="peer"), store=None, blobs=None,
                              dht=SimpleNamespace(visible_maddrs=lambda: ["/ip4/127.0.0.1/tcp/1"], served_bytes=lambda: 0))

    class FakeWorker:
        def __init__(self, spec: Any, identity: Any, dht: Any, store: Any, blobs: Any, options: Any, **kw: Any) -> None:
            built.append(options)

        def start_heartbeat(self) -> None:
            pass

        def run(self, stop: threading.Event, **kw: Any) -> int:
            return 0

    monkeypatch.setattr(session, "open_session", open_session)
    monkeypatch.setattr(session, "stop_on_signals", lambda: contextlib.nullcontext(threading.Event()))
    monkeypatch.setattr(worker, "Worker", FakeWorker)
    result = CliRunner().invoke(app, ["node", "run", "--network", str(network), "--skill", "arith", *args])
    assert result.exit_code == 0, (result.output, result.exception)
    (options,) = built
    return options


def test_node_run_takes_the_settings_file_and_flags_given_override_it(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    assert _run_node(monkeypatch, tmp_path).settings == WorkerSettings()  # neither: the defaults
    file = save_settings(CHANGED, tmp_path / "settings.toml")
    options = _run_node(monkeypatch, tmp_path, "--settings", str(file), "--no-progress")
    assert options.skill == "arith" and options.settings == CHANGED and options.progress is False
    options = _run_node(monkeypatch, tmp_path, "--settings", str(file), "--group-size", "6", "--engine", "hf",
                        "--no-lora", "--report-to", "wandb")
    assert options.settings == WorkerSettings(engine="hf", lora=False, steps_per_round=7, minutes_per_round=2.5,
                                              group_size=6, batch=3, lr=1e-3, threads=1, eval_n=16, retain=0.5,
                                              report_to=("wandb",))
    # a flag given at its default value still overrides the file
    assert _run_node(monkeypatch, tmp_path, "--settings", str(file), "--batch", "8").settings.batch == 8


def test_the_worker_trains_its_round_with_its_settings(tmp_path: Path) -> None:
    from skillswarm.node.checkpoints.store import CheckpointStore
    from skillswarm.node.roles.worker import ROUND_EVAL_EVERY, ROUND_SAVE_EVERY, Worker, WorkerOptions
    from skillswarm.protocol.netspec import load_spec
    from skillswarm.protocol.transport.blobs import BlobStore

    spec = load_spec(_network(tmp_path))
    v1 = CheckpointManifest(network="n", version=1, weights_hash="cd" * 32, parent_version=0, parent_hash="ab" * 32,
                            files=[])

    def config(settings: WorkerSettings) -> TrainConfig:
        worker = Worker(spec, Identity.generate(), None, CheckpointStore(tmp_path / "store"), BlobStore(tmp_path / "b"),
                        WorkerOptions(skill="arith", settings=settings))
        return worker.round_config(v1)

    cfg = config(CHANGED)
    assert (cfg.engine, cfg.lora, cfg.steps, cfg.max_minutes) == ("vllm", True, 7, 2.5)
    assert (cfg.group_size, cfg.batch, cfg.lr, cfg.threads, cfg.eval_n, cfg.retain) == (4, 3, 1e-3, 1, 16, 0.5)
    assert cfg.report_to == ("tensorboard",) and cfg.codec == "lora"  # LoRA publishes the adapter itself
    assert (cfg.eval_every, cfg.save_every) == (ROUND_EVAL_EVERY, ROUND_SAVE_EVERY)
    plain = config(WorkerSettings())
    assert plain.steps == spec.round.steps_per_round and plain.codec == spec.codec and plain.max_minutes is None
    for name in ("engine", "group_size", "batch", "lr", "threads", "eval_n", "retain", "report_to"):
        assert getattr(plain, name) == default_of(TrainConfig, name), name

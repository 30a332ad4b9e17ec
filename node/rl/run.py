"""A training run: async multi-turn GRPO on one skill shard, from a model directory to a trained model
and its delta. What `skillswarm train` and the worker call:

    result = train(TrainConfig(model_dir=..., skill="arith", steps=200, out_dir=...), progress=True,
                   on_step=callback, stop=threading_event)

The loop: a source (`skillswarm.node.rl.sources`) plays generation batches of groups; each step takes
whole batches until it holds at least `batch` fresh groups with signal (env_error groups dropped,
zero-variance groups filtered, groups older than `max_staleness` policy versions dropped; all
counted), takes one GRPO step, and publishes the new weights to the generator. Held-out eval every
`eval_every` steps, a run checkpoint every `save_every` steps, metrics to JSONL. The run ends at
`steps`, at `max_minutes`, or when `stop` is set (after the current step); then it writes the trained
model (HF format) and the delta against the starting model.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from skillswarm.node.rl.config import TrainConfig
from skillswarm.node.rl.engines import load_engine
from skillswarm.node.rl.engines.hf import HFEngine, load_model_dir
from skillswarm.node.rl.evaluation import evaluate
from skillswarm.node.rl.groups import Feed, SourceDrained, StepData
from skillswarm.node.rl.orchestrator import Orchestrator
from skillswarm.node.rl.outputs import save_outputs, train_stats, write_result
from skillswarm.node.rl.rundir import METRICS, MetricsLog, load_checkpoint, prepare_run_dir, save_checkpoint
from skillswarm.node.rl.sources import GeneratorSpec, Mailbox, ProcessSource, SyncSource, ThreadSource, model_threads
from skillswarm.node.rl.trainer import Trainer
from skillswarm.node.rl.verifiers_check import VERIFIERS_PREFIX
from skillswarm.node.rl.tracking import open_trackers
from skillswarm.protocol.errors import TrainError
from skillswarm.protocol.records import TrainStats

log = logging.getLogger(__name__)

ENDPOINT_MODES = ("live", "verifiers")
# Where a run that serves its policy through the recording endpoint gets its batches: (settings, trainer, run
# directory, device, skill or None, first batch, should-stop check) -> (source, publish(weights, version)).
# The endpoint provides it (skillswarm.node.endpoint.training.endpoint_source); the caller passes it in, as
# `skillswarm train` does.
EndpointSource = Callable[[TrainConfig, Any, Path, str, Any, int, Callable[[], bool]],
                          tuple[Any, Callable[[Any, int], None]]]


@dataclass
class TrainResult:
    """What a run produced: the trained model directory, its delta, the metrics log and the stats."""

    model_dir: Path
    delta: Any  # skillswarm.merge.DeltaInfo, or None when codec is None
    metrics_path: Path
    stats: TrainStats
    run_dir: Path
    evals: list[dict[str, Any]] = field(default_factory=list)
    adapter_dir: Path | None = None  # a LoRA run's PEFT adapter (adapter_config.json + adapter_model.safetensors)


def train(cfg: TrainConfig, progress: bool = True, on_step: Callable[[dict[str, Any]], None] | None = None,
          stop: threading.Event | None = None, endpoint_source: EndpointSource | None = None) -> TrainResult:
    """Run GRPO as configured; see the module docstring. Safe to call from a thread that runs an event loop.
    A run that serves its policy through the recording endpoint (`live`, `verifiers`) needs `endpoint_source`."""
    cfg.validate()
    if cfg.mode() in ENDPOINT_MODES and endpoint_source is None:
        raise TrainError(f"a {cfg.mode()} run plays against the recording endpoint: pass train() an endpoint_source "
                         "(skillswarm.node.endpoint.training.endpoint_source)")
    threads = model_threads(cfg.model_dir, cfg.threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run = _Run(cfg, threads, progress, on_step, stop or threading.Event(), endpoint_source)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(run.main())
        box: dict[str, Any] = {}  # called from inside an event loop: run ours on a fresh thread

        def target() -> None:
            try:
                box["result"] = asyncio.run(run.main())
            except BaseException as e:
                box["error"] = e

        t = threading.Thread(target=target, name="skillswarm-train")
        t.start()
        t.join()
        if "error" in box:
            raise box["error"]
        return box["result"]
    finally:
        torch.set_num_threads(previous)


class _Run:
    def __init__(self, cfg: TrainConfig, threads: int, progress: bool, on_step: Callable[[dict[str, Any]], None] | None,
                 stop: threading.Event, endpoint_source: EndpointSource | None = None) -> None:
        self.cfg, self.threads, self.show_progress, self.on_step, self.stop = cfg, threads, progress, on_step, stop
        self.endpoint_source = endpoint_source
        self.run_dir = cfg.out_dir
        self.metrics_path = self.run_dir / METRICS
        self.device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.mode = cfg.mode()
        self.started = time.monotonic()
        self.training_since: float | None = None  # when the step loop began: `max_minutes` counts from here
        self.evals: list[dict[str, Any]] = []

    # ---- set-up --------------------------------------------------------------------------------------
    def _setup(self) -> None:
        from skillswarm.skills.registry import get_skill, skill_names

        cfg = self.cfg
        name = cfg.external_name()
        plain = name is None and not cfg.skill.startswith(VERIFIERS_PREFIX)
        self.skill = get_skill(cfg.skill if name is None else name) if plain or name in skill_names() else None
        self.eval_n = cfg.eval_n if self.skill is not None else 0  # recorded trajectories of no known skill: no eval
        resuming = prepare_run_dir(self.run_dir, cfg.settings(), cfg.resume)
        model, self.tokenizer = load_model_dir(cfg.model_dir, self.device)
        self.dtype = _stored_dtype(model)
        self.eval_engine: Any = None
        if self.mode != "sync" and cfg.engine == "hf" and self.eval_n > 0:  # eval apart from the generator's engine
            self.eval_engine = HFEngine(copy.deepcopy(model), self.tokenizer, self.device)
        model = model.float()  # fp32 master weights
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.trainer = Trainer(model, int(pad), cfg.loss_config(), cfg.optim_config(), self.device)
        if cfg.retain > 0 and cfg.retain_skills:  # the starting policy's episodes (before a checkpoint is restored)
            from skillswarm.node.rl.anchor import anchor_episodes

            engine = self.eval_engine or HFEngine(copy.deepcopy(model), self.tokenizer, self.device)
            self.trainer.set_retain(anchor_episodes(engine, cfg.retain_skills, cfg.skill, cfg.retain_n, cfg.seed,
                                                    cfg.retain_fragile))
        self.state: dict[str, Any] = {"step": 0, "seconds": 0.0, "next_batch": 0, "accuracy_before": None}
        self.feed_counters: dict[str, Any] = {}
        checkpoint = load_checkpoint(self.run_dir) if resuming else None
        if checkpoint is not None:
            self.trainer.load_state_dict(checkpoint["trainer"])
            self.state.update(checkpoint["progress"]["state"])
            self.feed_counters = checkpoint["progress"]["feed"]
            records = MetricsLog.truncate(self.metrics_path, int(checkpoint["step"]))
            self.evals = [r for r in records if r.get("kind") == "eval"]
            log.info("resuming %s at step %d", self.run_dir, checkpoint["step"])
        else:
            MetricsLog.truncate(self.metrics_path, -1)
        self.metrics = MetricsLog(self.metrics_path, open_trackers(cfg.report_to, self.run_dir, self.run_dir.name,
                                                                   cfg.settings()))
        self.metrics.write({"kind": "start", "step": self.state["step"], "mode": self.mode, "threads": self.threads,
                            "resumed": checkpoint is not None, "settings": cfg.settings()})

    def _source(self) -> Any:
        cfg, start = self.cfg, int(self.state["next_batch"])
        if self.mode == "store":
            from skillswarm.node.rl.store_source import StoreSource

            self.engine, self.publish = None, None
            return StoreSource(cfg.store, cfg.external_name(), cfg.batch, cfg.loss, cfg.temperature, start,  # type: ignore[arg-type]
                               cfg.store_wait_s)
        if self.mode in ENDPOINT_MODES:  # an endpoint on its own engine, serving each new policy: harnesses (live)
            assert self.endpoint_source is not None  # or the environment (verifiers) play against it; train() checks
            self.engine = None
            source, self.publish = self.endpoint_source(cfg, self.trainer, self.run_dir, self.device, self.skill, start,
                                                        lambda: self.stop.is_set() or self._deadline_passed())
            return source
        if self.mode == "process":
            spec = GeneratorSpec(cfg.engine, str(cfg.model_dir), cfg.skill, cfg.rollout_config(), start, self.threads,
                                 cfg.device, logging.getLogger("skillswarm").getEffectiveLevel())
            source = ProcessSource(spec, self.trainer.engine_weights(), self.trainer.version, cfg.queue_depth)
            self.publish = source.mailbox.publish
            self.engine = None
            return source
        self.engine = load_engine(cfg.engine, cfg.model_dir, device=self.device)
        mailbox = Mailbox()
        if self.trainer.version > 0:
            mailbox.publish(self.trainer.engine_weights(), self.trainer.version)
        self.publish, self.mailbox = mailbox.publish, mailbox
        orchestrator = Orchestrator(self.engine, self.skill, cfg.rollout_config())
        if self.eval_engine is None and self.eval_n > 0:
            self.eval_engine = self.engine
        if self.mode == "sync":
            return SyncSource(orchestrator, mailbox, start)
        return ThreadSource(orchestrator, mailbox, start, cfg.queue_depth)

    # ---- the loop ------------------------------------------------------------------------------------
    async def main(self) -> TrainResult:
        await asyncio.to_thread(self._setup)
        source = None
        bar = _Bar(self.cfg, self.state["step"]) if self.show_progress else None
        try:
            source = await asyncio.to_thread(self._source)
            await source.start()  # a generator process loads its model while the base model is evaluated
            if self.state["accuracy_before"] is None and self.eval_n > 0:
                self.state["accuracy_before"] = (await self._eval())["accuracy"]
            feed = Feed(source, self.cfg.max_staleness, self.feed_counters)
            with bar or _nothing():
                await self._loop(feed, bar)
            await source.close()
            after = None
            if self.eval_n > 0:
                last = self.evals[-1] if self.evals else None
                after = last if last is not None and last["step"] == self.state["step"] else await self._eval()
            return await asyncio.to_thread(self._finish, after)
        finally:
            if source is not None:
                await source.close()
            self.metrics.close()

    def _deadline_passed(self) -> bool:
        """Whether `max_minutes` of training are spent. Loading, the anchors and the first eval do not count: they
        cost calc's worker 30-60 s before its first step on a slow machine, and its 2-minute demo rounds ended at
        12-23 of 50 steps."""
        since, cap = self.training_since, self.cfg.max_minutes
        return cap is not None and since is not None and time.monotonic() - since >= cap * 60

    async def _loop(self, feed: Feed, bar: "_Bar | None") -> None:
        cfg, trainer = self.cfg, self.trainer
        last_save = self.state["step"]
        self.training_since = time.monotonic()
        while self.state["step"] < cfg.steps and not self.stop.is_set() and not self._deadline_passed():
            t0 = time.monotonic()
            try:
                data = await feed.take(cfg.batch, trainer.version, lambda: self.stop.is_set() or self._deadline_passed())
            except SourceDrained as e:
                log.info("%s; the run ends at step %d", e, self.state["step"])
                break
            if data is None:
                break
            t1 = time.monotonic()
            metrics = await asyncio.to_thread(trainer.step, data.groups)
            if self.publish is not None:  # shared memory copies in process mode
                self.publish(trainer.engine_weights(clone=self.mode != "process"), trainer.version)
            t2 = time.monotonic()
            self.state["step"] += 1
            self.state["seconds"] += t2 - t0
            self.state["next_batch"] = max(self.state["next_batch"], data.last_batch + 1)
            record = self._step_record(data, metrics, t1 - t0, t2 - t1, feed)
            self.metrics.write(record)
            if cfg.eval_every and self.state["step"] % cfg.eval_every == 0 and self.state["step"] < cfg.steps:
                record["eval_accuracy"] = (await self._eval())["accuracy"]
            if cfg.save_every and self.state["step"] % cfg.save_every == 0:
                self._checkpoint(feed)
                last_save = self.state["step"]
            if bar is not None:
                bar.update(record, self.evals)
            if self.on_step is not None:
                self.on_step(record)
        self.feed_counters = feed.counters
        if self.state["step"] != last_save:
            self._checkpoint(feed)

    def _step_record(self, data: StepData, metrics: dict[str, float], wait: float, train_s: float, feed: Feed) -> dict[str, Any]:
        c = feed.counters
        return {"kind": "step", "step": self.state["step"], "time": round(time.monotonic() - self.started, 3),
                "version": self.trainer.version, **data.summary(), **metrics,
                "samples_total": c["samples"], "samples": c["samples"], "tokens_total": c["tokens"],
                "wait_seconds": round(wait, 4), "train_seconds": round(train_s, 4), "mode": self.mode}

    def _checkpoint(self, feed: Feed) -> None:
        save_checkpoint(self.run_dir, self.state["step"], self.trainer.state_dict(),
                        {"state": dict(self.state), "feed": dict(feed.counters)})

    async def _eval(self) -> dict[str, Any]:
        engine = self.eval_engine
        if engine is getattr(self, "engine", None):
            self.mailbox.apply(engine)
        else:
            engine.load_state_dict(self.trainer.engine_weights(), self.trainer.version)
        result = await asyncio.to_thread(evaluate, engine, self.skill, self.eval_n, 0,
                                         max_new_tokens=self.cfg.max_new_tokens, max_tokens=self.cfg.max_tokens)
        record = {"kind": "eval", "step": self.state["step"], "n": result.n, "accuracy": result.accuracy,
                  "mean_reward": result.mean_reward, "outcomes": result.outcomes, "rubric": result.rubric,
                  "seconds": result.seconds, **({"by_kind": result.by_kind} if result.by_kind else {})}
        self.metrics.write(record)
        self.evals.append(record)
        kinds = ", ".join(f"{k} {v['accuracy']:.3f}" for k, v in result.by_kind.items())
        log.info("eval at step %d: accuracy %.3f%s", record["step"], result.accuracy, f" ({kinds})" if kinds else "")
        return record

    def _finish(self, after: dict[str, Any] | None) -> TrainResult:
        model_dir, delta, adapter_dir = save_outputs(self.cfg, self.trainer, self.tokenizer, self.dtype, self.run_dir)
        stats = train_stats(self.cfg, self.state, self.feed_counters, after)
        self.metrics.write({"kind": "end", "step": self.state["step"], "stats": _struct_dict(stats),
                            "delta": None if delta is None else str(delta.path)})
        write_result(self.run_dir, model_dir, delta, stats)
        return TrainResult(model_dir, delta, self.metrics_path, stats, self.run_dir, list(self.evals), adapter_dir)


def _stored_dtype(model: Any) -> torch.dtype:
    """The dtype the starting model's config declares (its weights are loaded as fp32 for training)."""
    declared = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if isinstance(declared, torch.dtype) else torch.float32


def _struct_dict(stats: TrainStats) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(stats)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _Bar:
    """The rich progress bar on stderr: steps, reward (mean of the last 10 steps), held-out accuracy."""

    def __init__(self, cfg: TrainConfig, start: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(TextColumn(f"[bold]train {cfg.skill}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("reward {task.fields[reward]}  acc {task.fields[acc]}  stale {task.fields[stale]}"),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True), transient=False)
        self.task = self.progress.add_task("train", total=cfg.steps, completed=start, reward="-", acc="-", stale="-")
        self.rewards: list[float] = []

    def __enter__(self) -> "_Bar":
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def update(self, record: dict[str, Any], evals: list[dict[str, Any]]) -> None:
        self.rewards = (self.rewards + [record["reward"]])[-10:]
        acc = f"{evals[-1]['accuracy']:.1%}" if evals else "-"
        self.progress.update(self.task, completed=record["step"], reward=f"{sum(self.rewards) / len(self.rewards):.3f}",
                             acc=acc, stale=f"{record['staleness_mean']:.2f}")


__all__ = ["TrainConfig", "TrainResult", "train"]

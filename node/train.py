"""A training run: async multi-turn GRPO on one skill shard, from a model directory to a trained model
and its delta. What `skillswarm train` and the worker call:

    result = train(TrainConfig(model_dir=..., skill="arith", steps=200, out_dir=...), progress=True,
                   on_step=callback, stop=threading_event)

The loop: a source (`skillswarm.node.generator`) plays generation batches of groups; each step takes
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from skillswarm.node.engines import ENGINES, check_engine, load_engine
from skillswarm.node.evaluation import evaluate
from skillswarm.node.feed import Feed, SourceDrained, StepData
from skillswarm.node.finalize import save_outputs, train_stats, write_result
from skillswarm.node.generation import HFEngine, load_model_dir
from skillswarm.node.generator import GeneratorSpec, Mailbox, ProcessSource, SyncSource, ThreadSource, model_threads
from skillswarm.node.endpoint.verifiers_env import VERIFIERS_PREFIX
from skillswarm.node.grpo import VARIANTS, LossConfig
from skillswarm.node.metrics import MetricsLog, read_metrics
from skillswarm.node.tracking import check_trackers, open_trackers
from skillswarm.node.orchestrator import Orchestrator, RolloutConfig
from skillswarm.node.runstate import METRICS, load_checkpoint, prepare_run_dir, save_checkpoint
from skillswarm.node.trainer import OptimConfig, Trainer
from skillswarm.protocol.errors import TrainError
from skillswarm.protocol.records import TrainStats

log = logging.getLogger(__name__)
ASYNC_MODES = ("auto", "process", "thread")
EXTERNAL_PREFIX = "external:"


@dataclass
class TrainConfig:
    """Everything a run needs. `batch`: groups (tasks) per step, each of `group_size` episodes."""

    model_dir: Path
    skill: str
    steps: int = 1000
    out_dir: Path = Path("runs/train")
    lora: bool = False
    lora_rank: int = 8
    lora_alpha: float = 16.0
    group_size: int = 16
    batch: int = 8
    max_staleness: int = 2
    loss: str = "grpo"
    eps_low: float = 0.2
    eps_high: float = 0.28
    tis_cap: float = 2.0
    beta: float = 0.0
    lr: float = 2e-4
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch: int = 64
    mini_batches: int = 1
    temperature: float = 1.0
    max_new_tokens: int = 64
    max_tokens: int = 512
    max_minutes: float | None = None
    eval_every: int = 50  # 0: only before and after
    eval_n: int = 200  # 0: no held-out eval at all
    save_every: int = 50  # 0: only at the end
    seed: int = 0
    engine: str = "hf"
    device: str | None = None
    sync: bool = False
    async_mode: str = "auto"  # auto: a separate process for hf on CPU, a thread otherwise
    queue_depth: int = 1  # generation batches buffered ahead of the trainer
    threads: int | None = None  # torch threads per process (default: 1 for small models)
    codec: str | None = "dense_bf16"  # None: no delta file
    codec_params: dict[str, float] = field(default_factory=dict)
    resume: bool = False
    store: Path | None = None  # with skill "external:NAME": train on the groups an endpoint recorded there
    store_wait_s: float = 0.0  # how long to wait for new scored groups before the run ends (with serve: 0 = no limit)
    serve_port: int | None = None  # with skill "external:NAME": serve the trained policy here and train on what it records
    report_to: tuple[str, ...] = ()  # experiment trackers besides metrics.jsonl: tensorboard, wandb

    def __post_init__(self) -> None:
        self.model_dir, self.out_dir = Path(self.model_dir).expanduser(), Path(self.out_dir).expanduser()
        self.store = Path(self.store).expanduser() if self.store is not None else None

    def external_name(self) -> str | None:
        """NAME of `external:NAME` (recorded trajectories), else None."""
        return self.skill[len(EXTERNAL_PREFIX):] if self.skill.startswith(EXTERNAL_PREFIX) else None

    def validate(self) -> None:
        """Raise TrainError on settings that cannot work, saying which and why."""
        problems = []
        if self.steps < 0 or self.batch < 1 or self.group_size < 2:
            problems.append("steps must be >= 0, batch >= 1 and group_size >= 2")
        if self.loss not in VARIANTS:
            problems.append(f"loss must be one of {', '.join(VARIANTS)}")
        if self.engine not in ENGINES:
            problems.append(f"engine must be one of {', '.join(ENGINES)}")
        if self.async_mode not in ASYNC_MODES:
            problems.append(f"async_mode must be one of {', '.join(ASYNC_MODES)}")
        if self.max_staleness < 0 or self.queue_depth < 1 or min(self.eval_every, self.eval_n, self.save_every) < 0:
            problems.append("max_staleness, eval_every, eval_n and save_every must be >= 0, queue_depth >= 1")
        if self.max_minutes is not None and self.max_minutes <= 0:
            problems.append("max_minutes must be > 0")
        if self.threads is not None and self.threads < 1:
            problems.append("threads must be >= 1")
        if self.temperature <= 0:
            problems.append("temperature must be > 0 (RL samples)")
        if not (self.model_dir / "config.json").is_file():
            problems.append(f"{self.model_dir} is not a model directory (no config.json); build one with `skillswarm base build`")
        problems += self._store_problems()
        problems += check_trackers(self.report_to)
        if self.skill.startswith(VERIFIERS_PREFIX):
            from skillswarm.node.endpoint.verifiers_env import verifiers_problems

            problems += verifiers_problems(self.skill)
        if problems:
            raise TrainError("bad training settings: " + "; ".join(problems))
        try:
            self.loss_config(), self.optim_config()
        except ValueError as e:
            raise TrainError(f"bad training settings: {e}") from e
        if self.codec is not None:
            from skillswarm.merge.codecs import codec_params
            from skillswarm.protocol.errors import MergeError

            try:
                codec_params(self.codec, self.codec_params)
            except MergeError as e:
                raise TrainError(str(e)) from e
        check_engine(self.engine)

    def _store_problems(self) -> list[str]:
        name = self.external_name()
        if name is None:
            return ["--store and --serve need --skill external:NAME (NAME: what the endpoint records under)"] \
                if self.store or self.serve_port is not None else []
        if not name:
            return ["--skill external:NAME needs a NAME"]
        if self.serve_port is not None:
            return []  # the run's endpoint records its own store (opening it checks the model)
        if self.store is None:
            return ["--skill external:NAME trains on recorded trajectories: give the store with --store DIR, or "
                    "--serve PORT to serve the policy and record them"]
        from skillswarm.node.endpoint.store import store_model_hash
        from skillswarm.protocol.hashing import weights_hash

        held = store_model_hash(self.store)
        if held is None:
            return [f"{self.store} is not a trajectory store (no store.json); record one with `skillswarm endpoint serve` "
                    "or `skillswarm ingest`"]
        if (self.model_dir / "config.json").is_file() and held != weights_hash(self.model_dir):
            return [f"{self.store} was recorded by another model (weights {held[:12]}); train from the model the "
                    "endpoint served, or the recorded logprobs are of another policy"]
        return []

    def mode(self) -> str:
        """sync, process or thread; store when training on recorded trajectories, live when serving and training on
        what it records, verifiers for an environment's rollouts."""
        if self.serve_port is not None:
            return "live"
        if self.store is not None:
            return "store"
        if self.skill.startswith(VERIFIERS_PREFIX):
            return "verifiers"
        if self.sync:
            return "sync"
        if self.async_mode != "auto":
            return self.async_mode
        on_gpu = self.engine == "vllm" or (self.device or ("cuda" if torch.cuda.is_available() else "cpu")) != "cpu"
        return "thread" if on_gpu else "process"

    def loss_config(self) -> LossConfig:
        return LossConfig(variant=self.loss, eps_low=self.eps_low, eps_high=self.eps_high,  # type: ignore[arg-type]
                          tis_cap=self.tis_cap, beta=self.beta, max_tokens=self.max_new_tokens)

    def optim_config(self) -> OptimConfig:
        return OptimConfig(lr=self.lr, warmup_steps=self.warmup_steps, weight_decay=self.weight_decay,
                           max_grad_norm=self.max_grad_norm, micro_batch=self.micro_batch, mini_batches=self.mini_batches,
                           temperature=self.temperature, lora=self.lora, lora_rank=self.lora_rank, lora_alpha=self.lora_alpha)

    def rollout_config(self) -> RolloutConfig:
        return RolloutConfig(group_size=self.group_size, groups_per_batch=self.batch, temperature=self.temperature,
                             max_new_tokens=self.max_new_tokens, max_tokens=self.max_tokens,
                             variant=self.loss, seed=self.seed)  # type: ignore[arg-type]

    def settings(self) -> dict[str, Any]:
        """JSON-able settings (run.json)."""
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


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
          stop: threading.Event | None = None) -> TrainResult:
    """Run GRPO as configured; see the module docstring. Safe to call from a thread that runs an event loop."""
    cfg.validate()
    threads = model_threads(cfg.model_dir, cfg.threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run = _Run(cfg, threads, progress, on_step, stop or threading.Event())
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
                 stop: threading.Event) -> None:
        self.cfg, self.threads, self.show_progress, self.on_step, self.stop = cfg, threads, progress, on_step, stop
        self.run_dir = cfg.out_dir
        self.metrics_path = self.run_dir / METRICS
        self.device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.mode = cfg.mode()
        self.started = time.monotonic()
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
            from skillswarm.node.endpoint.source import StoreSource

            self.engine, self.publish = None, None
            return StoreSource(cfg.store, cfg.external_name(), cfg.batch, cfg.loss, cfg.temperature, start,  # type: ignore[arg-type]
                               cfg.store_wait_s)
        if self.mode == "live":  # an endpoint on its own engine, serving each new policy; harnesses play against it
            from skillswarm.node.endpoint.live import live_source

            self.engine = None
            source, self.publish = live_source(cfg, self.trainer, self.run_dir, self.device, self.skill, start,
                                               lambda: self.stop.is_set() or self._deadline_passed())
            return source
        if self.mode == "verifiers":  # an endpoint on its own engine; the environment plays against it
            from skillswarm.node.endpoint.verifiers_env import verifiers_source

            self.engine = None
            source, self.publish = verifiers_source(cfg, self.trainer, self.run_dir, self.device, start)
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
        return self.cfg.max_minutes is not None and time.monotonic() - self.started >= self.cfg.max_minutes * 60

    async def _loop(self, feed: Feed, bar: "_Bar | None") -> None:
        cfg, trainer = self.cfg, self.trainer
        last_save = self.state["step"]
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
                  "seconds": result.seconds}
        self.metrics.write(record)
        self.evals.append(record)
        log.info("eval at step %d: accuracy %.3f", record["step"], result.accuracy)
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
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

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


__all__ = ["TrainConfig", "TrainResult", "train", "read_metrics"]

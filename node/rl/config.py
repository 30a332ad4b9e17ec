"""Every setting of a training run, each with its default in exactly one place: `TrainConfig`.

The parts of the engine take nested configs (`LossConfig`, `OptimConfig`, `RolloutConfig`) that have no
defaults of their own: they are built from a TrainConfig, so a default cannot drift between layers. The
TrainConfig fields a worker node may set are one typed `WorkerSettings` (defaults: TrainConfig's), which `node run`
reads from its flags or a settings file. The CLI derives its defaults from these dataclasses too (`default_of`). This
module imports nothing heavy (no torch), so the CLI can read it at start-up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from skillswarm.protocol.atomic import atomic_write_text
from skillswarm.protocol.errors import TrainError
from skillswarm.protocol.records import EVAL_N
from skillswarm.node.rl.engines.base import DEFAULT_ENGINE, ENGINES

Variant = Literal["grpo", "dr_grpo", "dapo"]
VARIANTS: tuple[str, ...] = ("grpo", "dr_grpo", "dapo")
ASYNC_MODES: tuple[str, ...] = ("auto", "process", "thread")
EXTERNAL_PREFIX = "external:"
# The codec of a delta written outside a network (train, merge delta): half of fp32's bytes; bench/codecs.py's reference.
LOCAL_CODEC = "dense_bf16"


def default_of(cls: type, name: str) -> Any:
    """The default of dataclass field `name` of `cls` (for CLI options: one source of truth)."""
    f = {x.name: x for x in dataclasses.fields(cls)}[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise KeyError(f"{cls.__name__}.{name} has no default")


@dataclass(frozen=True)
class LossConfig:
    """Settings of the policy loss (defaults: TrainConfig).

    variant: grpo (std-normalized advantages, per-sequence token mean), dr_grpo (no std, no length
    normalization: token sum over a constant), dapo (std-normalized, token-level mean over the batch).
    eps_low/eps_high: PPO clip range [1-eps_low, 1+eps_high] (clip-higher: eps_high > eps_low).
    tis_cap: truncated importance sampling cap on pi_trainer/pi_behaviour (the inference engine's policy).
    beta: KL penalty weight against a reference policy (0 disables it).
    max_tokens: dr_grpo's constant normalizer (tokens per sequence budget).
    retain: weight of the KL from the starting policy on other skills' episodes (0 disables it).
    """

    variant: Variant
    eps_low: float
    eps_high: float
    tis_cap: float
    beta: float
    max_tokens: int
    retain: float

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown loss variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ValueError("clip range needs 0 <= eps_low < 1 and eps_high >= 0")
        if self.tis_cap <= 0 or self.beta < 0 or self.max_tokens < 1 or self.retain < 0:
            raise ValueError("tis_cap must be > 0, beta >= 0, retain >= 0, max_tokens >= 1")


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and batching settings of the trainer (defaults: TrainConfig). `temperature` is the sampling
    temperature: log-probs are computed at it, as the engine sampled."""

    lr: float
    warmup_steps: int
    weight_decay: float
    betas: tuple[float, float]
    max_grad_norm: float
    micro_batch: int
    mini_batches: int
    temperature: float
    lora: bool
    lora_rank: int
    lora_alpha: float
    retain_batch: int

    def __post_init__(self) -> None:
        if self.retain_batch < 1:
            raise ValueError("retain_batch must be >= 1")
        if self.lr <= 0 or self.max_grad_norm <= 0 or self.micro_batch < 1 or self.mini_batches < 1 or self.warmup_steps < 0:
            raise ValueError("lr and max_grad_norm must be > 0, micro_batch and mini_batches >= 1, warmup_steps >= 0")
        if self.lora and self.lora_rank < 1:
            raise ValueError("lora_rank must be >= 1")


@dataclass(frozen=True)
class RolloutConfig:
    """How episodes are generated (defaults: TrainConfig): `group_size` episodes per task, `groups_per_batch`
    tasks per generation batch."""

    group_size: int
    groups_per_batch: int
    temperature: float
    max_new_tokens: int
    max_tokens: int
    variant: Variant
    seed: int


@dataclass
class TrainConfig:
    """Everything a run needs, with the one default of each setting. `batch`: groups (tasks) per step, each of
    `group_size` episodes."""

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
    # Keep other skills where they are: a KL from the starting policy on its own correct greedy episodes of these
    # skills (up to `retain_n` each, from at most anchor.MAX_TRIES * retain_n tasks, new tasks every seed), so that
    # a delta changes its own skill only. A worker retains its network's other skills (`node run --retain`, 0 turns
    # it off); `train` the skills given. In the demo it made the four skills' deltas add up at lambda 1 (merged sum
    # 289-293 points against 270-286 without it; docs/demo.md). 2: at 100 steps a round weight 1 let the other
    # skills' deltas cost arith 3 points a round, weight 3 stalled sort; 2 kept >= 86% of every gain in 2 of 3 runs.
    retain: float = 2.0
    retain_skills: tuple[str, ...] = ()
    retain_n: int = 32
    # The share of each skill's anchors that are its least confident right answers (anchor.confidence), picked from
    # all anchor.MAX_TRIES * retain_n tasks; the rest are the first right answers. Random anchors of a skill solved 99
    # times in 100 hold almost none of the answers a merge flips: in five demo rounds of sort's training, reverse lost
    # 2.5-4.6 points with 0 and 0.6-1.8 with 0.5, the other skills about the same (docs/retain-anchors.md, "Fragile anchors").
    retain_fragile: float = 0.5
    retain_batch: int = 16  # retain episodes per optimizer step
    lr: float = 2e-4
    warmup_steps: int = 20  # linear lr warm-up (Adam's first updates are sign-sized)
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = 1.0
    micro_batch: int = 64  # sequences per forward/backward pass
    mini_batches: int = 1  # optimizer steps per batch of groups
    temperature: float = 1.0
    max_new_tokens: int = 64
    max_tokens: int = 512
    max_minutes: float | None = None  # of the step loop: loading, anchors and the first eval do not count
    eval_every: int = 50  # 0: only before and after
    eval_n: int = EVAL_N  # 0: no held-out eval at all
    save_every: int = 50  # 0: only at the end
    seed: int = 0
    engine: str = DEFAULT_ENGINE
    device: str | None = None
    sync: bool = False
    async_mode: str = "auto"  # auto: a separate process for hf (CPU or GPU), a thread for vllm
    queue_depth: int = 1  # generation batches buffered ahead of the trainer
    threads: int | None = None  # torch threads per process (default: 1 for small models)
    codec: str | None = LOCAL_CODEC  # None: no delta file; a worker's round publishes in its network's codec
    codec_params: dict[str, float] = field(default_factory=dict)
    resume: bool = False
    store: Path | None = None  # with skill "external:NAME": train on the groups an endpoint recorded there
    store_wait_s: float = 0.0  # how long to wait for new scored groups before the run ends (with serve: 0 = no limit)
    serve_port: int | None = None  # with skill "external:NAME": serve the trained policy here and train on what it records
    report_to: tuple[str, ...] = ()  # experiment trackers besides metrics.jsonl: tensorboard, wandb

    def __post_init__(self) -> None:
        self.model_dir, self.out_dir = Path(self.model_dir).expanduser(), Path(self.out_dir).expanduser()
        self.store = Path(self.store).expanduser() if self.store is not None else None
        self.adam_betas = (float(self.adam_betas[0]), float(self.adam_betas[1]))
        self.retain_skills = tuple(self.retain_skills)

    def external_name(self) -> str | None:
        """NAME of `external:NAME` (recorded trajectories), else None."""
        return self.skill[len(EXTERNAL_PREFIX):] if self.skill.startswith(EXTERNAL_PREFIX) else None

    def validate(self) -> None:
        """Raise TrainError on settings that cannot work, saying which and why."""
        from skillswarm.node.rl.engines import ENGINES, check_engine
        from skillswarm.node.rl.verifiers_check import verifiers_problems
        from skillswarm.node.rl.tracking import check_trackers
        from skillswarm.skills.registry import skill_names

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
        if not 0.0 <= self.retain_fragile <= 1.0:
            problems.append("retain_fragile must be a share in [0, 1]")
        if not (self.model_dir / "config.json").is_file():
            problems.append(f"{self.model_dir} is not a model directory (no config.json); build one with `skillswarm base build`")
        problems += self._store_problems()
        unknown = sorted(set(self.retain_skills) - set(skill_names()))
        if unknown:
            problems.append(f"retain skills {', '.join(unknown)} are not installed (see `skillswarm skills list`)")
        problems += check_trackers(self.report_to)
        problems += verifiers_problems(self.skill)
        if problems:
            raise TrainError("bad training settings: " + "; ".join(problems))
        try:
            self.loss_config(), self.optim_config(), self.rollout_config()
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
        from skillswarm.node.rl.records import store_model_hash
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
        from skillswarm.node.rl.verifiers_check import VERIFIERS_PREFIX

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
        # hf generates in its own process on a GPU too: a thread shares the trainer's GIL and CUDA stream, so
        # generation and training took turns there (1.14x sync on an H200) where processes overlap (1.70x on
        # CPU). vLLM runs its own worker processes, so a thread only drives it.
        return "thread" if self.engine == "vllm" else "process"

    def loss_config(self) -> LossConfig:
        """The policy loss's settings."""
        return LossConfig(variant=self.loss, eps_low=self.eps_low, eps_high=self.eps_high,  # type: ignore[arg-type]
                          tis_cap=self.tis_cap, beta=self.beta, max_tokens=self.max_new_tokens,
                          retain=self.retain if self.retain_skills else 0.0)

    def optim_config(self) -> OptimConfig:
        """The trainer's optimizer settings."""
        return OptimConfig(lr=self.lr, warmup_steps=self.warmup_steps, weight_decay=self.weight_decay,
                           betas=self.adam_betas, max_grad_norm=self.max_grad_norm, micro_batch=self.micro_batch,
                           mini_batches=self.mini_batches, temperature=self.temperature, lora=self.lora,
                           lora_rank=self.lora_rank, lora_alpha=self.lora_alpha, retain_batch=self.retain_batch)

    def rollout_config(self) -> RolloutConfig:
        """How the run's episodes are generated."""
        return RolloutConfig(group_size=self.group_size, groups_per_batch=self.batch, temperature=self.temperature,
                             max_new_tokens=self.max_new_tokens, max_tokens=self.max_tokens,
                             variant=self.loss, seed=self.seed)  # type: ignore[arg-type]

    def settings(self) -> dict[str, Any]:
        """JSON-able settings (run.json)."""
        return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
                for k, v in asdict(self).items()}


def _setting(name: str, help: str) -> Any:
    """A WorkerSettings field: TrainConfig's default of `name` (stated once, there) and its help for the CLI."""
    return field(default=default_of(TrainConfig, name), metadata={"help": help})


@dataclass(frozen=True)
class WorkerSettings:
    """The training settings a worker node chooses for its rounds (`node run`'s flags or its --settings file); each
    default is TrainConfig's, the rest of a round's TrainConfig comes from the network (`Worker.round_config`)."""

    engine: str = _setting("engine", "Inference engine: hf (CPU or GPU) or vllm (GPU, the vllm extra).")
    lora: bool = _setting("lora", "Train LoRA adapters instead of all weights.")
    steps_per_round: Annotated[int, Meta(ge=1)] | None = field(
        default=None, metadata={"help": "Optimizer steps per round (default: the network's)."})
    minutes_per_round: Annotated[float, Meta(ge=0.01)] | None = field(
        default=None, metadata={"help": "Also end each round's training after this many minutes (whichever comes first)."})
    group_size: Annotated[int, Meta(ge=2)] = _setting("group_size", "Episodes per task (GRPO group).")
    batch: Annotated[int, Meta(ge=1)] = _setting("batch", "Tasks per optimizer step.")
    lr: Annotated[float, Meta(gt=0.0)] = _setting("lr", "AdamW learning rate on checkpoint v0 (the network's lr_decay "
                                                        "scales it on later ones).")
    threads: Annotated[int, Meta(ge=1)] | None = _setting("threads", "CPU threads for torch (default: chosen by model size).")
    eval_n: Annotated[int, Meta(ge=0)] = _setting("eval_n", "Held-out episodes evaluated before and after each round "
                                                            "(0: none).")
    retain: Annotated[float, Meta(ge=0.0)] = _setting("retain", "Weight of the KL that keeps the network's other skills "
                                                                "where the round started (0: train the shard alone).")
    report_to: tuple[str, ...] = _setting("report_to", "Also send each round's training metrics to tensorboard or wandb "
                                                       "(one tracker run per round); repeatable.")

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")


def worker_settings(values: Any, source: str) -> WorkerSettings:
    """WorkerSettings from builtin values (a settings file's table, the CLI's), checked against every field's type and
    bounds; an unknown name or a bad value raises TrainError naming `source` and the field."""
    if not isinstance(values, dict):
        raise TrainError(f"{source}: expected a table of settings, got {type(values).__name__}")
    known = [f.name for f in dataclasses.fields(WorkerSettings)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise TrainError(f"{source}: unknown setting {', '.join(f'`{k}`' for k in unknown)}; "
                         f"known: {', '.join(known)}")
    try:
        return msgspec.convert(values, WorkerSettings)
    except msgspec.ValidationError as e:
        text, _, where = str(e).rpartition(" - at `$.")
        raise TrainError(f"{source}: setting `{where.rstrip('`')}`: {text}" if text else f"{source}: {e}") from None


def save_settings(settings: WorkerSettings, path: Path | str) -> Path:
    """Write `settings` to `path` (JSON for a .json name, else TOML), atomically: what `node run --settings` reads."""
    path = Path(path)
    values = {k: v for k, v in msgspec.to_builtins(settings).items() if v is not None}  # TOML has no null: None = default
    if path.suffix == ".json":
        return atomic_write_text(path, msgspec.json.encode(values).decode() + "\n")
    return atomic_write_text(path, "# skillswarm worker settings (`skillswarm node run --settings FILE`)\n"
                             + msgspec.toml.encode(values).decode())


def load_settings(path: Path | str) -> WorkerSettings:
    """Read a settings file written by `save_settings` (or by hand); any problem raises TrainError naming the file."""
    path = Path(path)
    source = f"settings file {path}"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TrainError(f"{source} does not exist") from None
    except OSError as e:
        raise TrainError(f"cannot read {source}: {e.strerror or e}") from None
    kind = "JSON" if path.suffix == ".json" else "TOML"
    try:
        values = (msgspec.json if kind == "JSON" else msgspec.toml).decode(data)
    except msgspec.DecodeError as e:
        raise TrainError(f"{source} is not valid {kind}: {e}") from None
    return worker_settings(values, source)


def override(settings: WorkerSettings, changes: dict[str, Any], source: str) -> WorkerSettings:
    """`settings` with `changes` (field name -> value, e.g. the flags a command line gave), checked as a file is."""
    return worker_settings({**msgspec.to_builtins(settings), **changes}, source)

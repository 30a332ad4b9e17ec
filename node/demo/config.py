"""What the demo runs: its settings (DemoConfig), the network it starts (`make_spec`), derived from the network's and training's
defaults where a value is not the demo's own."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from msgspec import UNSET

from skillswarm.node.demo.retention import RETENTION_N
from skillswarm.node.rl.config import EVAL_N, TrainConfig, WorkerSettings, default_of
from skillswarm.protocol.hashing import weights_hash
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.netspec import new_network
from skillswarm.protocol.records import (
    DEFAULT_LAMBDA_SEARCH,
    Codec,
    MergePolicy,
    NetworkSpec,
    RoundPolicy,
    ScreenPolicy,
)

NETWORK = "demo"
DESCRIPTION = "skillswarm demo on 127.0.0.1"


@dataclass
class DemoConfig:
    """What the demo runs."""

    out: Path
    skills: list[str]
    # More, shorter rounds keep more of each gain than fewer, longer ones (same steps in all; see docs/demo.md):
    # every skill re-learns on the merged model, and the last round's deltas, the ones merged last, are small.
    rounds: int = 4
    # The same steps for every skill (time-boxed rounds starve the slow, multi-turn ones): the network's default.
    steps_per_round: int = RoundPolicy().steps_per_round
    # A cap on each round's training, a safety net for slow machines: 50 steps of calc (3.5-6x the tokens of the other
    # skills' steps) took 65 s on one 2-core machine and about 3 minutes on a slower one, where a 2-minute cap
    # ended its rounds at 12-23 steps (docs/nano-model.md, "The swarm on a second machine").
    minutes_per_round: float | None = 3.0
    # The workers' learning rate on vN: lr * lr_decay**N (RoundPolicy.lr_decay); 1: constant. 0.8 kept no more of the
    # gains in three runs and merged 5 points fewer (docs/merging.md, "What the last round loses").
    lr_decay: float = 1.0
    method: str = MergePolicy().method
    density: float = MergePolicy().density
    # The network's: with the workers' retain loss the deltas of a round add up at full strength (docs/demo.md)
    scale: float = MergePolicy().scale
    scale_search: list[float] = field(default_factory=lambda: list(DEFAULT_LAMBDA_SEARCH))  # other lambdas, on evidence
    compare: list[str] = field(default_factory=lambda: ["task_arithmetic@1", "task_arithmetic@0.6"])  # re-merge the last round
    eval_n: int = EVAL_N
    retention_n: int = RETENTION_N  # held-out tasks per skill of the final re-measure
    # The demo's own, not TrainConfig's 16: half the episodes per step, for one machine running a worker per skill.
    group_size: int = 8
    batch: int = default_of(TrainConfig, "batch")
    lr: float = default_of(TrainConfig, "lr")
    retain: float = default_of(TrainConfig, "retain")  # the workers' retain loss (0: off)
    # The demo's own, not the network default (int8): lossless deltas, so no codec loss enters its retention figures.
    codec: Codec = "dense_fp32"
    timeout_s: float = 1800.0
    # One machine: every node's files share its disk, so a leaving coordinator gains nothing by waiting for copies.
    replicas: int = 0
    screen: ScreenPolicy = field(default_factory=ScreenPolicy.for_new_network)  # what the coordinator checks before merging a delta

    def worker_settings(self) -> WorkerSettings:
        """What every demo worker trains with (its --settings file): one torch thread each, as the workers share the
        machine's cores."""
        return WorkerSettings(group_size=self.group_size, batch=self.batch, lr=self.lr, threads=1, eval_n=self.eval_n,
                              retain=self.retain, minutes_per_round=self.minutes_per_round or None)


def make_spec(cfg: DemoConfig, base: Path, coordinator: Identity) -> NetworkSpec:
    """The demo network: the nano base, the skills, the coordinator, a round that waits for every skill."""
    return coordinator.sign_record(new_network(
        NETWORK, str(base), weights_hash(base), cfg.skills, [coordinator.public_key_hex],
        description=DESCRIPTION, codec=cfg.codec, replicas=cfg.replicas,
        round=RoundPolicy(steps_per_round=cfg.steps_per_round, min_deltas=len(cfg.skills), max_wait_s=cfg.timeout_s,
                          lr_decay=cfg.lr_decay if cfg.lr_decay < 1 else UNSET),
        merge=MergePolicy(method=cfg.method, density=cfg.density, scale=cfg.scale,  # type: ignore[arg-type]
                          scale_search=cfg.scale_search),
        screen=cfg.screen,
    ))

"""Groups and how they reach the trainer.

A `Group` is the G graded episodes (`Sample`s) of one task with their advantages and the policy version
that played them; a `Batch` is one generation batch of groups. `make_group` classifies a group:
`env_error` (the environment broke: dropped, counted), `zero_variance` (every episode got the same
reward: no signal, filtered, counted) or `ok`.

`Feed` is the trainer's side of the queue. A step takes whole batches (so a checkpoint at a step
boundary leaves nothing half-used: a resumed run regenerates from the next batch index) until it holds
at least `n` usable groups; on the way it drops env_error groups, filters zero-variance ones and drops
groups more than `max_staleness` policy versions behind the trainer, counting each. Counters are
cumulative over the run and saved in run checkpoints.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

import torch

from skillswarm.node.rl.config import Variant
from skillswarm.node.rl.evaluation import rubric_means
from skillswarm.node.rl.grpo import group_advantages, has_signal
from skillswarm.node.rl.rollout import Rollout
from skillswarm.protocol.errors import TrainError
from skillswarm.skills.taskbank import Task

log = logging.getLogger(__name__)

GroupStatus = Literal["ok", "env_error", "zero_variance"]


@dataclass
class Sample:
    """One episode as the trainer needs it: tokens, loss mask (1 = model token), behaviour logprobs."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    reward: float
    correct: bool
    outcome: str
    rubric: dict[str, float] = field(default_factory=dict)  # each reward function's raw value, metrics included

    @property
    def completion_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class Group:
    """The G episodes of one task, with their advantages and the policy version that produced them."""

    task_id: str
    samples: list[Sample]
    advantages: list[float]
    policy_version: int
    status: GroupStatus
    batch_index: int = 0

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


@dataclass
class Batch:
    """One generation batch's groups and its timing (what crosses the queue)."""

    index: int
    groups: list[Group]
    policy_version: int
    seconds: float = 0.0
    tokens: int = 0
    meta: dict[str, float] = field(default_factory=dict)


def to_sample(r: Rollout) -> Sample:
    """The trainer's view of a rollout."""
    return Sample(r.token_ids, r.loss_mask, r.logprobs, float(r.reward), bool(r.episode.correct), r.outcome,
                  dict(r.episode.rewards))


def make_group(task: Task, rollouts: list[Rollout], variant: Variant, policy_version: int, batch_index: int = 0) -> Group:
    """Grade-level classification and advantages of one task's episodes."""
    samples = [to_sample(r) for r in rollouts]
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    if any(s.outcome == "env_error" for s in samples):
        status: GroupStatus = "env_error"
    elif not bool(has_signal(rewards)):
        status = "zero_variance"
    else:
        status = "ok"
    adv = group_advantages(rewards, variant).tolist() if status == "ok" else [0.0] * len(samples)
    return Group(task.id, samples, adv, policy_version, status, batch_index)


# Consecutive batches without one usable group before the run gives up (the task is all-or-nothing
# for this model: RL has no signal to learn from).
MAX_BARREN_BATCHES = 50

COUNTERS = ("samples", "tokens", "episodes", "reward_sum", "correct_sum", "staleness_sum", "staleness_n",
            "ok_groups", "env_error_groups", "zero_variance_groups", "stale_groups", "gen_tokens", "gen_seconds")


class SourceDrained(TrainError):
    """A finite source (recorded trajectories) has nothing more: the run ends after what it has."""


class Source(Protocol):
    async def next_batch(self) -> Batch: ...


def split_groups(groups: list[Group], version: int, max_staleness: int) -> dict[str, list[Group]]:
    """Sort groups into ok / env_error / zero_variance / stale (staleness = version - policy_version)."""
    out: dict[str, list[Group]] = {"ok": [], "env_error": [], "zero_variance": [], "stale": []}
    for g in groups:
        if g.status != "ok":
            out[g.status].append(g)
        elif version - g.policy_version > max_staleness:
            out["stale"].append(g)
        else:
            out["ok"].append(g)
    return out


@dataclass
class StepData:
    """What one step took: the usable groups and an account of everything it consumed."""

    groups: list[Group] = field(default_factory=list)
    batches: int = 0
    last_batch: int = -1
    counts: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)
    rewards: list[float] = field(default_factory=list)
    correct: int = 0
    staleness: list[int] = field(default_factory=list)
    gen_seconds: float = 0.0
    gen_tokens: int = 0
    rubric: list[dict[str, float]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """The step's metrics about data (for the JSONL record)."""
        n = len(self.rewards)
        return {
            "reward": sum(self.rewards) / n if n else 0.0, "accuracy": self.correct / n if n else 0.0,
            "episodes": n, "groups": len(self.groups), "batches": self.batches,
            "env_error_groups": self.counts["env_error"], "zero_variance_groups": self.counts["zero_variance"],
            "stale_groups": self.counts["stale"], "outcomes": dict(self.outcomes),
            "staleness_mean": sum(self.staleness) / len(self.staleness) if self.staleness else 0.0,
            "staleness_max": max(self.staleness, default=0), "staleness": dict(Counter(self.staleness)),
            "gen_seconds": round(self.gen_seconds, 4), "gen_tokens": self.gen_tokens,
            "rubric": rubric_means(self.rubric),
        }


class Feed:
    """Pulls batches from a source and hands the trainer fresh groups with signal."""

    def __init__(self, source: Source, max_staleness: int, counters: dict[str, Any] | None = None) -> None:
        self.source, self.max_staleness = source, max_staleness
        self.counters: dict[str, Any] = {k: 0 for k in COUNTERS}
        self.counters["staleness_hist"] = {}
        self.counters["outcomes"] = {}
        for k, v in (counters or {}).items():
            self.counters[k] = dict(v) if isinstance(v, dict) else v
        self._barren = 0

    def account(self, batch: Batch, version: int, data: StepData) -> None:
        """Sort one batch's groups into `data` and the run's counters."""
        parts = split_groups(batch.groups, version, self.max_staleness)
        data.batches += 1
        data.last_batch = max(data.last_batch, batch.index)
        data.gen_seconds += batch.seconds
        data.gen_tokens += batch.tokens
        for kind, groups in parts.items():
            data.counts[kind] += len(groups)
            self.counters[f"{kind}_groups"] += len(groups)
        for g in batch.groups:
            for s in g.samples:
                data.rewards.append(s.reward)
                data.correct += int(s.correct)
                data.outcomes[s.outcome] += 1
                data.rubric.append(s.rubric)
        for g in parts["ok"]:
            staleness = version - g.policy_version
            data.staleness.append(staleness)
            hist = self.counters["staleness_hist"]
            hist[str(staleness)] = hist.get(str(staleness), 0) + 1
        data.groups += parts["ok"]
        c = self.counters
        c["episodes"] += sum(len(g.samples) for g in batch.groups)
        c["reward_sum"] += sum(s.reward for g in batch.groups for s in g.samples)
        c["correct_sum"] += sum(int(s.correct) for g in batch.groups for s in g.samples)
        c["staleness_sum"] += sum(version - g.policy_version for g in parts["ok"])
        c["staleness_n"] += len(parts["ok"])
        c["gen_tokens"] += batch.tokens
        c["gen_seconds"] += batch.seconds
        for g in batch.groups:
            for s in g.samples:
                c["outcomes"][s.outcome] = c["outcomes"].get(s.outcome, 0) + 1
        self._barren = 0 if parts["ok"] else self._barren + 1
        if self._barren >= MAX_BARREN_BATCHES:
            raise TrainError(f"{MAX_BARREN_BATCHES} generation batches in a row gave no group with reward variance "
                             f"(last: {dict(data.counts)}): every episode of a task gets the same reward, so GRPO has "
                             "nothing to learn; try a larger --group-size, a higher temperature, or another model")

    async def take(self, n: int, version: int, should_stop: Callable[[], bool]) -> StepData | None:
        """Whole batches until at least `n` usable groups; None when `should_stop` says so first."""
        data = StepData()
        while len(data.groups) < n:
            if should_stop():
                return None
            try:
                batch = await self.source.next_batch()
            except SourceDrained:
                if not data.groups:
                    raise
                break  # a last, smaller step on what there is
            self.account(batch, version, data)
        self.counters["samples"] += sum(len(g.samples) for g in data.groups)
        self.counters["tokens"] += sum(s.completion_tokens for g in data.groups for s in g.samples)
        return data

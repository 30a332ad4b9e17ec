"""The rollout orchestrator: tasks -> groups of graded episodes -> advantages -> a bounded queue.

Each generation batch samples `groups_per_batch` training tasks from the skill's TaskBank (seeded by
the run seed and the batch index, so batch k is the same on every run and after a resume) and plays
G episodes of each with the same environment seed: a replayable group. All B*G episodes of a batch
share batched `generate` calls on the engine. Every group is tagged with the engine's policy version
and classified: `env_error` (the environment broke: dropped, counted), `zero_variance` (every episode
got the same reward: no signal, filtered, counted) or `ok`. Timeouts stay in, graded 0.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Literal, Protocol

import torch

from skillswarm.node.engines import InferenceEngine
from skillswarm.node.grpo import Variant, group_advantages, has_signal
from skillswarm.node.rollout import Rollout, run_episodes
from skillswarm.skills.skill import Skill
from skillswarm.skills.taskbank import Task

log = logging.getLogger(__name__)

GroupStatus = Literal["ok", "env_error", "zero_variance"]


class Stop(Protocol):
    """A stop flag (threading.Event or multiprocessing.Event)."""

    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class RolloutConfig:
    """How episodes are generated. `group_size` episodes per task, `groups_per_batch` tasks per batch."""

    group_size: int = 8
    groups_per_batch: int = 4
    temperature: float = 1.0
    max_new_tokens: int = 64
    max_tokens: int = 512
    variant: Variant = "grpo"
    seed: int = 0


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


class Orchestrator:
    """Plays batches of groups on an engine; `run` feeds them to a bounded queue until stopped."""

    def __init__(self, engine: InferenceEngine, skill: Skill, cfg: RolloutConfig) -> None:
        if cfg.group_size < 2:
            raise ValueError("group_size must be >= 2 (advantages compare episodes of one task)")
        if cfg.groups_per_batch < 1:
            raise ValueError("groups_per_batch must be >= 1")
        self.engine, self.skill, self.cfg = engine, skill, cfg

    def _rng(self, batch_index: int) -> random.Random:
        return random.Random(f"{self.cfg.seed}/{self.skill.name}/batch/{batch_index}")

    def tasks_for(self, batch_index: int) -> list[tuple[Task, int]]:
        """Batch `batch_index`'s tasks and the environment seed of each group (deterministic)."""
        rng = self._rng(batch_index)
        return [(self.skill.tasks.sample(rng), rng.randrange(2**31)) for _ in range(self.cfg.groups_per_batch)]

    def generate_batch(self, batch_index: int) -> Batch:
        """Play every group of batch `batch_index` (blocking) and classify them."""
        cfg, G = self.cfg, self.cfg.group_size
        picked = self.tasks_for(batch_index)
        tasks = [t for t, _ in picked for _ in range(G)]
        seeds = [s for _, s in picked for _ in range(G)]
        version = self.engine.policy_version
        start = time.monotonic()
        rollouts = run_episodes(self.engine, self.skill, tasks, seeds, temperature=cfg.temperature,
                                max_new_tokens=cfg.max_new_tokens, max_tokens=cfg.max_tokens,
                                sample_seed=(cfg.seed * 1_000_003 + batch_index) % 2**31)
        seconds = time.monotonic() - start
        groups = [make_group(task, rollouts[i * G:(i + 1) * G], cfg.variant, version, batch_index)
                  for i, (task, _) in enumerate(picked)]
        tokens = sum(len(r.token_ids) for r in rollouts)
        return Batch(batch_index, groups, version, seconds, tokens)

    async def run(self, put: Callable[[Batch], Awaitable[None]], stop: Stop, start_batch: int = 0,
                  before_batch: Callable[[], None] | None = None) -> int:
        """Produce batches from `start_batch` on until `stop` is set; `put` applies back-pressure (a
        bounded queue); `before_batch` loads the newest weights (in the generating thread, before each
        batch, so that a batch comes from one policy version). Returns the next batch index."""

        def next_batch(index: int) -> Batch:
            if before_batch is not None:
                before_batch()
            return self.generate_batch(index)

        index = start_batch
        while not stop.is_set():
            batch = await asyncio.to_thread(next_batch, index)
            if stop.is_set():
                break
            await put(batch)
            index += 1
        return index

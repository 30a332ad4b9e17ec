"""The rollout orchestrator: tasks -> groups of graded episodes (`skillswarm.node.rl.groups`) -> a bounded queue.

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
from typing import Awaitable, Callable, Protocol

from skillswarm.node.rl.config import RolloutConfig
from skillswarm.node.rl.engines.base import InferenceEngine
from skillswarm.node.rl.groups import Batch, make_group
from skillswarm.node.rl.rollout import run_episodes
from skillswarm.skills.skill import Skill
from skillswarm.skills.taskbank import Task

log = logging.getLogger(__name__)


class Stop(Protocol):
    """A stop flag (threading.Event or multiprocessing.Event)."""

    def is_set(self) -> bool: ...


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

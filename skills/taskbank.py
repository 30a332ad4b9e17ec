"""Task banks: where a skill's tasks come from. Seeded train sampling, and a fixed held-out eval split.

A task belongs to the eval split when the hash of its id says so (a fixed fraction of the task space),
so the split is a property of the task itself: training never samples an eval task, whatever the
seed, and the eval list is the same on every machine.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any

from skillswarm.protocol.errors import SkillError


@dataclass(frozen=True)
class Task:
    """One problem: a stable id, the user-turn text, the exact expected answer, and skill-specific data."""

    id: str
    prompt: str
    answer: str
    data: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


class TaskBank:
    """Base class: subclasses implement `draw(rng)`, returning a random task of the skill's distribution.

    `eval_every`: one task id in this many (by hash) is held out for evaluation."""

    eval_every: int = 10
    split_salt: str = "skillswarm/eval-split/v1"
    _eval_seed: int = 20240917
    _max_tries: int = 100_000

    def draw(self, rng: random.Random) -> Task:
        """A random task; may be train or eval (the base class filters). Must use only `rng`."""
        raise NotImplementedError

    def stratum(self, task: Task) -> str:
        """The task's kind, where a skill mixes kinds of unequal difficulty (calc: with or without a third
        number). The nano warm-up stops a skill only once it solves some of every kind, since RL learns
        nothing on a kind the model never solves. Default: one kind."""
        return ""

    def check(self, task: Task, answer: str | None) -> bool:
        """Whether `answer` solves `task` (default: exact match after stripping whitespace)."""
        return answer is not None and answer.strip() == task.answer

    def is_eval(self, task: Task) -> bool:
        """Whether the task is in the held-out split."""
        digest = hashlib.sha256(f"{self.split_salt}:{task.id}".encode()).digest()
        return int.from_bytes(digest[:8], "big") % self.eval_every == 0

    def sample(self, rng: random.Random) -> Task:
        """One training task (never from the eval split), drawn with `rng`."""
        for _ in range(self._max_tries):
            task = self.draw(rng)
            if not self.is_eval(task):
                return task
        raise SkillError(f"{type(self).__name__} drew only eval tasks in {self._max_tries} tries; its task space is too small")

    def train_tasks(self, n: int, seed: int) -> list[Task]:
        """`n` training tasks, the same for the same seed (repeats possible, as in sampling)."""
        rng = random.Random(seed)
        return [self.sample(rng) for _ in range(n)]

    def eval_tasks(self, n: int, seed: int | None = None) -> list[Task]:
        """The first `n` distinct tasks of the fixed held-out list (a prefix of any longer request); with a
        `seed`, `n` distinct held-out tasks drawn with it instead (a sample nobody could know in advance)."""
        rng = random.Random(self._eval_seed if seed is None else seed)
        seen: set[str] = set()
        out: list[Task] = []
        tries = 0
        while len(out) < n:
            tries += 1
            if tries > self._max_tries + 100 * n:
                raise SkillError(f"{type(self).__name__} has fewer than {n} held-out tasks; ask for fewer (--n)")
            task = self.draw(rng)
            if task.id not in seen and self.is_eval(task):
                seen.add(task.id)
                out.append(task)
        return out

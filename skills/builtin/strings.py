"""`reverse` and `sort`: single-turn string transforms of 2-7 lower-case letters (short ones are easy,
long ones hard: the difficulty is spread so that a partly trained model solves some)."""

from __future__ import annotations

import random
import string
from typing import Callable

from skillswarm.skills.builtin.arith import exact_answer
from skillswarm.skills.environment import Environment
from skillswarm.skills.episode import Message
from skillswarm.skills.rubric import RewardFunc, Rubric
from skillswarm.skills.skill import Skill
from skillswarm.skills.taskbank import Task, TaskBank
from skillswarm.skills.toolcall import format_answer


class StringTasks(TaskBank):
    """A random string of `min_len`..`max_len` letters from `alphabet`, and its transform."""

    def __init__(self, kind: str, transform: Callable[[str], str], min_len: int = 2, max_len: int = 7,
                 alphabet: str = string.ascii_lowercase) -> None:
        self.kind, self.transform = kind, transform
        self.min_len, self.max_len, self.alphabet = min_len, max_len, alphabet

    def draw(self, rng: random.Random) -> Task:
        s = "".join(rng.choice(self.alphabet) for _ in range(rng.randint(self.min_len, self.max_len)))
        return Task(id=f"{self.kind}:{s}", prompt=s, answer=self.transform(s))


def same_length(answer: str | None, task: Task) -> float:
    """Metric: the answer has the right length (the model kept every letter)."""
    return float(answer is not None and len(answer.strip()) == len(task.answer))


def _reference(task: Task, messages: list[Message]) -> str:
    return format_answer(task.answer)


def _make(name: str, verb: str, transform: Callable[[str], str], description: str) -> Skill:
    return Skill(
        name=name, version="1", description=description,
        tasks=StringTasks(name, transform), env=Environment(system_prompt=f"{verb}. Reply {format_answer('S')}.", max_turns=1),
        rubric=Rubric([RewardFunc(exact_answer, 1.0), RewardFunc(same_length, 0.0)]), reference=_reference,
    )


def make_reverse() -> Skill:
    """The `reverse` skill."""
    return _make("reverse", "Reverse", lambda s: s[::-1], "reverse a string of 2-7 letters (single turn)")


def make_sort() -> Skill:
    """The `sort` skill."""
    return _make("sort", "Sort", lambda s: "".join(sorted(s)), "sort the letters of a 2-7 letter string (single turn)")

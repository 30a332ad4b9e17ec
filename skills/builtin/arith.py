"""`arith`: single-turn addition and subtraction of numbers from 0 to 99, answered in <answer>N</answer>."""

from __future__ import annotations

import random

from skillswarm.skills.environment import Environment
from skillswarm.skills.episode import Message
from skillswarm.skills.rubric import RewardFunc, Rubric
from skillswarm.skills.skill import Skill
from skillswarm.skills.taskbank import Task, TaskBank
from skillswarm.skills.toolcall import format_answer

SYSTEM = f"Reply {format_answer('N')}."


class ArithTasks(TaskBank):
    """a+b or a-b (a >= b, so results are never negative), each operand uniform from 0 to 10**max_digits - 1.

    Uniform over the numbers, not over digit counts: the held-out split is a list of distinct tasks, so it is
    as good as uniform over the task space, and training must sample the same distribution. (Version 1 drew
    the digit count first: a quarter of training was one-digit facts the model already knew, which make 2%
    of the held-out split, and RL gained half as much on the tasks that are evaluated.)"""

    def __init__(self, max_digits: int = 2) -> None:
        self.max_digits = max_digits

    def _operand(self, rng: random.Random) -> int:
        return rng.randint(0, 10**self.max_digits - 1)

    def draw(self, rng: random.Random) -> Task:
        a, b, op = self._operand(rng), self._operand(rng), rng.choice("+-")
        if op == "-" and b > a:
            a, b = b, a
        expr = f"{a}{op}{b}"
        return Task(id=f"arith:{expr}", prompt=expr, answer=str(a + b if op == "+" else a - b))


def exact_answer(answer: str | None, task: Task) -> float:
    """1 when the final answer is exactly right."""
    return float(answer is not None and answer.strip() == task.answer)


def formatted(answer: str | None) -> float:
    """Metric: the turn held a well-formed <answer> with an integer in it."""
    return float(answer is not None and answer.strip().lstrip("-").isdigit())


def digits_right(answer: str | None, task: Task) -> float:
    """Metric: the share of the answer's digits that are right, place by place from the units (partial
    progress that exact_answer does not show)."""
    got = (answer or "").strip()
    if not got.isdigit():
        return 0.0
    return sum(a == b for a, b in zip(reversed(got), reversed(task.answer))) / max(len(got), len(task.answer))


def reference(task: Task, messages: list[Message]) -> str:
    """The perfect reply."""
    return format_answer(task.answer)


def make_skill() -> Skill:
    """The `arith` skill."""
    return Skill(
        name="arith", version="2", description="add or subtract two numbers from 0 to 99 (single turn)",
        tasks=ArithTasks(), env=Environment(system_prompt=SYSTEM, max_turns=1),
        rubric=Rubric([RewardFunc(exact_answer, 1.0), RewardFunc(formatted, 0.0), RewardFunc(digits_right, 0.0)]),
        reference=reference,
    )

"""`arith`: single-turn addition and subtraction of 1-2 digit numbers, answered in <answer>N</answer>."""

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
    """a+b or a-b (a >= b, so results are never negative); each operand has 1 to 2 digits (uniformly),
    so difficulty is spread from memorisable facts to multi-digit carries."""

    def __init__(self, min_digits: int = 1, max_digits: int = 2) -> None:
        self.min_digits, self.max_digits = min_digits, max_digits

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

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


def reference(task: Task, messages: list[Message]) -> str:
    """The perfect reply."""
    return format_answer(task.answer)


def make_skill() -> Skill:
    """The `arith` skill."""
    return Skill(
        name="arith", version="1", description="add or subtract two 1-2 digit numbers (single turn)",
        tasks=ArithTasks(), env=Environment(system_prompt=SYSTEM, max_turns=1),
        rubric=Rubric([RewardFunc(exact_answer, 1.0), RewardFunc(formatted, 0.0)]), reference=reference,
    )

"""`calc`: multi-turn; evaluate a*b, a*b+c or a*b-c with a calculator that does one operation per call.

A perfect player calls `calc` on a*b, then (when there is a c) on the product and c, then answers:
two or three model turns. Reward: 1 for the right final answer, plus 0.1 per turn whose calls all
returned a result (capped by the turn limit, and worth nothing if the episode times out).
"""

from __future__ import annotations

import random

from skillswarm.skills.builtin.arith import exact_answer
from skillswarm.skills.environment import Environment
from skillswarm.skills.episode import Message, ToolCall, Turn
from skillswarm.skills.rubric import RewardFunc, Rubric
from skillswarm.skills.skill import Skill
from skillswarm.skills.taskbank import Task, TaskBank
from skillswarm.skills.toolcall import RESULT_CLOSE, RESULT_OPEN, format_answer, format_call
from skillswarm.skills.tools import Calculator

SYSTEM = f"One op per {format_call('calc', 'a*b')}. Reply {format_answer('N')}."


class CalcTasks(TaskBank):
    """a*b with a, b in 10..99, then (two times in three) + or - c with c in 10..999."""

    def draw(self, rng: random.Random) -> Task:
        a, b, tail = rng.randint(10, 99), rng.randint(10, 99), rng.choice(["", "+", "-"])
        expr, value = f"{a}*{b}", a * b
        if tail:
            c = rng.randint(10, 999)
            expr, value = f"{expr}{tail}{c}", value + c if tail == "+" else value - c
        return Task(id=f"calc:{expr}", prompt=expr, answer=str(value), data={"a": a, "b": b, "tail": expr[len(f"{a}*{b}"):]})

    def stratum(self, task: Task) -> str:
        """a*b, a*b+c or a*b-c: the tails need c copied from the prompt into the second call, which a model
        can fail at entirely while it solves every a*b."""
        return "a*b" + (task.data["tail"][:1] + "c" if task.data["tail"] else "")


def good_call(turn: Turn) -> float:
    """Per turn: 1 when the turn made well-formed calls that all returned a result."""
    return float(turn.error is None and bool(turn.calls) and all(c.ok for c in turn.calls))


def tool_calls_made(tool_calls: list[ToolCall]) -> float:
    """Metric: how many tool calls the episode made."""
    return float(len(tool_calls))


def reference(task: Task, messages: list[Message]) -> str:
    """Multiply first, then apply the tail to the product the tool returned, then answer."""
    results = [m.content for m in messages if m.role == "tool"]
    if not results:
        return format_call("calc", f"{task.data['a']}*{task.data['b']}")
    last = results[-1].removeprefix(RESULT_OPEN).removesuffix(RESULT_CLOSE)
    if len(results) == 1 and task.data["tail"]:
        return format_call("calc", f"{last}{task.data['tail']}")
    return format_answer(last)


def make_skill() -> Skill:
    """The `calc` skill."""
    return Skill(
        name="calc", version="1", description="a*b+c style expressions with a one-operation calculator tool (multi-turn)",
        tasks=CalcTasks(), env=Environment(system_prompt=SYSTEM, tools=[Calculator()], max_turns=4),
        rubric=Rubric([RewardFunc(exact_answer, 1.0), RewardFunc(good_call, 0.1, per_turn=True),
                       RewardFunc(tool_calls_made, 0.0)]),
        reference=reference,
    )

"""count_vowels: how many vowels (a, e, i, o, u) does a short lower-case word have? A multi-turn skill
with one tool, `count`; a perfect player calls it on the word, then answers with what it returned."""

from __future__ import annotations

import random

from skillswarm.skills.environment import Environment
from skillswarm.skills.episode import Message, ToolCall, Turn
from skillswarm.skills.rubric import RewardFunc, Rubric
from skillswarm.skills.skill import Skill
from skillswarm.skills.taskbank import Task, TaskBank
from skillswarm.skills.toolcall import RESULT_CLOSE, RESULT_OPEN, format_answer, format_call
from skillswarm.skills.tools import ToolInputError

VOWELS = "aeiou"
CONSONANTS = "bcdfghjklmnpqrstvwxyz"
# What the model reads first in every episode: the task, the tool and its reply, how to answer.
SYSTEM = (f"Count the vowels (aeiou). {format_call('count', 'word')} replies {RESULT_OPEN}N{RESULT_CLOSE}. "
          f"Reply {format_answer('N')}.")


class VowelTasks(TaskBank):
    """A word of 3-7 letters, each a vowel two times in five (so the answers spread over 0-7)."""

    def draw(self, rng: random.Random) -> Task:
        word = "".join(rng.choice(VOWELS if rng.random() < 0.4 else CONSONANTS) for _ in range(rng.randint(3, 7)))
        return Task(id=f"count_vowels:{word}", prompt=word, answer=str(sum(c in VOWELS for c in word)))


class Count:
    """The tool: the number of vowels of one lower-case word."""

    name = "count"
    description = "the number of vowels (a e i o u) of one lower-case word"

    def __call__(self, input: str) -> str:
        word = input.strip()
        if not word.isascii() or not word.isalpha() or not word.islower():
            raise ToolInputError("count takes one lower-case word, like banana")  # shown to the model
        return str(sum(c in VOWELS for c in word))


def correct(answer: str | None, task: Task) -> float:
    """The reward: 1 for the right count."""
    return float(answer is not None and answer.strip() == task.answer)


def good_call(turn: Turn) -> float:
    """Per turn: 1 when the turn made well-formed calls that all returned a result (weighted 0.1)."""
    return float(turn.error is None and bool(turn.calls) and all(c.ok for c in turn.calls))


def calls(tool_calls: list[ToolCall]) -> float:
    """A metric (weight 0): how many tool calls the episode made."""
    return float(len(tool_calls))


def reference(task: Task, messages: list[Message]) -> str:
    """The perfect player: call `count` on the word, then answer what it returned."""
    results = [m.content for m in messages if m.role == "tool"]
    if not results:
        return format_call("count", task.prompt)
    return format_answer(results[-1].removeprefix(RESULT_OPEN).removesuffix(RESULT_CLOSE))


def make_skill() -> Skill:
    """The entry point (pyproject.toml: [project.entry-points."skillswarm.skills"])."""
    return Skill(
        name="count_vowels", version="0.1.0", description="count the vowels of a word with a `count` tool (multi-turn)",
        tasks=VowelTasks(), env=Environment(system_prompt=SYSTEM, tools=[Count()], max_turns=3),
        rubric=Rubric([RewardFunc(correct, 1.0), RewardFunc(good_call, 0.1, per_turn=True), RewardFunc(calls, 0.0)]),
        reference=reference,
    )

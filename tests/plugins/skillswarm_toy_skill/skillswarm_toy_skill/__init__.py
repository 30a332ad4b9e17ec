"""A tiny third-party skill: echo the word in the user turn, inside <answer>...</answer>.

It is what a plugin author writes: a task bank, an environment, a rubric, and an entry point in the
`skillswarm.skills` group (see this package's pyproject.toml). Nothing about training."""

from __future__ import annotations

import random

from skillswarm.skills.environment import Environment
from skillswarm.skills.rubric import RewardFunc, Rubric
from skillswarm.skills.skill import Skill
from skillswarm.skills.taskbank import Task, TaskBank
from skillswarm.skills.toolcall import format_answer

WORDS = ["apple", "river", "stone", "cloud", "ember", "maple", "otter", "prism", "quill", "tulip", "violet", "willow"]


class EchoTasks(TaskBank):
    eval_every = 4

    def draw(self, rng: random.Random) -> Task:
        word = rng.choice(WORDS) + str(rng.randint(0, 99))
        return Task(id=f"toy_echo:{word}", prompt=word, answer=word)


def echoed(answer: str | None, task: Task) -> float:
    return float(answer == task.answer)


def make_skill() -> Skill:
    return Skill(
        name="toy_echo", version="0.1.0", description="echo a word (third-party plugin)",
        tasks=EchoTasks(), env=Environment(system_prompt=f"Echo. Reply {format_answer('W')}."),
        rubric=Rubric([RewardFunc(echoed)]), reference=lambda task, messages: format_answer(task.answer),
    )

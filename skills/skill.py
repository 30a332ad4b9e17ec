"""A Skill: a TaskBank + an Environment + a Rubric, with a name, version and description.

A skill author writes those three parts (and, optionally, a scripted `reference` player that the nano
base model's warm-up imitates) and nothing about training. `run_episode` is the text-level loop, for
any policy that maps messages to the next turn's text; the RL engine runs the same environment with
tokens in batches (`skillswarm.node.rl.rollout`).
"""

from __future__ import annotations

import logging
import re
import traceback
from dataclasses import dataclass
from typing import Callable

from skillswarm.protocol.errors import SkillError
from skillswarm.skills.environment import Environment, EpisodeState
from skillswarm.skills.episode import Episode, Message
from skillswarm.skills.rubric import Rubric
from skillswarm.skills.taskbank import Task, TaskBank

log = logging.getLogger(__name__)
Policy = Callable[[list[Message]], str]
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,39}\Z")


@dataclass(frozen=True)
class Skill:
    """What a node learns. `reference(task, messages)` returns the next turn a perfect player would write."""

    name: str
    version: str
    description: str
    tasks: TaskBank
    env: Environment
    rubric: Rubric
    reference: Callable[[Task, list[Message]], str] | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise SkillError(f"bad skill name {self.name!r}: use lower-case letters, digits, - and _ (max 40)")

    def reset(self, task: Task, seed: int) -> EpisodeState:
        """Start an episode."""
        return self.env.reset(task, seed)

    def grade(self, state: EpisodeState) -> Episode:
        """The graded record of a finished episode (rewards, correctness)."""
        episode = self.env.to_episode(state, self.name)
        try:
            episode.correct = episode.outcome == "ok" and self.tasks.check(state.task, episode.answer)
            return self.rubric.score(episode, state.task)
        except Exception as e:  # a broken rubric is the skill's bug, never the model's: env_error
            log.warning("grading error in %s: %s", state.task.id, e)
            episode.outcome, episode.stop_reason, episode.correct, episode.reward = "env_error", "env_error", False, 0.0
            episode.turn_rewards = [0.0] * len(episode.turns)
            episode.error = "".join(traceback.format_exception_only(type(e), e)).strip()
            return episode

    def run_episode(self, task: Task, seed: int, policy: Policy) -> Episode:
        """Play one episode with a text-level `policy` (messages so far -> next assistant text)."""
        state = self.reset(task, seed)
        while not state.done:
            self.env.step(state, policy(list(state.messages)))
        return self.grade(state)

    def demonstration(self, task: Task, seed: int = 0) -> Episode:
        """The episode the `reference` player produces (the warm-up data, rendered by the real environment)."""
        if self.reference is None:
            raise SkillError(f"skill {self.name} has no reference player")
        return self.run_episode(task, seed, lambda messages: self.reference(task, messages))

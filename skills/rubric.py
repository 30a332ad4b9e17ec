"""Rubrics: weighted reward functions over an episode, optional per-turn rewards, metrics at weight 0.

A reward function receives only the arguments it names, from: `answer` (the final answer or None),
`task`, `episode`, `turns`, `tool_calls`, `messages`; a per-turn function also gets `turn` (a `Turn`).
The episode reward is the weighted sum of the episode-level functions plus the sum of the per-turn
rewards. An episode whose outcome is not `ok` (timeout, tool error, env error) is graded 0, per-turn
rewards included, so that running out the clock is never worth anything; its metrics are still kept.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

from skillswarm.protocol.errors import SkillError
from skillswarm.skills.episode import Episode
from skillswarm.skills.taskbank import Task

EPISODE_ARGS = frozenset({"answer", "task", "episode", "turns", "tool_calls", "messages"})
TURN_ARGS = EPISODE_ARGS | {"turn"}


@dataclass(frozen=True)
class RewardFunc:
    """One reward function: its weight (0 = a metric only) and whether it scores each turn."""

    fn: Callable[..., float]
    weight: float = 1.0
    per_turn: bool = False
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or getattr(self.fn, "__name__", "reward")

    def args(self) -> list[str]:
        return list(inspect.signature(self.fn).parameters)


class Rubric:
    """A list of reward functions; `score` fills an episode's rewards."""

    def __init__(self, funcs: Sequence[RewardFunc | Callable[..., float]]) -> None:
        self.funcs = [f if isinstance(f, RewardFunc) else RewardFunc(f) for f in funcs]
        labels = [f.label for f in self.funcs]
        if len(set(labels)) != len(labels):
            raise SkillError(f"rubric reward functions need distinct names, got {labels}")
        for f in self.funcs:
            allowed = TURN_ARGS if f.per_turn else EPISODE_ARGS
            unknown = set(f.args()) - allowed
            if unknown:
                raise SkillError(f"reward function {f.label} asks for {sorted(unknown)}; it may name {sorted(allowed)}")

    def score(self, episode: Episode, task: Task) -> Episode:
        """Compute every function on `episode` (in place) and return it."""
        base = {"answer": episode.answer, "task": task, "episode": episode, "turns": episode.turns,
                "tool_calls": episode.tool_calls, "messages": episode.messages}
        total = 0.0
        turn_rewards = [0.0] * len(episode.turns)
        values: dict[str, float] = {}
        for f in self.funcs:
            names = f.args()
            if f.per_turn:
                per = [float(f.fn(**{k: ({**base, "turn": t})[k] for k in names})) for t in episode.turns]
                values[f.label] = sum(per)
                for i, v in enumerate(per):
                    turn_rewards[i] += f.weight * v
            else:
                v = float(f.fn(**{k: base[k] for k in names}))
                values[f.label] = v
                total += f.weight * v
        episode.rewards = values
        if episode.outcome == "ok":
            episode.turn_rewards = turn_rewards
            episode.reward = total + sum(turn_rewards)
        else:
            episode.turn_rewards = [0.0] * len(episode.turns)
            episode.reward = 0.0
        return episode

    def describe(self) -> list[dict[str, object]]:
        """Name, weight and kind of each function (for `skills show`)."""
        return [{"name": f.label, "weight": f.weight, "per_turn": f.per_turn,
                 "kind": "metric" if f.weight == 0 else "reward"} for f in self.funcs]

"""Held-out evaluation: run a skill's fixed eval split through its environment on a model.

Used by `skillswarm eval`, by the trainer (eval every K steps) and by the coordinator (every skill
on a merged checkpoint). Greedy by default, so a model's score is a property of its weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from skillswarm.node.rl.config import EVAL_N
from skillswarm.node.rl.engines.base import InferenceEngine
from skillswarm.node.rl.engines.hf import HFEngine
from skillswarm.node.rl.rollout import MAX_NEW_TOKENS, MAX_TOKENS, Rollout, run_episodes
from skillswarm.skills.episode import OUTCOMES
from skillswarm.skills.registry import get_skill
from skillswarm.skills.skill import Skill


@dataclass
class EvalResult:
    """Accuracy (share of episodes answered correctly), mean reward, and a count per outcome."""

    skill: str
    n: int
    accuracy: float
    mean_reward: float
    outcomes: dict[str, int]
    seconds: float = 0.0
    rollouts: list[Rollout] = field(default_factory=list, repr=False)
    rubric: dict[str, float] = field(default_factory=dict)  # each reward function's mean, weight-0 metrics included
    # Per kind of task (`TaskBank.stratum`), where the skill mixes kinds: {kind: {"n", "accuracy"}}. A skill can
    # solve one kind and none of another (calc: every a*b, few a*b+c), which one accuracy hides.
    by_kind: dict[str, dict[str, float]] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        """The `skillswarm eval --json` object."""
        return {"skill": self.skill, "n": self.n, "accuracy": self.accuracy, "mean_reward": self.mean_reward,
                "outcomes": dict(self.outcomes), "rubric": dict(self.rubric),
                **({"by_kind": {k: dict(v) for k, v in self.by_kind.items()}} if self.by_kind else {})}


def rubric_means(episodes: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each reward function (and weight-0 metric) over episodes' raw values, by name."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for rewards in episodes:
        for name, value in rewards.items():
            sums[name] = sums.get(name, 0.0) + float(value)
            counts[name] = counts.get(name, 0) + 1
    return {name: round(sums[name] / counts[name], 6) for name in sorted(sums)}


def accuracy_by_kind(kinds: Sequence[str], rollouts: Sequence[Rollout]) -> dict[str, dict[str, float]]:
    """Episodes and accuracy per kind of task (one kind per rollout, in order); empty for a single kind."""
    if len(kinds) != len(rollouts):
        raise ValueError(f"{len(kinds)} kinds for {len(rollouts)} rollouts")
    if len(set(kinds)) < 2:
        return {}
    tally: dict[str, list[int]] = {}
    for kind, r in zip(kinds, rollouts):
        counts = tally.setdefault(kind, [0, 0])
        counts[0] += 1
        counts[1] += bool(r.episode.correct)
    return {k: {"n": n, "accuracy": round(ok / n, 6)} for k, (n, ok) in sorted(tally.items())}


def summarize(skill: str, rollouts: list[Rollout], seconds: float = 0.0, kinds: Sequence[str] = ()) -> EvalResult:
    """Accuracy, mean reward and outcome counts of finished rollouts (and per kind, given each one's kind)."""
    n = len(rollouts)
    outcomes = {o: 0 for o in OUTCOMES}
    for r in rollouts:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    accuracy = sum(r.episode.correct for r in rollouts) / n if n else 0.0
    mean_reward = sum(r.reward for r in rollouts) / n if n else 0.0
    return EvalResult(skill, n, round(accuracy, 6), round(mean_reward, 6), outcomes, round(seconds, 3), rollouts,
                      rubric_means([r.episode.rewards for r in rollouts]), accuracy_by_kind(kinds, rollouts) if kinds else {})


def evaluate(model: Path | str | InferenceEngine, skill: str | Skill, n: int = EVAL_N, seed: int = 0, *,
             temperature: float = 0.0, max_new_tokens: int = MAX_NEW_TOKENS, max_tokens: int = MAX_TOKENS,
             on_done: Callable[[Rollout], None] | None = None, task_seed: int | None = None,
             offset: int = 0) -> EvalResult:
    """Evaluate a model (directory or engine) on the first `n` held-out tasks of `skill` (or on `n` held-out
    tasks drawn with `task_seed`); with `offset`, on the `n` that follow the first `offset` of that list."""
    if n < 1 or offset < 0:
        raise ValueError("n must be >= 1 and offset >= 0")
    engine = model if not isinstance(model, (str, Path)) else HFEngine.load(model)
    sk = get_skill(skill) if isinstance(skill, str) else skill
    tasks = sk.tasks.eval_tasks(offset + n, task_seed)[offset:]
    start = time.monotonic()
    rollouts = run_episodes(engine, sk, tasks, seed, temperature=temperature, max_new_tokens=max_new_tokens,
                            max_tokens=max_tokens, sample_seed=seed if temperature > 0 else None, on_done=on_done)
    return summarize(sk.name, rollouts, time.monotonic() - start, [str(sk.tasks.stratum(t)) for t in tasks])

"""Anchor episodes: the starting policy's own greedy episodes on the network's other skills.

A worker trains one skill, but its delta is merged with the other skills' deltas. The retain loss
(`TrainConfig.retain`) keeps the policy's next-token distributions on these episodes close to the
starting policy's where it answers correctly, so a delta changes its own skill and keeps what the others
get right; then the deltas of a round add up instead of undoing each other (learning without forgetting,
Li & Hoiem 2016).
"""

from __future__ import annotations

from typing import Sequence

from skillswarm.node.rl.engines.base import InferenceEngine
from skillswarm.node.rl.rollout import Rollout, run_episodes
from skillswarm.skills.registry import get_skill


def anchor_episodes(engine: InferenceEngine, skills: Sequence[str], own: str, n: int, seed: int) -> list[Rollout]:
    """The correct ones of `n` greedy episodes per skill of `skills` other than `own` (training tasks drawn with
    `seed`): what the start gets right is what a merge can lose; holding its wrong answers in place only
    blocks transfer."""
    episodes: list[Rollout] = []
    for name in skills:
        if name == own:
            continue
        skill = get_skill(name)
        tasks = skill.tasks.train_tasks(n, seed)
        episodes += [r for r in run_episodes(engine, skill, tasks, seed, temperature=0.0) if r.episode.correct and any(r.loss_mask)]
    return episodes

"""Anchor episodes: the starting policy's own greedy episodes on the network's other skills.

A worker trains one skill, but its delta is merged with the other skills' deltas. The retain loss
(`TrainConfig.retain`) keeps the policy's next-token distributions on these episodes close to the
starting policy's where it answers correctly, so a delta changes its own skill and keeps what the others
get right; then the deltas of a round add up instead of undoing each other (learning without forgetting,
Li & Hoiem 2016).

Part of each skill's anchors are its typical right answers (the first in task order), part its least
confident ones: what another skill's training flips first is the right answers the start barely gives
(a saturated skill loses almost only those), and random anchors of a skill solved 99 times in 100 hold
almost none of them.
"""

from __future__ import annotations

from typing import Sequence

from skillswarm.node.rl.engines.base import InferenceEngine
from skillswarm.node.rl.rollout import Rollout, run_episodes
from skillswarm.skills.registry import get_skill

# Tasks played per skill, at most, in units of the `n` anchors asked for: a skill the start solves one time in
# four still gets its n, so the skills it is weakest at (the ones still learning, whose gains a merge loses
# first) are held as firmly as the ones it has mastered. With fragile anchors every one is played: the least
# confident of the right answers are picked from all of them.
MAX_TRIES = 4


def confidence(r: Rollout) -> float:
    """How firmly the policy gave this episode's answer: the lowest logprob of the tokens it generated (greedy
    episodes carry the log-softmax at temperature 1), so a small change of the weights flips the lowest first."""
    return min((lp for lp, own in zip(r.logprobs, r.loss_mask) if own), default=0.0)


def anchor_episodes(engine: InferenceEngine, skills: Sequence[str], own: str, n: int, seed: int,
                    fragile: float = 0.0) -> list[Rollout]:
    """Up to `n` correct greedy episodes per skill of `skills` other than `own` (on training tasks drawn with
    `seed`, `n` at a time, at most MAX_TRIES * n): what the start gets right is what a merge can lose; holding
    its wrong answers in place only blocks transfer. A `fragile` share of them are the least confident right
    answers of all MAX_TRIES * n tasks (`confidence`), the rest the first right answers in task order."""
    if not 0.0 <= fragile <= 1.0:
        raise ValueError("fragile must be a share in [0, 1]")
    least = round(n * fragile)
    episodes: list[Rollout] = []
    for name in skills:
        if name == own:
            continue
        skill = get_skill(name)
        tasks = skill.tasks.train_tasks(n * MAX_TRIES, seed)
        right: list[Rollout] = []
        for start in range(0, len(tasks), n):
            chunk = tasks[start:start + n]
            right += [r for r in run_episodes(engine, skill, chunk, seed + start, temperature=0.0)
                      if r.episode.correct and any(r.loss_mask)]
            if len(right) >= n and not least:
                break
        typical = right[:n - least]
        episodes += typical + sorted(right[len(typical):], key=confidence)[:n - len(typical)]
    return episodes

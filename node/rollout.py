"""Rollouts: run multi-turn episodes of a skill in batches on an inference engine, at token level.

Every live episode generates its next turn in one batched `generate` call; each turn's text goes to
the skill's environment, whose observations are rendered by the chat template and appended as
tokens the model did not produce. The result per episode: the full token ids, a loss mask that is 1
exactly on model-generated tokens, the behaviour logprobs aligned with them (0 where the mask is 0),
the graded text-level `Episode` (rewards per turn and in total, outcome), and timing.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from skillswarm.skills.chat import encode, render, suffix
from skillswarm.skills.environment import EpisodeState
from skillswarm.skills.episode import Episode
from skillswarm.skills.skill import Skill
from skillswarm.skills.taskbank import Task

log = logging.getLogger(__name__)


class Engine(Protocol):
    """What a rollout needs of an inference engine (`skillswarm.node.generation.HFEngine` is one)."""

    tokenizer: Any
    policy_version: int
    max_context: int

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
                 seed: int | None = None, stop_token_ids: Any = None) -> list[Any]: ...


@dataclass
class Rollout:
    """One episode at token level. `logprobs[i]` is the behaviour logprob of `token_ids[i]` given the
    tokens before it (0.0 where `loss_mask[i]` is 0); `prompt_len` tokens precede the first model turn;
    `turn_spans[k]` is the [start, end) range of model turn k's tokens (for per-turn rewards)."""

    episode: Episode
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_len: int = 0
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    policy_version: int = 0
    gen_seconds: float = 0.0
    env_seconds: float = 0.0

    @property
    def reward(self) -> float:
        return self.episode.reward

    @property
    def outcome(self) -> str:
        return self.episode.outcome

    @property
    def completion_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class _Live:
    state: EpisodeState
    rollout: Rollout
    text: str  # the rendered text the token ids stand for


def _start(skill: Skill, engine: Engine, task: Task, seed: int) -> _Live:
    state = skill.reset(task, seed)
    text = render(engine.tokenizer, state.messages, add_generation_prompt=True)
    ids = encode(engine.tokenizer, text)
    rollout = Rollout(episode=None, token_ids=ids, loss_mask=[0] * len(ids), logprobs=[0.0] * len(ids),  # type: ignore[arg-type]
                      prompt_len=len(ids), policy_version=engine.policy_version)
    return _Live(state, rollout, text)


def _take_turn(skill: Skill, engine: Engine, live: _Live, gen: Any, budget: int) -> None:
    """Append the generated tokens, step the environment, and append its observations as tokens
    (unless they leave no room to generate within `budget`: then the episode is out of tokens)."""
    tok, r, state = engine.tokenizer, live.rollout, live.state
    r.turn_spans.append((len(r.token_ids), len(r.token_ids) + len(gen.token_ids)))
    r.token_ids += gen.token_ids
    r.loss_mask += [1] * len(gen.token_ids)
    r.logprobs += list(gen.logprobs)
    content_ids = gen.token_ids[:-1] if gen.finish_reason == "stop" else gen.token_ids
    content = tok.decode(content_ids, skip_special_tokens=False)
    t0 = time.monotonic()
    observations = skill.env.step(state, content)
    r.env_seconds += time.monotonic() - t0
    if state.done:
        return
    generated = live.text + tok.decode(gen.token_ids, skip_special_tokens=False)
    before_obs = render(tok, state.messages[: len(state.messages) - len(observations)])
    after = render(tok, state.messages, add_generation_prompt=True)
    try:  # the template's end-of-turn text is already in `generated` when the model stopped by itself
        piece = suffix(after, generated)
    except Exception:
        log.debug("chat template re-renders the model's turn differently; appending from the rendered turn")
        piece = suffix(after, before_obs)
    ids = encode(tok, piece)
    if len(r.token_ids) + len(ids) >= budget:
        del state.messages[len(state.messages) - len(observations):]  # the model never sees them
        skill.env.stop(state, "max_tokens")
        return
    r.token_ids += ids
    r.loss_mask += [0] * len(ids)
    r.logprobs += [0.0] * len(ids)
    live.text = after


def run_episodes(engine: Engine, skill: Skill, tasks: Sequence[Task], seeds: Sequence[int] | int = 0, *,
                 temperature: float = 1.0, max_new_tokens: int = 64, max_tokens: int = 512,
                 sample_seed: int | None = None, on_done: Callable[[Rollout], None] | None = None) -> list[Rollout]:
    """Play one episode per task (env seed from `seeds`: one per task, or a base added to the index).

    `max_new_tokens` caps a turn, `max_tokens` a whole episode (prompt included, and the engine's
    context); an episode that runs out of tokens is a timeout. `sample_seed` makes sampling
    reproducible. Returns the rollouts in task order; `on_done` is called as each one finishes."""
    seed_list = list(seeds) if not isinstance(seeds, int) else [seeds + i for i in range(len(tasks))]
    if len(seed_list) != len(tasks):
        raise ValueError("give one seed per task, or a single base seed")
    budget = min(max_tokens, engine.max_context)
    lives = [_start(skill, engine, t, s) for t, s in zip(tasks, seed_list)]
    done: list[Rollout | None] = [None] * len(lives)

    def finish(i: int) -> None:
        live = lives[i]
        live.rollout.episode = skill.grade(live.state)
        done[i] = live.rollout
        if on_done is not None:
            on_done(live.rollout)

    turn = 0
    while True:
        active = [i for i, live in enumerate(lives) if done[i] is None and not live.state.done]
        for i in [i for i, live in enumerate(lives) if done[i] is None and live.state.done]:
            finish(i)
        if not active:
            break
        room = {i: min(max_new_tokens, budget - len(lives[i].rollout.token_ids)) for i in active}
        for i in [i for i in active if room[i] <= 0]:
            skill.env.stop(lives[i].state, "max_tokens")
        active = [i for i in active if room[i] > 0]
        if not active:
            continue
        # one batch per turn; rows that have less room left than the others stop early (length).
        longest = max(len(lives[i].rollout.token_ids) for i in active)
        step_new = min(max(room[i] for i in active), engine.max_context - longest)
        t0 = time.monotonic()
        gens = engine.generate([lives[i].rollout.token_ids for i in active], step_new, temperature,
                               seed=None if sample_seed is None else sample_seed * 1000 + turn)
        elapsed = time.monotonic() - t0
        for i, gen in zip(active, gens):
            live = lives[i]
            if len(gen.token_ids) > room[i]:
                gen.token_ids, gen.logprobs, gen.finish_reason = gen.token_ids[:room[i]], gen.logprobs[:room[i]], "length"
            live.rollout.gen_seconds += elapsed
            try:
                _take_turn(skill, engine, live, gen, budget)
            except Exception as e:  # rendering or decoding broke: infrastructure, not the model
                log.warning("rollout error in %s: %s", live.state.task.id, e)
                live.state.finish("env_error", "env_error", "".join(traceback.format_exception_only(type(e), e)).strip())
        turn += 1
    return [r for r in done if r is not None]

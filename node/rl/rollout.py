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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from skillswarm.node.rl.config import TrainConfig, default_of
from skillswarm.node.rl.engines.base import InferenceEngine
from skillswarm.skills.chat import encode, render, suffix
from skillswarm.skills.environment import EpisodeState
from skillswarm.skills.episode import Episode, Message
from skillswarm.skills.skill import Skill
from skillswarm.skills.taskbank import Task

log = logging.getLogger(__name__)


# A run's defaults (TrainConfig), for callers that play episodes outside a run (evaluation, tests).
TEMPERATURE, MAX_NEW_TOKENS, MAX_TOKENS = (default_of(TrainConfig, name)
                                           for name in ("temperature", "max_new_tokens", "max_tokens"))

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


def _start(skill: Skill, engine: InferenceEngine, task: Task, seed: int) -> _Live:
    state = skill.reset(task, seed)
    state.batched = True  # its wall-clock limit counts its own environment steps, not the batch's waits
    text = render(engine.tokenizer, state.messages, add_generation_prompt=True)
    ids = encode(engine.tokenizer, text)
    rollout = Rollout(episode=None, token_ids=ids, loss_mask=[0] * len(ids), logprobs=[0.0] * len(ids),  # type: ignore[arg-type]
                      prompt_len=len(ids), policy_version=engine.policy_version)
    return _Live(state, rollout, text)


def _append_generation(engine: InferenceEngine, live: _Live, gen: Any) -> str:
    """Append a turn's generated tokens to the rollout; return the text the environment gets."""
    r = live.rollout
    r.turn_spans.append((len(r.token_ids), len(r.token_ids) + len(gen.token_ids)))
    r.token_ids += gen.token_ids
    r.loss_mask += [1] * len(gen.token_ids)
    r.logprobs += list(gen.logprobs)
    content_ids = gen.token_ids[:-1] if gen.finish_reason == "stop" else gen.token_ids
    return engine.tokenizer.decode(content_ids, skip_special_tokens=False)


def _step_env(skill: Skill, live: _Live, content: str) -> list[Message]:
    """Hand the turn to the environment (timed); its observations come back."""
    t0 = time.monotonic()
    try:
        return skill.env.step(live.state, content)
    except Exception as e:
        _broken(live, e)
        return []
    finally:
        live.rollout.env_seconds += time.monotonic() - t0


def _append_observations(skill: Skill, engine: InferenceEngine, live: _Live, gen: Any, observations: list[Message],
                         budget: int) -> None:
    """Append the environment's observations as tokens (unless they leave no room to generate within
    `budget`: then the episode is out of tokens)."""
    tok, r, state = engine.tokenizer, live.rollout, live.state
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


def _broken(live: _Live, e: Exception) -> None:
    """Rendering or decoding broke: infrastructure, not the model (env_error)."""
    log.warning("rollout error in %s: %s", live.state.task.id, e)
    live.state.finish("env_error", "env_error", "".join(traceback.format_exception_only(type(e), e)).strip())


def run_episodes(engine: InferenceEngine, skill: Skill, tasks: Sequence[Task], seeds: Sequence[int] | int = 0, *,
                 temperature: float = TEMPERATURE, max_new_tokens: int = MAX_NEW_TOKENS, max_tokens: int = MAX_TOKENS,
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
    # Environments that wait on something (a sandbox, a remote tool) say how many episodes may step, and be
    # graded, at once; the rest run one after another. Results stay in task order either way.
    workers = max(1, min(skill.env.concurrency, len(lives)))
    pool = ThreadPoolExecutor(workers, thread_name_prefix="episode-env") if workers > 1 else None

    def each(fn: Callable[[int], Any], indices: list[int]) -> list[Any]:
        return list(pool.map(fn, indices)) if pool is not None and len(indices) > 1 else [fn(i) for i in indices]

    def finish(i: int) -> None:
        live = lives[i]
        live.rollout.episode = skill.grade(live.state)
        done[i] = live.rollout

    def finish_all(indices: list[int]) -> None:
        each(finish, indices)
        if on_done is not None:
            for i in indices:
                on_done(done[i])  # type: ignore[arg-type]

    try:
        turn = 0
        while True:
            active = [i for i, live in enumerate(lives) if done[i] is None and not live.state.done]
            finish_all([i for i, live in enumerate(lives) if done[i] is None and live.state.done])
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
            gens = dict(zip(active, engine.generate([lives[i].rollout.token_ids for i in active], step_new, temperature,
                                                    seed=None if sample_seed is None else sample_seed * 1000 + turn)))
            elapsed = time.monotonic() - t0
            contents: dict[int, str] = {}
            for i in active:
                gen, live = gens[i], lives[i]
                if len(gen.token_ids) > room[i]:
                    gen.token_ids, gen.logprobs, gen.finish_reason = gen.token_ids[:room[i]], gen.logprobs[:room[i]], "length"
                live.rollout.gen_seconds += elapsed
                try:
                    contents[i] = _append_generation(engine, live, gen)
                except Exception as e:
                    _broken(live, e)
            stepped = list(contents)
            observations = dict(zip(stepped, each(lambda i: _step_env(skill, lives[i], contents[i]), stepped)))
            for i in stepped:
                try:
                    _append_observations(skill, engine, lives[i], gens[i], observations[i], budget)
                except Exception as e:
                    _broken(lives[i], e)
            turn += 1
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    return [r for r in done if r is not None]

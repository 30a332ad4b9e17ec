"""Environments: the multi-turn episode loop, text in and text out.

`reset(task, seed)` gives the opening messages; then, for each model turn, `step(state, text)` parses
it (see `skillswarm.skills.toolcall`), runs its tool calls and returns the observations the model sees
next (a `tool` turn), or ends the episode. It stops on a final answer, the turn limit or the
wall-clock limit. Failure semantics (environments get learned, quirks included):
- a malformed call, or a tool failing on the model's input, is an `<error>` observation;
- running out of turns or time is outcome `timeout` (or `tool_error` when the last call failed),
  graded 0 and kept; a single-turn environment simply ends after its one turn (`ok`);
- any other exception (our bug, infrastructure) ends the episode as `env_error`, never raised.
Subclasses override `env_response` (and `opening`) for other loops; state lives in `EpisodeState`,
so one environment object serves any number of concurrent episodes.
"""

from __future__ import annotations

import logging
import random
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Sequence

from skillswarm.skills.episode import Episode, Message, Outcome, ToolCall, Turn
from skillswarm.skills.taskbank import Task
from skillswarm.skills.toolcall import format_error, format_result, parse_turn
from skillswarm.skills.tools import Tool, ToolInputError

log = logging.getLogger(__name__)


@dataclass
class EpisodeState:
    """A live episode: its messages so far, parsed turns, and (once `done`) how it ended."""

    task: Task
    seed: int
    messages: list[Message]
    rng: random.Random
    turns: list[Turn] = field(default_factory=list)
    done: bool = False
    outcome: Outcome = "ok"
    stop_reason: str = ""
    answer: str | None = None
    error: str | None = None
    started: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.time)
    ended: float | None = None
    data: dict[str, Any] = field(default_factory=dict)
    env_seconds: float = 0.0  # time spent in this episode's environment steps (its tools)
    batched: bool = False  # played in a batch: waits for other episodes' generation and tools are not its own

    def finish(self, outcome: Outcome, stop_reason: str, error: str | None = None) -> None:
        """End the episode (first call wins)."""
        if not self.done:
            self.done, self.outcome, self.stop_reason, self.error = True, outcome, stop_reason, error
            self.ended = time.monotonic()

    @property
    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    @property
    def charged_seconds(self) -> float:
        """The time the wall-clock limit counts: all of it when the episode runs alone, only its own
        environment steps in a batch (whose generation is bounded by tokens, and shared)."""
        return self.env_seconds if self.batched else self.seconds


class Environment:
    """A chat environment with optional tools. With no tools and `max_turns=1` it is single-turn.

    `max_seconds`: the wall-clock limit of an episode; in a batched rollout only its own environment steps
    count (see `EpisodeState.charged_seconds`), so a slow machine or a large batch never times episodes out.
    `concurrency`: how many episodes may step (and be graded) at once in a rollout batch. Leave it at 1
    unless the tools and the rubric are thread-safe and spend their time waiting (a sandbox subprocess, a
    remote call): then a batch's tool calls overlap instead of queueing."""

    def __init__(self, system_prompt: str | None = None, tools: Sequence[Tool] = (), max_turns: int = 1,
                 max_seconds: float = 120.0, max_calls_per_turn: int = 4, concurrency: int = 1) -> None:
        if max_turns < 1 or max_seconds <= 0 or max_calls_per_turn < 1 or concurrency < 1:
            raise ValueError("max_turns, max_calls_per_turn and concurrency must be >= 1 and max_seconds > 0")
        self.concurrency = concurrency
        self.system_prompt = system_prompt
        self.tools = {t.name: t for t in tools}
        self.max_turns = max_turns
        self.max_seconds = max_seconds
        self.max_calls_per_turn = max_calls_per_turn

    @property
    def single_turn(self) -> bool:
        return self.max_turns == 1 and not self.tools

    def opening(self, task: Task) -> list[Message]:
        """The messages before the model's first turn: the system prompt (if any) and the task."""
        head = [Message("system", self.system_prompt)] if self.system_prompt else []
        return [*head, Message("user", task.prompt)]

    def reset(self, task: Task, seed: int) -> EpisodeState:
        """Start an episode of `task`; `seed` drives any randomness of the environment."""
        return EpisodeState(task=task, seed=seed, messages=list(self.opening(task)), rng=random.Random(seed))

    def step(self, state: EpisodeState, text: str) -> list[Message]:
        """Take the model's turn; return the observations to show it (empty once the episode is done)."""
        if state.done:
            raise RuntimeError("step() on a finished episode")
        state.messages.append(Message("assistant", text))
        turn = Turn(index=len(state.turns), text=text)
        state.turns.append(turn)
        t0 = time.monotonic()
        try:
            observations = self.env_response(state, turn)
        except Exception as e:  # our bug or infrastructure, never the model's doing
            log.warning("environment error in %s: %s", state.task.id, e, exc_info=log.isEnabledFor(logging.DEBUG))
            state.finish("env_error", "env_error", "".join(traceback.format_exception_only(type(e), e)).strip())
            return []
        finally:
            state.env_seconds += time.monotonic() - t0
        if not state.done:
            if state.charged_seconds > self.max_seconds:
                state.finish("timeout", "wall_clock")
            elif len(state.turns) >= self.max_turns:
                if self.single_turn:
                    state.finish("ok", "no_answer")
                else:
                    state.finish("tool_error" if turn.tool_error else "timeout", "max_turns")
        if state.done:
            return []
        state.messages.extend(observations)
        return observations

    def env_response(self, state: EpisodeState, turn: Turn) -> list[Message]:
        """The default loop: an answer ends the episode; calls run and come back as one `tool` turn."""
        parsed = parse_turn(turn.text, set(self.tools), self.max_calls_per_turn)
        turn.error, turn.answer, turn.tool_error = parsed.error, parsed.answer, parsed.call_error
        if parsed.error is None and parsed.answer is not None:
            state.answer = parsed.answer
            state.finish("ok", "answer")
            return []
        if self.single_turn:
            return []
        if parsed.error is not None:
            return [Message("tool", format_error(parsed.error))]
        if not parsed.calls:
            turn.error = "reply with <answer>...</answer> or a tool call"
            return [Message("tool", format_error(turn.error))]
        replies = []
        for call in parsed.calls:
            record = ToolCall(turn=turn.index, name=call.name, input=call.input)
            t0 = time.monotonic()
            try:
                record.output = str(self.tools[call.name](call.input))
                replies.append(format_result(record.output))
            except ToolInputError as e:
                record.error = str(e) or type(e).__name__
                turn.tool_error = True
                replies.append(format_error(record.error))
            finally:
                record.seconds = time.monotonic() - t0
                turn.calls.append(record)
        return [Message("tool", "".join(replies))]

    def stop(self, state: EpisodeState, stop_reason: str = "max_tokens") -> None:
        """End a live episode from outside (the rollout ran out of its token budget): a timeout."""
        state.finish("timeout", stop_reason)

    def to_episode(self, state: EpisodeState, skill: str) -> Episode:
        """The ungraded record of a finished episode."""
        if not state.done:
            raise RuntimeError("to_episode() on a live episode")
        return Episode(skill=skill, task_id=state.task.id, seed=state.seed, messages=list(state.messages),
                       turns=list(state.turns), outcome=state.outcome, stop_reason=state.stop_reason,
                       answer=state.answer, started_at=state.started_at, seconds=state.seconds, error=state.error)

"""The record of one episode: messages (which turns the model wrote, which the environment wrote),
tool calls, rewards, timing and the outcome. Text-level; the rollout adds tokens beside it."""

from __future__ import annotations

from typing import Literal

import msgspec

Role = Literal["system", "user", "assistant", "tool"]
Outcome = Literal["ok", "timeout", "tool_error", "env_error"]
# ok: the episode ended normally (answer given, or a single-turn skill's one turn taken);
# timeout: wall-clock, turn or token budget ran out (graded 0, kept); tool_error: ran out with the last
# tool call failed (graded 0, kept); env_error: our bug or infrastructure (the trainer drops the group).
OUTCOMES: tuple[str, ...] = ("ok", "timeout", "tool_error", "env_error")


class Message(msgspec.Struct, frozen=True):
    """One chat turn. Only `assistant` turns were produced by the model (trainable); the rest are masked."""

    role: Role
    content: str

    @property
    def trainable(self) -> bool:
        return self.role == "assistant"

    def as_dict(self) -> dict[str, str]:
        """The shape chat templates take."""
        return {"role": self.role, "content": self.content}


class ToolCall(msgspec.Struct):
    """One tool call: in which turn, what the model asked, what came back (output or error), how long."""

    turn: int
    name: str
    input: str
    output: str | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


class Turn(msgspec.Struct):
    """One model turn, parsed: its text, the final answer it gave, its calls, its format error, and
    whether its tool use failed (a malformed call, or a call that returned an error)."""

    index: int
    text: str
    answer: str | None = None
    calls: list[ToolCall] = msgspec.field(default_factory=list)
    error: str | None = None
    tool_error: bool = False


class Episode(msgspec.Struct):
    """A finished, graded episode.

    reward: the rubric's weighted total (0 unless outcome is ok); turn_rewards: the per-turn part of it,
    one entry per model turn; rewards: each reward function's raw value (metrics included), by name.
    stop_reason: answer | no_answer | max_turns | wall_clock | max_tokens | env_error."""

    skill: str
    task_id: str
    seed: int
    messages: list[Message]
    turns: list[Turn]
    outcome: Outcome
    stop_reason: str
    answer: str | None = None
    correct: bool = False
    reward: float = 0.0
    turn_rewards: list[float] = msgspec.field(default_factory=list)
    rewards: dict[str, float] = msgspec.field(default_factory=dict)
    started_at: float = 0.0
    seconds: float = 0.0
    error: str | None = None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [c for t in self.turns for c in t.calls]

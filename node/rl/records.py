"""Recorded trajectories, the format the recording endpoint writes and the trainer reads: trajectories at
token level (exact ids, loss masks, sampling logprobs and the policy version of every call), their rewards,
and their groups; and a trajectory store's files.

A trajectory is one agent run. Its calls extend one token sequence (a segment) as long as each request
continues the conversation the previous one ended with; a request that rewrites history starts a new
segment, so no token is ever trained on that the model did not see. A group is the set of trajectories
that answer one prompt (GRPO compares them); a store appends closed groups to `groups.jsonl`, expired
trajectories to `expired.jsonl`, and names the weights its logprobs belong to in `store.json`.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Literal

import msgspec

GROUPS_FILE, EXPIRED_FILE, MANIFEST = "groups.jsonl", "expired.jsonl", "store.json"
Status = Literal["open", "scored", "expired"]
# Bounds on what a client may say about a reward: a number a GRPO advantage can be computed from.
MAX_ABS_REWARD = 1e6


class Call(msgspec.Struct):
    """One completion: where its tokens lie in which segment, and how they were sampled."""

    segment: int
    start: int
    end: int
    policy_version: int
    temperature: float
    finish_reason: str
    created: float


class Segment(msgspec.Struct):
    """A token sequence the model saw as one context. `conversation` is the normalized (role, text)
    list up to and including its last generated turn; `text` the rendered text the ids stand for;
    `internal` the same turns as the chat template renders them (the model's raw turn text)."""

    token_ids: list[int] = msgspec.field(default_factory=list)
    loss_mask: list[int] = msgspec.field(default_factory=list)
    logprobs: list[float] = msgspec.field(default_factory=list)
    conversation: list[tuple[str, str]] = msgspec.field(default_factory=list)
    internal: list[tuple[str, str]] = msgspec.field(default_factory=list)
    text: str = ""


class Trajectory(msgspec.Struct):
    """One agent run and its reward (`reward` is the total; `turn_rewards` the per-turn part of it)."""

    id: str
    group: str
    name: str
    created: float
    updated: float
    task_id: str | None = None
    group_size: int | None = None
    segments: list[Segment] = msgspec.field(default_factory=list)
    calls: list[Call] = msgspec.field(default_factory=list)
    status: Status = "open"
    reward: float | None = None
    turn_rewards: list[float] = msgspec.field(default_factory=list)
    correct: bool | None = None
    reason: str | None = None
    scored_by: str | None = None  # feedback | rubric | ingest
    metrics: dict[str, float] = msgspec.field(default_factory=dict)

    @property
    def policy_version(self) -> int:
        """The oldest policy that wrote any of its tokens (what staleness is measured from)."""
        return min((c.policy_version for c in self.calls), default=0)

    @property
    def temperatures(self) -> set[float]:
        return {c.temperature for c in self.calls}


class GroupRecord(msgspec.Struct):
    """A closed group: its scored trajectories (expired ones are counted, not kept) and why it closed."""

    id: str
    name: str
    closed_at: float
    reason: str  # complete | idle | deadline | ingest
    trajectories: list[Trajectory]
    expired: int = 0


def check_reward(value: object, what: str = "reward") -> float:
    """A finite number within bounds, else ValueError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number")
    v = float(value)
    if not math.isfinite(v) or abs(v) > MAX_ABS_REWARD:
        raise ValueError(f"{what} must be finite and within +-{MAX_ABS_REWARD:g}")
    return v


def opening_key(name: str, conversation: list[tuple[str, str]]) -> str:
    """The default group id: a hash of the store name and the conversation before the first model turn,
    so runs of the same prompt form one group without the harness naming it."""
    opening = []
    for role, text in conversation:
        if role == "assistant":
            break
        opening.append([role, text])
    digest = hashlib.sha256(json.dumps([name, opening], separators=(",", ":")).encode()).hexdigest()
    return f"g-{digest[:24]}"


_encoder = msgspec.json.Encoder()
_group_decoder = msgspec.json.Decoder(GroupRecord)
_trajectory_decoder = msgspec.json.Decoder(Trajectory)


def encode_line(record: GroupRecord | Trajectory) -> bytes:
    """One JSONL line."""
    return _encoder.encode(record) + b"\n"


def decode_group(line: bytes) -> GroupRecord:
    """A group from one `groups.jsonl` line (msgspec.DecodeError / ValidationError when malformed)."""
    return _group_decoder.decode(line)


def decode_trajectory(line: bytes) -> Trajectory:
    return _trajectory_decoder.decode(line)


def store_model_hash(directory: Path) -> str | None:
    """The weights hash a store was recorded with (None when it has no manifest)."""
    try:
        return msgspec.json.decode((Path(directory) / MANIFEST).read_bytes()).get("model_hash")
    except (OSError, msgspec.DecodeError, AttributeError):
        return None

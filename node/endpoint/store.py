"""The trajectory store: open trajectories in memory, closed groups appended to `DIR/groups.jsonl`.

Every request is matched to its trajectory (by the id the harness passes, or else by finding the open
trajectory whose conversation the request continues), and every completion is appended to it at token
level. Rewards arrive by feedback or from a skill's rubric. A group closes when all of its trajectories
are finished and it is complete (its declared size) or idle; a trajectory without a reward by its
deadline expires: it is written to `expired.jsonl` and counted, never silently dropped. The store is
bounded: past `max_open` open trajectories the oldest expires.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import msgspec

from skillswarm.node.endpoint.limits import StoreLimits
from skillswarm.node.rl.records import (
    EXPIRED_FILE,
    GROUPS_FILE,
    MANIFEST,
    GroupRecord,
    Trajectory,
    check_reward,
    encode_line,
    opening_key,
)
from skillswarm.protocol.atomic import atomic_write_text
from skillswarm.protocol.errors import SkillswarmError

log = logging.getLogger(__name__)


class StoreError(SkillswarmError):
    """A store directory that cannot be used (another model's trajectories, unreadable files)."""


class FeedbackError(SkillswarmError):
    """Feedback for an unknown or already finished trajectory, or with a bad value."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def open_store(directory: Path, model_hash: str, name: str) -> Path:
    """Create (or reopen) a store for `model_hash`'s trajectories; refuse one another model recorded."""
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    manifest = directory / MANIFEST
    if manifest.is_file():
        try:
            held = msgspec.json.decode(manifest.read_bytes())
        except (OSError, msgspec.DecodeError) as e:
            raise StoreError(f"{manifest} is unreadable ({e}); use another --store directory") from e
        if held.get("model_hash") != model_hash:
            raise StoreError(f"{directory} holds trajectories of another model (weights {str(held.get('model_hash'))[:12]}, "
                             f"this one {model_hash[:12]}); their logprobs would be wrong for it: use another --store")
    else:
        atomic_write_text(manifest, msgspec.json.encode({"model_hash": model_hash, "name": name,
                                                         "created": time.time()}).decode() + "\n")
    return directory


def append_lines(path: Path, lines: list[bytes]) -> None:
    """Append whole lines in one write and fsync (one writer per store: a crash leaves at most a torn
    last line, which readers skip until it is complete)."""
    if not lines:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"".join(lines))
        os.fsync(fd)
    finally:
        os.close(fd)


class TrajectoryStore:
    """Open trajectories and groups; thread-safe (the server's handlers and its sweeper share it)."""

    def __init__(self, directory: Path, name: str, limits: StoreLimits = StoreLimits()) -> None:
        self.dir, self.name, self.limits = Path(directory), name, limits
        self.lock = threading.RLock()
        self.open: dict[str, Trajectory] = {}
        self.groups: dict[str, dict[str, Any]] = {}  # id -> {"members": [ids], "size": n|None, "active": t}
        self.finished: dict[str, Trajectory] = {}  # scored or expired, until their group closes
        self.closed: OrderedDict[str, Trajectory] = OrderedDict()  # recently closed, for status lookups (bounded)
        self.counts: Counter = Counter()
        # open trajectories by their last segment's conversation: finding the one a request continues is a
        # lookup per earlier model turn of the request, not a scan of every open trajectory
        self.by_conversation: dict[tuple[tuple[str, str], ...], set[str]] = {}

    # ---- trajectories ------------------------------------------------------------------------------
    def new(self, conversation: list[tuple[str, str]], trajectory_id: str | None = None, group: str | None = None,
            task_id: str | None = None, group_size: int | None = None) -> Trajectory:
        """A new open trajectory (its group from the harness, or the hash of its opening)."""
        now = time.time()
        with self.lock:
            tid = trajectory_id or f"traj-{secrets.token_hex(12)}"
            if tid in self.open or tid in self.finished or tid in self.closed:
                raise FeedbackError(f"trajectory {tid} already exists", 409)
            gid = group or opening_key(self.name, conversation)
            entry = self.groups.setdefault(gid, {"members": [], "size": group_size, "active": now})
            if len(entry["members"]) >= self.limits.max_group:
                raise FeedbackError(f"group {gid} already holds {self.limits.max_group} trajectories", 409)
            if group_size is not None:
                entry["size"] = group_size
            entry["members"].append(tid)
            entry["active"] = now
            traj = Trajectory(id=tid, group=gid, name=self.name, created=now, updated=now, task_id=task_id,
                              group_size=group_size)
            self.open[tid] = traj
            self.counts["trajectories"] += 1
            while len(self.open) > self.limits.max_open:
                oldest = min(self.open.values(), key=lambda t: t.updated)
                self._expire(oldest, "evicted: too many open trajectories")
            return traj

    def get(self, trajectory_id: str) -> Trajectory | None:
        with self.lock:
            return self.open.get(trajectory_id)

    def lookup(self, trajectory_id: str) -> Trajectory | None:
        """A trajectory open, finished, or recently closed (None when unknown or long gone)."""
        with self.lock:
            return self.open.get(trajectory_id) or self.finished.get(trajectory_id) or self.closed.get(trajectory_id)

    def continuing(self, conversation: list[tuple[str, str]], exclude: set[str] = frozenset()) -> Trajectory | None:  # type: ignore[assignment]
        """The open trajectory this conversation continues (its last segment's conversation is a strict
        prefix ending in a model turn); the longest match, the most recently active on a tie."""
        with self.lock:
            for n in range(len(conversation) - 1, 0, -1):
                if conversation[n - 1][0] != "assistant":
                    continue
                found = [self.open[t] for t in self.by_conversation.get(tuple(conversation[:n]), ()) if t not in exclude]
                if found:
                    return max(found, key=lambda t: t.updated)
        return None

    def index(self, traj: Trajectory, before: list[tuple[str, str]] | None, after: list[tuple[str, str]]) -> None:
        """Move a trajectory in the conversation index when its last segment's conversation changes."""
        with self.lock:
            self._unindex(traj.id, before)
            if traj.id in self.open:
                self.by_conversation.setdefault(tuple(map(tuple, after)), set()).add(traj.id)  # type: ignore[arg-type]

    def _unindex(self, trajectory_id: str, conversation: list[tuple[str, str]] | None) -> None:
        if conversation is None:
            return
        key = tuple(map(tuple, conversation))
        held = self.by_conversation.get(key)  # type: ignore[arg-type]
        if held is not None:
            held.discard(trajectory_id)
            if not held:
                del self.by_conversation[key]  # type: ignore[arg-type]

    def touch(self, traj: Trajectory) -> None:
        now = time.time()
        with self.lock:
            traj.updated = now
            if traj.group in self.groups:
                self.groups[traj.group]["active"] = now

    # ---- rewards -----------------------------------------------------------------------------------
    def score(self, trajectory_id: str, reward: Any, turn_rewards: Any = None, correct: Any = None,
              reason: Any = None, scored_by: str = "feedback", metrics: dict[str, float] | None = None) -> Trajectory:
        """Give a trajectory its reward. `reward` is the outcome part; per-turn rewards (one per model
        turn) add to it, as a rubric's do. Raises FeedbackError (404 unknown, 409 finished, 400 bad)."""
        try:
            value = check_reward(reward)
            turns = [check_reward(r, "turn_rewards[]") for r in (turn_rewards or [])]
        except ValueError as e:
            raise FeedbackError(str(e)) from None
        if turn_rewards is not None and not isinstance(turn_rewards, list):
            raise FeedbackError("turn_rewards must be a list of numbers")
        if correct is not None and not isinstance(correct, bool):
            raise FeedbackError("correct must be true or false")
        if reason is not None and (not isinstance(reason, str) or len(reason) > 2000):
            raise FeedbackError("reason must be a string of at most 2000 characters")
        with self.lock:
            traj = self.open.get(trajectory_id)
            if traj is None:
                done = self.finished.get(trajectory_id) or self.closed.get(trajectory_id)
                if done is not None:
                    raise FeedbackError(f"trajectory {trajectory_id} is already {done.status}", 409)
                raise FeedbackError(f"unknown trajectory {trajectory_id!r} (never recorded, or its group closed)", 404)
            if turns and len(turns) != len(traj.calls):
                raise FeedbackError(f"turn_rewards has {len(turns)} entries; trajectory {trajectory_id} has "
                                    f"{len(traj.calls)} model turns")
            traj.reward = value + sum(turns)
            traj.turn_rewards, traj.reason, traj.scored_by = turns, reason, scored_by
            traj.correct = correct if correct is not None else traj.reward > 0
            traj.metrics = dict(metrics or {})
            traj.status = "scored"
            self.counts["scored"] += 1
            self._finish(traj)
            return traj

    def _leave_open(self, traj: Trajectory) -> None:
        self.open.pop(traj.id, None)
        self._unindex(traj.id, traj.segments[-1].conversation if traj.segments else None)

    def _finish(self, traj: Trajectory) -> None:
        self._leave_open(traj)
        self.finished[traj.id] = traj
        self.touch(traj)
        self._maybe_close(traj.group, time.time())

    def _expire(self, traj: Trajectory, reason: str) -> None:
        traj.status, traj.reason = "expired", reason
        self.counts["expired"] += 1
        append_lines(self.dir / EXPIRED_FILE, [encode_line(traj)])
        log.info("trajectory %s expired (%s)", traj.id, reason)
        self._leave_open(traj)
        self.finished[traj.id] = traj
        self._maybe_close(traj.group, time.time(), force=True)

    # ---- groups ------------------------------------------------------------------------------------
    def _maybe_close(self, gid: str, now: float, force: bool = False) -> None:
        entry = self.groups.get(gid)
        if entry is None:
            return
        members = entry["members"]
        if any(m in self.open for m in members):
            return
        complete = entry["size"] is not None and len(members) >= entry["size"]
        idle = now - entry["active"] >= self.limits.group_idle_s
        if not (complete or idle or force):
            return
        done = [self.finished.pop(m) for m in members if m in self.finished]
        del self.groups[gid]
        for t in done:
            self.closed[t.id] = t
        while len(self.closed) > self.limits.max_open:
            self.closed.popitem(last=False)
        scored = [t for t in done if t.status == "scored"]
        record = GroupRecord(id=gid, name=self.name, closed_at=now, reason="complete" if complete else "idle",
                             trajectories=scored, expired=len(done) - len(scored))
        if scored:
            append_lines(self.dir / GROUPS_FILE, [encode_line(record)])
            self.counts["groups"] += 1
        else:
            self.counts["empty_groups"] += 1

    def sweep(self, now: float | None = None) -> None:
        """Expire trajectories past their deadline and close idle groups (the server calls it every second)."""
        now = time.time() if now is None else now
        with self.lock:
            for traj in [t for t in self.open.values() if now - t.updated >= self.limits.deadline_s]:
                self._expire(traj, f"no reward within {self.limits.deadline_s:g} s")
            for gid in list(self.groups):
                self._maybe_close(gid, now)

    def close(self) -> None:
        """Shut down: every open trajectory expires (counted and written), every group closes."""
        with self.lock:
            for traj in list(self.open.values()):
                self._expire(traj, "the endpoint stopped")
            for gid in list(self.groups):
                self._maybe_close(gid, time.time(), force=True)

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {"open": len(self.open), "open_groups": len(self.groups), **{k: int(v) for k, v in self.counts.items()}}

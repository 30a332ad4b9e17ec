"""Recorded, scored trajectories as a training source: `groups.jsonl` of a store, in batches of groups.

The trainer takes them exactly as it takes its own rollouts (`skillswarm.node.rl.groups`): each trajectory
segment is a sample with its recorded token ids, loss mask and sampling logprobs; the group's policy
version is the oldest that wrote any of its tokens, so staleness and the importance-sampling
correction work as for internal rollouts. Batch k is groups [k*B, (k+1)*B) of the file, so a resumed
run continues where it stopped. Trajectories sampled at another temperature than the run's (their
logprobs are of another distribution) are dropped and counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import msgspec
import torch

from skillswarm.node.rl.config import Variant
from skillswarm.node.rl.groups import Batch, Group, Sample, SourceDrained
from skillswarm.node.rl.grpo import group_advantages, has_signal
from skillswarm.node.rl.records import GROUPS_FILE, GroupRecord, decode_group
from skillswarm.protocol.errors import TrainError

log = logging.getLogger(__name__)


def to_group(record: GroupRecord, variant: Variant, temperature: float, batch_index: int,
             counts: Counter) -> Group | None:
    """A trainer group from a closed store group, or None when fewer than two usable trajectories remain."""
    usable = []
    for traj in record.trajectories:
        if traj.reward is None or not traj.segments:
            counts["unscored"] += 1
        elif any(abs(t - temperature) > 1e-9 for t in traj.temperatures):
            counts["other_temperature"] += 1
        else:
            usable.append(traj)
    if len(usable) < 2:
        counts["single_trajectory_groups"] += 1
        return None
    rewards = torch.tensor([float(t.reward) for t in usable], dtype=torch.float64)  # type: ignore[arg-type]
    status = "ok" if bool(has_signal(rewards)) else "zero_variance"
    adv = group_advantages(rewards, variant).tolist() if status == "ok" else [0.0] * len(usable)
    samples, advantages = [], []
    for traj, a in zip(usable, adv):
        for seg in traj.segments:
            if not any(seg.loss_mask):
                continue
            samples.append(Sample(list(seg.token_ids), list(seg.loss_mask), list(seg.logprobs), float(traj.reward or 0.0),
                                  bool(traj.correct), "ok", dict(traj.metrics)))
            advantages.append(a)
    version = min(t.policy_version for t in usable)
    return Group(record.id, samples, advantages, version, status, batch_index)  # type: ignore[arg-type]


class StoreSource:
    """Batches of `groups_per_batch` store groups named `name`, read as the file grows; waits up to
    `wait_s` for more, then hands over a partial batch, then raises SourceDrained."""

    def __init__(self, store_dir: Path, name: str, groups_per_batch: int, variant: Variant, temperature: float,
                 start_batch: int = 0, wait_s: float = 0.0, poll_s: float = 0.2,
                 should_stop: Callable[[], bool] | None = None) -> None:
        self.path = Path(store_dir) / GROUPS_FILE
        self.name, self.per_batch, self.variant, self.temperature = name, groups_per_batch, variant, temperature
        self.index, self.wait_s, self.poll_s, self.should_stop = start_batch, wait_s, poll_s, should_stop
        self.skip = start_batch * groups_per_batch  # groups of this name already trained on (resume)
        self.offset = 0
        self.pending: list[GroupRecord] = []
        self.counts: Counter = Counter()

    async def start(self) -> None:
        if not self.path.parent.is_dir():
            raise TrainError(f"{self.path.parent} is not a trajectory store; record one with `skillswarm endpoint serve "
                             "--store DIR` or `skillswarm ingest FILE --store DIR`")

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a torn last line waits until it is whole
        for number, line in enumerate(data[:end].splitlines()):
            if not line.strip():
                continue
            try:
                record = decode_group(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.counts["malformed_lines"] += 1
                log.warning("%s: skipping a malformed group line (%s)", self.path, e)
                continue
            if record.name != self.name:
                continue
            if self.skip:
                self.skip -= 1
                continue
            self.pending.append(record)
        self.offset += end

    async def next_batch(self) -> Batch:
        deadline = time.monotonic() + self.wait_s
        while True:
            await asyncio.to_thread(self._read)
            if len(self.pending) >= self.per_batch or (self.pending and time.monotonic() >= deadline):
                break
            if time.monotonic() >= deadline:
                raise SourceDrained(f"no more scored groups named {self.name!r} in {self.path}")
            if self.should_stop is not None and self.should_stop():
                raise SourceDrained("the run was asked to stop")
            await asyncio.sleep(self.poll_s)
        records, self.pending = self.pending[:self.per_batch], self.pending[self.per_batch:]
        groups = [g for r in records if (g := to_group(r, self.variant, self.temperature, self.index, self.counts))]
        for r in records:
            self.counts["expired_trajectories"] += r.expired
        if self.counts["other_temperature"]:
            log.warning("%d recorded trajectories were sampled at another temperature than this run's %.3g: dropped",
                        self.counts["other_temperature"], self.temperature)
        batch = Batch(self.index, groups, min((g.policy_version for g in groups), default=0),
                      tokens=sum(len(s.token_ids) for g in groups for s in g.samples),
                      meta={k: float(v) for k, v in self.counts.items()})
        self.index += 1
        return batch

    async def close(self) -> None:
        return None

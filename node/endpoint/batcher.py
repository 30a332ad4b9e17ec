"""Concurrent requests, batched onto one engine: one thread owns the engine and plays everything that is
waiting in one `generate` call (rows of one temperature; a request with its own seed runs alone), so
many agents calling at once cost about what one batched rollout costs. New weights are applied by the
same thread between batches, so every generation carries the policy version that produced it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from skillswarm.node.rl.engines.base import Generation

log = logging.getLogger(__name__)

# After the first request of a batch arrives, wait a little for others to join it: clients whose replies
# just went out are sending their next requests, and on a model whose batch is compute-light a batch of 16
# costs about what a batch of 4 does. The wait is this fraction of a batch's recent duration (capped), so
# it is noise for a slow model and never dominates a fast one.
BATCH_WINDOW_FRACTION, BATCH_WINDOW_MAX_S = 0.1, 0.05


@dataclass
class _Job:
    prompts: list[list[int]]
    max_new_tokens: int
    temperature: float
    seed: int | None
    future: Future = field(default_factory=Future)


class GenerationQueue:
    """Submit prompts, get (generations, policy version) from a future. `before_batch` runs in the engine's
    thread before each batch (a trainer's mailbox loads new weights there)."""

    def __init__(self, engine: Any, max_batch: int = 64, before_batch: Callable[[], None] | None = None) -> None:
        self.engine, self.max_batch, self.before_batch = engine, max_batch, before_batch
        self.recent_s = 0.0  # moving average of a batch's duration
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.batches = 0
        self.rows = 0
        self.engine_seconds = 0.0
        self.thread = threading.Thread(target=self._run, name="endpoint-engine", daemon=True)
        self.thread.start()

    def submit(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float,
               seed: int | None = None) -> Future:
        job = _Job([list(p) for p in prompts], max_new_tokens, temperature, seed)
        self.jobs.put(job)
        return job.future

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _take(self) -> list[_Job] | None:
        first = self.jobs.get()
        if first is None:
            return None
        batch, rows, held = [first], len(first.prompts), []
        width, new = max(map(len, first.prompts)), first.max_new_tokens
        if first.seed is None:
            until = time.monotonic() + min(BATCH_WINDOW_MAX_S, BATCH_WINDOW_FRACTION * self.recent_s)
            while rows < self.max_batch:
                try:
                    job = self.jobs.get(timeout=max(0.0, until - time.monotonic()))
                except queue.Empty:
                    break
                if job is None:
                    held.append(job)
                    break
                fits = max(width, *map(len, job.prompts)) + max(new, job.max_new_tokens) <= self.engine.max_context
                if job.seed is None and job.temperature == first.temperature and rows + len(job.prompts) <= self.max_batch and fits:
                    batch.append(job)
                    rows += len(job.prompts)
                    width, new = max(width, *map(len, job.prompts)), max(new, job.max_new_tokens)
                else:
                    held.append(job)
        for job in held:  # back in line, in order, for the next batch
            self.jobs.put(job)
        return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                if self.before_batch is not None:
                    self.before_batch()
                version = int(self.engine.policy_version)
                prompts = [p for job in batch for p in job.prompts]
                longest = max(job.max_new_tokens for job in batch)
                t0 = time.monotonic()
                gens = self.engine.generate(prompts, longest, batch[0].temperature, seed=batch[0].seed)
                took = time.monotonic() - t0
                self.engine_seconds += took
                self.recent_s = took if self.batches == 0 else 0.8 * self.recent_s + 0.2 * took
                self.batches += 1
                self.rows += len(prompts)
            except BaseException as e:  # every waiting request gets the error
                for job in batch:
                    job.future.set_exception(e)
                continue
            at = 0
            for job in batch:
                mine = [_cut(g, job.max_new_tokens) for g in gens[at:at + len(job.prompts)]]
                at += len(job.prompts)
                job.future.set_result((mine, version))


def _cut(gen: Generation, limit: int) -> Generation:
    """A generation cut to a request's own token limit (the batch ran to the longest one's)."""
    if len(gen.token_ids) <= limit:
        return gen
    return Generation(gen.token_ids[:limit], gen.logprobs[:limit], "length")

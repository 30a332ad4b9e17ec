"""verifiers environments as skills: `--skill verifiers:ENV_ID` trains on an installed verifiers (v1)
environment's rollouts, played against the recording endpoint.

Each batch draws `groups` tasks from the environment's taskset and runs `group_size` episodes of each
through verifiers' own machinery (`Env.run_slot`: its harness, interception and rubric) with the
endpoint as the model. Every model call carries its trajectory and group ids in the request's
`metadata` (a per-rollout sampling override, which verifiers lays over the body), so the endpoint
records each episode as one trajectory at token level; environments with several agents per episode
pass only the group, and their traces are matched to recorded trajectories by conversation. Each
trace's reward goes to the store (`scored_by="verifiers"`), and the closed groups come back as the
trainer's batch through `StoreSource`, exactly as recorded trajectories do (`external:NAME`).
verifiers is an optional extra: `pip install 'skillswarm[verifiers]'` (Python >= 3.11).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import secrets
import time
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Iterator

from skillswarm.node.endpoint.messages import RequestError, normalized
from skillswarm.node.endpoint.store import FeedbackError, TrajectoryStore
from skillswarm.node.rl.groups import Batch, SourceDrained
from skillswarm.node.rl.records import GROUPS_FILE
from skillswarm.node.rl.store_source import StoreSource
from skillswarm.node.rl.verifiers_check import (
    INSTALL_EXTRA,
    env_id_of,
    install_hint,
)
from skillswarm.protocol.errors import SkillError, TrainError

if TYPE_CHECKING:
    from skillswarm.node.endpoint.service import EndpointService

log = logging.getLogger(__name__)

SCORED_BY = "verifiers"
API_KEY_VAR = "SKILLSWARM_ENDPOINT_API_KEY"  # the endpoint is private to the run: no key (verifiers sends "EMPTY")


def import_verifiers() -> ModuleType:
    """`verifiers.v1`, or a SkillError saying how to install the extra."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise SkillError(f"verifiers environments need the verifiers package ({e}): {INSTALL_EXTRA} "
                         "(Python >= 3.11)") from None
    return vf


def load_environment(env_id: str) -> Any:
    """The installed verifiers environment `env_id` (its taskset's package), every seat that would run in
    verifiers' default remote sandbox put on the local subprocess runtime; SkillError when it cannot load."""
    vf = import_verifiers()
    from verifiers.v1.runtimes import PrimeConfig

    try:
        vf.import_taskset(env_id)
        cls = vf.env_config_type(env_id)
        seats = {name: {"runtime": {"type": "subprocess"}} for name, field in cls.model_fields.items()
                 if isinstance(field.default, vf.AgentConfig) and isinstance(field.default.runtime, PrimeConfig)}
        config = vf.resolve_env_config({"taskset": {"id": env_id}, **seats})
        return vf.load_environment(config)
    except ModuleNotFoundError as e:
        raise SkillError(f"verifiers environment {env_id!r} is not installed ({e}); {install_hint(env_id)}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise SkillError(f"cannot load verifiers environment {env_id!r}: {e}") from None


def task_stream(taskset: Any, seed: int, skip: int = 0) -> Iterator[Any]:
    """The taskset's tasks forever: an infinite taskset in its order, a finite one reshuffled every pass
    (seeded, so batch k draws the same tasks after a resume, which skips the `skip` already drawn)."""
    def passes() -> Iterator[Any]:
        if not taskset.bounded:
            yield from taskset
            return
        tasks = list(taskset)
        if not tasks:
            raise SkillError("the verifiers environment's taskset has no tasks")
        for epoch in itertools.count():
            order = list(tasks)
            random.Random(f"{seed}/{epoch}").shuffle(order)
            yield from order

    return itertools.islice(passes(), skip, None)


def _conversation(trace: Any) -> list[tuple[str, str]] | None:
    """A trace's final conversation in the endpoint's comparable form (None when it has none)."""
    from verifiers.v1.dialects.chat import message_to_wire

    try:
        return normalized([message_to_wire(m) for m in trace.messages]) or None
    except (RequestError, AttributeError, ValueError):
        return None


def _match(store: TrajectoryStore, group: str, trace: Any, taken: set[str]) -> str | None:
    """The open trajectory of `group` whose recorded conversation is the trace's (prefix-matched runs)."""
    want = _conversation(trace)
    if want is None:
        return None
    with store.lock:
        for tid in store.groups.get(group, {}).get("members", []):
            traj = store.open.get(tid)
            if traj is not None and tid not in taken and traj.segments and traj.segments[-1].conversation == want:
                return tid
    return None


def _score(store: TrajectoryStore, tid: str, trace: Any, env_id: str) -> bool:
    """Post a trace's reward for trajectory `tid`; False when the trace has none (failed, unscored)."""
    if not trace.rewards or any(r is None for r in trace.rewards.values()):
        return False
    metrics = {k: float(v) for k, v in trace.metrics.items() if v is not None}
    metrics.update({f"reward_{k}": float(r.score) for k, r in trace.rewards.items()})
    stop = trace.stop_condition or "done"
    try:
        store.score(tid, float(trace.reward), reason=f"verifiers {env_id}: {stop}", scored_by=SCORED_BY, metrics=metrics)
    except FeedbackError as e:  # expired meanwhile (the store's bounds), or a reward out of bounds
        log.warning("trajectory %s: the environment's reward was not recorded (%s)", tid, e)
        return False
    return True


async def play_groups(env: Any, env_id: str, tasks: list[Any], group_size: int, base_url: str, model: str,
                      store: TrajectoryStore, temperature: float, max_tokens: int, tag: str,
                      by_id: bool | None = None, errors: list[str] | None = None) -> Counter:
    """Run `group_size` episodes of each task against the endpoint at `base_url` (inside `env.serving()`)
    and post every trace's reward to `store`; returns counts (rollouts, scored, failed, unmatched). `by_id`:
    name each episode's trajectory (default for single-agent envs), else match traces by conversation;
    `errors` collects why rollouts failed."""
    vf = import_verifiers()
    client = vf.EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR)
    single = isinstance(env, vf.SingleAgentEnv) if by_id is None else by_id
    counts: Counter = Counter()
    errors = [] if errors is None else errors

    def failed(tid: str, why: str) -> None:
        log.warning("verifiers rollout %s failed: %s", tid, why)
        errors.append(why)
        counts["failed"] += 1

    async def one(task: Any, group: str, tid: str) -> None:
        ids = {"group_id": group, **({"trajectory_id": tid, "group_size": str(group_size)} if single else {})}
        sampling = vf.SamplingConfig(temperature=temperature, max_tokens=max_tokens, metadata=ids)
        ctx = vf.ModelContext(model=model, client=client, sampling=sampling)
        counts["rollouts"] += 1
        try:
            episode = await env.run_slot(env.slots(task, 1)[0], ctx)
        except Exception as e:  # the environment broke, not the model: its trajectories expire
            failed(tid, f"{type(e).__name__}: {e}")
            return
        if not env.complete(episode):  # a harness, sandbox or env hook failed: no reward is trusted, its calls expire
            error = episode.last_error or next((t.last_error for t in episode.traces if t.last_error), None)
            failed(tid, f"{error.type}: {error.message}" if error else "the episode ran no agent")
            return
        taken: set[str] = set()
        for trace in episode.traces:
            if not trace.ok:  # a participant the env tolerates failing: its calls expire
                failed(tid, f"{trace.last_error.type}: {trace.last_error.message}" if trace.last_error else "not ok")
                continue
            target = tid if single and tid not in taken and store.get(tid) is not None else \
                _match(store, group, trace, taken)
            if target is None:
                counts["unmatched"] += 1
                log.warning("verifiers rollout %s: no recorded trajectory matches its conversation", tid)
                continue
            taken.add(target)
            counts["scored" if _score(store, target, trace, env_id) else "unscored"] += 1

    jobs = []
    for i, task in enumerate(tasks):
        group = f"vf-{tag}-g{i}"
        jobs += [one(task, group, f"{group}-r{j}") for j in range(group_size)]
    await asyncio.gather(*jobs)
    return counts


class VerifiersSource:
    """Training batches from a verifiers environment: per batch, `groups` tasks x `group_size` episodes
    played against the run's endpoint (current weights), read back from its store as trainer groups."""

    def __init__(self, env_id: str, service: "EndpointService", groups: int, group_size: int, variant: str,
                 temperature: float, max_tokens: int, seed: int = 0, start_batch: int = 0) -> None:
        self.env_id, self.service, self.store = env_id, service, service.store
        self.groups, self.group_size, self.temperature, self.max_tokens = groups, group_size, temperature, max_tokens
        self.seed, self.index = seed, start_batch
        self.reader = StoreSource(self.store.dir, self.store.name, groups, variant, temperature)  # type: ignore[arg-type]
        self.run_tag = secrets.token_hex(4)
        self.counts: Counter = Counter()
        self.stack = contextlib.AsyncExitStack()
        self.env: Any = None
        self.tasks: Iterator[Any] | None = None
        self.base_url = ""
        self.closed = False

    async def start(self) -> None:
        from skillswarm.node.endpoint.serve import running

        self.env = await asyncio.to_thread(load_environment, self.env_id)
        self.tasks = task_stream(self.env.taskset, self.seed, self.index * self.groups)
        self.base_url = await asyncio.to_thread(self.stack.enter_context, running(self.service))  # closes the service
        await self.stack.enter_async_context(self.env.serving())
        groups_file = self.store.dir / GROUPS_FILE
        self.reader.offset = groups_file.stat().st_size if groups_file.exists() else 0  # a resumed run: new groups only
        log.info("verifiers %s: playing against %s", self.env_id, self.base_url)

    def _draw(self) -> list[Any]:
        assert self.tasks is not None, "start() first"
        tasks = list(itertools.islice(self.tasks, self.groups))
        if len(tasks) < self.groups:
            raise SourceDrained(f"the verifiers environment {self.env_id!r} has no more tasks")
        return tasks

    async def next_batch(self) -> Batch:
        tasks = await asyncio.to_thread(self._draw)
        before = self.store.counts["groups"]
        started, errors = time.monotonic(), []
        counts = await play_groups(self.env, self.env_id, tasks, self.group_size, self.base_url,
                                   self.service.model_name, self.store, self.temperature, self.max_tokens,
                                   f"{self.run_tag}-b{self.index}", errors=errors)
        seconds = time.monotonic() - started
        if counts["failed"] == counts["rollouts"]:  # a setting or the environment, not the model: stop, saying why
            raise TrainError(f"every rollout of verifiers environment {self.env_id!r} failed (batch {self.index}); "
                             f"the last: {errors[-1][:500] if errors else 'unknown'}")
        # Every episode of the batch is over: what is still open (a failed rollout's calls) expires, every group closes.
        limits = self.store.limits
        await asyncio.to_thread(self.store.sweep, time.time() + limits.deadline_s + limits.group_idle_s + 1)
        self.counts.update(counts)
        written = self.store.counts["groups"] - before
        self.reader.per_batch, self.reader.index = max(written, 1), self.index
        batch = await self.reader.next_batch() if written else Batch(self.index, [], self.service.engine.policy_version)
        batch.seconds = seconds
        batch.meta.update({f"verifiers_{k}": float(v) for k, v in self.counts.items()})
        log.info("verifiers batch %d: %s, %d groups closed in %.1f s", self.index, dict(counts), written, seconds)
        self.index += 1
        return batch

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            await self.stack.aclose()  # the environment's servers, then the endpoint (its store closes)
        finally:
            if not self.base_url:  # start() failed before the endpoint ran: close its engine queue and store here
                await asyncio.to_thread(self.service.close)


def verifiers_source(cfg: Any, trainer: Any, run_dir: Path, device: str,
                     start_batch: int) -> tuple[VerifiersSource, Callable[[Any, int], None]]:
    """The source for `train --skill verifiers:ENV_ID` (`cfg` a TrainConfig): an endpoint on its own engine copy over
    a store in RUN_DIR/store, its weights refreshed from the returned publish function before every generation batch."""
    from skillswarm.node.endpoint.live import trainer_endpoint

    env_id = env_id_of(cfg.skill)
    if not env_id:
        raise SkillError(f"{cfg.skill!r} is not verifiers:ENV_ID")
    import_verifiers()
    service, publish = trainer_endpoint(cfg.model_dir, cfg.engine, device, run_dir / "store", cfg.skill, trainer,
                                        cfg.max_new_tokens)
    source = VerifiersSource(env_id, service, cfg.batch, cfg.group_size, cfg.loss, cfg.temperature, cfg.max_new_tokens,
                             cfg.seed, start_batch)
    return source, publish

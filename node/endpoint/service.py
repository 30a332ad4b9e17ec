"""The endpoint's logic apart from HTTP: requests in, recorded completions out.

Each chat request is rendered by the model's chat template. When it continues a trajectory's
conversation, its prompt is the trajectory's exact token ids plus the new turns' tokens (as a rollout
builds them), so a multi-turn agent run becomes one training sequence with the right loss mask. All
concurrent requests share the engine through `GenerationQueue`. With a skill, the endpoint also hands
out tasks and grades the trajectories that play them with the skill's rubric.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping
from urllib.parse import parse_qsl

from skillswarm.node.endpoint.batcher import GenerationQueue
from skillswarm.node.endpoint.messages import RequestError, assistant_text, offered_tools, to_internal, tool_calls_of
from skillswarm.node.endpoint.store import TrajectoryStore
from skillswarm.node.rl.config import TrainConfig, default_of
from skillswarm.node.rl.records import Call, Segment, Trajectory
from skillswarm.skills.chat import encode, render, suffix
from skillswarm.skills.environment import EpisodeState
from skillswarm.skills.episode import Message
from skillswarm.skills.skill import Skill
from skillswarm.skills.taskbank import Task

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = default_of(TrainConfig, "max_new_tokens")
MAX_N = 64
MAX_ISSUED_TASKS = 10_000
MAX_SEGMENTS, MAX_CALLS = 64, 1024  # per trajectory: a client rewriting history forever is refused, not stored
ID_KEYS = ("trajectory_id", "group_id", "task_id", "group_size")


@dataclass
class Choice:
    """One generated choice, recorded: the OpenAI message, its finish reason, and the trajectory."""

    message: dict[str, Any]
    finish_reason: str
    trajectory_id: str
    token_ids: list[int]
    logprobs: list[float]
    text: str


@dataclass
class Completed:
    """A served request: its choices, the group, the prompt's length and the policy version."""

    choices: list[Choice]
    group_id: str
    prompt_tokens: int
    policy_version: int
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: f"chatcmpl-{secrets.token_hex(12)}")

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


def request_ids(headers: Mapping[str, str], body: Mapping[str, Any]) -> dict[str, Any]:
    """Trajectory, group and task ids (and a group size) from `X-Trajectory-Id`-style headers, the
    `metadata` object, or a `user` string `trajectory_id=..&group_id=..` (first found wins)."""
    found: dict[str, Any] = {}
    user = body.get("user")
    sources = [{k: headers.get("x-" + k.replace("_", "-")) for k in ID_KEYS}, body.get("metadata") or {},
               dict(parse_qsl(user)) if isinstance(user, str) and "=" in user else {}]
    for source in sources:
        if not isinstance(source, Mapping):
            raise RequestError("metadata must be an object of strings")
        for k in ID_KEYS:
            v = source.get(k)
            if v is not None and k not in found:
                if not isinstance(v, (str, int)) or len(str(v)) > 128 or not str(v).strip():
                    raise RequestError(f"{k} must be a non-empty string of at most 128 characters")
                found[k] = str(v)
    if "group_size" in found:
        try:
            found["group_size"] = int(found["group_size"])
        except ValueError:
            raise RequestError("group_size must be an integer") from None
        if not 1 <= found["group_size"] <= 256:
            raise RequestError("group_size must be between 1 and 256")
    return found


def _number(body: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
        raise RequestError(f"{key} must be a number between {low:g} and {high:g}")
    return float(v)


@dataclass
class Sampling:
    """A request's sampling settings, checked: only what keeps the recorded logprobs exact is accepted."""

    temperature: float
    n: int
    max_new_tokens: int
    seed: int | None
    logprobs: bool

    @classmethod
    def parse(cls, body: Mapping[str, Any], max_new_default: int) -> "Sampling":
        if body.get("top_p") not in (None, 1, 1.0):
            raise RequestError("top_p is not supported (the recorded logprobs are of the temperature-scaled "
                               "distribution); leave it unset or 1")
        for key in ("stop", "logit_bias", "presence_penalty", "frequency_penalty", "response_format"):
            if body.get(key) not in (None, [], {}, 0, 0.0, {"type": "text"}):
                raise RequestError(f"{key} is not supported by this endpoint; leave it unset")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise RequestError("seed must be an integer")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        limit = int(_number(body, key, max_new_default, 1, 1 << 20))
        wanted = body.get("logprobs")  # chat: a bool; completions: how many (only the chosen token's are returned)
        logprobs = wanted is True or (isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > 0)
        return cls(temperature=_number(body, "temperature", 1.0, 0.0, 2.0), n=int(_number(body, "n", 1, 1, MAX_N)),
                   max_new_tokens=limit, seed=seed, logprobs=logprobs)


class EndpointService:
    """Serves completions from `engine` and records them in `store`; with `skill`, hands out and grades tasks."""

    def __init__(self, engine: Any, store: TrajectoryStore, model_name: str, skill: Skill | None = None,
                 max_batch: int = 64, before_batch: Any = None, max_new_tokens: int | None = None) -> None:
        self.engine, self.store, self.model_name, self.skill = engine, store, model_name, skill
        self.tokenizer = engine.tokenizer
        self.max_new_tokens = max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        self.queue = GenerationQueue(engine, max_batch, before_batch)
        self.tasks: OrderedDict[str, tuple[Task, int]] = OrderedDict()
        self.episodes: dict[str, EpisodeState] = {}
        self.busy: set[str] = set()
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.started = time.time()

    def close(self) -> None:
        self.queue.close()
        self.store.close()
        self.episodes.clear()

    def sweep(self) -> None:
        """Expire overdue trajectories and close idle groups; forget environments of trajectories gone."""
        self.store.sweep()
        with self.store.lock:
            gone = [tid for tid in self.episodes if tid not in self.store.open]
        for tid in gone:
            self.episodes.pop(tid, None)

    # ---- tasks -------------------------------------------------------------------------------------
    def issue_tasks(self, n: int, split: str = "train", seed: int | None = None) -> list[dict[str, Any]]:
        """`n` tasks of the skill for a harness to play (pass `task_id` with each conversation)."""
        if self.skill is None:
            raise RequestError("this endpoint serves no skill; start it with --skill NAME to hand out tasks")
        if split not in ("train", "eval") or not 1 <= n <= 1024:
            raise RequestError("split must be train or eval, and n between 1 and 1024")
        rng = random.Random(seed if seed is not None else secrets.randbits(64))
        picked = self.skill.tasks.eval_tasks(n, seed) if split == "eval" else [self.skill.tasks.sample(rng) for _ in range(n)]
        out = []
        with self.lock:
            for task in picked:
                env_seed = rng.randrange(2**31)
                self.tasks[task.id] = (task, env_seed)
                self.tasks.move_to_end(task.id)
                while len(self.tasks) > MAX_ISSUED_TASKS:
                    self.tasks.popitem(last=False)
                out.append({"task_id": task.id, "seed": env_seed, "answer_hidden": True,
                            "messages": [m.as_dict() for m in self.skill.env.opening(task)], "tools": self.tool_specs()})
        return out

    def tool_specs(self) -> list[dict[str, Any]]:
        """The skill's tools as OpenAI function specs (each takes its raw input as `input`)."""
        if self.skill is None:
            return []
        return [{"type": "function", "function": {
            "name": name, "description": getattr(tool, "description", ""),
            "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}}
            for name, tool in self.skill.env.tools.items()]

    # ---- chat --------------------------------------------------------------------------------------
    async def chat(self, body: Mapping[str, Any], headers: Mapping[str, str]) -> Completed:
        """Serve one chat completion request (all its `n` choices) and record it."""
        internal = to_internal(body.get("messages"))  # type: ignore[arg-type]
        conversation = [(m.role, m.content) for m in internal]
        if conversation[-1][0] == "assistant":
            raise RequestError("the last message is the assistant's; send the conversation up to the model's turn")
        sampling = Sampling.parse(body, self.max_new_tokens)
        ids = request_ids(headers, body)
        tools = None if body.get("tool_choice") == "none" else offered_tools(body.get("tools"))
        if sampling.n > 1 and "trajectory_id" in ids:
            raise RequestError("n > 1 starts n trajectories; pass a group_id, not a trajectory_id")
        task = self._task(ids.get("task_id"))
        plans: list[tuple[Trajectory, Segment, list[int], str, int]] = []
        try:
            for _ in range(sampling.n):
                plans.append(self._plan(conversation, ids, sampling.n, task))
            width = max(len(p[2]) for p in plans)
            room = self.engine.max_context - width
            if room < 1:
                raise RequestError(f"the conversation is {width} tokens; the model's context is {self.engine.max_context}")
            limit = min(sampling.max_new_tokens, room)
            future = self.queue.submit([p[2] for p in plans], limit, sampling.temperature, sampling.seed)
            gens, version = await asyncio.wrap_future(future)
            choices = [self._record(plan, gen, version, sampling.temperature, tools) for plan, gen in zip(plans, gens)]
        finally:
            with self.lock:
                for traj, *_ in plans:
                    self.busy.discard(traj.id)
        self.counts["requests"] += 1
        self.counts["completion_tokens"] += sum(len(c.token_ids) for c in choices)
        for choice, (traj, *_) in zip(choices, plans):
            if traj.task_id is not None and self.skill is not None:
                await asyncio.to_thread(self._grade_step, traj, choice.text)
        return Completed(choices, plans[0][0].group, width, version)

    def _task(self, task_id: str | None) -> tuple[Task, int] | None:
        if task_id is None:
            return None
        if self.skill is None:
            raise RequestError("task_id needs an endpoint started with --skill")
        with self.lock:
            found = self.tasks.get(task_id)
        if found is None:
            raise RequestError(f"unknown task_id {task_id!r}: get tasks from GET /v1/tasks first")
        return found

    def _plan(self, conversation: list[tuple[str, str]], ids: dict[str, Any], n: int,
              task: tuple[Task, int] | None) -> tuple[Trajectory, Segment, list[int], str, int]:
        """Which trajectory and segment a choice extends, and its prompt (token ids and text)."""
        with self.lock:
            traj = None
            if "trajectory_id" in ids:
                traj = self.store.get(ids["trajectory_id"])
            elif n == 1:
                traj = self.store.continuing(conversation, exclude=self.busy)
            if traj is not None and traj.id in self.busy:
                raise RequestError(f"trajectory {traj.id} has a request in flight; wait for it")
            if traj is not None and (len(traj.calls) >= MAX_CALLS or len(traj.segments) >= MAX_SEGMENTS):
                raise RequestError(f"trajectory {traj.id} holds {len(traj.calls)} calls in {len(traj.segments)} segments, "
                                   f"the most one may (at most {MAX_CALLS} calls, {MAX_SEGMENTS} segments); start a new one")
            if traj is None:
                size = ids.get("group_size", n if n > 1 else None)
                traj = self.store.new(conversation, ids.get("trajectory_id"), ids.get("group_id"),
                                      task[0].id if task else None, size)
                if task is not None:
                    self.episodes[traj.id] = self.skill.reset(*task)  # type: ignore[union-attr]
            self.busy.add(traj.id)
        seg = traj.segments[-1] if traj.segments else None
        held = len(seg.conversation) if seg else 0
        if seg is not None and 0 < held < len(conversation) and conversation[:held] == seg.conversation:
            full = seg.internal + conversation[held:]
            after = render(self.tokenizer, [Message(r, c) for r, c in full], add_generation_prompt=True)
            try:
                piece = suffix(after, seg.text)
            except Exception:
                piece = suffix(after, render(self.tokenizer, [Message(r, c) for r, c in seg.internal]))
            prompt = seg.token_ids + encode(self.tokenizer, piece)
            fresh = Segment(list(seg.token_ids), list(seg.loss_mask), list(seg.logprobs), list(conversation), list(full))
            return traj, fresh, prompt, seg.text + piece, len(traj.segments) - 1
        if seg is not None:
            self.counts["rewritten_history"] += 1
            log.info("trajectory %s: the conversation does not continue the recorded one; a new segment starts", traj.id)
        text = render(self.tokenizer, [Message(r, c) for r, c in conversation], add_generation_prompt=True)
        prompt = encode(self.tokenizer, text)
        return traj, Segment(conversation=list(conversation), internal=list(conversation)), prompt, text, len(traj.segments)

    def _record(self, plan: tuple[Trajectory, Segment, list[int], str, int], gen: Any, version: int,
                temperature: float, tools: set[str] | None) -> Choice:
        traj, seg, prompt, prompt_text, index = plan
        stopped = gen.finish_reason == "stop"
        raw = self.tokenizer.decode(gen.token_ids[:-1] if stopped else gen.token_ids, skip_special_tokens=False)
        content, calls = tool_calls_of(raw, tools) if tools else (raw, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        new_env = len(prompt) - len(seg.token_ids)
        start = len(prompt)
        with self.store.lock:
            before = traj.segments[-1].conversation if traj.segments else None
            seg.token_ids = prompt + list(gen.token_ids)
            seg.loss_mask = seg.loss_mask + [0] * new_env + [1] * len(gen.token_ids)
            seg.logprobs = seg.logprobs + [0.0] * new_env + list(gen.logprobs)
            seg.conversation = seg.conversation + [("assistant", assistant_text(message))]
            seg.internal = seg.internal + [("assistant", raw)]
            seg.text = prompt_text + self.tokenizer.decode(gen.token_ids, skip_special_tokens=False)
            if index < len(traj.segments):
                traj.segments[index] = seg
            else:
                traj.segments.append(seg)
            traj.calls.append(Call(index, start, len(seg.token_ids), version, temperature, gen.finish_reason, time.time()))
            self.store.index(traj, before, seg.conversation)
            self.store.touch(traj)
        finish = "tool_calls" if calls else gen.finish_reason
        return Choice(message, finish, traj.id, list(gen.token_ids), list(gen.logprobs), raw)

    def _grade_step(self, traj: Trajectory, text: str) -> None:
        """Step the task's environment with the model's turn; when it ends, the skill's rubric scores it."""
        state = self.episodes.get(traj.id)
        if state is None or self.skill is None:
            return
        try:
            self.skill.env.step(state, text)
        except Exception as e:  # the environment broke: infrastructure, not the model
            state.finish("env_error", "env_error", str(e))
        if not state.done:
            return
        episode = self.skill.grade(state)
        self.episodes.pop(traj.id, None)
        if episode.outcome == "env_error":
            log.warning("trajectory %s: the skill's environment failed (%s); it is not scored", traj.id, episode.error)
            return
        turns = list(episode.turn_rewards) if len(episode.turn_rewards) == len(traj.calls) else None
        outcome = episode.reward - (sum(turns) if turns else 0.0)
        self.store.score(traj.id, outcome, turns, bool(episode.correct), f"{episode.outcome}: {episode.stop_reason}",
                         "rubric", dict(episode.rewards))

    # ---- completions -------------------------------------------------------------------------------
    async def complete(self, body: Mapping[str, Any], headers: Mapping[str, str]) -> Completed:
        """A raw text completion (`prompt`: a string or token ids), recorded as a one-call trajectory."""
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            text, ids_ = prompt, encode(self.tokenizer, prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in prompt):
                raise RequestError(f"prompt token ids must be in [0, {vocab})")
            text, ids_ = self.tokenizer.decode(prompt, skip_special_tokens=False), list(prompt)
        else:
            raise RequestError("prompt must be a non-empty string or a list of token ids (one prompt per request)")
        sampling = Sampling.parse(body, self.max_new_tokens)
        ids = request_ids(headers, body)
        room = self.engine.max_context - len(ids_)
        if room < 1:
            raise RequestError(f"the prompt is {len(ids_)} tokens; the model's context is {self.engine.max_context}")
        conversation = [("prompt", text)]
        plans = []
        with self.lock:
            for _ in range(sampling.n):
                traj = self.store.new(conversation, None if sampling.n > 1 else ids.get("trajectory_id"),
                                      ids.get("group_id"), None, ids.get("group_size", sampling.n if sampling.n > 1 else None))
                plans.append((traj, Segment(conversation=list(conversation), internal=list(conversation)), ids_, text, 0))
        future = self.queue.submit([ids_] * sampling.n, min(sampling.max_new_tokens, room), sampling.temperature, sampling.seed)
        gens, version = await asyncio.wrap_future(future)
        choices = [self._record(plan, gen, version, sampling.temperature, None) for plan, gen in zip(plans, gens)]
        self.counts["requests"] += 1
        self.counts["completion_tokens"] += sum(len(c.token_ids) for c in choices)
        done = Completed(choices, plans[0][0].group, len(ids_), version)
        done.id = f"cmpl-{secrets.token_hex(12)}"
        return done

    def trajectory(self, trajectory_id: str) -> dict[str, Any] | None:
        """A trajectory's state as JSON (open, finished, or recently closed)."""
        with self.store.lock:
            traj = self.store.lookup(trajectory_id)
            if traj is None:
                return None
            return {"id": traj.id, "group_id": traj.group, "status": traj.status, "reward": traj.reward,
                    "correct": traj.correct, "turns": len(traj.calls), "segments": len(traj.segments),
                    "task_id": traj.task_id, "policy_version": traj.policy_version, "metrics": traj.metrics}

    def stats(self) -> dict[str, Any]:
        return {"model": self.model_name, "skill": self.skill.name if self.skill else None,
                "policy_version": int(self.engine.policy_version), "uptime_s": round(time.time() - self.started, 1),
                "engine_batches": self.queue.batches, "engine_rows": self.queue.rows,
                "engine_seconds": round(self.queue.engine_seconds, 3), **{k: int(v) for k, v in self.counts.items()},
                "store": self.store.stats()}

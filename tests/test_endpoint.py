"""The recording endpoint, driven by the official `openai` client: chat with tools and streaming, tasks
graded by a skill's rubric, feedback, rewritten histories, concurrent batching; then GRPO on what was
recorded, whose first step recomputes the recorded logprobs; and `ingest` of logged traces."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from skillswarm.node.endpoint.limits import StoreLimits
from skillswarm.node.endpoint.serve import build_service, running
from skillswarm.node.endpoint.store import FeedbackError, TrajectoryStore
from skillswarm.node.rl.records import EXPIRED_FILE, GROUPS_FILE, decode_group
from skillswarm.skills.registry import get_skill
from tests.conftest import run_cli

pytestmark = pytest.mark.slow


def _groups(store: Path) -> list[Any]:
    path = store / GROUPS_FILE
    return [decode_group(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def _play_calc(client: openai.OpenAI, task: dict[str, Any], n: int) -> list[str]:
    """A harness: n rollouts of a calc task; it runs the tool calls itself and streams the later turns."""
    tool = get_skill("calc").env.tools["calc"]
    first = client.chat.completions.create(model="nano", messages=task["messages"], tools=task["tools"], n=n,
                                           metadata={"task_id": task["task_id"]})
    ids = first.model_extra["trajectory_ids"]
    assert len(ids) == n and len(set(ids)) == n
    for tid, choice in zip(ids, first.choices):
        messages = [*task["messages"], choice.message.model_dump(exclude_none=True)]
        while client.get(f"/trajectories/{tid}", cast_to=object)["status"] == "open":  # graded when the episode ends
            calls = messages[-1].get("tool_calls")
            for call in calls or []:
                args = json.loads(call["function"]["arguments"])
                try:
                    out = tool(args["input"])
                except Exception as e:
                    out = f"error: {e}"
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": out})
            if not calls:
                messages.append({"role": "user", "content": "Reply <answer>N</answer> or call calc."})
            stream = client.chat.completions.create(model="nano", messages=messages, tools=task["tools"], stream=True,
                                                    metadata={"task_id": task["task_id"], "trajectory_id": tid})
            content, tool_calls, finish = "", [], None
            for chunk in stream:
                assert chunk.model_extra["trajectory_ids"] == [tid]
                delta = chunk.choices[0].delta
                content += delta.content or ""
                tool_calls += [c.model_dump(exclude_none=True) for c in delta.tool_calls or []]
                finish = chunk.choices[0].finish_reason or finish
            assert finish in ("stop", "length", "tool_calls") and (finish == "tool_calls") == bool(tool_calls)
            reply: dict[str, Any] = {"role": "assistant", "content": content or None}
            if tool_calls:
                reply["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in tool_calls]
            messages.append(reply)
    return ids


def test_openai_client_records_trains_and_logprobs_match(nano_model: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    service = build_service(nano_model, store, skill="calc", limits=StoreLimits(group_idle_s=0.2), model_name="nano")
    with running(service) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["nano"]
        tasks = client.get("/tasks", cast_to=object, options={"params": {"n": 6, "seed": 3}})["tasks"]
        assert tasks[0]["tools"][0]["function"]["name"] == "calc" and tasks[0]["messages"][-1]["role"] == "user"
        for task in tasks:
            _play_calc(client, task, n=4)

        # rewards from outside: two groups of two with feedback (one reward per turn, plus a reason)
        for g in range(2):
            r = client.chat.completions.create(model="nano", messages=[{"role": "user", "content": f"9{g}+1"}], n=2,
                                               extra_headers={"X-Group-Id": f"fb{g}"}, max_tokens=8)
            assert r.model_extra["group_id"] == f"fb{g}" and r.usage.completion_tokens <= 16
            for i, tid in enumerate(r.model_extra["trajectory_ids"]):
                done = client.post("/feedback", cast_to=object, body={"trajectory_id": tid, "reward": float(i),
                                                                       "turn_rewards": [0.25], "reason": "judge"})
                assert done["status"] == "scored" and done["reward"] == i + 0.25
        with pytest.raises(openai.ConflictError, match="already scored"):
            client.post("/feedback", cast_to=object, body={"trajectory_id": tid, "reward": 1.0})
        with pytest.raises(openai.NotFoundError, match="unknown trajectory"):
            client.post("/feedback", cast_to=object, body={"trajectory_id": "nope", "reward": 1.0})
        with pytest.raises(openai.BadRequestError, match="finite and within"):
            client.post("/feedback", cast_to=object, body={"trajectory_id": "rw-none", "reward": 1e9})
        with pytest.raises(openai.BadRequestError, match="top_p"):
            client.chat.completions.create(model="nano", messages=[{"role": "user", "content": "1+1"}], top_p=0.5)
        with pytest.raises(openai.BadRequestError, match="unknown message role"):
            client.chat.completions.create(model="nano", messages=[{"role": "robot", "content": "1+1"}])

        # a harness that rewrites history gets a new segment, never tokens the model did not see
        opening = [{"role": "user", "content": "12+5"}]
        a = client.chat.completions.create(model="nano", messages=opening, max_tokens=8, metadata={"trajectory_id": "rw"})
        more = [*opening, a.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        client.chat.completions.create(model="nano", messages=more, max_tokens=8, metadata={"trajectory_id": "rw"})
        edited = [{"role": "user", "content": "12+6"}, *more[1:]]
        client.chat.completions.create(model="nano", messages=edited, max_tokens=8, metadata={"trajectory_id": "rw"})
        rw = client.get("/trajectories/rw", cast_to=object)
        assert rw["turns"] == 3 and rw["segments"] == 2
        # without ids, a request that extends a recorded conversation continues its trajectory
        plain = [{"role": "system", "content": "no ids"}, {"role": "user", "content": "3+4"}]
        first = client.chat.completions.create(model="nano", messages=plain, max_tokens=8)
        plain += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and 5+6?"}]
        second = client.chat.completions.create(model="nano", messages=plain, max_tokens=8)
        assert second.model_extra["trajectory_ids"] == first.model_extra["trajectory_ids"]
        assert client.get(f"/trajectories/{first.model_extra['trajectory_ids'][0]}", cast_to=object)["segments"] == 1

        # concurrent requests share engine batches
        before = client.get("/stats", cast_to=object)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: client.chat.completions.create(
                model="nano", messages=[{"role": "user", "content": f"{i}+{i}"}], max_tokens=16), range(16)))
        after = client.get("/stats", cast_to=object)
        assert after["requests"] - before["requests"] == 16
        assert after["engine_batches"] - before["engine_batches"] < 16
        deadline = time.monotonic() + 10
        while client.get("/stats", cast_to=object)["store"]["open_groups"] > 18 and time.monotonic() < deadline:
            time.sleep(0.1)  # the graded groups close once idle
    # the endpoint stopped: every unrewarded trajectory expired, counted and kept
    expired = (store / EXPIRED_FILE).read_bytes().splitlines()
    assert len(expired) == 2 + 16  # the rewritten one, the one without ids and the concurrent ones
    groups = _groups(store)
    calc = [g for g in groups if not g.id.startswith("fb")]
    assert sum(len(g.trajectories) for g in calc) == 24 and all(t.scored_by == "rubric" for g in calc for t in g.trajectories)
    tok = service.tokenizer
    for g in groups:
        for t in g.trajectories:
            seg = t.segments[0]
            assert len(t.segments) == 1 and len(seg.token_ids) == len(seg.loss_mask) == len(seg.logprobs)
            for call in t.calls:  # the model's tokens, and only them, are masked in; logprobs lie on them
                assert all(seg.loss_mask[call.start:call.end]) and all(lp <= 0 for lp in seg.logprobs[call.start:call.end])
            assert sum(seg.loss_mask) == sum(c.end - c.start for c in t.calls)
            assert tok.decode(seg.token_ids).startswith("<|system|>" if g.name == "calc" and not g.id.startswith("fb") else "<|user|>")
    assert any(len(t.calls) > 1 for g in calc for t in g.trajectories)  # multi-turn, tool results in between

    from skillswarm.node.rl.config import TrainConfig
    from skillswarm.node.rl.run import train

    result = train(TrainConfig(model_dir=nano_model, skill="external:calc", store=store, steps=3, batch=2, max_staleness=8,
                               eval_n=0, out_dir=tmp_path / "run", warmup_steps=1), progress=False)
    steps = [json.loads(line) for line in result.metrics_path.read_text().splitlines() if '"kind": "step"' in line]
    assert steps and steps[0]["version"] == 1 and steps[0]["staleness_mean"] == 0
    # recorded logprobs equal the trainer's recomputation at the policy version that produced them
    assert steps[0]["logp_diff_max"] < 1e-3, steps[0]["logp_diff_max"]
    assert result.delta is not None and result.delta.norm > 0


def test_store_counts_expired_trajectories_and_closes_declared_groups(tmp_path: Path) -> None:
    store = TrajectoryStore(tmp_path, "x", StoreLimits(deadline_s=5, group_idle_s=100))
    conv = [("user", "hi")]
    a, b = store.new(conv, group_size=2), store.new(conv, group_size=2)
    assert a.group == b.group  # one prompt, one group
    store.score(a.id, 1.0)
    assert not (tmp_path / GROUPS_FILE).exists()  # b is still open
    store.score(b.id, 0.0, correct=False)
    (group,) = _groups(tmp_path)
    assert group.reason == "complete" and [t.reward for t in group.trajectories] == [1.0, 0.0]
    c = store.new(conv)
    store.sweep(time.time() + 6)  # past the deadline: expired, written, counted
    assert store.stats()["expired"] == 1 and b"no reward within" in (tmp_path / EXPIRED_FILE).read_bytes()
    with pytest.raises(FeedbackError, match="already expired"):
        store.score(c.id, 1.0)
    with pytest.raises(FeedbackError, match="must be a number"):
        store.score(store.new(conv).id, "1")


def test_ingest_logged_traces_then_train(nano_model: Path, tmp_path: Path) -> None:
    traces = tmp_path / "traces.jsonl"
    rows = []
    for g, (question, right) in enumerate([("12+30", "42"), ("7+8", "15")]):
        for answer in (right, "0"):
            rows.append({"group_id": f"q{g}", "reward": float(answer == right),
                         "messages": [{"role": "user", "content": question},
                                      {"role": "assistant", "content": f"<answer>{answer}</answer>"}]})
    traces.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = tmp_path / "store"
    out = json.loads(run_cli("ingest", str(traces), "--store", str(store), "--model", str(nano_model), "--name", "logs",
                             "--json").stdout)
    assert out["trajectories"] == 4 and out["groups"] == 2 and out["logprobs_from_model"] == 4
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"messages": rows[0]["messages"], "reward": "high"}) + "\n")
    proc = run_cli("ingest", str(bad), "--store", str(store), "--model", str(nano_model), check=False)
    assert proc.returncode == 1 and "line 2: reward must be a number" in proc.stderr and "Traceback" not in proc.stderr
    assert len(_groups(store)) == 2  # nothing of the bad file landed
    from skillswarm.node.rl.config import TrainConfig
    from skillswarm.node.rl.run import train
    from skillswarm.protocol.errors import TrainError

    trained = train(TrainConfig(model_dir=nano_model, skill="external:logs", store=store, steps=5, batch=2, eval_n=0,
                                out_dir=tmp_path / "run"), progress=False)
    assert trained.stats.steps == 1 and trained.stats.samples == 4  # the store held one batch
    with pytest.raises(TrainError, match="--store DIR"):
        TrainConfig(model_dir=nano_model, skill="external:logs").validate()


def test_train_serve_trains_behind_the_api(nano_model: Path, tmp_path: Path) -> None:
    """`train --skill external:calc --serve`: a harness plays the skill's tasks against the policy being trained;
    each step's weights reach the endpoint, and every step recomputes the logprobs of the version that made them."""
    import os
    import re
    import subprocess

    from tests.conftest import SKILLSWARM

    run = tmp_path / "run"
    proc = subprocess.Popen([str(SKILLSWARM), "train", "--skill", "external:calc", "--serve", "0", "--model", str(nano_model),
                             "--steps", "3", "--batch", "2", "--eval-n", "0", "--warmup-steps", "1", "--out", str(run),
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "400"})
    try:
        url = None
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()  # type: ignore[union-attr]
            assert line, f"train exited early: {proc.wait()}"
            found = re.search(r"(http://127\.0\.0\.1:\d+/v1)", line)
            url = found.group(1) if found else None
        assert url is not None
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        versions = set()
        seed = 0
        while proc.poll() is None and time.monotonic() < deadline + 240:
            seed += 1
            try:
                for task in client.get("/tasks", cast_to=object, options={"params": {"n": 2, "seed": seed}})["tasks"]:
                    _play_calc(client, task, n=4)
                versions.add(client.get("/stats", cast_to=object)["policy_version"])
            except (openai.APIConnectionError, openai.APIStatusError):
                break  # the run finished and took its endpoint down
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out)["stats"]["steps"] == 3
    assert max(versions) >= 1  # the endpoint served trained weights, not only the base
    recorded = {t.policy_version for g in _groups(run / "store") for t in g.trajectories}
    assert max(recorded) >= 1
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "step"' in line]
    # samples of the policy being trained (fresh), including ones a trained version (>= 1) generated, match its logprobs
    fresh = [s for s in steps if s["fresh_samples"] > 0]
    assert any(s["version"] >= 2 for s in fresh), [(s["version"], s["staleness"]) for s in steps]
    assert all(s["logp_diff_fresh_max"] < 1e-3 for s in fresh), [(s["step"], s["logp_diff_fresh_max"]) for s in steps]


def test_sampling_settings_are_checked_with_their_names() -> None:
    from skillswarm.node.endpoint.messages import RequestError
    from skillswarm.node.endpoint.service import Sampling

    assert Sampling.parse({"max_tokens": 7}, 64).max_new_tokens == 7
    assert Sampling.parse({"max_completion_tokens": 5, "max_tokens": 7}, 64).max_new_tokens == 5
    assert Sampling.parse({}, 64).max_new_tokens == 64
    for body, name in (({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": "x"}, "max_completion_tokens"),
                       ({"temperature": 3}, "temperature"), ({"n": 0}, "n"), ({"top_p": 0.9}, "top_p")):
        with pytest.raises(RequestError, match=name):
            Sampling.parse(body, 64)

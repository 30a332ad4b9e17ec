"""Generation, rollouts and evaluation on a real nano model: logprobs, batching, reproducible
sampling, weight updates, token-level episodes (masks, alignment), budgets, and `skillswarm eval`."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from skillswarm.node.rl.engines.hf import HFEngine
from skillswarm.node.rl.evaluation import accuracy_by_kind, evaluate
from skillswarm.node.rl.rollout import run_episodes
from skillswarm.skills.chat import encode, render
from skillswarm.skills.environment import Environment
from skillswarm.skills.episode import OUTCOMES
from skillswarm.skills.registry import get_skill
from tests.conftest import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(nano_model: Path) -> HFEngine:
    return HFEngine.load(nano_model, device="cpu")


def _prompts(engine: HFEngine, skill: str, n: int) -> list[list[int]]:
    sk = get_skill(skill)
    return [encode(engine.tokenizer, render(engine.tokenizer, sk.env.opening(t), True)) for t in sk.tasks.eval_tasks(n)]


def _full_logprobs(engine: HFEngine, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), -1)


def test_logprobs_match_a_full_forward_and_batching_changes_nothing(engine: HFEngine) -> None:
    prompts = _prompts(engine, "calc", 6) + _prompts(engine, "arith", 6)  # different lengths: left padding
    sampled = engine.generate(prompts, 12, temperature=1.0, seed=3)
    for p, g in zip(prompts, sampled):
        ref = _full_logprobs(engine, p + g.token_ids)
        expected = [ref[len(p) - 1 + i, t].item() for i, t in enumerate(g.token_ids)]
        assert g.logprobs == pytest.approx(expected, abs=1e-4)
        assert g.finish_reason == ("stop" if g.token_ids[-1] in engine.eos_ids else "length")
        assert g.finish_reason == "stop" or len(g.token_ids) == 12
    greedy = engine.generate(prompts, 12, temperature=0.0)
    assert [g.token_ids for g in greedy] == [engine.generate([p], 12, temperature=0.0)[0].token_ids for p in prompts]


def test_sampling_is_reproducible_and_temperature_scales_logprobs(engine: HFEngine) -> None:
    prompts = _prompts(engine, "reverse", 8)
    a = engine.generate(prompts, 10, temperature=1.0, seed=7)
    b = engine.generate(prompts, 10, temperature=1.0, seed=7)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    hot = engine.generate(prompts[:1], 5, temperature=2.0, seed=1)[0]
    ref = torch.log_softmax(torch.log(torch.softmax(_full_logprobs(engine, prompts[0] + hot.token_ids), -1)) / 2.0, -1)
    assert hot.logprobs[0] == pytest.approx(ref[len(prompts[0]) - 1, hot.token_ids[0]].item(), abs=1e-4)


def test_weight_updates_change_generation_and_carry_a_policy_version(nano_model: Path) -> None:
    eng = HFEngine.load(nano_model)
    prompts = _prompts(eng, "arith", 4)
    before = eng.generate(prompts, 6, temperature=0.0)
    state = {k: torch.zeros_like(v) if k.endswith("norm.weight") and "layers.0." in k else v
             for k, v in eng.model.state_dict().items()}
    eng.load_state_dict(state, policy_version=5)
    assert eng.policy_version == 5
    assert [g.logprobs for g in eng.generate(prompts, 6, temperature=0.0)] != [g.logprobs for g in before]
    with pytest.raises(Exception, match="unknown parameters"):
        eng.load_state_dict({"nope.weight": torch.zeros(1)}, 6)


def test_rollouts_are_token_level_episodes(engine: HFEngine) -> None:
    skill = get_skill("calc")
    tasks = skill.tasks.eval_tasks(12)
    rollouts = run_episodes(engine, skill, tasks, 0, temperature=1.0, max_new_tokens=24, sample_seed=1)
    assert [r.episode.task_id for r in rollouts] == [t.id for t in tasks]
    tok = engine.tokenizer
    for r in rollouts:
        ep = r.episode
        assert len(r.token_ids) == len(r.loss_mask) == len(r.logprobs) and r.policy_version == engine.policy_version
        assert r.loss_mask[:r.prompt_len] == [0] * r.prompt_len and r.loss_mask[r.prompt_len] == 1
        assert all(lp == 0.0 for lp, m in zip(r.logprobs, r.loss_mask) if not m)
        assert all(lp < 0.0 for lp, m in zip(r.logprobs, r.loss_mask) if m)
        # the model's tokens are exactly its turns; the rest is the template and the environment's turns
        model_text = tok.decode([t for t, m in zip(r.token_ids, r.loss_mask) if m])
        turns = [m.content for m in ep.messages if m.role == "assistant"]
        assert model_text.replace("<|end|>", "") == "".join(turns)
        if model_text.count("<|end|>") == len(turns):  # every turn ended by itself: the text is the template's
            assert tok.decode(r.token_ids) == render(tok, ep.messages)
        assert len(ep.turns) == len(turns) == len(r.turn_spans) <= skill.env.max_turns and ep.outcome in OUTCOMES
        assert [tok.decode(r.token_ids[a:b]).replace("<|end|>", "") for a, b in r.turn_spans] == turns
        assert sum(b - a for a, b in r.turn_spans) == sum(r.loss_mask)
        assert len(ep.turn_rewards) == len(turns) and ep.reward == pytest.approx(
            ep.rewards["exact_answer"] + sum(ep.turn_rewards) if ep.outcome == "ok" else 0.0)
    # behaviour logprobs are the model's, token for token (one rollout checked against a full forward)
    r = rollouts[0]
    ref = _full_logprobs(engine, r.token_ids)
    for i, (t, m) in enumerate(zip(r.token_ids, r.loss_mask)):
        if m:
            assert r.logprobs[i] == pytest.approx(ref[i - 1, t].item(), abs=1e-4)


class _Overlapping(Environment):
    """calc's environment, counting how many episodes are inside a step at once (each step lingers a little)."""

    def __init__(self, base: Environment, concurrency: int) -> None:
        super().__init__(base.system_prompt, list(base.tools.values()), base.max_turns, concurrency=concurrency)
        self.inside, self.most, self._lock = 0, 0, threading.Lock()

    def env_response(self, state, turn):  # noqa: ANN001, ANN201
        with self._lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
            self.batched = getattr(self, "batched", True) and state.batched
        time.sleep(0.02)
        try:
            return super().env_response(state, turn)
        finally:
            with self._lock:
                self.inside -= 1


def test_concurrent_environment_steps_give_the_same_rollouts_in_order(engine: HFEngine) -> None:
    calc = get_skill("calc")
    tasks = calc.tasks.eval_tasks(12)
    one, four = _Overlapping(calc.env, 1), _Overlapping(calc.env, 4)
    runs = [run_episodes(engine, dataclasses.replace(calc, env=env), tasks, 0, temperature=1.0, max_new_tokens=24,
                         sample_seed=3) for env in (one, four)]
    assert one.most == 1 and four.most > 1  # steps overlapped only where the environment allows it
    assert one.batched and four.batched  # a rollout's episodes count only their own time against max_seconds
    for a, b in zip(*runs):
        assert (a.episode.task_id, a.token_ids, a.loss_mask, a.logprobs, a.turn_spans) == \
            (b.episode.task_id, b.token_ids, b.loss_mask, b.logprobs, b.turn_spans)
        assert (a.episode.reward, a.episode.outcome, a.episode.turn_rewards) == \
            (b.episode.reward, b.episode.outcome, b.episode.turn_rewards)
    assert [r.episode.task_id for r in runs[1]] == [t.id for t in tasks]


def test_running_out_of_tokens_is_a_timeout_graded_zero(engine: HFEngine) -> None:
    skill = get_skill("calc")
    rollouts = run_episodes(engine, skill, skill.tasks.eval_tasks(4), 0, temperature=1.0, max_tokens=50, sample_seed=2)
    assert all(r.outcome == "timeout" and r.episode.stop_reason in ("max_tokens", "max_turns") and r.reward == 0.0
               for r in rollouts if not r.episode.answer)
    assert all(len(r.token_ids) <= 50 for r in rollouts)


def test_evaluate_counts_every_outcome_including_env_errors(engine: HFEngine) -> None:
    result = evaluate(engine, "arith", n=16)
    assert result.n == 16 and sum(result.outcomes.values()) == 16 and set(result.outcomes) == set(OUTCOMES)
    assert result.accuracy == sum(r.episode.correct for r in result.rollouts) / 16
    assert evaluate(engine, "arith", n=16).as_json() == result.as_json()  # greedy: a property of the weights

    class Broken(Environment):
        def env_response(self, state, turn):  # noqa: ANN001, ANN202
            raise RuntimeError("infrastructure down")

    import dataclasses

    broken = dataclasses.replace(get_skill("arith"), env=Broken(system_prompt="x"))
    bad = evaluate(engine, broken, n=5)
    assert bad.outcomes["env_error"] == 5 and bad.accuracy == 0.0 and bad.mean_reward == 0.0


def test_evaluate_splits_accuracy_by_kind_of_task(engine: HFEngine) -> None:
    """calc mixes a*b with a*b+c and a*b-c: the result counts each kind apart, from the same rollouts."""
    calc = get_skill("calc")
    result = evaluate(engine, calc, n=30)
    kinds = [calc.tasks.stratum(t) for t in calc.tasks.eval_tasks(30)]
    assert set(result.by_kind) == set(kinds) == {"a*b", "a*b+c", "a*b-c"}
    for kind, got in result.by_kind.items():
        mine = [r.episode.correct for r, k in zip(result.rollouts, kinds) if k == kind]
        assert got == {"n": len(mine), "accuracy": round(sum(mine) / len(mine), 6)}
    assert result.as_json()["by_kind"] == result.by_kind
    one = evaluate(engine, "arith", n=8)  # one kind: nothing to split
    assert one.by_kind == {} and "by_kind" not in one.as_json()
    with pytest.raises(ValueError, match="2 kinds for 1 rollouts"):
        accuracy_by_kind(["a", "b"], result.rollouts[:1])


def test_eval_cli_prints_the_json_keys(nano_model: Path) -> None:
    out = json.loads(run_cli("eval", "--model", str(nano_model), "--skill", "reverse", "--n", "10", "--json").stdout)
    assert set(out) == {"skill", "n", "accuracy", "mean_reward", "outcomes", "rubric"}
    assert out["skill"] == "reverse" and out["n"] == 10 and sum(out["outcomes"].values()) == 10
    text = run_cli("eval", "--model", str(nano_model), "--skill", "calc", "--n", "4").stdout
    assert "accuracy" in text and "timeout" in text and "tool_calls_made" in text  # a weight-0 metric of calc's rubric
    assert "by kind of task" in text and "a*b+c" in text  # its first 4 held-out tasks hold all three kinds
    proc = run_cli("eval", "--model", str(nano_model), "--skill", "nope", check=False)
    assert proc.returncode == 1 and "unknown skill" in proc.stderr

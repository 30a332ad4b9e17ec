"""The trainer and orchestrator on a real nano model: masked tokens get no gradient, a step moves
log-probs the way the advantages say, LoRA weights and factors agree, env_error groups are dropped."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from skillswarm.node.rl.engines.hf import HFEngine, load_model_dir
from skillswarm.node.rl.groups import Group, Sample, split_groups
from skillswarm.node.rl.orchestrator import Orchestrator
from skillswarm.node.rl.trainer import Trainer, collate, token_logprobs
from skillswarm.skills.environment import Environment
from skillswarm.skills.registry import get_skill
from tests.rl_configs import loss_config, optim_config, rollout_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(nano_model: Path) -> HFEngine:
    return HFEngine.load(nano_model, device="cpu")


@pytest.fixture(scope="module")
def batch(engine: HFEngine) -> list[Group]:
    """Two real groups of calc episodes (multi-turn: tool tokens inside the sequences)."""
    orch = Orchestrator(engine, get_skill("calc"), rollout_config(group_size=4, batch=2, max_new_tokens=24))
    groups = orch.generate_batch(0).groups
    for g in groups:  # fixed advantages so the test does not depend on what the model scored
        g.advantages = [1.0, -1.0, 0.5, -0.5]
    return groups


def _trainer(nano_model: Path, **optim: object) -> Trainer:
    model, tok = load_model_dir(nano_model)
    return Trainer(model, tok.pad_token_id, loss_config(), optim_config(**optim))


def test_masked_tokens_get_zero_gradient(nano_model: Path, batch: list[Group]) -> None:
    trainer = _trainer(nano_model, lr=1e-3, micro_batch=3)
    logits: list[torch.Tensor] = []

    def keep(module: object, inputs: object, output: torch.Tensor) -> None:
        output.retain_grad()
        logits.append(output)

    trainer.model.lm_head.register_forward_hook(keep)
    samples = [s for g in batch for s in g.samples]
    assert any(0 in s.loss_mask[s.loss_mask.index(1):] for s in samples), "want tool tokens between model turns"
    trainer.step(batch)
    by_length = sorted(range(len(samples)), key=lambda i: len(samples[i].token_ids))
    micro = [by_length[i:i + 3] for i in range(0, len(samples), 3)]
    assert len(logits) == len(micro)
    for rows, out in zip(micro, logits):
        for r, i in enumerate(rows):
            s = samples[i]
            grad = out.grad[r].abs().sum(-1)  # [T]: position t predicts token t+1
            for t in range(out.shape[1]):
                trained = t + 1 < len(s.token_ids) and s.loss_mask[t + 1] == 1
                assert (grad[t] > 0) == trained, (i, t)


def test_a_step_moves_logprobs_the_way_the_advantages_say(nano_model: Path, batch: list[Group]) -> None:
    trainer = _trainer(nano_model, lr=1e-5)  # Adam's first step moves every weight by ~lr: keep it small
    samples = [s for g in batch for s in g.samples]
    adv = [a for g in batch for a in g.advantages]
    coll = collate(samples, adv, trainer.pad_id)

    def seq_logp() -> torch.Tensor:
        with torch.no_grad():
            lp = token_logprobs(trainer.model, coll.input_ids, coll.attention_mask, 1.0)
        return (lp * coll.loss_mask).sum(-1)

    before = seq_logp()
    weights_before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.step(batch)
    after = seq_logp()
    assert trainer.version == 1 and metrics["grad_norm"] > 0 and metrics["batch_samples"] == len(samples)
    up = [i for i, a in enumerate(adv) if a > 0]
    down = [i for i, a in enumerate(adv) if a < 0]
    assert (after - before)[up].mean() > 0 > (after - before)[down].mean()
    assert any(not torch.equal(v, weights_before[k]) for k, v in trainer.model.state_dict().items())
    # the behaviour log-probs the engine reported are the trainer's own before the step (same weights)
    torch.testing.assert_close((coll.behaviour_logp * coll.loss_mask).sum(-1), before, atol=1e-3, rtol=1e-4)


def test_mini_batches_engage_the_clip_range(nano_model: Path, batch: list[Group]) -> None:
    trainer = _trainer(nano_model, lr=3e-2, mini_batches=4)
    metrics = trainer.step(batch)
    assert metrics["clip_frac"] > 0  # after the first mini-batch the ratio to the batch-start policy moves


def test_lora_weights_and_factors_agree(nano_model: Path, batch: list[Group]) -> None:
    trainer = _trainer(nano_model, lr=1e-2, lora=True, lora_rank=4)
    base = {k: v.clone() for k, v in trainer.model.get_base_model().state_dict().items()}
    trainer.step(batch)
    weights, factors = trainer.engine_weights(), trainer.lora_factors()
    assert set(weights) == set(factors) and weights and all(".weight" in k and "lora" not in k for k in weights)
    plain = dict(trainer.merged_model().state_dict())
    for name, (a, b) in factors.items():
        assert a.shape[0] == 4
        base_name = name.replace(".weight", ".base_layer.weight")
        torch.testing.assert_close(weights[name], base[base_name] + b @ a)
        torch.testing.assert_close(plain[name], weights[name])
    assert any(not torch.equal(weights[n], base[n.replace(".weight", ".base_layer.weight")]) for n in weights)


def test_env_error_groups_are_dropped_and_counted(engine: HFEngine) -> None:
    class FlakyTool(Environment):
        """Breaks (our bug, not the model's) on tasks whose first operand is odd."""

        def env_response(self, state, turn):  # noqa: ANN001, ANN202
            if int(state.task.data["a"]) % 2:
                raise RuntimeError("calculator backend down")
            return super().env_response(state, turn)

    calc = get_skill("calc")
    flaky = dataclasses.replace(calc, env=FlakyTool(system_prompt=calc.env.system_prompt, tools=list(calc.env.tools.values()),
                                                    max_turns=4))
    orch = Orchestrator(engine, flaky, rollout_config(group_size=3, batch=6, max_new_tokens=24))
    groups = orch.generate_batch(1).groups
    odd = [g for g, (t, _) in zip(groups, orch.tasks_for(1)) if t.data["a"] % 2]
    assert odd and all(g.status == "env_error" for g in odd)
    parts = split_groups(groups, version=0, max_staleness=0)
    assert len(parts["env_error"]) == len(odd) and not set(map(id, parts["ok"])) & set(map(id, odd))
    assert all(s.outcome == "env_error" for g in odd for s in g.samples)


def test_groups_replay_the_same_tasks_and_seeds(engine: HFEngine) -> None:
    orch = Orchestrator(engine, get_skill("arith"), rollout_config(group_size=2, batch=3, seed=5))
    assert orch.tasks_for(7) == orch.tasks_for(7) and orch.tasks_for(7) != orch.tasks_for(8)
    a, b = orch.generate_batch(7), orch.generate_batch(7)
    assert [s.token_ids for g in a.groups for s in g.samples] == [s.token_ids for g in b.groups for s in g.samples]
    assert all(isinstance(s, Sample) and s.loss_mask[0] == 0 for g in a.groups for s in g.samples)


@pytest.mark.parametrize("lora", [False, True])
def test_kl_to_the_starting_policy(nano_model: Path, batch: list[Group], lora: bool) -> None:
    model, tok = load_model_dir(nano_model)
    trainer = Trainer(model, tok.pad_token_id, loss_config(loss="dapo", beta=0.1),
                      optim_config(lr=1e-3 if lora else 1e-4, lora=lora, lora_rank=2))
    first = trainer.step(batch)
    second = trainer.step(batch)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy still is the reference
    assert second["kl"] > 0  # one step later it has moved away from it, and the penalty sees it

"""The retain loss: a worker's delta keeps the network's other skills where its round started (a KL from the
starting policy on that policy's own greedy episodes of them), so the deltas of a round add up when merged."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from skillswarm.node.rl.anchor import MAX_TRIES, anchor_episodes, confidence
from skillswarm.node.rl.engines.hf import HFEngine, load_model_dir
from skillswarm.node.rl.groups import Group
from skillswarm.node.rl.orchestrator import Orchestrator
from skillswarm.node.rl.rollout import run_episodes
from skillswarm.node.rl.trainer import Trainer, episode_batch
from skillswarm.protocol.errors import TrainError
from skillswarm.skills.registry import get_skill
from tests.rl_configs import loss_config, optim_config, rollout_config, train_config


def test_retain_needs_skills_to_retain() -> None:
    assert train_config().loss_config().retain == 0.0  # `train` alone: no reference copy, no extra passes
    assert loss_config(retain=4.0, retain_skills=("sort",)).retain == 4.0
    assert loss_config(retain=0.0, retain_skills=("sort",)).retain == 0.0
    with pytest.raises(ValueError, match="retain"):
        loss_config(retain=-1.0, retain_skills=("sort",))


def test_unknown_retain_skills_are_refused(nano_model: Path) -> None:
    cfg = train_config(retain_skills=("sort", "no-such-skill"))
    cfg.model_dir = nano_model
    with pytest.raises(TrainError, match="retain skills no-such-skill are not installed"):
        cfg.validate()


@pytest.mark.slow
def test_anchors_are_what_the_start_gets_right_on_the_other_skills(nano_model: Path) -> None:
    """Up to n right answers per other skill, from as many tasks as it takes (at most MAX_TRIES * n): a skill
    the start is weak at is held by as many anchors as one it has mastered."""
    engine = HFEngine.load(nano_model, device="cpu")
    n = 8
    anchors = anchor_episodes(engine, ["arith", "sort", "reverse"], "arith", n, seed=3)
    right: dict[str, list] = {}
    in_first_n: dict[str, int] = {}
    for name in ("sort", "reverse"):
        played = run_episodes(engine, get_skill(name), get_skill(name).tasks.train_tasks(n * MAX_TRIES, 3), 3, temperature=0.0)
        right[name] = [r for r in played if r.episode.correct]
        in_first_n[name] = sum(r.episode.correct for r in played[:n])
    assert right["sort"] and right["reverse"]
    # the weak test model gets some of the first n wrong: the anchors come from further on too
    assert any(min(n, len(right[name])) > in_first_n[name] for name in right), in_first_n
    assert [r.token_ids for r in anchors] == [r.token_ids for name in ("sort", "reverse") for r in right[name][:n]]
    assert all(r.episode.skill != "arith" for r in anchors)  # never its own skill


@pytest.mark.slow
def test_fragile_anchors_are_the_least_confident_right_answers_of_every_task_played(nano_model: Path) -> None:
    """With a fragile share, part of each skill's anchors are its first right answers and the rest the least
    confident right answers of all MAX_TRIES * n tasks (the ones another skill's training flips first)."""
    engine = HFEngine.load(nano_model, device="cpu")
    n = 8
    anchors = anchor_episodes(engine, ["sort", "reverse"], "arith", n, seed=3, fragile=0.5)
    expected = []
    for name in ("sort", "reverse"):
        skill = get_skill(name)
        tasks = skill.tasks.train_tasks(n * MAX_TRIES, 3)
        right = [r for start in range(0, len(tasks), n)
                 for r in run_episodes(engine, skill, tasks[start:start + n], 3 + start, temperature=0.0) if r.episode.correct]
        rest = sorted(right[n // 2:], key=confidence)
        expected += right[:n // 2] + rest[:n // 2]
        if len(right) > n:  # a real choice (reverse: 10 of 32 here): not simply the order they came in
            assert rest[:n // 2] != right[n // 2:n]
    assert [r.token_ids for r in anchors] == [r.token_ids for r in expected]
    with pytest.raises(ValueError, match="share"):
        anchor_episodes(engine, ["sort"], "arith", n, seed=3, fragile=1.5)


def test_confidence_is_the_least_likely_generated_token() -> None:
    """Prompt and tool tokens (loss mask 0) do not count; an episode the policy generated nothing of is certain."""
    from skillswarm.node.rl.rollout import Rollout
    from skillswarm.skills.episode import Episode

    episode = Episode(skill="sort", task_id="t", seed=0, messages=[], turns=[], outcome="ok", stop_reason="answer")
    r = Rollout(episode, token_ids=[1, 2, 3, 4], loss_mask=[0, 1, 0, 1], logprobs=[-9.0, -0.2, -5.0, -0.7])
    assert confidence(r) == -0.7
    assert confidence(Rollout(episode, token_ids=[1], loss_mask=[0], logprobs=[-3.0])) == 0.0


@pytest.fixture(scope="module")
def drift_setup(nano_model: Path) -> tuple[list, list[Group]]:
    """Greedy episodes of two skills to hold (right or wrong: the trainer anchors what it is given) and a
    batch of arith groups with fixed advantages, so that the tests do not depend on what the model scored."""
    engine = HFEngine.load(nano_model, device="cpu")
    held = [r for name in ("sort", "reverse") for r in run_episodes(engine, get_skill(name),
                                                                    get_skill(name).tasks.train_tasks(4, 3), 3, temperature=0.0)]
    orch = Orchestrator(engine, get_skill("arith"), rollout_config(group_size=4, batch=2, max_new_tokens=16))
    batch: list[Group] = orch.generate_batch(0).groups
    for g in batch:
        g.advantages = [1.0, -1.0, 0.5, -0.5]
    return held, batch


def _trainer(nano_model: Path, retain: float, held: list) -> tuple[Trainer, int]:
    model, tok = load_model_dir(nano_model)
    trainer = Trainer(model, tok.pad_token_id, loss_config(retain=retain, retain_skills=("sort", "reverse")),
                      optim_config(lr=1e-3, warmup_steps=0, retain_batch=8))
    trainer.set_retain(held)
    return trainer, tok.pad_token_id


@pytest.mark.slow
def test_retain_keeps_the_other_skills_policy(nano_model: Path, drift_setup: tuple[list, list[Group]]) -> None:
    held, batch = drift_setup

    def drift(retain: float) -> tuple[float, list[float]]:
        trainer, pad = _trainer(nano_model, retain, held)
        kls = [trainer.step(batch).get("retain_kl", 0.0) for _ in range(5)]
        start, _ = load_model_dir(nano_model)
        return _kl(start, trainer.model, held, pad), kls

    free, _ = drift(0.0)
    kept, kls = drift(4.0)
    assert kls[0] == pytest.approx(0.0, abs=1e-6) and kls[-1] > 0  # the policy starts as the reference, then moves
    # kept/free was < 0.5 here and 0.51 on CI's CPU (2026-12-05): retain must hold a clear share of the drift back.
    assert free > 0 and kept < 0.75 * free, (kept, free)


@pytest.mark.slow
def test_retain_gradient_is_clipped_apart_from_the_policy_gradient(nano_model: Path,
                                                                    drift_setup: tuple[list, list[Group]]) -> None:
    """A spike of the retain gradient must not shrink the policy-gradient step (clipping the sum would)."""
    held, batch = drift_setup
    batch = copy.deepcopy(batch)
    for g in batch:  # a policy gradient over max_grad_norm too
        g.advantages = [100 * a for a in g.advantages]
    trainer, _ = _trainer(nano_model, 1000.0, held)  # a retain gradient far over max_grad_norm once the policy moved
    for _ in range(3):
        trainer.step(batch)
    state = copy.deepcopy(trainer.state_dict())
    metrics = trainer.step(batch)
    both = [p.grad.clone() for p in trainer.params]
    trainer.load_state_dict(state)
    trainer.retain_batch = None
    alone = trainer.step(batch)
    policy = [p.grad.clone() for p in trainer.params]
    cap = trainer.optim_cfg.max_grad_norm
    assert metrics["retain_grad_norm"] > 10 * cap and alone["grad_norm"] > 10 * cap
    assert alone["grad_norm"] == pytest.approx(metrics["grad_norm"])  # the policy gradient, measured alone
    assert _norm(policy) == pytest.approx(cap, rel=1e-4)
    assert _norm([b - a for a, b in zip(policy, both)]) == pytest.approx(cap, rel=1e-3)  # retain's part, clipped alone
    assert _norm(both) > 1.2 * cap  # two clipped parts: one clip of their sum would leave at most cap


def _norm(tensors: list[torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors])))


def _kl(ref: torch.nn.Module, model: torch.nn.Module, episodes: list, pad: int) -> float:
    """Mean KL(ref || model) per model token of `episodes`."""
    data = episode_batch(episodes, pad)
    with torch.no_grad():
        p = torch.log_softmax(ref(input_ids=data.input_ids, attention_mask=data.attention_mask).logits[:, :-1].float(), -1)
        q = torch.log_softmax(model(input_ids=data.input_ids, attention_mask=data.attention_mask).logits[:, :-1].float(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    return float((kl * data.loss_mask).sum() / data.loss_mask.sum())

"""The retain loss: a worker's delta keeps the network's other skills where its round started (a KL from the
starting policy on that policy's own greedy episodes of them), so the deltas of a round add up when merged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skillswarm.node.rl.anchor import anchor_episodes
from skillswarm.node.rl.engines.hf import HFEngine, load_model_dir
from skillswarm.node.rl.groups import Group
from skillswarm.node.rl.orchestrator import Orchestrator
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
def test_retain_keeps_the_other_skills_policy(nano_model: Path) -> None:
    engine = HFEngine.load(nano_model, device="cpu")
    anchors = anchor_episodes(engine, ["arith", "sort", "reverse"], "arith", 4, seed=3)
    assert len(anchors) == 8 and all(any(r.loss_mask) for r in anchors)  # its own skill is not anchored
    assert [r.token_ids for r in anchors] == [r.token_ids for r in anchor_episodes(engine, ["sort", "reverse"], "arith", 4, 3)]
    orch = Orchestrator(engine, get_skill("arith"), rollout_config(group_size=4, batch=2, max_new_tokens=16))
    batch: list[Group] = orch.generate_batch(0).groups
    for g in batch:  # fixed advantages: the test does not depend on what the model scored
        g.advantages = [1.0, -1.0, 0.5, -0.5]

    def drift(retain: float) -> tuple[float, list[float]]:
        model, tok = load_model_dir(nano_model)
        trainer = Trainer(model, tok.pad_token_id, loss_config(retain=retain, retain_skills=("sort", "reverse")),
                          optim_config(lr=1e-3, warmup_steps=0, retain_batch=8))
        trainer.set_retain(anchors)
        kls = [trainer.step(batch).get("retain_kl", 0.0) for _ in range(5)]
        start, _ = load_model_dir(nano_model)
        return _kl(start, trainer.model, anchors, tok.pad_token_id), kls

    free, _ = drift(0.0)
    kept, kls = drift(4.0)
    assert kls[0] == pytest.approx(0.0, abs=1e-6) and kls[-1] > 0  # the policy starts as the reference, then moves
    assert free > 0 and kept < 0.5 * free, (kept, free)


def _kl(ref: torch.nn.Module, model: torch.nn.Module, episodes: list, pad: int) -> float:
    """Mean KL(ref || model) per model token of `episodes`."""
    data = episode_batch(episodes, pad)
    with torch.no_grad():
        p = torch.log_softmax(ref(input_ids=data.input_ids, attention_mask=data.attention_mask).logits[:, :-1].float(), -1)
        q = torch.log_softmax(model(input_ids=data.input_ids, attention_mask=data.attention_mask).logits[:, :-1].float(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    return float((kl * data.loss_mask).sum() / data.loss_mask.sum())

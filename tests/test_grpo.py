"""GRPO math against hand-computed values and the formulas."""

from __future__ import annotations

import math

import pytest
import torch

from skillswarm.node.rl.grpo import aggregate, group_advantages, has_signal, kl_k3, policy_loss
from tests.rl_configs import loss_config


def test_group_advantages_by_variant() -> None:
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    # group 1: mean 0.5, unbiased std sqrt(1/3); group 2: mean 0.75, std 0.5
    s1 = math.sqrt(1 / 3)
    expected_grpo = torch.tensor([[0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1], [0.5, 0.5, 0.5, -1.5]])
    torch.testing.assert_close(group_advantages(r, "grpo", eps=0.0), expected_grpo)
    torch.testing.assert_close(group_advantages(r, "dapo", eps=0.0), expected_grpo)
    torch.testing.assert_close(group_advantages(r, "dr_grpo"), torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]]))
    zero = group_advantages(torch.tensor([0.3, 0.3, 0.3]), "grpo")
    assert torch.all(zero == 0)
    assert has_signal(r).tolist() == [True, True] and has_signal(torch.tensor([[1.0, 1.0], [0.0, 1.0]])).tolist() == [False, True]
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0]))


def test_ratio_one_reduces_to_minus_advantage_times_logprob() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[:, :4]  # [B=3, T=4]
    adv = torch.tensor([1.5, -0.5, 2.0])
    mask = torch.ones(3, 4)
    cfg = loss_config(loss="grpo")
    loss, m = policy_loss(logp, logp.detach(), logp.detach(), adv, mask, cfg)
    reference = (-(adv[:, None] * logp)).mean(-1).mean()  # -A * logprob, per-sequence mean
    g1 = torch.autograd.grad(loss, logits, retain_graph=True)[0]
    g2 = torch.autograd.grad(reference, logits)[0]
    torch.testing.assert_close(g1, g2)
    assert loss.item() == pytest.approx(-adv.mean().item())  # value: -A * ratio with ratio = 1
    assert m["clip_frac"] == 0 and m["is_weight_mean"] == pytest.approx(1.0)


def test_clipping_engages_where_it_should() -> None:
    cfg = loss_config(loss="dapo", eps_low=0.2, eps_high=0.28)
    old = torch.zeros(1, 4)
    # ratios: 1.5 (above 1+eps_high), 0.5 (below 1-eps_low), 1.1 (inside), 1.5
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.5]])).requires_grad_()
    pos, neg = torch.tensor([1.0]), torch.tensor([-1.0])
    loss_pos, m_pos = policy_loss(logp, old, old, pos, torch.ones(1, 4), cfg)
    # A>0: min(rA, clip(r)A) = [1.28, 0.5, 1.1, 1.28] -> loss = -mean
    assert loss_pos.item() == pytest.approx(-(1.28 + 0.5 + 1.1 + 1.28) / 4, rel=1e-6)
    assert m_pos["clip_frac"] == pytest.approx(0.5)
    (grad,) = torch.autograd.grad(loss_pos, logp)
    assert grad[0, 0] == 0 and grad[0, 3] == 0  # clipped tokens give no gradient
    assert grad[0, 1] != 0 and grad[0, 2] != 0
    loss_neg, m_neg = policy_loss(logp, old, old, neg, torch.ones(1, 4), cfg)
    # A<0: min(-r, -clip(r)) = [-1.5, -0.8, -1.1, -1.5] -> loss = mean of the negation
    assert loss_neg.item() == pytest.approx((1.5 + 0.8 + 1.1 + 1.5) / 4, rel=1e-6)
    assert m_neg["clip_frac"] == pytest.approx(0.25)


def test_truncated_importance_sampling_caps_the_weight() -> None:
    cfg = loss_config(loss="dapo", tis_cap=2.0)
    logp = torch.zeros(1, 3, requires_grad=True)
    behaviour = torch.log(torch.tensor([[0.25, 1.0, 2.0]]))  # pi/pi_behaviour = 4 (capped to 2), 1, 0.5
    loss, m = policy_loss(logp, logp.detach(), behaviour, torch.tensor([1.0]), torch.ones(1, 3), cfg)
    assert loss.item() == pytest.approx(-(2.0 + 1.0 + 0.5) / 3, rel=1e-6)
    assert m["is_truncated_frac"] == pytest.approx(1 / 3)


def test_masked_tokens_get_zero_gradient_and_do_not_count() -> None:
    logits = torch.randn(2, 6, 7, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 6))
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    mask = torch.tensor([[0, 0, 1, 1, 0, 1], [0, 1, 1, 0, 0, 0]], dtype=torch.float32)
    for variant in ("grpo", "dr_grpo", "dapo"):
        loss, _ = policy_loss(logp, logp.detach(), logp.detach(), torch.tensor([1.0, -2.0]), mask, loss_config(loss=variant))
        (g,) = torch.autograd.grad(loss, logits, retain_graph=True)
        assert torch.all(g[mask == 0] == 0), variant
        assert torch.all(g[mask == 1].abs().sum(-1) > 0), variant


def test_aggregation_by_variant() -> None:
    per_token = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert aggregate(per_token, mask, loss_config(loss="grpo")).item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate(per_token, mask, loss_config(loss="dapo")).item() == pytest.approx(10.0 / 4)
    assert aggregate(per_token, mask, loss_config(loss="dr_grpo", max_new_tokens=5)).item() == pytest.approx(10.0 / (2 * 5))


def test_kl_penalty() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    k3 = kl_k3(logp, ref)
    assert k3[0, 0].item() == pytest.approx(0.5 - math.log(0.5) - 1) and k3[0, 1].item() == 0
    cfg = loss_config(loss="dapo", beta=0.1)
    loss, m = policy_loss(logp, logp, logp, torch.tensor([0.0]), torch.ones(1, 2), cfg, ref_logp=ref)
    assert loss.item() == pytest.approx(0.1 * k3.mean().item()) and m["kl"] == pytest.approx(k3.mean().item())
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, logp, logp, torch.tensor([0.0]), torch.ones(1, 2), cfg)


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="variant"):
        loss_config(loss="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        loss_config(eps_low=1.5)


def test_micro_batches_sum_to_the_full_batch_loss() -> None:
    from skillswarm.node.rl.grpo import token_weights

    torch.manual_seed(3)
    logp = torch.randn(4, 5) - 2
    behaviour = logp + 0.1 * torch.randn(4, 5)
    mask = (torch.rand(4, 5) > 0.3).float()
    adv = torch.randn(4)
    for variant in ("grpo", "dr_grpo", "dapo"):
        cfg = loss_config(loss=variant)
        full, _ = policy_loss(logp, logp, behaviour, adv, mask, cfg)
        w = token_weights(mask, cfg)
        parts = sum(policy_loss(logp[i:i + 2], logp[i:i + 2], behaviour[i:i + 2], adv[i:i + 2], mask[i:i + 2], cfg,
                                weights=w[i:i + 2])[0] for i in (0, 2))
        assert parts.item() == pytest.approx(full.item(), rel=1e-6), variant

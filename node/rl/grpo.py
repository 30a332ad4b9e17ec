"""GRPO math as pure functions: group advantages and the clipped, importance-corrected policy loss
for the common variants (grpo, dr_grpo, dapo). No model, no I/O: tested against the formulas."""

from __future__ import annotations

import torch

from skillswarm.node.rl.config import LossConfig, Variant


def group_advantages(rewards: torch.Tensor, variant: Variant = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """Advantages within each group (last dim = the G episodes of one task).

    grpo/dapo: (r - mean) / (std + eps) with the unbiased std (as TRL); dr_grpo: r - mean (Dr. GRPO
    drops the std, which over-weights easy and hard groups)."""
    if rewards.shape[-1] < 2:
        raise ValueError("a group needs at least 2 episodes")
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    if variant == "dr_grpo":
        return centered
    return centered / (rewards.std(dim=-1, keepdim=True) + eps)


def has_signal(rewards: torch.Tensor, tol: float = 1e-8) -> torch.Tensor:
    """True per group when rewards vary; a zero-variance group has zero advantage and no gradient."""
    return (rewards.max(dim=-1).values - rewards.min(dim=-1).values) > tol


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimator k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased, >= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    ref_logp: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO surrogate loss over a batch of sequences.

    logp: [B, T] log-probs of the taken tokens under the policy being trained (carries the gradient);
    old_logp: [B, T] the same at the start of this update (detached; equal to logp on a single pass);
    behaviour_logp: [B, T] what the inference engine sampled with (possibly some versions stale);
    advantages: [B] one per sequence; mask: [B, T] 1 on model-generated tokens, 0 on prompt/tool tokens.
    Per token: -w * min(r A, clip(r, 1-eps_low, 1+eps_high) A) + beta KL, with r = pi/pi_old and the
    truncated IS weight w = min(pi_old/pi_behaviour, tis_cap) correcting for the stale sampler.
    weights: [B, T] per-token reduction weights (`token_weights` of the whole batch) when this call
    sees one micro-batch of it; by default they are computed from `mask`.
    """
    mask = mask.to(logp.dtype)
    old_logp, behaviour_logp = old_logp.detach(), behaviour_logp.detach()
    adv = advantages.detach().to(logp.dtype).unsqueeze(-1)
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    is_weight = torch.clamp(torch.exp(old_logp - behaviour_logp), max=cfg.tis_cap)
    per_token = -is_weight * surrogate
    kl = torch.zeros_like(per_token)
    if cfg.beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs reference log-probs (ref_logp)")
        kl = kl_k3(logp, ref_logp.detach())
        per_token = per_token + cfg.beta * kl
    if weights is None:
        weights = token_weights(mask, cfg)
    loss = (per_token * weights).sum()
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        was_clipped = ((ratio * adv) > (clipped * adv)).to(mask.dtype)
        metrics = {
            "clip_frac": float((was_clipped * mask).sum() / n),
            "is_weight_mean": float((is_weight * mask).sum() / n),
            "is_truncated_frac": float(((torch.exp(old_logp - behaviour_logp) > cfg.tis_cap).to(mask.dtype) * mask).sum() / n),
            "kl": float((kl * mask).sum() / n),
            "tokens": float(mask.sum()),
        }
    return loss, metrics


def token_weights(mask: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Per-token weights [B, T] whose dot product with per-token losses is the variant's reduction;
    computed once per batch so micro-batches (gradient accumulation) sum to the same loss."""
    mask = mask.to(torch.float32)
    if cfg.variant == "grpo":  # mean over each sequence's tokens, then over sequences
        return mask / mask.sum(-1, keepdim=True).clamp(min=1) / mask.shape[0]
    if cfg.variant == "dapo":  # token-level: every token of the batch weighs the same
        return mask / mask.sum().clamp(min=1)
    return mask / (mask.shape[0] * cfg.max_tokens)  # dr_grpo: a constant normalizer


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Reduce per-token losses [B, T] to a scalar the way each variant prescribes."""
    return (per_token * token_weights(mask, cfg).to(per_token.dtype)).sum()

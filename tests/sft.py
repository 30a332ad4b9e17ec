"""Real deltas for screening tests: a few steps of supervised training on one skill's demonstrations (the
nano warm-up's data path), or of gradient *ascent* on them (a delta trained against the skill, as a
poisoner would), written as a delta file against the base."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from safetensors import safe_open

from skillswarm.merge.deltas import DeltaInfo, encode_delta
from skillswarm.protocol.hashing import weights_hash
from skillswarm.skills.nano.warmup import collate
from skillswarm.skills.registry import get_skill


def sft_delta(base_dir: Path, skill: str, out: Path, *, steps: int = 40, lr: float = 2e-3, batch: int = 16,
              seed: int = 0, against: bool = False, codec: str = "dense_fp32") -> DeltaInfo:
    """Train a copy of the model in `base_dir` on `skill` (or against it) and write trained - base to `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(base_dir)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sk, rng = get_skill(skill), random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        data = collate(sk, tok, [sk.tasks.sample(rng) for _ in range(batch)], rng)
        loss = model(**data).loss
        (-loss if against else loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = model.state_dict()
    with safe_open(str(base_dir / "model.safetensors"), framework="pt") as f:  # tied weights are stored once
        delta = {n: (state[n] - before[n]).float() for n in f.keys()}
    return encode_delta(delta, out, codec, base_hash=weights_hash(base_dir), skill=skill)

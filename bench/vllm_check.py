"""Proof on a GPU machine that the `vllm` engine works behind the RL engine's interface:

1. generation: vLLM samples turns for real skill prompts (token ids, logprobs, finish reasons);
2. logprob agreement: the logprobs vLLM reports equal the hf model's log-softmax(logits / T) of the
   same tokens (teacher-forced), at temperature 1 and 0.7;
3. a weight update: new weights pushed through vLLM's `load_weights` (worker extension +
   collective_rpc) change vLLM's logprobs, which then agree with the hf model holding the same weights;
4. greedy agreement between the engines, and a short run of the orchestrator on the vllm engine.

Prints one JSON object; exits 1 when a check fails. Needs CUDA and `pip install -e '.[vllm]'`.

    .venv/bin/python bench/vllm_check.py [--model DIR] [--dtype float32]

Without --model it builds a small nano-architecture model whose head size (64) every vLLM attention
backend supports (the default nano recipe's head size is 16).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _teacher_forced(model: Any, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    import torch

    ids = torch.tensor([prompt + tokens], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), -1)
    return logp.gather(-1, torch.tensor(tokens, device=logits.device)[:, None]).squeeze(-1).tolist()


def _agreement(engine: Any, model: Any, prompts: list[list[int]], temperature: float, seed: int) -> dict[str, Any]:
    gens = engine.generate(prompts, 24, temperature=temperature, seed=seed)
    diffs = []
    for p, g in zip(prompts, gens):
        ref = _teacher_forced(model, p, g.token_ids, temperature)
        diffs += [abs(a - b) for a, b in zip(g.logprobs, ref)]
    return {"tokens": len(diffs), "max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs),
            "finish": {r: sum(g.finish_reason == r for g in gens) for r in ("stop", "length")},
            "sum_logprob": sum(sum(g.logprobs) for g in gens)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--dtype", default="float32", help="vLLM dtype (float32 makes agreement exact to ~1e-4)")
    parser.add_argument("--tol", type=float, default=None, help="max |logprob diff| allowed (default by dtype)")
    args = parser.parse_args()

    import torch

    from skillswarm.node.rl.config import TrainConfig
    from skillswarm.node.rl.engines.hf import load_model_dir
    from skillswarm.node.rl.engines.vllm import VLLMEngine, vllm_available
    from skillswarm.node.rl.orchestrator import Orchestrator
    from skillswarm.skills.chat import encode, render
    from skillswarm.skills.registry import get_skill

    problem = vllm_available()
    if problem:
        print(json.dumps({"ok": False, "error": problem}))
        return 1
    tol = args.tol if args.tol is not None else (2e-3 if args.dtype == "float32" else 0.1)
    tmp = tempfile.TemporaryDirectory(prefix="vllm-check-")
    model_dir = args.model
    if model_dir is None:
        from skillswarm.skills.nano.build import build_base
        from skillswarm.skills.nano.recipe import NanoRecipe

        recipe = NanoRecipe(hidden_size=128, heads=2, intermediate_size=256, layers=2, steps=60)
        model_dir = build_base(Path(tmp.name) / "model", recipe=recipe, cache=False)
    report: dict[str, Any] = {"model": str(model_dir), "dtype": args.dtype, "tol": tol}
    start = time.monotonic()
    engine = VLLMEngine.load(model_dir, dtype=args.dtype, max_model_len=512, gpu_memory_utilization=0.3)
    report["vllm_start_s"] = round(time.monotonic() - start, 1)
    report["processed_logprobs"] = engine.processed_logprobs
    hf, tok = load_model_dir(model_dir, device="cuda")
    skill = get_skill("arith")
    prompts = [encode(tok, render(tok, skill.env.opening(t), True)) for t in skill.tasks.eval_tasks(16)]
    checks: dict[str, bool] = {}

    for temp in (1.0, 0.7):
        r = _agreement(engine, hf, prompts, temp, seed=1)
        report[f"agreement_T{temp}"] = r
        checks[f"logprobs agree at T={temp}"] = r["max_abs_diff"] < tol
    greedy_v = engine.generate(prompts, 24, temperature=0.0)
    from skillswarm.node.rl.engines.hf import HFEngine

    hf_engine = HFEngine(hf, tok, "cuda")
    greedy_h = hf_engine.generate(prompts, 24, temperature=0.0)
    same = sum(a.token_ids == b.token_ids for a, b in zip(greedy_v, greedy_h))
    report["greedy_identical"] = f"{same}/{len(prompts)}"
    checks["greedy mostly identical"] = same >= len(prompts) * 0.75

    # a weight update: perturb every weight a little, push to vLLM, and compare again
    before = _agreement(engine, hf, prompts, 1.0, seed=2)["sum_logprob"]
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g, device=p.device) * 0.05 * p.std().clamp(min=1e-3))
    start = time.monotonic()
    engine.load_state_dict(hf.state_dict(), policy_version=1)
    report["weight_update_s"] = round(time.monotonic() - start, 3)
    after = _agreement(engine, hf, prompts, 1.0, seed=2)
    report["after_update"] = after
    checks["policy version set"] = engine.policy_version == 1
    checks["update changed vLLM's logprobs"] = abs(after["sum_logprob"] - before) > 1e-3
    checks["logprobs agree after the update"] = after["max_abs_diff"] < tol

    orch = Orchestrator(engine, get_skill("calc"), TrainConfig(model_dir=model_dir, skill="calc", group_size=4, batch=2, max_new_tokens=24).rollout_config())
    batch = orch.generate_batch(0)
    report["orchestrator"] = {"groups": len(batch.groups), "statuses": [g.status for g in batch.groups],
                              "policy_version": batch.policy_version, "tokens": batch.tokens}
    checks["orchestrator ran on vllm"] = len(batch.groups) == 2 and batch.policy_version == 1
    report["checks"] = checks
    report["ok"] = all(checks.values())
    engine.close()
    tmp.cleanup()
    print(json.dumps(report, indent=2, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Inference engines behind one interface: what the RL engine asks of a generator.

An engine completes batches of token-id prompts (one episode turn each), returning for every prompt
the generated token ids, their sampling logprobs (log-softmax of logits / temperature: the behaviour
policy the trainer corrects against) and a finish reason; and it takes new weights tagged with the
policy version (optimizer steps) they come from. `hf` (transformers, CPU or GPU) is the default;
`vllm` (GPU) is imported only when asked for.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence

import torch

from skillswarm.node.generation import Generation
from skillswarm.protocol.errors import TrainError

log = logging.getLogger(__name__)

ENGINES: tuple[str, ...] = ("hf", "vllm")


class InferenceEngine(Protocol):
    """The contract. `generate` is called with whole turns' prompts (one per live episode);
    `load_state_dict` between generate calls, with all or a subset of the model's parameters
    (names as in the HF model's state dict) and the policy version they belong to."""

    name: str
    tokenizer: Any
    policy_version: int
    max_context: int

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
                 seed: int | None = None, stop_token_ids: Iterable[int] | None = None) -> list[Generation]: ...

    def load_state_dict(self, state: Mapping[str, torch.Tensor], policy_version: int) -> None: ...


def load_engine(kind: str, model_dir: Path | str, *, device: str | None = None, **options: Any) -> InferenceEngine:
    """An engine of `kind` ("hf" or "vllm") on the HF model directory `model_dir`.

    options: hf takes `max_batch`; vllm takes `gpu_memory_utilization`, `max_model_len`, `enforce_eager`, `seed`."""
    if kind == "hf":
        from skillswarm.node.generation import HFEngine

        return HFEngine.load(model_dir, device=device, **options)
    if kind == "vllm":
        from skillswarm.node.vllm_engine import VLLMEngine

        return VLLMEngine.load(model_dir, **options)
    raise TrainError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINES)}")


def check_engine(kind: str) -> None:
    """Fail early, with what to do, when `kind` cannot run here (vllm needs CUDA and the `vllm` extra)."""
    if kind not in ENGINES:
        raise TrainError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINES)}")
    if kind == "vllm":
        from skillswarm.node.vllm_engine import vllm_available

        problem = vllm_available()
        if problem:
            raise TrainError(f"the vllm engine cannot run here: {problem}; use --engine hf")

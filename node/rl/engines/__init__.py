"""Inference engines behind one interface (`base.InferenceEngine`): `hf` (transformers, CPU or GPU) is the
default; `vllm` (GPU) is imported only when asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skillswarm.node.rl.engines.base import ENGINES, InferenceEngine
from skillswarm.protocol.errors import TrainError


def load_engine(kind: str, model_dir: Path | str, *, device: str | None = None, **options: Any) -> InferenceEngine:
    """An engine of `kind` ("hf" or "vllm") on the HF model directory `model_dir`.

    options: hf takes `max_batch`; vllm takes `gpu_memory_utilization`, `max_model_len`, `enforce_eager`, `seed`."""
    if kind == "hf":
        from skillswarm.node.rl.engines.hf import HFEngine

        return HFEngine.load(model_dir, device=device, **options)
    if kind == "vllm":
        from skillswarm.node.rl.engines.vllm import VLLMEngine

        return VLLMEngine.load(model_dir, **options)
    raise TrainError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINES)}")


def check_engine(kind: str) -> None:
    """Fail early, with what to do, when `kind` cannot run here (vllm needs CUDA and the `vllm` extra)."""
    if kind not in ENGINES:
        raise TrainError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINES)}")
    if kind == "vllm":
        from skillswarm.node.rl.engines.vllm import vllm_available

        problem = vllm_available()
        if problem:
            raise TrainError(f"the vllm engine cannot run here: {problem}; use --engine hf")

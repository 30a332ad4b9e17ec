"""The `vllm` inference engine (GPU, the `vllm` extra): the same interface as `hf`, on vLLM's offline
`LLM`. vLLM is imported only when this engine is created.

- Prompts go in as token ids (`TokensPrompt`), one `SamplingParams` per prompt so that the G episodes
  of a group (the same prompt) get different samples from one seed.
- Logprobs are the sampled tokens' logprobs after temperature (`logprobs_mode="processed_logprobs"`,
  vLLM >= 0.10.2); older releases return raw logprobs, exact only at temperature 1 (a warning says so).
- New weights go through vLLM's own weight loading: a worker extension (`vllm_worker.py`) calls the
  model's `load_weights` via `LLM.collective_rpc`; the prefix cache is reset after each update,
  because cached KV blocks were computed with the old weights.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from skillswarm.node.rl.engines.base import Generation
from skillswarm.protocol.errors import ModelError

log = logging.getLogger(__name__)

WORKER_EXTENSION = "skillswarm.node.rl.engines.vllm_worker.WeightUpdateExtension"


def vllm_available() -> str | None:
    """None when the vllm engine can run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device (vLLM runs on GPUs)"
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install -e '.[vllm]')"
    return None


class VLLMEngine:
    """Generation on vLLM. Thread-safe: one generate or weight update at a time."""

    name = "vllm"

    def __init__(self, llm: Any, tokenizer: Any, max_context: int, processed_logprobs: bool) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.processed_logprobs = processed_logprobs
        self.policy_version = 0
        self._lock = threading.Lock()
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ModelError("the tokenizer has no eos token; the vllm engine needs one to end turns")
        self.eos_ids = {int(eos)}

    @classmethod
    def load(cls, model_dir: Path | str, *, gpu_memory_utilization: float = 0.5, max_model_len: int | None = None,
             enforce_eager: bool = True, seed: int = 0, dtype: str = "auto") -> "VLLMEngine":
        """Start vLLM on the HF model directory `model_dir` (its tokenizer is loaded with transformers,
        so prompts are tokenized exactly as for the hf engine)."""
        problem = vllm_available()
        if problem:
            raise ModelError(f"cannot start the vllm engine: {problem}")
        import vllm
        from transformers import AutoTokenizer

        path = Path(model_dir).expanduser()
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is not a model directory (no config.json)")
        kwargs: dict[str, Any] = dict(model=str(path), tokenizer=str(path), seed=seed, dtype=dtype,
                                      gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                                      enable_prefix_caching=True, worker_extension_cls=WORKER_EXTENSION)
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        try:
            llm, processed = vllm.LLM(logprobs_mode="processed_logprobs", **kwargs), True
        except TypeError:  # vLLM < 0.10.2 has no logprobs_mode: raw logprobs (= processed at temperature 1)
            llm, processed = vllm.LLM(**kwargs), False
            log.warning("this vLLM returns raw logprobs; behaviour logprobs are exact only at temperature 1")
        tokenizer = AutoTokenizer.from_pretrained(path)
        max_context = int(llm.llm_engine.model_config.max_model_len)
        return cls(llm, tokenizer, max_context, processed)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
                 seed: int | None = None, stop_token_ids: Iterable[int] | None = None) -> list[Generation]:
        """Complete every prompt (temperature 0 = greedy); each prompt gets its own seed (seed + row)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if temperature < 0 or max_new_tokens < 0:
            raise ValueError("temperature and max_new_tokens must be >= 0")
        if not prompts or max_new_tokens == 0:
            return [Generation() for _ in prompts]
        if temperature > 0 and not self.processed_logprobs and abs(temperature - 1.0) > 1e-6:
            raise ModelError("this vLLM version returns raw logprobs; sample at temperature 1 or upgrade vLLM (>= 0.10.2)")
        stops = sorted(set(stop_token_ids) if stop_token_ids is not None else self.eos_ids)
        params = [SamplingParams(n=1, temperature=temperature, max_tokens=max_new_tokens, logprobs=0,
                                 seed=None if seed is None else seed * 100_003 + row, stop_token_ids=stops,
                                 skip_special_tokens=False, detokenize=False)
                  for row in range(len(prompts))]
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        with self._lock:
            outputs = self.llm.generate(inputs, params, use_tqdm=False)
        return [self._generation(out.outputs[0], set(stops)) for out in outputs]

    @staticmethod
    def _generation(out: Any, stops: set[int]) -> Generation:
        ids = [int(t) for t in out.token_ids]
        logprobs = [float(step[t].logprob) for step, t in zip(out.logprobs or [], ids)]
        if len(logprobs) != len(ids):
            raise ModelError("vLLM returned fewer logprobs than tokens; the vllm engine needs logprobs=0 support")
        # V1 may report "length" when the stop token was also the last allowed one: the token decides.
        reason = "stop" if ids and ids[-1] in stops else "length"
        return Generation(token_ids=ids, logprobs=logprobs, finish_reason=reason)

    def load_state_dict(self, state: Mapping[str, torch.Tensor], policy_version: int) -> None:
        """Push new weights (HF names) into the running model through vLLM's `load_weights`."""
        from safetensors.torch import save_file

        # safetensors refuses tensors that share memory (tied embeddings): save independent copies.
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="skillswarm-weights-", suffix=".safetensors", dir=folder)
        os.close(fd)
        try:
            save_file(tensors, path)
            with self._lock:
                loaded = self.llm.collective_rpc("skillswarm_load_weights", args=(path,))
                self.llm.reset_prefix_cache()
                self.policy_version = int(policy_version)
        finally:
            Path(path).unlink(missing_ok=True)
        log.debug("vllm engine: loaded %s tensors per worker, policy version %d", loaded, policy_version)

    def weight_checksum(self, name: str) -> float:
        """The sum of one parameter as vLLM's worker holds it (vLLM's own parameter naming)."""
        with self._lock:
            return float(self.llm.collective_rpc("skillswarm_weight_checksum", args=(name,))[0])

    def close(self) -> None:
        """Release the GPU (best effort: vLLM's shutdown API differs across versions)."""
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None

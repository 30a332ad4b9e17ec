"""Code that runs inside vLLM's GPU worker process: the `worker_extension_cls` mixin vLLM adds to
its worker, so that `LLM.collective_rpc("skillswarm_load_weights", ...)` pushes new weights through
the model's own `load_weights` (vLLM's weight-loading API: it knows the fused/sharded layouts).

Kept apart from `vllm_engine.py` and free of vLLM imports at module level: vLLM imports it by its
qualified name in the worker process.
"""

from __future__ import annotations

from pathlib import Path


class WeightUpdateExtension:
    """Mixed into vLLM's Worker: `self.model_runner` is the worker's model runner."""

    def skillswarm_load_weights(self, path: str) -> int:
        """Load the safetensors file at `path` (HF parameter names) into the running model; returns how
        many tensors were loaded. A file is the hand-off because it works across vLLM versions and
        process layouts; /dev/shm keeps it in memory."""
        import torch
        from safetensors.torch import load_file

        state = load_file(str(Path(path)), device=str(self.device) if hasattr(self, "device") else "cuda")
        model = self.model_runner.model
        model.load_weights(weights=list(state.items()))
        torch.cuda.synchronize()
        return len(state)

    def skillswarm_weight_checksum(self, name: str) -> float:
        """Sum of one parameter as the worker holds it (a check that an update landed)."""
        for n, p in self.model_runner.model.named_parameters():
            if n == name:
                return float(p.float().sum())
        raise KeyError(name)

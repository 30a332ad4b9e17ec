"""The `hf` inference engine: batched generation on transformers with a KV cache.

Prompts (token ids) are left-padded into one batch, prefilled once, then decoded one token per
step for every live row; a row stops at a stop token (the tokenizer's eos by default) or at
`max_new_tokens`. Each generated token comes with its sampling logprob: log-softmax(logits / T) at
temperature T > 0 (the behaviour policy the RL trainer corrects against), or log-softmax(logits)
when greedy (T = 0). The engine takes new weights with a policy version, so the RL trainer can
push updates to it.
"""

from __future__ import annotations

import inspect
import logging
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from skillswarm.node.rl.engines.base import Generation
from skillswarm.protocol.errors import ModelError

log = logging.getLogger(__name__)

def load_model_dir(model_dir: Path | str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Load a Hugging Face model directory (weights and tokenizer) for inference, with a clear error."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = Path(model_dir).expanduser()
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} is not a model directory (no config.json); build one with `skillswarm base build`")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"cannot load the model in {path}: {e}") from e
    return model.to(device).eval(), tokenizer


def auto_threads(model: Any, small: int = 50_000_000) -> int:
    """A sensible torch thread count for CPU inference: 1 for small models (their matrices are too
    small to split, and spare threads spin against other processes), all cores otherwise."""
    params = sum(p.numel() for p in model.parameters())
    return 1 if params < small else max(1, torch.get_num_threads())


class HFEngine:
    """Generation on a transformers causal LM. Thread-safe: one generate or weight update at a time."""

    name = "hf"

    def __init__(self, model: Any, tokenizer: Any, device: str | None = None, max_batch: int = 256) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.policy_version = 0
        self._lock = threading.Lock()
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ModelError("the tokenizer has neither a pad nor an eos token")
        self.pad_id = int(pad)
        eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
        self.eos_ids = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None}
        self.max_context = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        # transformers >= 5 calls the cache argument `cache`; older releases `past_key_values`.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" if "logits_to_keep" in params else None

    @classmethod
    def load(cls, model_dir: Path | str, device: str | None = None, max_batch: int = 256) -> "HFEngine":
        """An engine on the model in `model_dir` (HF format)."""
        dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model, tokenizer = load_model_dir(model_dir, dev)
        return cls(model, tokenizer, dev, max_batch)

    def load_state_dict(self, state: Mapping[str, torch.Tensor], policy_version: int) -> None:
        """Take new weights (all or a subset of the parameters) and the policy version they belong to."""
        with self._lock, torch.no_grad():
            missing = set(state) - set(self.model.state_dict())
            if missing:
                raise ModelError(f"weights for unknown parameters: {sorted(missing)[:5]}")
            self.model.load_state_dict(state, strict=False)
            self.policy_version = int(policy_version)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
                 seed: int | None = None, stop_token_ids: Iterable[int] | None = None) -> list[Generation]:
        """Complete every prompt; `temperature` 0 is greedy. Same seed, same weights: same samples."""
        if temperature < 0 or max_new_tokens < 0:
            raise ValueError("temperature and max_new_tokens must be >= 0")
        stops = set(stop_token_ids) if stop_token_ids is not None else self.eos_ids
        generator = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        out: list[Generation] = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(prompts), self.max_batch):
                chunk = prompts[start:start + self.max_batch]
                out += self._generate(chunk, max_new_tokens, temperature, generator, stops)
        return out

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        kwargs = {self._cache_kw: cache, "use_cache": True}
        if self._keep_kw:
            kwargs[self._keep_kw] = 1
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs).logits
        return logits[:, -1, :].float()

    def _generate(self, prompts: Sequence[Sequence[int]], max_new: int, temperature: float,
                  generator: torch.Generator | None, stops: set[int]) -> list[Generation]:
        from transformers import DynamicCache

        results = [Generation() for _ in prompts]
        if not prompts or max_new == 0:
            return results
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        width = max(len(p) for p in prompts)
        if width + max_new > self.max_context:
            raise ModelError(f"prompt ({width} tokens) + max_new_tokens ({max_new}) exceeds the model's context "
                             f"({self.max_context}); shorten the episode or lower max_new_tokens")
        n = len(prompts)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: every row's next token lands in the last column
            ids[row, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[row, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self._forward(ids, mask, positions, cache)
        live = torch.ones(n, dtype=torch.bool, device=self.device)
        stop_t = torch.tensor(sorted(stops), dtype=torch.long, device=self.device)
        last_pos = positions[:, -1:]
        for step in range(max_new):
            if temperature > 0:
                logp = torch.log_softmax(logits / temperature, dim=-1)
                token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
            else:
                logp = torch.log_softmax(logits, dim=-1)
                token = logp.argmax(-1)
            chosen = logp.gather(-1, token[:, None]).squeeze(-1)
            rows = live.nonzero().squeeze(-1).tolist()
            toks, lps = token.tolist(), chosen.tolist()
            for row in rows:
                results[row].token_ids.append(toks[row])
                results[row].logprobs.append(lps[row])
            stopped = live & torch.isin(token, stop_t)
            for row in stopped.nonzero().squeeze(-1).tolist():
                results[row].finish_reason = "stop"
            live &= ~stopped
            if not live.any() or step == max_new - 1:
                break
            token = torch.where(live, token, torch.full_like(token, self.pad_id))
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], dim=1)
            last_pos = last_pos + 1
            logits = self._forward(token[:, None], mask, last_pos, cache)
        return results

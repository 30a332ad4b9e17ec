"""Inference engines behind one interface: what the RL engine asks of a generator.

An engine completes batches of token-id prompts (one episode turn each), returning for every prompt
the generated token ids, their sampling logprobs (log-softmax of logits / temperature: the behaviour
policy the trainer corrects against) and a finish reason; and it takes new weights tagged with the
policy version (optimizer steps) they come from. The engines: `hf` (transformers, CPU or GPU; the
default) and `vllm` (GPU); `skillswarm.node.rl.engines.load_engine` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping, Protocol, Sequence

from skillswarm.protocol.records import DEFAULT_ENGINE

if TYPE_CHECKING:
    import torch

ENGINES: tuple[str, ...] = (DEFAULT_ENGINE, "vllm")
FinishReason = Literal["stop", "length"]


@dataclass
class Generation:
    """One completion: its token ids (the stop token included when it stopped), their logprobs, and why it ended."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason = "length"


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

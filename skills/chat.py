"""Conversations to text and tokens, through the tokenizer's own chat template.

Token sequences are built the way a rollout builds them, turn by turn: the environment's part (the
rendered text up to and including the assistant header) and the model's part (the assistant's
content and the template's end-of-turn text) are encoded separately, so the loss mask is exactly the
model's tokens. The nano warm-up trains on these sequences; `skillswarm.node.rl.rollout` makes the same
ones from sampled turns.
"""

from __future__ import annotations

from typing import Any, Sequence

from skillswarm.protocol.errors import ModelError
from skillswarm.skills.episode import Message


def render(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    """The chat template's text for `messages` (plus the assistant header when asked)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError("the tokenizer has no chat template; skills need a chat model (or `skillswarm base build`)")
    return tokenizer.apply_chat_template([m.as_dict() for m in messages], tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of already-rendered text (the template placed every special token itself)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def suffix(full: str, prefix: str) -> str:
    """`full` minus `prefix`; templates that rewrite earlier turns cannot be trained turn by turn."""
    if not full.startswith(prefix):
        raise ModelError("the chat template re-renders earlier turns differently once a turn is added; "
                         "multi-turn training needs a template whose output only grows")
    return full[len(prefix):]


def episode_tokens(tokenizer: Any, messages: Sequence[Message]) -> tuple[list[int], list[int]]:
    """Token ids of a conversation up to its last assistant turn, and the loss mask (1 on the model's tokens)."""
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for i, m in enumerate(messages):
        if m.role != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        after = render(tokenizer, messages[: i + 1])
        env_ids = encode(tokenizer, suffix(before, done))
        model_ids = encode(tokenizer, suffix(after, before))
        ids += env_ids + model_ids
        mask += [0] * len(env_ids) + [1] * len(model_ids)
        done = after
    return ids, mask

"""The nano model's character-level tokenizer, in Hugging Face format.

One token per printable ASCII character (and newline), special tokens for the chat roles and the end
of a turn, and the tool-call protocol's tags as whole (non-special) tokens so that a tiny model
writes them in one step. The chat template renders

    <|system|>...<|end|><|user|>...<|end|><|assistant|>...<|end|><|tool|>...<|end|>

and, with `add_generation_prompt`, a trailing `<|assistant|>`. `<|end|>` is the eos token: the model
ends its turn by emitting it.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from skillswarm.skills.toolcall import PROTOCOL_TOKENS

PAD, END, UNK = "<|pad|>", "<|end|>", "<|unk|>"
ROLES = ("system", "user", "assistant", "tool")
ROLE_TOKENS = tuple(f"<|{r}|>" for r in ROLES)
SPECIAL = (PAD, END, UNK, *ROLE_TOKENS)
CHARS = tuple(chr(i) for i in range(32, 127)) + ("\n",)

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('unknown role ' ~ m['role'] ~ '; use system, user, assistant or tool') }}"
    "{%- endif -%}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer (same vocabulary every time: ids do not depend on any seed)."""
    vocab = {t: i for i, t in enumerate((*SPECIAL, *PROTOCOL_TOKENS, *CHARS))}
    # BPE with no merges over the whole string = one token per character; unknown characters -> <|unk|>.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in PROTOCOL_TOKENS])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=END, unk_token=UNK,
                                  clean_up_tokenization_spaces=False, model_max_length=4096)
    tok.chat_template = CHAT_TEMPLATE
    return tok

"""The nano base model: a character-level tokenizer with a chat template, a small Llama, and a short
supervised warm-up on the built-in skills; built deterministically from a seed and cached."""

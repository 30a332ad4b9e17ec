"""`vf-reverse-env`: a verifiers v1 environment whose task the nano model knows (reverse 2-4 letters,
reply `<answer>S</answer>`), with an in-process chat harness so it runs without uv or a sandbox."""

from vf_reverse_env.env import ChatHarness, ReverseTaskset

__all__ = ["ReverseTaskset", "ChatHarness"]

"""Tools an environment offers, and how a tool says "the model's input was bad".

A tool is called with the raw text between `<tool name="...">` and `</tool>` and returns text. It
raises `ToolInputError` when the failure is the model's doing (bad expression, its code crashed, a
limit was hit): the environment shows that to the model as an `<error>` observation. Any other
exception means the tool itself is broken, and the episode ends as `env_error`.
"""

from __future__ import annotations

import operator
import re
from typing import Protocol, runtime_checkable


class ToolInputError(Exception):
    """The tool failed because of its input; the message is shown to the model."""


@runtime_checkable
class Tool(Protocol):
    """What an environment needs of a tool: a name, a one-line description, and a call."""

    name: str
    description: str

    def __call__(self, input: str) -> str: ...


_BINARY = re.compile(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*\Z")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


class Calculator:
    """`calc`: exactly one integer operation `a op b` with op in + - * (so multi-step work takes turns)."""

    name = "calc"
    description = "one integer operation: a+b, a-b or a*b"

    def __init__(self, max_digits: int = 12) -> None:
        self.max_digits = max_digits

    def __call__(self, input: str) -> str:
        m = _BINARY.match(input)
        if not m:
            raise ToolInputError("calc takes one operation like 12*7")
        a, op, b = m.groups()
        if max(len(a.lstrip("-")), len(b.lstrip("-"))) > self.max_digits:
            raise ToolInputError(f"numbers have at most {self.max_digits} digits")
        return str(_OPS[op](int(a), int(b)))

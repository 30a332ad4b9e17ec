"""The tool-call text protocol, and its strict parser.

A model turn is plain text. Inside it, the model may write

    <tool name="NAME">INPUT</tool>      call tool NAME on the raw text INPUT (one or more per turn)
    <answer>TEXT</answer>              give the final answer (ends the episode)

and the environment answers each call in a `tool` turn, in call order, with

    <result>OUTPUT</result>            the tool ran; OUTPUT is what it returned
    <error>MESSAGE</error>             the call was malformed, or the tool failed on this input

Example (the `calc` skill): `<tool name="calc">12*7</tool>` -> `<result>84</result>`, then
`<answer>84</answer>`. Parsing is strict, so that a tiny model and a chat model are graded alike:
tags are case-sensitive and never nest; NAME matches `[a-z][a-z0-9_]*`; a turn holds either one answer
or one or more calls, never both; text outside tags is allowed (and ignored); `<result>` and `<error>`
are written by the environment only. Anything else is malformed and earns an `<error>` observation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TOOL_OPEN = '<tool name="'
TOOL_OPEN_END = '">'
TOOL_CLOSE = "</tool>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
ERROR_OPEN, ERROR_CLOSE = "<error>", "</error>"

# Strings a tokenizer may keep whole (the nano tokenizer does): every tag of the protocol.
PROTOCOL_TOKENS: tuple[str, ...] = (
    ANSWER_OPEN, ANSWER_CLOSE, TOOL_OPEN, TOOL_OPEN_END, TOOL_CLOSE, RESULT_OPEN, RESULT_CLOSE, ERROR_OPEN, ERROR_CLOSE,
)

_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
# Anything that looks like one of our tags, well-formed or not; the scanner then checks it exactly.
_TAG = re.compile(r"</?(?:tool|answer|result|error)\b[^>]*>?")


@dataclass(frozen=True)
class Call:
    """One parsed tool call: the tool's name and its raw input text."""

    name: str
    input: str


@dataclass(frozen=True)
class ParsedTurn:
    """What a model turn says: a final answer, tool calls, or why it is malformed (`error`;
    `call_error` when the fault is in a tool call rather than in the answer or elsewhere)."""

    answer: str | None = None
    calls: tuple[Call, ...] = field(default_factory=tuple)
    error: str | None = None
    call_error: bool = False


def format_call(name: str, input: str) -> str:
    """The text of a tool call, as a model should write it."""
    return f"{TOOL_OPEN}{name}{TOOL_OPEN_END}{input}{TOOL_CLOSE}"


def format_answer(text: str) -> str:
    """The text of a final answer."""
    return f"{ANSWER_OPEN}{text}{ANSWER_CLOSE}"


def format_result(output: str) -> str:
    """The environment's reply to a call that ran."""
    return f"{RESULT_OPEN}{output}{RESULT_CLOSE}"


def format_error(message: str) -> str:
    """The environment's reply to a malformed call or a tool failure."""
    return f"{ERROR_OPEN}{message}{ERROR_CLOSE}"


def _malformed(message: str, call: bool = False) -> ParsedTurn:
    return ParsedTurn(error=message, call_error=call)


def parse_turn(text: str, tools: frozenset[str] | set[str] | None = None, max_calls: int = 4) -> ParsedTurn:
    """Parse one model turn strictly. `tools`: the names the environment offers (None: any name).

    Never raises on model text: every problem comes back as `ParsedTurn.error`, a message meant for
    the model (it is shown to it inside `<error>`)."""
    answers: list[str] = []
    calls: list[Call] = []
    pos = 0
    while (m := _TAG.search(text, pos)) is not None:
        tag = m.group(0)
        if tag.startswith(("<result", "</result", "<error", "</error")):
            return _malformed(f"{tag} is written by the environment, not by you")
        if tag == ANSWER_OPEN:
            end = text.find(ANSWER_CLOSE, m.end())
            if end < 0:
                return _malformed(f"{ANSWER_OPEN} is not closed with {ANSWER_CLOSE}")
            body = text[m.end():end]
            if _TAG.search(body):
                return _malformed("tags cannot nest inside <answer>")
            answers.append(body.strip())
            pos = end + len(ANSWER_CLOSE)
        elif tag.startswith("<tool"):
            if not text.startswith(TOOL_OPEN, m.start()):
                return _malformed(f'write a tool call as {format_call("NAME", "INPUT")}', call=True)
            name_end = text.find(TOOL_OPEN_END, m.start() + len(TOOL_OPEN))
            if name_end < 0:
                return _malformed(f'write a tool call as {format_call("NAME", "INPUT")}', call=True)
            name = text[m.start() + len(TOOL_OPEN):name_end]
            if not _NAME.match(name):
                return _malformed(f"bad tool name {name!r}: use lower-case letters, digits and _", call=True)
            end = text.find(TOOL_CLOSE, name_end)
            if end < 0:
                return _malformed(f"the call to {name} is not closed with {TOOL_CLOSE}", call=True)
            body = text[name_end + len(TOOL_OPEN_END):end]
            if _TAG.search(body):
                return _malformed("tags cannot nest inside <tool>", call=True)
            if tools is not None and name not in tools:
                offered = ", ".join(sorted(tools)) or "none"
                return _malformed(f"unknown tool {name!r} (tools: {offered})", call=True)
            calls.append(Call(name, body))
            pos = end + len(TOOL_CLOSE)
        else:
            return _malformed(f"unexpected {tag}")
    if answers and calls:
        return _malformed("a turn either calls tools or answers, not both", call=True)
    if len(answers) > 1:
        return _malformed("give exactly one <answer>")
    if len(calls) > max_calls:
        return _malformed(f"at most {max_calls} tool calls per turn", call=True)
    return ParsedTurn(answer=answers[0] if answers else None, calls=tuple(calls))

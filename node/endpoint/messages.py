"""OpenAI chat messages to the skills' text protocol and back.

The model speaks the skills' tool protocol (`skillswarm.skills.toolcall`): a call is
`<tool name="NAME">INPUT</tool>` and the results come back in one `tool` turn as `<result>...</result>`
per call. On the OpenAI side a call is a `tool_calls` entry whose `arguments` is a JSON string: INPUT
that is a JSON object is passed as it is, any other INPUT as `{"input": INPUT}`; tool messages (one per
call, in call order) are joined into one `tool` turn. The model sees exactly the messages it is sent,
rendered by its own chat template: a harness describes its tools in the system prompt, as skills do.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Sequence

from skillswarm.protocol.errors import SkillswarmError
from skillswarm.skills.episode import Message
from skillswarm.skills.toolcall import RESULT_CLOSE, RESULT_OPEN, format_call, parse_turn

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(SkillswarmError):
    """A request the endpoint cannot serve; the message says what is wrong (HTTP 400)."""


def text_of(content: Any) -> str:
    """The text of an OpenAI message content: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError("only text content parts are supported (type: text)")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError("message content must be a string, null or a list of text parts")


def call_input(arguments: str) -> str:
    """A tool call's protocol INPUT from its OpenAI `arguments` JSON (the inverse of `call_arguments`)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and set(value) == {"input"} and isinstance(value["input"], str):
        return value["input"]
    return arguments


def call_arguments(input_text: str) -> str:
    """OpenAI `arguments` (a JSON object as text) for a protocol INPUT."""
    try:
        if isinstance(json.loads(input_text), dict):
            return input_text
    except ValueError:
        pass
    return json.dumps({"input": input_text})


def assistant_text(message: dict[str, Any]) -> str:
    """The protocol text of an assistant message (its content, then its tool calls as tags)."""
    text = text_of(message.get("content"))
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise RequestError("tool_calls must be a list")
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError("each tool call needs function.name and function.arguments")
        text += format_call(fn["name"], call_input(str(fn.get("arguments") or "")))
    return text


def to_internal(messages: Sequence[dict[str, Any]]) -> list[Message]:
    """The conversation as the chat template renders it: developer is system, tool messages in a row join."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError("messages must be a non-empty list")
    out: list[Message] = []
    for m in messages:
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise RequestError(f"unknown message role {role!r}; use one of {', '.join(ROLES)}")
        if role == "assistant":
            out.append(Message("assistant", assistant_text(m)))
        elif role == "tool":
            piece = f"{RESULT_OPEN}{text_of(m.get('content'))}{RESULT_CLOSE}"
            if out and out[-1].role == "tool":
                out[-1] = Message("tool", out[-1].content + piece)
            else:
                out.append(Message("tool", piece))
        else:
            out.append(Message("system" if role == "developer" else role, text_of(m.get("content"))))
    return out


def normalized(messages: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """A comparable form of OpenAI messages (role and protocol text), for matching a conversation's
    continuation against what was recorded; tool call ids are ignored (harnesses rewrite them)."""
    return [(m.role, m.content) for m in to_internal(messages)]


def tool_calls_of(text: str, tool_names: set[str] | None) -> tuple[str | None, list[dict[str, Any]]]:
    """Split a generated turn into OpenAI `content` and `tool_calls`. Calls are returned only when the
    turn is a well-formed call turn (and, when the request offered tools, names one of them); anything
    else stays content, so a malformed turn reaches the harness as the model wrote it."""
    parsed = parse_turn(text, tool_names)
    if parsed.error is not None or not parsed.calls:
        return text, []
    calls = [{"id": f"call_{secrets.token_hex(8)}", "type": "function",
              "function": {"name": c.name, "arguments": call_arguments(c.input)}} for c in parsed.calls]
    rest = text
    for c in parsed.calls:
        rest = rest.replace(format_call(c.name, c.input), "", 1)
    return (rest.strip() or None), calls


def offered_tools(tools: Any) -> set[str] | None:
    """The function names a request offers (None when it offers none: then no calls are extracted)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list")
    names = set()
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError("each tool needs type: function and function.name")
        names.add(fn["name"])
    return names

"""The Hermes tool-call format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the assistant's text,
as Qwen2.5's and Qwen3's chat templates ask for it (and render an assistant message's ``tool_calls``).

``parse_tool_calls(text)`` returns every call in order, each a ``ToolCall`` or, for a block that is not one, a
``ToolCallError`` saying why in one line; it never raises on what a model wrote.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Union

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool's name and its arguments by name."""

    name: str
    arguments: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCallError:
    """A ``<tool_call>`` block that is not a call: the reason (one line), and the name when one could be read."""

    message: str
    name: str = ""


ParsedCall = Union[ToolCall, ToolCallError]


def _short(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _parse_block(body: str) -> ParsedCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCallError(f"malformed tool call: not JSON ({err.msg} at character {err.pos}) in {_short(body)!r}")
    if not isinstance(value, dict):
        return ToolCallError(f"malformed tool call: expected a JSON object with 'name' and 'arguments', got "
                             f"{type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError("malformed tool call: no 'name' string")
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string (the OpenAI wire form)
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            return ToolCallError(f"malformed tool call to {name!r}: 'arguments' is a string but not JSON "
                                 f"({err.msg})", name)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCallError(f"malformed tool call to {name!r}: 'arguments' must be an object, got "
                             f"{type(arguments).__name__}", name)
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> List[ParsedCall]:
    """The calls in ``text``, in order (empty when there are none); a ``<tool_call>`` left open is an error."""
    calls: List[ParsedCall] = [_parse_block(m.group(1).strip()) for m in _BLOCK.finditer(text)]
    rest = _BLOCK.sub("", text)
    if OPEN in rest:
        calls.append(ToolCallError(f"malformed tool call: {OPEN} without {CLOSE}"))
    return calls


def assistant_message(text: str) -> Dict[str, Any]:
    """An assistant turn's text as a chat message: its calls as ``tool_calls`` (a block that does not parse stays in
    the content), the rest, stripped, as ``content``; how a trajectory is written back as messages."""
    calls, kept, last = [], [], 0
    for match in _BLOCK.finditer(text):
        call = _parse_block(match.group(1).strip())
        kept.append(text[last:match.start()])
        if isinstance(call, ToolCall):
            calls.append({"type": "function", "function": {"name": call.name, "arguments": call.arguments}})
        else:
            kept.append(match.group(0))
        last = match.end()
    kept.append(text[last:])
    message: Dict[str, Any] = {"role": "assistant", "content": "".join(kept).strip()}
    if calls:
        message["tool_calls"] = calls
    return message

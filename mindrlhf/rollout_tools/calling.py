"""Calling the model's tool calls: ``ToolBox`` holds the run's tools, checks each call's arguments against the tool's
schema, calls it under a time limit and writes its result as the text the model reads next.

A failure of any kind (a malformed call, an unknown tool, bad arguments, the tool raising, the time limit) is a
result too: ``error: <one line>``, marked ``failed`` so the rollout counts it, and the run goes on.

**How a tool is stopped at its time limit.** Tools run in the training process (as reward functions do), so the
choice is between ways of interrupting Python code in-process. In the main thread (where the rollout runs) a
``SIGALRM`` timer (``signal.setitimer``) raises ``ToolTimeout`` inside the tool: it stops pure-Python code and
blocking calls such as ``time.sleep`` or a socket read, and nothing of the tool runs on afterwards. ``ToolTimeout``
is a ``BaseException``, so a tool's ``except Exception`` does not swallow it; a result that arrives after the limit
anyway (a tool that catches ``BaseException``) still counts as timed out. A worker thread with ``join(timeout)``
alone would return in time but leave the tool running beside the training. Off the main thread, where no signal can
be delivered, the tool runs in a daemon thread and ``ToolTimeout`` is raised into it asynchronously
(``PyThreadState_SetAsyncExc``), which stops Python code at its next bytecode but not a call blocked in C, which
finishes in the background. No in-process mechanism interrupts one long C call holding the GIL (a huge integer
power): the built-in calculator bounds its numbers instead. A tool that needs a hard limit should run its work in a
subprocess of its own.
"""
from __future__ import annotations

import ctypes
import inspect
import json
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from mindrlhf.errors import MindRLHFError
from mindrlhf.rollout_tools.hermes import ParsedCall, ToolCall, ToolCallError, parse_tool_calls
from mindrlhf.rollout_tools.registry import ToolError, get_tool
from mindrlhf.rollout_tools.schema import tool_schema

#: Appended to a result cut at ``max_response_length`` characters (verl's marker).
TRUNCATED = "...(truncated)"


class ToolTimeout(BaseException):
    """Raised inside a tool at its time limit (a ``BaseException``, so ``except Exception`` in a tool lets it by)."""


@dataclass(frozen=True)
class ToolResult:
    """What one call gave: the tool's name (as called), the text the model reads, and whether the call failed."""

    name: str
    content: str
    failed: bool


def _on_alarm(signum, frame):
    raise ToolTimeout


def _alarm_call(fn: Callable, kwargs: Dict[str, Any], timeout: float) -> Any:
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    pending, _ = signal.setitimer(signal.ITIMER_REAL, timeout)
    start = time.monotonic()
    try:
        return fn(**kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
        if pending:  # another timer was running: give it back what is left of its time
            signal.setitimer(signal.ITIMER_REAL, max(pending - (time.monotonic() - start), 1e-6))


def _thread_call(fn: Callable, kwargs: Dict[str, Any], timeout: float) -> Any:
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(**kwargs)
        except BaseException as err:  # handed to the caller below (or dropped when the call timed out)
            box["error"] = err

    worker = threading.Thread(target=run, daemon=True, name=f"tool-{getattr(fn, '__name__', 'tool')}")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident), ctypes.py_object(ToolTimeout))
        raise ToolTimeout
    if "error" in box:
        raise box["error"]
    return box["value"]


def call_with_timeout(fn: Callable, kwargs: Dict[str, Any], timeout: Optional[float]) -> Any:
    """``fn(**kwargs)``, stopped by ``ToolTimeout`` after ``timeout`` seconds (None or 0: no limit); see the module
    docstring for how."""
    if not timeout:
        return fn(**kwargs)
    start = time.monotonic()
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        value = _alarm_call(fn, kwargs, timeout)
    else:
        value = _thread_call(fn, kwargs, timeout)
    if time.monotonic() - start > timeout:  # the tool caught ToolTimeout and finished late: still a timeout
        raise ToolTimeout
    return value


_JSON_TYPES = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
               "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
               "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
               "array": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict),
               "null": lambda v: v is None}


def _type_error(name: str, value: Any, schema: Dict[str, Any]) -> Optional[str]:
    """Why ``value`` does not fit the property's schema (its JSON type and enum; one level deep), or None."""
    if value is None and schema.get("nullable"):
        return None
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        if not any(_JSON_TYPES.get(kind, lambda v: True)(value) for kind in kinds):
            return f"{name!r} must be {' or '.join(kinds)}, got {json.dumps(value)[:40]}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{name!r} must be one of {json.dumps(schema['enum'])}"
    return None


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class ToolBox:
    """The run's tools: each a built-in's name, a ``"package.module:function"`` path or a function.

    ``schemas`` is what the chat template renders (``tools=``); ``call`` answers one parsed call and ``run`` every
    call in an assistant turn's text. ``timeout`` is each call's limit in seconds (0: none); a result longer than
    ``max_response_length`` characters (0: no limit) is cut there and marked ``...(truncated)``. ``schemas``: the
    tools' schemas when they are known already (an environment's methods, bound anew for every completion), one per
    tool in order; otherwise each is read from its signature and docstring.
    """

    def __init__(self, tools: Sequence[Union[str, Callable]], timeout: float = 10.0, max_response_length: int = 256,
                 schemas: Optional[Sequence[Dict[str, Any]]] = None):
        if timeout < 0 or max_response_length < 0:
            raise MindRLHFError(f"tool timeout ({timeout}) and max_tool_response_length ({max_response_length}) "
                                "must be >= 0 (0: no limit)")
        if schemas is not None and len(schemas) != len(tools):
            raise MindRLHFError(f"ToolBox got {len(schemas)} schemas for {len(tools)} tools; give one per tool")
        self.timeout = float(timeout)
        self.max_response_length = int(max_response_length)
        self.functions: Dict[str, Callable] = {}
        self.schemas: List[Dict[str, Any]] = []
        for k, tool in enumerate(tools):
            fn = get_tool(tool) if isinstance(tool, str) else tool
            if inspect.iscoroutinefunction(fn):
                raise MindRLHFError(f"tool {tool!r} is an async function; give a plain function (async tools are "
                                    "not supported)")
            schema = tool_schema(fn) if schemas is None else schemas[k]
            name = schema["function"]["name"]
            if name in self.functions:
                raise MindRLHFError(f"two tools are named {name!r}; the model calls a tool by its function name, so "
                                    "give each tool its own")
            self.functions[name] = fn
            self.schemas.append(schema)

    @property
    def names(self) -> List[str]:
        """The tools' names, as the model calls them."""
        return list(self.functions)

    def _failed(self, name: str, message: str) -> ToolResult:
        return ToolResult(name, self._truncate(f"error: {_one_line(message)}"), True)

    def _truncate(self, text: str) -> str:
        if self.max_response_length and len(text) > self.max_response_length:
            return text[:self.max_response_length] + TRUNCATED
        return text

    def call(self, call: ParsedCall) -> ToolResult:
        """One call's result; never raises for anything the model wrote or a tool did."""
        if isinstance(call, ToolCallError):
            return self._failed(call.name, call.message)
        fn = self.functions.get(call.name)
        if fn is None:
            return self._failed(call.name, f"unknown tool {call.name!r}; the tools are {', '.join(self.names)}")
        schema = self.schemas[self.names.index(call.name)]["function"]["parameters"]
        params = inspect.signature(fn).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            unknown = [arg for arg in call.arguments if arg not in schema["properties"]]
            if unknown:
                return self._failed(call.name, f"bad arguments for {call.name!r}: unknown argument "
                                               f"{', '.join(map(repr, unknown))}; it takes "
                                               f"{', '.join(schema['properties']) or 'no arguments'}")
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as err:
            return self._failed(call.name, f"bad arguments for {call.name!r}: {err}")
        for arg, value in call.arguments.items():
            problem = _type_error(arg, value, schema["properties"].get(arg, {}))
            if problem:
                return self._failed(call.name, f"bad arguments for {call.name!r}: {problem}")
        try:
            value = call_with_timeout(fn, call.arguments, self.timeout)
        except ToolTimeout:
            return self._failed(call.name, f"{call.name!r} timed out after {self.timeout:g} s")
        except ToolError as err:
            return self._failed(call.name, str(err))
        except Exception as err:  # a tool's own bug is the model's failed call, not the run's end
            return self._failed(call.name, f"{type(err).__name__}: {err}")
        return ToolResult(call.name, self._truncate(_as_text(value)), False)

    def run(self, text: str) -> List[ToolResult]:
        """The results of every call in ``text`` (an assistant turn), in order; empty when it calls nothing."""
        return [self.call(call) for call in parse_tool_calls(text)]


__all__ = ["ToolBox", "ToolResult", "ToolTimeout", "ToolCall", "call_with_timeout", "TRUNCATED"]

"""Tools by name: the built-ins' ``Registry`` and user functions by dotted path, resolved as reward functions are
(``Registry.resolve``).

A tool is a typed Python function with a Google-style docstring (TRL's form): its schema, what the model reads in its
prompt, comes from the signature and docstring (``schema.tool_schema``); it is called with the arguments the model
wrote, by keyword, and returns its result (text, or anything ``json.dumps`` can write). To report a failure in words
the model should read, raise ``ToolError``; any other exception is reported too, with its type.
"""
from __future__ import annotations

from typing import Callable

from mindrlhf.registry import Registry

#: The built-in tools (``rollout_tools.builtin``) and any registered with ``register_tool``.
TOOLS: Registry = Registry("tool", module="mindrlhf.rollout_tools.builtin")
#: Decorator: make ``fn`` available as the built-in tool ``name``.
register_tool = TOOLS.register


class ToolError(Exception):
    """A tool's own failure, its message the one line the model reads as the result (``error: <message>``)."""


def get_tool(name: str) -> Callable:
    """A built-in tool by name, or a user function given as ``"package.module:function"``."""
    return TOOLS.resolve(name)

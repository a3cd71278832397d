"""Tools a policy calls during a rollout: the registry (built-ins by name, user functions by dotted path), a tool's
JSON schema from its signature and docstring, the built-in ``calculator``, the Hermes ``<tool_call>`` parser and
``ToolBox``, which calls them under a time limit and writes their results, and their rendering through the chat
template (``render``: schemas into the prompt, results as appended token ids). Imports no MindSpore.
"""
from mindrlhf.rollout_tools.calling import TRUNCATED, ToolBox, ToolResult, ToolTimeout, call_with_timeout
from mindrlhf.rollout_tools.hermes import ToolCall, ToolCallError, assistant_message, parse_tool_calls
from mindrlhf.rollout_tools.registry import TOOLS, ToolError, get_tool, register_tool
from mindrlhf.rollout_tools.render import (
    check_template_renders_tools,
    render_prompt,
    retokenization_drift,
    tool_result_ids,
    trajectory_messages,
)
from mindrlhf.rollout_tools.schema import tool_schema

__all__ = ["TOOLS", "TRUNCATED", "ToolBox", "ToolCall", "ToolCallError", "ToolError", "ToolResult", "ToolTimeout",
           "assistant_message", "call_with_timeout", "check_template_renders_tools", "get_tool", "parse_tool_calls",
           "register_tool", "render_prompt", "retokenization_drift", "tool_result_ids", "tool_schema",
           "trajectory_messages"]

"""A tool's JSON schema from its typed signature and Google-style docstring, as ``transformers.utils.get_json_schema``
builds it (the form chat templates render under ``tools=``), without importing transformers.

The description is the docstring up to ``Args:``/``Returns:``/``Raises:``; each argument needs a type hint and a
line under ``Args:`` (a trailing ``(choices: [...])`` becomes an ``enum``); a parameter without a default is
``required``. Types: ``int`` ``float`` ``str`` ``bool`` ``None``, ``list[T]``, ``tuple[A, B]``, ``dict[str, T]``,
``Optional``/``Union``, ``Literal`` and ``Enum`` classes. A ``self``/``cls`` without a hint is skipped (methods).
"""
from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing
from typing import Any, Callable, Dict, List, Optional, Tuple

from mindrlhf.errors import MindRLHFError

# The same section patterns as transformers' chat_template_utils, so a docstring splits the same way.
_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_ARG_SPLIT = re.compile(
    r"(?:^|\n)([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*?)\s*(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)",
    re.DOTALL)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_PLAIN = {**{t: {"type": name} for t, name in _SCALARS.items()}, list: {"type": "array"}, tuple: {"type": "array"},
          dict: {"type": "object"}, Any: {}}


class _Unsupported(Exception):
    """A type hint with no JSON schema (a custom class); turned into the one-line error by ``tool_schema``."""


def _enum(values: list) -> dict:
    kinds = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _hint_schema(hint: Any) -> dict:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [member.value for member in hint]
        if not values or any(type(v) not in _SCALARS for v in values):
            raise _Unsupported(f"Enum {hint.__name__} needs members with int, float, str, bool or None values")
        return _enum(values)
    if origin is None:
        if hint in _PLAIN:
            return dict(_PLAIN[hint])
        raise _Unsupported(f"type hint {hint!r} has no JSON schema (use int, float, str, bool, list, tuple, dict, "
                           "Optional, Union, Literal or an Enum)")
    if origin is typing.Union or origin is types.UnionType:
        subs = [_hint_schema(t) for t in args if t is not type(None)]
        if len(subs) == 1:
            out = subs[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subs):
            names = sorted({s["type"] for s in subs})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": subs}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is typing.Literal and args:
        if any(type(a) not in _SCALARS for a in args):
            raise _Unsupported("typing.Literal may list only int, float, str, bool or None values")
        return _enum(list(args))
    if origin is list:
        return {"type": "array", "items": _hint_schema(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise _Unsupported(f"{hint} is a one-element or variable-length tuple; use list[...] instead")
        return {"type": "array", "prefixItems": [_hint_schema(t) for t in args]}
    if origin is dict:
        return {"type": "object", "additionalProperties": _hint_schema(args[1])} if len(args) == 2 else {
            "type": "object"}
    raise _Unsupported(f"type hint {hint!r} has no JSON schema")


def parse_docstring(doc: str) -> Tuple[Optional[str], Dict[str, str], Optional[str]]:
    """A Google-style docstring's description, argument descriptions by name, and ``Returns:`` text."""
    description = _DESCRIPTION.search(doc)
    args = _ARGS.search(doc)
    returns = _RETURNS.search(doc)
    arg_docs: Dict[str, str] = {}
    if args is not None:
        block = "\n".join(line for line in args.group(1).split("\n") if line.strip())
        arg_docs = {m[1]: re.sub(r"\s*\n+\s*", " ", m[2].strip()) for m in _ARG_SPLIT.findall(block)}
    return (description.group(1).strip() if description else None, arg_docs,
            returns.group(1).strip() if returns else None)


def tool_schema(fn: Callable) -> Dict[str, Any]:
    """``{"type": "function", "function": {"name", "description", "parameters"[, "return"]}}`` for ``fn``; a
    one-line ``MindRLHFError`` naming the function and what its signature or docstring lacks."""
    name = getattr(fn, "__name__", "operation")
    doc = inspect.getdoc(fn)
    if not doc:
        raise MindRLHFError(f"tool {name!r} has no docstring; give it a Google-style docstring (a description and "
                            "an 'Args:' line per argument), which is the schema the model reads")
    description, arg_docs, return_doc = parse_docstring(doc.strip())
    try:
        hints = typing.get_type_hints(fn)
    except Exception as err:  # an annotation that names something undefined
        raise MindRLHFError(f"tool {name!r}: cannot read its type hints ({type(err).__name__}: {err})") from err
    params = inspect.signature(fn).parameters
    first = next(iter(params), None)
    receiver = first if first in {"self", "cls"} and params[first].annotation is inspect.Parameter.empty else None
    required: List[str] = []
    for pname, param in params.items():
        if pname == receiver:
            continue
        if param.annotation is inspect.Parameter.empty:
            raise MindRLHFError(f"tool {name!r}: argument {pname!r} has no type hint; annotate it (int, float, str, "
                                "bool, list[...], ...), since the schema's types come from the hints")
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    properties: Dict[str, Any] = {}
    returns = None
    try:
        for pname, hint in hints.items():
            if pname == receiver:
                continue
            if pname == "return":
                try:  # the model never writes the return value: a hint with no schema is left out
                    returns = _hint_schema(hint)
                except _Unsupported:
                    pass
                continue
            properties[pname] = _hint_schema(hint)
    except _Unsupported as err:
        raise MindRLHFError(f"tool {name!r}: {err}") from None
    for pname, schema in properties.items():
        if pname not in arg_docs:
            raise MindRLHFError(f"tool {name!r}: the docstring has no 'Args:' line for {pname!r}; describe every "
                                "argument (Google style: '    name: what it is')")
        text = arg_docs[pname]
        choices = _CHOICES.search(text)
        if choices:
            try:
                values = json.loads(choices.group(1))
            except json.JSONDecodeError as err:
                raise MindRLHFError(f"tool {name!r}: the '(choices: ...)' of {pname!r} is not a JSON list "
                                    f"({err})") from None
            schema["enum"] = [v.strip() if isinstance(v, str) else v for v in values]
            text = text[:choices.start()].strip()
        schema["description"] = text
    parameters: Dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    function: Dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if returns is not None:
        if return_doc is not None:
            returns["description"] = return_doc
        function["return"] = returns
    return {"type": "function", "function": function}

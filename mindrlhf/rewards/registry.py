"""Reward functions by name: the built-ins' ``Registry``, and user functions by dotted path.

A reward function has TRL's signature ``fn(prompts, completions, completion_ids, **kwargs) ->
list[float | None]``: one score per completion, None meaning "not applicable". Everything arrives
by keyword: ``prompts`` (prompt text, chat template included), ``completions`` (text),
``completion_ids`` (token ids) and the dataset's columns (``solution``, ``question``), so a
function names what it reads and takes the rest as ``**kwargs``.
"""
from __future__ import annotations

import importlib
from typing import Callable, List, Optional

from mindrlhf.errors import MindRLHFError
from mindrlhf.registry import Registry

RewardFn = Callable[..., List[Optional[float]]]
#: The built-in reward functions (``rewards.builtin``) and any registered with ``register_reward``.
REWARD_FUNCS: Registry = Registry("reward function", module="mindrlhf.rewards.builtin")
#: Decorator: make ``fn`` available as the built-in reward ``name``.
register_reward = REWARD_FUNCS.register


def get_reward_fn(name: str) -> RewardFn:
    """A built-in reward by name, or a user function given as ``"package.module:function"``
    (``"package.module.function"`` also works)."""
    if not isinstance(name, str) or not name.strip():
        raise MindRLHFError(f"reward function name must be a non-empty string, got {name!r}")
    if name in REWARD_FUNCS:
        return REWARD_FUNCS.get(name)
    builtins = ", ".join(sorted(REWARD_FUNCS.names()))
    if ":" in name:
        module_name, _, attr = name.partition(":")
    elif "." in name:
        module_name, _, attr = name.rpartition(".")
    else:
        raise MindRLHFError(
            f"unknown reward function {name!r}; built-ins: {builtins}; "
            "or give a user function as 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or any error raised while the user module runs
        raise MindRLHFError(
            f"reward function {name!r}: cannot import module {module_name!r} ({type(err).__name__}: {err}); "
            f"check the path and PYTHONPATH (built-ins: {builtins})"
        ) from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise MindRLHFError(
            f"reward function {name!r}: module {module_name!r} has no callable {attr!r}"
        )
    return fn

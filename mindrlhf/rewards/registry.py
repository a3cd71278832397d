"""Reward functions by name: the built-ins' ``Registry``, and user functions by dotted path.

A reward function has TRL's signature ``fn(prompts, completions, completion_ids, **kwargs) ->
list[float | None]``: one score per completion, None meaning "not applicable". Everything arrives
by keyword: ``prompts`` (prompt text, chat template included), ``completions`` (text),
``completion_ids`` (token ids) and the dataset's columns (``solution``, ``question``), so a
function names what it reads and takes the rest as ``**kwargs``.
"""
from __future__ import annotations

from typing import Callable, List, Optional

from mindrlhf.registry import Registry

RewardFn = Callable[..., List[Optional[float]]]
#: The built-in reward functions (``rewards.builtin``) and any registered with ``register_reward``.
REWARD_FUNCS: Registry = Registry("reward function", module="mindrlhf.rewards.builtin")
#: Decorator: make ``fn`` available as the built-in reward ``name``.
register_reward = REWARD_FUNCS.register


def get_reward_fn(name: str) -> RewardFn:
    """A built-in reward by name, or a user function given as ``"package.module:function"``
    (``"package.module.function"`` also works)."""
    return REWARD_FUNCS.resolve(name)

"""The algorithm registries (``mindrlhf.registry``) as the MindSpore code looks them up.

``lookup`` is the ``get`` to use in code that may run inside ``mindspore.jit``: the name is checked
by an ``ops.constexpr`` (plain Python at graph-compile time, so a bad name raises ``MindRLHFError``
both eagerly and in a graph, whose parser rejects ``raise`` of non-builtin exception types), then
read from the registry's table.
"""
from __future__ import annotations

from typing import Callable

from mindspore import ops

from mindrlhf.registry import (
    ADVANTAGE_ESTIMATORS,
    IS_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    ROLLOUT_RS,
    Registry,
)

_BY_KIND = {r.kind: r for r in (POLICY_LOSSES, IS_MODES, ROLLOUT_RS, ADVANTAGE_ESTIMATORS, KL_ESTIMATORS,
                                PREFERENCE_LOSSES)}


@ops.constexpr
def check_registered(kind: str, name) -> bool:
    """Raise a one-line ``MindRLHFError`` naming ``name`` and listing the known names of ``kind``."""
    _BY_KIND[kind].check(name)
    return True


def lookup(registry: Registry, name: str) -> Callable:
    """``registry.get(name)``, usable inside ``mindspore.jit``."""
    check_registered(registry.kind, name)
    return registry.entries[name]

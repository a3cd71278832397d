"""Name → function registries shared by the algorithm modules.

Look-ups validate with ``ops.constexpr`` checks: they run in Python at graph-compile time, so a
bad name raises ``MindRLHFError`` both eagerly and inside ``mindspore.jit`` (whose parser rejects
``raise`` of non-builtin exception types and ``try`` blocks).
"""
from __future__ import annotations

from typing import Callable, Dict

from mindspore import ops

from mindrlhf.errors import MindRLHFError

_REGISTRIES: Dict[str, Dict[str, Callable]] = {}
_HINTS: Dict[str, str] = {}


def new_registry(kind: str, hints: Dict[str, str] = None) -> Dict[str, Callable]:
    """Create the registry for ``kind`` (e.g. "policy loss"); ``hints`` map likely wrong names to advice."""
    _REGISTRIES[kind] = {}
    for name, hint in (hints or {}).items():
        _HINTS[f"{kind}:{name}"] = hint
    return _REGISTRIES[kind]


def registrar(kind: str, doc: str = "") -> Callable[[str], Callable[[Callable], Callable]]:
    """A ``register(name)`` decorator factory for the registry ``kind``; ``doc`` is its docstring."""

    def register(name: str) -> Callable[[Callable], Callable]:
        def wrap(fn: Callable) -> Callable:
            registry = _REGISTRIES[kind]
            if name in registry and registry[name] is not fn:
                raise MindRLHFError(f"{kind} {name!r} is already registered (by {registry[name].__qualname__})")
            registry[name] = fn
            return fn

        return wrap

    register.__doc__ = doc or f"Decorator: register a {kind} under ``name``."
    return register


@ops.constexpr
def check_registered(kind: str, name) -> bool:
    """Raise a one-line ``MindRLHFError`` naming ``name`` and listing the known names of ``kind``."""
    registry = _REGISTRIES[kind]
    if not isinstance(name, str) or name not in registry:
        hint = _HINTS.get(f"{kind}:{str(name).lower()}", "")
        raise MindRLHFError(
            f"unknown {kind} {name!r}; choose one of {', '.join(sorted(registry))}" + (f" ({hint})" if hint else "")
        )
    return True

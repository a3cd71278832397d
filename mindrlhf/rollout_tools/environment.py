"""Environments: a class whose instance holds one rollout's state, in the shape of TRL's ``environment_factory``.

``--environment my_pkg.envs:Cls``: ``Cls()`` is built once per completion and ``reset(**row)`` called with the
prompt row's columns (its reward columns, e.g. ``question``, and ``solution``) before the completion is sampled;
every other public method is a tool the policy may call, answered by that completion's instance (its schema from the
signature and the Google-style docstring, as a tool function's); an optional ``get_reward()`` is read after the
completion's last turn and scored by the ``environment`` reward function. An observation returned by ``reset`` is
refused: prompts are tokenised once, before the rollout, so a per-rollout text cannot join them; put it in the
prompt rows.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Dict, List, Mapping, Union

from mindrlhf.errors import MindRLHFError
from mindrlhf.registry import Registry
from mindrlhf.rollout_tools.calling import ToolBox

#: Environment classes by dotted path (no built-ins).
ENVIRONMENTS: Registry = Registry("environment")
#: Public methods that are not tools.
NOT_TOOLS = ("reset", "get_reward")


class Environment:
    """The run's environment class (a ``"package.module:Class"`` path or the class); ``schemas`` are its tools'."""

    def __init__(self, source: Union[str, type]):
        cls = ENVIRONMENTS.resolve(source) if isinstance(source, str) else source
        if not inspect.isclass(cls):
            raise MindRLHFError(f"environment {source!r} is not a class; give 'package.module:Class' whose instances "
                                "have reset(**row) and public methods as tools")
        self.cls, self.name = cls, cls.__name__
        if not callable(getattr(cls, "reset", None)):
            raise MindRLHFError(f"environment {self.name} has no reset(**row) method; add one (it is called with the "
                                "prompt row's columns before each rollout)")
        self.methods = [name for name, member in inspect.getmembers(cls, callable)
                        if not name.startswith("_") and name not in NOT_TOOLS and not inspect.isclass(member)]
        if not self.methods:
            raise MindRLHFError(f"environment {self.name} has no public methods besides reset/get_reward: its public "
                                "methods are the tools the policy calls")
        self.has_reward = callable(getattr(cls, "get_reward", None))
        self.schemas = ToolBox(self.tools(self._build())).schemas

    def _build(self) -> Any:
        try:
            return self.cls()
        except Exception as err:  # the user's constructor: named, not a traceback from deep in the rollout
            raise MindRLHFError(f"environment {self.name}() failed: {type(err).__name__}: {err}; its constructor "
                                "must take no arguments") from err

    def tools(self, instance: Any) -> List[Callable]:
        """``instance``'s tools: its public methods, bound."""
        return [getattr(instance, name) for name in self.methods]

    def toolbox(self, instance: Any, box: ToolBox) -> ToolBox:
        """``box``'s tools (with its limits) and ``instance``'s: the tools one completion calls. The schemas are the
        ones read once from the class, not read again for every instance."""
        return ToolBox(list(box.functions.values()) + self.tools(instance), timeout=box.timeout,
                       max_response_length=box.max_response_length, schemas=box.schemas + self.schemas)

    def start(self, row: Mapping[str, Any]) -> Any:
        """A new instance, reset with ``row``'s columns."""
        instance = self._build()
        observation = instance.reset(**dict(row))
        if observation is not None and observation != "":
            raise MindRLHFError(f"environment {self.name}.reset returned an observation ({str(observation)[:40]!r}); "
                                "prompts are tokenised once before the rollout, so put that text in the prompt rows "
                                "and return None")
        return instance

    def reward(self, instance: Any) -> float:
        """``instance.get_reward()`` as a float (NaN without ``get_reward``, or when it returns None)."""
        if not self.has_reward:
            return math.nan
        value = instance.get_reward()
        return math.nan if value is None else float(value)


def environment_rows(columns: Dict[str, list], solutions: list) -> List[Dict[str, Any]]:
    """Per prompt, the row ``reset`` gets: its dataset columns by name and its ``solution``."""
    return [{**{name: values[i] for name, values in columns.items()}, "solution": solutions[i]}
            for i in range(len(solutions))]


__all__ = ["ENVIRONMENTS", "Environment", "environment_rows"]

"""Environments the tests name by dotted path (``--environment tool_envs:CalculatorEnv``; tests/ is on sys.path)."""
from __future__ import annotations

from typing import List, Optional

from mindrlhf.rollout_tools.builtin import calculator as builtin_calculator


class CalculatorEnv:
    """The built-in calculator as one rollout's tool (the same schema), remembering its row: ``get_reward`` is 1.0
    when one of the rollout's calls gave the row's solution, else 0.0."""

    def __init__(self) -> None:
        self.solution: Optional[str] = None
        self.results: List[str] = []

    def reset(self, solution: str = "", **row) -> None:
        self.solution, self.results = str(solution), []

    def calculator(self, expression: str) -> str:
        result = builtin_calculator(expression)
        self.results.append(result)
        return result

    calculator.__doc__ = builtin_calculator.__doc__

    def get_reward(self) -> float:
        return 1.0 if self.solution in self.results else 0.0


class Talkative(CalculatorEnv):
    """Returns an observation from reset (refused: prompts are tokenised once)."""

    def reset(self, **row) -> str:
        return "The numbers are small."


class NoTools:
    """Only reset and get_reward: nothing to call."""

    def reset(self, **row) -> None:
        pass

    def get_reward(self) -> float:
        return 0.0


class NeedsArguments(CalculatorEnv):
    def __init__(self, seed: int) -> None:
        super().__init__()

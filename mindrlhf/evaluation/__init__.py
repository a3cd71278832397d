"""Benchmarks of a policy: GSM8K greedy pass@1 / maj@k (``mindrlhf-eval``).

Names are imported lazily from ``mindrlhf.evaluation.gsm8k_eval``, so that
``python -m mindrlhf.evaluation.gsm8k_eval`` runs without a double-import warning and importing
this package stays cheap.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Question", "QuestionScore", "binomial_stderr", "evaluate", "format_summary", "load_questions",
           "majority_vote", "score_question"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("mindrlhf.evaluation.gsm8k_eval"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Built-in reward functions: ``accuracy``, ``format``, ``gsm8k_format``, ``boxed`` (TRL-compatible signatures)."""
from __future__ import annotations

import re
from typing import Callable, List, Optional, Sequence

from mindrlhf.rewards.answers import extract_answer, locate_answer, numbers_match, parse_number
from mindrlhf.rewards.registry import register_reward

# <think>…</think> then <answer>…</answer>, only whitespace around; no nested/repeated tags.
_NO_TAG = r"(?:(?!</?(?:think|answer)>).)*"
_FORMAT = re.compile(rf"\s*<think>{_NO_TAG}</think>\s*<answer>{_NO_TAG}</answer>\s*", re.DOTALL)


def completion_text(completion) -> str:
    """The text of a completion: a string, or TRL's conversational form (messages; last content)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, (list, tuple)) and completion:
        return completion_text(completion[-1])
    return ""


def _gold(solution) -> Optional[float]:
    """The reference number: the solution itself if numeric, else its extracted final answer."""
    value = parse_number(solution) if isinstance(solution, (str, int, float)) else None
    if value is None and isinstance(solution, str):
        value = parse_number(extract_answer(solution))
    return value


def _normalise_text(s: str) -> str:
    return " ".join(s.split()).lower()


#: math-verify's time limits in seconds (its parse and verify use SIGALRM, so only in the main thread), as TRL's.
PARSE_TIMEOUT, VERIFY_TIMEOUT = 10, 5


def math_gold(solution: str) -> Optional[list]:
    """A solution that is mathematics rather than a number, parsed by math-verify (a set, an interval, an
    expression, a root, π, ∞, a percentage, an equation: anything but a finite number), or None. A number, a
    GSM8K answer (``#### N``) and text math-verify cannot read keep the number path, so GSM8K scores as before."""
    # A LaTeX percentage (MATH's "10\\%") is a fraction to math-verify, where our number path would read 10.
    if "####" in solution or (parse_number(solution) is not None and "\\%" not in solution):
        return None
    import threading

    import sympy
    from math_verify import parse

    main = threading.current_thread() is threading.main_thread()
    gold = parse(solution, parsing_timeout=PARSE_TIMEOUT if main else None)
    if not gold or (isinstance(gold[0], sympy.Number) and gold[0].is_finite):
        return None
    return gold


def math_verified(gold: list, text: str) -> bool:
    """Whether ``text``'s first LaTeX answer (a ``\\boxed{}`` first, then ``$…$``; never a bare number, so the
    model must write its answer as mathematics) equals ``gold`` by math-verify, with the extraction settings of TRL's
    ``accuracy_reward`` (units normalised away)."""
    import threading

    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    main = threading.current_thread() is threading.main_thread()
    answer = parse(text, extraction_config=[LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                                                  boxed_match_priority=0,
                                                                  try_extract_without_anchor=False)],
                   extraction_mode="first_match", parsing_timeout=PARSE_TIMEOUT if main else None)
    return bool(verify(gold, answer, timeout_seconds=VERIFY_TIMEOUT if main else None))


@register_reward("accuracy")
def accuracy_reward(completions: Sequence, solution: Sequence, **kwargs) -> List[Optional[float]]:
    """1.0 when the completion's final answer equals the solution, else 0.0.

    ``solution`` may be a number (``"18"``) or a full GSM8K answer (``"…#### 18"``): the completion's final answer
    must equal it numerically (rel. tol 1e-6). A solution that is mathematics rather than a number (``$\\sqrt{2}$``,
    ``$\\{1,2,3\\}$``, ``\\boxed{(0, 1]}``; ``math_gold``) is checked by math-verify as TRL's ``accuracy_reward``
    checks it (``math_verified``); any other solution is compared as normalised text. An empty/missing solution
    gives None.
    """
    rewards: List[Optional[float]] = []
    for completion, sol in zip(completions, solution):
        if sol is None or (isinstance(sol, str) and not sol.strip()):
            rewards.append(None)
            continue
        maths = math_gold(sol) if isinstance(sol, str) else None
        if maths is not None:
            rewards.append(1.0 if math_verified(maths, completion_text(completion)) else 0.0)
            continue
        predicted = extract_answer(completion_text(completion))
        gold = _gold(sol)
        if gold is None:  # non-numeric reference: exact text match of the final answers
            gold_text = extract_answer(str(sol)) or str(sol)
            ok = predicted is not None and _normalise_text(predicted) == _normalise_text(gold_text)
        else:
            value = parse_number(predicted)
            ok = value is not None and numbers_match(value, gold)
        rewards.append(1.0 if ok else 0.0)
    return rewards


@register_reward("format")
def format_reward(completions: Sequence, **kwargs) -> List[Optional[float]]:
    """1.0 iff the completion is ``<think>…</think>`` then ``<answer>…</answer>``, nothing else but whitespace."""
    return [1.0 if _FORMAT.fullmatch(completion_text(c)) else 0.0 for c in completions]


_HASH_LINE = re.compile(r"####[ \t]*(\S[^\n]*)")


@register_reward("gsm8k_format")
def gsm8k_format_reward(completions: Sequence, **kwargs) -> List[Optional[float]]:
    """1.0 iff the completion ends with its only ``#### <number>`` line (GSM8K's answer format).

    Exactly one ``####`` is allowed: a model that repeats its answer line until the length limit
    would otherwise be rewarded for never stopping.
    """
    rewards = []
    for c in completions:
        text = completion_text(c)
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        match = _HASH_LINE.fullmatch(lines[-1]) if lines and text.count("####") == 1 else None
        rewards.append(1.0 if match and parse_number(match.group(1)) is not None else 0.0)
    return rewards


@register_reward("boxed")
def boxed_reward(completions: Sequence, **kwargs) -> List[Optional[float]]:
    """1.0 iff the final answer is inside a non-empty ``\\boxed{}``."""
    rewards = []
    for c in completions:
        answer, source = locate_answer(completion_text(c))
        rewards.append(1.0 if source == "boxed" and answer else 0.0)
    return rewards


def overlong_reward(max_completion_length: int, buffer_length: int, penalty: float) -> Callable[..., List[float]]:
    """DAPO's soft overlong punishment as a reward function named ``overlong``: 0 up to
    ``max_completion_length - buffer_length`` tokens, then falling linearly to ``-penalty`` at
    ``max_completion_length`` (lengths in generated tokens, a stop token included)."""
    if not 0 < buffer_length < max_completion_length:
        raise ValueError(f"overlong buffer {buffer_length} must be in (0, max_completion_length="
                         f"{max_completion_length})")
    start = max_completion_length - buffer_length

    def overlong(completion_ids: Sequence[Sequence[int]], **kwargs) -> List[float]:
        return [-penalty * min(max(len(ids) - start, 0) / buffer_length, 1.0) for ids in completion_ids]

    return overlong


@register_reward("environment")
def environment_reward(completions: Sequence, environment_reward: Optional[Sequence] = None,
                       **kwargs) -> List[Optional[float]]:
    """The rollout's environment's ``get_reward()`` for each completion (``--environment`` with a ``get_reward``
    method; NaN or None scores nothing)."""
    if environment_reward is None:
        raise ValueError("the 'environment' reward reads an environment's get_reward(); run with --environment "
                         "pkg.module:Class whose class has get_reward()")
    return [None if value is None or value != value else float(value) for value in environment_reward]

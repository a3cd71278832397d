"""Reward functions for end-to-end tests (loaded by dotted path, as users load theirs).

A tiny random model never answers GSM8K correctly, so the built-in rewards are all zero and the
advantages vanish; these give every group a spread of rewards, so updates carry real gradients.
"""
from typing import List, Optional, Sequence


def length_reward(completions: Sequence[str], **kwargs) -> List[Optional[float]]:
    """Characters in the completion / 40 (different for almost every sample)."""
    return [len(c) / 40.0 for c in completions]


def trl_signature_reward(prompts, completions, completion_ids, **kwargs):
    """Written as TRL documents reward functions; checks what it is given (an assert stops the run)."""
    assert len(prompts) == len(completions) == len(completion_ids) == len(kwargs["solution"])
    for prompt, question, ids in zip(prompts, kwargs["question"], completion_ids):
        assert isinstance(prompt, str) and question in prompt, (prompt, question)
        assert all(isinstance(i, int) for i in ids)
    return [len(ids) / 8.0 for ids in completion_ids]


def broken_reward(completions, **kwargs):
    """A reward with a bug."""
    raise ValueError("this reward has a bug")


def _flat_for(parity: int, completions, question) -> List[float]:
    """Zero for every completion of a question whose length has ``parity`` (a group with no spread), else the length
    reward."""
    return [0.0 if len(q) % 2 == parity else len(c) / 40.0 for c, q in zip(completions, question)]


def flat_for_even_questions(completions, question, **kwargs):
    """Zero for every completion of a question of even length (a group with no spread), else the
    length reward: a deterministic mix of flat and informative groups for dynamic sampling."""
    return _flat_for(0, completions, question)


def flat_for_odd_questions(completions, question, **kwargs):
    """flat_for_even_questions the other way round: of the suite's first 16 GSM8K questions only 4 (0, 8, 10, 12)
    give a spread, so dynamic sampling runs short of informative groups and fills the step with masked flat ones."""
    return _flat_for(1, completions, question)


def zero_reward(completions, **kwargs):
    """The same reward for everything: every group is flat."""
    return [0.0] * len(completions)


def one_infinite_reward(completions, **kwargs):
    """The length reward, but inf for the first completion of every call (a reward with an overflow)."""
    return [float("inf")] + [len(c) / 40.0 for c in completions[1:]]


def no_score(completions, **kwargs):
    """None for everything: a function that never applies."""
    return [None] * len(completions)


def unit_reward(completions, **kwargs):
    """0 or 1, alternating: every group has the same spread."""
    return [float(i % 2) for i in range(len(completions))]


def huge_reward(completions, **kwargs):
    """``unit_reward`` times 1e30: finite in float32, but its square is not (a reward on an unscaled count)."""
    return [1e30 * r for r in unit_reward(completions)]


def string_reward(completions, **kwargs):
    """Numbers as strings ("0.5"): TRL refuses them; float() would have accepted them."""
    return [str(len(c) / 40.0) for c in completions]


def record_columns_reward(completions, solution, **columns):
    """The length reward; appends the dataset columns it got (names, and every solution and answer) as one JSON
    line to the file $MINDRLHF_TEST_COLUMNS, so a test sees what reached the reward functions."""
    import json
    import os

    with open(os.environ["MINDRLHF_TEST_COLUMNS"], "a", encoding="utf-8") as f:
        f.write(json.dumps({"names": sorted(columns), "solution": list(solution),
                            "answer": list(columns.get("answer") or [])}) + "\n")
    return [len(c) / 40.0 for c in completions]

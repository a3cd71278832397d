"""Reward functions: a registry of built-ins (accuracy, format, gsm8k_format, boxed), user functions by dotted
path, and ``RewardManager`` for the weighted sum."""
from mindrlhf.rewards.answers import extract_answer, locate_answer, numbers_match, parse_number
from mindrlhf.rewards.builtin import (
    accuracy_reward,
    boxed_reward,
    completion_text,
    format_reward,
    gsm8k_format_reward,
    overlong_reward,
)
from mindrlhf.rewards.manager import RewardManager
from mindrlhf.rewards.registry import REWARD_FUNCS, RewardFn, get_reward_fn, register_reward

__all__ = [
    "REWARD_FUNCS",
    "RewardFn",
    "RewardManager",
    "accuracy_reward",
    "boxed_reward",
    "completion_text",
    "extract_answer",
    "format_reward",
    "get_reward_fn",
    "gsm8k_format_reward",
    "locate_answer",
    "numbers_match",
    "overlong_reward",
    "parse_number",
    "register_reward",
]

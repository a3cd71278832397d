"""GSM8K answers and prompt construction.

A GSM8K ``answer`` is worked reasoning with ``<<a*b=c>>`` calculator notes, ending in
``#### <final number>``; the reward compares the model's answer with that final number.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # only for the annotation; keeps this module import-light for the reward code
    from mindrlhf.tokenizer import Tokenizer

# The format reward checks for exactly this shape of completion: reasoning inside <think> </think>,
# then the bare final number inside <answer> </answer> (which the accuracy reward parses). Kept short
# (30 Qwen2.5 tokens) so every GSM8K train and test prompt fits the default max_prompt_length of 256.
DEFAULT_SYSTEM_PROMPT = (
    "You are a math assistant. Think step by step inside <think> </think>, "
    "then give only the final number inside <answer> </answer>."
)


def extract_gsm8k_solution(answer: str) -> Optional[str]:
    """The final answer after ``####`` with whitespace stripped and thousands commas removed.

    ``"... #### 1,234"`` → ``"1234"``. Returns None when the answer has no ``####`` marker.
    """
    if "####" not in answer:
        return None
    # The last marker wins: the final answer follows it, whatever the reasoning contained.
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def build_prompt(
    question: str,
    tokenizer: "Tokenizer",
    system_prompt: Optional[str] = DEFAULT_SYSTEM_PROMPT,
    use_chat_template: bool = True,
) -> str:
    """The prompt text for one question.

    With ``use_chat_template`` (default): the tokenizer's chat template over a system message
    (skipped when ``system_prompt`` is empty or None) and the user question, ending with the
    assistant header (``add_generation_prompt=True``). Otherwise the raw question.
    """
    if not use_chat_template:
        return question
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

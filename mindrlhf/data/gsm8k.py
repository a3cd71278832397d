"""GSM8K answers and prompt construction.

A GSM8K ``answer`` is worked reasoning with ``<<a*b=c>>`` calculator notes, ending in
``#### <final number>``; the reward compares the model's answer with that final number.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple

from mindrlhf.errors import MindRLHFError

if TYPE_CHECKING:  # only for the annotation; keeps this module import-light for the reward code
    from mindrlhf.tokenizer import Tokenizer

# A prompt style is a system prompt and the reward that checks a completion follows it.
# "gsm8k": GSM8K's own answer format, brief reasoning then a last line "#### <number>" (reward
# gsm8k_format). The one-line worked example is what makes small models use the format: measured
# with SmolLM2-135M-Instruct (8 training questions x 8 samples, temperature 0.7, 200 new tokens) the
# format rate is 41% with it and 2% without, so GRPO starts with a signal to amplify.
# "tags": reasoning inside <think> </think>, then the bare number inside <answer> </answer> (reward
# format; the DeepSeek-R1 / TRL convention, for models that can follow it, e.g. Qwen2.5-Instruct).
# Every GSM8K prompt of either style fits the default max_prompt_length 320 (tests check this).
PROMPT_STYLES = {
    "gsm8k": ("Solve the math problem briefly, in a few short steps. Then write the final answer on its own "
              "last line as '#### <number>'.\nExample:\nQ: Tom has 3 apples and buys 4 more. How many apples "
              "does he have?\nA: Tom has 3 + 4 = 7 apples.\n#### 7", "gsm8k_format"),
    "tags": ("You are a math assistant. Think step by step inside <think> </think>, "
             "then give only the final number inside <answer> </answer>.", "format"),
}
DEFAULT_PROMPT_STYLE = "gsm8k"
DEFAULT_SYSTEM_PROMPT = PROMPT_STYLES[DEFAULT_PROMPT_STYLE][0]


def style_system_prompt(style: str) -> str:
    """The system prompt of a prompt style (``gsm8k`` or ``tags``)."""
    return PROMPT_STYLES[_check_style(style)][0]


def style_format_reward(style: str) -> str:
    """The registered name of the reward that checks a prompt style's answer format."""
    return PROMPT_STYLES[_check_style(style)][1]


def detect_prompt_style(prompt: str) -> Optional[str]:
    """The style whose system prompt a built (decoded) prompt contains; None for a custom one."""
    for style, (system_prompt, _) in PROMPT_STYLES.items():
        if system_prompt in prompt:
            return style
    return None


def prompt_style_of_ids(tokenizer, ids) -> Optional[str]:
    """``detect_prompt_style`` of a tokenised prompt (or a whole row that starts with one)."""
    return detect_prompt_style(tokenizer.decode([int(i) for i in ids], skip_special_tokens=False))


def check_format_reward(style: str, reward_funcs, data_source: str) -> None:
    """Refuse another style's format reward: against these prompts it can never score."""
    own = style_format_reward(style)
    wrong = [name for name in reward_funcs
             if name != own and name in {fmt for _, fmt in PROMPT_STYLES.values()}]
    if wrong:
        from mindrlhf.errors import MindRLHFError

        raise MindRLHFError(
            f"reward_funcs has {wrong[0]!r}, but the prompts in {data_source} use prompt style {style!r}, whose "
            f"format reward is {own!r}: set reward_funcs to [accuracy, {own}] or rebuild the data with "
            f"rlhf_data.py --prompt_style {next(s for s, (_, f) in PROMPT_STYLES.items() if f == wrong[0])}")


def _check_style(style: str) -> str:
    if style not in PROMPT_STYLES:
        from mindrlhf.errors import MindRLHFError

        raise MindRLHFError(f"prompt style {style!r}: use one of {', '.join(PROMPT_STYLES)}")
    return style


def extract_gsm8k_solution(answer: str) -> Optional[str]:
    """The final answer after ``####`` with whitespace stripped and thousands commas removed.

    ``"... #### 1,234"`` → ``"1234"``. Returns None when the answer has no ``####`` marker.
    """
    if "####" not in answer:
        return None
    # The last marker wins: the final answer follows it, whatever the reasoning contained.
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def question_answer_row(record: dict) -> dict:
    """A question row with GSM8K's ``question`` / ``answer`` keys: the row itself when it has a question, else
    verl's GSM8K layout (its preprocessing's parquet) mapped onto them: ``question`` from ``extra_info.question``,
    else the last user message of ``prompt``; ``answer`` from ``extra_info.answer`` (GSM8K's worked answer), else
    ``'#### '`` + ``reward_model.ground_truth``. Every question reader (mindrlhf-eval, eval_file, mindrlhf-data)
    reads rows through it, so the same rules hold for every file format."""
    if "question" in record or not isinstance(record.get("prompt"), list):
        return record
    extra = record.get("extra_info") if isinstance(record.get("extra_info"), dict) else {}
    reward_model = record.get("reward_model") if isinstance(record.get("reward_model"), dict) else {}
    out = dict(record)
    question = extra.get("question")
    if not isinstance(question, str):
        users = [m.get("content") for m in record["prompt"] if isinstance(m, dict) and m.get("role") == "user"]
        question = users[-1] if users else None
    if question is not None:
        out["question"] = question
    if "answer" not in record:
        if isinstance(extra.get("answer"), str):
            out["answer"] = extra["answer"]
        elif reward_model.get("ground_truth") is not None:
            out["answer"] = f"#### {reward_model['ground_truth']}"
    return out


def build_prompt(
    question: str,
    tokenizer: "Tokenizer",
    system_prompt: Optional[str] = DEFAULT_SYSTEM_PROMPT,
    use_chat_template: bool = True,
    tools: Optional[Sequence[Dict[str, Any]]] = None,
) -> str:
    """The prompt text for one question.

    With ``use_chat_template`` (default): the tokenizer's chat template over a system message
    (skipped when ``system_prompt`` is empty or None) and the user question, ending with the
    assistant header (``add_generation_prompt=True``), with ``tools`` (JSON schemas) rendered by the
    template as a prompt row's ``tools`` column is. Otherwise the raw question.
    """
    if not use_chat_template:
        if tools:
            raise MindRLHFError("tools are shown to the model by the chat template; drop --no_chat_template")
        return question
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         tools=list(tools) if tools else None)


def strip_calculator_notes(answer: str) -> str:
    """A GSM8K solution without its ``<<48/2=24>>`` calculator annotations (what a model should write)."""
    import re

    return re.sub(r"<<[^>]*>>", "", answer)


def sft_row(question: str, answer: str, style: str = DEFAULT_PROMPT_STYLE) -> dict:
    """One conversational SFT row (TRL's prompt/completion message lists): the style's system prompt and
    the question, answered by the reference solution (calculator notes removed; it ends with
    ``#### <number>``, the ``gsm8k`` style's format)."""
    prompt = [{"role": "system", "content": style_system_prompt(style)}, {"role": "user", "content": question}]
    return {"prompt": prompt, "completion": [{"role": "assistant", "content": strip_calculator_notes(answer)}]}


def final_answer(value: object, dataset_type: str = "gsm8k") -> Tuple[Optional[str], str]:
    """``(solution, why-not)`` of an answer value: the reference the accuracy reward compares with.

    ``gsm8k``: the number after the last ``####`` (a row without one, with nothing after it or with no
    number there has no solution: no completion could match it); other types: the answer itself, stripped.
    A number is read as its text. Shared by the prompt mindrecord converter and the prompt JSONL reader, so
    both hold the same solutions for the same rows.
    """
    from mindrlhf.rewards.answers import parse_number  # lazy: the reward package is not needed to build prompts

    text = str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if not isinstance(text, str):
        return None, f"answer is a {type(value).__name__}, not a string"
    if dataset_type == "gsm8k":
        solution = extract_gsm8k_solution(text)
        if solution is None:
            return None, "answer has no '####' marker"
        if not solution:
            return None, "nothing after '####'"
        if parse_number(solution) is None:  # the accuracy reward compares numbers: no completion could match
            return None, f"final answer {solution!r} after '####' is not a number"
        return solution, ""
    solution = text.strip()  # openr1math / generic: the field already holds the final answer
    return (solution, "") if solution else (None, "answer is empty")

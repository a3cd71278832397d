"""Reward functions, answer extraction, the registry and RewardManager."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

from mindrlhf.errors import MindRLHFError
from mindrlhf.rewards import (
    REWARD_FUNCS,
    RewardManager,
    accuracy_reward,
    boxed_reward,
    extract_answer,
    format_reward,
    get_reward_fn,
    parse_number,
    register_reward,
)


# --- accuracy on GSM8K ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gsm8k_answers(data_dir):
    with open(data_dir / "gsm8k" / "test.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["answer"] for line in f]


def test_accuracy_is_one_on_every_gsm8k_reference(gsm8k_answers):
    numbers = [a.split("####")[-1].strip() for a in gsm8k_answers]
    assert len(gsm8k_answers) == 1319
    # The solution column may be the full answer text or just the number.
    assert accuracy_reward(gsm8k_answers, gsm8k_answers) == [1.0] * len(gsm8k_answers)
    assert accuracy_reward(gsm8k_answers, numbers) == [1.0] * len(gsm8k_answers)


def test_accuracy_is_zero_when_the_final_number_changes(gsm8k_answers):
    wrong = []
    for answer in gsm8k_answers:
        body, final = answer.rsplit("####", 1)
        wrong.append(f"{body}#### {int(parse_number(final)) + 1}")
    # Includes 1,450,000 → 1450001: integers compare exactly, not within the relative tolerance.
    assert accuracy_reward(wrong, gsm8k_answers) == [0.0] * len(gsm8k_answers)


@pytest.mark.parametrize(
    "completion, solution, expected",
    [
        ("So she makes 18.", "18", 1.0),
        ("The total is $1,000", "1000", 1.0),
        ("The total is $1,000.", "#### 1,000", 1.0),
        ("The temperature drops to -3", "-3", 1.0),
        ("The temperature drops to -3", "3", 0.0),
        ("16-3-4=9 eggs", "9", 1.0),  # "-4" here is a subtraction, not a negative number
        ("The answer is \\boxed{42}.", "42", 1.0),
        ("<answer>7</answer>", "7", 1.0),
        ("18.0", "18", 1.0),
        ("3/4", "0.75", 1.0),
        ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
        ("50%", "50", 1.0),
        ("\\boxed{50\\%}", "50", 1.0),
        ("It took 18 minutes", "17", 0.0),
        ("No number at all", "17", 0.0),
        # precedence: <answer> over numbers in the reasoning; \boxed over "####"; "####" over the last number
        ("<think>maybe 99</think><answer>7</answer>", "7", 1.0),
        ("<think>maybe 99</think><answer>The answer is 7 dollars</answer>", "7", 1.0),
        ("<think>7</think><answer>99</answer>", "7", 0.0),
        ("\\boxed{5}\n#### 6", "5", 1.0),
        ("#### 5\nchecked against 6 other ways", "5", 1.0),
        ("\\boxed{x = 12}", "12", 1.0),
        ("\\boxed{12\\text{ apples}}", "12", 1.0),
    ],
)
def test_accuracy_cases(completion, solution, expected):
    assert accuracy_reward([completion], [solution]) == [expected]


def test_accuracy_without_a_solution_is_not_applicable():
    assert accuracy_reward(["42", "42"], [None, "  "]) == [None, None]


def test_accuracy_conversational_completion():
    completion = [{"role": "assistant", "content": "<think>6*7</think><answer>42</answer>"}]
    assert accuracy_reward([completion], ["42"]) == [1.0]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>7</answer>", "7"),
        ("\\boxed{\\frac{1}{2}} and more text 9", "\\frac{1}{2}"),
        ("\\boxed{{3}+{4}} and \\boxed{x}", "x"),
        ("x \\boxed{7", "7"),  # unbalanced box: fall back to the last number
        ("The answer:\n#### 1,234", "1,234"),
        ("It is 5, no, 6.", "6"),
        ("nothing here", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "s, expected",
    [
        ("18.", 18.0),
        ("$1,000", 1000.0),
        ("\\$1{,}000", 1000.0),
        ("-3", -3.0),
        ("\u22123", -3.0),
        ("18.0", 18.0),
        ("3/4", 0.75),
        ("\\frac{3}{4}", 0.75),
        ("-\\frac{3}{4}", -0.75),
        ("50%", 50.0),
        ("{42}", 42.0),
        (".5", 0.5),
        ("1,234,567.25", 1234567.25),
        ("1,00", None),  # not a thousands grouping
        ("1/0", None),
        ("abc", None),
        ("", None),
        (None, None),
        ("inf", None),
    ],
)
def test_parse_number(s, expected):
    assert parse_number(s) == expected


# --- format and boxed ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>6*7=42</think><answer>42</answer>", 1.0),
        ("  <think>\nreasoning\n</think>\n\n<answer>\n42\n</answer>\n", 1.0),
        ("<answer>42</answer>", 0.0),  # no think block
        ("<think>x</think>", 0.0),  # no answer block
        ("<think>x</think><answer>42</answer> Hope this helps!", 0.0),  # trailing text
        ("Sure! <think>x</think><answer>42</answer>", 0.0),  # leading text
        ("<think>x</think> so <answer>42</answer>", 0.0),  # text between
        ("<answer>42</answer><think>x</think>", 0.0),  # wrong order
        ("<think>x</think><answer>4</answer><answer>2</answer>", 0.0),  # two answers
        ("<think>a<think>b</think></think><answer>42</answer>", 0.0),  # nested think
    ],
)
def test_format_reward(completion, expected):
    assert format_reward([completion], solution=["42"]) == [expected]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("so the answer is \\boxed{42}", 1.0),
        ("<think>x</think><answer>\\boxed{42}</answer>", 1.0),
        ("\\boxed{\\frac{1}{2}}", 1.0),
        ("<think>\\boxed{1}</think><answer>42</answer>", 0.0),  # final answer is not the boxed one
        ("the answer is 42", 0.0),
        ("\\boxed{}", 0.0),
        ("\\boxed{42", 0.0),
    ],
)
def test_boxed_reward(completion, expected):
    assert boxed_reward([completion], solution=["42"]) == [expected]


# --- registry ------------------------------------------------------------------------------------
def test_registry_builtins_and_unknown_name():
    assert get_reward_fn("accuracy") is accuracy_reward
    assert get_reward_fn("format") is format_reward
    assert get_reward_fn("boxed") is boxed_reward
    with pytest.raises(MindRLHFError, match=r"unknown reward function 'acurracy'; built-ins: accuracy, boxed, "
                                            r"environment, format, gsm8k_format;"):
        get_reward_fn("acurracy")


def test_registry_user_function_by_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "mindrlhf_test_user_rewards.py").write_text(
        "def length_penalty(completions, solution, **columns):\n"
        "    return [-0.01 * len(c) for c in completions]\n"
        "NOT_A_FUNCTION = 3\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward_fn("mindrlhf_test_user_rewards:length_penalty")
    assert fn(["abcd"], ["1"]) == [pytest.approx(-0.04)]
    assert get_reward_fn("mindrlhf_test_user_rewards.length_penalty") is fn
    total, per_fn = RewardManager(["mindrlhf_test_user_rewards:length_penalty"])(["ab", "abcdef"], ["1", "2"])
    np.testing.assert_allclose(total, [-0.02, -0.06], rtol=1e-6)
    # Logged under the function's __name__, as TRL names reward metrics (rewards/length_penalty/mean).
    assert list(per_fn) == ["length_penalty"]
    with pytest.raises(MindRLHFError, match="no callable 'missing'"):
        get_reward_fn("mindrlhf_test_user_rewards:missing")
    with pytest.raises(MindRLHFError, match="no callable 'NOT_A_FUNCTION'"):
        get_reward_fn("mindrlhf_test_user_rewards:NOT_A_FUNCTION")
    with pytest.raises(MindRLHFError, match="cannot import module 'no_such_pkg_xyz.rewards'.*built-ins: accuracy"):
        get_reward_fn("no_such_pkg_xyz.rewards:fn")


def test_manager_names_are_trl_names_and_a_clash_is_one_error(tmp_path, monkeypatch):
    (tmp_path / "mindrlhf_test_rewards_a.py").write_text(
        "def length_parity(completions, **kw):\n    return [float(len(c) % 2) for c in completions]\n"
        "def accuracy(completions, **kw):\n    return [1.0 for c in completions]\n", encoding="utf-8")
    (tmp_path / "mindrlhf_test_rewards_b.py").write_text(
        "def length_parity(completions, **kw):\n    return [0.0 for c in completions]\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))

    def gsm8k_style(completions, **kwargs):
        return [0.0] * len(completions)

    manager = RewardManager(["accuracy", "mindrlhf_test_rewards_a:length_parity", gsm8k_style])
    assert manager.names == ["accuracy", "length_parity", "gsm8k_style"]
    with pytest.raises(MindRLHFError) as err:
        RewardManager(["mindrlhf_test_rewards_a:length_parity", "mindrlhf_test_rewards_b.length_parity"])
    assert str(err.value) == (
        "reward function 'length_parity' names two functions, 'mindrlhf_test_rewards_a:length_parity' and "
        "'mindrlhf_test_rewards_b.length_parity'; rename one of them (each is logged as rewards/<name>/mean)")
    # A user function named like a built-in clashes with it too.
    with pytest.raises(MindRLHFError, match="'accuracy' names two functions, 'accuracy' and 'mindrlhf_test_rewards_a:"):
        RewardManager(["accuracy", "mindrlhf_test_rewards_a:accuracy"])


def test_register_reward_decorator():
    try:

        @register_reward("test_always_half")
        def always_half(completions, **kwargs):
            return [0.5] * len(completions)

        assert get_reward_fn("test_always_half") is always_half
        with pytest.raises(MindRLHFError, match="already registered"):
            register_reward("test_always_half")(lambda completions, **kw: [])
    finally:
        REWARD_FUNCS.unregister("test_always_half")


# --- RewardManager -------------------------------------------------------------------------------
def test_manager_weights():
    completions = [
        "<think>6*7</think><answer>42</answer>",  # accuracy 1, format 1
        "<think>6*7</think><answer>41</answer>",  # accuracy 0, format 1
        "42",  # accuracy 1, format 0
    ]
    manager = RewardManager(["accuracy", "format"], weights=[1.0, 0.25])
    total, per_fn = manager(completions, ["42", "42", "42"])
    assert total.dtype == np.float32 and total.shape == (3,)
    np.testing.assert_array_equal(per_fn["accuracy"], np.array([1, 0, 1], np.float32))
    np.testing.assert_array_equal(per_fn["format"], np.array([1, 1, 0], np.float32))
    np.testing.assert_allclose(total, [1.25, 0.25, 1.0])
    total, _ = RewardManager(["accuracy", "format"])(completions, ["42"] * 3)  # default weights 1
    np.testing.assert_allclose(total, [2.0, 1.0, 1.0])


def test_manager_none_is_nan_and_all_none_total_is_nan():
    def sometimes(completions, solution, **kw):
        return [None, 1.0, None]

    def never(completions, solution, **kw):
        return [None, None, None]

    manager = RewardManager([sometimes, never], weights=[2.0, 1.0])
    total, per_fn = manager(["a", "b", "c"], ["1", "2", "3"])
    assert np.isnan(per_fn["never"]).all()
    assert np.isnan(per_fn["sometimes"][[0, 2]]).all() and per_fn["sometimes"][1] == 1.0
    assert np.isnan(total[0]) and np.isnan(total[2])
    assert total[1] == 2.0  # NaN terms are skipped, not propagated


def test_manager_stops_on_a_failing_function_by_default():
    def broken(completions, solution, **kw):
        raise ZeroDivisionError("oops")

    with pytest.raises(MindRLHFError, match="reward function 'broken' raised ZeroDivisionError: oops; .*"
                                            "reward_errors: skip") as info:
        RewardManager(["accuracy", broken])(["42"], ["42"])
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    with pytest.raises(MindRLHFError, match="reward_errors='ignore' is not one of raise, skip"):
        RewardManager(["accuracy"], errors="ignore")


def test_non_finite_rewards_are_failures_of_the_function(caplog):
    # An inf used to be trained on: its group's std became NaN and every advantage of the group 0,
    # loss 0, exit 0, without a word. None stays the way to give no score.
    def blows_up(completions, solution, **kw):
        return [1.0, float("inf"), None, float("nan")]

    with pytest.raises(MindRLHFError, match=r"reward function 'blows_up' returned inf for completion 1 \(2 of 4 "
                                            r"non-finite\); return a finite float, or None for no score, or set "
                                            r"reward_errors: skip"):
        RewardManager([blows_up])(list("abcd"), list("1234"))
    manager = RewardManager(["accuracy", blows_up], errors="skip")
    with caplog.at_level(logging.WARNING, logger="mindrlhf.rewards"):
        for _ in range(2):
            total, per_fn = manager(["1", "x", "3", "x"], list("1234"))
    assert per_fn["blows_up"][0] == 1.0 and np.isnan(per_fn["blows_up"][1:]).all()
    np.testing.assert_array_equal(total, [2.0, 0.0, 1.0, 0.0])  # accuracy alone where blows_up gave no score
    assert manager.failures == {"accuracy": 0, "blows_up": 2}
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "'blows_up' returned inf for completion 1 (2 of 4 non-finite)" in warning


def test_manager_calls_functions_with_trl_arguments():
    seen = {}

    def trl_style(prompts, completions, completion_ids, **kwargs):  # TRL's documented signature
        seen.update(prompts=prompts, completion_ids=completion_ids, kwargs=kwargs)
        return [float(len(ids)) for ids in completion_ids]

    total, _ = RewardManager([trl_style])(["ab", "c"], ["1", "2"], prompts=["p0", "p1"], completion_ids=[[5, 6], [7]],
                                          question=["q0", "q1"])
    np.testing.assert_array_equal(total, [2.0, 1.0])
    assert seen == {"prompts": ["p0", "p1"], "completion_ids": [[5, 6], [7]],
                    "kwargs": {"solution": ["1", "2"], "question": ["q0", "q1"]}}
    with pytest.raises(MindRLHFError, match="reward inputs: 1 values of 'prompts' for 2 completions"):
        RewardManager([trl_style])(["ab", "c"], ["1", "2"], prompts=["p0"], completion_ids=[[5, 6], [7]])


def test_manager_skip_mode_scores_none_counts_and_logs_once(caplog):
    def broken(completions, solution, **kw):
        raise ZeroDivisionError("oops")

    manager = RewardManager(["accuracy", broken], weights=[1.0, 3.0], errors="skip")
    with caplog.at_level(logging.WARNING, logger="mindrlhf.rewards"):
        for _ in range(3):
            total, per_fn = manager(["42", "7"], ["42", "42"])
    assert np.isnan(per_fn["broken"]).all()
    np.testing.assert_array_equal(total, [1.0, 0.0])
    assert manager.failures == {"accuracy": 0, "broken": 3}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "broken" in warnings[0].getMessage()
    assert warnings[0].exc_info is not None and warnings[0].exc_info[0] is ZeroDivisionError


def test_manager_wrong_length_and_bad_values_are_errors():
    def too_short(completions, solution, **kw):
        return [1.0]

    def not_a_number(completions, solution, **kw):
        return ["high"] * len(completions)

    with pytest.raises(MindRLHFError, match="reward function 'too_short' returned 1 values for 2 completions"):
        RewardManager([too_short])(["a", "b"], ["1", "2"])
    with pytest.raises(MindRLHFError, match=r"'not_a_number' returned a str \('high'\) for completion 0"):
        RewardManager([not_a_number])(["a", "b"], ["1", "2"])


def test_manager_passes_extra_columns():
    seen = {}

    def uses_columns(completions, solution, question, **kw):
        seen["question"] = question
        return [float(len(q)) for q in question]

    total, _ = RewardManager([uses_columns])(["a", "b"], ["1", "2"], question=["why", "how so"])
    assert seen["question"] == ["why", "how so"]
    np.testing.assert_array_equal(total, [3.0, 6.0])


def test_manager_config_errors():
    with pytest.raises(MindRLHFError, match="2 values for 1 reward funcs"):
        RewardManager(["accuracy"], weights=[1.0, 2.0])
    with pytest.raises(MindRLHFError, match="non-empty list"):
        RewardManager([])
    with pytest.raises(MindRLHFError, match="listed twice"):
        RewardManager(["accuracy", "accuracy"])
    with pytest.raises(MindRLHFError, match="finite"):
        RewardManager(["accuracy"], weights=[math.nan])
    with pytest.raises(MindRLHFError, match="unknown reward function 'nope'"):
        RewardManager(["nope"])


@pytest.mark.parametrize("completion,expected", [
    ("3 + 4 = 7\n#### 7", 1.0),
    ("#### 1,234.\n\n  ", 1.0),           # trailing blank lines are ignored; numbers as the accuracy reward parses them
    ("####7", 1.0),
    ("#### 7\nSo the answer is 7.", 0.0),  # not the last line
    ("the answer is #### 7", 0.0),          # not at the start of the line
    ("#### seven", 0.0),
    ("####", 0.0),
    ("#### 7\n#### 7", 0.0),                # a repeated answer line (a model that never stops)
    ("first #### 1\n#### 2", 0.0),          # more than one ####
    ("####\n#### 2", 0.0),
    ("", 0.0),
])
def test_gsm8k_format_reward(completion, expected):
    from mindrlhf.rewards import get_reward_fn, gsm8k_format_reward

    assert gsm8k_format_reward([completion]) == [expected]
    assert get_reward_fn("gsm8k_format") is gsm8k_format_reward


def test_prompt_styles_pair_prompt_and_reward():
    from mindrlhf.data.gsm8k import DEFAULT_SYSTEM_PROMPT, PROMPT_STYLES, style_format_reward, style_system_prompt
    from mindrlhf.errors import MindRLHFError
    from mindrlhf.rewards import get_reward_fn

    assert style_system_prompt("gsm8k") == DEFAULT_SYSTEM_PROMPT and "####" in DEFAULT_SYSTEM_PROMPT
    assert "<answer>" in style_system_prompt("tags")
    for style in PROMPT_STYLES:
        get_reward_fn(style_format_reward(style))  # every style names a registered reward
    with pytest.raises(MindRLHFError, match="prompt style 'boxed'"):
        style_system_prompt("boxed")


def test_overlong_reward_hand_values():
    from mindrlhf.rewards import overlong_reward

    fn = overlong_reward(max_completion_length=10, buffer_length=4, penalty=0.5)
    assert fn.__name__ == "overlong"
    # punishment starts after 10 - 4 = 6 tokens: 7 → -0.5·1/4, 8 → -0.5·2/4, 10 → -0.5
    lengths = [0, 3, 6, 7, 8, 10]
    assert fn(completion_ids=[[1] * n for n in lengths], completions=[""] * 6) == \
        pytest.approx([0.0, 0.0, 0.0, -0.125, -0.25, -0.5])
    with pytest.raises(ValueError, match="overlong buffer 10 must be in"):
        overlong_reward(10, 10, 1.0)


def test_config_refuses_two_reward_funcs_of_one_name_before_anything_loads():
    from mindrlhf.configs import parse_args

    with pytest.raises(MindRLHFError, match=r"reward_funcs \['a.rewards:length_parity', 'b.more.length_parity'\] are "
                                            r"all named 'length_parity' \(logged as rewards/length_parity/mean"):
        parse_args(["--reward_funcs", "a.rewards:length_parity", "b.more.length_parity"])
    with pytest.raises(MindRLHFError, match=r"reward_funcs \['accuracy', 'my.rewards:accuracy'\] are all named"):
        parse_args(["--reward_funcs", "accuracy", "my.rewards:accuracy"])
    with pytest.raises(MindRLHFError, match="reward_funcs names a function 'overlong'"):
        parse_args(["--overlong_buffer_length", "16", "--reward_funcs", "accuracy", "my.rewards:overlong"])
    assert parse_args(["--reward_funcs", "accuracy", "my.rewards:length_parity"]).reward.reward_funcs == [
        "accuracy", "my.rewards:length_parity"]


# --- answers that are mathematics: math-verify, as TRL's accuracy_reward ------------------------------------------
#: How TRL 1.16's accuracy_reward scores 26 tricky (solution, completion) pairs (tests/make_trl_accuracy_reference.py,
#: run in TRL's virtualenv with math-verify).
TRL_ACCURACY = json.loads((Path(__file__).resolve().parent / "data" / "trl_accuracy_reference.json").read_text())


@pytest.mark.parametrize("name", sorted(TRL_ACCURACY["cases"]))
def test_accuracy_scores_tricky_answers_as_trl(name):
    """Equivalent fractions and roots, LaTeX spellings, sets, intervals, expressions, units, percentages and infinity
    score as TRL's accuracy_reward scores them (its boxed-first LaTeX extraction: a bare number or an unbraced
    \\frac34 is no answer to a mathematical solution)."""
    case = TRL_ACCURACY["cases"][name]
    assert accuracy_reward([case["completion"]], [case["solution"]]) == [case["trl"]]


def test_math_verify_is_asked_only_for_solutions_that_are_not_numbers(gsm8k_answers):
    """GSM8K's answers and plain numbers keep the number path (math-verify is never called for them); LaTeX
    mathematics goes to math-verify, a finite number in LaTeX or text stays a number."""
    from mindrlhf.rewards.builtin import math_gold

    assert not any(math_gold(a) is not None for a in gsm8k_answers[:200])
    assert not any(math_gold(s) is not None for s in ("18", "1,450,000", "$5$", "The answer is 18", "-3.5"))
    assert all(math_gold(s) is not None for s in ("$\\sqrt{2}$", "$\\{1,2\\}$", "$[0,1)$", "$\\pi$", "$10\\%$"))

"""Inputs that trained on nothing (or on something else) without a word, each reproduced as
the user met it: GRPO rewards of 0 and 1e30 (reward_std logged inf), a reward function returning strings
(coerced to numbers), preference pairs whose chosen equals rejected (kept), and conversations with a role no
chat template knows (trained; Qwen2.5's template silently drops the message)."""
from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

from grpo_runs import grpo_args, read_rows, run_inprocess
from mindrlhf.data import read_pair_rows, read_sft_rows
from mindrlhf.errors import MindRLHFError
from mindrlhf.rewards import RewardManager
from mindrlhf.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(qwen_tokenizer_dir)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _user(text):
    return [{"role": "user", "content": text}]


def _assistant(text):
    return [{"role": "assistant", "content": text}]


# ---------------------------------------------------------------------------------------------- huge rewards
@pytest.mark.slow
def test_rewards_of_0_and_1e30_train_as_rewards_of_0_and_1(grpo_assets, tmp_path):
    """Rewards of 0 and 1e30 are finite float32 numbers, and the advantages (float64 on the host) were right, but
    reward_std was computed in float32, whose square of 1e30 overflows: logged inf every step. Now every reward
    statistic is float64: reward_std is 1e30 times that of rewards 0 and 1, and the step trains as theirs."""
    runs = {}
    for name in ("unit_reward", "huge_reward"):
        out = tmp_path / name
        assert run_inprocess(grpo_args(grpo_assets, out, max_steps=1, max_completion_length=4, tensorboard="false",
                                       reward_funcs=[f"e2e_rewards:{name}"])) == 0
        (row,) = read_rows(out)
        dump = [json.loads(line) for line in (out / "completions_step_1.jsonl").read_text().splitlines()]
        runs[name] = row, np.array([d["advantage"] for d in dump])
    (unit, unit_adv), (huge, huge_adv) = runs["unit_reward"], runs["huge_reward"]
    assert math.isfinite(huge["reward_std"]) and huge["reward_std"] == pytest.approx(1e30 * unit["reward_std"],
                                                                                      rel=1e-6)
    assert huge["reward"] == pytest.approx(1e30 * unit["reward"], rel=1e-6)
    assert huge["rewards/huge_reward/std"] == pytest.approx(1e30 * unit["rewards/unit_reward/std"], rel=1e-6)
    np.testing.assert_allclose(huge_adv, unit_adv, rtol=1e-5)
    assert np.abs(unit_adv).min() > 0.5  # every completion has a real advantage (G = 4: ±0.866)
    assert huge["grad_norm"] == pytest.approx(unit["grad_norm"], rel=1e-4) and huge["grad_norm"] > 0


# ---------------------------------------------------------------------------------------------- reward values
@pytest.mark.slow
def test_a_reward_function_returning_strings_stops_grpo_in_one_line(grpo_assets, tmp_path, capsys):
    """"0.1" used to be float()-ed into a reward; TRL refuses it, and so does the reward-failure path now."""
    capsys.readouterr()
    assert run_inprocess(grpo_args(grpo_assets, tmp_path / "run", max_steps=1, max_completion_length=4,
                                   reward_funcs=["e2e_rewards:string_reward"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[-1].startswith("error: reward function 'e2e_rewards:string_reward' returned a str ('")
    assert err[-1].endswith("for completion 0 (8 of 8 not numbers); return a float, int or bool (as TRL), or None "
                            "for no score, or set reward_errors: skip to score such values None and train on")


def test_reward_values_are_what_trl_accepts(caplog):
    """TRL's GRPOTrainer takes numbers (float, int, bool, numpy scalars) and None; anything else (a string, a list)
    is a failure of the function under reward_errors, named with the value's type; values beyond float32's range,
    and weighted sums beyond it, too."""
    def mixed(completions, **kw):
        return [True, 2, np.float64(0.5), np.int32(3), None, False]

    total, per_fn = RewardManager([mixed])(list("abcdef"), list("123456"))
    np.testing.assert_array_equal(per_fn["mixed"], [1.0, 2.0, 0.5, 3.0, np.nan, 0.0])

    def strings(completions, **kw):
        return ["0.5", 1.0, b"2"]

    with pytest.raises(MindRLHFError, match=r"^reward function 'strings' returned a str \('0.5'\) for completion 0 "
                                            r"\(2 of 3 not numbers\); return a float, int or bool \(as TRL\), or None "
                                            r"for no score, or set reward_errors: skip"):
        RewardManager([strings])(list("abc"), list("123"))

    def listed(completions, **kw):
        return [[1.0], 1.0, 1.0]

    with pytest.raises(MindRLHFError, match=r"returned a list \(\[1.0\]\) for completion 0 \(1 of 3 not numbers\)"):
        RewardManager([listed])(list("abc"), list("123"))

    def too_big(completions, **kw):
        return [1e39, 1.0, 0.0]

    with pytest.raises(MindRLHFError, match=r"'too_big' returned 1e\+39 for completion 0 \(1 of 3 beyond float32's "
                                            r"range\); scale the reward down"):
        RewardManager([too_big])(list("abc"), list("123"))

    def big(completions, **kw):
        return [3e38, 1.0, None]

    def bigger(completions, **kw):
        return [2e38, 2.0, 1.0]

    with pytest.raises(MindRLHFError, match=r"^reward function 'big' made the weighted reward 5e\+38 for completion 0 "
                                            r"\(1 of 3 beyond float32's range; weighted terms: 'big' 3e\+38, 'bigger' "
                                            r"2e\+38\); scale the rewards or reward_weights down"):
        RewardManager([big, bigger])(list("abc"), list("123"))

    # skip: those values score None (the sample keeps the other functions' terms), counted, the first one logged
    manager = RewardManager(["accuracy", strings, big, bigger], errors="skip")
    with caplog.at_level(logging.WARNING, logger="mindrlhf.rewards"):
        total, per_fn = manager(["1", "x", "3"], list("123"))
    assert np.isnan(per_fn["strings"]).tolist() == [True, False, True]
    assert np.isnan(total[0]) and total[1] == pytest.approx(1.0 + 1.0 + 2.0) and total[2] == pytest.approx(1.0 + 1.0)
    assert manager.failures == {"accuracy": 0, "strings": 1, "big": 1, "bigger": 0}
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 2 and "returned a str ('0.5') for completion 0 (2 of 3 not numbers)" in said[0]
    assert "'big' made the weighted reward 5e+38 for completion 0 (1 of 3 beyond float32's range; weighted terms: " \
           "'accuracy' 1, 'big' 3e+38, 'bigger' 2e+38)" in said[1]


# ---------------------------------------------------------------------------------------------- identical pairs
def test_pairs_whose_chosen_equals_rejected_are_skipped_and_counted(tmp_path, tok):
    """A pair of equal sides has no preference gradient (float noise, which Adam normalises, moved the weights):
    skipped as identical_pair in every pair format, after tokenisation and the cut to max_length."""
    answer = " The answer is 4."
    rows = [{"prompt": "What is 2+2?", "chosen": answer, "rejected": " It is 5."},                    # 1 kept
            {"prompt": "What is 2+2?", "chosen": answer, "rejected": answer},                          # 2 identical
            {"prompt": "Q?", "pos_answers": [" a", " b"], "neg_answers": [" c", " b"]},               # 3 ReaL
            {"prompt": _user("2+2?"), "chosen": _assistant("4"), "rejected": _assistant("4")}]         # 4 chat
    pairs, report = read_pair_rows(_jsonl(tmp_path / "p.jsonl", rows[:2]), tok, max_length=64, show_progress=False)
    assert pairs.lines == [1] and [(s.line, s.reason) for s in report.skipped] == [(2, "identical_pair")]
    assert str(report.skipped[0]).endswith(": skipped (chosen equals rejected): chosen and rejected are the same "
                                           f"{len(tok.encode(answer)) + 1} tokens")
    assert report.summary().endswith("1 kept (1 pairs), 1 skipped (chosen equals rejected: 1)")
    real, report = read_pair_rows(_jsonl(tmp_path / "r.jsonl", rows[2:3]), tok, max_length=64, show_progress=False)
    assert real.lines == [1] and [tok.decode(c) for c in real.chosen_ids] == [" a"]  # pair 1 (" b" twice) skipped
    assert [(s.line, s.reason, s.detail[:8]) for s in report.skipped] == [(1, "identical_pair", "pair 1: ")]
    chat = rows[3:4] + [{"prompt": _user("2+2?"), "chosen": _assistant("4"), "rejected": _assistant("5")}]
    chat, report = read_pair_rows(_jsonl(tmp_path / "c.jsonl", chat), tok, max_length=64, show_progress=False)
    assert chat.lines == [2] and [(s.line, s.reason) for s in report.skipped] == [(1, "identical_pair")]
    # Two answers that differ only past max_length are the same tokens after DPO's cut.
    long = [{"prompt": "List:", "chosen": " a b c d e f", "rejected": " a b c d x y"},
            {"prompt": "List:", "chosen": " a b x", "rejected": " a b y"}]
    path = _jsonl(tmp_path / "l.jsonl", long)
    cut, report = read_pair_rows(path, tok, max_length=len(tok.encode("List: a b c")), show_progress=False)
    assert cut.lines == [2] and [(s.line, s.reason) for s in report.skipped] == [(1, "identical_pair")]
    assert report.skipped[0].detail.endswith("after the cut to max_length")
    kept, report = read_pair_rows(path, tok, max_length=64, show_progress=False)
    assert kept.lines == [1, 2] and not report.skipped


# ---------------------------------------------------------------------------------------------- roles
def test_a_message_with_an_unknown_role_is_a_bad_row_in_every_reader(tmp_path, tok):
    """Qwen2.5's chat template drops a message whose role it does not know, so a 'wizard' turn was trained as a
    conversation without it. Roles are system, user, assistant and tool; anything else is unknown_role."""
    wizard = {"role": "wizard", "content": "abracadabra"}
    assert "abracadabra" not in tok.apply_chat_template(_user("hi") + [wizard], add_generation_prompt=False)
    tool_call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]}
    sft = [{"messages": _user("2+2?") + _assistant("4")},
           {"messages": _user("2+2?") + [wizard] + _assistant("4")},
           {"messages": [{"role": "system", "content": "Be brief."}] + _user("2+2?") + [tool_call]
            + [{"role": "tool", "content": "4"}] + _assistant("4")},
           {"messages": [{"role": "User", "content": "2+2?"}] + _assistant("4")}]
    rows, report = read_sft_rows(_jsonl(tmp_path / "m.jsonl", sft), tok, max_length=256, show_progress=False)
    assert rows.lines == [1, 3]
    assert [(s.line, s.reason) for s in report.skipped] == [(2, "unknown_role"), (4, "unknown_role")]
    assert str(report.skipped[0]).endswith(": skipped (unknown message role): 'messages'[1] has role 'wizard'; a "
                                           "chat template knows system, user, assistant, tool")
    prompt_completion = [{"prompt": _user("2+2?"), "completion": _assistant("4")},
                         {"prompt": [wizard] + _user("2+2?"), "completion": _assistant("4")}]
    rows, report = read_sft_rows(_jsonl(tmp_path / "pc.jsonl", prompt_completion), tok, max_length=256,
                                 show_progress=False)
    assert rows.lines == [1] and [(s.line, s.reason) for s in report.skipped] == [(2, "unknown_role")]
    pairs = [{"prompt": _user("2+2?"), "chosen": _assistant("4"), "rejected": _assistant("5")},
             {"prompt": _user("2+2?"), "chosen": _assistant("4"), "rejected": [dict(wizard, content="5")]}]
    implicit = [{"chosen": _user("2+2?") + _assistant("4"), "rejected": _user("2+2?") + _assistant("5")},
                {"chosen": _user("2+2?") + _assistant("4"), "rejected": _user("2+2?") + [wizard]}]
    for name, rows in (("explicit", pairs), ("implicit", implicit)):
        got, report = read_pair_rows(_jsonl(tmp_path / f"{name}.jsonl", rows), tok, max_length=256,
                                     show_progress=False)
        assert got.lines == [1] and [(s.line, s.reason) for s in report.skipped] == [(2, "unknown_role")], name

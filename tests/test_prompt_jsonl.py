"""Prompts from JSONL for the RL stages (GRPO, PPO): ReaL's ``{"prompt": text}`` rows and TRL's prompt-only rows
(a text or a conversation), their other keys passed to the reward functions as dataset columns; and a PPO critic
exported to an HF ``*ForSequenceClassification`` directory."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

from grpo_runs import grpo_args, is_timing, read_rows, run_cli
from mindrlhf.data import build_prompt, read_prompt_rows
from mindrlhf.data.gsm8k import DEFAULT_SYSTEM_PROMPT, extract_gsm8k_solution
from mindrlhf.data.text_rows import NO_SOLUTION_WARNING
from mindrlhf.errors import MindRLHFError
from mindrlhf.tokenizer import Tokenizer

GSM8K_ROWS = 16  # grpo_assets' mindrecord: the first 16 rows of tests/data/gsm8k/test.jsonl


def _gsm8k(data_dir: Path, n: int = GSM8K_ROWS) -> list:
    return [json.loads(line) for line in (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[:n]]


def _messages(question: str) -> list:
    """The conversation rlhf_data builds for a question (build_prompt: system prompt, then the question)."""
    return [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": question}]


def _write(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory, grpo_assets, data_dir) -> dict:
    """The mindrecord's 16 GSM8K rows as a ReaL text-prompt JSONL (the prompt rendered as the mindrecord holds it)
    and as a TRL conversational-prompt JSONL (the same system and user messages), each with the GSM8K answer as
    its ``answer`` column."""
    root = tmp_path_factory.mktemp("prompt_jsonl")
    tok = Tokenizer.from_dir(grpo_assets["model"])
    rows = _gsm8k(data_dir)
    real = _write(root / "real.jsonl", [{"prompt": build_prompt(r["question"], tok), "answer": r["answer"]}
                                        for r in rows])
    trl = _write(root / "trl.jsonl", [{"prompt": _messages(r["question"]), "answer": r["answer"]} for r in rows])
    return {"real": real, "trl": trl, "rows": rows}


# -- the reader ---------------------------------------------------------------------------------------
def test_both_forms_give_the_mindrecords_prompts_and_solutions(grpo_assets, prompt_files):
    """A text prompt is tokenised as it is and a conversation through the chat template with its generation
    prompt: both are the ids the mindrecord holds; the solutions are its final answers, the other keys columns."""
    from mindrlhf.data import PromptDataset

    tok = Tokenizer.from_dir(grpo_assets["model"])
    mind = PromptDataset(grpo_assets["data"], batch_size=1)
    for form in ("real", "trl"):
        rows, report = read_prompt_rows(prompt_files[form], tok, max_prompt_length=256, show_progress=False)
        assert (report.rows_read, report.rows_written, report.skipped) == (16, 16, [])
        assert len(rows) == mind.num_rows == 16
        for i, ids in enumerate(rows.prompt_ids):
            np.testing.assert_array_equal(ids, mind.prompt_ids[i, :mind.prompt_length[i]], err_msg=f"{form} {i}")
        assert rows.solutions == list(mind.solution)
        assert rows.columns["answer"] == [r["answer"] for r in prompt_files["rows"]]
    assert rows.columns["question"] == list(mind.question)  # a conversation's question: its last user message


def test_columns_pass_as_given_and_missing_keys_are_none(tmp_path, qwen_tokenizer_dir):
    """Every key but the prompt is a column (TRL's rule), None where a row lacks it; ``solution`` is taken as
    given, else from ``answer`` (GSM8K's '####' number, or the answer itself); a row without either is counted."""
    tok = Tokenizer.from_dir(qwen_tokenizer_dir)
    path = _write(tmp_path / "p.jsonl", [
        {"prompt": "What is 2+2?", "answer": "2 and 2 make 4.\n#### 4", "ground_truth": [4], "completion": "x"},
        {"prompt": "Name a colour.", "solution": "red", "answer": "#### 7", "index": 3},
        {"prompt": "Say hi.", "answer": 12},
        {"prompt": "Tell a joke."},
    ])
    rows, report = read_prompt_rows(path, tok, max_prompt_length=64, show_progress=False)
    assert rows.solutions == ["4", "red", "12", None]
    assert rows.columns == {"answer": ["2 and 2 make 4.\n#### 4", "#### 7", 12, None],
                            "ground_truth": [[4], None, None, None], "question": ["What is 2+2?", "Name a colour.",
                                                                                   "Say hi.", "Tell a joke."],
                            "index": [None, 3, None, None]}
    assert report.warnings == {NO_SOLUTION_WARNING: 1}
    assert rows.prompt_ids[0].tolist() == tok.encode("What is 2+2?", add_special_tokens=True)


def test_bad_rows_are_skipped_and_named(tmp_path, qwen_tokenizer_dir):
    """Each bad row is skipped with its file, line and reason (the other readers' rules, their message check
    included); a prompt longer than max_prompt_length is skipped, never cut."""
    tok = Tokenizer.from_dir(qwen_tokenizer_dir)
    good = {"prompt": [{"role": "user", "content": "What is 2+2?"}], "answer": "#### 4"}
    path = _write(tmp_path / "p.jsonl", [
        good, "{not json", "[1, 2]", {"question": "no prompt"}, {"prompt": 7}, {"prompt": []},
        {"prompt": [{"content": "no role"}]}, {"prompt": [{"role": "user", "content": "x " * 80}]},
        {"prompt": [{"role": "user", "content": "q"}], "answer": "#### seven"}, {"prompt": "a text row"},
        {"prompt": [{"role": "user", "content": "q"}], "completions": 1}, "", good,
    ])
    rows, report = read_prompt_rows(path, tok, max_prompt_length=40, show_progress=False)
    assert rows.lines == [1, 13] and len(rows) == 2
    named = [str(row) for row in report.skipped]
    assert [(row.line, row.reason) for row in report.skipped] == [
        (2, "malformed_json"), (3, "not_an_object"), (4, "missing_field"), (5, "wrong_type"), (6, "wrong_type"),
        (7, "wrong_type"), (8, "prompt_too_long"), (9, "no_final_answer"), (10, "mixed_format"), (11, "wrong_type")]
    assert named[6].startswith(f"{path}:8: skipped (prompt too long): ") and "> max_prompt_length 40" in named[6]
    assert named[7] == (f"{path}:9: skipped (no final answer): 'answer': final answer 'seven' after '####' is not "
                        "a number")
    assert "conversational file" in named[8] and "'completions'" in named[9]
    assert report.summary().startswith(f"{path}: 12 rows read, 2 kept, 10 skipped (malformed JSON: 1, ")
    with pytest.raises(MindRLHFError, match=r"p\.jsonl:2: malformed JSON: "):
        read_prompt_rows(path, tok, max_prompt_length=40, strict=True, show_progress=False)


def test_a_file_of_only_bad_rows_is_a_one_line_error(tmp_path, qwen_tokenizer_dir, grpo_assets, capsys):
    """The reader raises one error naming the file and its summary; ``mindrlhf-grpo`` and ``mindrlhf-ppo`` print it
    as one line and exit 2."""
    from mindrlhf import grpo, ppo

    path = _write(tmp_path / "bad.jsonl", [{"question": "q"}, "{oops", {"prompt": ""}])
    with pytest.raises(MindRLHFError) as err:
        read_prompt_rows(path, Tokenizer.from_dir(qwen_tokenizer_dir), max_prompt_length=64, show_progress=False)
    assert str(err.value).startswith(f"no usable rows in {path} ({path}: 3 rows read, 0 kept, 3 skipped")
    for main, model in ((grpo.main, "sft_path_train"), (ppo.main, "model")):
        code = main([f"--{model}", str(grpo_assets["model"]), "--train_file", str(path),
                     "--output_dir", str(tmp_path / "out"), "--max_prompt_length", "256"])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and lines[-1].startswith(f"error: no usable rows in {path}"), lines
        assert not any("Traceback" in line for line in lines)


def test_the_stages_name_the_skipped_rows(tmp_path, grpo_assets, prompt_files, caplog):
    """A run's prompt file with bad rows: each skipped row is logged with its file:line and reason, then the
    summary; the dataset holds the good rows."""
    from mindrlhf.configs import parse_args
    from mindrlhf.models.config import DecoderConfig
    from mindrlhf.parallel.groups import init_run_layout
    from mindrlhf.parallel.layout import ParallelLayout
    from mindrlhf.trainer.sampling import load_prompt_dataset

    lines = prompt_files["trl"].read_text().splitlines()[:4]
    path = _write(tmp_path / "p.jsonl", [lines[0], "{oops", lines[1], {"prompt": 3}, lines[2], lines[3]])
    cfg = parse_args(["--train_file", str(path), "--max_prompt_length", "256", "--output_dir", str(tmp_path / "o")])
    layout = init_run_layout(ParallelLayout(dp=1), ParallelLayout(dp=1), 0, 1)
    tok = Tokenizer.from_dir(grpo_assets["model"])
    config = DecoderConfig.from_hf_dict(json.loads((grpo_assets["model"] / "config.json").read_text()))
    with caplog.at_level(logging.INFO, logger="mindrlhf"):
        dataset = load_prompt_dataset(cfg, layout, tok, config, batch_size=2)
    assert dataset.num_rows == 4 and dataset.solution == [extract_gsm8k_solution(r["answer"])
                                                          for r in prompt_files["rows"][:4]]
    assert dataset.report.rows_written == 4 and [row.line for row in dataset.report.skipped] == [2, 4]
    logged = [r.getMessage() for r in caplog.records]
    assert f"{path}:2: skipped (malformed JSON): Expecting property name enclosed in double quotes: line 1 column 2 " \
           "(char 1)" in logged
    assert (f"{path}:4: skipped (wrongly typed field): 'prompt' must be a string or a list of messages, "
            "not int") in logged
    assert f"train_file: {path}: 6 rows read, 4 kept, 2 skipped (malformed JSON: 1, wrongly typed field: 1)" in logged


def test_a_prompt_file_is_jsonl_by_its_name_or_first_byte(tmp_path, grpo_assets):
    """``.jsonl`` / ``.json`` names, or a first byte ``{`` (after a BOM or blank lines), are JSON lines; a
    mindrecord (its binary header) and a missing file of another name go to the mindrecord reader."""
    from mindrlhf.trainer.sampling import prompt_file_format

    text = tmp_path / "prompts.txt"
    text.write_text('\ufeff\n{"prompt": "x"}\n', encoding="utf-8")
    assert prompt_file_format(str(text)) == prompt_file_format(str(tmp_path / "missing.jsonl")) == "jsonl"
    assert prompt_file_format(str(tmp_path / "rows.JSON")) == "jsonl"
    assert prompt_file_format(str(grpo_assets["data"])) == prompt_file_format(str(tmp_path / "missing.mr")) \
        == "mindrecord"


# -- the stages ---------------------------------------------------------------------------------------
def _first_rows(out: Path) -> dict:
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1]
    return {k: v for k, v in rows[0].items() if not is_timing(k)}


def _columns_seen(path: Path, answers: list) -> None:
    """The reward functions got the file's ``answer`` column as written and the solutions of the mindrecord."""
    calls = [json.loads(line) for line in path.read_text().splitlines()]
    assert calls, "record_columns_reward was never called"
    for call in calls:
        assert {"answer", "question"} <= set(call["names"])
        assert call["answer"] and all(a in answers for a in call["answer"])
        assert call["solution"] == [extract_gsm8k_solution(a) for a in call["answer"]]


def _columns_env(seen: Path) -> dict:
    """A child run's environment additions: tests/ importable (the reward function's module, given by dotted
    path) and the file record_columns_reward appends to."""
    import os

    from grpo_runs import REPO

    path = os.pathsep.join(p for p in (str(REPO / "tests"), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "MINDRLHF_TEST_COLUMNS": str(seen)}


GRPO_REWARDS = ["accuracy", "gsm8k_format", "e2e_rewards:record_columns_reward"]


@pytest.mark.slow
def test_grpo_trains_from_a_prompt_jsonl_as_from_the_mindrecord(grpo_assets, prompt_files, tmp_path):
    """``mindrlhf-grpo --train_file`` (the new alias) with a TRL conversational prompt file: step 1's metrics are
    identical to the mindrecord's of the same rows, and the ``answer`` column reaches the reward functions (the
    accuracy reward reads its final number). (The ReaL text form gives the same ids through the same reader:
    test_both_forms_give_the_mindrecords_prompts_and_solutions; one jsonl run keeps CI short.)"""
    answers = [r["answer"] for r in prompt_files["rows"]]
    runs = {}
    for form, data in (("mindrecord", grpo_assets["data"]), ("trl", prompt_files["trl"])):
        out, seen = tmp_path / form, tmp_path / f"{form}.columns.jsonl"
        argv = grpo_args(grpo_assets, out, max_steps=1, reward_funcs=GRPO_REWARDS)
        argv[argv.index("--mind_dataset_dir"):argv.index("--mind_dataset_dir") + 2] = ["--train_file", str(data)]
        proc = run_cli(argv, env_extra=_columns_env(seen), timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[form] = _first_rows(out)
        if form != "mindrecord":
            _columns_seen(seen, answers)
            assert "train_file: " in proc.stderr and "16 rows read, 16 kept, 0 skipped" in proc.stderr
    assert "rewards/accuracy/mean" in runs["mindrecord"]
    assert runs["trl"] == runs["mindrecord"]


def _ppo(assets, out: Path, data: Path, seen: Path, **extra):
    import os
    import subprocess
    import sys

    from grpo_runs import REPO, SUITE_RECOMPUTE

    args = {"model": assets["model"], "reward_model": assets["rm"], "train_file": data, "output_dir": out,
            "batch_size": 4, "max_new_tokens": 12, "max_prompt_length": 256, "max_steps": 1, "save_steps": 1,
            "lr": 1e-3, "temperature": 1.0, "ppo_epochs": 2, "num_mini_batches": 2, "micro_batch_size": 1,
            "reward_funcs": "accuracy", "progress_bar": "false", "lr_schedule": "constant", **SUITE_RECOMPUTE,
            **extra}
    argv = [x for k, v in args.items() for x in (f"--{k}", str(v))]
    argv[argv.index("accuracy") + 1:argv.index("accuracy") + 1] = ["e2e_rewards:record_columns_reward"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **_columns_env(seen))
    return subprocess.run([sys.executable, "-m", "mindrlhf.ppo", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.fixture(scope="module")
def ppo_runs(grpo_assets, prompt_files, tmp_path_factory) -> dict:
    """One PPO step from the mindrecord and the TRL file (``--train_file``), with a tiny reward model as the reward
    model and the critic (the ReaL form reads through the same reader: GRPO's note above)."""
    from mindrlhf.testing import add_tokenizer, make_tiny_reward_model

    root = tmp_path_factory.mktemp("ppo_jsonl")
    rm = make_tiny_reward_model(root / "rm", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=1024, seed=7)
    assets = {**grpo_assets, "rm": add_tokenizer(rm, grpo_assets["model"])}
    runs = {}
    for form, data in (("mindrecord", grpo_assets["data"]), ("trl", prompt_files["trl"])):
        out, seen = root / form, root / f"{form}.columns.jsonl"
        proc = _ppo(assets, out, data, seen)
        runs[form] = {"out": out, "seen": seen, "proc": proc}
    # No reward model: the critic is the actor's causal LM body with a new score head (its config.json has none).
    out, seen = root / "actor_critic", root / "actor_critic.columns.jsonl"
    runs["actor_critic"] = {"out": out, "seen": seen, "proc": _ppo(assets, out, prompt_files["trl"], seen,
                                                                    reward_model="", kl_coef=0.0)}
    return runs


@pytest.mark.slow
def test_ppo_trains_from_a_prompt_jsonl_as_from_the_mindrecord(ppo_runs, prompt_files):
    """``mindrlhf-ppo --train_file prompts.jsonl`` trains (it said the mindrecord index was missing): a TRL prompt
    file gives step 1's metrics of the mindrecord exactly, and the ``answer`` column reaches the reward functions."""
    forms = ("mindrecord", "trl")
    for form in forms:
        assert ppo_runs[form]["proc"].returncode == 0, (form, ppo_runs[form]["proc"].stderr[-3000:])
    first = {form: _first_rows(ppo_runs[form]["out"]) for form in forms}
    assert "rewards/accuracy/mean" in first["mindrecord"]
    assert first["trl"] == first["mindrecord"]
    _columns_seen(ppo_runs["trl"]["seen"], [r["answer"] for r in prompt_files["rows"]])


@pytest.mark.slow
@pytest.mark.parametrize("run_name", ["trl", "actor_critic"], ids=["critic_from_reward_model", "critic_from_actor"])
def test_ppo_critic_exports_as_a_sequence_classifier(ppo_runs, tmp_path, run_name):
    """``convert_weight --reverse`` on a PPO checkpoint's critic.ckpt writes an HF Qwen2ForSequenceClassification
    directory (from critic.config.json beside it) that transformers loads with our critic's scores (≤1e-4), whether
    the critic started from the reward model or from the actor with a new score head."""
    from grpo_runs import check_score_export
    from mindrlhf.checkpoint.manager import CheckpointManager
    from mindrlhf.models import load_model

    run = ppo_runs[run_name]
    assert run["proc"].returncode == 0, run["proc"].stderr[-3000:]
    step, checkpoint = CheckpointManager(str(run["out"] / "checkpoints")).latest_complete()
    assert step == 1
    critic = load_model(checkpoint / "critic.ckpt")
    assert critic.config.num_labels == 1
    check_score_export(checkpoint / "critic.ckpt", critic, tmp_path / "critic_hf", seed=3)


@pytest.mark.slow
def test_grpo_trains_on_math_style_prompts_checked_by_math_verify(grpo_assets, tmp_path):
    """A MATH-style prompt file (LaTeX solutions: roots, sets, intervals) trains: the solutions reach the accuracy
    reward as written, and each dumped completion's accuracy is math-verify's verdict on it (rewards.math_gold)."""
    from mindrlhf.rewards import accuracy_reward
    from mindrlhf.rewards.builtin import math_gold

    problems = [("Simplify $\\sqrt{8}/2$.", "$\\sqrt{2}$"), ("List the divisors of 6 below 4.", "$\\{1,2,3\\}$"),
                ("Solve $x^2 < 1$.", "$(-1, 1)$"), ("Expand $(x+1)^2$.", "$x^2+2x+1$")]
    rows = [{"prompt": [{"role": "user", "content": q + " Put the answer in \\boxed{}."}], "solution": s}
            for q, s in problems]
    data = _write(tmp_path / "math.jsonl", rows)
    out = tmp_path / "run"
    argv = grpo_args(grpo_assets, out, max_steps=1, num_generations=2, reward_funcs=["accuracy", "boxed"])
    argv[argv.index("--mind_dataset_dir"):argv.index("--mind_dataset_dir") + 2] = ["--train_file", str(data)]
    proc = run_cli(argv, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dumped = [json.loads(line) for line in (out / "completions_step_1.jsonl").read_text().splitlines()]
    assert {r["solution"] for r in dumped} <= {s for _, s in problems} and dumped
    assert all(math_gold(r["solution"]) is not None for r in dumped)
    assert [r["rewards"]["accuracy"] for r in dumped] == accuracy_reward([r["completion"] for r in dumped],
                                                                         [r["solution"] for r in dumped])
    assert math.isfinite(read_rows(out)[0]["rewards/accuracy/mean"])

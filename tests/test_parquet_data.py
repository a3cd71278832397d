"""Data files beside JSONL: parquet files (verl's GSM8K layout) and ``datasets.save_to_disk`` folders, read by the
same row readers with the same bad-row rules (``mindrlhf.data.row_files``). Every file here is written with pyarrow
in the test (the folder in save_to_disk's layout: Arrow IPC stream shards, state.json, dataset_info.json), so
``datasets`` is not needed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_runs import REPO, SUITE_RECOMPUTE, byhand_only, grpo_args, launch_env, read_rows
from mindrlhf.data import read_pair_rows, read_prompt_rows, read_sft_rows
from mindrlhf.data.gsm8k import extract_gsm8k_solution
from mindrlhf.errors import MindRLHFError
from mindrlhf.tokenizer import Tokenizer

VERL_INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'


def write_jsonl(path: Path, rows: List[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: List[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_saved(folder: Path, rows: List[dict], shards: int = 2) -> Path:
    """``rows`` as ``Dataset.save_to_disk`` lays them out: ``data-0000i-of-0000n.arrow`` Arrow IPC streams (listed
    in state.json's ``_data_files``, in row order), dataset_info.json and state.json."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    size = -(-len(rows) // shards)
    names = []
    for i in range(shards):
        names.append(f"data-{i:05d}-of-{shards:05d}.arrow")
        with pa.OSFile(str(folder / names[-1]), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(i * size, size), max_chunksize=2)
    (folder / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": {}}))
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                   "_fingerprint": "0", "_format_type": None, "_split": None}))
    return folder


def verl_gsm8k_rows(data_dir: Path, n: int, split: str = "train") -> List[dict]:
    """Rows in the layout verl's examples/data_preprocess/gsm8k.py writes to train.parquet (the question with its
    instruction as a one-message prompt; the final number as reward_model.ground_truth), plus a conversational
    ``completion`` (the GSM8K answer) so SFT can train on the same file."""
    rows = [json.loads(line) for line in (data_dir / "gsm8k" / f"{split}.jsonl").read_text().splitlines()[:n]]
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": r["question"] + VERL_INSTRUCTION}],
             "completion": [{"role": "assistant", "content": r["answer"]}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": extract_gsm8k_solution(r["answer"])},
             "extra_info": {"split": split, "index": i, "answer": r["answer"], "question": r["question"]}}
            for i, r in enumerate(rows)]


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(qwen_tokenizer_dir)


def _same(a, b) -> None:
    """Two reader outputs (SFTRows / PairRows / PromptRows) hold the same values, field by field."""
    assert type(a) is type(b)
    for name, value in vars(a).items():
        if name == "source":
            continue
        other = vars(b)[name]
        if isinstance(value, list) and value and isinstance(value[0], np.ndarray):
            assert len(value) == len(other) and all(np.array_equal(x, y) for x, y in zip(value, other)), name
        else:
            assert value == other, name


SFT_ROWS = [{"prompt": "What is 2+3?", "completion": " 5"},
            {"prompt": "Name a colour.", "completion": " Blue, like the sky."},
            {"prompt": "", "completion": "An empty prompt is allowed."}]
PAIR_ROWS = [{"prompt": [{"role": "user", "content": "2+3?"}], "chosen": [{"role": "assistant", "content": "5"}],
              "rejected": [{"role": "assistant", "content": "6"}]},
             {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sky colour?"}],
              "chosen": [{"role": "assistant", "content": "Blue."}],
              "rejected": [{"role": "assistant", "content": "Green, mostly."}]}]


@pytest.mark.parametrize("layout", ["parquet", "save_to_disk"])
def test_the_same_rows_give_the_same_tokens_as_jsonl(tmp_path, tok, data_dir, layout):
    """SFT rows, preference pairs and verl-layout prompt rows read from a parquet file or a save_to_disk folder
    equal the reader's output for the same rows as JSONL (tokens, masks, row numbers, reward columns); the
    prompt rows' reference answer is reward_model.ground_truth, and nested columns arrive as dicts."""
    write = write_parquet if layout == "parquet" else write_saved
    prompts = verl_gsm8k_rows(data_dir, 5)
    for name, rows, read in (("sft", SFT_ROWS, lambda p: read_sft_rows(p, tok, max_length=64, show_progress=False)),
                             ("pairs", PAIR_ROWS, lambda p: read_pair_rows(p, tok, max_length=64,
                                                                           show_progress=False)),
                             ("prompts", prompts, lambda p: read_prompt_rows(p, tok, max_prompt_length=256,
                                                                             show_progress=False))):
        table, table_report = read(write(tmp_path / f"{name}.{layout}", rows))
        lines, lines_report = read(write_jsonl(tmp_path / f"{name}.jsonl", rows))
        _same(table, lines)
        assert len(table) == len(rows) and table_report.rows_read == len(rows) and not table_report.skipped
        assert table_report.summary().split(": ", 1)[1] == lines_report.summary().split(": ", 1)[1]
    assert table.solutions == [r["reward_model"]["ground_truth"] for r in prompts] == ["72", "10", "5", "42", "624"]
    assert table.columns["reward_model"][0] == {"style": "rule", "ground_truth": "72"}
    assert table.columns["extra_info"][1]["index"] == 1
    assert table.columns["question"][0] == prompts[0]["prompt"][0]["content"]


def test_ground_truth_comes_first_then_solution_then_answer(tmp_path, tok):
    """The accuracy reward's reference: reward_model.ground_truth when the row has one, else the existing rules
    (``solution``, else the final number of ``answer``); pandas' saved index column is no reward column."""
    rows = [{"prompt": "a", "reward_model": {"ground_truth": "1"}, "solution": "9", "answer": "#### 8"},
            {"prompt": "b", "reward_model": {"style": "model"}, "solution": "2", "answer": "#### 8"},
            {"prompt": "c", "answer": "so #### 3"}]
    table = pa.Table.from_pylist(rows).append_column("__index_level_0__", pa.array([4, 7, 9]))  # pandas' index
    pq.write_table(table, tmp_path / "p.parquet")
    got, _ = read_prompt_rows(tmp_path / "p.parquet", tok, max_prompt_length=16, show_progress=False)
    assert got.solutions == ["1", "2", "3"]
    assert sorted(got.columns) == ["answer", "question", "reward_model"]


def test_bad_table_rows_are_skipped_and_named_by_row_number(tmp_path, tok, caplog):
    """A table's bad rows follow the JSONL rules: skipped with the file and their 1-based row number (a null cell
    is an absent key), or, with strict, the first one is a one-line error naming file:row."""
    rows = [{"prompt": "What is 1+1?", "completion": " 2"},
            {"prompt": "What is 2+2?", "completion": ""},
            {"prompt": None, "completion": " 6"},
            {"prompt": "What is 4+4?", "completion": " 8"}]
    path = write_parquet(tmp_path / "sft.parquet", rows)
    got, report = read_sft_rows(path, tok, max_length=64, show_progress=False)
    assert got.lines == [1, 4] and report.rows_read == 4
    assert [str(row) for row in report.skipped] == [
        f"{path}:2: skipped (empty completion): 'completion' is empty",
        f"{path}:3: skipped (missing field): no 'prompt' (the file is TRL prompt/completion, set by line 1)"]
    with pytest.raises(MindRLHFError, match=rf"^{path}:2: empty completion: 'completion' is empty; fix the row"):
        read_sft_rows(path, tok, max_length=64, strict=True, show_progress=False)

    folder = write_saved(tmp_path / "prompts", [{"prompt": [{"role": "user", "content": "hi"}]},
                                                {"prompt": [{"role": "wizard", "content": "hi"}]},
                                                {"prompt": [{"role": "user", "content": "word " * 80}]}])
    got, report = read_prompt_rows(folder, tok, max_prompt_length=40, show_progress=False)
    assert got.lines == [1]
    assert [(row.line, row.reason, row.path) for row in report.skipped] == [
        (2, "unknown_role", str(folder)), (3, "prompt_too_long", str(folder))]


def test_folders_and_files_that_are_not_rows_are_one_line_errors(tmp_path, tok):
    """A DatasetDict folder names the split folders to pass; a folder datasets did not write, a missing file and a
    file that is not parquet are refused in one line."""
    from mindrlhf.trainer.sampling import prompt_file_format

    splits = tmp_path / "gsm8k"
    write_saved(splits / "train", SFT_ROWS, shards=1)
    write_saved(splits / "test", SFT_ROWS, shards=1)
    (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    read = lambda p: read_sft_rows(p, tok, max_length=64, show_progress=False)  # noqa: E731
    with pytest.raises(MindRLHFError, match=rf"^{splits} is a datasets DatasetDict folder \(splits: train, test\); "
                                            rf"pass one split's folder, e.g. {splits / 'train'}$"):
        read(splits)
    rows, _ = read(splits / "train")
    assert len(rows) == 3
    with pytest.raises(MindRLHFError, match="is a folder without state.json or dataset_info.json"):
        read(tmp_path)
    with pytest.raises(MindRLHFError, match=r"SFT data file not found: .*missing\.parquet; pass a JSONL file"):
        read(tmp_path / "missing.parquet")
    broken = tmp_path / "broken.parquet"
    broken.write_text('{"prompt": "not parquet"}\n')
    with pytest.raises(MindRLHFError, match=rf"^{broken}: cannot read it as a parquet file \(ArrowInvalid: "):
        read(broken)
    assert [prompt_file_format(str(p)) for p in (broken, splits / "train", splits, tmp_path / "x.mindrecord")] == \
        ["parquet", "save_to_disk", "dataset_dict", "mindrecord"]


# -- one step of each stage on a verl-style GSM8K parquet --------------------------------------------------
def reward_model_column_reward(completions, reward_model, **_columns):
    """A test reward (imported by dotted path in the child run): appends the type of each ``reward_model`` it got
    to $MINDRLHF_TEST_COLUMNS and scores every completion 0."""
    with open(os.environ["MINDRLHF_TEST_COLUMNS"], "a", encoding="utf-8") as f:
        f.write(json.dumps([type(value).__name__ for value in reward_model]) + "\n")
    return [0.0] * len(completions)


@pytest.fixture(scope="module")
def verl_parquet(grpo_assets, data_dir, tmp_path_factory) -> dict:
    """A verl-layout GSM8K train.parquet of 4 rows, and a tiny reward model (PPO's reward model and critic)."""
    from mindrlhf.testing import add_tokenizer, make_tiny_reward_model

    root = tmp_path_factory.mktemp("verl")
    rm = make_tiny_reward_model(root / "rm", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=1024, seed=7)
    rows = verl_gsm8k_rows(data_dir, 4)
    return {**grpo_assets, "rm": add_tokenizer(rm, grpo_assets["model"]), "rows": rows,
            "parquet": write_parquet(root / "train.parquet", rows)}


def _run(stage: str, argv: list, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"mindrlhf.{stage}", *map(str, argv)], cwd=REPO,
                          env=launch_env({"PYTHONUNBUFFERED": "1", **env}), capture_output=True, text=True,
                          timeout=900)


def _flags(**args) -> list:
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]


@pytest.mark.slow
def test_sft_trains_a_step_on_a_verl_parquet(verl_parquet, tmp_path):
    """SFT's --train_file takes the parquet (its prompt/completion message lists) and trains one step."""
    out = tmp_path / "sft"
    proc = _run("sft", _flags(model=verl_parquet["model"], train_file=verl_parquet["parquet"], output_dir=out,
                              max_steps=1, save_steps=1, batch_size=2, micro_batch_size=2, max_length=512,
                              lr=1e-3, progress_bar="false", **SUITE_RECOMPUTE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"train_file: {verl_parquet['parquet']}: 4 rows read, 4 kept, 0 skipped" in proc.stderr
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1] and np.isfinite(rows[0]["loss"])


@pytest.mark.slow
def test_grpo_trains_a_step_on_a_verl_parquet(verl_parquet, tmp_path):
    """GRPO's --train_file takes the parquet: the accuracy reward's solutions are reward_model.ground_truth and a
    reward function gets the reward_model column as dicts."""
    out, seen = tmp_path / "grpo", tmp_path / "columns.jsonl"
    argv = grpo_args(verl_parquet, out, max_steps=1, num_generations=2, max_completion_length=4,
                     reward_funcs=["accuracy", "test_parquet_data:reward_model_column_reward"], tensorboard="false")
    argv[argv.index("--mind_dataset_dir"):argv.index("--mind_dataset_dir") + 2] = \
        ["--train_file", str(verl_parquet["parquet"])]
    proc = _run("grpo", argv, MINDRLHF_TEST_COLUMNS=str(seen))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{verl_parquet['parquet']}: 4 rows read, 4 kept, 0 skipped" in proc.stderr
    assert "rewards/accuracy/mean" in read_rows(out)[0]
    dumped = [json.loads(line) for line in (out / "completions_step_1.jsonl").read_text().splitlines()]
    truths = {r["reward_model"]["ground_truth"] for r in verl_parquet["rows"]}
    assert dumped and all(row["solution"] in truths for row in dumped)
    calls = [json.loads(line) for line in seen.read_text().splitlines()]
    assert calls and all(kinds and set(kinds) == {"dict"} for kinds in calls)


@pytest.mark.slow
@byhand_only("GRPO's parquet test reads prompts through the same reader")
def test_ppo_trains_a_step_on_a_verl_parquet(verl_parquet, tmp_path):
    """PPO's --train_file takes the parquet; the accuracy reward scores against reward_model.ground_truth."""
    out = tmp_path / "ppo"
    proc = _run("ppo", _flags(model=verl_parquet["model"], reward_model=verl_parquet["rm"],
                              train_file=verl_parquet["parquet"], output_dir=out, batch_size=2, max_new_tokens=4,
                              max_prompt_length=256, max_steps=1, save_steps=1, lr=1e-3, micro_batch_size=1,
                              reward_funcs="accuracy", progress_bar="false", **SUITE_RECOMPUTE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"train_file: {verl_parquet['parquet']}: 4 rows read, 4 kept, 0 skipped" in proc.stderr
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1]
    assert "rewards/accuracy/mean" in rows[0] and "no reward_model.ground_truth" not in proc.stderr


# -- question files: mindrlhf-eval --data_path, eval_file, mindrlhf-data -----------------------------------
@pytest.mark.parametrize("layout", ["parquet", "save_to_disk"])
def test_question_files_read_a_verl_parquet_as_the_gsm8k_jsonl(tmp_path, data_dir, layout):
    """The question readers (mindrlhf-eval's and eval_file's ``load_questions``, the converter's and mindrlhf-data
    --sft's ``read_records``) read verl's GSM8K layout from a parquet file or a save_to_disk folder as they read the
    GSM8K JSONL it came from: the same questions, worked answers, final answers and row numbers, and mindrlhf-data
    --sft writes the same rows. A verl row without extra_info asks its prompt's user message, answered by its
    reward_model.ground_truth."""
    from mindrlhf.data.rlhf_data import read_records, write_sft_rows
    from mindrlhf.evaluation.gsm8k_eval import load_questions

    write = write_parquet if layout == "parquet" else write_saved
    source = data_dir / "gsm8k" / "test.jsonl"
    jsonl = write_jsonl(tmp_path / "gsm8k.jsonl", [json.loads(line) for line in source.read_text().splitlines()[:6]])
    table = write(tmp_path / f"verl.{layout}", verl_gsm8k_rows(data_dir, 6, "test"))
    got, want = load_questions(table, limit=4, offset=1), load_questions(jsonl, limit=4, offset=1)
    assert got == want and len(got[0]) == 4 and got[0][0].solution == "3"
    records, records_want = read_records(table, "gsm8k", "question", "answer"), \
        read_records(jsonl, "gsm8k", "question", "answer")
    assert [(n, r["question"], r["answer"], s) for n, r, s in records[0]] == \
        [(n, r["question"], r["answer"], s) for n, r, s in records_want[0]] and records[2] == 6
    write_sft_rows(table, tmp_path / "a.jsonl")
    write_sft_rows(jsonl, tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    bare = [{k: v for k, v in row.items() if k != "extra_info"} for row in verl_gsm8k_rows(data_dir, 2, "test")]
    questions, _ = load_questions(write_parquet(tmp_path / "bare.parquet", bare))
    assert [(q.question, q.solution, q.line) for q in questions] == \
        [(r["prompt"][0]["content"], r["reward_model"]["ground_truth"], i + 1) for i, r in enumerate(bare)]


@pytest.mark.slow
def test_mindrlhf_eval_and_pairs_take_a_verl_parquet(grpo_assets, data_dir, tmp_path):
    """mindrlhf-eval --data_path and mindrlhf-data --pairs --data_path take the verl parquet: the same summary
    (rewards included) and the same pairs as the GSM8K JSONL it came from; GRPO's eval_file accepts it."""
    from mindrlhf.configs import parse_args
    from mindrlhf.evaluation.gsm8k_eval import evaluate
    from mindrlhf.evaluation.gsm8k_pairs import make_pairs

    source = data_dir / "gsm8k" / "test.jsonl"
    jsonl = write_jsonl(tmp_path / "gsm8k.jsonl", [json.loads(line) for line in source.read_text().splitlines()[:3]])
    table = write_parquet(tmp_path / "test.parquet", verl_gsm8k_rows(data_dir, 3, "test"))
    runs = {}
    for name, path in (("parquet", table), ("jsonl", jsonl)):
        summary = evaluate(str(grpo_assets["model"]), data_path=path, max_new_tokens=6, progress=False)
        pairs = make_pairs(tmp_path / f"{name}.pairs.jsonl", model=str(grpo_assets["model"]), data_path=path, k=2,
                           max_new_tokens=6, progress=False)
        runs[name] = ({k: v for k, v in summary.items() if not k.endswith("_s") and k != "data_path"},
                      (tmp_path / f"{name}.pairs.jsonl").read_text(), pairs["pairs"])
    assert runs["parquet"] == runs["jsonl"] and runs["jsonl"][2] > 0
    assert set(runs["jsonl"][0]["rewards"]) == {"accuracy", "gsm8k_format"}
    assert parse_args(["--eval_steps", "1", "--eval_file", str(table)]).train.eval_file == str(table)

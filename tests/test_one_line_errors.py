"""Misuses that used to end in a traceback (issue #39, item 4) now end in one ``error: ...`` line and exit 2:
a reward model (``*ForSequenceClassification``: a score head, no ``lm_head``) given where a causal LM must
generate or give token log-probs (DPO/PPO/GRPO's reference, ``mindrlhf-eval``, ``mindrlhf-data --pairs``), and
``mindrlhf-data --pairs`` on a GSM8K file with a malformed or non-UTF-8 row or with ``--temperature 0``.
Every check runs before any weights are read, so each case takes a fraction of a second."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_runs import SUITE_RECOMPUTE

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO / "mindrlhf" / "resources" / "gsm8k_train_sample.jsonl"


@pytest.fixture(scope="module")
def assets(tmp_path_factory, ppo_assets) -> dict:
    """The tiny actor, 16-prompt mindrecord and reward model (``ppo_assets``), and four pairs."""
    pairs = tmp_path_factory.mktemp("one_line") / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Q{i}: 2+{i}?\nA:", "chosen": f" {2 + i}",
                                         "rejected": f" {3 + i}"}) + "\n" for i in range(4)))
    return {**ppo_assets, "pairs": pairs}


def _flags(**kw) -> list:
    return [x for k, v in {**kw, **SUITE_RECOMPUTE}.items() for x in (f"--{k}", str(v))]


def _command(case: str, a: dict, out: Path):
    """(main, argv, the flag the error must name) of each command given the reward model as a causal LM."""
    from mindrlhf import dpo, grpo, ppo
    from mindrlhf.evaluation import gsm8k_eval
    from mindrlhf.tools import data_cli

    common = dict(output_dir=out, max_steps=1, progress_bar="false")
    if case == "dpo --ref_model":
        return dpo.main, _flags(model=a["model"], ref_model=a["rm"], train_file=a["pairs"], batch_size=2,
                                **common), "--ref_model"
    if case == "ppo --ref_model":
        return ppo.main, _flags(model=a["model"], ref_model=a["rm"], reward_model=a["rm"], train_file=a["data"],
                                batch_size=2, max_new_tokens=4, reward_funcs="accuracy", **common), "--ref_model"
    if case == "grpo --load_ref_checkpoint":
        return grpo.main, _flags(sft_path_train=a["model"], mind_dataset_dir=a["data"], beta=0.04,
                                 load_ref_checkpoint=a["rm"], num_generations=2, chunk_size=2,
                                 max_completion_length=4, **common), "--load_ref_checkpoint"
    if case == "grpo --sft_path_train":
        return grpo.main, _flags(sft_path_train=a["rm"], mind_dataset_dir=a["data"], num_generations=2,
                                 chunk_size=2, max_completion_length=4, **common), "--sft_path_train"
    if case == "eval --model":
        return gsm8k_eval.main, ["--model", str(a["rm"]), "--limit", "1", "--max_new_tokens", "2",
                                 "--output", str(out / "eval.jsonl"), "--no_progress"], "--model"
    assert case == "data --pairs --model"
    return data_cli.main, ["--pairs", "--model", str(a["rm"]), "--output", str(out / "pairs.jsonl"), "--limit", "1",
                           "--k", "1", "--max_new_tokens", "2", "--no_progress"], "--model"


@pytest.mark.parametrize("case", ["dpo --ref_model", "ppo --ref_model", "grpo --load_ref_checkpoint",
                                  "grpo --sft_path_train", "eval --model", "data --pairs --model"])
def test_a_reward_model_where_a_causal_lm_is_needed_is_one_line(assets, tmp_path, capsys, case):
    """It used to load and then die in the first generate / log-prob pass with ``AttributeError ... lm_head``;
    now it is refused, naming the flag and the path, before a model loads, and nothing of a run is written."""
    out = tmp_path / "out"
    main, argv, flag = _command(case, assets, out)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: {flag} {assets['rm']} is a sequence-classification model "
                             "(Qwen2ForSequenceClassification, a reward model or critic: a score head, no lm_head); ")
    assert "must be a causal LM" in err[0]
    written = sorted(p.name for p in out.rglob("*") if p.is_file()) if out.exists() else []
    assert not written, written  # no metrics, config, checkpoint, results or pairs file


def _gsm8k_with(tmp_path: Path, bad: bytes) -> Path:
    """Two packaged GSM8K rows, then a bad line."""
    path = tmp_path / "gsm8k_bad.jsonl"
    good = GSM8K.read_bytes().split(b"\n")[:2]
    path.write_bytes(b"\n".join(good + [bad]) + b"\n")
    return path


BAD_ROWS = {"malformed JSON": b'{"question": "How many?", "answer": ',
            "not UTF-8": b'{"question": "\xff\xfe", "answer": "#### 1"}'}


@pytest.mark.parametrize("bad", list(BAD_ROWS.values()), ids=list(BAD_ROWS))
def test_pairs_from_a_file_with_a_bad_row(assets, tmp_path, capsys, bad):
    """``mindrlhf-data --pairs`` read every line of --data_path again for the reference answers, so a bad row
    past --limit was a JSONDecodeError / UnicodeDecodeError traceback after the whole sampling run. Now only the
    questions used are read: with --limit 2 the pairs are written; without it the bad row is one line naming it."""
    from mindrlhf.tools.data_cli import main

    data, out = _gsm8k_with(tmp_path, bad), tmp_path / "pairs.jsonl"
    argv = ["--pairs", "--model", str(assets["model"]), "--data_path", str(data), "--output", str(out), "--k", "2",
            "--max_new_tokens", "3", "--no_progress"]
    assert main(argv + ["--limit", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert result["questions"] == 2 and result["pairs"] == sum(len(r["neg_answers"]) for r in rows)
    answers = [json.loads(line)["answer"] for line in GSM8K.read_text(encoding="utf-8").splitlines()[:2]]
    for row in rows:  # the chosen answer is that question's reference solution, calculator notes removed
        assert row["pos_answers"][0].split("####")[-1] == answers[row["question_index"]].split("####")[-1]
    assert main(argv + ["--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {data} line 3: malformed JSON ("), err
    assert err[0].endswith("fix or remove that line")


def test_pairs_with_temperature_zero_names_no_missing_flag(assets, tmp_path, capsys):
    """``--pairs --temperature 0`` said to use ``--mode greedy``, a flag --pairs does not have."""
    from mindrlhf.tools.data_cli import main

    out = tmp_path / "pairs.jsonl"
    assert main(["--pairs", "--model", str(assets["model"]), "--output", str(out), "--temperature", "0",
                 "--limit", "1", "--no_progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --temperature 0.0: pairs come from sampled completions; use a temperature > 0 "
                   "(default 1.0)"]
    assert not out.exists()

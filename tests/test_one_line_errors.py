"""Misuses that used to end in a traceback now end in one ``error: ...`` line and exit 2:
a reward model (``*ForSequenceClassification``: a score head, no ``lm_head``) given where a causal LM must
generate or give token log-probs (DPO/PPO/GRPO's reference, ``mindrlhf-eval``, ``mindrlhf-data --pairs``), and
``mindrlhf-data --pairs`` on a GSM8K file with a malformed or non-UTF-8 row or with ``--temperature 0``; a
safetensors file cut short past its header (``mindrlhf-eval``, ``convert_weight --reverse --adapter``); a
``mindrlhf-eval --output`` that cannot be written. Every check runs before any weights are read, so each case takes
a fraction of a second."""
from __future__ import annotations

import json
import os
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


def _truncated_copy(src: Path, dst: Path, name: str) -> Path:
    """A copy of the folder ``src`` whose safetensors file ``name`` is cut in the middle of its tensor data (a copy
    or download that stopped): its header is whole, so only the tensor reads would find it."""
    import shutil

    from mindrlhf.checkpoint.hf_io import read_safetensors_header

    shutil.copytree(src, dst)
    file = dst / name
    _, data_start = read_safetensors_header(file)
    with open(file, "r+b") as f:
        f.truncate(data_start + (file.stat().st_size - data_start) // 2)
    return file


@pytest.fixture(scope="module")
def adapter(assets, tmp_path_factory) -> Path:
    """A LoRA adapter folder (PEFT's format) on the tiny actor."""
    from mindrlhf.models import load_model
    from mindrlhf.models.lora import LoRASpec, adapter_weights, apply_lora, save_adapter, set_adapter_weights
    from mindrlhf.testing import lora_numpy_init

    model = load_model(assets["model"])
    apply_lora(model, LoRASpec(r=4, alpha=8, target_modules=("q_proj", "v_proj")))
    set_adapter_weights(model, {k: lora_numpy_init(k, v.shape, 3) for k, v in adapter_weights(model).items()})
    return save_adapter(model, tmp_path_factory.mktemp("lora") / "adapter")


@pytest.mark.parametrize("case", ["eval --model HF_DIR", "eval --model ADAPTER", "convert_weight --reverse --adapter"])
def test_a_truncated_safetensors_file_is_one_line(assets, adapter, tmp_path, capsys, case):
    """A safetensors file cut short past its header (a model's or an adapter's) was a SafetensorError traceback
    ("incomplete metadata, file not fully covered") once the first tensor was read; now it is one line naming the
    file, that it is truncated and what to do, and nothing is written."""
    from mindrlhf.evaluation import gsm8k_eval
    from mindrlhf.tools import convert_weight

    out = tmp_path / "out"
    eval_flags = ["--limit", "1", "--max_new_tokens", "2", "--output", str(out / "eval.jsonl"), "--no_progress"]
    if case == "eval --model HF_DIR":
        bad = _truncated_copy(assets["model"], tmp_path / "model", "model.safetensors")
        main, argv = gsm8k_eval.main, ["--model", str(bad.parent)] + eval_flags
    elif case == "eval --model ADAPTER":
        bad = _truncated_copy(adapter, tmp_path / "adapter", "adapter_model.safetensors")
        main, argv = gsm8k_eval.main, ["--model", str(bad.parent), "--base_model", str(assets["model"])] + eval_flags
    else:
        bad = _truncated_copy(adapter, tmp_path / "adapter", "adapter_model.safetensors")
        main, argv = convert_weight.main, ["--reverse", "--input_path", str(assets["model"]), "--adapter",
                                           str(bad.parent), "--output_path", str(out / "merged"), "--no_progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: {bad}: the safetensors file is truncated: {bad.stat().st_size} bytes, its "
                             "header describes "), err
    assert err[0].endswith("; re-download or re-save it (or use another checkpoint)"), err
    written = sorted(p.name for p in out.rglob("*") if p.is_file()) if out.exists() else []
    assert not written, written


def test_eval_output_that_cannot_be_written_is_refused_before_the_model_loads(assets, tmp_path, capsys):
    """``mindrlhf-eval --output`` in a read-only folder was an OSError traceback once the model had loaded (the
    results' temporary file opened then); a folder that is a file, a traceback from mkdir. Both are now one line
    naming the path, before anything loads: a damaged model given beside them is not read."""
    from grpo_runs import read_only_dir
    from mindrlhf.evaluation import gsm8k_eval

    # The model would fail as it loads: the output's error coming first shows the check runs before the loading.
    damaged = _truncated_copy(assets["model"], tmp_path / "model", "model.safetensors").parent
    a_file = tmp_path / "results"
    a_file.write_text("not a folder\n")
    with read_only_dir(tmp_path / "read_only") as read_only:
        for output, why in ((read_only / "eval.jsonl", "Read-only file system" if os.geteuid() == 0 else
                             "Permission denied"),
                            (a_file / "eval.jsonl", f"{a_file} is a file, not a folder")):
            argv = ["--model", str(damaged), "--limit", "1", "--max_new_tokens", "2", "--output", str(output),
                    "--no_progress"]
            assert gsm8k_eval.main(argv) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert err == [f"error: --output {output} cannot be written ({why}); choose a writable path"], err
        assert not any(read_only.iterdir())
    assert a_file.read_text() == "not a folder\n"

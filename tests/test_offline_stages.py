"""``mindrlhf-sft``, ``mindrlhf-rm``, ``mindrlhf-dpo`` and ``mindrlhf-orpo`` end to end on a tiny Qwen2 with the real
tokenizer: each command's outputs (metrics under TRL's names, plots, checkpoints that load as models), and a run
killed with SIGKILL mid-step then resumed reproduces the uninterrupted run's metrics and weights."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from grpo_runs import BYHAND, SUITE_RECOMPUTE, byhand, byhand_only, check_score_export

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO / "mindrlhf" / "resources" / "gsm8k_train_sample.jsonl"

#: The keys each stage logs every step (TRL's names).
KEYS = {
    "sft": {"loss", "grad_norm", "learning_rate", "mean_token_accuracy", "entropy", "num_tokens", "epoch"},
    "rm": {"loss", "grad_norm", "learning_rate", "accuracy", "margin", "min_reward", "mean_reward", "max_reward",
           "num_tokens", "epoch"},
    "dpo": {"loss", "grad_norm", "learning_rate", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
            "rewards/margins", "logps/chosen", "logps/rejected", "num_tokens", "epoch"},
    "orpo": {"loss", "grad_norm", "learning_rate", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
             "rewards/margins", "logps/chosen", "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen",
             "num_tokens", "epoch"},
}
EVAL_KEYS = {"sft": {"eval/loss", "eval/mean_token_accuracy"},
             "rm": {"eval/loss", "eval/accuracy", "eval/margin", "eval/mean_reward"},
             "dpo": {"eval/loss", "eval/rewards/accuracies", "eval/rewards/margins"},
             "orpo": {"eval/loss", "eval/rewards/accuracies", "eval/rewards/margins", "eval/nll_loss"}}


@pytest.fixture(scope="module")
def stage_assets(tmp_path_factory, qwen_tokenizer_dir):
    """A tiny Qwen2 with the Qwen2.5 tokenizer; SFT rows (conversational GSM8K, ReaL's prompt/answer) and
    preference pairs (TRL's prompt/chosen/rejected, ReaL's pos_answers/neg_answers) from the packaged sample."""
    from mindrlhf.data.gsm8k import sft_row, strip_calculator_notes
    from mindrlhf.testing import add_tokenizer, make_tiny_qwen2

    root = tmp_path_factory.mktemp("stages")
    model = add_tokenizer(make_tiny_qwen2(root / "model", seed=5), qwen_tokenizer_dir)
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:12]]
    files = {}

    def write(name, items):
        files[name] = root / name
        files[name].write_text("".join(json.dumps(r) + "\n" for r in items))

    write("sft_train.jsonl", [sft_row(r["question"], r["answer"]) for r in rows[:8]])
    write("sft_valid.jsonl", [{"prompt": f"Q: {r['question']}\nA:", "answer": " " + strip_calculator_notes(r["answer"])}
                              for r in rows[8:]])

    def wrong(answer):
        head, number = answer.rsplit("####", 1)
        return f"{head}#### {int(number.strip().replace(',', '')) + 1}"

    pairs = [{"prompt": f"Q: {r['question']}\nA:", "chosen": " " + strip_calculator_notes(r["answer"]),
              "rejected": " " + strip_calculator_notes(wrong(r["answer"]))} for r in rows]
    write("pairs_train.jsonl", pairs[:8])
    write("pairs_valid.jsonl", [{"prompt": p["prompt"], "pos_answers": [p["chosen"]], "neg_answers": [p["rejected"]]}
                                for p in pairs[8:]])
    return {"model": model, **files}


def _argv(stage, assets, out, **extra):
    train, valid = ("sft_train.jsonl", "sft_valid.jsonl") if stage == "sft" else ("pairs_train.jsonl",
                                                                                   "pairs_valid.jsonl")
    args = {"model": assets["model"], "train_file": assets[train], "valid_file": assets[valid],
            "output_dir": out, "max_steps": 4, "batch_size": 4, "micro_batch_size": 2,
            # room for every row: the GSM8K system prompt alone is ~90 tokens, and the RM drops long pairs
            "max_length": 256,
            "save_steps": 1, "eval_steps": 2, "seed": 3, "progress_bar": "false", "lr": 1e-3,
            "warmup_steps": 2, **SUITE_RECOMPUTE}
    args.update(extra)
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]


#: SUITE_RECOMPUTE as flags, for the tests that call a stage's main in this process.
_PIN = [x for k, v in SUITE_RECOMPUTE.items() for x in (f"--{k}", v)]


def _run(stage, argv, env_extra=None, **kw):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", f"mindrlhf.{stage}", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900, **kw)


def _last_checkpoint(out: Path, step: int = 4) -> Path:
    from mindrlhf.checkpoint.manager import CheckpointManager

    found, path = CheckpointManager(str(out / "checkpoints")).latest_complete()
    assert found == step
    return path


def _metrics(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("stage,extra,kill", [
    ("sft", {}, False), ("dpo", {"beta": 0.2}, True),
    pytest.param("rm", {"center_rewards_coefficient": 0.01}, False,
                 marks=byhand("rm", "sft and dpo resume through the same offline trainer").marks),
    pytest.param("orpo", {"beta": 0.2}, False, marks=byhand("orpo", "dpo's pair path and the shared resume").marks)])
def test_stage_runs_and_resumes_exactly_after_sigkill(stage_assets, tmp_path, stage, extra, kill):
    """4 steps uninterrupted vs killed (SIGKILL) in step 3's gradient reduction and resumed with --resume:
    identical metrics (every key, rel 1e-6) and final weights; metrics carry TRL's names, eval runs at steps
    2 and 4, loss.png is written and every checkpoint folder loads as a model. (The resume path is the shared
    OfflineTrainer's, killed and resumed in the DPO case, whose state adds a reference that must stay the
    initial policy; the SFT and RM cases, whose state is nothing more, skip the kill to keep CI short.)"""
    from mindrlhf.models import get_weights, load_model

    full = tmp_path / "full"
    proc = _run(stage, _argv(stage, stage_assets, full, **extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _metrics(full)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert KEYS[stage] <= set(r), (stage, sorted(set(r)))
        assert all(np.isfinite(v) for k, v in r.items() if isinstance(v, float)), r
    assert EVAL_KEYS[stage] <= set(rows[1]) and EVAL_KEYS[stage] <= set(rows[3])
    assert not EVAL_KEYS[stage] & set(rows[0])
    assert rows[0]["learning_rate"] < rows[1]["learning_rate"] > rows[3]["learning_rate"]  # warmup, then decay
    assert (full / "loss.png").is_file()
    if stage != "sft":
        assert (full / "accuracy.png").is_file()
    final = load_model(_last_checkpoint(full))
    assert final.config.num_labels == (1 if stage == "rm" else 0)
    if stage == "rm":
        check_score_export(_last_checkpoint(full) / "policy.ckpt", final, tmp_path / "hf")

    if not kill:
        return
    killed = tmp_path / "killed"
    proc = _run(stage, _argv(stage, stage_assets, killed, **extra),
                env_extra={"MINDRLHF_KILL_AT": "0:3:grad_allreduce"})
    assert proc.returncode != 0 and "fault injection: rank 0 kills itself at step 3" in proc.stderr
    assert [r["step"] for r in _metrics(killed)] == [1, 2]
    proc = _run(stage, _argv(stage, stage_assets, killed, resume="latest", **extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = _metrics(killed)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for want, got in zip(rows, resumed):
        for k, v in want.items():
            if k not in ("step_time", "time"):
                assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-9), (stage, want["step"], k)
    a, b = get_weights(final), get_weights(load_model(_last_checkpoint(killed)))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


#: The metrics each stage's evaluation reports, as the step's metric of the same name.
EVAL_AS_STEP = {"sft": ("mean_token_accuracy",), "rm": ("accuracy", "margin", "mean_reward"),
                "dpo": ("rewards/accuracies", "rewards/margins")}


@pytest.mark.slow
@pytest.mark.parametrize("stage,extra", [
    ("sft", {"packing": "true"}), ("rm", {"center_rewards_coefficient": 0.01}), ("dpo", {}),
    ("dpo", {"loss_type": "ipo", "precompute_ref_log_probs": "true"})])
def test_evaluation_is_the_training_objective(stage_assets, tmp_path, stage, extra):
    """Evaluation applies the stage's training objective: on a valid file equal to the train file, with one step
    covering every row, eval/loss and each eval/<metric> before the step equal that step's loss and metrics (both
    are computed on the same weights), to float32 rounding (the step sums in another row order)."""
    import importlib

    from mindrlhf.registry import STAGES
    from mindrlhf.trainer.entry import setup_runtime

    name = "sft_train.jsonl" if stage == "sft" else "pairs_train.jsonl"
    rows = tmp_path / name
    rows.write_text("".join(stage_assets[name].read_text().splitlines(keepends=True)[:4]))
    spec = getattr(importlib.import_module(STAGES[stage].module), stage.upper())  # the recipe's StageSpec
    cfg = spec.parse(_argv(stage, stage_assets, tmp_path / "out", train_file=rows, valid_file=rows, batch_size=4,
                           max_steps=1, eval_steps=0, **extra) + _PIN)
    trainer = spec.build(cfg, setup_runtime(cfg))
    evaluated = trainer.evaluate()
    assert set(evaluated) == {"eval/loss"} | {f"eval/{k}" for k in EVAL_AS_STEP[stage]} == EVAL_KEYS[stage]
    step = trainer.train_one_step()
    for key in ("loss",) + EVAL_AS_STEP[stage]:
        assert evaluated[f"eval/{key}"] == pytest.approx(step[key], rel=1e-5, abs=1e-6), (stage, key)


def test_stage_commands_refuse_bad_inputs_in_one_line(stage_assets, tmp_path, capsys):
    """A missing --train_file (rm, dpo), a reward model given to SFT, a bad loss type: one-line errors, exit 2."""
    from mindrlhf import dpo, rm, sft

    out = str(tmp_path / "o")
    assert rm.main(["--model", str(stage_assets["model"]), "--output_dir", out]) == 2
    assert "--train_file is required" in capsys.readouterr().err
    assert dpo.main(["--model", str(stage_assets["model"]), "--output_dir", out, "--loss_type", "bco"]) == 2
    err = capsys.readouterr().err
    assert "loss_type" in err and "sigmoid" in err and len(err.strip().splitlines()) == 1
    assert sft.main(["--batch_size", "6", "--micro_batch_size", "4", "--output_dir", out]) == 2
    assert "not divisible by micro_batch_size = 4" in capsys.readouterr().err


def test_reward_model_trains_the_same_with_and_without_recompute(stage_assets, tmp_path):
    """``--recompute none`` (the whole-model graph, through the score head) and ``full`` (the layer graphs):
    the same metrics (rel 1e-5) and final weights over 2 steps of the reward model."""
    from mindrlhf import rm
    from mindrlhf.models import get_weights, load_model

    runs = {}
    for mode in ("none", "full"):
        out = tmp_path / mode
        # A small lr, as in the msrun test below: Adam's first update is ~lr * sign(gradient), so a gradient entry
        # at float32-noise level moves by 2 * lr between two ways of computing it.
        assert rm.main(_argv("rm", stage_assets, out, max_steps=2, save_steps=2, eval_steps=2, lr=1e-5,
                             recompute=mode)) == 0
        runs[mode] = (_metrics(out), get_weights(load_model(_last_checkpoint(out, 2))))
    _assert_same_run(runs["full"], runs["none"], abs_metric=1e-6)
    (_, a), (_, b) = runs["full"], runs["none"]
    for name in a:
        assert np.abs(b[name] - a[name]).mean() < 1e-7, name  # only noise-level entries differ at all


def _assert_same_run(want_run, got_run, abs_metric: float) -> None:
    """Two runs' (metrics rows, final weights): every logged metric but the times to rel 1e-5 (``abs_metric``
    near 0), every weight to rtol 1e-4 / atol 2e-5."""
    (want, a), (got, b) = want_run, got_run
    assert [x["step"] for x in got] == [x["step"] for x in want]
    for x, y in zip(want, got):
        for k, v in x.items():
            if k not in ("step_time", "time"):
                assert y[k] == pytest.approx(v, rel=1e-5, abs=abs_metric), (x["step"], k)
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_micro_batches_longest_first_train_as_the_data_order(stage_assets, tmp_path, stage):
    """``--micro_batch_order length`` (the default: each step's rows longest first, so like lengths share a
    micro-batch) and ``data``: the same metrics (rel 1e-5) and final weights over 2 steps, and the same
    evaluation (DPO's reference log-probs are placed by row id, so a wrong reorder would show there)."""
    import importlib

    from mindrlhf.models import get_weights, load_model

    main = importlib.import_module(f"mindrlhf.{stage}").main
    runs = {}
    for order in ("data", "length"):
        out = tmp_path / order
        assert main(_argv(stage, stage_assets, out, max_steps=2, save_steps=2, eval_steps=2, lr=1e-5,
                          micro_batch_order=order, **({"beta": 0.2} if stage == "dpo" else {}))) == 0
        runs[order] = (_metrics(out), get_weights(load_model(_last_checkpoint(out, 2))))
    # abs: DPO's rewards are beta x differences of sequence log-probs near -100, whose float32 sums move by ~1e-5
    # with the padding; a row's reference placed on another row would move them by ~1.
    _assert_same_run(runs["data"], runs["length"], abs_metric=2e-5)


def _msrun_stage(stage, assets, out: Path, log_dir: Path, port: int, env_extra=None, **flags):
    """Two msrun workers running ``stage`` (examples/stages/run.py) with ``_argv``'s flags and ``flags``; returns the
    finished process and the tails of the workers' logs."""
    from grpo_runs import launch_env

    script = REPO / "examples" / "stages" / "run.py"
    cmd = [str(Path(sys.executable).parent / "msrun"), "--worker_num=2", "--local_worker_num=2",
           f"--master_port={port}", "--join=True", f"--log_dir={log_dir}", str(script), stage,
           *_argv(stage, assets, out, use_parallel="true", **flags)]
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(env_extra), capture_output=True, text=True, timeout=900)
    return proc, "\n".join(p.read_text()[-3000:] for p in sorted(log_dir.glob("*.log")))


def _assert_rows_close(want, got, stage):
    """Each step's metrics of two layouts equal (rel 2e-5; the same keys), to the float32 noise of their sums."""
    for a, b in zip(want, got):
        # DPO's implicit rewards are beta * (policy - reference) sums of ~100 log-probs: float32 rounding of each
        # sum (eps ~1.2e-7, reduced in another order per layout) sets their absolute noise floor.
        floor = 20 * 1.2e-7 * 0.2 * (abs(a.get("logps/chosen", 0)) + abs(a.get("logps/rejected", 0)))
        for k, v in a.items():
            if k not in ("step_time", "time") and not k.startswith("time/"):
                tol = floor if k.startswith(("rewards/", "eval/rewards/")) else 1e-6
                assert b[k] == pytest.approx(v, rel=2e-5, abs=max(tol, 1e-6)), (stage, a["step"], k)


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.parametrize("stage,layout,port", [
    ("rm", {"train_tp": 2}, 8303),
    pytest.param("dpo", {"train_pp": 2, "train_micro_batches": 2}, 8305, id="dpo-pp2",
                 marks=byhand("dpo", "sft-lora-pp2 runs an offline stage on pipeline stages").marks),
    ("orpo", {"train_dp": 2, "lora_rank": 4, "lora_alpha": 8}, 8307),
    ("sft", {"train_pp": 2, "train_micro_batches": 2, "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.1}, 8323)],
    ids=["rm-tp2", "dpo-pp2", "orpo-lora-dp2", "sft-lora-pp2"])
def test_stage_under_msrun_equals_one_process(stage_assets, tmp_path, stage, layout, port):
    """Two msrun workers (RM tensor-parallel, DPO pipeline-parallel with 2 micro-batches, ORPO training LoRA adapters
    data-parallel: each worker a half of every step's pairs and of the validation pairs, and of the GSM8K questions of
    the evaluation by generation, 20 of them in batches of 16 and 4, only the adapters' gradients reduced; SFT
    training LoRA adapters pipeline-parallel with adapter dropout: each stage its layers' adapters, each stage's
    recomputing backward the masks of its forward, and one process with the pipeline's pieces as its micro-batches
    draws the same masks; LoRA tensor-parallel is DPO's test
    below, which also kills and resumes) give one process's
    metrics (loss, grad_norm, the stage's metrics, eval, eval by generation) and final weights (LoRA: the adapters
    of the checkpoint, a PEFT adapter folder assembled from the shards, and output_dir/adapter: the same folder one
    process writes)."""
    from mindrlhf.models import get_weights, load_model
    from mindrlhf.models.lora import read_adapter

    # A small lr: Adam's first update is ~lr * sign(gradient), so gradient entries at float32-noise level (which
    # the layouts reduce in different orders) would otherwise move by a full 2 * lr between the two runs.
    extra = {"max_steps": 2, "save_steps": 2, "eval_steps": 2, "lr": 1e-5}
    layout = dict(layout)  # the parameter's own dict stays as it is
    lora = {k: layout.pop(k) for k in ("lora_rank", "lora_alpha", "lora_dropout") if k in layout}
    extra.update(lora)  # the one-process run trains the same adapters
    if stage == "orpo":  # the replicas share the evaluation's questions and sum their counts
        extra.update(eval_generation="true", eval_limit=20, eval_max_new_tokens=4)
    one = tmp_path / "one"
    # Adapter dropout draws a mask per micro-batch over its positions: the one process runs the pipeline's pieces
    # (micro_batch_size 2 cut into train_micro_batches) as its micro-batches, so both draw the same masks.
    pieces = {"micro_batch_size": 2 // layout["train_micro_batches"]} if "lora_dropout" in lora else {}
    proc = _run(stage, _argv(stage, stage_assets, one, **extra, **pieces))
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = tmp_path / "two"
    proc, logs = _msrun_stage(stage, stage_assets, two, tmp_path / "log", port, **layout, **extra)
    assert proc.returncode == 0, logs
    want, got = _metrics(one), _metrics(two)
    assert [r["step"] for r in got] == [1, 2]
    assert stage != "orpo" or "eval/accuracy" in want[-1] and "eval/format_rate" in got[-1]
    _assert_rows_close(want, got, stage)
    step = "step_00000002"
    folders = [("checkpoints", step), ("adapter",)] if lora else [("checkpoints", step)]
    for folder in folders:
        if lora:
            (spec_a, a), (spec_b, b) = (read_adapter(run.joinpath(*folder)) for run in (one, two))
            assert spec_a == spec_b and a.keys() == b.keys(), folder
            assert any(".lora_B." in k and np.abs(v).max() > 0 for k, v in a.items())
            assert all(a[k].shape == b[k].shape for k in a)
        else:
            a, b = (get_weights(load_model(run.joinpath(*folder))) for run in (one, two))
        for name in a:  # an entry whose gradient is float32 noise may still differ by up to 2 steps x 2 * lr
            np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=4 * extra["lr"], err_msg=name)
            assert np.abs(b[name] - a[name]).mean() < 1e-7, name  # ...but only such entries


@pytest.mark.slow
@pytest.mark.msrun
@byhand_only("LoRA gradients under tp2: test_lora; a killed msrun job resumed exactly: test_grpo_e2e's dead worker")
def test_dpo_lora_under_tp2_equals_one_process_and_resumes_exactly_after_sigkill(stage_assets, tmp_path):
    """DPO training LoRA adapters on two tensor-parallel msrun workers (the reference: the policy's own shards with
    their adapters switched off) with a checkpoint each step; rank 1 is killed (SIGKILL) in step 3's gradient
    reduction. A --resume from step 1's checkpoint (adapters and moments assembled from the shards) redoes steps 2
    and 3: its step 2 equals the killed run's bit for bit (metrics and the checkpoint's adapters), and every step
    and the final adapters (the checkpoint, output_dir/adapter) equal one process's."""
    from mindrlhf.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter

    extra = {"max_steps": 3, "save_steps": 1, "eval_steps": 2, "lr": 1e-5, "beta": 0.2, "lora_rank": 4,
             "lora_alpha": 8}
    one, two = tmp_path / "one", tmp_path / "two"
    proc = _run("dpo", _argv("dpo", stage_assets, one, **extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, logs = _msrun_stage("dpo", stage_assets, two, tmp_path / "log", 8325, train_tp=2,
                              env_extra={"MINDRLHF_KILL_AT": "1:3:grad_allreduce"}, **extra)
    assert proc.returncode != 0 and "fault injection: rank 1 kills itself at step 3" in logs, logs
    killed = _metrics(two)
    assert [r["step"] for r in killed] == [1, 2]
    step2 = two / "checkpoints" / "step_00000002"
    killed_files = {name: (step2 / name).read_bytes() for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)}
    proc, logs = _msrun_stage("dpo", stage_assets, two, tmp_path / "log_resume", 8327, train_tp=2,
                              resume=two / "checkpoints" / "step_00000001", **extra)
    assert proc.returncode == 0, logs
    resumed = _metrics(two)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for k, v in killed[1].items():
        if k not in ("step_time", "time") and not k.startswith("time/"):
            assert resumed[1][k] == v, k
    assert {name: (step2 / name).read_bytes() for name in killed_files} == killed_files
    _assert_rows_close(_metrics(one), resumed, "dpo")
    for folder in (("checkpoints", "step_00000003"), ("adapter",)):
        (spec_a, a), (spec_b, b) = (read_adapter(run.joinpath(*folder)) for run in (one, two))
        assert spec_a == spec_b and a.keys() == b.keys(), folder
        for name in a:
            np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=6 * extra["lr"], err_msg=name)
            assert np.abs(b[name] - a[name]).mean() < 1e-7, name


def test_gsm8k_pairs_from_a_models_wrong_answers(stage_assets, tmp_path, qwen_tokenizer_dir, capsys):
    """mindrlhf-data --pairs: k sampled completions per question; every wrong one (a random model's are) is a
    rejected answer against the reference solution (calculator notes removed), in ReaL's format, which
    read_pair_rows reads; --max_pairs_per_question caps them; an existing output needs --overwrite."""
    from mindrlhf.data.gsm8k import build_prompt, style_system_prompt
    from mindrlhf.data.text_rows import read_pair_rows
    from mindrlhf.tokenizer import Tokenizer
    from mindrlhf.tools.data_cli import main

    out = tmp_path / "pairs.jsonl"
    argv = ["--pairs", "--model", str(stage_assets["model"]), "--output", str(out), "--k", "3", "--limit", "4",
            "--max_new_tokens", "6", "--no_progress", "--data_path", str(GSM8K)]
    assert main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    source = [json.loads(line) for line in GSM8K.read_text().splitlines()[:4]]
    tokenizer = Tokenizer.from_dir(qwen_tokenizer_dir)
    assert len(rows) == 4 and [r["question_index"] for r in rows] == [0, 1, 2, 3]
    for row, src in zip(rows, source):
        assert row["prompt"] == build_prompt(src["question"], tokenizer, style_system_prompt("gsm8k"))
        assert len(row["neg_answers"]) == len(row["pos_answers"]) == 3
        assert row["pos_answers"][0].endswith(src["answer"].rsplit("####", 1)[1].strip()) and "<<" not in \
            row["pos_answers"][0]
    pairs, report = read_pair_rows(out, tokenizer, max_length=512, show_progress=False)
    assert len(pairs.prompt_ids) == 12, report.summary()
    assert main(argv) == 2  # an existing output is kept unless --overwrite
    capsys.readouterr()
    with_bar = [a for a in argv if a != "--no_progress"]
    assert main(with_bar + ["--overwrite", "--max_pairs_per_question", "1"]) == 0
    said = capsys.readouterr()  # the bar says what it does (it said "gsm8k maj"); stdout: what was written
    assert "pairs: 3 answers a question" in said.err and "gsm8k maj" not in said.err
    assert json.loads(said.out.strip().splitlines()[-1])["pairs"] == 4
    assert [len(json.loads(line)["neg_answers"]) for line in out.read_text().splitlines()] == [1, 1, 1, 1]
    assert not list(tmp_path.glob("*.samples.jsonl")) and not list(tmp_path.glob("*.tmp"))


@pytest.mark.slow
@pytest.mark.byhand
@pytest.mark.skipif(not BYHAND, reason="beyond CI's time; the pipeline tutorial's test runs SFT -> RM / DPO / GRPO "
                    "from the run folders and checks DPO's ln 2: MINDRLHF_BYHAND=1")
def test_rm_dpo_and_grpo_start_from_an_sft_checkpoint(stage_assets, tmp_path):
    """The walkthrough's chain: an SFT checkpoint folder is the --model of the reward model (its lm_head replaced
    by a score head, the tokenizer read from the folder) and of DPO, whose reference is then that same model:
    DPO's first step has loss ln 2 and zero rewards, as TRL's. The SFT packs its 8 rows into 2 sequences of up to
    1024 tokens, so its one step of batch_size 2 trains on every row. Each stage in a child process, as a user
    runs them (and so that their graphs do not stay in the test process)."""
    from mindrlhf.data.text_rows import read_sft_rows
    from mindrlhf.tokenizer import Tokenizer

    common = ["--max_steps", "1", "--batch_size", "4", "--max_length", "256", "--progress_bar", "false", *_PIN]

    def run(stage, *argv):  # the stage's own flags last: they override common's
        proc = _run(stage, [*common, *map(str, argv)])
        assert proc.returncode == 0, proc.stderr[-3000:]

    run("sft", "--model", stage_assets["model"], "--train_file", stage_assets["sft_train.jsonl"],
        "--output_dir", tmp_path / "sft", "--packing", "true", "--max_length", "1024", "--batch_size", "2")
    rows, _ = read_sft_rows(stage_assets["sft_train.jsonl"], Tokenizer.from_dir(stage_assets["model"]),
                            max_length=1024)
    assert len(rows) == 8 and _metrics(tmp_path / "sft")[0]["num_tokens"] == sum(len(r) for r in rows.input_ids)
    ckpt = _last_checkpoint(tmp_path / "sft", step=1)
    run("rm", "--model", ckpt, "--train_file", stage_assets["pairs_train.jsonl"], "--output_dir", tmp_path / "rm")
    assert {"accuracy", "margin", "mean_reward"} <= set(_metrics(tmp_path / "rm")[0])
    run("dpo", "--model", ckpt, "--train_file", stage_assets["pairs_train.jsonl"], "--output_dir", tmp_path / "dpo")
    first = _metrics(tmp_path / "dpo")[0]
    assert first["loss"] == pytest.approx(np.log(2.0), rel=1e-6)
    assert first["rewards/margins"] == 0.0 and first["rewards/accuracies"] == 0.0
    # ... and of GRPO (--sft_path_train), on its default data (the packaged GSM8K sample), as the walkthrough's
    # "then GRPO from the SFT model"; its reference is that same folder's weights.
    proc = _run("grpo", ["--sft_path_train", str(ckpt), "--output_dir", str(tmp_path / "grpo"), "--max_steps", "1",
                         "--num_generations", "2", "--max_completion_length", "8", "--beta", "0.04",
                         "--progress_bar", "false", *_PIN])
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = _metrics(tmp_path / "grpo")[0]
    assert first["step"] == 1 and first["kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.slow
def test_dpo_precomputed_reference_equals_the_per_step_reference(stage_assets, tmp_path, policy_ref_dirs):
    """--precompute_ref_log_probs (the reference run once over the training and validation pairs, then
    released) trains exactly as the reference run every step: the same metrics over 2 steps, eval included."""
    from mindrlhf import dpo

    policy, ref = policy_ref_dirs
    runs = {}
    for name, extra in (("per_step", []), ("precomputed", ["--precompute_ref_log_probs"])):
        out = tmp_path / name
        argv = ["--model", str(policy), "--ref_model", str(ref), "--train_file", str(stage_assets["pairs_train.jsonl"]),
                "--valid_file", str(stage_assets["pairs_valid.jsonl"]), "--output_dir", str(out), "--max_steps", "2",
                "--batch_size", "4", "--micro_batch_size", "2", "--max_length", "256", "--eval_steps", "1",
                "--lr", "1e-4", "--progress_bar", "false", *extra]
        assert dpo.main(argv) == 0
        runs[name] = _metrics(out)
    assert runs["per_step"][0]["rewards/margins"] != 0.0  # the reference differs from the policy
    for a, b in zip(runs["per_step"], runs["precomputed"]):
        for k, v in a.items():
            if k not in ("step_time", "time"):
                assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (a["step"], k)


@pytest.fixture(scope="module")
def policy_ref_dirs(tmp_path_factory, qwen_tokenizer_dir):
    """Two different tiny Qwen2 (policy, reference) with the Qwen2.5 tokenizer."""
    from mindrlhf.testing import add_tokenizer, make_tiny_qwen2

    root = tmp_path_factory.mktemp("policy_ref")
    return (add_tokenizer(make_tiny_qwen2(root / "policy", seed=5), qwen_tokenizer_dir),
            add_tokenizer(make_tiny_qwen2(root / "ref", seed=6), qwen_tokenizer_dir))


@pytest.mark.slow
def test_sft_default_data_is_the_packaged_gsm8k_sample(stage_assets, tmp_path):
    """With no --train_file, SFT trains on the packaged GSM8K sample as conversational rows (system prompt and
    question, the reference solution without calculator notes as the answer), written once into output_dir/data."""
    from mindrlhf import sft

    out = tmp_path / "sft"
    assert sft.main(["--model", str(stage_assets["model"]), "--output_dir", str(out), "--max_steps", "1",
                     "--batch_size", "2", "--max_length", "320", "--progress_bar", "false", *_PIN]) == 0
    rows = [json.loads(line) for line in (out / "data" / "gsm8k_sft_sample.jsonl").read_text().splitlines()]
    first = json.loads(GSM8K.read_text().splitlines()[0])
    assert len(rows) == len(GSM8K.read_text().splitlines())
    assert [m["role"] for m in rows[0]["prompt"]] == ["system", "user"] and rows[0]["prompt"][1]["content"] == \
        first["question"]
    answer = rows[0]["completion"][0]["content"]
    assert "<<" not in answer and answer.endswith("#### 72")
    assert _metrics(out)[0]["num_tokens"] > 0


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "orpo"])
def test_recompute_auto_sizes_the_update_by_the_rows_not_max_length(stage_assets, tmp_path, stage, caplog):
    """``recompute auto`` estimates the largest micro-batch the stage's rows can form (< 400 positions a row here),
    not rows of ``max_length`` (4096): under a budget of a quarter of the max_length estimate it keeps the
    activations, and its logged micro-batch is the rows' own."""
    import importlib
    import logging
    import re

    from mindrlhf.parallel.groups import init_run_layout
    from mindrlhf.parallel.layout import ParallelLayout
    from mindrlhf.trainer.memory import MicroBatchExtent, activation_bytes

    rows = 2 if stage == "sft" else 4  # micro_batch_size 2: pairs are two rows each
    config = json.loads((Path(stage_assets["model"]) / "config.json").read_text())
    config = type("C", (), {**config, "head_dim": config["hidden_size"] // config["num_attention_heads"]})
    max_length = activation_bytes(config, MicroBatchExtent.padded(rows, 4096, 0 if stage == "rm" else None),
                                  layers=config.num_hidden_layers)
    cfg = getattr(importlib.import_module("mindrlhf.configs.offline"), f"parse_{stage}_args")(
        _argv(stage, stage_assets, tmp_path / "out", max_length=4096, recompute="auto",
              memory_budget_gb=max_length / 4 / 2 ** 30))
    with caplog.at_level(logging.INFO, logger="mindrlhf.trainer.memory"):
        trainer = importlib.import_module(f"mindrlhf.{stage}").build_trainer(
            cfg, init_run_layout(ParallelLayout(dp=1), ParallelLayout(dp=1), 0, 1))
    (line,) = [r.getMessage() for r in caplog.records if "recompute auto" in r.getMessage()]
    assert trainer.updater.recompute == "none", line
    assert 0 < int(re.search(r"\((\d+) positions\)", line).group(1)) < rows * 400


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "orpo"])
def test_static_layer_graphs_get_at_most_their_shapes_of_micro_batches(stage_assets, tmp_path, stage, caplog):
    """Rows whose lengths would form more micro-batch shapes than the static layer graphs compile (8): with
    ``layer_graph_shapes static`` every step's micro-batches keep to 8 shapes, logged once; with ``dynamic`` they
    are padded to the bucket only, more than 8 shapes. A shape is the rows' width for padded rows (SFT, ORPO) and
    the (prompt, completion) widths for pairs packed behind their prompt (RM, DPO: the layer graphs see both)."""
    import importlib
    import logging

    from mindrlhf.parallel.groups import init_run_layout
    from mindrlhf.parallel.layout import ParallelLayout

    def words(n):
        return " ".join(["seven"] * n)

    rows = [(words(p), words(c)) for p in (10, 40, 70, 100) for c in (10, 60, 110, 160, 210)]
    path = tmp_path / "rows.jsonl"
    if stage == "sft":
        lines = [{"prompt": p, "completion": " " + c} for p, c in rows]
    else:
        lines = [{"prompt": p, "chosen": " " + c, "rejected": " " + words(5)} for p, c in rows]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    module = importlib.import_module(f"mindrlhf.{stage}")
    parse = getattr(importlib.import_module("mindrlhf.configs.offline"), f"parse_{stage}_args")
    shapes = {}
    for mode in ("static", "dynamic"):
        argv = _argv(stage, stage_assets, tmp_path / mode, max_length=512, train_file=path, valid_file="",
                     batch_size=4, micro_batch_size=1, layer_graph_shapes=mode)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="mindrlhf"):
            trainer = module.build_trainer(parse(argv), init_run_layout(ParallelLayout(dp=1), ParallelLayout(dp=1),
                                                                        0, 1))
        logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("micro-batch widths")]
        assert len(logged) == (mode == "static"), logged
        data = trainer.dataset
        shapes[mode] = {(mb["input_ids"].shape, mb["completion_ids"].shape if stage in ("rm", "dpo") else None)
                        for index in range(len(data))
                        for mb in trainer.micro_batches(trainer.ordered(data.batch(0, index), data.columns), "train")}
    assert len(shapes["static"]) <= 8 < len(shapes["dynamic"]), shapes

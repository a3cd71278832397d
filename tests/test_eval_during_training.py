"""Evaluation while the policy stages train (GRPO and PPO: ``eval_steps``; SFT and DPO: ``eval_generation``
at their ``eval_steps``). Every N steps and at the last, the run's own sampler answers held-out GSM8K questions as
``mindrlhf-eval`` would: the ``eval/*`` rows (``eval/reward/<fn>`` included) equal ``mindrlhf-eval`` on that step's
checkpoint with the same questions and settings."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_runs import (
    DEFAULT_REWARDS,
    EVAL_KEYS,
    byhand,
    byhand_only,
    grpo_args,
    launch_env,
    run_cli,
    same_as_mindrlhf_eval,
)

EVAL = {"eval_steps": 1, "eval_limit": 4}


def _rows(out: Path) -> list:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_grpo_eval_rows_equal_mindrlhf_eval_on_each_checkpoint(grpo_assets, tmp_path):
    out = tmp_path / "grpo"
    # A reward that reads the completion's text (a random model's are long and varied), and one that checks the
    # question column and the prompt it is given: eval/reward/<fn> are the run's own functions on the eval answers.
    rewards = (*DEFAULT_REWARDS, "e2e_rewards:length_reward", "e2e_rewards:trl_signature_reward")
    proc = run_cli(grpo_args(grpo_assets, out, max_steps=2, max_completion_length=12, reward_funcs=rewards, **EVAL),
                   env_extra={"PYTHONPATH": launch_env()["PYTHONPATH"]}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2] and all(set(EVAL_KEYS) <= set(r) for r in rows)
    assert (out / "eval_accuracy.png").is_file()
    assert all(r["eval/reward/length_reward"] > 0 for r in rows)
    same_as_mindrlhf_eval(out, rows, 12, rewards, limit=EVAL["eval_limit"])


@pytest.mark.slow
@byhand_only("GRPO's test runs the rollout stages' one evaluation (PolicyEvaluation)")
def test_ppo_evaluates_every_n_steps_and_at_the_last(grpo_assets, tmp_path):
    """eval_steps 2 on a 3-step PPO run: eval rows at steps 2 and 3 (the last), equal to mindrlhf-eval's."""
    import os
    import subprocess
    import sys

    from grpo_runs import REPO

    out = tmp_path / "ppo"
    args = {"model": grpo_assets["model"], "train_file": grpo_assets["data"], "output_dir": out, "batch_size": 2,
            "max_new_tokens": 8, "max_prompt_length": 256, "max_steps": 3, "save_steps": 1, "micro_batch_size": 1,
            "reward_funcs": "accuracy", "progress_bar": "false", "recompute": "full", "eval_steps": 2,
            "eval_limit": EVAL["eval_limit"]}
    argv = [x for k, v in args.items() for x in (f"--{k}", str(v))]
    proc = subprocess.run([sys.executable, "-m", "mindrlhf.ppo", *argv], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(out)
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [2, 3]
    same_as_mindrlhf_eval(out, [r for r in rows if "eval/accuracy" in r], 8, ("accuracy",), limit=EVAL["eval_limit"])


def test_a_missing_eval_file_is_refused_before_training(tmp_path):
    from mindrlhf.configs import parse_args
    from mindrlhf.errors import MindRLHFError

    with pytest.raises(MindRLHFError, match="eval_file = '.*nope.jsonl' does not exist; give GSM8K-style question"):
        parse_args(["--eval_steps", "5", "--eval_file", str(tmp_path / "nope.jsonl")])


def _policy_rows(tmp_path: Path) -> dict:
    """SFT rows and DPO pairs on the packaged GSM8K training questions in the default prompt style, answered
    '#### 18' (chosen) / '#### 7' (rejected)."""
    from mindrlhf.data.gsm8k import sft_row
    from mindrlhf.resources import GSM8K_TRAIN_SAMPLE

    questions = [json.loads(line)["question"] for line in GSM8K_TRAIN_SAMPLE.read_text().splitlines()[:8]]
    sft = [sft_row(q, "#### 18") for q in questions]
    pairs = [{"prompt": row["prompt"], "chosen": row["completion"],
              "rejected": [{"role": "assistant", "content": "#### 7"}]} for row in sft]
    files = {}
    for name, rows in (("sft", sft), ("dpo", pairs)):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return files


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", byhand("dpo", "sft runs the offline stages' one evaluation")])
def test_sft_and_dpo_eval_generation_rows_equal_mindrlhf_eval(grpo_assets, tmp_path, stage):
    """eval_generation on a 4-step run with eval_steps 2: eval rows at steps 2 and 4 only, equal to mindrlhf-eval on
    those checkpoints (accuracy, format rate, length, truncation, the built-in rewards), and the curve. (SFT's, DPO's
    and ORPO's trainers are ``PolicyOfflineTrainer``s, the same evaluation code: CI runs SFT's.)"""
    import os
    import subprocess
    import sys

    from grpo_runs import REPO, SUITE_RECOMPUTE

    out = tmp_path / stage
    rows_file = _policy_rows(tmp_path)["sft" if stage == "sft" else "dpo"]  # ORPO trains on DPO's pairs
    args = {"model": grpo_assets["model"], "train_file": rows_file, "output_dir": out,
            "max_steps": 4, "batch_size": 4, "max_length": 256, "save_steps": 1, "eval_steps": 2, "lr": 1e-3,
            "eval_generation": "true", "eval_limit": EVAL["eval_limit"], "eval_max_new_tokens": 8,
            "progress_bar": "false", **SUITE_RECOMPUTE}
    argv = [x for k, v in args.items() for x in (f"--{k}", str(v))]
    proc = subprocess.run([sys.executable, "-m", f"mindrlhf.{stage}", *argv], cwd=REPO, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(out)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert (out / "eval_accuracy.png").is_file()
    same_as_mindrlhf_eval(out, evals, 8, limit=EVAL["eval_limit"])


def test_sft_and_dpo_generation_eval_is_off_by_default_and_checked(tmp_path):
    """SFT/DPO evaluate by generation only with eval_generation (an existing run does not get slower); an eval_file
    nothing would read, or a pipeline layout the sampler cannot run, is refused in one line; the reward model has no
    such option; GRPO's grouped YAML keys of the evaluation still load."""
    from mindrlhf.configs import GRPOConfig
    from mindrlhf.configs.offline import parse_dpo_args, parse_rm_args, parse_sft_args
    from mindrlhf.errors import MindRLHFError

    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    assert parse_sft_args([]).train.eval_generation is False and parse_dpo_args([]).train.eval_generation is False
    with pytest.raises(MindRLHFError, match="eval_file = .* is given but eval_generation is false"):
        parse_sft_args(["--eval_file", str(questions)])
    with pytest.raises(MindRLHFError, match="eval_generation with train_pp = 2"):
        parse_dpo_args(["--eval_generation", "--use_parallel", "--train_pp", "2"])
    with pytest.raises(MindRLHFError, match="unknown option --eval_generation"):
        parse_rm_args(["--eval_generation"])
    cfg = parse_sft_args(["--eval_generation", "--eval_file", str(questions), "--eval_limit", "3"])
    assert (cfg.train.eval_file, cfg.train.eval_limit) == (str(questions), 3)
    grouped = GRPOConfig.from_dict({"train": {"eval_steps": 2, "eval_file": str(questions), "eval_limit": 5,
                                              "eval_num_generations": 3}})
    assert (grouped.train.eval_steps, grouped.train.eval_limit, grouped.train.eval_num_generations) == (2, 5, 3)

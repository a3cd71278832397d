"""Issue 41: evaluation while GRPO and PPO train (``eval_steps``). Every N steps and at the last, the run's own
sampler answers held-out GSM8K questions as ``mindrlhf-eval`` would: the ``eval/*`` rows equal ``mindrlhf-eval`` on
that step's checkpoint with the same questions and settings."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_runs import grpo_args, run_cli

EVAL = {"eval_steps": 1, "eval_limit": 4}
KEYS = {"eval/accuracy": "accuracy", "eval/format_rate": "format_rate", "eval/mean_length": "mean_completion_tokens",
        "eval/truncated_rate": "truncated_rate"}


def _rows(out: Path) -> list:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same_as_mindrlhf_eval(out: Path, rows: list, max_new_tokens: int) -> None:
    from mindrlhf.evaluation.gsm8k_eval import evaluate

    for row in rows:
        step = out / "checkpoints" / f"step_{row['step']:08d}"
        want = evaluate(str(step), limit=EVAL["eval_limit"], max_new_tokens=max_new_tokens, progress=False)
        assert {key: row[key] for key in KEYS} == {key: float(want[name]) for key, name in KEYS.items()}, row["step"]


@pytest.mark.slow
def test_grpo_eval_rows_equal_mindrlhf_eval_on_each_checkpoint(grpo_assets, tmp_path):
    out = tmp_path / "grpo"
    proc = run_cli(grpo_args(grpo_assets, out, max_steps=2, max_completion_length=12, **EVAL), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2] and all(set(KEYS) <= set(r) for r in rows)
    assert (out / "eval_accuracy.png").is_file()
    _same_as_mindrlhf_eval(out, rows, 12)


@pytest.mark.slow
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
    _same_as_mindrlhf_eval(out, [r for r in rows if "eval/accuracy" in r], 8)


def test_a_missing_eval_file_is_refused_before_training(tmp_path):
    from mindrlhf.configs import parse_args
    from mindrlhf.errors import MindRLHFError

    with pytest.raises(MindRLHFError, match="eval_file = '.*nope.jsonl' does not exist; give a GSM8K-style"):
        parse_args(["--eval_steps", "5", "--eval_file", str(tmp_path / "nope.jsonl")])

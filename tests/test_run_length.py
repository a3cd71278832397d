"""The resolved run length: an epochs field sets the number of steps, which the trainer keeps as
``total_steps`` beside the config; the config stays as the user gave it, and the config.yaml a run saves records the
resolved length (``Trainer.run_config``), so running that file again gives the same run."""
from __future__ import annotations

import json

import pytest
import yaml

from grpo_runs import SUITE_RECOMPUTE, grpo_args


@pytest.mark.slow
def test_grpo_epochs_leave_the_config_as_given_and_the_run_stops_at_the_resolved_step(grpo_assets, tmp_path):
    """16 prompts, chunk_size 4, 2 rollouts per step, grpo_epochs 1 and max_steps not given: 2 steps."""
    from mindrlhf import grpo
    from mindrlhf.configs import parse_args

    args = grpo_args(grpo_assets, tmp_path / "run", chunk_size=4, num_rollouts=2, grpo_epochs=1,
                     max_completion_length=4, tensorboard="false", log_completions_steps=0)
    i = args.index("--max_steps")
    cfg = parse_args(args[:i] + args[i + 2:])
    trainer = grpo.build_trainer(cfg)
    assert cfg.train.max_steps == 12 and trainer.total_steps == 2  # the default, untouched; the resolved length
    assert trainer.run_config().train.max_steps == 2 and cfg.train.max_steps == 12
    history = trainer.train()
    assert len(history) == 2 and trainer.step == 2 and cfg.train.max_steps == 12
    saved = yaml.safe_load((tmp_path / "run" / "checkpoints" / "step_00000002" / "config.yaml").read_text())
    assert (saved["train"]["max_steps"], saved["train"]["grpo_epochs"]) == (2, 1)


@pytest.mark.slow
def test_sft_num_epochs_leave_the_config_as_given_and_the_run_stops_at_the_resolved_step(tmp_path,
                                                                                         qwen_tokenizer_dir):
    """6 rows, batch_size 2, num_epochs 2 and max_steps not given: 3 steps an epoch, 6 in all."""
    from mindrlhf import sft
    from mindrlhf.configs.offline import parse_sft_args
    from mindrlhf.parallel.groups import init_run_layout
    from mindrlhf.parallel.layout import ParallelLayout
    from mindrlhf.testing import add_tokenizer, make_tiny_qwen2

    model = add_tokenizer(make_tiny_qwen2(tmp_path / "model", seed=5), qwen_tokenizer_dir)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Q: {i} + {i}?\nA:", "completion": f" {2 * i}"}) + "\n"
                            for i in range(6)))
    flags = {"model": model, "train_file": rows, "output_dir": tmp_path / "out", "num_epochs": 2, "batch_size": 2,
             "micro_batch_size": 2, "max_length": 64, "save_steps": 0, "progress_bar": "false", "tensorboard": "false",
             **SUITE_RECOMPUTE}
    cfg = parse_sft_args([x for k, v in flags.items() for x in (f"--{k}", str(v))])
    before = cfg.train.max_steps
    trainer = sft.build_trainer(cfg, init_run_layout(ParallelLayout(dp=1), ParallelLayout(dp=1), 0, 1))
    assert trainer.total_steps == 6 and cfg.train.max_steps == before
    history = trainer.train()
    assert len(history) == 6 and trainer.step == 6 and cfg.train.max_steps == before
    (saved,) = (tmp_path / "out" / "checkpoints").glob("step_*/config.yaml")
    assert yaml.safe_load(saved.read_text())["train"]["max_steps"] == 6

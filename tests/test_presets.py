"""Every shipped preset names the format reward of the prompt style its data is built with, the job
refuses the other style's format reward, and each CPU-sized preset trains one step."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from mindrlhf.configs import GRPOConfig
from mindrlhf.configs.mindrlhf_yaml import is_sectioned
from mindrlhf.data.gsm8k import (
    DEFAULT_PROMPT_STYLE,
    PROMPT_STYLES,
    check_format_reward,
    detect_prompt_style,
    style_format_reward,
)
from mindrlhf.errors import MindRLHFError
from mindrlhf.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]


def _is_grpo_config(path: Path) -> bool:
    """A GRPOConfig YAML: not a MindFormers model YAML (an sft_path_train / sft_path_infer value), nor MindRLHF's
    sectioned grpo_config.yaml (read by its main.py; tests/test_mindrlhf_main.py trains it)."""
    import yaml

    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    mindformers = isinstance(data.get("model"), dict) and "model_config" in data["model"]
    return not mindformers and not is_sectioned(data)


PRESETS = sorted(p for p in [*REPO.glob("model_configs/**/*.yaml"), *REPO.glob("examples/**/*.yaml")]
                 if _is_grpo_config(p))
CPU_PRESETS = [p for p in PRESETS if GRPOConfig.from_yaml(p).parallel.device_target == "CPU"]


def test_the_presets_are_found():
    names = {p.name for p in PRESETS}
    assert {"grpo_tiny_cpu.yaml", "grpo_config.yaml", "grpo_qwen2_5_7b_8p.yaml"} <= names
    assert {p.name for p in CPU_PRESETS} == {"grpo_tiny_cpu.yaml", "grpo_config.yaml"}


@pytest.fixture(scope="module")
def packaged_data_style(tmp_path_factory, qwen_tokenizer_dir) -> str:
    """The style of the packaged default data as the job builds it (read back from its first prompt)."""
    from mindrlhf.data.dataset import PromptDataset
    from mindrlhf.data.rlhf_data import convert_to_mindrecord
    from mindrlhf.resources import GSM8K_TRAIN_SAMPLE as DEFAULT_TRAIN_DATA

    tokenizer = Tokenizer.from_dir(qwen_tokenizer_dir)
    out = tmp_path_factory.mktemp("default_data") / "sample.mindrecord"
    convert_to_mindrecord(str(DEFAULT_TRAIN_DATA), str(out), tokenizer, show_progress=False)
    data = PromptDataset(out, batch_size=1)
    return detect_prompt_style(tokenizer.decode(data.prompt_ids[0, :data.prompt_length[0]], skip_special_tokens=False))


@pytest.mark.parametrize("path", PRESETS, ids=[p.name for p in PRESETS])
def test_preset_names_the_format_reward_of_its_data_style(path, packaged_data_style):
    cfg = GRPOConfig.from_yaml(path)
    cfg.validate()
    # '' trains on the packaged sample, which the job builds in the default style; a preset that
    # names a mindrecord expects rlhf_data.py's default style (the workflow of docs/tutorials/grpo-gsm8k.md).
    style = packaged_data_style if not cfg.data.mind_dataset_dir else DEFAULT_PROMPT_STYLE
    assert packaged_data_style == DEFAULT_PROMPT_STYLE
    assert style_format_reward(style) in cfg.reward.reward_funcs
    check_format_reward(style, cfg.reward.reward_funcs, str(path))


@pytest.mark.parametrize("style", sorted(PROMPT_STYLES))
def test_the_other_styles_format_reward_is_refused(style):
    other = next(fmt for s, (_, fmt) in PROMPT_STYLES.items() if s != style)
    with pytest.raises(MindRLHFError, match=f"'{other}'.*prompt style '{style}'.*'{style_format_reward(style)}'"):
        check_format_reward(style, ["accuracy", other], "data.mindrecord")
    check_format_reward(style, ["accuracy", style_format_reward(style), "boxed", "pkg.mod:fn"], "data.mindrecord")


def test_detect_prompt_style(qwen_tokenizer_dir):
    from mindrlhf.data.gsm8k import build_prompt, style_system_prompt

    tok = Tokenizer.from_dir(qwen_tokenizer_dir)
    for style in PROMPT_STYLES:
        assert detect_prompt_style(build_prompt("What is 2 + 2?", tok, style_system_prompt(style))) == style
    assert detect_prompt_style(build_prompt("What is 2 + 2?", tok, "Answer tersely.")) is None


@pytest.fixture(scope="module")
def tiny_model_with_tokenizer(grpo_assets) -> Path:
    return grpo_assets["model"]  # 1024 positions: room for the presets' 320 prompt + 256 completion tokens


@pytest.mark.slow
@pytest.mark.parametrize("path", CPU_PRESETS, ids=[p.name for p in CPU_PRESETS])
def test_cpu_preset_trains_one_step(path, tiny_model_with_tokenizer, tmp_path):
    """Each preset as shipped, recompute auto included (the tiny model's activations fit: the whole-model
    graph); in a child process, which takes that graph's memory with it."""
    from grpo_runs import run_cli
    from mindrlhf.trainer.metrics import read_metrics

    out = tmp_path / "run"
    # One step: warmup (a validated bound on max_steps) is the only other field that must change.
    proc = run_cli(["--config", str(path), "--sft_path_train", str(tiny_model_with_tokenizer), "--max_steps", "1",
                    "--warmup_steps", "0", "--output_dir", str(out), "--progress_bar", "false"], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recompute auto -> none for the policy" in proc.stderr
    (row,) = read_metrics(out / "metrics.jsonl")
    cfg = GRPOConfig.from_yaml(path)
    assert row["step"] == 1 and all(math.isfinite(v) for v in row.values() if isinstance(v, float))
    assert f"rewards/{style_format_reward(DEFAULT_PROMPT_STYLE)}/mean" in row
    assert (out / "checkpoints" / "step_00000001" / "policy.ckpt").is_file()
    assert ("kl" in row) == (cfg.algorithm.beta > 0)  # the preset's own settings were used


def test_job_refuses_a_format_reward_its_data_cannot_score(tiny_model_with_tokenizer, tmp_path, capsys):
    from mindrlhf.grpo import main

    rc = main(["--sft_path_train", str(tiny_model_with_tokenizer), "--reward_funcs", "accuracy", "format",
               "--output_dir", str(tmp_path / "run"), "--max_steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "reward_funcs has 'format'" in err and "[accuracy, gsm8k_format]" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

"""GRPOConfig: defaults, YAML (grouped / flat), CLI, type coercion, validation rules, docs, presets."""
from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from mindrlhf.configs import REFERENCES, GRPOConfig, config_reference_markdown, grpo_configs, parse_args
from mindrlhf.configs.base import coerce_value
from mindrlhf.configs.common import RewardConfig
from mindrlhf.configs.ppo import PPOConfig
from mindrlhf.errors import MindRLHFError

REPO = Path(__file__).resolve().parents[1]
PRESETS = [
    REPO / "model_configs" / "qwen_grpo" / "grpo_tiny_cpu.yaml",
    REPO / "model_configs" / "qwen_grpo" / "grpo_qwen2_5_7b_8p.yaml",
    REPO / "examples" / "grpo" / "qwen_grpo_tutorial" / "grpo_config.yaml",
]
SEED_FLAGS = ["sft_path_infer", "sft_path_train", "vocab_path", "merges_file_path", "mind_dataset_dir",
              "save_data_file", "save_ckpt_dir", "use_parallel", "load_sft_checkpoint_infer",
              "load_sft_checkpoint_train", "load_ref_checkpoint", "enable_compile_cache", "use_vllm"]


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def config_with(**values) -> GRPOConfig:
    """A default config with flat overrides, not validated."""
    return GRPOConfig.from_dict(values, validate=False)


# ---------------------------------------------------------------------------------------------- schema
def test_defaults_validate():
    cfg = GRPOConfig()
    cfg.validate()
    assert cfg.algorithm.num_generations == 4 and cfg.algorithm.chunk_size == 2
    assert cfg.algorithm.beta == 0.0 and cfg.algorithm.kl_estimator == "k3"
    assert cfg.algorithm.loss_agg_mode == "seq-mean-token-mean"
    assert cfg.reward.reward_funcs == ["accuracy", "gsm8k_format"] and cfg.reward.reward_weights is None
    assert cfg.optimizer.lr == 2e-5 and cfg.parallel.device_target == "CPU" and cfg.train.max_steps == 12


def test_every_field_has_help_default_and_unique_name():
    index = GRPOConfig.field_index()
    seen = set()
    for gname, gcls in GRPOConfig.groups():
        for f in dataclasses.fields(gcls):
            assert f.name not in seen, f.name
            seen.add(f.name)
            assert len(f.metadata["help"]) > 30, f.name
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            assert index[f.name].group == gname
    assert seen == set(index)
    assert not seen & {g for g, _ in GRPOConfig.groups()}
    for flag in SEED_FLAGS:
        assert flag in index


def test_list_defaults_are_not_shared():
    a, b = GRPOConfig(), GRPOConfig()
    a.reward.reward_funcs.append("boxed")
    assert b.reward.reward_funcs == ["accuracy", "gsm8k_format"]


def test_derived_sizes():
    cfg = config_with(chunk_size=4, num_rollouts=2, num_generations=8, mini_batch_size=16, micro_batch_size=4,
                      num_iterations=2, use_parallel=True, train_dp=2, infer_dp=2)
    cfg.validate()
    assert cfg.prompts_per_step == 8 and cfg.completions_per_step == 64
    assert cfg.mini_batches_per_step == 4 and cfg.optimizer_steps_per_step == 8
    assert cfg.micro_batch_completions == 4 and cfg.grad_accum_steps == 2
    assert cfg.prompts_per_infer_rank == 2 and cfg.world_size == 2 and cfg.needs_old_logprobs
    default = GRPOConfig()
    assert default.mini_batch_completions == 8 and default.micro_batch_completions == 8
    assert default.grad_accum_steps == 1 and not default.needs_old_logprobs
    assert default.checkpoint_dir == str(Path("output/grpo") / "checkpoints")
    assert config_with(save_ckpt_dir="/ck").checkpoint_dir == "/ck"
    assert default.get("beta") == 0.0


# ---------------------------------------------------------------------------------------------- YAML
def test_yaml_grouped(tmp_path):
    path = write(tmp_path, "algorithm:\n  beta: 0.04\n  num_generations: 8\noptimizer:\n  lr: 5.0e-7\n"
                           "generation:\n  stop_token_ids: [151643, 151645]\n")
    cfg = GRPOConfig.from_yaml(path)
    assert cfg.algorithm.beta == 0.04 and cfg.algorithm.num_generations == 8
    assert cfg.optimizer.lr == 5e-7 and cfg.generation.stop_token_ids == [151643, 151645]
    assert cfg.train.max_steps == 12  # untouched default


def test_yaml_flat_and_mixed(tmp_path):
    flat = GRPOConfig.from_yaml(write(tmp_path, "beta: 0.04\nnum_generations: 8\nlr: 5.0e-7\n", "flat.yaml"))
    grouped = GRPOConfig.from_yaml(write(
        tmp_path, "algorithm: {beta: 0.04, num_generations: 8}\noptimizer: {lr: 5.0e-7}\n", "grouped.yaml"))
    mixed = GRPOConfig.from_yaml(write(tmp_path, "beta: 0.04\nalgorithm:\n  num_generations: 8\nlr: 5.0e-7\n",
                                       "mixed.yaml"))
    assert flat == grouped == mixed
    assert flat != GRPOConfig()


def test_yaml_empty_file_and_empty_group(tmp_path):
    assert GRPOConfig.from_yaml(write(tmp_path, "# nothing\n")) == GRPOConfig()
    assert GRPOConfig.from_yaml(write(tmp_path, "algorithm:\n", "g.yaml")) == GRPOConfig()


def test_yaml_numbers(tmp_path):
    # PyYAML reads 1e-6 (no dot) as a string; ints are accepted for float fields.
    cfg = GRPOConfig.from_yaml(write(tmp_path, "lr: 1e-6\nmin_lr: 0\ntemperature: 1\nadam_eps: '1e-8'\n"))
    assert cfg.optimizer.lr == 1e-6 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.min_lr == 0.0 and isinstance(cfg.optimizer.min_lr, float)
    assert cfg.generation.temperature == 1.0 and isinstance(cfg.generation.temperature, float)
    assert cfg.optimizer.adam_eps == 1e-8


@pytest.mark.parametrize("text, key, suggestion", [
    ("betta: 0.1\n", "'betta'", "'beta'"),
    ("algorithm:\n  num_generation: 8\n", "'algorithm.num_generation'", "'num_generations'"),
    ("algoritm:\n  beta: 0.1\n", "'algoritm'", "'algorithm'"),
    ("optimizer:\n  learning_rat: 0.1\n", "'optimizer.learning_rat'", None),
])
def test_yaml_unknown_key(tmp_path, text, key, suggestion):
    path = write(tmp_path, text)
    with pytest.raises(MindRLHFError) as err:
        GRPOConfig.from_yaml(path)
    msg = str(err.value)
    assert str(path) in msg and key in msg and "\n" not in msg
    if suggestion:
        assert f"did you mean {suggestion}" in msg


def test_yaml_field_in_wrong_group(tmp_path):
    path = write(tmp_path, "algorithm:\n  lr: 0.1\n")
    with pytest.raises(MindRLHFError, match=r"'lr' belongs to group 'optimizer'") as err:
        GRPOConfig.from_yaml(path)
    assert str(path) in str(err.value)


def test_yaml_key_set_twice(tmp_path):
    with pytest.raises(MindRLHFError, match=r"'beta' is set twice.*'beta'.*'algorithm.beta'"):
        GRPOConfig.from_yaml(write(tmp_path, "beta: 0.1\nalgorithm:\n  beta: 0.2\n"))


def test_yaml_bad_files(tmp_path):
    with pytest.raises(MindRLHFError, match="config file not found"):
        GRPOConfig.from_yaml(tmp_path / "missing.yaml")
    with pytest.raises(MindRLHFError, match=r"line 2"):
        GRPOConfig.from_yaml(write(tmp_path, "beta: 0.1\n  lr: [1\n", "bad.yaml"))
    with pytest.raises(MindRLHFError, match="top level must be a mapping"):
        GRPOConfig.from_yaml(write(tmp_path, "- beta\n", "list.yaml"))
    with pytest.raises(MindRLHFError, match="group 'algorithm' must be a mapping"):
        GRPOConfig.from_yaml(write(tmp_path, "algorithm: 3\n", "scalar.yaml"))


# ---------------------------------------------------------------------------------------------- types
@pytest.mark.parametrize("text, needle", [
    ("num_generations: eight\n", "num_generations = 'eight' is not an integer"),
    ("num_generations: 4.5\n", "num_generations = 4.5 is not an integer"),
    ("num_generations: true\n", "num_generations = True is not an integer"),
    ("beta: abc\n", "beta = 'abc' is not a number"),
    ("beta: false\n", "beta = False is not a number"),
    ("beta: .nan\n", "is not a finite number"),
    ("use_vllm: 'yes'\n", "use_vllm = 'yes' is not true or false"),
    ("use_vllm: 2\n", "use_vllm = 2 is not true or false (or 1 / 0)"),
    ("reward_funcs: accuracy\n", "reward_funcs = 'accuracy' is not a list of str"),
    ("stop_token_ids: [1, two]\n", "stop_token_ids[1] = 'two' is not an integer"),
    ("reward_weights: [1.0, x]\n", "reward_weights[1] = 'x' is not a number"),
    ("output_dir: 123\n", "output_dir = 123 is not a string"),
    ("algorithm:\n  beta: [1]\n", "algorithm.beta = [1] is not a number"),
    ("dtype: null\n", "dtype = None is not a string"),
])
def test_yaml_type_errors(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(MindRLHFError) as err:
        GRPOConfig.from_yaml(path)
    assert needle in str(err.value) and str(path) in str(err.value)


def test_yaml_type_coercions(tmp_path):
    cfg = GRPOConfig.from_yaml(write(
        tmp_path, "use_vllm: 'false'\njit: False\nreward_weights: null\nnum_rollouts: '3'\ndtype: bf16\n"
                  "resume: auto\nreward_funcs: [accuracy]\n"))
    assert cfg.generation.use_vllm is False and cfg.parallel.jit is False
    assert cfg.reward.reward_weights is None and cfg.algorithm.num_rollouts == 3
    assert cfg.model.dtype == "bfloat16" and cfg.train.resume == "latest"


def test_validate_catches_wrong_python_types():
    cfg = GRPOConfig()
    cfg.algorithm.beta = "0.1"
    cfg.generation.stop_token_ids = [1, 2.5]
    with pytest.raises(MindRLHFError) as err:
        cfg.validate()
    assert "beta = '0.1' is not of type float" in str(err.value)
    assert "stop_token_ids = [1, 2.5] is not of type list[int]" in str(err.value)


# ---------------------------------------------------------------------------------------------- CLI
def test_cli_overrides_yaml_only_for_given_flags(tmp_path):
    path = write(tmp_path, "algorithm:\n  beta: 0.04\n  num_generations: 8\ntrain:\n  max_steps: 7\n")
    cfg = parse_args(["--config", str(path), "--beta", "0.1", "--lr", "2e-6"])
    assert cfg.algorithm.beta == 0.1  # CLI wins
    assert cfg.algorithm.num_generations == 8 and cfg.train.max_steps == 7  # YAML kept
    assert cfg.optimizer.lr == 2e-6  # CLI on top of a default
    assert cfg.generation.temperature == GRPOConfig().generation.temperature == 0.7  # default kept
    assert parse_args([]) == GRPOConfig()


def test_cli_bools():
    assert parse_args(["--tensorboard", "false"]).train.tensorboard is False
    assert parse_args(["--tensorboard", "FALSE"]).train.tensorboard is False
    assert parse_args(["--mask_truncated_completions"]).algorithm.mask_truncated_completions is True
    assert parse_args(["--mask_truncated_completions", "true"]).algorithm.mask_truncated_completions is True
    cfg = parse_args(["--use_parallel", "--train_dp", "2", "--infer_dp", "2"])
    assert cfg.parallel.use_parallel is True and cfg.parallel.train_dp == 2
    with pytest.raises(MindRLHFError, match=r"command line.*--jit = 'yes' is not true or false"):
        parse_args(["--jit", "yes"])


def test_cli_lists():
    cfg = parse_args(["--reward_funcs", "accuracy", "format", "boxed", "--reward_weights", "1", "0.5", "-0.25",
                      "--stop_token_ids", "151643", "151645"])
    assert cfg.reward.reward_funcs == ["accuracy", "format", "boxed"]
    assert cfg.reward.reward_weights == [1.0, 0.5, -0.25]
    assert cfg.generation.stop_token_ids == [151643, 151645]
    assert parse_args(["--stop_token_ids"]).generation.stop_token_ids == []


def test_cli_optional_list_reset_to_none(tmp_path):
    path = write(tmp_path, "reward_weights: [1.0, 2.0]\n")
    assert GRPOConfig.from_yaml(path).reward.reward_weights == [1.0, 2.0]
    assert parse_args(["--config", str(path), "--reward_weights", "none"]).reward.reward_weights is None


def test_cli_resume():
    assert parse_args(["--resume"]).train.resume == "latest"
    assert parse_args(["--resume", "auto"]).train.resume == "latest"
    assert parse_args(["--resume", "/ckpt/step_10"]).train.resume == "/ckpt/step_10"
    assert parse_args([]).train.resume == ""


def test_cli_seed_flags():
    argv = ["--sft_path_infer", "infer_ckpt", "--sft_path_train", "train_ckpt", "--vocab_path", "vocab.json",
            "--merges_file_path", "merges.txt", "--mind_dataset_dir", "gsm8k.mindrecord",
            "--save_data_file", "exp.npz", "--save_ckpt_dir", "ckpts", "--use_parallel", "true",
            "--load_sft_checkpoint_infer", "true", "--load_sft_checkpoint_train", "True",
            "--load_ref_checkpoint", "false", "--enable_compile_cache", "true", "--use_vllm", "false"]
    cfg = parse_args(argv)
    assert cfg.model.sft_path_infer == "infer_ckpt" and cfg.model.sft_path_train == "train_ckpt"
    assert cfg.model.vocab_path == "vocab.json" and cfg.model.merges_file_path == "merges.txt"
    assert cfg.data.mind_dataset_dir == "gsm8k.mindrecord" and cfg.train.save_data_file == "exp.npz"
    assert cfg.train.save_ckpt_dir == "ckpts" and cfg.parallel.use_parallel is True
    assert cfg.model.load_ref_checkpoint is False and cfg.parallel.enable_compile_cache is True
    assert cfg.generation.use_vllm is False


def test_cli_type_error_names_flag():
    with pytest.raises(MindRLHFError, match=r"command line: --num_generations = '4.0' is not an integer"):
        parse_args(["--num_generations", "4.0"])


def test_cli_unknown_flag_suggests():
    with pytest.raises(MindRLHFError, match=r"unknown option --betta \(did you mean '--beta'\?\)"):
        parse_args(["--betta", "0.1"])
    with pytest.raises(MindRLHFError, match=r"unknown option --learning_rate"):
        parse_args(["--learning_rate=0.1"])
    with pytest.raises(MindRLHFError, match=r"unexpected argument 'stray'"):
        parse_args(["stray"])


def test_cli_validates_after_merge(tmp_path):
    path = write(tmp_path, "num_generations: 8\n")
    with pytest.raises(MindRLHFError, match=r"num_generations = 1 must be >= 2"):
        parse_args(["--config", str(path), "--num_generations", "1"])


def test_cli_help_is_grouped():
    text = GRPOConfig.build_parser(prog="grpo").format_help()
    for gname, _ in GRPOConfig.groups():
        assert f"\n{gname}:\n" in text
    for name in GRPOConfig.field_index():
        assert f"--{name}" in text
    assert "--config PATH" in text and "default: 0.2" in text


# ---------------------------------------------------------------------------------------------- validation
RULES = [
    # (overrides, substrings the message must contain)
    (dict(num_generations=1), ["num_generations = 1 must be >= 2"]),
    (dict(chunk_size=0), ["chunk_size = 0 must be >= 1"]),
    (dict(num_rollouts=0), ["num_rollouts = 0"]),
    (dict(num_iterations=0), ["num_iterations = 0"]),
    (dict(mini_batch_size=-1), ["mini_batch_size = -1 must be >= 0"]),
    (dict(beta=-0.1), ["beta = -0.1 must be >= 0"]),
    (dict(epsilon_low=-0.1), ["epsilon_low = -0.1 must be >= 0"]),
    (dict(epsilon_low=1.0), ["epsilon_low = 1.0 must be < 1"]),
    (dict(epsilon_high=-0.01), ["epsilon_high = -0.01 must be >= 0"]),
    (dict(kl_estimator="k4"), ["kl_estimator = 'k4' is not one of k1|k2|k3"]),
    (dict(loss_type="gspo_token"), ["loss_type = 'gspo_token'", "did you mean 'gspo-token'"]),
    (dict(loss_agg_mode="token_mean"), ["loss_agg_mode = 'token_mean'", "did you mean 'token-mean'"]),
    (dict(loss_type="gmpo", loss_agg_mode="token-mean"),
     ["loss_type = 'gmpo' is a mean over sequences and needs loss_agg_mode = 'seq-mean-token-mean'"]),
    (dict(loss_type="luspo", loss_agg_mode="seq-mean-token-sum-norm"), ["loss_type = 'luspo'", "not "
                                                                        "'seq-mean-token-sum-norm'"]),
    (dict(loss_type="clip_cov", clip_cov_lb=5.0, clip_cov_ub=1.0), ["clip_cov_lb = 5.0 >= clip_cov_ub = 1.0"]),
    (dict(delta=1.0), ["delta = 1.0 caps a ratio at or below 1", "use a value > 1 (e.g. 4), or 0 for off"]),
    (dict(multi_objective_aggregation="normalize_then_sum", scale_rewards="batch"),
     ["multi_objective_aggregation = 'normalize_then_sum' forms GDPO's advantages itself", "scale_rewards = 'batch'"]),
    (dict(multi_objective_aggregation="normalize_then_sum", advantage_estimator="rloo"),
     ["advantage_estimator = 'rloo'"]),
    (dict(clip_ratio_c=0.5), ["clip_ratio_c = 0.5 caps a ratio at or below 1", "(e.g. 3)"]),
    (dict(advantage_estimator="reinforce_plus_plus", loss_type="gspo"),
     ["advantage_estimator = 'reinforce_plus_plus' gives one advantage per token", "loss_type = 'gspo' needs one"]),
    (dict(advantage_estimator="reinforce_plus_plus_baseline", off_policy_mask_threshold=0.1),
     ["off_policy_mask_threshold = 0.1 masks completions by the sign of their advantage"]),
    (dict(rollout_rs="seq_mean_k3"), ["rollout_rs = 'seq_mean_k3' needs rollout_rs_threshold > 0"]),
    (dict(rollout_rs_threshold=2.0), ["rollout_rs_threshold = 2.0 applies to rollout_rs only, which is 'none'"]),
    (dict(rollout_rs="seq_max_k2", rollout_rs_threshold=0.1, rollout_rs_threshold_lower=0.5),
     ["rollout_rs_threshold_lower = 0.5 applies to the k1 criteria (token_k1, seq_sum_k1, seq_mean_k1), not "
      "'seq_max_k2'"]),
    (dict(rollout_rs="token_k1", rollout_rs_threshold=0.5), ["rollout_rs = 'token_k1' keeps log-ratios within [log 2, "
                                                              "log 0.5], which is empty"]),
    (dict(rollout_rs="seq_sum_k1", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0),
     ["[log 3, log 2], which is empty"]),
    (dict(rollout_rs="token_k4", rollout_rs_threshold=2.0), ["rollout_rs = 'token_k4' is not one of none|token_k1"]),
    (dict(gamma=0.9), ["gamma = 0.9 applies to advantage_estimator reinforce_plus_plus only, not 'grpo'"]),
    (dict(advantage_estimator="reinforce_plus_plus", gamma=1.5), ["gamma = 1.5 must be <= 1"]),
    (dict(advantage_estimator="reinforce_plus_plus", scale_rewards="batch"),
     ["scale_rewards = 'batch' applies to advantage_estimator grpo only"]),
    (dict(delta=4.0, loss_type="sapo"), ["delta = 4.0 applies to loss_type grpo (and TRL's dapo / bnpo / dr_grpo), "
                                         "not 'sapo'"]),
    (dict(clip_ratio_c=3.0, loss_type="gspo"), ["clip_ratio_c = 3.0 applies to loss_type grpo"]),
    (dict(delta=-1.0), ["delta = -1.0 must be >= 0"]),
    (dict(loss_type="vespo", importance_sampling_correction=True),  # the default mode, sequence_mask
     ["loss_type = 'vespo' folds importance_sampling_correction's per-token weights into its sequence weight, but "
      "importance_sampling_mode = 'sequence_mask' gives one per completion; use token_truncate or token_mask"]),
    (dict(sapo_temperature_pos=0.0), ["sapo_temperature_pos = 0.0 must be > 0"]),
    (dict(clip_cov_ratio=0.0), ["clip_cov_ratio = 0.0 must be > 0"]),
    (dict(scale_rewards="std"), ["scale_rewards = 'std' is not one of group|batch|none"]),
    (dict(ref_model_sync_steps=0), ["ref_model_sync_steps = 0 must be >= 1"]),
    (dict(ref_model_mixup_alpha=0.0), ["ref_model_mixup_alpha = 0.0 must be > 0"]),
    (dict(ref_model_mixup_alpha=1.5), ["ref_model_mixup_alpha = 1.5 must be <= 1"]),
    (dict(reward_funcs=[]), ["reward_funcs is empty"]),
    (dict(reward_funcs=["accuracy", "accuracy"]), ["reward_funcs lists ['accuracy'] more than once"]),
    (dict(reward_weights=[1.0]), ["reward_weights has 1 values", "reward_funcs has 2"]),
    (dict(sync_ref_model=True), ["sync_ref_model = true with beta = 0", "set beta > 0 or sync_ref_model false"]),
    (dict(beta=0.04, load_ref_checkpoint=False, load_sft_checkpoint_train=False),
     ["beta = 0.04 with load_ref_checkpoint = false and load_sft_checkpoint_train = false"]),
    (dict(ref_path="ref", load_ref_checkpoint=False), ["ref_path = 'ref' is ignored with load_ref_checkpoint"]),
    (dict(sft_path_infer="inf", load_sft_checkpoint_infer=False),
     ["sft_path_infer = 'inf' is ignored with load_sft_checkpoint_infer"]),
    (dict(vocab_path="vocab.json"), ["vocab_path = 'vocab.json' and merges_file_path = ''", "both or neither"]),
    (dict(vocab_path="v.json", merges_file_path="m.txt", tokenizer_dir="tok"),
     ["both vocab_path", "tokenizer_dir"]),
    (dict(dtype="float64"), ["dtype = 'float64' is not one of float32|bfloat16|float16"]),
    # generation
    (dict(max_prompt_length=0), ["max_prompt_length = 0 must be >= 1"]),
    (dict(max_completion_length=0), ["max_completion_length = 0 must be >= 1"]),
    (dict(loss_agg_mode="seq-mean-token-sum-norm", max_completion_length=0), ["max_completion_length = 0"]),
    (dict(temperature=0.0), ["temperature = 0.0 must be > 0"]),
    (dict(top_p=0.0), ["top_p = 0.0 must be > 0"]),
    (dict(top_p=1.1), ["top_p = 1.1 must be <= 1"]),
    (dict(top_k=-1), ["top_k = -1 must be >= 0"]),
    (dict(min_p=1.0), ["min_p = 1.0 must be < 1"]),
    (dict(min_p=-0.1), ["min_p = -0.1 must be >= 0"]),
    (dict(repetition_penalty=0.0), ["repetition_penalty = 0.0 must be > 0"]),
    (dict(min_new_tokens=200), ["min_new_tokens = 200 > max_completion_length = 160"]),
    (dict(stop_token_ids=[5, -1]), ["stop_token_ids[1] = -1 must be >= 0"]),
    # optimizer
    (dict(lr=0.0), ["lr = 0.0 must be > 0"]),
    (dict(lr=1e6), ["lr = 1000000.0 must be <= 0.1"]),  # was accepted: weights blew up to 2e6, all finite
    (dict(temperature=50.0), ["temperature = 50.0 must be <= 10.0"]),
    (dict(adam_eps=1.0), ["adam_eps = 1.0 must be <= 0.01"]),
    (dict(weight_decay=5.0), ["weight_decay = 5.0 must be <= 1.0"]),
    (dict(epsilon_high=100.0), ["epsilon_high = 100.0 must be <= 10.0"]),
    (dict(lr=1e-6, min_lr=1e-5), ["min_lr = 1e-05 > lr = 1e-06"]),
    (dict(warmup_steps=30), ["warmup_steps = 30 > max_steps = 12"]),
    (dict(lr_schedule="cosin"), ["lr_schedule = 'cosin'", "did you mean 'cosine'"]),
    (dict(weight_decay=-1.0), ["weight_decay = -1.0 must be >= 0"]),
    (dict(adam_beta1=1.0), ["adam_beta1 = 1.0 must be < 1"]),
    (dict(adam_beta2=1.0), ["adam_beta2 = 1.0 must be < 1"]),
    (dict(adam_eps=0.0), ["adam_eps = 0.0 must be > 0"]),
    (dict(max_grad_norm=-1.0), ["max_grad_norm = -1.0 must be >= 0"]),
    (dict(max_consecutive_nonfinite=0), ["max_consecutive_nonfinite = 0 must be >= 1"]),
    # parallel
    (dict(train_tp=2, infer_tp=2), ["use_parallel = false but train_tp = 2, infer_tp = 2"]),
    (dict(use_parallel=True, train_dp=2), ["train world size", "= 2 != infer world size", "= 1"]),
    (dict(use_parallel=True, train_micro_batches=2), ["train_micro_batches = 2 with train_pp = 1"]),
    (dict(use_parallel=True, train_dp=0), ["train_dp = 0 must be >= 1"]),
    (dict(device_target="NPU"), ["device_target = 'NPU' is not one of CPU|Ascend|GPU"]),
    # batch geometry (defaults: 2 prompts x 4 = 8 completions)
    (dict(use_parallel=True, infer_dp=2, train_dp=2, chunk_size=3, num_generations=4, mini_batch_size=12),
     ["chunk_size = 3 is not divisible by infer_dp = 2"]),
    (dict(mini_batch_size=3), ["mini_batch_size = 3 does not divide", "= 2*1*4 = 8"]),
    (dict(use_parallel=True, train_dp=4, infer_dp=2, infer_tp=2, mini_batch_size=2),
     ["mini_batch_size = 2 is not divisible by train_dp = 4"]),
    (dict(use_parallel=True, train_dp=4, infer_dp=2, infer_tp=2, num_generations=3),
     ["mini_batch_size = 6 (= all completions) is not divisible by train_dp = 4"]),
    (dict(micro_batch_size=3), ["micro_batch_size = 3 does not divide", "= 8 / 1 = 8"]),
    (dict(micro_batch_size=16), ["micro_batch_size = 16 does not divide"]),
    (dict(use_parallel=True, train_pp=2, infer_tp=2, train_micro_batches=3, micro_batch_size=4),
     ["micro_batch_size = 4 is not divisible by train_micro_batches = 3"]),
    # train
    (dict(max_steps=0), ["max_steps = 0 must be >= 1"]),
    (dict(seed=-1), ["seed = -1 must be >= 0"]),
    (dict(save_steps=-1), ["save_steps = -1 must be >= 0"]),
    (dict(keep_last=-1), ["keep_last = -1 must be >= 0"]),
    (dict(logging_steps=0), ["logging_steps = 0 must be >= 1"]),
    (dict(log_completions_steps=-1), ["log_completions_steps = -1 must be >= 0"]),
    (dict(output_dir=""), ["output_dir is empty"]),
    (dict(save_data_file="x.npz", replay_data_file="x.npz"), ["save_data_file and replay_data_file are both"]),
]


@pytest.mark.parametrize("overrides, needles", RULES, ids=[",".join(r[0]) for r in RULES])
def test_validation_rule(overrides, needles):
    cfg = config_with(**overrides)
    with pytest.raises(MindRLHFError) as err:
        cfg.validate()
    msg = str(err.value)
    assert msg.startswith("invalid config") and "\n" not in msg
    for needle in needles:
        assert needle in msg, msg


def test_validation_reports_every_field_error_at_once():
    with pytest.raises(MindRLHFError) as err:
        config_with(beta=-1.0, top_p=2.0, lr=0.0).validate()
    msg = str(err.value)
    assert "beta = -1.0" in msg and "top_p = 2.0" in msg and "lr = 0.0" in msg


def test_validation_names_the_file(tmp_path):
    path = write(tmp_path, "beta: -1.0\n")
    with pytest.raises(MindRLHFError, match=rf"invalid config \({path}\): beta = -1.0 must be >= 0"):
        GRPOConfig.from_yaml(path)


def test_valid_combinations():
    # Reference from a copy of the loaded policy; sync with beta > 0; pipeline micro-batches.
    config_with(beta=0.04, load_ref_checkpoint=False).validate()
    config_with(beta=0.04, sync_ref_model=True, ref_model_mixup_alpha=0.6).validate()
    config_with(use_parallel=True, train_pp=2, infer_tp=2, train_micro_batches=2, micro_batch_size=4).validate()
    config_with(use_parallel=True).validate()  # one msrun worker
    config_with(save_data_file="a.npz", replay_data_file="b.npz").validate()
    config_with(reward_weights=[2.0, -1.0]).validate()
    config_with(mini_batch_size=4, num_iterations=2, micro_batch_size=2).validate()
    for mode in ("token_truncate", "token_mask"):  # VESPO folds the per-token weights in (TRL's two modes)
        config_with(loss_type="vespo", importance_sampling_correction=True, importance_sampling_mode=mode).validate()


def test_use_vllm(monkeypatch):
    config_with(use_vllm=True).validate()  # on CPU: vLLM's CPU build, in its own environment
    with pytest.raises(MindRLHFError, match=r"use_vllm = true with infer_tp = 2: .*set infer_tp 1"):
        config_with(use_vllm=True, use_parallel=True, train_tp=2, infer_tp=2).validate()
    real = importlib.util.find_spec
    monkeypatch.setattr(grpo_configs.importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm_mindspore" else real(name, *a))
    with pytest.raises(MindRLHFError, match=r"use_vllm = true on Ascend needs the vllm_mindspore package"):
        config_with(use_vllm=True, device_target="Ascend").validate()
    monkeypatch.setattr(grpo_configs.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm_mindspore" else real(name, *a))
    config_with(use_vllm=True, device_target="Ascend").validate()


# ---------------------------------------------------------------------------------------------- save / docs
def test_round_trip(tmp_path):
    cfg = config_with(beta=0.04, lr=3e-7, reward_weights=[1.0, 0.5], stop_token_ids=[1, 2], dtype="bf16",
                      resume="latest", use_parallel=True, train_tp=2, infer_tp=2, tensorboard=False,
                      loss_type="gspo-token", sft_path_train="/m/qwen")
    cfg.validate()
    path = tmp_path / "out" / "saved.yaml"
    cfg.save_yaml(path)
    again = GRPOConfig.from_yaml(path)
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()
    assert list(cfg.to_dict()) == [g for g, _ in GRPOConfig.groups()]
    assert cfg.to_dict()["algorithm"]["beta"] == 0.04
    default_path = tmp_path / "default.yaml"
    GRPOConfig().save_yaml(default_path)
    assert GRPOConfig.from_yaml(default_path) == GRPOConfig()


@pytest.mark.parametrize("stage", list(REFERENCES))
def test_docs_reference_is_up_to_date(stage):
    cls, path, _ = REFERENCES[stage]
    committed = (REPO / path).read_text(encoding="utf-8")
    assert committed == config_reference_markdown(stage), (
        f"{path} is stale; regenerate with: python -c \"from mindrlhf.configs import write_config_references; "
        "write_config_references()\"")
    for name in cls.field_index():
        assert f"| `{name}` |" in committed


#: A measured figure in a help text: a time, a memory size or a speed-up ratio.
_FIGURE = re.compile(r"\d[\d.]*\s*(?:s|ms|min|GiB|MiB|GB)\b|\d(?:\.\d+)?x\b")


@pytest.mark.parametrize("stage", list(REFERENCES))
def test_help_says_what_a_field_does_and_leaves_figures_to_bench(stage):
    """Help strings carried benchmark figures (recompute's was 907 characters: GiB, seconds) that go
    stale with every speed-up. A help says what the field does and where the figures are (bench/README.md)."""
    carrying = {name: _FIGURE.findall(f.help) for name, f in REFERENCES[stage][0].field_index().items()
                if _FIGURE.search(f.help)}
    assert not carrying, carrying
    assert "bench/README.md" in REFERENCES[stage][0].field_index()["recompute"].help


@pytest.mark.parametrize("stage", list(REFERENCES))
def test_help_and_reference_show_the_stages_own_defaults(stage):
    """A stage may give a shared group another default (RM's and DPO's output_dir): help and the reference
    show the value the stage starts with, not the shared field's (both said output/sft for rm and dpo)."""
    import re

    import yaml

    cls, _, _ = REFERENCES[stage]
    start = cls()
    reference = config_reference_markdown(stage)
    flags = " ".join(cls.build_parser().format_help().split())  # argparse wraps lines
    for name, info in cls.field_index().items():
        shown = re.search(rf"^\| `{name}` \| `[^`]*` \| `(.*?)` \|", reference, re.M).group(1)
        value = coerce_value(yaml.safe_load(shown), info.type, name=name, source="reference")
        assert value == start.get(name), (name, shown)
        assert f"default: {shown}]" in flags, name
    if stage in ("rm", "dpo"):
        assert start.train.output_dir == f"output/{stage}" and f"default: 'output/{stage}'" in flags


@pytest.mark.parametrize("stage", ["rm", "dpo"])
def test_pair_stages_do_not_promise_a_default_train_file(stage, tmp_path, capsys):
    """RM's and DPO's train_file help said '' meant the packaged GSM8K sample; both require the file."""
    import mindrlhf.dpo
    import mindrlhf.rm

    cls, _, _ = REFERENCES[stage]
    text = cls.field_index()["train_file"].help
    assert "packaged GSM8K sample" not in text and "Required" in text
    main = {"rm": mindrlhf.rm.main, "dpo": mindrlhf.dpo.main}[stage]
    assert main(["--output_dir", str(tmp_path / "o")]) == 2
    assert "--train_file is required" in capsys.readouterr().err


@pytest.mark.parametrize("stage", list(REFERENCES))
def test_unknown_key_names_the_stages_own_reference(stage, tmp_path):
    """An unknown key in an SFT (RM, DPO, PPO) YAML pointed to the GRPO reference, docs/config_reference.md."""
    cls, path, _ = REFERENCES[stage]
    assert (REPO / path).is_file()
    for text, key in (("max_stepz: 3\n", "'max_stepz'"), ("train:\n  max_stepz: 3\n", "'train.max_stepz'")):
        config = write(tmp_path, text)
        with pytest.raises(MindRLHFError) as err:
            cls.from_yaml(config)
        assert str(err.value).endswith(f"unknown config key {key} (did you mean 'max_steps'?); see {path}")


# ---------------------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("path", PRESETS, ids=[p.name for p in PRESETS])
def test_presets_load_and_validate(path):
    cfg = GRPOConfig.from_yaml(path)
    cfg.validate()
    assert parse_args(["--config", str(path)]) == cfg


def test_preset_values():
    tiny = GRPOConfig.from_yaml(PRESETS[0])
    assert tiny.algorithm.num_generations == 4 and tiny.algorithm.chunk_size == 2
    assert tiny.generation.max_completion_length == 32 and tiny.train.max_steps == 3
    assert tiny.parallel.device_target == "CPU" and not tiny.parallel.use_parallel
    big = GRPOConfig.from_yaml(PRESETS[1])
    p = big.parallel
    assert (p.train_dp, p.train_tp, p.train_pp, p.infer_dp, p.infer_tp) == (1, 4, 2, 2, 4)
    assert p.device_target == "Ascend" and p.use_parallel and big.world_size == 8
    assert big.model.dtype == "bfloat16" and big.algorithm.num_generations == 8 and big.algorithm.beta == 0.04


@pytest.mark.parametrize("loss_type,expected", [
    ("grpo", ("grpo", "seq-mean-token-mean")), ("gspo", ("gspo", "seq-mean-token-mean")),
    ("bnpo", ("grpo", "token-mean")), ("dapo", ("grpo", "token-mean")),
    ("dr_grpo", ("grpo", "seq-mean-token-sum-norm"))])
def test_trl_loss_type_names_resolve_to_loss_and_aggregation(loss_type, expected):
    assert parse_args(["--loss_type", loss_type]).policy_loss == expected
    # The alias's own aggregation may be given too; our names keep whatever aggregation is configured.
    assert parse_args(["--loss_type", loss_type, "--loss_agg_mode", expected[1]]).policy_loss == expected
    if loss_type in ("grpo", "gspo"):
        assert parse_args(["--loss_type", loss_type, "--loss_agg_mode", "token-mean"]).policy_loss == \
            (loss_type, "token-mean")


def test_trl_loss_type_with_a_different_aggregation_is_an_error():
    with pytest.raises(MindRLHFError, match="loss_type = 'dapo' \\(TRL's name\\) means loss_agg_mode = 'token-mean', "
                                            "but loss_agg_mode = 'seq-mean-token-sum-norm'"):
        parse_args(["--loss_type", "dapo", "--loss_agg_mode", "seq-mean-token-sum-norm"])


def test_advantage_estimator_resolves_with_scale_rewards():
    assert parse_args([]).advantage_estimator == "grpo"
    assert parse_args(["--scale_rewards", "none"]).advantage_estimator == "dr_grpo"
    assert parse_args(["--scale_rewards", "batch"]).advantage_estimator == "batch_std"
    assert parse_args(["--advantage_estimator", "rloo"]).advantage_estimator == "rloo"
    assert parse_args(["--advantage_estimator", "dr_grpo"]).advantage_estimator == "dr_grpo"
    with pytest.raises(MindRLHFError, match="scale_rewards = 'batch' applies to advantage_estimator grpo only, not "
                                            "'dr_grpo'"):
        parse_args(["--advantage_estimator", "dr_grpo", "--scale_rewards", "batch"])
    with pytest.raises(MindRLHFError, match="scale_rewards = 'none' applies to advantage_estimator grpo only"):
        parse_args(["--advantage_estimator", "rloo", "--scale_rewards", "none"])


def test_overlong_buffer_checks():
    with pytest.raises(MindRLHFError, match="overlong_buffer_length = 160 must be below max_completion_length = 160"):
        parse_args(["--overlong_buffer_length", "160"])
    with pytest.raises(MindRLHFError, match="reward_funcs names a function 'overlong'"):
        parse_args(["--overlong_buffer_length", "16", "--reward_funcs", "accuracy", "overlong"])
    assert parse_args(["--overlong_buffer_length", "16"]).reward.overlong_penalty == 1.0


@pytest.mark.parametrize("group, values, needle", [
    (grpo_configs.AlgorithmConfig, dict(sync_ref_model=True), "sync_ref_model = true with beta = 0"),
    (grpo_configs.GRPORewardConfig, dict(reward_funcs=[]), "reward_funcs is empty"),
    (grpo_configs.GRPORewardConfig, dict(overlong_buffer_length=4, reward_funcs=["my.rewards:overlong"]),
     "reward_funcs names a function 'overlong'"),
    (RewardConfig, dict(reward_funcs=["accuracy"], reward_weights=[1.0, 2.0]),
     "reward_weights has 2 values [1.0, 2.0] but reward_funcs has 1"),
    (grpo_configs.AlgorithmConfig, dict(loss_type="dapo", loss_agg_mode="seq-mean-token-sum-norm"),
     "loss_type = 'dapo' (TRL's name) means loss_agg_mode = 'token-mean'"),
    (grpo_configs.GenerationConfig, dict(min_new_tokens=200), "min_new_tokens = 200 > max_completion_length = 160"),
    (grpo_configs.ModelConfig, dict(ref_path="ref", load_ref_checkpoint=False),
     "ref_path = 'ref' is ignored with load_ref_checkpoint"),
    (grpo_configs.ModelConfig, dict(vocab_path="vocab.json"), "vocab_path = 'vocab.json' and merges_file_path = ''"),
    (grpo_configs.ParallelConfig, dict(use_parallel=True, train_dp=2), "= 2 != infer world size"),
])
def test_each_group_checks_its_own_fields(group, values, needle):
    """A rule among one group's fields is that group's ``check`` (GRPOConfig keeps only the rules across
    groups), so a stage that reuses the group (PPO: generation, parallel) gets the rule with it."""
    errors = []
    group(**values).check(errors)
    assert len(errors) == 1 and needle in errors[0], errors
    errors = []
    group().check(errors)
    assert errors == []


def test_ppo_gets_the_generation_and_layout_rules_of_the_groups_it_shares():
    """PPO's config had its own copies of the min_new_tokens and world-size rules with blunter messages; the shared
    groups now check them, with the same words as GRPO's (the fix, the factors of each world size)."""
    for cls in (GRPOConfig, PPOConfig):
        cfg = cls.from_dict(dict(min_new_tokens=200), validate=False)
        with pytest.raises(MindRLHFError) as err:
            cfg.validate()
        assert "min_new_tokens = 200 > max_completion_length = 160; lower min_new_tokens" in str(err.value)
        assert str(err.value).count("min_new_tokens = 200") == 1
        cfg = cls.from_dict(dict(use_parallel=True, train_dp=2), validate=False)
        with pytest.raises(MindRLHFError) as err:
            cfg.validate()
        assert "train world size train_dp*train_tp*train_pp = 2*1*1 = 2 != infer world size infer_dp*infer_tp = " \
               "1*1 = 1" in str(err.value), str(err.value)


# ---------------------------------------------------------------------------------------------- the reward group
#: The reward fields as a YAML of the layout before the reward group writes them, and the same config now.
OLD_REWARD_LAYOUT = {
    GRPOConfig: ("algorithm:\n  beta: 0.0\n  reward_funcs: [accuracy, format]\n  reward_weights: [1.0, 0.5]\n"
                 "  reward_errors: skip\n  overlong_buffer_length: 8\n  overlong_penalty: 0.5\n",
                 "algorithm:\n  beta: 0.0\nreward:\n  reward_funcs: [accuracy, format]\n  reward_weights: [1.0, 0.5]\n"
                 "  reward_errors: skip\n  overlong_buffer_length: 8\n  overlong_penalty: 0.5\n"),
    PPOConfig: ("algorithm:\n  kl_coef: 0.1\n  reward_funcs: [gsm8k_format]\n  reward_errors: skip\n"
                "  reward_output_scaling: 2.0\n  reward_output_bias: -1.0\n  max_reward_clip: 5.0\n"
                "  truncated_penalty: -2.0\n",
                "algorithm:\n  kl_coef: 0.1\nreward:\n  reward_funcs: [gsm8k_format]\n  reward_errors: skip\n"
                "  reward_output_scaling: 2.0\n  reward_output_bias: -1.0\n  max_reward_clip: 5.0\n"
                "  truncated_penalty: -2.0\n"),
}


@pytest.mark.parametrize("cls", [GRPOConfig, PPOConfig], ids=["grpo", "ppo"])
def test_reward_fields_written_under_algorithm_still_load(cls, tmp_path, caplog, monkeypatch):
    """The reward fields moved from the algorithm group to one reward group shared by GRPO and PPO. A YAML
    of the old layout (a user's file, a run's recorded config.yaml) loads to the same config, with one warning
    naming the new place, once per process; the flags keep their names."""
    import mindrlhf.configs.base as base

    monkeypatch.setattr(base, "_WARNED_MOVED", set())
    old_text, new_text = OLD_REWARD_LAYOUT[cls]
    new = cls.from_yaml(write(tmp_path, new_text, "new.yaml"))
    with caplog.at_level("WARNING", logger="mindrlhf.configs.base"):
        old = cls.from_yaml(write(tmp_path, old_text, "old.yaml"))
        assert cls.from_yaml(tmp_path / "old.yaml") == old
    assert old == new and old.reward.reward_errors == "skip"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert "algorithm.reward_funcs" in warnings[0] and "moved to the 'reward' group" in warnings[0]
    assert "write 'reward: {reward_funcs: ...}'" in warnings[0]
    flags = ["--reward_funcs", "accuracy", "--reward_errors", "skip"]
    parse = cls.parse_args
    assert parse(flags).reward.reward_funcs == ["accuracy"] and parse(flags).reward.reward_errors == "skip"
    # Only the old group is accepted besides the new one: anywhere else is still the wrong group.
    with pytest.raises(MindRLHFError, match=r"'generation.reward_funcs': field 'reward_funcs' belongs to group "
                                            r"'reward'"):
        cls.from_yaml(write(tmp_path, "generation:\n  reward_funcs: [accuracy]\n", "wrong.yaml"))
    with pytest.raises(MindRLHFError, match=r"'reward_funcs' is set twice"):
        cls.from_yaml(write(tmp_path, "algorithm:\n  reward_funcs: [accuracy]\nreward:\n  reward_funcs: [accuracy]\n",
                            "twice.yaml"))


@pytest.mark.parametrize("cls", [GRPOConfig, PPOConfig], ids=["grpo", "ppo"])
def test_an_old_recorded_config_regroups_to_the_current_one(cls, tmp_path):
    """What a resume compares: a config.yaml recorded before the reward group (its reward fields under algorithm),
    regrouped, equals this version's to_dict of the same config, field for field."""
    old_text, new_text = OLD_REWARD_LAYOUT[cls]
    now = cls.from_yaml(write(tmp_path, new_text)).to_dict()
    recorded = {g: dict(v) for g, v in now.items() if g != "reward"}
    recorded["algorithm"].update(now["reward"])  # the old layout: the reward fields among the algorithm's
    assert cls.regroup(recorded) == now
    assert cls.regroup(now) == now
    assert "reward" not in yaml.safe_load(old_text) and cls.MOVED_FIELDS["reward_funcs"] == "algorithm"


def test_grpo_and_ppo_share_one_reward_group():
    """One RewardConfig holds the rule rewards' fields and their check; each stage extends it with its own terms."""
    from mindrlhf.configs.ppo import PPORewardConfig

    shared = {f.name for f in dataclasses.fields(RewardConfig)}
    assert shared == {"reward_funcs", "reward_weights", "reward_errors"}
    for cls, group in ((GRPOConfig, grpo_configs.GRPORewardConfig), (PPOConfig, PPORewardConfig)):
        assert dict(cls.groups())["reward"] is group and issubclass(group, RewardConfig)
        assert {n for n, i in cls.field_index().items() if i.group == "algorithm"}.isdisjoint(shared)
        assert {n: cls.field_index()[n].field.metadata["help"] for n in shared} == {
            f.name: f.metadata["help"] for f in dataclasses.fields(RewardConfig)}


@pytest.mark.parametrize("stage", ["grpo", "ppo"])
def test_resume_compares_an_old_layout_checkpoint_config_field_by_field(stage, tmp_path, caplog):
    """A checkpoint's config.yaml written before the reward group (reward fields under algorithm) is compared with
    the resumed run's config field by field: the same values say nothing, a changed reward weight is named (it was
    silently skipped while the saved file had no reward group)."""
    import importlib

    trainer_cls = {"grpo": "GRPOTrainer", "ppo": "PPOTrainer"}[stage]
    trainer_cls = getattr(importlib.import_module(f"mindrlhf.{stage}"), trainer_cls)
    cfg_cls = REFERENCES[stage][0]
    cfg = cfg_cls.from_dict(dict(reward_funcs=["accuracy", "gsm8k_format"], reward_weights=[1.0, 0.5]))
    host = type("Host", (), {"cfg": cfg, "math_groups": trainer_cls.math_groups, "math_fields": trainer_cls.math_fields,
                             "run_config": lambda self: cfg})()

    def old_layout(weights):
        saved = cfg.to_dict()
        reward = saved.pop("reward")
        saved["algorithm"].update(reward, reward_weights=weights)
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False), encoding="utf-8")

    assert "reward" in trainer_cls.math_groups
    old_layout([1.0, 0.5])
    with caplog.at_level("WARNING"):
        trainer_cls.warn_config_changes(host, tmp_path)
    assert not [r for r in caplog.records if "different config" in r.getMessage()]
    old_layout([1.0, 2.0])
    with caplog.at_level("WARNING"):
        trainer_cls.warn_config_changes(host, tmp_path)
    changed = [r.getMessage() for r in caplog.records if "different config" in r.getMessage()]
    assert len(changed) == 1 and "reward_weights [1.0, 2.0] -> [1.0, 0.5]" in changed[0], changed

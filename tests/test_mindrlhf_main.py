"""MindRLHF's current tutorial entry point: main.py's flags and its sectioned grpo_config.yaml (a copy of the
tutorial's file in tests/data/mindrlhf_tutorial/), read onto our fields by mindrlhf.configs.mindrlhf_yaml; one run of
examples/grpo/qwen_grpo_tutorial/main.py on the tiny model."""
from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_runs import read_rows
from mindrlhf.configs import GRPOConfig
from mindrlhf.configs.mindrlhf_yaml import (
    ENVIRONMENT,
    KEYS,
    NESTED,
    REFERENCE_FILE,
    is_sectioned,
    parse_main_args,
    reference_markdown,
    startup_notes,
    translate,
)
from mindrlhf.errors import MindRLHFError
from mindrlhf.rewards import get_reward_fn

REPO = Path(__file__).resolve().parents[1]
CPU_YAML = REPO / "model_configs" / "qwen_grpo" / "grpo_config_mindrlhf_cpu.yaml"
MAIN_PY = REPO / "examples" / "grpo" / "qwen_grpo_tutorial" / "main.py"
#: The tutorial's launch (README "四、开启vLLM推理功能", run_grpo_vllm.sh), paths aside.
TUTORIAL_FLAGS = ["--tokenizer_dir", "M", "--dataset_file", "D", "--save_checkpoint_dir", "S",
                  "--actor_checkpoint_path", "M", "--ref_checkpoint_path", "M", "--generate_checkpoint_path", "M",
                  "--verifier_function", "qwen_accuracy_reward,format_reward", "--verifier_weight", "1.0,1.0"]
#: Its environment (run_grpo_vllm.sh and the README).
TUTORIAL_ENV = {"vLLM_MODEL_BACKEND": "MindFormers", "vLLM_MODEL_MEMORY_USE_GB": "40", "HCCL_EXEC_TIMEOUT": "7200",
                "MS_JIT_MODULES": "vllm_mindspore,research", "MS_ALLOC_CONF": "memory_tracker:False,enable_vmm:True"}


@pytest.fixture(scope="module")
def tutorial(data_dir) -> dict:
    """MindRLHF's grpo_config.yaml as its tutorial ships it."""
    return yaml.safe_load((data_dir / "mindrlhf_tutorial" / "grpo_config.yaml").read_text(encoding="utf-8"))


def _leaves(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if dotted in NESTED:
            out.update(_leaves(value, dotted + "."))
        elif isinstance(value, dict) and not prefix:
            out.update(_leaves(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _write(tmp_path: Path, data, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data, encoding="utf-8")
    return path


def _error(fn, *args) -> str:
    with pytest.raises(MindRLHFError) as err:
        fn(*args)
    assert "\n" not in str(err.value)
    return str(err.value)


# ---------------------------------------------------------------------------------------------
# The table, on the tutorial's own file
# ---------------------------------------------------------------------------------------------
def test_every_key_of_the_tutorial_yaml_is_mapped_or_listed_as_ignored(tutorial):
    given = _leaves(tutorial)
    assert len(given) == 135 and set(given) <= set(KEYS)
    found = translate(tutorial, "t")
    ignored = {line.split(" (", 1)[0] for line in found.ignored}
    used = {key for key in given if KEYS[key].convert is not None}
    # each key is either read (a field, or a check / a factor of another key's field) or named in the log, never both
    assert used | ignored == set(given) and not used & ignored
    assert {written for _, written in found.fields.values()} <= used
    assert (len(used), len(found.ignored)) == (63, 72)


def test_the_tutorial_yaml_translates_to_these_fields(tutorial):
    """Hand-worked: chunk_size 1 per generator replica x data_parallel 2 = 2 prompts a call; batch_size 1 x
    micro_batch_num 2 (pipeline_stage 2) x pack_num 1 = 2 completions per update, x data_parallel 1; 2 x 4 rollouts
    x 8 generations = 64 completions = 32 updates a step, so warmup_step 10 (updates) is 1 training step."""
    fields = {name: value for name, (value, _) in translate(tutorial, "t").fields.items()}
    assert fields == {
        "mind_dataset_dir": "/path/train.mindrecord", "tokenizer_dir": "/path/", "grpo_epochs": 10,
        "micro_batch_size": 2, "mini_batch_size": 2, "use_parallel": True, "enable_compile_cache": False,
        "save_data_file": "/tmp/grpo.mindrecord", "log_completions_steps": 1, "save_steps": 5, "keep_last": 5,
        "tensorboard": False, "beta": 0.01, "num_generations": 8, "num_rollouts": 4, "chunk_size": 2,
        "num_iterations": 1, "epsilon_low": 0.2, "epsilon_high": 0.2, "seed": 0,
        "sft_path_train": "", "save_ckpt_dir": "/tmp/", "loss_scale_init": 1.0,
        "train_dp": 1, "train_tp": 4, "train_pp": 2, "train_micro_batches": 2, "recompute": "full",
        "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8, "weight_decay": 0.01,
        "lr_schedule": "cosine", "lr": 5e-7, "min_lr": 1e-10, "warmup_steps": 1,
        "ref_path": "", "sync_ref_model": False, "ref_model_sync_steps": 50,
        "reward_funcs": ["accuracy", "format"], "reward_weights": [1.0, 1.0],
        "sft_path_infer": "", "infer_dp": 2, "infer_tp": 4, "use_vllm": True,
        "vllm_max_model_len": 32768, "vllm_max_num_batched_tokens": 32768, "vllm_max_num_seqs": 1024,
        "max_prompt_length": 2048, "max_completion_length": 512, "min_new_tokens": 2, "temperature": 0.8,
        "repetition_penalty": 1.05, "top_p": 0.8, "top_k": 20, "stop_token_ids": [151645, 151643],
        "device_target": "Ascend"}
    cfg = GRPOConfig()
    cfg._apply(translate(tutorial, "t").fields, "t")
    # 32 updates a step in MindRLHF (64 completions, one per batch of 2): the same here
    assert (cfg.completions_per_step, cfg.optimizer_steps_per_step, cfg.grad_accum_steps) == (64, 32, 1)


@pytest.mark.parametrize("key", [k for k, spec in KEYS.items() if spec.how == "the same"])
def test_a_key_mapped_as_the_same_reaches_its_field(tutorial, key):
    spec = KEYS[key]
    data = copy.deepcopy(tutorial)
    *path, last = key.split(".")
    node = data
    for part in path:
        node = node.setdefault(part, {})
    old = node.get(last, spec.default)
    new = {bool: lambda v: not v, int: lambda v: v + 3, float: lambda v: v * 0.5 + 0.125,
           str: lambda v: "CPU" if last == "device_target" else f"{v}x"}[spec.type](old)
    node[last] = new
    assert translate(data, "t").fields[spec.sets] == (new, key)


def test_keys_left_out_take_mindrlhfs_defaults():
    fields = translate({"rl_config": {"beta": 0.02}}, "t").fields
    values = {name: value for name, (value, _) in fields.items()}
    assert values["beta"] == 0.02
    # grpo_configs.py's defaults: 8 generations, lr 5e-7, tp4 x pp2 with 4 micro-batches, 512 new tokens, vLLM
    assert (values["num_generations"], values["lr"], values["train_tp"], values["train_pp"],
            values["train_micro_batches"], values["max_completion_length"], values["use_vllm"]) == \
        (8, 5e-7, 4, 2, 4, 512, True)
    assert values["reward_funcs"] == ["accuracy", "format"] and values["reward_weights"] is None
    # placeholder paths (dataset_file "/path/train.mindrecord", save "/tmp/") are not applied when left out
    assert not {"mind_dataset_dir", "sft_path_train", "save_ckpt_dir", "save_data_file", "seed"} & set(values)


def test_format_is_detected_by_the_top_level_sections(tutorial):
    assert is_sectioned(tutorial) and is_sectioned({"generate_config": {}})
    assert not is_sectioned({"algorithm": {"beta": 0.1}}) and not is_sectioned({"beta": 0.1})


def test_mindrlhf_reward_names_are_read_as_ours_and_logged_once():
    """Both accuracy names are our accuracy (whatever --model_name, which in MindRLHF only picks between them),
    format_reward is our format, and one log line says how each was read: the flag's names, else the YAML's."""
    cfg = parse_main_args(["--config", str(CPU_YAML), "--use_vllm", "0", "--model_name", "llama",
                           "--verifier_function", "accuracy_reward, format_reward,boxed", "--verifier_weight", "1,1,1"])
    assert cfg.reward.reward_funcs == ["accuracy", "format", "boxed"] and cfg.reward.reward_weights == [1.0] * 3
    reward_lines = [n for n in startup_notes(cfg, {}) if "reward names read as ours" in n]
    assert len(reward_lines) == 1 and reward_lines[0].startswith("--verifier_function:")
    assert "accuracy_reward -> accuracy" in reward_lines[0] and "format_reward -> format" in reward_lines[0]
    assert "boxed ->" not in reward_lines[0]
    # without the flag, the YAML's (the CPU copy: accuracy_reward and our gsm8k_format, for the packaged prompts)
    cfg = parse_main_args(["--config", str(CPU_YAML)])
    assert cfg.reward.reward_funcs == ["accuracy", "gsm8k_format"]
    yaml_lines = [n for n in startup_notes(cfg, {}) if "reward names" in n]
    assert len(yaml_lines) == 1 and yaml_lines[0].startswith("reward_config.verifier_function:")
    assert "accuracy_reward -> accuracy" in yaml_lines[0] and "gsm8k_format ->" not in yaml_lines[0]


# ---------------------------------------------------------------------------------------------
# What MindRLHF's reward functions score against ours (mindrlhf/reward/reward_fn.py at the copied commit)
# ---------------------------------------------------------------------------------------------
def _their_qwen_accuracy(completion: str, solution: str) -> float:
    response = re.sub(r"(\d),(\d)", r"\1\2", completion)
    numbers = re.findall(r"boxed{([-+]?\d*\.?\d+)}", response)
    prediction = numbers[-1] if numbers else response
    gold = re.findall(r"([-+]?\d+\.?\d*)", re.sub(r"(\d),(\d)", r"\1\2", solution))[0]
    return 1.0 if str(prediction).lower() == str(gold).lower() else 0.0


def _their_format(completion: str) -> float:
    pattern = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    return 1.0 if re.match(pattern, completion, re.DOTALL | re.MULTILINE) else 0.0


@pytest.mark.parametrize("completion, theirs, ours", [
    ("so \\boxed{1,800}", 1.0, 1.0),           # both: the boxed number, commas dropped
    ("<answer>1800</answer>", 0.0, 1.0),       # unboxed: 0 there, the <answer> block here
    ("the total is 1800", 0.0, 1.0),           # the last number counts here only
    ("\\boxed{1800.0}", 0.0, 1.0),             # text equality there, numbers here
    ("\\boxed{1700}", 0.0, 0.0),
])
def test_accuracy_reward_there_and_here(completion, theirs, ours):
    solution = "He pays 1,800 in total.\n#### 1800"
    assert _their_qwen_accuracy(completion, solution) == theirs
    assert get_reward_fn("accuracy")([completion], [solution])[0] == ours


@pytest.mark.parametrize("completion, theirs, ours", [
    ("<think>a</think> <answer>b</answer>", 1.0, 1.0),
    ("<think>a</think><answer>b</answer>\nand more text", 1.0, 0.0),  # MULTILINE: $ ends the line there
    ("  <think>a</think><answer>b</answer>  ", 0.0, 1.0),           # whitespace around is fine here
    ("<think>a<think>b</think><answer>c</answer>", 1.0, 0.0),       # no nested tags here
])
def test_format_reward_there_and_here(completion, theirs, ours):
    assert _their_format(completion) == theirs
    assert get_reward_fn("format")([completion])[0] == ours


# ---------------------------------------------------------------------------------------------
# main.py's command line
# ---------------------------------------------------------------------------------------------
def test_the_tutorial_launch_reads_its_flags(data_dir):
    cfg = parse_main_args(["--config", str(data_dir / "mindrlhf_tutorial" / "grpo_config.yaml"), *TUTORIAL_FLAGS,
                           "--device_target", "CPU", "--infer_tp", "1", "--infer_dp", "2", "--train_tp", "1",
                           "--train_pp", "1", "--train_micro_batches", "1", "--use_parallel", "false",
                           "--infer_dp", "1", "--chunk_size", "2"])
    m = cfg.model
    assert (m.sft_path_train, m.ref_path, m.sft_path_infer, m.tokenizer_dir) == ("M", "M", "M", "M")
    assert (cfg.data.mind_dataset_dir, cfg.train.save_ckpt_dir) == ("D", "S")
    assert cfg.reward.reward_funcs == ["accuracy", "format"] and cfg.reward.reward_weights == [1.0, 1.0]
    assert cfg.generation.use_vllm is True and cfg.optimizer.lr == 5e-7


def test_flags_override_the_yaml_and_our_flags_override_both(tmp_path):
    argv = ["--config", str(CPU_YAML), "--use_vllm", "0", "--dataset_file", "a.mindrecord",
            "--actor_checkpoint_path", "model", "--verifier_weight", "1.0,0.5", "--tensorboard", "true",
            "--save_checkpoint_dir", "ckpts", "--resume_training"]
    cfg = parse_main_args(argv)
    assert cfg.generation.use_vllm is False and cfg.data.mind_dataset_dir == "a.mindrecord"
    assert cfg.model.sft_path_train == "model" and cfg.reward.reward_weights == [1.0, 0.5]
    assert cfg.train.tensorboard is True and cfg.train.save_ckpt_dir == "ckpts" and cfg.train.resume == "latest"
    assert cfg.algorithm.beta == 0.01  # the YAML's
    ours = parse_main_args(argv + ["--beta", "0.05", "--mind_dataset_dir", "b.mindrecord", "--use_vllm", "0",
                                   "--max_steps", "2"])
    assert (ours.algorithm.beta, ours.data.mind_dataset_dir, ours.train.max_steps) == (0.05, "b.mindrecord", 2)
    assert parse_main_args(["--config", str(CPU_YAML), "--use_vllm", "1", "--vllm_server", "s"]).generation.use_vllm


def test_our_own_yaml_works_through_main_py():
    ours = REPO / "examples" / "grpo" / "qwen_grpo_tutorial" / "grpo_config.yaml"
    cfg = parse_main_args(["--config", str(ours), "--dataset_file", "d.mindrecord", "--use_vllm", "0"])
    want = GRPOConfig.from_yaml(ours)
    want.data.mind_dataset_dir = "d.mindrecord"
    assert cfg.to_dict() == want.to_dict()
    assert startup_notes(cfg, {}) == []


def test_startup_notes_list_each_ignored_key_once_and_the_environment(tutorial):
    cfg = parse_main_args(["--config", str(CPU_YAML), "--use_vllm", "0", "--tokenizer_type", "qwen"])
    notes = startup_notes(cfg, TUTORIAL_ENV)
    text = "\n".join(notes)
    for key in ("rl_config.seq_length", "generate_config.num_scheduler_steps", "generate_config.hf_config_path",
                "generate_config.block_size", "generate_config.gpu_memory_utilization", "context.max_device_memory",
                "generate_config.sampling_config.detokenize", "actor_config.model_config",
                "profiler_config.profile", "monitor_config.host_monitor_interval"):
        assert text.count(f"{key} (") == 1, key
    assert "--tokenizer_type qwen ignored" in text
    env = [n for n in notes if n.startswith("MindRLHF's environment variables: ")]
    assert len(env) == 1
    for name, value in TUTORIAL_ENV.items():
        assert env[0].count(f"{name}={value} ({ENVIRONMENT[name][1]})") == 1
    assert "vLLM_MODEL_BACKEND=MindFormers (ignored on CPU" in env[0]
    cfg.parallel.device_target = "Ascend"
    ascend = startup_notes(cfg, {"HCCL_EXEC_TIMEOUT": "7200"})[-1]
    assert ascend == f"MindRLHF's environment variables: HCCL_EXEC_TIMEOUT=7200 ({ENVIRONMENT['HCCL_EXEC_TIMEOUT'][0]})"


# ---------------------------------------------------------------------------------------------
# Refused, in one line naming the key
# ---------------------------------------------------------------------------------------------
def _with(tutorial, key: str, value):
    data = copy.deepcopy(tutorial)
    *path, last = key.split(".")
    node = data
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value
    return data


@pytest.mark.parametrize("key, value, message", [
    ("generate_config.use_vllm", 2, r"generate_config.use_vllm = 2 is MindRLHF's debug mode .*use 1 for vLLM or 0"),
    ("generate_config.use_vllm", 3, r"generate_config.use_vllm = 3 is not 0 or 1"),
    ("rl_config.bogus", 1, r"unknown key 'rl_config.bogus': not one of MindRLHF's grpo_config.yaml keys"),
    ("generate_config.sampling_config.max_token", 1, r"unknown key 'generate_config.sampling_config.max_token' "
                                                      r"\(did you mean 'max_tokens'\?\)"),
    ("actor_config.optimizer.type", "lamb", r"actor_config.optimizer.type = 'lamb': the optimizer here is AdamW"),
    ("generate_config.parallel_config.pipeline_stage", 2, r"pipeline_stage = 2: generation runs without pipeline"),
    ("actor_config.parallel_config.context_parallel", 2, r"context_parallel = 2: context parallelism is not built"),
    ("reward_config.verifier_function", ["kk_reward"], r"kk_reward \(the Knights-and-Knaves puzzle reward\) has no "
                                                        r"counterpart here"),
    ("rl_config.beta", "abc", r"rl_config.beta = 'abc' is not a number"),
    ("rl_config.batch_size", 0, r"rl_config.batch_size = 0 must be a positive integer"),
    ("actor_config.lr_schedule", 5, r"actor_config.lr_schedule must be a mapping"),
])
def test_sectioned_errors_name_the_key(tutorial, key, value, message):
    assert re.search(message, _error(translate, _with(tutorial, key, value), "t"))


def test_mixed_formats_and_flag_errors_are_one_line(tmp_path, tutorial):
    mixed = _write(tmp_path, {**tutorial, "algorithm": {"beta": 0.1}})
    assert "'algorithm' is not a section of MindRLHF's grpo_config.yaml" in _error(parse_main_args,
                                                                                   ["--config", str(mixed)])
    assert "did you mean 'rl_config'" in _error(translate, {"rl_conifg": {}, "generate_config": {}}, "t")
    base = ["--config", str(CPU_YAML)]
    assert "--use_vllm = 2 is MindRLHF's debug mode" in _error(parse_main_args, base + ["--use_vllm", "2"])
    assert "--verifier_function: kk_reward" in _error(parse_main_args, base + ["--verifier_function", "kk_reward"])
    assert "unknown option --bogus" in _error(parse_main_args, base + ["--bogus", "1"])
    assert "config file not found" in _error(parse_main_args, ["--config", str(tmp_path / "none.yaml")])


def test_the_generated_table_is_current():
    committed = (REPO / REFERENCE_FILE).read_text(encoding="utf-8")
    assert committed == reference_markdown(), (
        f"{REFERENCE_FILE} is stale; regenerate with: python -c \"from mindrlhf.configs import "
        "write_config_references; write_config_references()\"")
    for key in KEYS:
        assert f"| `{key.split('.', 1)[1]}` |" in committed


# ---------------------------------------------------------------------------------------------
# main.py runs
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_main_py_trains_a_step_on_the_tiny_model_with_the_tutorial_environment(grpo_assets, data_dir, tmp_path):
    """The tutorial's launch on the CPU copy of its config (--use_vllm 0), its environment variables set: one step,
    the checkpoint in --save_checkpoint_dir, the translated settings in config.yaml, and the ignored keys and the
    environment each logged once."""
    from mindrlhf.data.gsm8k import PROMPT_STYLES
    from mindrlhf.data.rlhf_data import convert_to_mindrecord
    from mindrlhf.tokenizer import Tokenizer

    model, out, ckpt = str(grpo_assets["model"]), tmp_path / "out", tmp_path / "ckpt"
    # MindRLHF's format_reward wants <think> then <answer>: prompts that ask for them (rlhf_data.py's tags style)
    data = tmp_path / "tags.mindrecord"
    rows = (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[:4]
    (tmp_path / "q.jsonl").write_text("\n".join(rows) + "\n")
    convert_to_mindrecord(str(tmp_path / "q.jsonl"), str(data), Tokenizer.from_dir(model), max_prompt_length=256,
                          system_prompt=PROMPT_STYLES["tags"][0], show_progress=False)
    argv = [sys.executable, str(MAIN_PY), "--config", str(CPU_YAML), "--use_vllm", "0",
            "--tokenizer_dir", model, "--dataset_file", str(data), "--save_checkpoint_dir", str(ckpt),
            "--actor_checkpoint_path", model, "--ref_checkpoint_path", model, "--generate_checkpoint_path", model,
            "--verifier_function", "qwen_accuracy_reward,format_reward", "--verifier_weight", "1.0,1.0",
            "--max_steps", "1", "--output_dir", str(out), "--progress_bar", "false", "--layer_graph_shapes", "dynamic"]
    run = subprocess.run(argv, cwd=tmp_path, env=dict(os.environ, **TUTORIAL_ENV, PYTHONUNBUFFERED="1"),
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1] and rows[0]["loss"] == rows[0]["loss"]
    assert (ckpt / "step_00000001").is_dir()
    saved = GRPOConfig.from_yaml(out / "config.yaml")  # our format: mindrlhf-grpo --config resumes it
    assert (saved.algorithm.beta, saved.reward.reward_funcs, saved.algorithm.chunk_size,
            saved.algorithm.mini_batch_size, saved.generation.max_completion_length, saved.generation.use_vllm) == \
        (0.01, ["accuracy", "format"], 2, 4, 32, False)
    assert run.stderr.count("MindRLHF keys that set nothing here") == 1
    assert run.stderr.count("MindRLHF's environment variables: ") == 1
    assert "vLLM_MODEL_BACKEND=MindFormers (ignored on CPU" in run.stderr
    assert not list(tmp_path.glob("rank_*"))

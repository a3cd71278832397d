"""MindRLHF's Qwen-GRPO tutorial as written: its grpo_configs.py names (aliases), 1/0 booleans,
path-valued --load_* flags, MindFormers model YAMLs as --sft_path_train / --sft_path_infer, and the
whole workflow under msrun equal to the same run given our own flags."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from grpo_runs import grpo_args, is_timing, msrun, read_rows, run_inprocess
from mindrlhf.configs import GRPOConfig, parse_args
from mindrlhf.configs.mindformers import read_model_yaml
from mindrlhf.errors import MindRLHFError
from mindrlhf.generation.factory import check_sampler_config

REPO = Path(__file__).resolve().parents[1]
QWEN = REPO / "model_configs" / "qwen_grpo"
TINY_TRAIN, TINY_INFER = QWEN / "finetune_qwen2_tiny_cpu.yaml", QWEN / "predict_qwen2_tiny_cpu.yaml"


def _yaml(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _error(argv) -> str:
    with pytest.raises(MindRLHFError) as err:
        parse_args([*map(str, argv)])
    assert "\n" not in str(err.value)
    return str(err.value)


# ---------------------------------------------------------------------------------------------
# grpo_configs.py names: key aliases
# ---------------------------------------------------------------------------------------------
ALIASES = [("start_lr", "lr", "3.0e-6", 3e-6), ("end_lr", "min_lr", "1.0e-7", 1e-7),
           ("batch_size", "mini_batch_size", "4", 4)]


@pytest.mark.parametrize("alias, field, text, value", ALIASES)
def test_alias_reaches_its_field_in_yaml_grouped_yaml_and_flags(tmp_path, alias, field, text, value):
    group = GRPOConfig.field_index()[field].group
    for cfg in (GRPOConfig.from_yaml(_yaml(tmp_path, f"{alias}: {text}\n")),
                GRPOConfig.from_yaml(_yaml(tmp_path, f"{group}:\n  {alias}: {text}\n", "grouped.yaml")),
                parse_args([f"--{alias}", text])):
        assert cfg.get(field) == value
    # the same value under both names is fine; different values are one error naming both
    assert parse_args([f"--{alias}", text, f"--{field}", text]).get(field) == value
    msg = _error([f"--{alias}", text, f"--{field}", "8" if field == "mini_batch_size" else "2.0e-7"])
    assert f"'--{alias}'" in msg and f"'--{field}'" in msg and f"{alias} is another name of {field}" in msg
    with pytest.raises(MindRLHFError, match=f"{alias} is another name of {field}"):
        GRPOConfig.from_yaml(_yaml(tmp_path, f"{alias}: {text}\n{group}:\n  {field}: 8\n", "both.yaml"))
    # the YAML's alias and a flag of the canonical name: the flag overrides, as for any field
    over = "8" if field == "mini_batch_size" else "2.0e-7"
    yaml_path = str(_yaml(tmp_path, f"{alias}: {text}\n", "o.yaml"))
    assert parse_args(["--config", yaml_path, f"--{field}", over]).get(field) == type(value)(float(over))


def test_aliases_are_in_the_config_reference():
    text = (REPO / "docs" / "config_reference.md").read_text(encoding="utf-8")
    for alias, field, _, _ in ALIASES:
        row = next(line for line in text.splitlines() if line.startswith(f"| `{field}` |"))
        assert f"Alias: `{alias}`." in row
    assert "| `grpo_epochs` |" in text


@pytest.mark.parametrize("text, want", [("1", True), ("0", False), ("True", True), ("False", False),
                                        ("true", True), ("false", False)])
def test_booleans_accept_one_zero_and_capitalised(tmp_path, text, want):
    cfg = parse_args(["--enable_compile_cache", text, "--tensorboard", text])
    assert cfg.parallel.enable_compile_cache is want and cfg.train.tensorboard is want
    assert GRPOConfig.from_yaml(_yaml(tmp_path, f"tensorboard: {text}\n")).train.tensorboard is want
    assert parse_args(["--load_ref_checkpoint", text]).model.load_ref_checkpoint is want


def test_use_vllm_1_is_true_and_needs_a_vllm_environment(tmp_path):
    cfg = parse_args(["--use_vllm", "1", "--vllm_python", str(tmp_path / "none" / "python")])
    assert cfg.generation.use_vllm is True
    with pytest.raises(MindRLHFError, match=r"^use_vllm: no vLLM environment at .*none/python; make one with "
                                            r"`bash scripts/install_vllm.sh .venv-vllm`"):
        check_sampler_config(cfg)
    with pytest.raises(MindRLHFError, match=r"^vllm_server .*sock: no such socket"):
        check_sampler_config(parse_args(["--use_vllm", "1", "--vllm_server", str(tmp_path / "sock")]))
    assert parse_args(["--use_vllm", "0"]).generation.use_vllm is False


def test_tutorial_settings_yaml_maps_onto_our_fields(tmp_path):
    text = ("beta: 0.04\nnum_generations: 4\ngrpo_epochs: 2\nstart_lr: 5.0e-7\nend_lr: 1.0e-10\nchunk_size: 2\n"
            "batch_size: 4\nsync_ref_model: True\nref_model_sync_steps: 50\n")
    cfg = GRPOConfig.from_yaml(_yaml(tmp_path, text))
    assert (cfg.algorithm.beta, cfg.algorithm.num_generations, cfg.train.grpo_epochs, cfg.optimizer.lr,
            cfg.optimizer.min_lr, cfg.algorithm.chunk_size, cfg.algorithm.mini_batch_size,
            cfg.algorithm.sync_ref_model, cfg.algorithm.ref_model_sync_steps) == \
        (0.04, 4, 2, 5e-7, 1e-10, 2, 4, True, 50)


# ---------------------------------------------------------------------------------------------
# grpo_epochs: the run's length
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, batches, want", [
    ([], 8, 12),                                          # max_steps' default alone
    (["--grpo_epochs", "2"], 8, 16),                      # epochs alone: max_steps not given
    (["--grpo_epochs", "2", "--num_rollouts", "2"], 9, 8),  # 9 // 2 = 4 steps per epoch
    (["--grpo_epochs", "2", "--max_steps", "5"], 8, 5),    # whichever ends first
    (["--grpo_epochs", "1", "--max_steps", "30"], 8, 8),
])
def test_grpo_epochs_sets_the_run_length(flags, batches, want):
    from mindrlhf.trainer.schedule import run_steps

    assert run_steps(parse_args(flags), batches) == want


def test_grpo_epochs_errors():
    from mindrlhf.trainer.schedule import run_steps

    with pytest.raises(MindRLHFError, match="fewer than num_rollouts = 4"):
        run_steps(parse_args(["--grpo_epochs", "1", "--num_rollouts", "4"]), 3)
    with pytest.raises(MindRLHFError, match="warmup_steps = 5 > the run's 4 steps"):
        run_steps(parse_args(["--grpo_epochs", "1", "--warmup_steps", "5"]), 4)


@pytest.mark.slow
def test_grpo_epochs_run_and_its_resume_share_one_schedule(grpo_assets, tmp_path):
    """16 prompts, chunk_size 4 and 2 rollouts per step: one epoch is 2 steps (max_steps, 12 by default,
    not given). The cosine decay spans those 2 steps, and a run resumed from step 1 repeats step 2."""
    from mindrlhf.trainer.schedule import lr_at

    def argv(out, **extra):
        args = grpo_args(grpo_assets, out, chunk_size=4, num_rollouts=2, grpo_epochs=1, start_lr=1e-3,
                         end_lr=1e-4, max_completion_length=6, tensorboard="false", keep_last=0, **extra)
        i = args.index("--max_steps")
        return args[:i] + args[i + 2:]

    full = tmp_path / "full"
    assert run_inprocess(argv(full)) == 0
    rows = read_rows(full)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        want = lr_at(r["step"] - 1, lr=1e-3, min_lr=1e-4, warmup_steps=0, total_steps=2, schedule="cosine")
        assert r["learning_rate"] == pytest.approx(want, rel=1e-6)
    assert rows[1]["learning_rate"] == pytest.approx(5.5e-4)  # halfway down the 2-step cosine: not 12 steps'
    # the saved config records the run's length, so running it again gives the same run
    saved = GRPOConfig.from_yaml(full / "config.yaml")
    assert (saved.train.max_steps, saved.train.grpo_epochs) == (2, 1)
    resumed = tmp_path / "resumed"
    shutil.copytree(full / "checkpoints" / "step_00000001", resumed / "checkpoints" / "step_00000001")
    assert run_inprocess(argv(resumed, resume="latest")) == 0
    again = read_rows(resumed)
    assert [r["step"] for r in again] == [2]
    for key, value in rows[1].items():
        if not is_timing(key):
            assert again[0][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


# ---------------------------------------------------------------------------------------------
# --load_sft_checkpoint_* / --load_ref_checkpoint PATH
# ---------------------------------------------------------------------------------------------
def test_load_flags_take_a_path_or_a_bool():
    cfg = parse_args(["--load_sft_checkpoint_train", "/ckpt/train", "--load_sft_checkpoint_infer", "/ckpt/infer",
                      "--load_ref_checkpoint", "/ckpt/ref"])
    assert [cfg.model_weights(r) for r in ("train", "infer", "ref")] == ["/ckpt/train", "/ckpt/infer", "/ckpt/ref"]
    cfg = parse_args(["--sft_path_train", "/m", "--load_sft_checkpoint_train", "True"])
    assert cfg.model_weights("train") == "/m" and cfg.model_weights("ref") == ""  # ref: the policy's checkpoint
    # MindRLHF's scripts write "" for "load nothing"
    cfg = parse_args(["--load_sft_checkpoint_infer", "", "--load_ref_checkpoint", ""])
    assert cfg.model.load_sft_checkpoint_infer is False and cfg.model.load_ref_checkpoint is False
    # the same path in both places is one checkpoint, not a conflict
    assert parse_args(["--sft_path_train", "/m", "--load_sft_checkpoint_train", "/m"]).model_weights("train") == "/m"


@pytest.mark.parametrize("argv, needle", [
    (["--sft_path_train", "/a", "--load_sft_checkpoint_train", "/b"],
     "load_sft_checkpoint_train = '/b' and sft_path_train = '/a' name two different checkpoints"),
    (["--sft_path_infer", "/a", "--load_sft_checkpoint_infer", "/b"],
     "load_sft_checkpoint_infer = '/b' and sft_path_infer = '/a' name two different checkpoints"),
    (["--ref_path", "/a", "--load_ref_checkpoint", "/b"],
     "load_ref_checkpoint = '/b' and ref_path = '/a' name two different checkpoints"),
    (["--sft_path_train", str(TINY_TRAIN), "--use_parallel", "1"],
     "is a model YAML, which holds no weights; give the checkpoint with load_sft_checkpoint_train PATH"),
])
def test_a_load_path_conflicting_with_a_weights_path_is_one_error(argv, needle):
    assert needle in _error(argv)


def test_every_checkpoint_form_loads_through_the_flag(grpo_assets, tmp_path, capsys):
    """A full .ckpt, a .safetensors, an HF directory and rank_* shards, each given as
    --load_sft_checkpoint_train PATH, load the same weights."""
    from mindrlhf.grpo import resolve_model_path
    from mindrlhf.models import get_weights
    from mindrlhf.parallel.layout import ParallelLayout
    from mindrlhf.parallel.resharding import checkpoint_config, load_shard
    from mindrlhf.tools.convert_weight import main as convert
    from mindrlhf.tools.transform_checkpoint import main as transform

    hf = grpo_assets["model"]
    forms = {"hf": hf, "ckpt": tmp_path / "ms" / "tiny.ckpt", "safetensors": tmp_path / "st" / "tiny.safetensors",
             "shards": tmp_path / "shards"}
    for key in ("ckpt", "safetensors"):
        assert convert(["--model", "qwen2_5", "--input_path", str(hf), "--output_path", str(forms[key]),
                        "--no_progress"]) == 0
    assert transform(["--src_checkpoint", str(forms["ckpt"]), "--dst_checkpoint", str(forms["shards"]),
                      "--layout", "1,1,1", "--no_progress"]) == 0
    capsys.readouterr()
    want = None
    for key, path in forms.items():
        cfg = parse_args(["--load_sft_checkpoint_train", str(path)])
        weights = resolve_model_path(cfg)
        assert weights == str(path), key
        assert checkpoint_config(weights).hidden_size == 32
        got = dict(get_weights(load_shard(weights, ParallelLayout(), 0)))
        if want is None:
            want = got
        assert sorted(got) == sorted(want), key
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{key}: {name}")


# ---------------------------------------------------------------------------------------------
# MindFormers model YAMLs
# ---------------------------------------------------------------------------------------------
def _tutorial_layout(**extra):
    flags = ["--sft_path_train", QWEN / "finetune_qwen2_5_7b.yaml", "--sft_path_infer",
             QWEN / "predict_qwen2_5_7b_instruct.yaml", "--load_sft_checkpoint_train", "/ckpt/train",
             "--load_sft_checkpoint_infer", "/ckpt/infer", "--use_parallel", "True", "--chunk_size", "2"]
    for k, v in extra.items():
        flags += [f"--{k}", str(v)]
    return [*map(str, flags)]


def test_the_7b_yamls_set_the_tutorials_layouts():
    p = parse_args(_tutorial_layout()).parallel
    assert (p.train_dp, p.train_tp, p.train_pp, p.train_micro_batches, p.infer_dp, p.infer_tp) == (1, 4, 2, 2, 2, 4)
    # an explicit value equal to the YAML's is fine; a different one is one error naming both
    assert parse_args(_tutorial_layout(train_tp=4, infer_dp=2)).parallel.train_tp == 4
    msg = _error(_tutorial_layout(train_tp=8))
    assert "train_tp = 8 conflicts with parallel_config.model_parallel: 4 in" in msg and "finetune_qwen2_5_7b" in msg
    msg = _error(_tutorial_layout(infer_dp=4))
    assert "infer_dp = 4 conflicts with parallel_config.data_parallel: 2 in" in msg
    # ... also when the explicit value is the default
    assert "train_pp = 1 conflicts with parallel_config.pipeline_stage: 2" in _error(_tutorial_layout(train_pp=1))


def test_tiny_yamls_layout_and_the_keys_they_ignore():
    p = parse_args(["--sft_path_train", str(TINY_TRAIN), "--sft_path_infer", str(TINY_INFER),
                    "--load_sft_checkpoint_train", "/t", "--use_parallel", "1"]).parallel
    assert (p.train_dp, p.train_tp, p.train_pp, p.train_micro_batches, p.infer_dp, p.infer_tp) == (1, 2, 1, 1, 2, 1)
    train = read_model_yaml(TINY_TRAIN)
    ignored = train.unused_layout_keys("train") + train.ignored
    for key in ("parallel_config.use_seq_parallel", "parallel_config.micro_batch_num", "micro_batch_interleave_num",
                "runner_config", "optimizer", "context", "model.arch", "model.model_config.compute_dtype",
                "model.model_config.seq_length"):
        assert key in ignored, key
    assert "parallel_config.model_parallel" not in ignored and "model.model_config.hidden_size" not in ignored


def test_infer_pipeline_stage_above_one_is_refused(tmp_path):
    text = TINY_INFER.read_text().replace("pipeline_stage: 1", "pipeline_stage: 2")
    bad = _yaml(tmp_path, text, "predict_pp2.yaml")
    msg = _error(["--sft_path_infer", bad, "--use_parallel", "1"])
    assert "parallel_config.pipeline_stage = 2" in msg and "set pipeline_stage: 1 in the infer" in msg


def test_a_yaml_that_is_not_a_mindformers_model_is_named(tmp_path):
    not_model = _yaml(tmp_path, "beta: 0.04\n", "grpo.yaml")
    msg = _error(["--sft_path_train", not_model, "--load_sft_checkpoint_train", "/t"])
    assert "not a MindFormers model config (no model.model_config section)" in msg


def test_architecture_mismatch_names_the_key_and_ignored_keys_are_logged_once(grpo_assets, tmp_path, caplog):
    from mindrlhf.grpo import check_model_yamls
    from mindrlhf.parallel.resharding import checkpoint_config

    hf = str(grpo_assets["model"])
    config = checkpoint_config(hf)
    cfg = parse_args(["--sft_path_train", str(TINY_TRAIN), "--sft_path_infer", str(TINY_INFER),
                      "--load_sft_checkpoint_train", hf, "--use_parallel", "1"])
    with caplog.at_level(logging.INFO, logger="mindrlhf"):
        check_model_yamls(cfg, config, hf)
    logged = [r.getMessage() for r in caplog.records if "ignored (no meaning here)" in r.getMessage()]
    assert len(logged) == 2  # one line per YAML
    assert "parallel_config.use_seq_parallel" in logged[0] and "micro_batch_interleave_num" in logged[0]
    assert "model.model_config.use_past" in logged[1] and str(TINY_INFER) in logged[1]
    for key, value in (("hidden_size", 64), ("n_kv_heads", 4), ("qkv_has_bias", False), ("theta", 10000.0)):
        text = TINY_TRAIN.read_text()
        line = next(s for s in text.splitlines() if s.strip().startswith(f"{key}:"))
        bad = _yaml(tmp_path, text.replace(line, f"    {key}: {value}"), f"bad_{key}.yaml")
        bad_cfg = parse_args(["--sft_path_train", str(bad), "--load_sft_checkpoint_train", hf, "--use_parallel", "1",
                              "--infer_dp", "2"])
        with pytest.raises(MindRLHFError) as err:
            check_model_yamls(bad_cfg, config, hf)
        assert f"model.model_config.{key} = {value!r} but the checkpoint {hf} has" in str(err.value)


# ---------------------------------------------------------------------------------------------
# The tutorial's whole workflow under msrun
# ---------------------------------------------------------------------------------------------
TUTORIAL_SETTINGS = """\
# grpo_configs.py's settings under the tutorial's names
beta: 0.04
num_generations: 4
grpo_epochs: 1
start_lr: 1.0e-3
end_lr: 1.0e-4
chunk_size: 2
batch_size: 4
sync_ref_model: True
ref_model_sync_steps: 1
# a reward with a spread in every group (real gradients), small for CPU
reward_funcs: [accuracy, "e2e_rewards:length_reward"]
max_prompt_length: 256
max_completion_length: 12
temperature: 1.0
tensorboard: False
progress_bar: False
recompute: full  # as every run of the suite (grpo_runs.SUITE_RECOMPUTE), so the two runs compute alike
"""


@pytest.mark.slow
@pytest.mark.msrun
def test_tutorial_workflow_equals_our_flags(grpo_assets, data_dir, tmp_path):
    """convert_weight.py -> transform_checkpoint.py (train layout tp2, infer layout dp2) -> rlhf_data.py ->
    msrun grpo_one_stage.py with the tutorial's flag shapes, its MindFormers YAMLs (the layouts) and its
    grpo_configs.py names; then the same run with our own flags. 4 prompts, chunk_size 2: grpo_epochs 1
    is 2 steps. Metrics and final weights agree."""
    from mindrlhf.data.rlhf_data import main as rlhf_data
    from mindrlhf.tools.convert_weight import main as convert
    from mindrlhf.tools.transform_checkpoint import main as transform

    hf = grpo_assets["model"]
    ckpt = tmp_path / "ms_ckpt" / "qwen_tiny.ckpt"
    assert convert(["--model", "qwen2_5", "--input_path", str(hf), "--output_path", str(ckpt), "--no_progress"]) == 0
    train_shards, infer_shards = tmp_path / "ckpt" / "train", tmp_path / "ckpt" / "infer"
    for dst, layout in ((train_shards, "1,2,1"), (infer_shards, "2,1,1")):
        assert transform(["--src_checkpoint", str(ckpt), "--dst_checkpoint", str(dst), "--layout", layout,
                          "--no_progress"]) == 0
    rows = (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[:4]
    (tmp_path / "gsm8k4.jsonl").write_text("\n".join(rows) + "\n")
    data = tmp_path / "grpo_data" / "gsm8k4.mindrecord"
    data.parent.mkdir()
    assert rlhf_data(["--vocab_path", str(hf / "vocab.json"), "--merges_file_path", str(hf / "merges.txt"),
                      "--file_path", str(tmp_path / "gsm8k4.jsonl"), "--output_path", str(data),
                      "--max_prompt_length", "256", "--no_progress"]) == 0

    tutorial = tmp_path / "tutorial"
    msrun(2, ["--config", _yaml(tmp_path, TUTORIAL_SETTINGS, "grpo_config.yaml"),
              "--sft_path_infer", TINY_INFER, "--sft_path_train", TINY_TRAIN,
              "--vocab_path", hf / "vocab.json", "--merges_file_path", hf / "merges.txt",
              "--mind_dataset_dir", data, "--save_data_file", tmp_path / "grpo_data" / "grpo_1024.mindrecord",
              "--save_ckpt_dir", tmp_path / "ckpt" / "saved", "--output_dir", tutorial,
              "--use_parallel", "True", "--load_sft_checkpoint_infer", infer_shards,
              "--load_sft_checkpoint_train", train_shards, "--load_ref_checkpoint", train_shards,
              "--enable_compile_cache", "False"], tmp_path / "log_tutorial", 8141)
    ours = tmp_path / "ours"
    msrun(2, grpo_args({"model": hf, "data": data}, ours, use_parallel="true", train_tp=2, infer_dp=2, beta=0.04,
                       max_steps=2, lr=1e-3, min_lr=1e-4, mini_batch_size=4, sync_ref_model="true",
                       ref_model_sync_steps=1, max_completion_length=12, tensorboard="false",
                       reward_funcs=["accuracy", "e2e_rewards:length_reward"],
                       save_steps=10), tmp_path / "log_ours", 8143)

    log = "".join(p.read_text() for p in (tmp_path / "log_tutorial").glob("*.log"))
    assert log.count("ignored (no meaning here)") == 2  # rank 0 only, once per YAML
    got, want = read_rows(tutorial), read_rows(ours)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    # not a vacuous comparison: real updates, and the re-synced reference differs from the policy at step 2
    assert all(r["grad_norm"] > 1e-3 and r["reward_std"] > 0 for r in want) and want[1]["kl"] > 0
    for a, b in zip(got, want):
        assert sorted(a) == sorted(b)
        for key in a:
            if not is_timing(key):
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
    import mindspore as ms

    w_tutorial = ms.load_checkpoint(str(tmp_path / "ckpt" / "saved" / "step_00000002" / "policy.ckpt"))
    w_ours = ms.load_checkpoint(str(ours / "checkpoints" / "step_00000002" / "policy.ckpt"))
    assert sorted(w_tutorial) == sorted(w_ours)
    for name in w_ours:
        np.testing.assert_allclose(w_tutorial[name].asnumpy(), w_ours[name].asnumpy(), rtol=1e-6, atol=1e-7,
                                   err_msg=name)

"""Mixed precision: float32 master weights and Adam moments under a float16 compute copy, float32
checkpoints, and dynamic loss scaling (skip on overflow, halve, resume)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from grpo_runs import grpo_args, read_rows, run_inprocess


def _tensors(path) -> dict:
    import mindspore as ms

    return {name: p for name, p in ms.load_checkpoint(str(path)).items()}


def _initial(model_dir) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def replayed_runs(grpo_assets, tmp_path_factory):
    """One recording run (float32: its rollouts), then the same 3 steps replayed in float16 and
    float32 at lr 1e-6: (initial weights, {dtype: run folder})."""
    root = tmp_path_factory.mktemp("mp")
    dump = root / "exp" / "rollouts.npz"
    # A reward that differs within each group, so every step has a gradient to follow.
    assert run_inprocess(grpo_args(grpo_assets, root / "record",
                                   reward_funcs=["e2e_rewards:length_reward"], save_data_file=dump)) == 0
    runs = {}
    for dtype in ("float16", "float32"):
        runs[dtype] = root / dtype
        assert run_inprocess(grpo_args(grpo_assets, runs[dtype], lr=1e-6, lr_schedule="constant", dtype=dtype,
                                       reward_funcs=["e2e_rewards:length_reward"], replay_data_file=dump,
                                       save_steps=3)) == 0
    return _initial(grpo_assets["model"]), runs


@pytest.mark.slow
def test_float16_run_moves_every_weight_with_a_gradient(replayed_runs):
    initial, runs = replayed_runs
    step = runs["float16"] / "checkpoints" / "step_00000003"
    policy, optimizer = _tensors(step / "policy.ckpt"), _tensors(step / "optimizer.ckpt")
    reference = _tensors(runs["float32"] / "checkpoints" / "step_00000003" / "policy.ckpt")
    import mindspore as ms

    assert set(policy) == set(initial)
    assert all(p.dtype == ms.float32 for p in policy.values())  # the masters, not the float16 copy
    moved = touched = 0
    for name, start in initial.items():
        has_grad = optimizer[f"adam_v.{name}"].asnumpy() > 0  # some step had a non-zero gradient there
        delta = policy[name].asnumpy() != start
        assert not (delta & ~has_grad).any(), name  # nothing moves without a gradient (no weight decay)
        if "norm" in name:  # RMSNorm scales sit near 1.0, where float16's spacing is 1e-3 >> lr
            # Exactly the elements that move in float32 move (an element whose three Adam steps
            # cancel to the same float32 value stays put in both), and nearly all of them.
            assert has_grad.all() and delta.mean() >= 0.9, name
            np.testing.assert_array_equal(delta, reference[name].asnumpy() != start, err_msg=name)
        moved += int(delta.sum())
        touched += int(has_grad.sum())
    assert touched > 10_000 and moved >= 0.99 * touched, (moved, touched)


@pytest.mark.slow
def test_float16_update_agrees_with_float32(replayed_runs):
    initial, runs = replayed_runs
    updates = {}
    for dtype, out in runs.items():
        final = _tensors(out / "checkpoints" / "step_00000003" / "policy.ckpt")
        updates[dtype] = np.concatenate([(final[n].asnumpy().astype(np.float64) - initial[n]).ravel()
                                         for n in sorted(initial)])
    half, full = updates["float16"], updates["float32"]
    cosine = float(half @ full / (np.linalg.norm(half) * np.linalg.norm(full)))
    rel = float(np.linalg.norm(half - full) / np.linalg.norm(full))
    assert np.linalg.norm(full) > 0 and cosine >= 0.99 and rel <= 0.05, (cosine, rel)
    rows = {dtype: read_rows(out) for dtype, out in runs.items()}
    assert all(r["loss_scale"] == 65536.0 and r["skipped_updates"] == 0.0 for r in rows["float16"])
    assert "loss_scale" not in rows["float32"][0]
    for half_row, full_row in zip(rows["float16"], rows["float32"]):
        assert half_row["loss"] == pytest.approx(full_row["loss"], rel=0.02, abs=1e-4)


def _updater(model_dir, dtype: str, **kw):
    from mindrlhf.grpo import GRPOObjective, LossSettings
    from mindrlhf.models import load_model
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.trainer.update import Updater

    model = load_model(model_dir, dtype=dtype)
    settings = LossSettings(loss_type="grpo", loss_agg_mode="token-mean", epsilon_low=0.2, epsilon_high=0.2,
                            beta=0.0, kl_estimator="k3", max_completion_length=8, temperature=1.0,
                            off_policy=False)
    return Updater(model, GRPOObjective(settings), head=LogProbHead(settings.temperature), lr=1e-3,
                   weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, max_grad_norm=0.0, jit=False, **kw)


def _micro(advantage: float) -> dict:
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 900, (4, 14)).astype(np.int32)
    mask = np.ones((4, 8), np.float32)
    return {"input_ids": ids[:, :-1], "attention_mask": np.ones((4, 13), np.int32),
            "completion_ids": ids[:, 6:], "completion_mask": mask,
            "advantages": np.array([1, -1, 1, -1], np.float32) * advantage,
            "old_logp": np.zeros((4, 8), np.float32), "ref_logp": np.zeros((4, 8), np.float32),
            "sampler_logp": np.zeros((4, 8), np.float32)}


def test_overflow_is_skipped_the_scale_halves_and_the_next_step_updates(tiny_qwen2_dir):
    updater = _updater(tiny_qwen2_dir, "float16", loss_scale_init=65536.0, loss_scale_window=1000)
    masters = {n: p.asnumpy().copy() for n, p in updater.master_weights().items()}
    compute = {p.name: p.asnumpy().copy() for p in updater.params}
    # Advantages of 1e5 keep the float32 loss finite but the scaled float16 gradients overflow.
    res = updater.step([_micro(1e5)], (32.0, 4.0))
    assert math.isfinite(res["loss"]) and res["skipped"] == 1.0 and res["overflow"] == 1.0
    assert updater.loss_scale == 32768.0
    assert int(updater.optimizer.step.asnumpy()) == 0
    for name, p in updater.master_weights().items():
        np.testing.assert_array_equal(p.asnumpy(), masters[name])
    res = updater.step([_micro(1.0)], (32.0, 4.0))
    assert res["skipped"] == 0.0 and res["overflow"] == 0.0 and math.isfinite(res["grad_norm"])
    assert updater.loss_scale == 32768.0 and int(updater.optimizer.step.asnumpy()) == 1
    moved = [p.name for p in updater.params if not np.array_equal(p.asnumpy(), compute[p.name])]
    assert len(moved) > len(updater.params) // 2
    # The compute copy is the float16 rounding of the float32 master, after every update.
    for p in updater.params:
        np.testing.assert_array_equal(p.asnumpy(), updater.master_weights()[p.name].asnumpy().astype(np.float16))


def test_loss_scale_grows_after_a_window_and_reports_the_unscaled_loss(tiny_qwen2_dir):
    half = _updater(tiny_qwen2_dir, "float16", loss_scale_init=1024.0, loss_scale_window=2)
    full = _updater(tiny_qwen2_dir, "float32")
    assert full.scaler is None and full.loss_scale == 1.0 and full.loss_scale_state() == {}
    a = half.step([_micro(1.0)], (32.0, 4.0))
    b = full.step([_micro(1.0)], (32.0, 4.0))
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-2, abs=1e-4)  # not multiplied by 1024
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-2)
    assert half.loss_scale == 1024.0
    half.step([_micro(1.0)], (32.0, 4.0))
    assert half.loss_scale_state() == {"loss_scale": 2048.0, "loss_scale_counter": 0}


def test_float32_params_are_their_own_masters(tiny_qwen2_dir):
    updater = _updater(tiny_qwen2_dir, "float32")
    assert all(updater.master_weights()[p.name] is p for p in updater.params)


@pytest.mark.slow
def test_float16_checkpoint_loads_as_a_model_and_exports_in_the_requested_dtype(replayed_runs, tmp_path):
    from safetensors.numpy import load_file

    from mindrlhf.models import load_model
    from mindrlhf.tools.convert_weight import main as convert

    _, runs = replayed_runs
    step = runs["float16"] / "checkpoints" / "step_00000003"
    masters = _tensors(step / "policy.ckpt")
    model = load_model(step, dtype="float16")  # mindrlhf-eval and load_model take the folder as it is
    for name, p in model.parameters_and_names():
        np.testing.assert_array_equal(p.asnumpy(), masters[name].asnumpy().astype(np.float16), err_msg=name)
    for flag, dtype in (([], np.float32), (["--dtype", "fp16"], np.float16)):
        out = tmp_path / f"hf_{dtype.__name__}"
        assert convert(["--reverse", "--input_path", str(step / "policy.ckpt"), "--output_path", str(out),
                        "--no_progress", *flag]) == 0
        exported = load_file(str(out / "model.safetensors"))
        assert set(exported) == set(masters)
        for name, array in exported.items():
            assert array.dtype == dtype
            np.testing.assert_array_equal(array, masters[name].asnumpy().astype(dtype), err_msg=name)

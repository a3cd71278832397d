"""The policy update (trainer.update.Updater with GRPO's objective) on a tiny Qwen2: padding invariance."""
import math

import numpy as np
import pytest

from grpo_runs import assert_same_updated_weights
from mindrlhf.trainer.experience import Experience, left_pad, right_pad


def _experience(width: int, seed: int = 0) -> Experience:
    """Four rows with prompts of 3-6 tokens and completions of 2-9 tokens, completions padded to ``width``."""
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, 200, n)) for n in (3, 6, 4, 5)]
    completions = [list(rng.integers(1, 200, n)) for n in (9, 2, 5, 7)]
    logp = [list(-rng.random(len(c)).astype(np.float32)) for c in completions]
    prompt_ids, prompt_mask = left_pad(prompts, 8, 0)
    present = right_pad([[1] * len(c) for c in completions], width, 0, np.int32)
    n = len(prompts)
    return Experience(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask,
        completion_ids=right_pad(completions, width, 0, np.int32), completion_mask=present.astype(np.float32),
        sampler_logp=right_pad(logp, width, 0.0, np.float32), truncated=np.zeros(n, bool),
        rewards=np.array([1, 0, 0, 1], np.float32), reward_per_fn=np.zeros((n, 1), np.float32),
        advantages=np.array([0.87, -0.87, -0.87, 0.87], np.float32), prompt_index=np.zeros(n, np.int64),
        ref_logp=right_pad(logp, width, 0.0, np.float32), extras={"completion_present": present})


def _update(model_dir, exp: Experience, loss_agg_mode: str):
    from mindrlhf.grpo import GRPOObjective, LossSettings
    from mindrlhf.models import get_weights, load_model
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.trainer.update import Updater

    model = load_model(model_dir)
    settings = LossSettings(loss_type="grpo", loss_agg_mode=loss_agg_mode, epsilon_low=0.2, epsilon_high=0.2,
                            beta=0.04, kl_estimator="k3", max_completion_length=16, temperature=0.7,
                            off_policy=False)
    # The updater GRPO's trainer builds (trainer.update.build_updater), without its config.
    updater = Updater(model, GRPOObjective(settings), head=LogProbHead(settings.temperature), lr=1e-3,
                      weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, max_grad_norm=1.0, jit=False)
    inputs = exp.train_inputs()
    micro = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"],
             "completion_ids": exp.completion_ids, "completion_mask": exp.completion_mask,
             "advantages": exp.advantages, "old_logp": exp.sampler_logp, "ref_logp": exp.ref_logp,
             "sampler_logp": exp.sampler_logp}
    mask = exp.completion_mask
    result = updater.step([micro], (float(mask.sum()), float((mask.sum(1) > 0).sum())))
    return result, get_weights(model)


@pytest.mark.parametrize("loss_agg_mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_extra_completion_padding_does_not_change_the_update(tiny_qwen2_dir, loss_agg_mode):
    # The trainer pads completions only to the step's longest (rounded up), not to max_completion_length;
    # that is only valid because padded columns contribute nothing to the loss, the gradient or the KL.
    narrow, narrow_w = _update(tiny_qwen2_dir, _experience(9), loss_agg_mode)
    wide, wide_w = _update(tiny_qwen2_dir, _experience(16), loss_agg_mode)
    assert narrow["grad_norm"] > 0 and narrow["kl"] > 0
    for key in ("loss", "grad_norm", "kl"):
        assert wide[key] == pytest.approx(narrow[key], rel=1e-5, abs=1e-8), key
    # The same update to float rounding: Adam's division lets an element with a near-zero gradient move by a fraction
    # of lr on summation-order noise (2.6e-7 on one of 4096 q_proj elements on an AMD Zen 5 box).
    assert_same_updated_weights(narrow_w, wide_w, lr=1e-3)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_sampling_correction_weights_the_update(tiny_qwen2_dir, mode):
    """On-policy (ratio 1), grpo's per-token loss is -A; the correction weights it by the mode's ratio of the
    trainer's to the sampler's log-probs, computed here in numpy from the trainer's own log-probs."""
    from mindrlhf.grpo import GRPOObjective, LossSettings
    from mindrlhf.models import load_model
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.trainer.update import Updater

    exp = _experience(9)
    inputs = exp.train_inputs()
    micro = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"],
             "completion_ids": exp.completion_ids, "completion_mask": exp.completion_mask,
             "advantages": exp.advantages, "old_logp": exp.sampler_logp, "ref_logp": exp.ref_logp}
    mask = exp.completion_mask
    results = {}
    for correction in (False, True):
        settings = LossSettings("grpo", "token-mean", 0.2, 0.2, 0.0, "k3", 16, 1.0, False, correction, mode, 1.5)
        updater = Updater(load_model(tiny_qwen2_dir), GRPOObjective(settings), head=LogProbHead(settings.temperature),
                          lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, max_grad_norm=0.0, jit=False)
        logp = updater.forward([micro])[0].astype(np.float64)
        # A sampler that disagrees with the trainer by up to ±0.6 nats per token.
        sampler = (logp + np.random.default_rng(1).uniform(-0.6, 0.6, logp.shape)) * mask
        gap = (logp - sampler) * mask
        if mode.startswith("token"):
            ratio, counted = np.exp(gap), mask
        else:
            ratio, counted = np.exp(gap.sum(1, keepdims=True)), (mask.sum(1, keepdims=True) > 0).astype(float)
        weights = np.minimum(ratio, 1.5) if mode.endswith("truncate") else np.where(ratio > 1.5, 0.0, ratio)
        results[correction] = updater.step([dict(micro, sampler_logp=sampler.astype(np.float32))],
                                           (float(mask.sum()), float((mask.sum(1) > 0).sum())))
    res = results[True]
    per_token = -exp.advantages[:, None] * np.broadcast_to(weights, mask.shape)
    assert res["loss"] == pytest.approx((per_token * mask).sum() / mask.sum(), rel=1e-5, abs=1e-7)
    assert results[False]["loss"] == pytest.approx((-exp.advantages[:, None] * mask).sum() / mask.sum(), abs=1e-6)
    assert 0.05 < (weights != 1).mean() and (weights == 0).any() == mode.endswith("mask")
    # The gap's metrics are logged the same with the correction off.
    for r in results.values():
        assert r["sampling/sampling_logp_difference/mean"] == pytest.approx(np.abs(gap).sum() / mask.sum(), rel=1e-5)
        assert r["sampling/sampling_logp_difference/max"] == pytest.approx(np.abs(gap).max(), rel=1e-5)
        w = np.broadcast_to(weights, counted.shape)[counted > 0]
        assert r["sampling/importance_sampling_ratio/mean"] == pytest.approx(w.mean(), rel=1e-5)
        assert r["sampling/importance_sampling_ratio/min"] == pytest.approx(w.min(), rel=1e-5, abs=1e-7)
        assert r["sampling/importance_sampling_ratio/max"] == pytest.approx(w.max(), rel=1e-5)


@pytest.mark.parametrize("criterion,threshold", [("token_k1", 1.3), ("seq_mean_k3", 0.02), ("seq_max_k2", 0.1)])
def test_rejection_sampling_masks_the_update(tiny_qwen2_dir, criterion, threshold):
    """verl's rollout_rs on the IS path: on-policy grpo's per-token loss -A drops out where the criterion's statistic
    of d = logp_train - logp_sampler leaves the bounds (the denominators keep every token), and the step logs verl's
    rollout_corr/rollout_rs_* metrics, all checked against numpy."""
    from mindrlhf.grpo import GRPOObjective, LossSettings
    from mindrlhf.models import load_model
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.trainer.update import Updater

    exp = _experience(9)
    exp.completion_mask[2] = 0.0  # a completion masked out of the loss: in no statistic, no share
    inputs = exp.train_inputs()
    micro = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"],
             "completion_ids": exp.completion_ids, "completion_mask": exp.completion_mask,
             "advantages": exp.advantages, "old_logp": exp.sampler_logp, "ref_logp": exp.ref_logp}
    mask = exp.completion_mask.astype(np.float64)
    settings = LossSettings("grpo", "token-mean", 0.2, 0.2, 0.0, "k3", 16, 1.0, False, rollout_rs=criterion,
                            rollout_rs_threshold=threshold)
    updater = Updater(load_model(tiny_qwen2_dir), GRPOObjective(settings), head=LogProbHead(settings.temperature),
                      lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, max_grad_norm=0.0, jit=False)
    logp = updater.forward([micro])[0].astype(np.float64)
    sampler = (logp + np.random.default_rng(2).uniform(-0.6, 0.6, logp.shape)) * mask
    d = (logp - sampler) * mask
    valid = mask > 0
    k = {"k1": -d, "k2": 0.5 * d * d, "k3": np.exp(d) - 1.0 - d}[criterion[-2:]]
    if criterion.startswith("token"):
        stat, unit = k, valid
        lower, upper = -math.log(threshold), math.log(threshold)
    else:
        reduce = np.mean if criterion.startswith("seq_mean") else np.max
        stat = np.array([[reduce(r[v]) if v.any() else 0.0] for r, v in zip(k, valid)])  # empty: 0, as verl
        unit = valid.any(1, keepdims=True)
        lower, upper = -np.inf, threshold
    keep = ((stat >= lower) & (stat <= upper)).astype(np.float64)
    res = updater.step([dict(micro, sampler_logp=sampler.astype(np.float32))],
                       (float(mask.sum()), float((mask.sum(1) > 0).sum())))
    per_token = -exp.advantages[:, None] * np.broadcast_to(keep, mask.shape)
    assert res["loss"] == pytest.approx((per_token * mask).sum() / mask.sum(), rel=1e-5, abs=1e-7)
    rejected = (1.0 - np.broadcast_to(keep, mask.shape)) * mask
    assert 0 < rejected.sum() < mask.sum()
    prefix = f"rollout_corr/rollout_rs_{criterion}"
    values = np.broadcast_to(stat, mask.shape)
    assert res["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected.sum() / mask.sum(), rel=1e-6)
    seq_share = (rejected.sum(1) > 0).sum() / valid.any(1).sum()  # over completions with a loss token
    assert res["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(seq_share)
    assert res[f"{prefix}_mean"] == pytest.approx((values * mask).sum() / mask.sum(), rel=1e-4, abs=1e-6)
    assert res[f"{prefix}_max"] == pytest.approx(stat[unit].max(), rel=1e-4)
    assert res[f"{prefix}_min"] == pytest.approx(stat[unit].min(), rel=1e-4, abs=1e-6)
    assert res[f"{prefix}_fraction_high"] == pytest.approx((stat[unit] > upper).mean())
    assert res[f"{prefix}_fraction_low"] == pytest.approx((stat[unit] < lower).mean())
    assert res[f"{prefix}_masked_fraction"] == res["rollout_corr/rollout_rs_masked_fraction"]
    assert res[f"{prefix}_seq_masked_fraction"] == pytest.approx(seq_share)


def test_concat_experiences_pads_to_the_widest():
    from mindrlhf.trainer.experience import concat_experiences

    narrow, wide = _experience(9, seed=0), _experience(12, seed=1)
    narrow.ref_logp = wide.ref_logp = None  # rollouts are joined before any log-probs are computed
    wide.prompt_ids, wide.prompt_mask = wide.prompt_ids[:, 2:], wide.prompt_mask[:, 2:]  # a 6-token prompt width
    narrow.extras["sampler_entropy"] = np.ones((4, 9), np.float32)
    wide.extras["sampler_entropy"] = np.ones((4, 12), np.float32)
    both = concat_experiences([narrow, wide], pad_id=7)
    assert len(both) == 8 and both.prompt_ids.shape == (8, 8) and both.completion_ids.shape == (8, 12)
    np.testing.assert_array_equal(both.prompt_ids[4:, 2:], wide.prompt_ids)
    assert (both.prompt_ids[4:, :2] == 7).all() and (both.prompt_mask[4:, :2] == 0).all()
    np.testing.assert_array_equal(both.completion_ids[:4, :9], narrow.completion_ids)
    assert (both.completion_ids[:4, 9:] == 7).all() and (both.completion_mask[:4, 9:] == 0).all()
    assert (both.extras["sampler_entropy"][:4, 9:] == 0).all() and both.extras["completion_present"].shape == (8, 12)
    np.testing.assert_array_equal(both.rewards, np.concatenate([narrow.rewards, wide.rewards]))
    # every row keeps its real tokens: prompt (mask 1) then completion (present)
    def tokens(e, i):
        present = e.extras["completion_present"][i] > 0
        return np.concatenate([e.prompt_ids[i][e.prompt_mask[i] > 0], e.completion_ids[i][present]])

    for row, (e, i) in enumerate([(narrow, i) for i in range(4)] + [(wide, i) for i in range(4)]):
        np.testing.assert_array_equal(tokens(both, row), tokens(e, i))


def test_a_dump_keeps_the_tool_mask(tmp_path):
    """A recorded tool-using step replays with its tool mask (its length metrics count the policy's tokens)."""
    from mindrlhf.trainer.experience import load_experience, save_experience

    exp = _experience(9)
    tools = (np.arange(9)[None, :] % 3 != 1).astype(np.int32).repeat(4, 0)
    exp.extras["tool_mask"] = tools
    save_experience(exp, tmp_path / "d.step1.npz")
    back = load_experience(tmp_path / "d.step1.npz")
    np.testing.assert_array_equal(back.extras["tool_mask"], tools)
    np.testing.assert_array_equal(back.extras["completion_present"], exp.extras["completion_present"])
    del exp.extras["tool_mask"]
    save_experience(exp, tmp_path / "e.step1.npz")
    assert "tool_mask" not in load_experience(tmp_path / "e.step1.npz").extras

"""Advantages, KL estimators, policy losses and loss aggregation against hand-computed numbers.

Expected values come from a small float64 numpy re-implementation of the formulas in DESIGN.md
(written independently of the MindSpore code) or literally by hand; gradients are checked against
central finite differences of that numpy loss, or against the analytic derivative.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindrlhf.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    get_advantage_estimator,
    get_is_mode,
    get_policy_loss,
    group_advantages,
    kl_penalty,
    loss_denominators,
    off_policy_sequence_mask,
    policy_loss,
)
from mindrlhf.errors import MindRLHFError

MAX_LEN = 6  # max_completion_length for seq-mean-token-sum-norm


# --- numpy reference (float64) -------------------------------------------------------------------
def np_kl(logp, ref, estimator):
    d = logp - ref
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d**2
    return np.exp(ref - logp) - (ref - logp) - 1.0


def np_ratio(logp, old, mask, loss_type):
    """Token ratios (B, T) for grpo; the sequence ratio broadcast to (B, T) for gspo/gspo-token."""
    lr = np.where(mask > 0, logp - old, 0.0)
    if loss_type == "grpo":
        return np.exp(lr)
    n = mask.sum(-1, keepdims=True)
    seq = np.where(n > 0, lr.sum(-1, keepdims=True) / np.maximum(n, 1), 0.0)
    return np.broadcast_to(np.exp(seq), logp.shape)


def np_per_token(logp, old, adv, mask, loss_type, el, eh):
    r = np_ratio(logp, old, mask, loss_type)
    a = adv[:, None] if adv.ndim == 1 else adv
    return -np.minimum(r * a, np.clip(r, 1 - el, 1 + eh) * a)


def np_aggregate(loss, mask, mode, max_len=None, n_tokens=None, n_seqs=None):
    m = mask > 0
    loss = np.where(m, loss, 0.0)
    if mode == "token-mean":
        return loss.sum() / (m.sum() if n_tokens is None else n_tokens)
    per_seq_tokens = m.sum(-1)
    nonempty = per_seq_tokens > 0
    if mode == "seq-mean-token-mean":
        seq = np.array([loss[i].sum() / per_seq_tokens[i] if nonempty[i] else 0.0 for i in range(len(m))])
    else:
        seq = loss.sum(-1) / max_len
    return seq.sum() / (nonempty.sum() if n_seqs is None else n_seqs)


def np_loss(logp, old, adv, mask, loss_type, mode, beta=0.0, ref=None, kl="k3", el=0.2, eh=0.2):
    per_token = np_per_token(logp, old, adv, mask, loss_type, el, eh)
    if beta > 0:
        per_token = per_token + beta * np_kl(logp, ref, kl)
    return np_aggregate(per_token, mask, mode, MAX_LEN)


def finite_diff(fn, x, h=1e-6):
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        g[idx] = (fn(xp) - fn(xm)) / (2 * h)
    return g


# --- MindSpore helpers ---------------------------------------------------------------------------
def t(x):
    return Tensor(np.asarray(x, dtype=np.float32))


def ms_loss_grad(logp, old, adv, mask, **kw):
    """(loss, metrics, d loss / d logp) with mindspore.grad."""
    old_t, adv_t, mask_t = t(old), t(adv), t(mask)
    ref_t = t(kw.pop("ref_logp")) if kw.get("ref_logp") is not None else None
    kw.pop("ref_logp", None)

    def f(lp):
        return policy_loss(lp, old_t, adv_t, mask_t, ref_logp=ref_t, **kw)[0]

    loss, metrics = policy_loss(t(logp), old_t, adv_t, mask_t, ref_logp=ref_t, **kw)
    grad = ms.grad(f)(t(logp))
    return float(loss), {k: float(v) for k, v in metrics.items()}, grad.asnumpy()


@pytest.fixture(scope="module")
def batch():
    """4 sequences (one empty), ratios spread over the clip boundaries but away from the kinks."""
    rng = np.random.default_rng(7)
    b, T = 4, 5
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], np.float64)
    old = rng.uniform(-3.0, -0.2, (b, T))
    logp = old + rng.uniform(-0.45, 0.45, (b, T))
    ref = old + rng.uniform(-0.6, 0.6, (b, T))
    adv = np.array([-0.9, 1.3, 0.6, 0.4])
    # Round to float32 so numpy and MindSpore see the same inputs.
    logp, old, ref = (x.astype(np.float32).astype(np.float64) for x in (logp, old, ref))
    for loss_type in ("grpo", "gspo"):  # finite differences need every ratio away from 1±ε
        r = np_ratio(logp, old, mask, loss_type)[mask > 0]
        assert np.abs(r - 0.8).min() > 1e-3 and np.abs(r - 1.2).min() > 1e-3
    a = np.broadcast_to(adv[:, None], mask.shape)[mask > 0]
    r = np_ratio(logp, old, mask, "grpo")[mask > 0]
    assert ((r > 1.2) & (a > 0)).any() and ((r < 0.8) & (a < 0)).any()  # both clip sides are exercised
    r = np_ratio(logp, old, mask, "gspo")[mask > 0]
    assert ((r < 0.8) & (a < 0)).any()
    return dict(logp=logp, old=old, ref=ref, adv=adv, mask=mask)


# --- advantages ----------------------------------------------------------------------------------
def test_group_advantages_hand_cases():
    r = np.array([1, 0, 0, 1, 2, 2, 2, 2], np.float32)
    # group 1: mean 0.5, unbiased std sqrt(4·0.25/3) = 0.57735; group 2 identical → 0
    np.testing.assert_allclose(
        group_advantages(r, 4, "group"), [0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0], atol=2e-6
    )
    # batch: mean 1.25, unbiased std sqrt(5.5/7) = 0.886405 → ±0.5/0.886405
    np.testing.assert_allclose(
        group_advantages(r, 4, "batch"), [0.564076, -0.564076, -0.564076, 0.564076, 0, 0, 0, 0], atol=2e-6
    )
    np.testing.assert_allclose(group_advantages(r, 4, "none"), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    assert group_advantages(r, 4).dtype == np.float32


def test_group_advantages_registry():
    r = np.array([3.0, 1.0, 0.0, 2.0, 5.0, 1.0])
    assert set(ADVANTAGE_ESTIMATORS) >= {"grpo", "dr_grpo", "batch_std"}
    for name, mode in [("grpo", "group"), ("dr_grpo", "none"), ("batch_std", "batch")]:
        np.testing.assert_allclose(get_advantage_estimator(name)(r, 3), group_advantages(r, 3, mode))
    with pytest.raises(MindRLHFError, match=r"unknown advantage estimator 'ppo'.*batch_std, dr_grpo, grpo, "
                       r"reinforce_plus_plus, reinforce_plus_plus_baseline, rloo"):
        get_advantage_estimator("ppo")


def test_rloo_hand_cases():
    rloo = get_advantage_estimator("rloo")
    # group [3, 1, 0, 2]: each minus the mean of the other three, e.g. 3 - (1 + 0 + 2) / 3 = 2
    np.testing.assert_allclose(rloo(np.array([3.0, 1.0, 0.0, 2.0]), 4), [2.0, -2 / 3, -2.0, 2 / 3], atol=1e-12)
    # NaN rewards: left out of the baseline, advantage 0; one valid reward has no baseline → 0
    r = np.array([1.0, np.nan, 4.0, 1.0, 5.0, np.nan, np.nan, np.nan], np.float32)
    np.testing.assert_allclose(rloo(r, 4), [1 - 2.5, 0, 4 - 1, 1 - 2.5, 0, 0, 0, 0], atol=1e-6)
    assert rloo(r, 4).dtype == np.float32
    # equal to n/(n-1) times Dr.GRPO's centred reward on a full group
    x = np.array([0.3, 0.9, 0.1, 0.5, 0.7, 0.2])
    np.testing.assert_allclose(rloo(x, 3), 1.5 * group_advantages(x, 3, "none"), atol=1e-12)


def test_informative_groups():
    from mindrlhf.algorithms import informative_groups

    r = np.array([1, 1, 1, 1, 0, 1, 0, 0, 2, np.nan, np.nan, np.nan, 3, np.nan, 4, 4], np.float64)
    # flat; spread; one valid reward (no spread); spread among the valid ones [3, 4, 4]
    np.testing.assert_array_equal(informative_groups(r, 4), [False, True, False, True])


def test_group_advantages_nan_rewards_are_excluded():
    r = np.array([1.0, np.nan, 0.0, 1.0, np.nan, np.nan, np.nan, np.nan, 3.0, np.nan, np.nan, np.nan])
    # group 1 valid [1, 0, 1]: mean 2/3, unbiased std sqrt((1/9 + 4/9 + 1/9)/2) = sqrt(1/3)
    s = math.sqrt(1 / 3) + 1e-6
    expected = [(1 / 3) / s, 0.0, (-2 / 3) / s, (1 / 3) / s] + [0.0] * 8
    for mode in ("group", "batch", "none"):
        adv = group_advantages(r, 4, mode)
        assert not np.isnan(adv).any()
        assert adv[1] == 0 and (adv[4:] == 0).all()
    np.testing.assert_allclose(group_advantages(r, 4, "group"), expected, rtol=1e-9)
    np.testing.assert_allclose(group_advantages(r, 4, "none")[:4], [1 / 3, 0, -2 / 3, 1 / 3])
    # batch std over all valid rewards [1, 0, 1, 3]: mean 1.25, unbiased var (0.0625+1.5625+0.0625+3.0625)/3
    bs = math.sqrt(4.75 / 3) + 1e-6
    np.testing.assert_allclose(group_advantages(r, 4, "batch")[:4], [(1 / 3) / bs, 0, (-2 / 3) / bs, (1 / 3) / bs])


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_group_advantages_identical_rewards_are_zero(mode, eps):
    adv = group_advantages(np.full(6, 0.7, np.float32), 3, mode, eps=eps)
    assert not np.isnan(adv).any() and (adv == 0).all()


def test_group_advantages_numpy_and_tensor_agree():
    r = np.array([0.5, 1.0, np.nan, 0.0, 2.0, 1.5], np.float32)
    for mode in ("group", "batch", "none"):
        out_np = group_advantages(r, 3, mode)
        out_ms = group_advantages(Tensor(r), 3, mode)
        assert isinstance(out_np, np.ndarray) and isinstance(out_ms, Tensor)
        assert out_ms.dtype == ms.float32 and out_ms.shape == (6,)
        np.testing.assert_array_equal(out_ms.asnumpy(), out_np)
    ints = np.array([1, 0, 0, 1])
    assert group_advantages(ints, 2, "none").dtype == np.float32
    out = group_advantages(Tensor(ints), 2, "none")
    assert out.dtype == ms.float32 and out.asnumpy().tolist() == [0.5, -0.5, -0.5, 0.5]
    out = group_advantages(Tensor(np.array([1.0, 0.0]), ms.bfloat16), 2, "none")
    assert out.dtype == ms.bfloat16 and out.astype(ms.float32).asnumpy().tolist() == [0.5, -0.5]


def test_group_advantages_bad_inputs():
    with pytest.raises(MindRLHFError, match="num_generations=4"):
        group_advantages(np.zeros(6), 4)
    with pytest.raises(MindRLHFError, match="scale_rewards='std'"):
        group_advantages(np.zeros(6), 3, "std")


# --- KL ------------------------------------------------------------------------------------------
def test_kl_estimators_hand_values():
    logp = t([-1.0, -2.0, -0.5])
    ref = t([-1.5, -1.0, -0.5])
    # d = logp - ref = [0.5, -1, 0]
    np.testing.assert_allclose(kl_penalty(logp, ref, "k1").asnumpy(), [0.5, -1.0, 0.0], atol=1e-7)
    np.testing.assert_allclose(kl_penalty(logp, ref, "k2").asnumpy(), [0.125, 0.5, 0.0], atol=1e-7)
    # k3 = exp(-d) + d - 1: exp(-0.5) - 0.5 = 0.1065307; e - 2 = 0.7182818
    np.testing.assert_allclose(kl_penalty(logp, ref, "k3").asnumpy(), [0.1065307, 0.7182818, 0.0], rtol=1e-5, atol=1e-7)
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}
    with pytest.raises(MindRLHFError, match="unknown KL estimator 'k4'; choose one of k1, k2, k3"):
        kl_penalty(logp, ref, "k4")


# --- aggregation ---------------------------------------------------------------------------------
def test_aggregate_loss_hand_values():
    loss = t([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    mask = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the empty third sequence is not counted
    assert float(aggregate_loss(loss, mask, "token-mean")) == pytest.approx(7 / 3)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx((1.5 + 4) / 2)
    got = aggregate_loss(loss, mask, "seq-mean-token-sum-norm", max_completion_length=4)
    assert float(got) == pytest.approx((3 / 4 + 4 / 4) / 2)
    assert float(aggregate_loss(loss, mask, "token-mean", global_num_tokens=7)) == pytest.approx(1.0)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-mean", global_num_seqs=Tensor(11.0))) == pytest.approx(
        0.5
    )
    n_tok, n_seq = loss_denominators(mask)
    assert (float(n_tok), float(n_seq)) == (3.0, 2.0)


def test_aggregate_loss_empty_mask_is_zero_not_nan():
    loss = t([[1.0, 2.0], [3.0, 4.0]])
    mask = t([[0, 0], [0, 0]])
    for mode in LOSS_AGG_MODES:
        assert float(aggregate_loss(loss, mask, mode, max_completion_length=2)) == 0.0


def test_aggregate_loss_bad_args():
    loss, mask = t([[1.0]]), t([[1.0]])
    with pytest.raises(MindRLHFError, match="loss_agg_mode='sum'"):
        aggregate_loss(loss, mask, "sum")
    with pytest.raises(MindRLHFError, match="needs max_completion_length"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")


# --- policy loss: value and gradient grid --------------------------------------------------------
@pytest.mark.parametrize("kl", [None, "k1", "k2", "k3"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_type", ["grpo", "gspo", "gspo-token"])
def test_policy_loss_value_grad_metrics(batch, loss_type, mode, kl):
    beta = 0.0 if kl is None else 0.05
    b = batch
    loss, metrics, grad = ms_loss_grad(
        b["logp"],
        b["old"],
        b["adv"],
        b["mask"],
        ref_logp=b["ref"] if kl else None,
        loss_type=loss_type,
        beta=beta,
        kl_estimator=kl or "k3",
        loss_agg_mode=mode,
        max_completion_length=MAX_LEN,
    )
    # gspo-token has gspo's value and gradient (per-sequence advantages), so gspo is its reference.
    ref_type = "grpo" if loss_type == "grpo" else "gspo"

    def fn(lp):
        return np_loss(lp, b["old"], b["adv"], b["mask"], ref_type, mode, beta, b["ref"], kl or "k3")

    assert loss == pytest.approx(fn(b["logp"]), rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(grad, finite_diff(fn, b["logp"]), rtol=1e-4, atol=1e-6)
    assert (grad[b["mask"] == 0] == 0).all()

    m = b["mask"] > 0
    r = np_ratio(b["logp"], b["old"], b["mask"], ref_type)
    a = np.broadcast_to(b["adv"][:, None], r.shape)
    low, high = (r < 0.8) & (a < 0), (r > 1.2) & (a > 0)
    clip_m = m
    if loss_type == "gspo":  # one ratio per sequence: TRL reports the fraction of sequences
        clip_m, low, high = m.any(-1), low[:, 0], high[:, 0]
    assert metrics["clip_ratio/low_mean"] == pytest.approx(low[clip_m].mean())
    assert metrics["clip_ratio/high_mean"] == pytest.approx(high[clip_m].mean())
    assert metrics["clip_ratio/region_mean"] == pytest.approx((low | high)[clip_m].mean())
    expected_kl = np_kl(b["logp"], b["ref"], kl)[m].mean() if kl else 0.0
    assert metrics["kl"] == pytest.approx(expected_kl, rel=1e-5, abs=1e-7)


def test_clipping_stops_gradient_exactly_where_it_should():
    # One token per sequence, old_logp = 0 so r = exp(logp); ε = 0.2; token-mean over 5 tokens.
    logp = np.log([1.5, 1.5, 0.7, 0.7, 1.1])
    adv = np.array([1.0, -1.0, -1.0, 1.0, 1.0])
    loss, metrics, grad = ms_loss_grad(
        logp[:, None], np.zeros((5, 1)), adv, np.ones((5, 1)), loss_type="grpo", loss_agg_mode="token-mean"
    )
    # per token ℓ = -min(rA, clip(r)A):
    #   r=1.5, A=+1 → -1.2 (clipped, grad 0)      r=1.5, A=-1 → +1.5 (unclipped, dℓ/dlogp = -rA = 1.5)
    #   r=0.7, A=-1 → +0.8 (clipped, grad 0)      r=0.7, A=+1 → -0.7 (unclipped, grad -0.7)
    #   r=1.1, A=+1 → -1.1 (inside the trust region, grad -1.1)
    assert loss == pytest.approx((-1.2 + 1.5 + 0.8 - 0.7 - 1.1) / 5, abs=1e-6)
    np.testing.assert_allclose(grad[:, 0], np.array([0.0, 1.5, 0.0, -0.7, -1.1]) / 5, atol=1e-6)
    assert grad[0, 0] == 0.0 and grad[2, 0] == 0.0
    assert metrics["clip_ratio/high_mean"] == pytest.approx(1 / 5)
    assert metrics["clip_ratio/low_mean"] == pytest.approx(1 / 5)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(2 / 5)


def test_dapo_clip_higher():
    # DAPO = grpo with ε_high > ε_low: r = 1.25 is clipped at ε_high = 0.2 but not at 0.28.
    logp = np.log([[1.25]])
    kw = dict(loss_type="grpo", loss_agg_mode="token-mean", epsilon_low=0.2)
    loss, metrics, grad = ms_loss_grad(logp, np.zeros((1, 1)), np.array([1.0]), np.ones((1, 1)), **kw)
    assert (loss, float(grad[0, 0]), metrics["clip_ratio/high_mean"]) == pytest.approx((-1.2, 0.0, 1.0))
    loss, metrics, grad = ms_loss_grad(
        logp, np.zeros((1, 1)), np.array([1.0]), np.ones((1, 1)), epsilon_high=0.28, **kw
    )
    assert (loss, float(grad[0, 0]), metrics["clip_ratio/high_mean"]) == pytest.approx((-1.25, -1.25, 0.0))
    with pytest.raises(MindRLHFError, match="DAPO is loss_type='grpo'"):
        get_policy_loss("dapo")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gspo_token_equals_gspo(batch, mode):
    b = batch
    common = dict(loss_agg_mode=mode, max_completion_length=MAX_LEN, beta=0.02, ref_logp=b["ref"])
    seq = ms_loss_grad(b["logp"], b["old"], b["adv"], b["mask"], loss_type="gspo", **dict(common))
    tok = ms_loss_grad(b["logp"], b["old"], b["adv"], b["mask"], loss_type="gspo-token", **dict(common))
    assert tok[0] == pytest.approx(seq[0], rel=1e-6)
    assert tok[1]["kl"] == pytest.approx(seq[1]["kl"])
    np.testing.assert_allclose(tok[2], seq[2], rtol=1e-5, atol=1e-7)


def test_gspo_token_with_token_advantages_hand_gradient():
    # One sequence of 3 tokens, mean log-ratio 0.05 → s = e^0.05 = 1.05127 (inside [0.8, 1.2]).
    # ℓ_t = -s·A_t with gradient dℓ_t/dlogp_t = -s·A_t on its own token only; seq-mean over 3 tokens.
    logp = np.array([[0.1, 0.0, 0.05]])
    adv = np.array([[1.0, -2.0, 0.5]])
    s = math.exp(0.05)
    loss, _, grad = ms_loss_grad(logp, np.zeros((1, 3)), adv, np.ones((1, 3)), loss_type="gspo-token")
    assert loss == pytest.approx(-s * (1.0 - 2.0 + 0.5) / 3, rel=1e-6)
    np.testing.assert_allclose(grad, -s * adv / 3, rtol=1e-6)
    with pytest.raises(MindRLHFError, match="loss_type='gspo' needs one advantage per sequence"):
        ms_loss_grad(logp, np.zeros((1, 3)), adv, np.ones((1, 3)), loss_type="gspo")


@pytest.mark.parametrize("loss_type", ["grpo", "gspo", "gspo-token"])
def test_on_policy_has_no_clipping(batch, loss_type):
    b = batch
    loss, metrics, grad = ms_loss_grad(b["logp"], b["logp"], b["adv"], b["mask"], loss_type=loss_type)
    assert metrics["clip_ratio/low_mean"] == 0.0
    assert metrics["clip_ratio/high_mean"] == 0.0
    assert metrics["clip_ratio/region_mean"] == 0.0
    assert metrics["kl"] == 0.0
    # r = 1: the loss is -mean over non-empty sequences of A; d/dlogp_t = -A_i / |y_i| / n_seqs.
    n = b["mask"].sum(-1)
    nonempty = n > 0
    assert loss == pytest.approx(-b["adv"][nonempty].mean(), rel=1e-6)
    expected = np.where(b["mask"] > 0, -b["adv"][:, None] / np.maximum(n, 1)[:, None] / nonempty.sum(), 0.0)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("loss_type", ["grpo", "gspo-token"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_sum_to_the_unsplit_loss(mode, loss_type):
    rng = np.random.default_rng(3)
    b, T = 7, 6
    lengths = np.array([6, 1, 0, 4, 3, 6, 2])
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    old = rng.uniform(-2.0, -0.5, (b, T)).astype(np.float32)
    logp = (old + rng.uniform(-0.4, 0.4, (b, T))).astype(np.float32)
    ref = (old + rng.uniform(-0.3, 0.3, (b, T))).astype(np.float32)
    adv = rng.normal(size=b).astype(np.float32)
    kw = dict(loss_type=loss_type, loss_agg_mode=mode, max_completion_length=MAX_LEN, beta=0.04)
    full_loss, _, full_grad = ms_loss_grad(logp, old, adv, mask, ref_logp=ref, **kw)

    # Global counts = sums of the micro-batches' loss_denominators (an all-reduce across ranks).
    counts = [loss_denominators(t(mask[lo:hi])) for lo, hi in ((0, 2), (2, 5), (5, 7))]
    n_tok, n_seq = sum(c[0] for c in counts), sum(c[1] for c in counts)  # 0-d Tensors
    assert (float(n_tok), float(n_seq)) == (22.0, 6.0)  # the empty sequence is not counted
    # Uneven splits into 2 micro-batches (counts as Python ints) and 3 (counts as Tensors).
    for bounds, as_int in (([0, 3, 7], True), ([0, 2, 5, 7], False)):
        if as_int:
            n_tok, n_seq = int(n_tok), int(n_seq)
        else:
            n_tok, n_seq = Tensor(float(n_tok)), Tensor(float(n_seq))
        total, grads = 0.0, []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            part, _, g = ms_loss_grad(
                logp[lo:hi], old[lo:hi], adv[lo:hi], mask[lo:hi], ref_logp=ref[lo:hi],
                global_num_tokens=n_tok, global_num_seqs=n_seq, **kw,
            )
            total += part
            grads.append(g)
        assert total == pytest.approx(full_loss, rel=1e-5, abs=1e-7)
        np.testing.assert_allclose(np.concatenate(grads), full_grad, rtol=1e-5, atol=1e-8)


def test_log_ratio_outlier_is_clamped_not_inf():
    # One token 100 nats more likely under the policy than when sampled: exp(100) overflows float32.
    # Clamped at 20: with A = -1 the loss is -min(rA, clip(r)A) = exp(20) (finite, no gradient past the
    # bound); with A = +1 it is clipped at 1 + ε = 1.2 as before. The KL term is clamped the same way.
    logp, old = np.array([[100.0]]), np.zeros((1, 1))
    loss, _, grad = ms_loss_grad(logp, old, np.array([-1.0]), np.ones((1, 1)), loss_agg_mode="token-mean")
    assert loss == pytest.approx(math.exp(20.0), rel=1e-5) and float(grad[0, 0]) == 0.0
    loss, _, grad = ms_loss_grad(logp, old, np.array([1.0]), np.ones((1, 1)), loss_agg_mode="token-mean")
    assert (loss, float(grad[0, 0])) == pytest.approx((-1.2, 0.0))
    # k3 with d = logp - ref = -100 would be exp(100) - 101; clamped, d = -20: exp(20) - 21.
    loss, metrics, _ = ms_loss_grad(np.array([[-100.0]]), np.array([[-100.0]]), np.array([0.0]), np.ones((1, 1)),
                                    ref_logp=np.zeros((1, 1)), beta=1.0, loss_agg_mode="token-mean")
    assert metrics["kl"] == pytest.approx(math.exp(20.0) - 21.0, rel=1e-5) and loss == pytest.approx(metrics["kl"])


def test_importance_sampling_modes_hand_values_and_gradient():
    # trainer − sampler log-ratios of 2 completions (the second has 2 valid tokens); cap 2.
    gap = np.array([[0.5, 1.0, -0.2], [0.3, 0.1, 0.0]])
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.float64)
    e = np.exp
    expected = {
        "token_truncate": [[e(0.5), 2.0, e(-0.2)], [e(0.3), e(0.1), 1.0]],
        "token_mask": [[e(0.5), 0.0, e(-0.2)], [e(0.3), e(0.1), 1.0]],
        "sequence_truncate": [[2.0], [e(0.4)]],        # exp(1.3) = 3.67 capped; exp(0.4) = 1.49
        "sequence_mask": [[0.0], [e(0.4)]],
    }
    for mode, want in expected.items():
        got = get_is_mode(mode)(t(gap), t(mask), 2.0).asnumpy()
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=mode)
    # The weights scale the policy term and its gradient, not the KL term (TRL's order), and get no gradient.
    w = np.array([[0.5, 2.0, 1.0], [1.5, 0.0, 1.0]])
    logp, ref = np.full((2, 3), -1.0), np.full((2, 3), -1.2)
    kw = dict(loss_agg_mode="token-mean", ref_logp=ref, beta=0.1)
    plain, m, grad = ms_loss_grad(logp, logp, np.array([1.0, -2.0]), mask, **kw)
    weighted, _, wgrad = ms_loss_grad(logp, logp, np.array([1.0, -2.0]), mask, is_weights=t(w), **kw)
    kl = m["kl"]  # on-policy: ratio 1, per-token policy loss -A
    assert plain == pytest.approx((-1.0 * 3 + 2.0 * 2) / 5 + 0.1 * kl, rel=1e-6)
    assert weighted == pytest.approx((-1.0 * 3.5 + 2.0 * 1.5) / 5 + 0.1 * kl, rel=1e-6)
    kl_grad = grad + np.array([[1.0], [-2.0]]) * mask / 5  # remove the policy term's -A/5
    np.testing.assert_allclose(wgrad, kl_grad - np.array([[1.0], [-2.0]]) * w * mask / 5, atol=1e-6)


def test_decoupled_loss_hand_values_and_gradient():
    """AReaL's decoupled PPO (Fu et al. 2025, eq. 5): -w * min(u A, clip(u) A) with u = pi_theta / pi_prox and
    w = pi_prox / pi_behav (0 above the cap), token-mean over 5 valid tokens; reference in float64 by hand."""
    logp = np.array([[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]])    # pi_theta
    prox = np.array([[-1.1, -0.9, -2.0], [-0.3, -1.0, -0.9]])    # the trainer's before the update (old_logp)
    behav = np.array([[-1.3, -0.8, -3.2], [-0.5, -1.0, -0.9]])   # the sampler's, some updates earlier
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.float64)
    adv = np.array([1.0, -2.0])
    e = np.exp
    # Token by token: u = e(0.1), e(0.4) (clipped to 1.2: A > 0), e(0); w = e(0.2), e(-0.1), e(1.2) > 3 -> 0.
    # Row 2 (A = -2): u = 1, e(-0.2) = 0.819 (inside the clip); w = e(0.2), 1; the third token is padding.
    per_token = [-e(0.2) * e(0.1), -e(-0.1) * 1.2, 0.0, -e(0.2) * -2.0, -1.0 * (e(-0.2) * -2.0)]
    want = sum(per_token) / 5
    kw = dict(loss_type="decoupled", epsilon_low=0.2, epsilon_high=0.2, loss_agg_mode="token-mean",
              behav_logp=t(behav), behav_cap=3.0)
    loss, metrics, grad = ms_loss_grad(logp, prox, adv, mask, **kw)
    assert loss == pytest.approx(want, rel=1e-6)
    # d/dlogp of -w u A / 5 is -w u A / 5 where the min picks the unclipped term; 0 where clipped, capped, padded.
    want_grad = np.array([[-e(0.2) * e(0.1), 0.0, 0.0], [e(0.2) * 2.0, e(-0.2) * 2.0, 0.0]]) / 5
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(1 / 5)  # the clip is on the proximal ratio
    # Behaviour == proximal (a synchronous row): weight 1, the grpo loss exactly.
    same = ms_loss_grad(logp, prox, adv, mask, **dict(kw, behav_logp=t(prox)))[0]
    grpo = ms_loss_grad(logp, prox, adv, mask, loss_type="grpo", loss_agg_mode="token-mean")[0]
    assert same == pytest.approx(grpo, rel=1e-7)
    assert loss != pytest.approx(grpo, rel=1e-3)


def test_padding_garbage_does_not_leak():
    # Padded positions holding -inf/NaN log-probs must not turn the loss or gradient into NaN.
    logp = np.array([[-1.0, -np.inf, np.nan], [-0.5, -0.7, -np.inf]])
    old = np.array([[-1.1, np.nan, -np.inf], [-0.6, -0.6, np.nan]])
    mask = np.array([[1, 0, 0], [1, 1, 0]])
    for mode in LOSS_AGG_MODES:
        loss, metrics, grad = ms_loss_grad(
            logp, old, np.array([1.0, -1.0]), mask, ref_logp=old, beta=0.1,
            loss_agg_mode=mode, max_completion_length=3,
        )
        assert np.isfinite(loss) and all(np.isfinite(v) for v in metrics.values())
        assert np.isfinite(grad).all() and (grad[mask == 0] == 0).all()


def test_policy_loss_in_jit_matches_pynative(batch, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a failed graph compile writes rank_0/om/analyze_fail.ir into the cwd
    b = batch
    old, adv, mask, ref = t(b["old"]), t(b["adv"]), t(b["mask"]), t(b["ref"])

    def f(lp, n_tok):
        return policy_loss(
            lp, old, adv, mask, ref_logp=ref, beta=0.1, epsilon_high=0.28,
            loss_agg_mode="token-mean", global_num_tokens=n_tok,
        )

    def loss_only(lp, n_tok):
        return f(lp, n_tok)[0]

    n_tok = Tensor(9.0)
    eager_loss, eager_metrics = f(t(b["logp"]), n_tok)
    jit_loss, jit_metrics = ms.jit(f)(t(b["logp"]), n_tok)
    eager_grad = ms.grad(loss_only)(t(b["logp"]), n_tok)
    jit_grad = ms.jit(ms.grad(loss_only))(t(b["logp"]), n_tok)
    assert float(jit_loss) == pytest.approx(float(eager_loss), rel=1e-6)
    for k in eager_metrics:
        assert float(jit_metrics[k]) == pytest.approx(float(eager_metrics[k]), rel=1e-6)
    np.testing.assert_allclose(jit_grad.asnumpy(), eager_grad.asnumpy(), rtol=1e-6, atol=1e-9)

    def needs_ref(lp):
        return policy_loss(lp, old, adv, mask, beta=0.1)[0]

    with pytest.raises(MindRLHFError, match="needs ref_logp"):
        ms.jit(needs_ref)(t(b["logp"]))

    def unknown_loss(lp):  # the registry look-up raises the one-line error inside a graph too
        return policy_loss(lp, old, adv, mask, loss_type="ppo")[0]

    known = ("unknown policy loss 'ppo'; choose one of cispo, clip_cov, decoupled, gmpo, grpo, gspo, gspo-token, "
             "kl_cov, luspo, sapo, vespo")
    with pytest.raises(MindRLHFError, match=known):
        ms.jit(unknown_loss)(t(b["logp"]))


def test_policy_loss_argument_errors(batch):
    b = batch
    args = (t(b["logp"]), t(b["old"]), t(b["adv"]), t(b["mask"]))
    assert set(POLICY_LOSSES) == {"grpo", "gspo", "gspo-token", "decoupled", "cispo", "sapo", "gmpo", "clip_cov",
                                  "kl_cov", "luspo", "vespo"}
    with pytest.raises(MindRLHFError, match="beta=0.1 > 0 needs ref_logp"):
        policy_loss(*args, beta=0.1)
    known = ("unknown policy loss 'ppo'; choose one of cispo, clip_cov, decoupled, gmpo, grpo, gspo, gspo-token, "
             "kl_cov, luspo, sapo, vespo")
    with pytest.raises(MindRLHFError, match=known):
        policy_loss(*args, loss_type="ppo")
    with pytest.raises(MindRLHFError, match="unknown KL estimator 'kl'"):
        policy_loss(*args, kl_estimator="kl")
    with pytest.raises(MindRLHFError, match="needs max_completion_length"):
        policy_loss(*args, loss_agg_mode="seq-mean-token-sum-norm")
    for loss_type in ("gmpo", "luspo"):
        with pytest.raises(MindRLHFError, match=f"^loss_type='{loss_type}' is a mean over sequences and needs "
                                                "loss_agg_mode='seq-mean-token-mean', got 'token-mean'$"):
            policy_loss(*args, loss_type=loss_type, loss_agg_mode="token-mean")
    per_sequence = t(np.ones((len(b["adv"]), 1)))  # a sequence mode's weights: VESPO folds per-token ones only
    with pytest.raises(MindRLHFError, match=r"^loss_type='vespo' folds per-token importance weights of shape \(4, 5\) "
                                            r"into its sequence weight, got \(4, 1\); use importance_sampling_mode "
                                            "token_truncate or token_mask$"):
        policy_loss(*args, loss_type="vespo", loss_agg_mode="token-mean", is_ratio=per_sequence)


# --- CISPO, SAPO, GMPO, Clip-Cov, KL-Cov, LUSPO, VESPO: float64 hand computations -------------------------
# One hand-made case: 2 completions (3 and 2 valid tokens), old log-probs 0 so r_t = exp(logp_t), with ratios on
# both sides of every clip bound used below and both advantage signs; token-mean over the 5 valid tokens unless
# a test says otherwise. Gradients of losses with a stop-gradient weight are written out analytically.
HAND_LOGP = np.log(np.array([[1.5, 0.7, 1.1], [0.6, 1.3, 1.0]]))
HAND_MASK = np.array([[1, 1, 1], [1, 1, 0]], np.float64)
HAND_ADV = np.array([1.0, -2.0])
HAND_A = np.broadcast_to(HAND_ADV[:, None], HAND_LOGP.shape)


def hand_grad(loss_type, logp=HAND_LOGP, adv=HAND_ADV, mask=HAND_MASK, **kw):
    kw.setdefault("loss_agg_mode", "token-mean")
    return ms_loss_grad(logp, np.zeros_like(logp), adv, mask, loss_type=loss_type, **kw)


def test_cispo_hand_values_and_gradient():
    """CISPO (MiniMax-M1, arXiv:2506.13585): -sg(min(r, cap)) * A * logp. A token above the cap keeps a gradient
    of -cap * A (PPO's clip would zero it), and r < 1 - eps is not clipped at all."""
    r = np.exp(HAND_LOGP)
    w = np.minimum(r, 1.2)  # 1.5 -> 1.2; 0.6 stays (no lower bound)
    want = (np.where(HAND_MASK > 0, -w * HAND_A * HAND_LOGP, 0.0)).sum() / 5
    loss, _, grad = hand_grad("cispo", loss_params={"cispo_ratio_max": 1.2})
    assert loss == pytest.approx(want, rel=1e-6)
    np.testing.assert_allclose(grad, np.where(HAND_MASK > 0, -w * HAND_A / 5, 0.0), rtol=1e-5, atol=1e-8)
    assert grad[0, 0] == pytest.approx(-1.2 / 5, rel=1e-6)  # clipped weight, gradient kept


#: grpo's two bounds on HAND_LOGP (ratios 1.5 0.7 1.1 | 0.6 1.3, A = 1 | -2, eps 0.2): the tokens' losses
#: -min(rA, clip(r)A) are -1.2 (clipped) -0.7 -1.1 | 1.6 (clipped) 2.6; a bound of 1.25 on the second row's ratio 1.3
#: (delta) or on its loss -c A = 2.5 (clip_ratio_c) takes 2.6 to 2.5 and its gradient 2.6 to 0. delta 1.4 lies above
#: 1.3 and changes nothing; neither bound touches the positive advantage's clipped ratio 1.5.
GRPO_BOUNDS = {
    "none": ({}, [-1.2, -0.7, -1.1, 1.6, 2.6], [0.0, -0.7, -1.1, 0.0, 2.6]),
    "delta": ({"delta": 1.25}, [-1.2, -0.7, -1.1, 1.6, 2.5], [0.0, -0.7, -1.1, 0.0, 0.0]),
    "delta_above": ({"delta": 1.4}, [-1.2, -0.7, -1.1, 1.6, 2.6], [0.0, -0.7, -1.1, 0.0, 2.6]),
    "dual_clip": ({"clip_ratio_c": 1.25}, [-1.2, -0.7, -1.1, 1.6, 2.5], [0.0, -0.7, -1.1, 0.0, 0.0]),
    "both": ({"delta": 1.4, "clip_ratio_c": 1.25}, [-1.2, -0.7, -1.1, 1.6, 2.5], [0.0, -0.7, -1.1, 0.0, 0.0]),
}


@pytest.mark.parametrize("case", sorted(GRPO_BOUNDS))
def test_grpo_two_sided_and_dual_clip_hand_values(case):
    """INTELLECT-2's delta caps the unclipped ratio, dual-clip PPO's c caps a negative advantage's loss at -c A;
    each by hand on the five tokens (token mean), values and gradients."""
    params, losses, grads = GRPO_BOUNDS[case]
    loss, _, grad = hand_grad("grpo", epsilon_low=0.2, epsilon_high=0.2, loss_params=params)
    assert loss == pytest.approx(sum(losses) / 5, rel=1e-6)
    np.testing.assert_allclose(grad[HAND_MASK > 0], np.array(grads) / 5, rtol=1e-5, atol=1e-7)
    assert grad[1, 2] == 0.0


def test_off_policy_sequence_mask_by_hand():
    """Off-policy sequence masking: a sequence with a negative advantage is dropped when its mean per-token KL from
    the sampler, mean(sampler logp - logp), exceeds the threshold; a positive advantage is always kept; padding
    counts in neither the sum nor the mean."""
    logp = np.array([[-1.0, -1.0, -1.0], [-1.0, -1.0, -9.0], [-2.0, -2.0, -2.0], [-1.0, -1.0, -1.0]])
    sampler = np.array([[-0.7, -0.8, -1.0], [-0.9, -1.0, 0.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    mask = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]], np.float64)
    adv = np.array([-1.0, -1.0, 2.0, -1.0])
    # Mean KL per sequence: 0.5/3 = 0.167, 0.1/2 = 0.05 (the padded -9 / 0 pair ignored), 1.0, none (0).
    keep = off_policy_sequence_mask(t(adv), t(logp), t(sampler), t(mask), 0.1).asnumpy()
    assert keep.shape == (4, 1) and keep[:, 0].tolist() == [0.0, 1.0, 1.0, 1.0]
    assert off_policy_sequence_mask(t(adv), t(logp), t(sampler), t(mask), 0.2).asnumpy()[:, 0].tolist() == [1.0] * 4


def np_sapo(logp, adv, mask, tau_pos, tau_neg):
    r, a = np.exp(logp), np.broadcast_to(adv[:, None], logp.shape)
    tau = np.where(a > 0, tau_pos, tau_neg)
    per = -(1.0 / (1.0 + np.exp(-tau * (r - 1.0)))) * 4.0 / tau * a
    return np.where(mask > 0, per, 0.0).sum() / mask.sum()


def test_sapo_hand_values_and_gradient():
    """SAPO (arXiv:2511.20347): -sigmoid(tau (r - 1)) 4/tau A, tau by the advantage's sign; at r = 1 the gate is
    2/tau with slope 1 (the plain policy gradient), far from 1 it flattens instead of cutting off."""
    kw = {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}
    loss, _, grad = hand_grad("sapo", loss_params=kw)
    fn = lambda lp: np_sapo(lp, HAND_ADV, HAND_MASK, 1.0, 1.05)  # noqa: E731
    assert loss == pytest.approx(fn(HAND_LOGP), rel=1e-5, abs=2e-6)  # float32; a sum of terms of both signs
    np.testing.assert_allclose(grad, finite_diff(fn, HAND_LOGP), rtol=1e-5, atol=1e-7)
    # r = 1 (the padded-out third token of row 2 aside): d/dlogp of -f(r) A at r = 1 is -f'(1) A = -A.
    assert grad[1, 2] == 0.0
    on_policy = hand_grad("sapo", logp=np.zeros((2, 3)), loss_params=kw)[2]
    np.testing.assert_allclose(on_policy, np.where(HAND_MASK > 0, -HAND_A / 5, 0.0), rtol=1e-6)
    # Sharper temperatures damp the far-off-policy token r = 1.5 (A > 0) much more.
    sharp = hand_grad("sapo", loss_params={"sapo_temperature_pos": 8.0, "sapo_temperature_neg": 8.0})[2]
    assert abs(sharp[0, 0]) < 0.2 * abs(grad[0, 0])


def np_gmpo(logp, adv, mask, el, eh):
    lr = np.where(mask > 0, logp, 0.0)
    s = np.sign(adv)[:, None]
    kept = s * np.minimum(s * lr, s * np.clip(lr, -el, eh))
    seq = -adv * np.exp((kept * mask).sum(-1) / mask.sum(-1))
    return seq.mean()


def test_gmpo_hand_values_and_gradient():
    """GMPO (arXiv:2507.20673; verl geo_mean): -A exp(mean_t of the sign-pessimistic log-ratio clipped to
    [-eps_low, eps_high]), a mean over sequences. With eps 0.4: row 1 (A > 0) clips log 1.5 = 0.405 to 0.4 (no
    gradient) but keeps log 0.7; row 2 (A < 0) keeps log 0.6 = -0.51 unclipped (the pessimistic side)."""
    loss, metrics, grad = hand_grad("gmpo", loss_agg_mode="seq-mean-token-mean", epsilon_low=0.4, epsilon_high=0.4)
    fn = lambda lp: np_gmpo(lp, HAND_ADV, HAND_MASK, 0.4, 0.4)  # noqa: E731
    assert loss == pytest.approx(fn(HAND_LOGP), rel=1e-6)
    np.testing.assert_allclose(grad, finite_diff(fn, HAND_LOGP), rtol=1e-5, atol=1e-8)
    g1 = math.exp((0.4 + math.log(0.7) + math.log(1.1)) / 3)  # row 1's geometric mean, first token clipped
    assert grad[0, 0] == 0.0 and grad[0, 1] == pytest.approx(-g1 / 3 / 2, rel=1e-5)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(1 / 5)  # log 1.5 > 0.4 with A > 0
    assert metrics["clip_ratio/low_mean"] == pytest.approx(1 / 5)   # log 0.6 < -0.4 with A < 0


def np_cov(adv, logp, mask):
    m = mask > 0
    a = np.broadcast_to(adv[:, None], logp.shape)
    return (a - a[m].mean()) * (logp - logp[m].mean())


def test_kl_cov_hand_values_and_gradient():
    """KL-Cov (arXiv:2505.22617; verl kl_cov): -A r plus coef |log r| on the max(floor(ratio N), 1) tokens of
    largest covariance (A - mean A)(logp - mean logp); here N = 5, ratio 0.4 -> the 2 largest."""
    cov = np_cov(HAND_ADV, HAND_LOGP, HAND_MASK)
    order = np.argsort(-np.where(HAND_MASK > 0, cov, -np.inf), axis=None)[:2]
    chosen = np.zeros(HAND_LOGP.size, bool)
    chosen[order] = True
    chosen = chosen.reshape(HAND_LOGP.shape)
    assert chosen[0, 0] and chosen[1, 0]  # r = 1.5 with A > 0, r = 0.6 with A < 0: the two far-off tokens
    r = np.exp(HAND_LOGP)
    per = -HAND_A * r + np.where(chosen, 0.5 * np.abs(HAND_LOGP), 0.0)
    loss, _, grad = hand_grad("kl_cov", loss_params={"kl_cov_ratio": 0.4, "kl_cov_coef": 0.5})
    assert loss == pytest.approx(np.where(HAND_MASK > 0, per, 0.0).sum() / 5, rel=1e-6)
    want = -HAND_A * r + np.where(chosen, 0.5 * np.sign(HAND_LOGP), 0.0)
    np.testing.assert_allclose(grad, np.where(HAND_MASK > 0, want / 5, 0.0), rtol=1e-5, atol=1e-8)
    # The default ratio 2e-4 still treats one token (max(floor(0.001), 1)): the largest covariance.
    small = hand_grad("kl_cov", loss_params={"kl_cov_ratio": 2e-4, "kl_cov_coef": 0.5})[2]
    assert (np.abs(small - np.where(HAND_MASK > 0, -HAND_A * r / 5, 0.0)) > 1e-6).sum() == 1


def test_clip_cov_hand_values_and_gradient():
    """Clip-Cov (arXiv:2505.22617; verl clip_cov): PPO's clipped surrogate with the tokens chosen among the
    unclipped ones whose covariance lies in (lb, ub) set to 0. With every such token chosen (ratio 1), the pick
    is the whole eligible set, as verl's random pick is then."""
    cov = np_cov(HAND_ADV, HAND_LOGP, HAND_MASK)
    r = np.exp(HAND_LOGP)
    plain, clipped = -HAND_A * r, -HAND_A * np.clip(r, 0.8, 1.2)
    unclipped = (clipped <= plain) & (HAND_MASK > 0)
    lb, ub = -0.45, 0.2  # covariances: 0.51, -0.40, 0.14 / 0.88, -0.51; the two eligible: -0.40, 0.14
    eligible = unclipped & (cov > lb) & (cov < ub)
    assert eligible.sum() == 2 and not eligible[1, 0]  # r = 0.6, A < 0 is clipped (cov 0.88): never eligible
    per = np.where(eligible, 0.0, np.maximum(plain, clipped))
    dper = np.where(eligible | ~unclipped, 0.0, -HAND_A * r)
    params = {"clip_cov_ratio": 1.0, "clip_cov_lb": lb, "clip_cov_ub": ub}
    loss, _, grad = hand_grad("clip_cov", loss_params=params)
    assert loss == pytest.approx(np.where(HAND_MASK > 0, per, 0.0).sum() / 5, rel=1e-6)
    np.testing.assert_allclose(grad, np.where(HAND_MASK > 0, dper / 5, 0.0), rtol=1e-5, atol=1e-8)
    # Ratio 0.2: max(floor(0.2 * 5), 1) = 1 of the 2 eligible tokens loses its gradient, the other keeps it.
    one = hand_grad("clip_cov", loss_params=dict(params, clip_cov_ratio=0.2))[2]
    zeroed = eligible & (np.abs(one) < 1e-12)
    assert zeroed.sum() == 1
    np.testing.assert_allclose(one[~zeroed], np.where(HAND_MASK > 0, np.where(~unclipped, 0.0, -HAND_A * r) / 5,
                                                      0.0)[~zeroed], rtol=1e-5, atol=1e-8)
    # Bounds that exclude every token: the grpo loss exactly.
    none = hand_grad("clip_cov", loss_params=dict(params, clip_cov_lb=10.0, clip_cov_ub=20.0))
    grpo = hand_grad("grpo")
    assert none[0] == pytest.approx(grpo[0], rel=1e-7)
    np.testing.assert_allclose(none[2], grpo[2], rtol=1e-6)


def test_luspo_hand_values_and_gradient():
    """LUSPO (TRL luspo): GSPO's clipped sequence loss times the sequence length, a mean over sequences. Row 1:
    s = exp(mean log r) = (1.5*0.7*1.1)^(1/3) = 1.0504 inside [0.8, 1.2]; row 2: s = (0.6*1.3)^(1/2) = 0.883."""
    s1, s2 = (1.5 * 0.7 * 1.1) ** (1 / 3), (0.6 * 1.3) ** 0.5
    want = (3 * -s1 * 1.0 + 2 * -s2 * -2.0) / 2
    loss, _, grad = hand_grad("luspo", loss_agg_mode="seq-mean-token-mean")
    assert loss == pytest.approx(want, rel=1e-6)
    # d(-|y| s A)/dlogp_t = -|y| s A / |y| = -s A per token, over 2 sequences.
    np.testing.assert_allclose(grad, np.where(HAND_MASK > 0, [[-s1 / 2] * 3, [2 * s2 / 2] * 3], 0.0), rtol=1e-5)
    # epsilon_high 0.02: row 1's s = 1.05 > 1.02 with A > 0 is clipped: value 3 * -1.02, no gradient.
    loss, _, grad = hand_grad("luspo", loss_agg_mode="seq-mean-token-mean", epsilon_high=0.02)
    assert loss == pytest.approx((3 * -1.02 + 2 * -s2 * -2.0) / 2, rel=1e-6) and (grad[0] == 0).all()


def np_vespo(logp, adv, mask, k_pos, l_pos, k_neg, l_neg):
    log_w = np.clip(np.where(mask > 0, logp, 0.0).sum(-1, keepdims=True), math.log(1e-8), 20.0)
    a = adv[:, None]
    k, lam = np.where(a >= 0, k_pos, k_neg), np.where(a >= 0, l_pos, l_neg)
    return np.exp(lam + k * log_w - lam * np.exp(log_w))


def test_vespo_hand_values_and_gradient():
    """VESPO (TRL vespo): -sg(phi(w)) A logp with phi(w) = exp(lam + k log w - lam w), w = exp(sum_t log r_t);
    phi(1) = 1 and phi falls off on both sides of w = 1, more steeply for the negative advantage's (k, lam)."""
    params = dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)
    phi = np_vespo(HAND_LOGP, HAND_ADV, HAND_MASK, 2.0, 3.0, 3.0, 2.0)
    loss, _, grad = hand_grad("vespo", loss_params=params)
    per = -phi * HAND_A * HAND_LOGP
    assert loss == pytest.approx(np.where(HAND_MASK > 0, per, 0.0).sum() / 5, rel=1e-6)
    np.testing.assert_allclose(grad, np.where(HAND_MASK > 0, -phi * HAND_A / 5, 0.0), rtol=1e-5, atol=1e-8)
    w1 = 1.5 * 0.7 * 1.1  # row 1: phi = exp(3 + 2 log w - 3 w)
    assert phi[0, 0] == pytest.approx(math.exp(3 + 2 * math.log(w1) - 3 * w1)) and phi[0, 0] < 1.0
    on_policy = hand_grad("vespo", logp=np.zeros((2, 3)), loss_params=params)[2]  # w = 1: phi = 1
    np.testing.assert_allclose(on_policy, np.where(HAND_MASK > 0, -HAND_A / 5, 0.0), rtol=1e-6)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "gmpo", "clip_cov", "kl_cov", "luspo", "vespo", "vespo_is"])
def test_new_losses_in_jit_match_pynative(loss_type, tmp_path, monkeypatch):
    """Each loss compiles in a graph to its PyNative value and gradient; vespo_is: VESPO folding token IS weights
    (one of them 0, a masked token)."""
    monkeypatch.chdir(tmp_path)  # a failed graph compile writes rank_0/om/analyze_fail.ir into the cwd
    old, adv, mask = t(np.zeros((2, 3))), t(HAND_ADV), t(HAND_MASK)
    agg = "seq-mean-token-mean" if loss_type in ("gmpo", "luspo") else "token-mean"
    params = {"clip_cov": {"clip_cov_ratio": 0.2, "clip_cov_lb": -0.45, "clip_cov_ub": 0.2},
              "kl_cov": {"kl_cov_ratio": 0.4}}
    is_ratio = t([[1.2, 0.9, 1.0], [0.0, 1.1, 1.0]]) if loss_type == "vespo_is" else None
    loss_type = loss_type.replace("_is", "")

    def f(lp):
        return policy_loss(lp, old, adv, mask, loss_type=loss_type, loss_agg_mode=agg,
                           loss_params=params.get(loss_type), is_ratio=is_ratio)[0]

    np.testing.assert_allclose(float(ms.jit(f)(t(HAND_LOGP))), float(f(t(HAND_LOGP))), rtol=1e-6)
    np.testing.assert_allclose(ms.jit(ms.grad(f))(t(HAND_LOGP)).asnumpy(), ms.grad(f)(t(HAND_LOGP)).asnumpy(),
                               rtol=1e-6, atol=1e-9)


# --- TRL 1.16's own losses on recorded inputs (tests/make_trl_loss_reference.py, run in TRL's venv) --------
TRL_LOSS_REFERENCE = Path(__file__).resolve().parent / "data" / "trl_loss_reference.json"
TRL_REF = json.loads(TRL_LOSS_REFERENCE.read_text(encoding="utf-8"))


def trl_case_kwargs(case):
    """policy_loss's arguments for a TRL case: TRL's aggregation for its loss type and its fields by our names."""
    f = case["fields"]
    if case["loss_type"] == "cispo":  # TRL's epsilon_high is CISPO's cap; aggregated over the batch's tokens
        return dict(loss_agg_mode="token-mean", loss_params={"cispo_ratio_max": f["epsilon_high"]})
    if case["loss_type"] == "sapo":
        return dict(loss_agg_mode="seq-mean-token-mean", loss_params=f)
    if case["loss_type"] == "luspo":
        return dict(loss_agg_mode="seq-mean-token-mean", epsilon_low=f["epsilon"], epsilon_high=f["epsilon_high"])
    if case["loss_type"] in ("grpo", "dapo"):  # TRL's grpo is our default aggregation, its dapo a token mean
        return dict(loss_agg_mode="seq-mean-token-mean" if case["loss_type"] == "grpo" else "token-mean",
                    epsilon_low=f["epsilon"], epsilon_high=f.get("epsilon_high", f["epsilon"]),
                    loss_params={"delta": f.get("delta", 0.0)})
    return dict(loss_agg_mode="token-mean", loss_params=f)  # vespo, whose fields are ours by name


@pytest.mark.parametrize("name", sorted(TRL_REF["cases"]))
def test_loss_equals_trl_reference(name):
    case, data = TRL_REF["cases"][name], TRL_REF["inputs"]
    logp, old, mask = (np.array(data[k], np.float64) for k in ("logp", "old_logp", "mask"))
    loss_type = "grpo" if case["loss_type"] == "dapo" else case["loss_type"]  # TRL's dapo: our grpo, token-mean
    adv, kw = np.array(data["advantages"]), trl_case_kwargs(case)
    threshold = case["fields"].get("off_policy_mask_threshold")
    if threshold is not None:  # TRL's sampling log-probs are the old ones without vLLM
        keep = off_policy_sequence_mask(t(adv), t(logp), t(old), t(mask), threshold)
        kw["is_weights"] = keep
        assert 0 < float(keep.sum()) < len(adv)  # the case drops a sequence and keeps one
    loss, metrics, grad = ms_loss_grad(logp, old, adv, mask, loss_type=loss_type, **kw)
    assert loss == pytest.approx(case["loss"], rel=1e-5, abs=2e-6)  # float32 against TRL's float64
    np.testing.assert_allclose(grad, np.array(case["grad"]), rtol=2e-5, atol=1e-7)
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        if key in case["metrics"]:  # luspo: TRL's clip fractions of the sequence ratio
            assert metrics[key] == pytest.approx(case["metrics"][key]), key


#: TRL's fields -> ours (the rest share our names: loss_type, epsilon_high, vespo_*, off_policy_mask_threshold,
#: scale_rewards, multi_objective_aggregation).
_TRL_NAMES = {"epsilon": "epsilon_low", "vllm_importance_sampling_correction": "importance_sampling_correction",
              "vllm_importance_sampling_mode": "importance_sampling_mode",
              "vllm_importance_sampling_clip_max": "importance_sampling_cap"}


def _rollout_config(fields):
    """Our GRPO config for a TRL rollout case: TRL's fields by our names, 2 iterations per step (so the old policy
    is not the one being trained, as in the recorded log-probs), TRL's default clip range and IS cap, G = 3, and
    VESPO aggregated as TRL does (token-mean; its grpo and dapo are our TRL loss-type names)."""
    from mindrlhf.configs import GRPOConfig

    ours = {"epsilon_low": 0.2, "importance_sampling_cap": 3.0, "beta": 0.0, "num_generations": 3,
            "num_iterations": 2, "max_completion_length": 5}
    if fields["loss_type"] == "vespo":
        ours["loss_agg_mode"] = "token-mean"
    ours.update({_TRL_NAMES.get(k, k): v for k, v in fields.items()})
    ours.setdefault("epsilon_high", ours["epsilon_low"])
    return GRPOConfig.from_dict(ours)


@pytest.mark.parametrize("name", sorted(TRL_REF["rollout_cases"]))
def test_rollout_correction_and_advantages_equal_trl_reference(name):
    """TRL's own _generate_and_score_completions and _compute_loss on fixed sampler / old / policy log-probs and
    per-function rewards (tests/make_trl_loss_reference.py): our advantages (the reward manager's weighted sum and
    the configured estimator, or GDPO's normalize_then_sum), importance-sampling weights, the trainer's GRPO
    objective (VESPO folding the token weights into its sequence weight, the four modes, off-policy masking on the
    sampler's log-probs), its gradient and its sampling / clip metrics equal TRL's. TRL adds 1e-4 to the stds, ours
    1e-6 by default (verl's): the estimator is given TRL's."""
    from mindrlhf.grpo import GRPOObjective, LossSettings
    from mindrlhf.rewards import RewardManager

    case, data = TRL_REF["rollout_cases"][name], TRL_REF["rollout_inputs"]
    cfg = _rollout_config(case["fields"])
    mask = np.array(data["mask"], np.float64)
    logp, old, sampler = (np.array(data[k], np.float64) for k in ("logp", "old_logp", "sampler_logp"))
    G = data["num_generations"]

    # Advantages: each function's scores through the reward manager, then the configured aggregation.
    columns = list(zip(*data["rewards_per_func"]))

    def scorer(i):
        def fn(completions, **_):
            return list(columns[i])
        fn.__name__ = ("first", "second")[i]
        return fn

    manager = RewardManager([scorer(0), scorer(1)], data["reward_weights"])
    total, per_fn = manager([""] * len(mask), [""] * len(mask))
    if cfg.algorithm.multi_objective_aggregation == "normalize_then_sum":
        from mindrlhf.algorithms import normalize_then_sum_advantages

        adv = normalize_then_sum_advantages(np.stack([per_fn["first"], per_fn["second"]], 1), manager.weights, G)
    else:
        adv = get_advantage_estimator(cfg.advantage_estimator)(total, G, eps=1e-4)
    np.testing.assert_allclose(adv, case["advantages"], rtol=1e-5, atol=1e-6)
    assert adv[-1] == 0.0  # no function scored the last completion

    # The trainer's objective on TRL's advantages: loss, d loss / d logp and the metrics.
    settings = LossSettings.from_config(cfg)
    assert settings.off_policy and settings.is_correction
    objective = GRPOObjective(settings)
    adv_t, old_t, sampler_t, mask_t, zeros = t(case["advantages"]), t(old), t(sampler), t(mask), t(np.zeros_like(mask))
    counts = (Tensor(np.float32(mask.sum())), Tensor(np.float32((mask.sum(1) > 0).sum())))

    def f(lp):
        return objective.loss(lp, mask_t, adv_t, old_t, zeros, sampler_t, *counts)[0]

    loss, aux = objective.loss(t(logp), mask_t, adv_t, old_t, zeros, sampler_t, *counts)
    assert float(loss) == pytest.approx(case["loss"], rel=1e-5, abs=2e-6)  # float32 against TRL's float64
    np.testing.assert_allclose(ms.grad(f)(t(logp)).asnumpy(), np.array(case["grad"]), rtol=2e-5, atol=1e-7)
    metrics = objective.metrics({k: float(v) for (k, _), v in zip(objective.aux, aux)})
    checked = [k for k in case["metrics"] if k.startswith(("sampling/", "clip_ratio/")) and k in metrics]
    assert len(checked) >= 5, checked
    for key in checked:
        assert metrics[key] == pytest.approx(case["metrics"][key], rel=1e-5, abs=1e-6), key

    # TRL's importance-sampling weights, as our mode computes them from the trainer/sampler gap.
    weights = get_is_mode(settings.is_mode)(t(np.where(mask > 0, old - sampler, 0.0)), mask_t, settings.is_cap)
    want = np.array(case["importance_sampling_ratio"])
    valid = mask > 0 if want.shape[1] > 1 else np.ones_like(want, bool)
    np.testing.assert_allclose(weights.asnumpy()[valid], want[valid], rtol=1e-5)
    assert 0 < (want[valid] == (0.0 if settings.is_mode.endswith("mask") else settings.is_cap)).sum()  # bites
    if settings.off_policy_mask_threshold:  # the case drops a completion and keeps one with a negative advantage
        from mindrlhf.algorithms import off_policy_sequence_mask

        keep = off_policy_sequence_mask(adv_t, t(logp), sampler_t, mask_t, settings.off_policy_mask_threshold)
        assert 0 < float(((keep.asnumpy()[:, 0] == 1) & (np.array(case["advantages"]) < 0)).sum()) < (
            np.array(case["advantages"]) < 0).sum()


def test_normalize_then_sum_advantages_by_hand():
    """GDPO (TRL's normalize_then_sum): each function normalised in its group (unbiased std + 1e-4), weighted and
    summed, then normalised over the batch. A function 1000x wider than the other no longer decides alone, a NaN is
    left out of its function's statistics and of the sum, a row no function scored gets advantage 0."""
    from mindrlhf.algorithms import normalize_then_sum_advantages

    per_fn = np.array([[1.0, 1000.0], [0.0, 3000.0], [1.0, 2000.0],   # group 1
                       [0.0, np.nan], [1.0, 5000.0], [np.nan, np.nan]])  # group 2
    weights = np.array([1.0, 0.5])
    eps = 1e-4

    def z(values):  # one group's column, NaNs left out
        v = values[~np.isnan(values)]
        return (values - v.mean()) / (v.std(ddof=1) + eps) if v.size > 1 else (values - v.mean()) / (np.nan + eps)

    summed = np.zeros(6)
    for g in (slice(0, 3), slice(3, 6)):
        for k in range(2):
            col = z(per_fn[g, k])
            summed[g] += weights[k] * np.nan_to_num(col, nan=0.0)
    summed[5] = np.nan
    scored = summed[:5]
    want = np.append((scored - scored.mean()) / (scored.std(ddof=1) + eps), 0.0)
    got = normalize_then_sum_advantages(per_fn, weights, 3)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert got[5] == 0.0 and abs(got[:5].mean()) < 1e-9
    # By hand for group 1's first function: values 1, 0, 1 have mean 2/3, std 0.57735: z = 0.57732, -1.15465.
    assert z(per_fn[0:3, 0])[1] == pytest.approx(-1.1546, abs=1e-4)


def _whiten_by_hand(values):
    """verl's masked_whiten over a flat list of the batch's valid-token values: unbiased variance, + 1e-8."""
    v = np.asarray(values, np.float64)
    mean = v.sum() / v.size
    var = ((v - mean) ** 2).sum() / (v.size - 1)
    return (v - mean) / math.sqrt(var + 1e-8)


def test_reinforce_plus_plus_advantages_by_hand():
    """REINFORCE++: the reward on the last valid token, discounted back by gamma, whitened over the batch's valid
    tokens; padding and a NaN reward's tokens are 0 and left out of the mean and variance."""
    est = get_advantage_estimator("reinforce_plus_plus")
    rewards = np.array([1.0, 0.0, 2.0, np.nan])
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], np.float32)
    got = est(rewards, 2, completion_mask=mask, gamma=0.5)
    # returns: row 0 [0.25, 0.5, 1], row 1 [0, 0], row 2 [2]; row 3 (NaN) out: 6 valid tokens
    white = _whiten_by_hand([0.25, 0.5, 1.0, 0.0, 0.0, 2.0])
    want = np.zeros((4, 4))
    want[0, :3], want[1, :2], want[2, 0] = white[:3], white[3:5], white[5]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # mean 3.75/6 = 0.625, unbiased variance 2.96875/5 = 0.59375: the last token of row 2 is (2 - 0.625)/0.770551
    assert got[2, 0] == pytest.approx(1.375 / math.sqrt(0.59375 + 1e-8), rel=1e-12)
    assert abs(got[mask * ~np.isnan(rewards)[:, None] > 0].mean()) < 1e-12
    # gamma 1: every token of a completion carries its reward; float32 in, float32 out
    flat = est(np.array([1.0, 0.0, 2.0, 3.0], np.float32), 2, completion_mask=mask)
    assert flat.dtype == np.float32
    white = _whiten_by_hand([1, 1, 1, 0, 0, 2, 3, 3, 3, 3])
    np.testing.assert_allclose(flat[mask > 0], white, rtol=1e-6)
    # a masked-out row (no loss token) gets 0 and does not move the others
    mask2 = mask.copy()
    mask2[1] = 0
    got2 = est(rewards, 2, completion_mask=mask2, gamma=0.5)
    assert (got2[1] == 0).all() and (got2[3] == 0).all()
    np.testing.assert_allclose(got2[:3][mask2[:3] > 0], _whiten_by_hand([0.25, 0.5, 1.0, 2.0]), rtol=1e-12)


def test_reinforce_plus_plus_return_passes_through_tool_tokens():
    """A two-turn row (call, tool result out of the mask, reply): the return passes through the tool tokens, so the
    call gets the reward discounted over the policy tokens between (γ^k, k not counting the tool tokens), as GAE
    carries PPO's credit; the tool tokens get 0 and are left out of the whitening."""
    est = get_advantage_estimator("reinforce_plus_plus")
    mask = np.array([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]], np.float32)
    got = est(np.array([2.0, 1.0]), 2, completion_mask=mask, gamma=0.5)
    # row 0: returns [0.5, 1 | tool | 2]; row 1 (one turn): [0.25, 0.5, 1]
    white = _whiten_by_hand([0.5, 1.0, 2.0, 0.25, 0.5, 1.0])
    want = np.zeros((2, 6))
    want[0, [0, 1, 4]], want[1, :3] = white[:3], white[3:]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_reinforce_plus_plus_baseline_advantages_by_hand():
    """REINFORCE++-baseline: reward minus its group's mean on every valid token, whitened over the batch's valid
    tokens; a group with one valid reward keeps it uncentred (verl's baseline 0 for a group of one)."""
    est = get_advantage_estimator("reinforce_plus_plus_baseline")
    rewards = np.array([1.0, 0.0, 2.0, np.nan, 3.0, 5.0])
    mask = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 0]], np.float32)
    got = est(rewards, 2, completion_mask=mask)
    # centred: [0.5, -0.5 | 2 (alone), NaN | -1, 1]; valid tokens 2 + 1 + 3 + 0 + 1 + 2 = 9
    white = _whiten_by_hand([0.5, 0.5, -0.5, 2, 2, 2, -1, 1, 1])
    want = np.zeros((6, 3))
    want[0, :2], want[1, 0], want[2], want[4, 0], want[5, :2] = white[:2], white[2], white[3:6], white[6], white[7:]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert (got[3] == 0).all()
    # a flat batch: every centred reward 0, so every advantage 0 (never NaN)
    assert (est(np.ones(4), 2, completion_mask=np.ones((4, 3))) == 0).all()


def test_per_token_advantages_are_refused_by_sequence_losses():
    """The losses of one advantage per sequence (registry.SEQUENCE_ADVANTAGE_LOSSES) reject a (B, T) advantage;
    the token-level ones take it."""
    from mindrlhf.registry import SEQUENCE_ADVANTAGE_LOSSES

    logp = Tensor(np.full((2, 3), -1.0, np.float32))
    adv = Tensor(np.ones((2, 3), np.float32))
    mask = Tensor(np.ones((2, 3), np.float32))
    for loss_type in SEQUENCE_ADVANTAGE_LOSSES:
        with pytest.raises(MindRLHFError, match=f"loss_type={loss_type!r} needs one advantage per sequence"):
            policy_loss(logp, logp, adv, mask, loss_type=loss_type)
    loss, _ = policy_loss(logp, logp, adv, mask, loss_type="grpo")
    assert float(loss.asnumpy()) == pytest.approx(-1.0)


#: log π_train − log π_sampler of three completions (row 2 padded after one token, row 3 empty), for the rejection
#: criteria: a token exactly on a bound, one beyond verl's ±20 clamp.
_RS_D = np.array([[0.1, -0.3, 0.0, 0.2], [np.log(2.0), 25.0, 0.0, 0.0], [-0.05, 9.0, 9.0, 9.0],
                  [0.0, 0.0, 0.0, 0.0]])
_RS_MASK = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], np.float64)


def _rs_by_hand(criterion: str) -> np.ndarray:
    """verl's statistic of ``criterion`` in float64: k1 = -d, k2 = d²/2, k3 = exp(d) - 1 - d on the valid tokens (d
    clamped to ±20), per token or as each row's sum / mean / max (0 for an empty row)."""
    level, k = criterion.rsplit("_", 1)
    d = np.clip(_RS_D, -20.0, 20.0)
    tok = {"k1": -d, "k2": 0.5 * d * d, "k3": np.exp(d) - 1.0 - d}[k]
    valid = _RS_MASK > 0
    if level == "token":
        return tok
    rows = []
    for t, v in zip(tok, valid):
        vals = t[v]
        if not vals.size:
            rows.append(0.0)
        else:
            rows.append({"seq_sum": vals.sum(), "seq_mean": vals.mean(), "seq_max": vals.max()}[level])
    return np.array(rows)[:, None]


@pytest.mark.parametrize("criterion", ["token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                                       "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"])
def test_rollout_rejection_criteria_by_hand(criterion):
    """Each of verl's rejection criteria: its statistic equals the float64 hand computation (padding ignored, an
    empty row 0, d clamped at 20), and the mask keeps exactly the values within verl's bounds, a value on a bound
    kept."""
    from mindrlhf.algorithms import rollout_rejection_mask
    from mindrlhf.registry import TWO_SIDED_ROLLOUT_RS

    want = _rs_by_hand(criterion)
    valid = (_RS_MASK > 0) if want.shape[1] > 1 else np.ones_like(want, bool)
    # An upper bound equal to one of the statistics: that one is kept, anything above it rejected.
    finite = want[valid]
    if criterion in TWO_SIDED_ROLLOUT_RS:
        upper, lower = 1.5, 0.5  # ratio bounds: keep log 0.5 <= stat <= log 1.5
        bounds = (math.log(lower), math.log(upper))
    else:
        upper, lower = float(np.sort(finite)[len(finite) // 2]), 0.0
        bounds = (-np.inf, upper)
    keep, stat = rollout_rejection_mask(criterion, Tensor(_RS_D), Tensor(_RS_MASK), upper, lower)
    np.testing.assert_allclose(stat.asnumpy(), np.where(valid, want, stat.asnumpy()), rtol=1e-12, atol=1e-12)
    expect_keep = (want >= bounds[0]) & (want <= bounds[1])
    np.testing.assert_array_equal(keep.asnumpy()[valid], expect_keep[valid].astype(np.float64))
    if criterion not in TWO_SIDED_ROLLOUT_RS:
        assert keep.asnumpy()[valid][np.argmin(np.abs(finite - upper))] == 1.0  # on the bound: kept


def test_rollout_rejection_k1_default_lower_bound_and_values():
    """k1 criteria with one threshold keep ratios in [1/threshold, threshold] (verl's default lower); by hand for
    seq_mean_k1: row 0's mean of -d is (−0.1 + 0.3 − 0 − 0.2)/4 = 0, row 1's (−log 2 − 20)/2, row 2's 0.05."""
    from mindrlhf.algorithms import rollout_rejection_mask, rollout_rs_bounds

    assert rollout_rs_bounds("seq_mean_k1", 2.0) == (pytest.approx(-math.log(2.0)), pytest.approx(math.log(2.0)))
    assert rollout_rs_bounds("seq_mean_k3", 0.01) == (-math.inf, 0.01)
    keep, stat = rollout_rejection_mask("seq_mean_k1", Tensor(_RS_D), Tensor(_RS_MASK), 2.0)
    np.testing.assert_allclose(stat.asnumpy()[:3, 0], [0.0, (-math.log(2.0) - 20.0) / 2, 0.05], atol=1e-12)
    np.testing.assert_array_equal(keep.asnumpy()[:, 0], [1.0, 0.0, 1.0, 1.0])
    # token_k1 with threshold 2: −log 2 is exactly the lower bound, kept; the clamped 25 (−20) is rejected.
    keep, _ = rollout_rejection_mask("token_k1", Tensor(_RS_D), Tensor(_RS_MASK), 2.0)
    np.testing.assert_array_equal(keep.asnumpy()[1, :2], [1.0, 0.0])

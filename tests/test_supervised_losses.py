"""The SFT / reward-model / DPO losses (``algorithms.supervised``) against hand-computed values and gradients."""
from __future__ import annotations

import math

import numpy as np
import pytest

from mindrlhf.errors import MindRLHFError

LOGITS = np.array([2.0, -1.5, 0.25, 0.0, 1e4, -1e4], np.float32)


def _sig(x):
    return 1.0 / (1.0 + math.exp(-x)) if x > -700 else 0.0


def _log_sig(x):
    return -math.log1p(math.exp(-x)) if x > -30 else x  # log σ(x) ≈ x far below 0 (|error| < 1e-13)


# (loss type, beta, label smoothing, loss(z) with z = logits, d loss / d z)
CASES = [
    ("sigmoid", 0.1, 0.0, lambda z: -_log_sig(0.1 * z), lambda z: -0.1 * (1 - _sig(0.1 * z))),
    ("sigmoid", 0.5, 0.2, lambda z: -0.8 * _log_sig(0.5 * z) - 0.2 * _log_sig(-0.5 * z),
     lambda z: -0.8 * 0.5 * (1 - _sig(0.5 * z)) + 0.2 * 0.5 * (1 - _sig(-0.5 * z))),
    ("robust", 0.5, 0.2, lambda z: (-0.8 * _log_sig(0.5 * z) + 0.2 * _log_sig(-0.5 * z)) / 0.6,
     lambda z: (-0.8 * 0.5 * (1 - _sig(0.5 * z)) - 0.2 * 0.5 * (1 - _sig(-0.5 * z))) / 0.6),
    ("hinge", 0.5, 0.0, lambda z: max(0.0, 1 - 0.5 * z), lambda z: -0.5 if 1 - 0.5 * z > 0 else 0.0),
    ("ipo", 0.5, 0.0, lambda z: (z - 1.0) ** 2, lambda z: 2 * (z - 1.0)),
]


@pytest.mark.parametrize("name,beta,smoothing,value,grad", CASES)
def test_preference_losses_and_gradients_by_hand(name, beta, smoothing, value, grad):
    import mindspore as ms

    from mindrlhf.algorithms.supervised import get_preference_loss

    fn = get_preference_loss(name)
    x = ms.Tensor(LOGITS)
    got = fn(x, beta, smoothing).asnumpy()
    got_grad = ms.grad(lambda z: fn(z, beta, smoothing).sum())(x).asnumpy()
    assert np.isfinite(got_grad).all()  # stable at margins of ±1e4 (beta * 1e4 = 5e3 or 1e3)
    for i, z in enumerate(LOGITS.astype(np.float64)):
        if name == "ipo" and abs(z) > 1e3:  # (1e4 - 1)^2 in float32: compare relatively
            assert got[i] == pytest.approx(value(z), rel=1e-6)
            continue
        assert got[i] == pytest.approx(value(z), rel=1e-5, abs=1e-6), (name, z)
        assert got_grad[i] == pytest.approx(grad(z), rel=1e-5, abs=1e-6), (name, z)


def test_unknown_preference_loss_is_one_line():
    from mindrlhf.algorithms.supervised import get_preference_loss

    with pytest.raises(MindRLHFError, match="DPO loss 'bco'.*sigmoid"):
        get_preference_loss("bco")


def test_dpo_logits_and_reward_model_loss_by_hand():
    import mindspore as ms

    from mindrlhf.algorithms.supervised import dpo_logits, reward_model_loss

    t = ms.Tensor
    logits = dpo_logits(t(np.array([-3.0, -5.0], np.float32)), t(np.array([-4.0, -2.0], np.float32)),
                        t(np.array([-3.5, -4.0], np.float32)), t(np.array([-3.5, -3.0], np.float32)))
    np.testing.assert_allclose(logits.asnumpy(), [1.0, -2.0])
    chosen, rejected = np.array([1.0, -0.5, 2.0], np.float32), np.array([0.0, 0.5, 2.5], np.float32)
    n = t(np.float32(6))  # the step has 6 pairs; this micro-batch holds 3
    want = -sum(_log_sig(c - r) for c, r in zip(chosen, rejected)) / 6
    assert float(reward_model_loss(t(chosen), t(rejected), n).asnumpy()) == pytest.approx(want, rel=1e-6)
    centered = want + 0.01 * sum((c + r) ** 2 for c, r in zip(chosen, rejected)) / 6
    got = float(reward_model_loss(t(chosen), t(rejected), n, center_rewards_coefficient=0.01).asnumpy())
    assert got == pytest.approx(centered, rel=1e-6)
    margin = np.array([0.5, 0.0, 1.0], np.float32)
    with_margin = -sum(_log_sig(c - r - m) for c, r, m in zip(chosen, rejected, margin)) / 6
    got = float(reward_model_loss(t(chosen), t(rejected), n, margin=t(margin)).asnumpy())
    assert got == pytest.approx(with_margin, rel=1e-6)
    # d/d r_c of -log σ(r_c - r_r) / 6 = -(1 - σ(r_c - r_r)) / 6, and the opposite for r_r
    gc, gr = ms.grad(lambda c, r: reward_model_loss(c, r, n), grad_position=(0, 1))(t(chosen), t(rejected))
    want_gc = [-(1 - _sig(c - r)) / 6 for c, r in zip(chosen, rejected)]
    np.testing.assert_allclose(gc.asnumpy(), want_gc, rtol=1e-6)
    np.testing.assert_allclose(gr.asnumpy(), -np.array(want_gc), rtol=1e-6)


def test_sft_loss_is_the_step_token_mean():
    import mindspore as ms

    from mindrlhf.algorithms.supervised import sft_loss

    logp = np.array([[-1.0, -2.0, -3.0], [-0.5, -4.0, -1.5]], np.float32)
    mask = np.array([[0, 1, 1], [1, 0, 0]], np.float32)
    got = float(sft_loss(ms.Tensor(logp), ms.Tensor(mask), ms.Tensor(np.float32(10))).asnumpy())
    assert got == pytest.approx((2.0 + 3.0 + 0.5) / 10)


def test_length_normalisation_is_a_property_of_the_registered_loss():
    """A loss registered ``length_normalized=True`` (IPO; a new one, SimPO-like) makes DPO's objective compare the
    completions' token-mean log-probs, a plain one their sums: the stage reads it from the registry, no name test."""
    import mindspore as ms

    from mindrlhf.algorithms.supervised import get_preference_loss, is_length_normalized, register_preference_loss
    from mindrlhf.dpo import DPOObjective
    from mindrlhf.registry import PREFERENCE_LOSSES

    assert [n for n in PREFERENCE_LOSSES.names() if is_length_normalized(get_preference_loss(n))] == ["ipo"]

    @register_preference_loss("test_mean_margin", length_normalized=True)
    def mean_margin(logits, beta, label_smoothing):
        return -beta * logits

    try:
        # Two pairs (rows chosen, rejected, chosen, rejected) of 1-3 completion tokens; reference log-probs 0.
        logp = np.array([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0], [-0.5, -0.5, 0.0], [-1.0, -2.0, -3.0]], np.float32)
        mask = np.array([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], np.float32)
        sums, means = (logp * mask).sum(-1), (logp * mask).sum(-1) / mask.sum(-1)
        for name, seq in (("test_mean_margin", means), ("sigmoid", sums)):
            objective = DPOObjective(name, 0.5, 0.0)
            assert objective.token_mean == (name == "test_mean_margin")
            loss, aux = objective.loss(ms.Tensor(logp), ms.Tensor(mask), ms.Tensor(np.zeros_like(logp)),
                                       ms.Tensor(np.float32(2.0)))
            logits = (seq[0::2] - seq[1::2]).astype(np.float64)
            want = (-0.5 * logits).sum() / 2 if name == "test_mean_margin" else \
                -np.log(1 / (1 + np.exp(-0.5 * logits))).sum() / 2
            assert float(loss.asnumpy()) == pytest.approx(want, rel=1e-6)
            assert float(aux[4].asnumpy()) == pytest.approx(seq[0::2].sum(), rel=1e-6)  # logps/chosen's sum
    finally:
        PREFERENCE_LOSSES.unregister("test_mean_margin")

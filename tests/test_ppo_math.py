"""PPO's math (``algorithms.ppo``) against hand-computed cases: KL-shaped rewards, GAE and returns on
variable-length rows, whitening, score shaping, the running value normaliser, the clipped value loss (values
and gradients)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from mindrlhf.algorithms import ppo
from mindrlhf.errors import MindRLHFError

MASK = np.array([[1, 1, 1], [1, 1, 0]])


def test_kl_shaped_rewards_put_the_score_on_each_rows_last_token():
    logp = np.array([[-1.0, -2.0, -0.5], [-0.3, -0.4, -9.0]])
    ref = np.array([[-1.5, -1.0, -0.5], [-0.1, -0.4, 3.0]])
    rewards, kl = ppo.kl_shaped_rewards(logp, ref, MASK, scores=np.array([1.0, 2.0]), kl_coef=0.1)
    # k1: d = logp - ref = [0.5, -1, 0] and [-0.2, 0, (padding)]
    np.testing.assert_allclose(kl, [[0.5, -1.0, 0.0], [-0.2, 0.0, 0.0]])
    np.testing.assert_allclose(rewards, [[-0.05, 0.1, 1.0], [0.02, 2.0, 0.0]])
    _, k3 = ppo.kl_shaped_rewards(logp, ref, MASK, np.zeros(2), 0.1, estimator="k3")
    assert k3[0, 1] == pytest.approx(math.exp(1.0) - 1.0 - 1.0) and k3[1, 2] == 0.0
    with pytest.raises(Exception, match="k9"):
        ppo.kl_shaped_rewards(logp, ref, MASK, np.zeros(2), 0.1, estimator="k9")


def test_ppo_reward_kl_is_the_registered_estimator():
    """PPO's reward kept its own copy of the KL estimators and configs/ppo.py its own list of their
    names. Now one table: every registered estimator (a new one too) is PPO's, on host float64 arrays, with the
    values the policy loss's MindSpore estimator gives, and PPO's kl_estimator choices are the registry's."""
    import dataclasses

    import mindspore as ms

    from mindrlhf.algorithms import KL_ESTIMATORS, kl_penalty, register_kl_estimator
    from mindrlhf.configs.ppo import PPOAlgorithmConfig

    logp = np.array([[-1.0, -2.0, -0.5], [-0.3, -0.4, -9.0]])
    ref = np.array([[-1.5, -1.0, -0.5], [-0.1, -0.4, 3.0]])
    for name in KL_ESTIMATORS.names():
        _, kl = ppo.kl_shaped_rewards(logp, ref, MASK, np.zeros(2), 0.1, estimator=name)
        device = kl_penalty(ms.Tensor(logp), ms.Tensor(ref), name).asnumpy()
        np.testing.assert_allclose(kl, np.where(MASK > 0, device, 0.0), rtol=1e-12, atol=1e-15)
    choices = {f.name: f for f in dataclasses.fields(PPOAlgorithmConfig)}["kl_estimator"].metadata["choices"]
    assert choices == KL_ESTIMATORS.names() == ("k1", "k2", "k3")

    register_kl_estimator("abs_test")(lambda d, exp=None: abs(d))
    try:
        _, kl = ppo.kl_shaped_rewards(logp, ref, MASK, np.zeros(2), 1.0, estimator="abs_test")
    finally:
        KL_ESTIMATORS.unregister("abs_test")
    np.testing.assert_allclose(kl, [[0.5, 1.0, 0.0], [0.2, 0.0, 0.0]])


def test_gae_and_returns_by_hand_on_variable_length_rows():
    rewards = np.array([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])  # row 2's last column is padding (ignored)
    values = np.array([[0.5, 0.2, 0.4], [1.0, 1.0, 5.0]])
    adv, ret = ppo.gae(rewards, values, MASK, gamma=1.0, lam=0.5)
    # row 1: δ2 = 1 - 0.4 = 0.6, A2 = 0.6; δ1 = 0.4 - 0.2 = 0.2, A1 = 0.2 + 0.5·0.6 = 0.5;
    #        δ0 = 0.2 - 0.5 = -0.3, A0 = -0.3 + 0.5·0.5 = -0.05
    # row 2: δ1 = 2 - 1 = 1 (no value after the last token), A1 = 1; δ0 = 1 - 1 = 0, A0 = 0.5
    np.testing.assert_allclose(adv, [[-0.05, 0.5, 0.6], [0.5, 1.0, 0.0]], atol=1e-12)
    np.testing.assert_allclose(ret, [[0.45, 0.7, 1.0], [1.5, 2.0, 0.0]], atol=1e-12)
    # γ = λ = 1: the advantage is the reward-to-go minus the value (Monte Carlo)
    rng = np.random.default_rng(0)
    r, v = rng.normal(size=(2, 3)), rng.normal(size=(2, 3))
    adv, ret = ppo.gae(r, v, MASK, gamma=1.0, lam=1.0)
    to_go = np.where(MASK > 0, np.cumsum((r * MASK)[:, ::-1], 1)[:, ::-1], 0.0)
    np.testing.assert_allclose(adv, np.where(MASK > 0, to_go - v, 0.0), atol=1e-12)
    np.testing.assert_allclose(ret, to_go, atol=1e-12)
    # γ discounts: one row, rewards only at the end
    adv, _ = ppo.gae(np.array([[0.0, 0.0, 1.0]]), np.zeros((1, 3)), np.ones((1, 3)), gamma=0.9, lam=1.0)
    np.testing.assert_allclose(adv, [[0.81, 0.9, 1.0]])


def _one_turn_gae(rewards, values, mask, gamma, lam):
    """``gae`` as it was before multi-turn rows: the running advantage and the next value reset to 0 at every position
    outside the mask. The reference for prefix masks, where nothing is carried past a completion's end."""
    m = np.asarray(mask) > 0
    r = np.where(m, np.asarray(rewards, np.float64), 0.0)
    v = np.where(m, np.asarray(values, np.float64), 0.0)
    adv = np.zeros_like(r)
    next_value, running = np.zeros(r.shape[0]), np.zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = np.where(m[:, t], delta + gamma * lam * running, 0.0)
        adv[:, t] = running
        next_value = np.where(m[:, t], v[:, t], 0.0)
    return adv, np.where(m, adv + v, 0.0)


def test_gae_on_prefix_masks_is_the_one_turn_formula_bit_for_bit():
    """Rows of every length 0..C (padding holding junk rewards and values), several γ, λ: advantages and returns
    equal the one-turn loop's exactly."""
    rng = np.random.default_rng(5)
    c = 9
    mask = (np.arange(c)[None, :] < np.arange(c + 1)[:, None]).astype(np.float32)
    r, v = rng.normal(size=mask.shape) * 3, rng.normal(size=mask.shape)
    for gamma, lam in ((1.0, 0.95), (0.9, 0.5), (1.0, 0.0), (0.99, 1.0), (0.0, 0.7)):
        for got, want in zip(ppo.gae(r, v, mask, gamma, lam), _one_turn_gae(r, v, mask, gamma, lam)):
            np.testing.assert_array_equal(got, want, err_msg=f"gamma {gamma}, lam {lam}")


#: A two-turn row: the call (columns 0, 1), the tool's result (2, 3: out of the mask), the reply (4, 5), padding (6).
TOOL_ROW = np.array([[1, 1, 0, 0, 1, 1, 0]])


def test_gae_carries_credit_across_tool_tokens_by_hand():
    """The running advantage and the next value pass through the tool tokens unchanged (verl's
    ``compute_gae_advantage_return``), so the reward at the reply reaches the call; the tool columns' rewards and
    values (junk here) are not read, and their advantages and returns are 0."""
    rewards = np.array([[0.0, 0.0, 9.0, 9.0, 0.0, 1.0, 5.0]])
    values = np.array([[0.5, 0.2, 7.0, 7.0, 0.4, 0.3, 3.0]])
    adv, ret = ppo.gae(rewards, values, TOOL_ROW, gamma=1.0, lam=0.5)
    # the row without its tool columns: r = [0, 0, 0, 1], V = [0.5, 0.2, 0.4, 0.3]
    # A3 = 1 − 0.3 = 0.7; A2 = (0.3 − 0.4) + 0.5·0.7 = 0.25; A1 = (0.4 − 0.2) + 0.5·0.25 = 0.325;
    # A0 = (0.2 − 0.5) + 0.5·0.325 = −0.1375
    np.testing.assert_allclose(adv, [[-0.1375, 0.325, 0.0, 0.0, 0.25, 0.7, 0.0]], atol=1e-12)
    np.testing.assert_allclose(ret, [[0.3625, 0.525, 0.0, 0.0, 0.65, 1.0, 0.0]], atol=1e-12)
    # the one-turn loop would end the call's credit at the tool block: A1 = 0 − 0.2 there
    assert _one_turn_gae(rewards, values, TOOL_ROW, 1.0, 0.5)[0][0, 1] == pytest.approx(-0.2)
    # γ discounts over the policy tokens only: the reward 1 at the reply's end is γ³ = 0.729 at the call's start
    adv, _ = ppo.gae(np.array([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]), np.zeros((1, 7)), TOOL_ROW, 0.9, 1.0)
    np.testing.assert_allclose(adv, [[0.729, 0.81, 0.0, 0.0, 0.9, 1.0, 0.0]], atol=1e-12)


def test_gae_with_tool_tokens_is_gae_on_the_row_without_them():
    """Random rows, each with random holes (tool blocks) and padding: advantages and returns at the masked columns
    equal ``gae`` on the row with the other columns removed (a prefix row), bit for bit; 0 elsewhere."""
    rng = np.random.default_rng(11)
    b, c = 12, 10
    mask = (rng.random((b, c)) < 0.6).astype(np.float32)
    mask[0], mask[1] = 0, 1  # an empty row and a full one
    r, v = rng.normal(size=(b, c)), rng.normal(size=(b, c))
    for gamma, lam in ((1.0, 0.95), (0.9, 0.5), (0.99, 1.0)):
        adv, ret = ppo.gae(r, v, mask, gamma, lam)
        assert not adv[mask == 0].any() and not ret[mask == 0].any()
        for i in range(b):
            keep = np.flatnonzero(mask[i])
            packed = np.zeros((1, c))
            packed_mask = (np.arange(c) < len(keep))[None, :].astype(np.float32)
            pr, pv = packed.copy(), packed.copy()
            pr[0, :len(keep)], pv[0, :len(keep)] = r[i, keep], v[i, keep]
            want_adv, want_ret = ppo.gae(pr, pv, packed_mask, gamma, lam)
            np.testing.assert_array_equal(adv[i, keep], want_adv[0, :len(keep)], err_msg=f"row {i}")
            np.testing.assert_array_equal(ret[i, keep], want_ret[0, :len(keep)], err_msg=f"row {i}")


def test_in_loss_gae_returns_are_for_prefix_masks_only():
    """``gae_returns`` (the critic's in-update targets) resets at a tool block, so on a tool row it is not ``gae``'s
    returns: why a step whose mask is no prefix takes the separate values pass (``PPOTrainer.values_pass``)."""
    import mindspore as ms

    rewards = np.array([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]], np.float32)
    values = np.array([[0.5, 0.2, 7.0, 7.0, 0.4, 0.3, 3.0]], np.float32)
    got = ppo.gae_returns(ms.Tensor(values), ms.Tensor(rewards), ms.Tensor(TOOL_ROW.astype(np.float32)), 1.0, 0.5)
    _, want = ppo.gae(rewards, values, TOOL_ROW, 1.0, 0.5)
    assert abs(got.asnumpy()[0, 1] - want[0, 1]) > 0.1


def test_in_graph_gae_returns_equal_the_host_gae_on_prefix_masks():
    """The critic's in-loss targets (``gae_returns``, a (C, C) matmul) equal ``gae``'s returns: the hand case above
    and random rows of every length from 0 to C (empty, partial, full), for several γ, λ (λ = 0: one-step TD)."""
    import mindspore as ms

    got = ppo.gae_returns(ms.Tensor(np.array([[0.5, 0.2, 0.4], [1.0, 1.0, 5.0]], np.float32)),
                          ms.Tensor(np.array([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]], np.float32)),
                          ms.Tensor(MASK.astype(np.float32)), 1.0, 0.5)
    np.testing.assert_allclose(got.asnumpy(), [[0.45, 0.7, 1.0], [1.5, 2.0, 0.0]], atol=1e-6)
    rng = np.random.default_rng(3)
    c = 7
    mask = (np.arange(c)[None, :] < np.arange(c + 1)[:, None]).astype(np.float32)  # rows of length 0..C
    r, v = rng.normal(size=mask.shape).astype(np.float32), rng.normal(size=mask.shape).astype(np.float32)
    for gamma, lam in ((1.0, 0.95), (0.9, 0.5), (1.0, 0.0), (0.99, 1.0)):
        _, want = ppo.gae(r, v, mask, gamma, lam)
        got = ppo.gae_returns(ms.Tensor(v), ms.Tensor(r), ms.Tensor(mask), gamma, lam).asnumpy()
        np.testing.assert_allclose(got, want, atol=2e-6, err_msg=f"gamma {gamma}, lam {lam}")


def test_masked_whiten_and_score_shaping():
    x = np.array([[1.0, 2.0, 3.0], [9.0, 9.0, 100.0]])
    mask = np.array([[1, 1, 1], [0, 0, 0]])
    np.testing.assert_allclose(ppo.masked_whiten(x, mask), [[-1, 0, 1], [0, 0, 0]], atol=1e-7)  # var 1 (unbiased)
    np.testing.assert_allclose(ppo.masked_whiten(x, mask, shift_mean=False), [[1, 2, 3], [0, 0, 0]], atol=1e-7)
    s = ppo.shape_scores(np.array([1.0, -4.0, 10.0]), scaling=2.0, bias=0.5, clip=5.0,
                         truncated=np.array([False, False, True]), truncated_penalty=-1.0)
    np.testing.assert_allclose(s, [2.5, -5.0, -1.0])
    np.testing.assert_array_equal(ppo.last_token_index(np.array([[1, 1, 0], [0, 0, 0], [1, 1, 1]])), [1, -1, 2])


@pytest.mark.parametrize("scores, kw, what", [
    ([1.0, float("nan")], {}, "completion 1's score nan is not finite"),
    ([float("inf"), 1.0], {"clip": 5.0}, "completion 0's score inf is not finite"),  # no clip hides a broken RM
    ([1.0, 3e38], {"scaling": 2.0}, "completion 1's score 6e+38 is beyond float32's range"),
])
def test_a_score_float32_cannot_keep_is_a_one_line_error(scores, kw, what):
    # Reward model x reward_output_scaling + rule rewards used to go on as inf / NaN scores into the step.
    with pytest.raises(MindRLHFError, match=what.replace("+", r"\+")) as err:
        ppo.shape_scores(np.array(scores), **kw)
    assert "\n" not in str(err.value) and "reward_output_scaling" in str(err.value)
    # a finite score beyond float32 that the clip brings back is fine
    np.testing.assert_allclose(ppo.shape_scores(np.array([1.0, 3e38]), scaling=2.0, clip=5.0), [2.0, 5.0])


def test_running_value_norm_is_a_debiased_ema_and_round_trips():
    norm = ppo.RunningValueNorm(beta=0.9)
    assert norm.mean_std() == (0.0, 1.0)
    norm.update(np.array([[1.0, 3.0, 50.0]]), np.array([[1, 1, 0]]))
    mean, std = norm.mean_std()  # the first batch counts fully: mean 2, E[x²] 5, var 1
    assert mean == pytest.approx(2.0) and std == pytest.approx(1.0)
    norm.update(np.array([[4.0]]), np.array([[1]]))
    # weights 0.9·0.1 and 0.1 over a debias of 0.19: mean (0.09·2 + 0.1·4) / 0.19
    assert norm.mean_std()[0] == pytest.approx((0.09 * 2 + 0.1 * 4) / 0.19)
    x = np.array([0.5, 7.0])
    np.testing.assert_allclose(norm.denormalize(norm.normalize(x)), x)
    assert norm.normalize(np.array([1e6]))[0] == 5.0  # clipped at ±5 (ReaL)
    flat = ppo.RunningValueNorm(beta=0.9)
    flat.update(np.full((1, 4), 3.0), np.ones((1, 4)))
    assert flat.mean_std() == (pytest.approx(3.0), pytest.approx(0.1))  # the variance floor 1e-2
    other = ppo.RunningValueNorm(beta=0.9)
    other.load_state(norm.state())
    assert other.mean_std() == norm.mean_std()


def test_clipped_value_loss_values_and_gradients():
    import mindspore as ms

    values = ms.Tensor(np.array([1.0, 0.6, 0.45], np.float32))
    old = ms.Tensor(np.array([0.5, 0.5, 0.5], np.float32))
    returns = ms.Tensor(np.array([2.0, 2.0, 0.0], np.float32))
    loss, clipped = ppo.clipped_value_loss(values, old, returns, cliprange_value=0.2)
    # 1: clip(1.0) = 0.7, (0.7-2)² = 1.69 > (1-2)² = 1 → 0.845, clipped; 2: inside the range → 0.5·1.96
    # 3: inside the range → 0.5·0.2025
    np.testing.assert_allclose(loss.asnumpy(), [0.845, 0.98, 0.10125], rtol=1e-6)
    np.testing.assert_array_equal(clipped.asnumpy(), [1.0, 0.0, 0.0])
    grad = ms.grad(lambda v: ppo.clipped_value_loss(v, old, returns, 0.2)[0].sum())(values)
    np.testing.assert_allclose(grad.asnumpy(), [0.0, -1.4, 0.45], rtol=1e-6)  # clipped: no gradient

"""PPO's pieces beyond the clipped policy surrogate: the KL-shaped per-token reward, GAE, whitening,
running value normalisation and the clipped value loss.

Formulas as InstructGPT's PPO implements them in TRL's last ``PPOTrainer`` (trl 0.11–0.2x,
``ppo_trainer.py``: reward = −kl_coef·KL per token plus the score at the last completion token, GAE,
returns = advantages + values, advantages whitened over the mask, value loss
``0.5·max((V−R)², (clip(V, V_old±ε_v)−R)²)``) and ReaL (``realhf/impl/model/utils/ppo_functional.py``:
score scaling/bias/clip; its EMA value normaliser
``ExponentialRunningMeanStd``).

Rows are completions, right-padded: ``mask`` (B, T) is 1 on each completion's policy tokens (0 on padding and,
in a multi-turn rollout, on the tool results' tokens between turns: ``gae`` carries credit across them). Host functions
work in float64 numpy (rollout data lives on the host between phases, as GRPO's advantages do);
``clipped_value_loss`` is a MindSpore function used inside the critic's loss.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np
from mindspore import Tensor, ops

from mindrlhf.algorithms.kl import get_kl_estimator
from mindrlhf.errors import MindRLHFError


def _mask(mask: np.ndarray) -> np.ndarray:
    m = np.asarray(mask) > 0
    if m.ndim != 2:
        raise MindRLHFError(f"mask must have shape (B, T), got {m.shape}")
    return m


def last_token_index(mask: np.ndarray) -> np.ndarray:
    """Index of each row's last completion token (B,); -1 for a row with none."""
    m = _mask(mask)
    return np.where(m.any(1), m.shape[1] - 1 - np.argmax(m[:, ::-1], axis=1), -1)


def shape_scores(scores: np.ndarray, *, scaling: float = 1.0, bias: float = 0.0, clip: float = 0.0,
                 truncated: Optional[np.ndarray] = None, truncated_penalty: Optional[float] = None) -> np.ndarray:
    """Sequence scores as the reward uses them: ``clip(score·scaling + bias, ±clip)`` (ReaL's
    ``reward_output_scaling`` / ``reward_output_bias`` / ``max_reward_clip``; clip 0 = none); a completion
    cut at the token limit (``truncated``) gets ``truncated_penalty`` instead when it is set (TRL's
    ``missing_eos_penalty`` subtracts; a fixed value is ReaL's choice and does not depend on the score).

    A score that is not finite (a reward model that produced inf or NaN), or that stays beyond float32's range
    after the clip (the rewards and metrics the step keeps are float32, as the reward functions' are), is an
    error naming the completion: it would otherwise train as inf or vanish from the metrics."""
    s = np.asarray(scores, np.float64) * scaling + bias
    _check_scores(s, "is not finite", ~np.isfinite(s))
    if clip:
        s = np.clip(s, -clip, clip)
    if truncated is not None and truncated_penalty is not None:
        s = np.where(np.asarray(truncated, bool), float(truncated_penalty), s)
    _check_scores(s, "is beyond float32's range", np.abs(s) > np.finfo(np.float32).max)
    return s


def _check_scores(s: np.ndarray, what: str, bad: np.ndarray) -> None:
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise MindRLHFError(
            f"completion {i}'s score {s[i]!r} {what} ({int(bad.sum())} of {len(s)} this step; the score is the "
            "reward model's times reward_output_scaling plus reward_output_bias, plus the reward functions' "
            "weighted sum); check the reward model's output, lower reward_output_scaling, or bound scores with "
            "max_reward_clip")


def kl_shaped_rewards(logp: np.ndarray, ref_logp: np.ndarray, mask: np.ndarray, scores: np.ndarray,
                      kl_coef: float, estimator: str = "k1") -> Tuple[np.ndarray, np.ndarray]:
    """Per-token rewards (B, T): ``−kl_coef · KL_t`` on every masked token, plus the row's score at its last
    masked token (``last_token_index``: a multi-turn row's last policy token); 0 where the mask is 0. Returns
    ``(rewards, kl)`` (``kl`` per token, 0 where the mask is 0: ``objective/kl`` is its row sum)."""
    kl_of = get_kl_estimator(estimator)  # algorithms.kl's estimator, on host float64 arrays
    m = _mask(mask)
    d = np.asarray(logp, np.float64) - np.asarray(ref_logp, np.float64)
    kl = np.where(m, kl_of(np.where(m, d, 0.0), exp=np.exp), 0.0)
    rewards = -kl_coef * kl
    last = last_token_index(m)
    rows = np.nonzero(last >= 0)[0]
    rewards[rows, last[rows]] += np.asarray(scores, np.float64)[rows]
    return rewards, kl


def gae(rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, gamma: float = 1.0,
        lam: float = 0.95) -> Tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation (Schulman et al. 2016) over each row's masked tokens:
    ``δ_t = r_t + γ·V_next − V_t``, ``A_t = δ_t + γλ·A_next``, where "next" is the row's next MASKED token (``V``
    and ``A`` after the last one are 0); returns ``(advantages, returns = advantages + values)``, both 0 where
    the mask is 0.

    A position outside the mask inside a row (a tool result's tokens between two turns of a multi-turn rollout)
    is skipped: the running advantage and the next value pass through it unchanged, so the final reward's credit
    reaches the turns before it. That is verl's ``compute_gae_advantage_return``
    (``verl/trainer/ppo/core_algos.py``: "skip values and TD-error on observation tokens"), and it equals GAE on
    the row with those columns removed. Trailing padding carries zeros, so on a prefix mask (a completion's
    tokens, then padding) this is the one-turn formula, bit for bit."""
    m = _mask(mask)
    r = np.where(m, np.asarray(rewards, np.float64), 0.0)
    v = np.where(m, np.asarray(values, np.float64), 0.0)
    adv = np.zeros_like(r)
    next_value = np.zeros(r.shape[0])
    running = np.zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = np.where(m[:, t], delta + gamma * lam * running, running)
        adv[:, t] = np.where(m[:, t], running, 0.0)
        next_value = np.where(m[:, t], v[:, t], next_value)
    return adv, np.where(m, adv + v, 0.0)


def masked_whiten(x: np.ndarray, mask: np.ndarray, shift_mean: bool = True, eps: float = 1e-8) -> np.ndarray:
    """``(x − mean) / sqrt(var + eps)`` over the masked entries (unbiased variance, as TRL's ``masked_whiten``);
    ``shift_mean=False`` adds the mean back. 0 on padding."""
    m = _mask(mask)
    x = np.asarray(x, np.float64)
    n = m.sum()
    if n < 2:
        return np.where(m, x - (x[m].mean() if n else 0.0), 0.0)
    mean = x[m].mean()
    var = ((x[m] - mean) ** 2).sum() / (n - 1)
    out = (x - mean) / np.sqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return np.where(m, out, 0.0)


class RunningValueNorm:
    """An exponential running mean/variance of the value targets, as ReaL's ``ExponentialRunningMeanStd``:
    ``update`` folds in a batch's masked mean and mean square with weight ``1 − beta``, debiased by the running
    weight sum (so the first batch counts fully); the variance is floored at 1e-2 and ``normalize`` clips to
    ±5 (both ReaL's). The critic learns ``normalize(returns)`` and GAE reads ``denormalize(values)``.
    ``state``/``load_state`` are what a checkpoint keeps."""

    def __init__(self, beta: float = 0.99995, eps: float = 1e-5):
        if not 0.0 < beta < 1.0:
            raise MindRLHFError(f"value_norm_beta {beta} must be in (0, 1)")
        self.beta, self.eps = float(beta), float(eps)
        self.mean = self.mean_sq = self.debias = 0.0

    def update(self, x: np.ndarray, mask: np.ndarray) -> None:
        m = _mask(mask)
        if not m.any():
            return
        values = np.asarray(x, np.float64)[m]
        b = self.beta
        self.mean = b * self.mean + (1 - b) * values.mean()
        self.mean_sq = b * self.mean_sq + (1 - b) * (values ** 2).mean()
        self.debias = b * self.debias + (1 - b)

    def mean_std(self) -> Tuple[float, float]:
        if self.debias == 0.0:
            return 0.0, 1.0
        debias = max(self.debias, self.eps)
        mean = self.mean / debias
        return mean, float(np.sqrt(max(self.mean_sq / debias - mean * mean, 1e-2)))

    def normalize(self, x: np.ndarray) -> np.ndarray:
        mean, std = self.mean_std()
        return np.clip((np.asarray(x, np.float64) - mean) / std, -5.0, 5.0)

    def denormalize(self, x: np.ndarray) -> np.ndarray:
        mean, std = self.mean_std()
        return np.asarray(x, np.float64) * std + mean

    def state(self) -> Dict[str, float]:
        return {"mean": self.mean, "mean_sq": self.mean_sq, "debias": self.debias}

    def load_state(self, state: Dict[str, float]) -> None:
        self.mean, self.mean_sq, self.debias = (float(state[k]) for k in ("mean", "mean_sq", "debias"))


def gae_returns(values: Tensor, rewards: Tensor, mask: Tensor, gamma: float, lam: float) -> Tensor:
    """``gae``'s returns (advantages + values, 0 on padding) as a MindSpore function, for rows whose ``mask`` is a
    prefix (a completion's tokens, then padding; a row with tool tokens between turns is not, and its step takes
    the separate values pass, ``PPOTrainer.values_pass``): the critic's first update of a step computes its own targets
    from the values it has just produced (``PPOTrainer``). With δ_s = r_s + γ·V_{s+1} − V_s on the row's tokens
    (V past the last token 0) and 0 beyond them, ``A_t = Σ_{s ≥ t} (γλ)^{s−t} δ_s``: one (C, C) matmul instead of
    a loop over the columns."""
    m = (mask > 0).astype(values.dtype)
    v = values * m
    next_v = ops.concat([v[:, 1:], ops.zeros_like(v[:, :1])], 1)
    delta = (rewards + gamma * next_v - v) * m
    c = values.shape[1]
    col = ops.arange(c, dtype=values.dtype)
    lag = col.expand_dims(0) - col.expand_dims(1)  # lag[t, s] = s − t
    decay = ops.where(lag >= 0, ops.pow(ops.full((c, c), gamma * lam, dtype=values.dtype), ops.relu(lag)),
                      ops.zeros_like(lag))
    return (ops.matmul(delta, decay.transpose(1, 0)) + v) * m


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor,
                       cliprange_value: float) -> Tuple[Tensor, Tensor]:
    """Per-token ``0.5 · max((V − R)², (clip(V, V_old − ε, V_old + ε) − R)²)`` and where the clipped term is
    the larger (``val/clipfrac``); the caller masks and aggregates (``losses.aggregate_loss``)."""
    clipped = ops.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    plain_sq = (values - returns) ** 2
    clipped_sq = (clipped - returns) ** 2
    return 0.5 * ops.maximum(plain_sq, clipped_sq), (clipped_sq > plain_sq).astype(values.dtype)

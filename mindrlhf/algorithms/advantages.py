"""Group-relative advantage estimators (GRPO, Dr.GRPO, LitePPO batch-std, RLOO), GDPO's multi-reward form and the
per-token REINFORCE++ estimators.

Rewards arrive flat, shape ``(B,)`` with ``B = prompts × G``: the G completions of one prompt are
consecutive. A NaN reward means "every reward function failed / was not applicable" for that
sample: it is left out of its group's statistics and gets advantage 0, so it neither pushes nor
pulls the policy.

Standard deviations are the *unbiased* sample std (ddof=1, as ``torch.std`` in TRL and verl), so
numbers match those references. With fewer than two valid rewards the std is defined as 0 (the
numerator is then 0 as well, so the advantage is 0, never NaN).

The REINFORCE++ estimators (``registry.PER_TOKEN_ADVANTAGE_ESTIMATORS``) return one advantage per completion token,
``(B, T)``, 0 on tokens outside ``completion_mask``: they whiten over the batch's valid tokens.

Advantages are computed on the host in float64 (rewards come from Python reward functions, so
there is no device round trip to save) and returned in the input's dtype and container.
"""
from __future__ import annotations

import warnings
from typing import Callable

import mindspore as ms
import numpy as np

from mindrlhf.algorithms.ppo import gae, last_token_index, masked_whiten
from mindrlhf.algorithms.registry import lookup
from mindrlhf.errors import MindRLHFError
from mindrlhf.registry import ADVANTAGE_ESTIMATORS, SCALE_REWARDS


def _to_numpy(rewards):
    """``(array, back)``: the rewards as float64 and a function restoring the container and float dtype."""
    if isinstance(rewards, ms.Tensor):
        dtype = rewards.dtype if rewards.is_floating_point() else ms.float32
        host = rewards.astype(ms.float32) if rewards.dtype == ms.bfloat16 else rewards  # numpy has no bf16
        return host.asnumpy().astype(np.float64), lambda out: ms.Tensor(out, dtype=dtype)
    arr = np.asarray(rewards)
    dtype = arr.dtype if np.issubdtype(arr.dtype, np.floating) else np.dtype(np.float32)
    return arr.astype(np.float64), lambda out: out.astype(dtype)


def _group_std(dev: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Unbiased std per row from deviations ``dev`` over valid entries; 0 when fewer than 2 are valid."""
    count = valid.sum(axis=1)
    sq = np.where(valid, dev * dev, 0.0).sum(axis=1)
    return np.where(count >= 2, np.sqrt(sq / np.maximum(count - 1, 1)), 0.0)


def _group_deviations(arr: np.ndarray, num_generations: int):
    """(valid (n, G) bool, valid count (n, 1), reward − group mean over valid rewards (n, G), 0 where invalid)."""
    if arr.ndim != 1:
        raise MindRLHFError(f"rewards must have shape (B,), got {arr.shape}")
    if num_generations < 1 or arr.shape[0] % num_generations:
        raise MindRLHFError(
            f"num_generations={num_generations} must be >= 1 and divide the number of rewards ({arr.shape[0]})"
        )
    grouped = arr.reshape(-1, num_generations)
    valid = ~np.isnan(grouped)
    count = valid.sum(axis=1, keepdims=True)
    mean = np.where(valid, grouped, 0.0).sum(axis=1, keepdims=True) / np.maximum(count, 1)
    return valid, count, np.where(valid, grouped - mean, 0.0)


def group_advantages(rewards, num_generations: int, scale_rewards: str = "group", eps: float = 1e-6):
    """Per-sample advantages from per-group reward statistics.

    Args:
        rewards: ``(B,)`` numpy array or MindSpore Tensor, groups of ``num_generations`` consecutive
            samples; NaN = failed reward (excluded from statistics, advantage 0).
        num_generations: group size G; ``B`` must be a multiple of it.
        scale_rewards: ``"group"``: ``(r − group mean) / (group std + eps)`` (GRPO);
            ``"batch"``: ``(r − group mean) / (std of the whole batch + eps)`` (LitePPO);
            ``"none"``: ``r − group mean`` (Dr.GRPO). Stds are unbiased (ddof=1), over valid rewards.
        eps: added to the std, so a group of identical rewards gives 0, not NaN.

    Returns:
        Advantages, same shape, dtype and container (numpy in → numpy out, Tensor in → Tensor out).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise MindRLHFError(f"scale_rewards={scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}")
    arr, back = _to_numpy(rewards)
    valid, count, dev = _group_deviations(arr, num_generations)
    if scale_rewards == "group":
        scale = _group_std(dev, valid)[:, None] + eps
    elif scale_rewards == "batch":
        flat = arr[~np.isnan(arr)]
        scale = np.full((1, 1), (flat.std(ddof=1) if flat.size >= 2 else 0.0) + eps)
    else:
        scale = np.ones((1, 1))
    # 0/0 (identical rewards with eps=0) is an advantage of 0, not NaN.
    scale = np.broadcast_to(scale, dev.shape)
    adv = np.divide(dev, scale, out=np.zeros_like(dev), where=scale > 0)
    return back(adv.reshape(-1))


def normalize_then_sum_advantages(reward_per_fn, weights, num_generations: int, eps: float = 1e-4) -> np.ndarray:
    """GDPO's advantages (Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy Optimization for
    Multi-reward RL Optimization", arXiv:2601.05242; TRL 1.16's ``multi_objective_aggregation="normalize_then_sum"``):
    each reward function's rewards normalised within their group first, so one function's scale cannot drown the
    others, then summed with the weights and normalised over the batch:

        r̂_ik = (r_ik − mean_g r_k) / (std_g r_k + eps),   R_i = Σ_k w_k r̂_ik,   A_i = (R_i − mean R) / (std R + eps).

    ``reward_per_fn``: ``(B, K)`` in groups of ``num_generations`` consecutive rows, NaN = no score (left out of
    every statistic and of the sum; a row that no function scored gets advantage 0). Stds are unbiased (ddof=1), as
    TRL's ``nanstd``; ``eps`` is TRL's 1e-4."""
    per_fn = np.asarray(reward_per_fn, np.float64)
    if per_fn.ndim != 2 or per_fn.shape[0] % num_generations:
        raise MindRLHFError(f"normalize_then_sum: rewards of shape {per_fn.shape} are not (B, K) in groups of "
                            f"{num_generations}")
    grouped = per_fn.reshape(-1, num_generations, per_fn.shape[1])
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN groups: NaN statistics, handled below
        normalised = (grouped - np.nanmean(grouped, axis=1, keepdims=True)) / (
            np.nanstd(grouped, axis=1, ddof=1, keepdims=True) + eps)
        summed = np.nansum(normalised.reshape(per_fn.shape) * np.asarray(weights, np.float64)[None, :], axis=1)
        summed[np.isnan(per_fn).all(axis=1)] = np.nan
        scored = summed[~np.isnan(summed)]
        std = scored.std(ddof=1) if scored.size > 1 else 0.0
        adv = (summed - (scored.mean() if scored.size else 0.0)) / (std + eps)
    return np.nan_to_num(adv, nan=0.0)


def informative_groups(rewards, num_generations: int, tol: float = 1e-8) -> np.ndarray:
    """Per group, whether its valid rewards differ (sample std > ``tol``): the groups that carry a
    gradient. A group with fewer than two valid rewards is not informative (DAPO's dynamic sampling)."""
    arr, _ = _to_numpy(rewards)
    valid, count, dev = _group_deviations(arr, num_generations)
    return _group_std(dev, valid) > tol


# --- registry ------------------------------------------------------------------------------------
AdvantageEstimator = Callable[..., object]
#: Decorator: register ``fn(rewards, num_generations, eps=1e-6)`` under ``name``; a per-token estimator
#: (``registry.PER_TOKEN_ADVANTAGE_ESTIMATORS``) also takes ``completion_mask=`` and returns (B, T).
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The registered estimator ``name``; a clear error listing the known names otherwise."""
    return lookup(ADVANTAGE_ESTIMATORS, name)


@register_advantage_estimator("grpo")
def grpo_advantages(rewards, num_generations: int, eps: float = 1e-6):
    """GRPO: rewards normalised by their group's mean and std."""
    return group_advantages(rewards, num_generations, "group", eps)


@register_advantage_estimator("dr_grpo")
def dr_grpo_advantages(rewards, num_generations: int, eps: float = 1e-6):
    """Dr.GRPO: group mean subtracted, no std scaling (removes the difficulty bias)."""
    return group_advantages(rewards, num_generations, "none", eps)


@register_advantage_estimator("batch_std")
def batch_std_advantages(rewards, num_generations: int, eps: float = 1e-6):
    """LitePPO: group mean subtracted, scaled by the std of the whole batch."""
    return group_advantages(rewards, num_generations, "batch", eps)


@register_advantage_estimator("rloo")
def rloo_advantages(rewards, num_generations: int, eps: float = 1e-6):
    """RLOO: a reward minus the mean of the other valid rewards of its group, n/(n−1)·(r − group mean)
    for n valid rewards; 0 in a group with fewer than two (no baseline). ``eps`` is unused (no division)."""
    arr, back = _to_numpy(rewards)
    valid, count, dev = _group_deviations(arr, num_generations)
    factor = np.where(count >= 2, count / np.maximum(count - 1, 1), 0.0)
    return back((dev * factor).reshape(-1))


def _scored_tokens(arr: np.ndarray, completion_mask) -> np.ndarray:
    """(B, T) bool: the completion tokens of rows whose reward is not NaN (the tokens REINFORCE++ whitens over)."""
    mask = np.asarray(completion_mask) > 0
    if mask.ndim != 2 or mask.shape[0] != arr.shape[0]:
        raise MindRLHFError(f"completion_mask of shape {mask.shape} does not match {arr.shape[0]} rewards; "
                            "it must be (B, T)")
    return mask & ~np.isnan(arr)[:, None]


@register_advantage_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantages(rewards, num_generations: int, eps: float = 1e-6, *, completion_mask,
                                   gamma: float = 1.0):
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262; verl's ``compute_reinforce_plus_plus_outcome_advantage``):
    the reward placed on each completion's last valid token, its discounted return per token G_t = γ^k·R with k the
    valid tokens after t, then whitened over all valid tokens of the batch,
    (G − mean) / sqrt(var + 1e-8) with the unbiased variance (``ppo.masked_whiten``, verl's ``masked_whiten``).
    No group baseline: ``num_generations`` and ``eps`` are unused. A NaN reward's tokens are left out of the
    statistics and get 0. A tool result's tokens between two turns are not valid tokens and are skipped: the
    return passes through them, so the turns before them get the reward too (``ppo.gae``'s carry). verl's loop
    resets the return at every masked token, which gives those turns 0; on a prefix mask (a one-turn rollout) the
    two are the same. Returns (B, T)."""
    arr, back = _to_numpy(rewards)
    valid = _scored_tokens(arr, completion_mask)
    token_rewards = np.zeros(valid.shape)
    last = last_token_index(valid)
    rows = np.flatnonzero(last >= 0)
    token_rewards[rows, last[rows]] = arr[rows]
    # GAE with λ = 1 and no values is the discounted return over the valid tokens, 0 on the others.
    returns, _ = gae(token_rewards, np.zeros(valid.shape), valid, gamma, 1.0)
    return back(masked_whiten(returns, valid))


@register_advantage_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantages(rewards, num_generations: int, eps: float = 1e-6, *, completion_mask):
    """REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262; verl's
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``): the reward minus its group's mean, broadcast over
    the completion's valid tokens, then whitened over all valid tokens of the batch (unbiased variance, + 1e-8, as
    verl). The mean is over the group's valid (non-NaN) rewards; a group with a single one keeps its reward
    uncentred (verl's baseline 0 for a group of one). A NaN reward's tokens are left out and get 0. ``eps`` is
    unused. Returns (B, T)."""
    arr, back = _to_numpy(rewards)
    valid, count, dev = _group_deviations(arr, num_generations)
    grouped = np.where(valid, arr.reshape(dev.shape), 0.0)
    centred = np.where(count > 1, dev, grouped).reshape(-1)
    tokens = _scored_tokens(arr, completion_mask)
    return back(masked_whiten(np.where(tokens, centred[:, None], 0.0), tokens))

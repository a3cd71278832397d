"""Policy losses (GRPO, GSPO, GSPO-token, decoupled, CISPO, SAPO, GMPO, Clip-Cov, KL-Cov, LUSPO, VESPO) and the one
loss-aggregation helper.

Every policy loss is a small registered function ``fn(log_ratio, advantages, mask, epsilon_low,
epsilon_high, **params) -> (per_token_loss, ratio)`` of the masked, detached-old log-ratio
``logp − sg(old_logp)``; ``ratio`` is the importance ratio that was clipped (per token, or per
sequence as ``(B, 1)``) and feeds the clip metrics. ``policy_loss`` adds the KL term, aggregates
with ``aggregate_loss`` and computes the metrics.

All functions are written with MindSpore ops and no Python branching on tensor values, so they
differentiate with ``mindspore.grad`` and compile inside ``mindspore.jit``. Python values
(``loss_type``, ``beta``, ``loss_agg_mode``, counts given as ints) are compile-time constants there:
pass ``global_num_tokens``/``global_num_seqs`` as 0-d Tensors to avoid a recompile per value.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Mapping, Optional, Tuple, Union

from mindspore import Tensor, ops

from mindrlhf.algorithms.kl import get_kl_estimator
from mindrlhf.algorithms.registry import check_registered, lookup
from mindrlhf.errors import MindRLHFError
from mindrlhf.registry import (
    IS_FOLDING_LOSSES,
    IS_MODES,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSS_AGGREGATION,
    POLICY_LOSSES,
    ROLLOUT_RS,
    TWO_SIDED_ROLLOUT_RS,
)

#: Log-ratios (policy vs old, policy vs reference) are clamped to ±this before ``exp`` (as verl does):
#: exp(20) ≈ 4.9e8 is far outside any clip range, yet one off-policy outlier can no longer overflow
#: float32 (exp(89) = inf) and turn the whole update non-finite.
LOG_RATIO_BOUND = 20.0
Count = Union[int, float, Tensor]


# --- argument checks: constexpr, so they raise MindRLHFError inside mindspore.jit as well ---------
@ops.constexpr
def _check_agg_args(loss_agg_mode: str, max_completion_length) -> bool:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise MindRLHFError(f"loss_agg_mode={loss_agg_mode!r} is not one of {', '.join(LOSS_AGG_MODES)}")
    if loss_agg_mode == "seq-mean-token-sum-norm" and not (max_completion_length or 0) > 0:
        raise MindRLHFError(
            "loss_agg_mode='seq-mean-token-sum-norm' needs max_completion_length > 0 "
            f"(got {max_completion_length!r}); pass the generation's max new tokens"
        )
    return True


@ops.constexpr
def _check_beta(beta: float, has_ref_logp: bool) -> bool:
    if beta > 0 and not has_ref_logp:
        raise MindRLHFError(f"beta={beta} > 0 needs ref_logp (reference log-probs); pass them or set beta=0")
    return True


@ops.constexpr
def _check_seq_advantages(loss_type: str, shape) -> bool:
    # registry.SEQUENCE_ADVANTAGE_LOSSES lists the losses that call this (the config rejects per-token estimators).
    if shape[-1] != 1:
        raise MindRLHFError(f"loss_type={loss_type!r} needs one advantage per sequence, shape (B,); got {shape}")
    return True


# --- aggregation ---------------------------------------------------------------------------------
def _at_least_one(count, dtype):
    """``max(count, 1)`` as a Tensor of ``dtype``: an empty batch/sequence divides by 1, not 0."""
    if isinstance(count, Tensor):
        return ops.maximum(count.astype(dtype), 1.0)
    return Tensor(max(float(count), 1.0), dtype)


def loss_denominators(mask: Tensor) -> Tuple[Tensor, Tensor]:
    """Local ``(num_tokens, num_seqs)`` of a ``(B, T)`` mask, as ``aggregate_loss`` counts them.

    ``num_seqs`` counts sequences with at least one valid token. Sum (all-reduce) these over
    micro-batches and ranks to get ``global_num_tokens`` / ``global_num_seqs``.
    """
    tokens_per_seq = (mask > 0).astype(mask.dtype).sum(axis=-1)
    return tokens_per_seq.sum(), (tokens_per_seq > 0).astype(mask.dtype).sum()


def aggregate_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    *,
    max_completion_length: Optional[int] = None,
    global_num_tokens: Optional[Count] = None,
    global_num_seqs: Optional[Count] = None,
) -> Tensor:
    """Reduce a ``(B, T)`` per-token loss to a scalar over the valid (``mask > 0``) tokens.

    Modes:
        ``"seq-mean-token-mean"``: mean over each sequence's valid tokens, then mean over sequences
        (GRPO paper). ``"token-mean"``: sum over all valid tokens / number of valid tokens (DAPO).
        ``"seq-mean-token-sum-norm"``: each sequence's token sum / ``max_completion_length``, then
        mean over sequences (Dr.GRPO; a constant length, so no length bias).

    Sequences with no valid token contribute 0 and are not counted as sequences (so fully
    masked-out samples do not dilute the rest; no NaN). ``global_num_tokens`` / ``global_num_seqs``
    replace the local counts (see ``loss_denominators``): with them, the losses of the
    micro-batches/ranks of one global batch sum exactly to the unsplit loss.
    """
    _check_agg_args(loss_agg_mode, max_completion_length)
    dtype = per_token_loss.dtype
    valid = mask > 0
    token_sums = ops.where(valid, per_token_loss, 0.0).sum(axis=-1)
    tokens_per_seq = valid.astype(dtype).sum(axis=-1)
    if loss_agg_mode == "token-mean":
        denom = tokens_per_seq.sum() if global_num_tokens is None else global_num_tokens
        return token_sums.sum() / _at_least_one(denom, dtype)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_loss = token_sums / ops.maximum(tokens_per_seq, 1.0)
    else:  # seq-mean-token-sum-norm
        seq_loss = token_sums / float(max_completion_length)
    if global_num_seqs is None:
        denom = (tokens_per_seq > 0).astype(dtype).sum()
    else:
        denom = global_num_seqs
    return seq_loss.sum() / _at_least_one(denom, dtype)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` (broadcast to the mask's shape) over ``mask > 0``; 0 for an empty mask."""
    valid = mask > 0
    values = ops.broadcast_to(values, mask.shape)
    return ops.where(valid, values, 0.0).sum() / _at_least_one(valid.astype(values.dtype).sum(), values.dtype)


# --- policy losses -------------------------------------------------------------------------------
PolicyLoss = Callable[..., Tuple[Tensor, Tensor]]


def register_policy_loss(name: str, *, reads_logp: bool = False) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: register ``fn(log_ratio, advantages, mask, eps_low, eps_high, **params) -> (loss, ratio)``
    under ``name``. ``params`` are its hyper-parameters (``registry.POLICY_LOSS_PARAMS``), passed by keyword.
    ``reads_logp``: it is also given the masked log-probs themselves (``logp=``), for a loss whose value is
    ``A·logp`` (CISPO's, VESPO's) rather than a function of the ratio only."""
    def wrap(fn: PolicyLoss) -> PolicyLoss:
        POLICY_LOSSES.register(name)(fn)
        fn.reads_logp = bool(reads_logp)
        return fn

    return wrap


@ops.constexpr
def _reads_logp(loss_type: str) -> bool:
    # constexpr: the attribute is read in Python at graph-compile time, not parsed into the graph.
    # An unknown name is False here: the registry look-up beside it raises the one-line error.
    return bool(getattr(POLICY_LOSSES.entries.get(loss_type), "reads_logp", False))


@ops.constexpr
def _folds_is_ratio(loss_type: str) -> bool:
    return loss_type in IS_FOLDING_LOSSES


@ops.constexpr
def _check_token_is_ratio(loss_type: str, shape, token_shape) -> bool:
    if tuple(shape) != tuple(token_shape):
        raise MindRLHFError(f"loss_type={loss_type!r} folds per-token importance weights of shape "
                            f"{tuple(token_shape)} into its sequence weight, got {tuple(shape)}; use "
                            "importance_sampling_mode token_truncate or token_mask")
    return True


@ops.constexpr
def _check_loss_agg(loss_type: str, loss_agg_mode: str) -> bool:
    need = POLICY_LOSS_AGGREGATION.get(loss_type)
    if need is not None and loss_agg_mode != need:
        raise MindRLHFError(f"loss_type={loss_type!r} is a mean over sequences and needs loss_agg_mode={need!r}, "
                            f"got {loss_agg_mode!r}")
    return True


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered policy loss ``name``; a clear error listing the known names otherwise."""
    return lookup(POLICY_LOSSES, name)


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, epsilon_low: float, epsilon_high: float) -> Tensor:
    """PPO's pessimistic objective, negated: −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)."""
    clipped = ops.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    return -ops.minimum(ratio * advantages, clipped * advantages)


def _seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Masked mean over the last axis, keepdims: ``(B, T) -> (B, 1)``; 0 for an empty sequence."""
    return (x * mask).sum(axis=-1, keepdims=True) / ops.maximum(mask.sum(axis=-1, keepdims=True), 1.0)


@register_policy_loss("grpo")
def grpo_loss(log_ratio, advantages, mask, epsilon_low, epsilon_high, *, delta=0.0, clip_ratio_c=0.0):
    """GRPO/PPO token-level clipped surrogate with ratio r_t = exp(logp_t − old_logp_t),

        ℓ_t = −min(min(r_t, δ)·A, clip(r_t, 1−ε_low, 1+ε_high)·A),

    with two optional bounds (0 = off). ``delta`` δ: INTELLECT-2's two-sided clip (Prime Intellect 2025,
    arXiv:2505.07291, section 3.2; TRL 1.16's ``delta``), which caps the unclipped ratio too, so a negative-advantage
    token whose ratio ran far above 1 + ε_high cannot give an unbounded loss. ``clip_ratio_c`` c: dual-clip PPO
    (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning", arXiv:1912.09729,
    eq. 5; verl's ``clip_ratio_c``, AReaL's ``c_clip``): a negative-advantage token's loss is at most −c·A, and its
    gradient is then 0."""
    ratio = ops.exp(log_ratio)
    unclipped = ops.minimum(ratio, delta) if delta > 0 else ratio
    clipped = ops.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    per_token = -ops.minimum(unclipped * advantages, clipped * advantages)
    if clip_ratio_c > 0:
        per_token = ops.where(advantages < 0, ops.minimum(per_token, -clip_ratio_c * advantages), per_token)
    return per_token, ratio


@register_policy_loss("gspo")
def gspo_loss(log_ratio, advantages, mask, epsilon_low, epsilon_high):
    """GSPO: one ratio per sequence, s_i = exp(mean_t log_ratio), clipped with the sequence advantage."""
    _check_seq_advantages("gspo", advantages.shape)
    ratio = ops.exp(_seq_mean(log_ratio, mask))
    seq_loss = _clipped_surrogate(ratio, advantages, epsilon_low, epsilon_high)
    return ops.broadcast_to(seq_loss, log_ratio.shape), ratio


@register_policy_loss("gspo-token")
def gspo_token_loss(log_ratio, advantages, mask, epsilon_low, epsilon_high):
    """GSPO-token: log s_{i,t} = logp − sg(logp) + sg(mean_t log_ratio); value s_i, gradient per token."""
    seq_log_ratio = ops.stop_gradient(_seq_mean(log_ratio, mask))
    ratio = ops.exp(log_ratio - ops.stop_gradient(log_ratio) + seq_log_ratio)
    return _clipped_surrogate(ratio, advantages, epsilon_low, epsilon_high), ratio


@register_policy_loss("decoupled")
def decoupled_loss(log_ratio, advantages, mask, epsilon_low, epsilon_high, behav_log_ratio=None, behav_cap=None):
    """AReaL's decoupled PPO objective (Fu et al. 2025, "AReaL: a large-scale asynchronous reinforcement learning
    system for language reasoning", arXiv:2505.24298, eq. 5; their ``ppo_actor_loss_fn``), negated per token:

        ℓ_t = −w_t · min(u_t·A_t, clip(u_t, 1−ε_low, 1+ε_high)·A_t),
        u_t = π_θ(y_t) / π_prox(y_t),   w_t = π_prox(y_t) / π_behav(y_t)  (no gradient),

    with ``log_ratio`` = log u_t (θ against the proximal policy: the trainer's log-probs before the update) and
    ``behav_log_ratio`` = log w_t (proximal against the behaviour policy: the sampler's log-probs of the rows,
    which an asynchronous rollout took some updates earlier). A token whose w_t exceeds ``behav_cap`` gets weight 0
    (AReaL's ``behav_imp_weight_cap``). Without ``behav_log_ratio`` it is the "grpo" loss."""
    per_token, ratio = grpo_loss(log_ratio, advantages, mask, epsilon_low, epsilon_high)
    if behav_log_ratio is None:
        return per_token, ratio
    weight = ops.stop_gradient(ops.exp(ops.clamp(behav_log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)))
    if behav_cap is not None:
        weight = ops.where(weight > behav_cap, 0.0, weight)
    return per_token * weight.astype(per_token.dtype), ratio


@register_policy_loss("cispo", reads_logp=True)
def cispo_loss(log_ratio, advantages, mask, epsilon_low, epsilon_high, *, logp=None, cispo_ratio_max=5.0):
    """CISPO (MiniMax-M1, arXiv:2506.13585, section 3.1): clip the importance weight, not the update, and keep
    every token's gradient:

        ℓ_t = −sg(min(r_t, ε_max)) · A · log π_θ(y_t),   r_t = exp(log_ratio_t),

    with TRL 1.16's one-sided bound (``GRPOTrainer._compute_loss``, ``loss_type="cispo"``, whose
    ``epsilon_high`` is ε_max = ``cispo_ratio_max``; ScaleRL recommends 5). The clip range ε is not used."""
    ratio = ops.exp(log_ratio)
    weight = ops.stop_gradient(ops.minimum(ratio, cispo_ratio_max))
    return -weight * advantages * logp, ratio


@register_policy_loss("sapo")
def sapo_loss(log_ratio, advantages, mask, epsilon_low, epsilon_high, *, sapo_temperature_pos=1.0,
              sapo_temperature_neg=1.05):
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347): a smooth gate in place of
    the hard clip,

        ℓ_t = −f(r_t) · A,   f(r) = σ(τ·(r − 1)) · 4/τ,   τ = τ_pos if A > 0 else τ_neg,

    as TRL 1.16 (``loss_type="sapo"``) and verl (``compute_policy_loss_sapo``) compute it: f(1) = 2/τ and
    f'(1) = 1, so on-policy it is the plain policy gradient. The clip range ε is not used."""
    ratio = ops.exp(log_ratio)
    tau = ops.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg).astype(ratio.dtype)
    return -ops.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * advantages, ratio


@register_policy_loss("gmpo")
def gmpo_loss(log_ratio, advantages, mask, epsilon_low, epsilon_high):
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673; verl's ``geo_mean``,
    ``compute_policy_loss_geo_mean``): the geometric mean of the token ratios, each clipped in log space on the
    pessimistic side of its advantage's sign,

        ℓ_i = −A_i · exp(mean_t sgn(A)·min(sgn(A)·log r_t, sgn(A)·clip(log r_t, −ε_low, ε_high))),

    one value per sequence, broadcast over its tokens (aggregated seq-mean-token-mean: verl's mean over
    sequences). GMPO's clip range is wider than PPO's because it is in log space (the paper uses ε = 0.4).
    The returned ratio is ``1 + log r_t``, so the clip metrics count exactly the tokens whose log-ratio left
    [−ε_low, ε_high] on the clipped side."""
    _check_seq_advantages("gmpo", advantages.shape)
    sign = ops.sign(advantages)
    clipped = ops.clamp(log_ratio, -epsilon_low, epsilon_high)
    pessimistic = sign * ops.minimum(sign * log_ratio, sign * clipped)
    seq_loss = -advantages * ops.exp(_seq_mean(pessimistic, mask))
    return ops.broadcast_to(seq_loss, log_ratio.shape), 1.0 + log_ratio


def _covariance(advantages: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """Per token (A − mean A)·(logp − mean logp), means over the valid tokens; no gradient (Cui et al. 2025,
    arXiv:2505.22617: the centred product whose large values drive the entropy collapse)."""
    adv = ops.broadcast_to(advantages, mask.shape)
    cov = (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))
    return ops.stop_gradient(cov)


def _rank(keys: Tensor) -> Tensor:
    """Each element's 0-based rank in ascending order of ``keys`` (ties broken by the sort): a permutation."""
    flat = keys.reshape(-1)
    return ops.argsort(ops.argsort(flat)).reshape(keys.shape)


def _pick_count(ratio: float, mask: Tensor) -> Tensor:
    """max(⌊ratio · valid tokens⌋, 1): how many tokens Clip-Cov / KL-Cov treat, as verl counts them."""
    return ops.maximum(ops.floor(ratio * mask.sum()), 1.0)


#: Weyl-sequence keys frac(n·φ) stand in for verl's ``torch.randperm`` in Clip-Cov's choice among the eligible
#: tokens: spread over the batch like a random pick, but the same on every run and inside a compiled graph.
_GOLDEN = 0.6180339887498949


@register_policy_loss("clip_cov", reads_logp=True)
def clip_cov_loss(log_ratio, advantages, mask, epsilon_low, epsilon_high, *, logp=None, clip_cov_ratio=2e-4,
                  clip_cov_lb=1.0, clip_cov_ub=5.0):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models", arXiv:2505.22617, section 4; verl's ``compute_policy_loss_clip_cov``): the PPO clipped surrogate,
    with the gradient of max(⌊clip_cov_ratio · tokens⌋, 1) tokens removed (their loss set to 0), chosen among the
    unclipped valid tokens whose covariance ``(A − Ā)(logp − l̄ogp)`` lies in (clip_cov_lb, clip_cov_ub).
    verl picks them with ``torch.randperm``; here the pick is by fixed Weyl keys (``_GOLDEN``), so a run
    repeats exactly. The means and the count are over the micro-batch, as verl computes them."""
    ratio = ops.exp(log_ratio)
    plain = -advantages * ratio
    clipped = -advantages * ops.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    valid = mask > 0
    cov = _covariance(advantages, logp, mask)
    eligible = ops.logical_and(ops.logical_and(valid, clipped <= plain),
                               ops.logical_and(cov > clip_cov_lb, cov < clip_cov_ub))
    index = ops.arange(mask.size, dtype=ratio.dtype).reshape(mask.shape) + 1.0
    key = ops.where(eligible, index * _GOLDEN - ops.floor(index * _GOLDEN), 2.0)
    dropped = ops.logical_and(eligible, _rank(key).astype(ratio.dtype) < _pick_count(clip_cov_ratio, mask))
    return ops.where(dropped, 0.0, ops.maximum(plain, clipped)), ratio


@register_policy_loss("kl_cov", reads_logp=True)
def kl_cov_loss(log_ratio, advantages, mask, epsilon_low, epsilon_high, *, logp=None, kl_cov_ratio=2e-4,
                kl_cov_coef=1.0):
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617, section 4; verl's ``compute_policy_loss_kl_cov``): the
    unclipped surrogate −A·r_t, plus ``kl_cov_coef``·|log r_t| on the max(⌊kl_cov_ratio · tokens⌋, 1) valid
    tokens of largest covariance ``(A − Ā)(logp − l̄ogp)`` (means and count over the micro-batch, as verl's).
    No ratio clip: the KL term on the high-covariance tokens replaces it. The clip range ε is not used."""
    ratio = ops.exp(log_ratio)
    cov = _covariance(advantages, logp, mask)
    key = ops.where(mask > 0, -cov, float("inf"))  # ascending rank of −cov: the largest covariance first
    chosen = _rank(key).astype(ratio.dtype) < _pick_count(kl_cov_ratio, mask)
    penalty = ops.where(chosen, kl_cov_coef * ops.abs(log_ratio), 0.0)
    return -advantages * ratio + penalty, ratio


@register_policy_loss("luspo")
def luspo_loss(log_ratio, advantages, mask, epsilon_low, epsilon_high):
    """LUSPO (arXiv:2602.05261, "Length-Unbiased Sequence Policy Optimization"; TRL 1.16's ``loss_type="luspo"``
    with ``importance_sampling_level="sequence"``): GSPO's clipped sequence loss scaled by the sequence's length
    |y_i|, so under seq-mean-token-mean each sequence counts Σ_t ℓ_i = |y_i|·ℓ_i, TRL's
    ``(per_token_loss * mask).sum(-1).mean()``."""
    _check_seq_advantages("luspo", advantages.shape)
    per_token, ratio = gspo_loss(log_ratio, advantages, mask, epsilon_low, epsilon_high)
    return per_token * mask.sum(axis=-1, keepdims=True), ratio


#: VESPO's floor on the sequence weight w, log(1e-8), as TRL (``get_gamma_weights``) and the VESPO code clamp it.
_VESPO_LOG_W_MIN = math.log(1e-8)


@register_policy_loss("vespo", reads_logp=True)
def vespo_loss(log_ratio, advantages, mask, epsilon_low, epsilon_high, *, logp=None, is_ratio=None, vespo_k_pos=2.0,
               vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0):
    """VESPO (arXiv:2602.10693, "Variational Sequence-Level Soft Policy Optimization"; TRL 1.16's
    ``loss_type="vespo"``, ``GRPOTrainer.get_gamma_weights``): a token-level gradient weighted by a smooth
    Gamma-shaped function of the sequence's importance weight w = exp(Σ_t log r_t),

        ℓ_t = −sg(φ(w)) · A · log π_θ(y_t),   φ(w) = exp(λ + k·log w − λ·w)  (φ(1) = 1),

    with (k, λ) = (k_pos, λ_pos) for A ≥ 0 else (k_neg, λ_neg), log w clamped to [log 1e-8, 20]. The clip
    range ε is not used. Returns φ's argument w per sequence (B, 1) as the ratio.

    ``is_ratio``: the importance-sampling correction's per-token weights π_old/π_sampler (B, T) (token_truncate or
    token_mask), folded into w as TRL does, log w = Σ_t log r_t + Σ_t clamp(log is_ratio_t, log 1e-8, 20), so the
    sequence weight is against the sampler and a masked token (weight 0) sends φ towards 0; they do not multiply
    the loss. Padding adds nothing (TRL's padding weight is exp(0) = 1 for any cap ≥ 1, its log 0)."""
    log_w = (log_ratio * mask).sum(axis=-1, keepdims=True)
    if is_ratio is not None:
        _check_token_is_ratio("vespo", is_ratio.shape, log_ratio.shape)
        log_is = ops.clamp(ops.log(ops.stop_gradient(is_ratio)), _VESPO_LOG_W_MIN, LOG_RATIO_BOUND)
        log_w = log_w + (log_is * mask).sum(axis=-1, keepdims=True)
    log_w = ops.clamp(log_w, _VESPO_LOG_W_MIN, LOG_RATIO_BOUND)
    w = ops.exp(log_w)
    nonneg = advantages >= 0
    k = ops.where(nonneg, vespo_k_pos, vespo_k_neg).astype(w.dtype)
    lam = ops.maximum(ops.where(nonneg, vespo_lambda_pos, vespo_lambda_neg).astype(w.dtype), 1e-4)
    phi = ops.stop_gradient(ops.exp(lam + k * log_w - lam * w))
    return -phi * advantages * logp, w


# --- rollout/train mismatch: importance-sampling weights ----------------------------------------
#: ``fn(log_ratio (B, T), mask (B, T), cap) -> weights``: per token (B, T) or per sequence (B, 1).
ISWeights = Callable[[Tensor, Tensor, float], Tensor]
#: Decorator: register ``fn(log_ratio, mask, cap) -> weights`` (log_ratio = trainer − sampler log-probs, masked).
register_is_mode = IS_MODES.register


def get_is_mode(name: str) -> ISWeights:
    """The registered importance-sampling mode ``name`` (TRL's four modes)."""
    return lookup(IS_MODES, name)


def _bounded_exp(log_ratio: Tensor) -> Tensor:
    return ops.exp(ops.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


@register_is_mode("token_truncate")
def is_token_truncate(log_ratio, mask, cap):
    """Per-token ratio π_train/π_sampler, capped at ``cap`` (truncated IS)."""
    return ops.minimum(_bounded_exp(log_ratio), cap)


@register_is_mode("token_mask")
def is_token_mask(log_ratio, mask, cap):
    """Per-token ratio; tokens whose ratio exceeds ``cap`` get weight 0 (masked IS)."""
    ratio = _bounded_exp(log_ratio)
    return ops.where(ratio > cap, 0.0, ratio)


@register_is_mode("sequence_truncate")
def is_sequence_truncate(log_ratio, mask, cap):
    """One ratio per sequence, exp(Σ_t log-ratio), capped at ``cap``: (B, 1)."""
    return ops.minimum(_bounded_exp((log_ratio * mask).sum(axis=-1, keepdims=True)), cap)


@register_is_mode("sequence_mask")
def is_sequence_mask(log_ratio, mask, cap):
    """One ratio per sequence; a sequence whose ratio exceeds ``cap`` gets weight 0: (B, 1)."""
    ratio = _bounded_exp((log_ratio * mask).sum(axis=-1, keepdims=True))
    return ops.where(ratio > cap, 0.0, ratio)


# --- rollout/train mismatch: rejection sampling (verl's rollout_rs) --------------------------------
#: ``fn(log_ratio (B, T), mask (B, T)) -> statistic``: per token (B, T) or per sequence (B, 1), from the masked
#: log-ratio log π_train − log π_sampler (0 on padding).
RejectionStatistic = Callable[[Tensor, Tensor], Tensor]
#: Decorator: register a rejection-sampling statistic ``fn(log_ratio, mask)`` under ``name``.
register_rollout_rs = ROLLOUT_RS.register


def get_rollout_rs(name: str) -> RejectionStatistic:
    """The registered rejection-sampling criterion ``name`` (verl's ``rollout_rs`` options)."""
    return lookup(ROLLOUT_RS, name)


def _k1(d: Tensor) -> Tensor:
    """verl's token k1, −d = log π_sampler − log π_train."""
    return -d


def _k2(d: Tensor) -> Tensor:
    """verl's token k2, d²/2."""
    return 0.5 * d * d


def _k3(d: Tensor) -> Tensor:
    """verl's token k3, exp(d) − 1 − d (≥ 0)."""
    return ops.exp(d) - 1.0 - d


def _masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum(axis=-1, keepdims=True)


def _masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Max over each row's valid tokens, (B, 1); 0 for a row with none (verl's ``_sequence_max``)."""
    top = ops.where(mask > 0, x, float("-inf")).max(axis=-1, keepdims=True)
    return ops.where(mask.sum(axis=-1, keepdims=True) > 0, top, 0.0)


_RS_LEVELS = {"token": ("the per-token value", lambda x, mask: x), "seq_sum": ("its sum over the tokens", _masked_sum),
              "seq_mean": ("its mean over the tokens", _seq_mean), "seq_max": ("its max over the tokens", _masked_max)}


def _register_criteria() -> None:
    """The eleven statistics of verl's ``compute_rollout_rejection_mask``: k1 / k2 / k3 per token, or their sum,
    mean or max over each completion's tokens (no ``seq_max_k1``: the max of a signed log-ratio bounds nothing)."""
    for level, (what, reduce) in _RS_LEVELS.items():
        for k, divergence in (("k1", _k1), ("k2", _k2), ("k3", _k3)):
            if level == "seq_max" and k == "k1":
                continue

            def statistic(d, mask, reduce=reduce, divergence=divergence):
                return reduce(divergence(d), mask)

            statistic.__qualname__ = statistic.__name__ = f"rollout_rs_{level}_{k}"
            statistic.__doc__ = (f"verl's rollout_rs {level}_{k} (rollout_corr_helper.py): {what} of "
                                 f"{divergence.__doc__.split(', ', 1)[1]}")
            register_rollout_rs(f"{level}_{k}")(statistic)


_register_criteria()


def rollout_rs_bounds(criterion: str, threshold: float, threshold_lower: float = 0.0) -> Tuple[float, float]:
    """(lower, upper) bounds on ``criterion``'s statistic, verl's ``rollout_rs_threshold`` semantics: a k1
    criterion (``TWO_SIDED_ROLLOUT_RS``) keeps ``log(lower) ≤ stat ≤ log(upper)`` of the ratio bounds
    ``threshold_lower`` (0 = 1/``threshold``, verl's default) and ``threshold``; any other keeps ``stat ≤ threshold``
    (lower −inf)."""
    if criterion in TWO_SIDED_ROLLOUT_RS:
        return math.log(threshold_lower or 1.0 / threshold), math.log(threshold)
    return float("-inf"), float(threshold)


def rollout_rejection_mask(criterion: str, log_ratio: Tensor, mask: Tensor, threshold: float,
                           threshold_lower: float = 0.0) -> Tuple[Tensor, Tensor]:
    """verl's rejection sampling (``rollout_corr_helper.compute_rollout_rejection_mask``, one option): ``(keep,
    statistic)``, ``keep`` 1 where ``criterion``'s statistic of ``log_ratio`` = log π_train − log π_sampler (clamped
    to ±``LOG_RATIO_BOUND``, verl's safety bound) lies within ``rollout_rs_bounds``, else 0; per token (B, T) or per
    sequence (B, 1), as the statistic. No gradient."""
    valid = mask > 0
    d = ops.stop_gradient(ops.where(valid, ops.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND), 0.0))
    stat = get_rollout_rs(criterion)(d, valid.astype(d.dtype))
    lower, upper = rollout_rs_bounds(criterion, threshold, threshold_lower)
    # Bounds as tensors of the statistic's dtype: a bare Python float is compared in float32, so a float64 value
    # on the bound could fall on either side.
    keep = stat <= ops.scalar_to_tensor(upper, stat.dtype)
    if criterion in TWO_SIDED_ROLLOUT_RS:
        keep = ops.logical_and(keep, stat >= ops.scalar_to_tensor(lower, stat.dtype))
    return keep.astype(d.dtype), stat


def off_policy_sequence_mask(advantages: Tensor, logp: Tensor, sampler_logp: Tensor, mask: Tensor,
                             threshold: float) -> Tensor:
    """Off-policy sequence masking (DeepSeek-V3.2's technical report, 2025; TRL 1.16's
    ``GRPOTrainer.get_off_policy_mask``): (B, 1), 0 for a sequence with a negative advantage whose mean per-token
    KL from the sampling policy, mean_t (log π_sampler − sg(log π_θ)), exceeds ``threshold``, else 1. Such a sequence
    teaches the policy away from text it no longer finds likely, the update least to be trusted; a positive
    advantage's sequence is always kept. No gradient."""
    valid = mask > 0
    kl = ops.where(valid, sampler_logp - ops.stop_gradient(logp), 0.0)
    tokens = ops.maximum(valid.astype(kl.dtype).sum(axis=-1, keepdims=True), 1.0)
    low_kl = kl.sum(axis=-1, keepdims=True) / tokens <= threshold
    if advantages.ndim == 1:
        advantages = advantages.reshape(-1, 1)
    return ops.logical_or(advantages >= 0, low_kl).astype(kl.dtype)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    ref_logp: Optional[Tensor] = None,
    loss_type: str = "grpo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    loss_agg_mode: str = "seq-mean-token-mean",
    max_completion_length: Optional[int] = None,
    global_num_tokens: Optional[Count] = None,
    global_num_seqs: Optional[Count] = None,
    is_weights: Optional[Tensor] = None,
    is_ratio: Optional[Tensor] = None,
    behav_logp: Optional[Tensor] = None,
    behav_cap: Optional[float] = None,
    loss_params: Optional[Mapping[str, float]] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Clipped policy-gradient loss plus an optional KL penalty, aggregated to a scalar.

    ``logp``/``old_logp``/``ref_logp``/``mask``: ``(B, T)`` float Tensors (log-probs of the sampled
    completion tokens; ``mask`` 1 on completion tokens). ``advantages``: ``(B,)`` (or ``(B, T)``
    per-token for "grpo"/"gspo-token"). Per token: ``ℓ = policy_loss + beta·KL`` where the KL term
    is used only when ``beta > 0`` (then ``ref_logp`` is required), then
    ``aggregate_loss(ℓ, mask, loss_agg_mode, ...)``. ``old_logp`` and ``ref_logp`` get no gradient.
    Both log-ratios are clamped to ±``LOG_RATIO_BOUND`` (no gradient beyond it). ``is_weights``
    ((B, T) or (B, 1), no gradient) multiply the policy term before the KL is added: the rollout/train
    mismatch correction's masks (off-policy masking, rejection sampling). ``is_ratio``: its importance-sampling
    weights (``IS_MODES``, (B, T) or (B, 1), no gradient), multiplied in with ``is_weights``, except by a loss of
    ``IS_FOLDING_LOSSES`` ("vespo"), which folds them into its own sequence weight (per-token weights only).
    ``behav_logp`` / ``behav_cap``: the behaviour policy's (the sampler's) log-probs and the cap of their weight,
    read by "decoupled" only (``old_logp`` is then the proximal policy's).
    ``loss_params``: the loss's own hyper-parameters by name (``registry.POLICY_LOSS_PARAMS``; defaults: the papers').

    Loss types (``POLICY_LOSSES``): "grpo" (token ratio), "gspo" (sequence ratio), "gspo-token", "decoupled"
    (AReaL's decoupled PPO: "grpo" on the proximal ratio times the proximal/behaviour weight), "cispo", "sapo",
    "gmpo", "clip_cov", "kl_cov", "luspo", "vespo" (each function's docstring gives its formula and source).
    Recipes: DAPO = ``loss_type="grpo"``, ``epsilon_high > epsilon_low`` (clip-higher, e.g. 0.2/0.28)
    and ``loss_agg_mode="token-mean"``; there is no "dapo" loss type, because the rest of DAPO
    (dynamic sampling, overlong shaping) lives in the trainer and rewards, not in the loss.
    Dr.GRPO = "grpo" with ``loss_agg_mode="seq-mean-token-sum-norm"`` and "dr_grpo" advantages.

    Returns ``(loss, metrics)``; metrics are detached masked means with TRL's names and definitions:
    ``kl`` (over tokens; 0 when beta == 0), ``clip_ratio/low_mean`` (r < 1−ε_low and A < 0),
    ``clip_ratio/high_mean`` (r > 1+ε_high and A > 0), ``clip_ratio/region_mean`` (either); the clip
    fractions are over valid tokens, or over non-empty sequences for "gspo"'s sequence ratio.
    """
    loss_fn = get_policy_loss(loss_type)
    check_registered(KL_ESTIMATORS.kind, kl_estimator)  # validate even when beta == 0
    _check_loss_agg(loss_type, loss_agg_mode)
    _check_beta(beta, ref_logp is not None)
    dtype = logp.dtype
    valid = mask > 0
    mask = valid.astype(dtype)
    if advantages.ndim == 1:
        advantages = advantages.reshape(-1, 1)
    advantages = ops.stop_gradient(advantages.astype(dtype))
    # Mask before exp: padding positions may hold garbage (even -inf) log-probs. Clamp: LOG_RATIO_BOUND.
    log_ratio = ops.clamp(ops.where(valid, logp - ops.stop_gradient(old_logp), 0.0), -LOG_RATIO_BOUND,
                          LOG_RATIO_BOUND)
    folding = is_ratio is not None and _folds_is_ratio(loss_type)
    if loss_type == "decoupled" and behav_logp is not None:
        behav = ops.where(valid, ops.stop_gradient(old_logp) - ops.stop_gradient(behav_logp.astype(dtype)), 0.0)
        per_token, ratio = loss_fn(log_ratio, advantages, mask, epsilon_low, epsilon_high, behav, behav_cap)
    else:
        params = {} if loss_params is None else loss_params
        # logp and is_ratio are keywords of their own: a Tensor merged into the params dict breaks a graph.
        if folding:
            per_token, ratio = loss_fn(log_ratio, advantages, mask, epsilon_low, epsilon_high,
                                       logp=ops.where(valid, logp, 0.0), is_ratio=is_ratio.astype(dtype), **params)
        elif _reads_logp(loss_type):
            per_token, ratio = loss_fn(log_ratio, advantages, mask, epsilon_low, epsilon_high,
                                       logp=ops.where(valid, logp, 0.0), **params)
        else:
            per_token, ratio = loss_fn(log_ratio, advantages, mask, epsilon_low, epsilon_high, **params)
    if is_ratio is not None and not folding:  # one product: the weights times the masks
        is_weights = is_ratio if is_weights is None else is_ratio * is_weights
    if is_weights is not None:
        per_token = per_token * ops.stop_gradient(is_weights.astype(dtype))

    if beta > 0:
        ref_log_ratio = ops.where(valid, logp - ops.stop_gradient(ref_logp), 0.0)
        kl = get_kl_estimator(kl_estimator)(ops.clamp(ref_log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        per_token = per_token + beta * kl
        kl_mean = masked_mean(ops.stop_gradient(kl), mask)
    else:
        kl_mean = ops.zeros((), dtype)

    loss = aggregate_loss(
        per_token,
        mask,
        loss_agg_mode,
        max_completion_length=max_completion_length,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
    )

    ratio = ops.stop_gradient(ratio)
    is_low = ops.logical_and(ratio < 1.0 - epsilon_low, advantages < 0)
    is_high = ops.logical_and(ratio > 1.0 + epsilon_high, advantages > 0)
    # Token ratios: fraction of valid tokens. A sequence ratio (B, 1): fraction of non-empty sequences.
    # Both as TRL (whose masked mean of a (B, 1) tensor is a plain mean over sequences).
    if ratio.shape[-1] == 1:
        mask = (mask.sum(axis=-1, keepdims=True) > 0).astype(dtype)
    metrics = {
        "kl": kl_mean,
        "clip_ratio/low_mean": masked_mean(is_low.astype(dtype), mask),
        "clip_ratio/high_mean": masked_mean(is_high.astype(dtype), mask),
        "clip_ratio/region_mean": masked_mean(ops.logical_or(is_low, is_high).astype(dtype), mask),
    }
    return loss, metrics

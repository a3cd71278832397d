"""GRPO's objective for the shared ``Updater``: the clipped policy loss (``algorithms.policy_loss``)
with the KL term, importance-sampling correction of the rollout/train mismatch, and the aux values
the step's metrics are made of."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Tuple

import mindspore as ms
from mindspore import Tensor, ops

from mindrlhf.algorithms import get_is_mode, policy_loss

# Token-weighted means: each micro-batch returns mean x its token count, summed over the step.
TOKEN_MEANS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
               "sampling/sampling_logp_difference/mean")
EXTREMES = (("sampling/sampling_logp_difference/max", "max"), ("sampling/importance_sampling_ratio/max", "max"),
            ("sampling/importance_sampling_ratio/min", "min"))


@dataclass
class LossSettings:
    """The algorithm fields the loss needs (a slice of the GRPO config)."""

    loss_type: str
    loss_agg_mode: str
    epsilon_low: float
    epsilon_high: float
    beta: float
    kl_estimator: str
    max_completion_length: int
    temperature: float
    off_policy: bool
    is_correction: bool = False
    is_mode: str = "sequence_mask"
    is_cap: float = 3.0

    @classmethod
    def from_config(cls, cfg) -> "LossSettings":
        """The settings of a ``GRPOConfig``."""
        a, g = cfg.algorithm, cfg.generation
        loss_type, agg = cfg.policy_loss
        return cls(loss_type, agg, a.epsilon_low, a.epsilon_high, a.beta, a.kl_estimator, g.max_completion_length,
                   g.temperature if g.temperature > 0 else 1.0, cfg.needs_old_logprobs,
                   a.importance_sampling_correction, a.importance_sampling_mode, a.importance_sampling_cap)


class GRPOObjective:
    """The GRPO loss of one micro-batch of completion log-probs, normalised by the mini-batch's global
    token and sequence counts (the step's scalars)."""

    inputs = ("completion_mask", "advantages", "old_logp", "ref_logp", "sampler_logp")
    aux = tuple((k, "sum") for k in TOKEN_MEANS) + (("tokens", "sum"), ("is_ratio_sum", "sum"),
                                                    ("is_ratio_count", "sum")) + EXTREMES

    def __init__(self, settings: LossSettings):
        self.settings = settings

    def loss(self, logp: Tensor, completion_mask: Tensor, advantages: Tensor, old_logp: Tensor, ref_logp: Tensor,
             sampler_logp: Tensor, num_tokens: Tensor, num_seqs: Tensor) -> Tuple[Tensor, Tuple[Tensor, ...]]:
        s = self.settings
        # On-policy: old == current (detached), so the ratio is exactly 1 and needs no extra forward.
        old = old_logp if s.off_policy else ops.stop_gradient(logp)
        # Rollout/train mismatch: the trainer's log-probs of the sampling policy vs the sampler's own.
        valid = completion_mask > 0
        gap = ops.where(valid, ops.stop_gradient(old).astype(ms.float32) - sampler_logp, 0.0)
        mask = valid.astype(ms.float32)
        weights = get_is_mode(s.is_mode)(gap, mask, s.is_cap)
        loss, metrics = policy_loss(
            logp, old, advantages, completion_mask, ref_logp=ref_logp if s.beta > 0 else None,
            loss_type=s.loss_type, epsilon_low=s.epsilon_low, epsilon_high=s.epsilon_high, beta=s.beta,
            kl_estimator=s.kl_estimator, loss_agg_mode=s.loss_agg_mode,
            max_completion_length=s.max_completion_length, global_num_tokens=num_tokens, global_num_seqs=num_seqs,
            is_weights=weights if s.is_correction else None)
        # Means are over this micro-batch; weighted by its token count, the step forms exact global means.
        tokens = mask.sum()
        metrics["sampling/sampling_logp_difference/mean"] = ops.abs(gap).sum() / ops.maximum(tokens, 1.0)
        # Ratio statistics over what the ratio is per: valid tokens, or completions with a valid token.
        counted = mask if weights.shape[-1] != 1 else (mask.sum(axis=-1, keepdims=True) > 0).astype(ms.float32)
        weights = ops.broadcast_to(weights, counted.shape)
        inf = float("inf")
        aux = tuple(metrics[k] * tokens for k in TOKEN_MEANS) + (tokens,)
        aux += ((weights * counted).sum(), counted.sum())
        aux += (ops.abs(gap).max(), ops.where(counted > 0, weights, -inf).max(),
                ops.where(counted > 0, weights, inf).min())
        return loss, aux

    def metrics(self, reduced: Dict[str, float]) -> Dict[str, float]:
        tokens = max(reduced["tokens"], 1.0)
        out = {k: reduced[k] / tokens for k in TOKEN_MEANS}
        count = reduced["is_ratio_count"]
        out["sampling/importance_sampling_ratio/mean"] = reduced["is_ratio_sum"] / count if count else 0.0
        for k, _ in EXTREMES:  # no valid token anywhere: 0
            out[k] = reduced[k] if math.isfinite(reduced[k]) else 0.0
        return out

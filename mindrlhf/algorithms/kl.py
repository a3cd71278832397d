"""KL(π‖π_ref) estimators from per-token log-probs (Schulman, "Approximating KL divergence").

With ``d = logp − ref_logp`` (log π/π_ref of the sampled token, sampled from π):
``k1 = d`` (unbiased, high variance, can be negative), ``k2 = ½ d²`` (low variance, biased),
``k3 = exp(−d) + d − 1 = exp(ref − logp) − (ref − logp) − 1`` (unbiased, always ≥ 0; GRPO's choice).
Each estimator is a small function of ``d`` so the loss can mask ``d`` before it is used. It is written
once for both callers: MindSpore tensors in the policy loss (GRPO), and float64 numpy on the host with
``exp=np.exp`` in PPO's KL-shaped reward (``algorithms.ppo.kl_shaped_rewards``).
"""
from __future__ import annotations

from typing import Callable

from mindspore import Tensor, ops

from mindrlhf.algorithms.registry import lookup
from mindrlhf.registry import KL_ESTIMATORS

KLEstimator = Callable[..., Tensor]
#: Decorator: register ``fn(log_ratio, exp=ops.exp) -> per-token KL`` under ``name`` (``exp``: the array
#: library's exponential, so one formula serves tensors and numpy arrays).
register_kl_estimator = KL_ESTIMATORS.register


def get_kl_estimator(name: str) -> KLEstimator:
    """The registered KL estimator ``name`` (a function of ``logp − ref_logp``)."""
    return lookup(KL_ESTIMATORS, name)


@register_kl_estimator("k1")
def kl_k1(log_ratio: Tensor, exp: Callable = ops.exp) -> Tensor:
    """k1 = logp − ref."""
    return log_ratio


@register_kl_estimator("k2")
def kl_k2(log_ratio: Tensor, exp: Callable = ops.exp) -> Tensor:
    """k2 = ½ (logp − ref)²."""
    return 0.5 * log_ratio * log_ratio


@register_kl_estimator("k3")
def kl_k3(log_ratio: Tensor, exp: Callable = ops.exp) -> Tensor:
    """k3 = exp(ref − logp) − (ref − logp) − 1."""
    return exp(-log_ratio) + log_ratio - 1.0


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL estimate between the policy and the reference (Tensors, same shape)."""
    return get_kl_estimator(estimator)(logp - ref_logp)

"""Losses of the stages that train on fixed rows: SFT, the reward model, DPO and ORPO.

Pure MindSpore functions of the head's output (no state, no Python branching on tensor values), so
they differentiate with ``mindspore.grad`` and compile inside ``mindspore.jit``. Counts that normalise
a loss over the whole optimizer step (every micro-batch and data-parallel rank) come in as 0-d tensors,
so a step's loss is the same whatever its split into micro-batches and ranks.

DPO's loss types are registered (``registry.PREFERENCE_LOSSES``): ``fn(logits, beta, label_smoothing)
-> per-pair loss`` of ``logits = (logp_c − logp_r) − (ref_c − ref_r)``, the formulas of TRL's
``DPOTrainer.dpo_loss`` (each cites its paper). Whether a loss compares sums of the completions'
log-probs or their token means (length normalisation: IPO; SimPO's and ORPO's average log-probs) is a
property of the registered loss (``register_preference_loss(name, length_normalized=True)``), which the
stage reads (``is_length_normalized``), so a new length-normalised loss needs no stage change.
ORPO's odds-ratio term (``orpo_log_odds``, ``odds_ratio_loss``) is reference-free and reads token-mean
log-probs, so it is not one of them.
"""
from __future__ import annotations

from typing import Callable

from mindspore import Tensor, ops

from mindrlhf.algorithms.registry import lookup
from mindrlhf.registry import PREFERENCE_LOSSES

#: ``fn(logits (P,), beta, label_smoothing) -> loss (P,)`` of a pair's implicit-reward margin.
PreferenceLoss = Callable[[Tensor, float, float], Tensor]


def register_preference_loss(name: str, *, length_normalized: bool = False) -> Callable[[PreferenceLoss],
                                                                                       PreferenceLoss]:
    """Decorator: register a preference loss under ``name`` (``--loss_type``). ``length_normalized``: its
    sequence log-probs are token means over the completion, not sums (``is_length_normalized``)."""
    def wrap(fn: PreferenceLoss) -> PreferenceLoss:
        PREFERENCE_LOSSES.register(name)(fn)
        fn.length_normalized = bool(length_normalized)
        return fn

    return wrap


def is_length_normalized(loss: PreferenceLoss) -> bool:
    """Whether the registered preference loss ``loss`` compares token-mean log-probs (else sums)."""
    return bool(getattr(loss, "length_normalized", False))


def log_sigmoid(x: Tensor) -> Tensor:
    """``log σ(x) = −softplus(−x)``: finite with exact gradients at any margin (softplus is linear past its
    threshold), where ``log(sigmoid(x))`` gives −inf below about −88 in float32."""
    return -ops.softplus(-x)


def sft_loss(logp: Tensor, mask: Tensor, num_tokens: Tensor) -> Tensor:
    """Token-mean negative log-likelihood of the trained tokens: ``-Σ mask·logp / num_tokens``.

    ``num_tokens`` counts the trained tokens of the whole step, so micro-batches and ranks add up to the
    mean over the step, as TRL's ``SFTTrainer`` does (its loss divides the summed cross-entropy by
    ``num_items_in_batch``, the step's label count over accumulation steps and processes) and as ReaL's
    SFT interface does (token mean over the batch). ``logp`` (B, T) float32, ``mask`` (B, T) 0/1.
    """
    return -(logp * mask).sum() / ops.maximum(num_tokens, 1.0)


def reward_model_loss(chosen: Tensor, rejected: Tensor, num_pairs: Tensor, center_rewards_coefficient: float = 0.0,
                      margin: Tensor = None) -> Tensor:
    """Bradley–Terry pairwise loss, summed over this micro-batch's pairs / the step's pair count:
    ``mean(−log σ(r_c − r_r − margin))`` (InstructGPT, Ouyang et al. 2022, eq. 1; TRL's ``RewardTrainer``),
    plus ``center_rewards_coefficient · mean((r_c + r_r)²)`` (Eisenstein et al. 2023), which pulls the
    rewards towards zero mean. ``chosen``/``rejected`` (P,) float32 rewards of the pairs."""
    diff = chosen - rejected if margin is None else chosen - rejected - margin
    loss = -log_sigmoid(diff).sum()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ops.square(chosen + rejected).sum()
    return loss / ops.maximum(num_pairs, 1.0)


def dpo_logits(chosen_logp: Tensor, rejected_logp: Tensor, ref_chosen_logp: Tensor,
               ref_rejected_logp: Tensor) -> Tensor:
    """The pair's log-ratio margin ``(logp_c − logp_r) − (ref_c − ref_r)`` (sequence log-probs (P,))."""
    return (chosen_logp - rejected_logp) - (ref_chosen_logp - ref_rejected_logp)


@register_preference_loss("sigmoid")
def sigmoid_loss(logits: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """DPO (Rafailov et al. 2023, eq. 7) with conservative label smoothing (cDPO, Mitchell 2023):
    ``−(1−ε)·log σ(β·logits) − ε·log σ(−β·logits)``. ``log_sigmoid`` is stable at any margin."""
    return -(1.0 - label_smoothing) * log_sigmoid(beta * logits) - label_smoothing * log_sigmoid(-beta * logits)


@register_preference_loss("robust")
def robust_loss(logits: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """Robust DPO (Chowdhury et al. 2024, eq. 5): an unbiased loss under label noise rate ε,
    ``(−(1−ε)·log σ(β·logits) + ε·log σ(−β·logits)) / (1 − 2ε)``."""
    return (-(1.0 - label_smoothing) * log_sigmoid(beta * logits)
            + label_smoothing * log_sigmoid(-beta * logits)) / (1.0 - 2.0 * label_smoothing)


@register_preference_loss("hinge")
def hinge_loss(logits: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """SLiC's hinge loss (Zhao et al. 2023) on the normalised likelihood: ``max(0, 1 − β·logits)``."""
    return ops.relu(1.0 - beta * logits)


@register_preference_loss("ipo", length_normalized=True)
def ipo_loss(logits: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """IPO (Azar et al. 2023, eq. 17): ``(logits − 1/(2β))²``, β being the paper's τ. Its log-probs are
    token means, not sums (length-normalised, as TRL does for ``loss_type="ipo"``)."""
    return ops.square(logits - 1.0 / (2.0 * beta))


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 − exp(x))`` for ``x ≤ 0``, accurate on both sides of −ln 2 (Mächler 2012; TRL's ``log1mexp``):
    ``log1p(−e^x)`` below, ``log(−expm1(x))`` above, the latter as ``log(−2t) − log1p(−t)``, ``t = tanh(x/2)``,
    because MindSpore's CPU ``expm1`` is ``exp(x) − 1`` (it loses every digit as ``x → 0``). Each branch reads
    its input clamped to its own side, so the branch ``where`` discards has finite gradients; ``x`` is capped at
    ``−1e−7`` (a completion whose every token has probability 1 in float32), where the value (TRL's too) is −inf
    and its gradient NaN."""
    t = -0.6931471805599453
    lo = ops.minimum(x, t)
    half = ops.tanh(ops.minimum(ops.maximum(x, t), -1e-7) / 2.0)
    return ops.where(x < t, ops.log1p(-ops.exp(lo)), ops.log(-2.0 * half) - ops.log1p(-half))


def orpo_log_odds(chosen_logp: Tensor, rejected_logp: Tensor) -> Tensor:
    """ORPO's log odds ratio of a pair (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without
    Reference Model", the odds of eq. 4, their ratio in eq. 7): ``log(odds(y_w|x) / odds(y_l|x))`` with
    ``odds(y|x) = P / (1 − P)``, i.e. ``(c − r) − (log(1 − e^c) − log(1 − e^r))`` of the completions'
    TOKEN-MEAN log-probs ``c``, ``r`` (P,) (TRL 1.16, ``trl/experimental/orpo/orpo_trainer.py``:
    ``ORPOTrainer.odds_ratio_loss`` on ``get_batch_logps(..., average_log_prob=True)``)."""
    return (chosen_logp - rejected_logp) - (log1mexp(chosen_logp) - log1mexp(rejected_logp))


def odds_ratio_loss(log_odds: Tensor, beta: float) -> Tensor:
    """ORPO's odds-ratio term of each pair, ``λ · L_OR = −λ · log σ(log_odds)`` (Hong et al. 2024, eqs. 6-7;
    λ is TRL's ``beta``). ORPO's loss is the chosen row's NLL plus the mean of this over the pairs (TRL:
    ``loss = policy_nll_loss - losses.mean()``, ``losses = beta * logsigmoid(log_odds)``)."""
    return -beta * log_sigmoid(log_odds)


def get_preference_loss(name: str) -> PreferenceLoss:
    """The registered DPO loss ``name``; a one-line error listing the known names otherwise."""
    return lookup(PREFERENCE_LOSSES, name)

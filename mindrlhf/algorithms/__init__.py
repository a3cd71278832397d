"""The stages' pure losses and estimators: advantage estimators, KL estimators, policy losses and their
aggregation (GRPO; ``kl`` also shapes PPO's reward), PPO's reward, GAE and value loss (``algorithms.ppo``), the
supervised, reward-model and DPO losses (``algorithms.supervised``).

GRPO's data flows reward → ``group_advantages`` / ``get_advantage_estimator`` → ``policy_loss`` (which
uses ``kl_penalty`` and ``aggregate_loss``). Everything is registered by name so configs select it;
the registries themselves (``mindrlhf.registry``) import no MindSpore.
"""
from mindrlhf.algorithms.advantages import (
    batch_std_advantages,
    dr_grpo_advantages,
    get_advantage_estimator,
    group_advantages,
    grpo_advantages,
    informative_groups,
    normalize_then_sum_advantages,
    register_advantage_estimator,
    rloo_advantages,
)
from mindrlhf.algorithms.kl import get_kl_estimator, kl_penalty, register_kl_estimator
from mindrlhf.algorithms.losses import (
    LOG_RATIO_BOUND,
    aggregate_loss,
    cispo_loss,
    clip_cov_loss,
    decoupled_loss,
    get_is_mode,
    get_policy_loss,
    gmpo_loss,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
    kl_cov_loss,
    loss_denominators,
    luspo_loss,
    masked_mean,
    off_policy_sequence_mask,
    policy_loss,
    register_is_mode,
    register_policy_loss,
    sapo_loss,
    vespo_loss,
)
from mindrlhf.registry import (
    ADVANTAGE_ESTIMATORS,
    IS_MODES,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    SCALE_REWARDS,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "IS_MODES",
    "LOG_RATIO_BOUND",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "SCALE_REWARDS",
    "aggregate_loss",
    "decoupled_loss",
    "batch_std_advantages",
    "dr_grpo_advantages",
    "get_advantage_estimator",
    "get_is_mode",
    "get_kl_estimator",
    "get_policy_loss",
    "group_advantages",
    "grpo_advantages",
    "grpo_loss",
    "informative_groups",
    "normalize_then_sum_advantages",
    "gspo_loss",
    "gspo_token_loss",
    "kl_penalty",
    "loss_denominators",
    "masked_mean",
    "off_policy_sequence_mask",
    "policy_loss",
    "register_advantage_estimator",
    "register_is_mode",
    "register_kl_estimator",
    "register_policy_loss",
    "rloo_advantages",
    "cispo_loss",
    "clip_cov_loss",
    "gmpo_loss",
    "kl_cov_loss",
    "luspo_loss",
    "sapo_loss",
    "vespo_loss",
]

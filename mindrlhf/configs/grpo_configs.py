"""The GRPO configuration: one dataclass per group, YAML + command-line loading, validation.

``GRPOConfig`` holds the groups as attributes (``cfg.algorithm.beta``, ``cfg.parallel.train_tp``).
Field names are unique across groups, so YAML may be grouped (``algorithm: {beta: 0.04}``) or flat
(``beta: 0.04``) and every field is the flag ``--<name>``. ``docs/config_reference.md`` is generated
from the help text here by ``mindrlhf.configs.write_config_references()``.

Usage::

    cfg = GRPOConfig.from_yaml("model_configs/qwen_grpo/grpo_tiny_cpu.yaml")
    cfg = parse_args(["--config", "grpo_config.yaml", "--beta", "0.04"])
"""
from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Optional, Sequence, Tuple, Union

from mindrlhf.configs.base import config_field
from mindrlhf.configs.common import (
    ModelBaseConfig,
    OptimizerConfig,
    PolicyEvalTrainConfig,
    RewardConfig,
    TrainingConfig,
    TrainLayoutConfig,
)
from mindrlhf.configs.mindformers import is_model_yaml, read_model_yaml
from mindrlhf.errors import MindRLHFError
from mindrlhf.registry import (
    ADVANTAGE_ESTIMATOR_PARAMS,
    ADVANTAGE_ESTIMATORS,
    IS_FOLDING_LOSSES,
    IS_MODES,
    KL_ESTIMATOR_FORMULAS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    MULTI_OBJECTIVE_AGGREGATIONS,
    PER_TOKEN_ADVANTAGE_ESTIMATORS,
    POLICY_LOSS_AGGREGATION,
    POLICY_LOSS_PARAMS,
    POLICY_LOSSES,
    ROLLOUT_RS,
    ROLLOUT_RS_OFF,
    SCALE_REWARDS,
    SEQUENCE_ADVANTAGE_LOSSES,
    STAGES,
    TOKEN_IS_MODES,
    TWO_SIDED_ROLLOUT_RS,
)
from mindrlhf.rewards.manager import reward_spec_name

#: TRL's loss_type names that are an aggregation of our token-level "grpo" loss (TRL's own "grpo" is ours).
TRL_LOSS_TYPES = {"bnpo": "token-mean", "dapo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
# Choices are read from the registries (mindrlhf.registry, no MindSpore), never listed here.
LOSS_TYPES = POLICY_LOSSES.names() + tuple(TRL_LOSS_TYPES)
#: How a LoRA policy samples (``generation.lora_sampler``): its layers apply the adapters, or a plain copy gets the
#: merged projections after every update (``trainer.rollout.RolloutTrainer.sync_generator``).
LORA_SAMPLERS = ("layers", "merged")
#: The registered estimator (algorithms.advantages) for advantage_estimator grpo and each scale_rewards.
_GRPO_SCALINGS = {"group": "grpo", "batch": "batch_std", "none": "dr_grpo"}


@dataclass
class AlgorithmConfig:
    """GRPO algorithm: group size, batch geometry, loss, KL, clipping, advantages, reference model."""

    num_generations: int = config_field(
        4, "G: completions sampled per prompt; advantages are normalised within each group of G. "
        "Must be >= 2 (a group of one has no baseline). Completions per step = chunk_size * num_rollouts * G.",
        ge=2)
    chunk_size: int = config_field(
        2, "Prompts per generation call, global across data-parallel ranks: each of the infer_dp generator "
        "replicas samples chunk_size / infer_dp prompts (x num_generations completions), so chunk_size must be "
        "divisible by infer_dp. Bigger chunks use the accelerator better but need more KV-cache memory.",
        ge=1)
    num_rollouts: int = config_field(
        1, "Generation calls per training step; prompts per step = chunk_size * num_rollouts. Raises the batch "
        "per step without raising generation memory.",
        ge=1)
    num_iterations: int = config_field(
        1, "Optimizer passes over each step's rollouts (mu in the GRPO paper). Above 1 (or with several "
        "mini-batches per step) the update is off-policy and the old policy's log-probs are computed for the "
        "clipped ratio; at 1 with one mini-batch the ratio is exactly 1.",
        ge=1)
    mini_batch_size: int = config_field(
        0, "Completions per optimizer update, global across train_dp ranks. 0 = all completions of the step "
        "(chunk_size * num_rollouts * num_generations) in one update. Must divide the completions per step and "
        "be divisible by train_dp; optimizer updates per step = num_iterations * completions / mini_batch_size. "
        "MindRLHF's grpo_configs.py calls this training batch batch_size.",
        ge=0, key_aliases=("batch_size",))
    micro_batch_size: int = config_field(
        0, "Completions per forward/backward on one train rank (gradient accumulation over "
        "mini_batch_size / train_dp / micro_batch_size micro-batches). 0 = the rank's whole share of the "
        "mini-batch at once. Must divide mini_batch_size / train_dp, and be divisible by train_micro_batches. "
        "Lower it to save activation memory; the loss does not change.",
        ge=0)
    beta: float = config_field(
        0.0, "KL coefficient: adds beta * KL(policy || reference) per token to the loss (estimator: "
        "kl_estimator). 0 disables the KL term and skips the reference model entirely (no memory, no forward). "
        "DeepSeekMath used 0.04; DAPO and Dr.GRPO use 0. Range >= 0.",
        ge=0.0)
    kl_estimator: str = config_field(
        "k3", f"KL estimator per token (k3: the GRPO paper's), {KL_ESTIMATOR_FORMULAS}. Used only when beta > 0.",
        choices=KL_ESTIMATORS.names())
    loss_type: str = config_field(
        "grpo", "Policy loss: grpo = per-token clipped ratio exp(logp - logp_old) (PPO-style); gspo = "
        "sequence-level ratio exp(mean_t(logp - logp_old)) clipped with the sequence advantage (GSPO; use "
        "much smaller epsilons, e.g. 3e-4 / 4e-4); gspo-token = GSPO's value with a per-token gradient; decoupled = "
        "AReaL's decoupled PPO for stale rows (max_staleness > 0): grpo's clip on the ratio to the proximal policy "
        "(the trainer's log-probs before the update) times the behaviour weight exp(logp_proximal - logp_sampler), "
        "0 above importance_sampling_cap (not with importance_sampling_correction). TRL's "
        "names are accepted and mean loss grpo with an aggregation: bnpo = token-mean, dapo = token-mean, dr_grpo = "
        "seq-mean-token-sum-norm (TRL's grpo is ours with the default seq-mean-token-mean); loss_agg_mode must then "
        "be left at its default or equal that aggregation. cispo = MiniMax-M1's -sg(min(r, cispo_ratio_max)) * A * "
        "logp (every token keeps its gradient; TRL aggregates it token-mean); sapo = -sigmoid(tau (r - 1)) 4/tau * A, "
        "a soft gate for the clip (sapo_temperature_pos / _neg); gmpo = GMPO (verl's geo_mean): -A * the geometric "
        "mean of the token ratios, each clipped in log space to [-epsilon_low, epsilon_high] (the paper's 0.4); "
        "clip_cov / kl_cov = grpo's clip, resp. no clip, with the gradient of a few high-covariance tokens cut, resp. "
        "penalised by kl_cov_coef |log r| (Clip-Cov / KL-Cov, verl's names); luspo = gspo scaled by each "
        "completion's length (TRL's luspo at sequence level); vespo = -sg(phi(w)) * A * logp, phi a Gamma-shaped "
        "weight of the completion's ratio w (TRL's vespo; aggregated token-mean there; the token weights of "
        "importance_sampling_correction are folded into w, as TRL does, instead of multiplying the loss). gmpo and "
        "luspo need loss_agg_mode seq-mean-token-mean. Log-ratios are clamped to +-20 before exp (verl's bound), so "
        "one off-policy outlier cannot overflow the update.",
        choices=LOSS_TYPES)
    loss_agg_mode: str = config_field(
        "seq-mean-token-mean", "How per-token losses become one number: seq-mean-token-mean = mean over each "
        "completion's tokens, then over completions (GRPO paper); token-mean = mean over all completion tokens "
        "of the global batch, independent of how it is split across ranks and micro-batches (DAPO); "
        "seq-mean-token-sum-norm = sum over tokens divided by the constant max_completion_length, then mean "
        "over completions (Dr.GRPO, no length bias).",
        choices=LOSS_AGG_MODES)
    epsilon_low: float = config_field(
        0.2, "Lower clip: the ratio is clipped below at 1 - epsilon_low. Range [0, 1). For loss_type gspo / "
        "gspo-token use ~3e-4.",
        ge=0.0, lt=1.0)
    epsilon_high: float = config_field(
        0.2, "Upper clip: the ratio is clipped above at 1 + epsilon_high. Range >= 0. DAPO's clip-higher "
        "uses 0.28 (with epsilon_low 0.2) to keep exploration; GSPO uses ~4e-4. Range [0, 10].",
        ge=0.0, le=10.0)
    delta: float = config_field(
        0.0, "loss_type grpo (and TRL's dapo / bnpo / dr_grpo): INTELLECT-2's two-sided clip, the unclipped ratio "
        "capped at delta too, so a token with a negative advantage whose ratio ran far above 1 + epsilon_high gives "
        "a bounded loss (TRL's delta; INTELLECT-2 uses 4, above 1 + epsilon_high). 0 = off. Range 0 or > 1.",
        ge=0.0)
    clip_ratio_c: float = config_field(
        0.0, "loss_type grpo (and TRL's dapo / bnpo / dr_grpo): dual-clip PPO, a token with a negative advantage "
        "loses at most -clip_ratio_c * A (no gradient beyond it; verl's clip_ratio_c, typically 3; AReaL's c_clip). "
        "0 = off. Range 0 or > 1.",
        ge=0.0)
    cispo_ratio_max: float = config_field(
        5.0, "loss_type cispo: the cap eps_max of the detached importance weight min(r, eps_max) (TRL's epsilon_high "
        "under loss_type cispo; ScaleRL's recommended 5). Range > 0.",
        gt=0.0)
    sapo_temperature_pos: float = config_field(
        1.0, "loss_type sapo: the gate's temperature tau for tokens with a positive advantage (TRL's and the SAPO "
        "paper's default 1.0); larger = closer to a hard clip. Range > 0.",
        gt=0.0)
    sapo_temperature_neg: float = config_field(
        1.05, "loss_type sapo: tau for tokens with advantage <= 0 (default 1.05: negative updates damped a little "
        "faster, as SAPO argues). Range > 0.",
        gt=0.0)
    clip_cov_ratio: float = config_field(
        2e-4, "loss_type clip_cov: fraction of a micro-batch's tokens whose gradient is cut (at least one), picked "
        "among the unclipped tokens with covariance (A - mean A)(logp - mean logp) in (clip_cov_lb, clip_cov_ub) "
        "(verl's clip_cov_ratio). Range (0, 1].",
        gt=0.0, le=1.0)
    clip_cov_lb: float = config_field(
        1.0, "loss_type clip_cov: lower bound of the covariance of the tokens it may cut (verl's clip_cov_lb).")
    clip_cov_ub: float = config_field(
        5.0, "loss_type clip_cov: upper bound of that covariance (verl's clip_cov_ub); must exceed clip_cov_lb.")
    kl_cov_ratio: float = config_field(
        2e-4, "loss_type kl_cov: fraction of a micro-batch's tokens (at least one), those of largest covariance, that "
        "get the penalty kl_cov_coef * |log r| (verl's kl_cov_ratio). Range (0, 1].",
        gt=0.0, le=1.0)
    kl_cov_coef: float = config_field(
        1.0, "loss_type kl_cov: coefficient of that |log r| penalty (verl's ppo_kl_coef). Range >= 0.",
        ge=0.0)
    vespo_k_pos: float = config_field(
        2.0, "loss_type vespo: the power k of phi(w) = exp(lambda + k log w - lambda w) for advantages >= 0; larger "
        "damps completions with w < 1 more (TRL's vespo_k_pos). Range >= 0.",
        ge=0.0)
    vespo_lambda_pos: float = config_field(
        3.0, "loss_type vespo: the decay lambda of phi for advantages >= 0; larger damps w > 1 more (TRL's "
        "vespo_lambda_pos). Range > 0.",
        gt=0.0)
    vespo_k_neg: float = config_field(
        3.0, "loss_type vespo: k for negative advantages (TRL's vespo_k_neg). Range >= 0.",
        ge=0.0)
    vespo_lambda_neg: float = config_field(
        2.0, "loss_type vespo: lambda for negative advantages (TRL's vespo_lambda_neg). Range > 0.",
        gt=0.0)
    advantage_estimator: str = config_field(
        "grpo", "Advantage estimator: grpo = reward minus its group's mean, divided as scale_rewards says (group std: "
        "GRPO; batch std: LitePPO; none: Dr.GRPO); dr_grpo = grpo with no division (the same as scale_rewards "
        "none); rloo = reward minus the mean of the other rewards of its group (RLOO: G/(G-1) x (reward - group "
        "mean), no division); batch_std = grpo with scale_rewards batch (LitePPO); reinforce_plus_plus = "
        "REINFORCE++ (verl's name): one advantage per token, the reward's discounted return gamma^(tokens to the "
        "end) * reward, whitened over all completion tokens of the step (no group baseline); "
        "reinforce_plus_plus_baseline = the reward minus its group's mean on every token, whitened over all "
        "completion tokens of the step (REINFORCE++-baseline). The two REINFORCE++ estimators give per-token "
        "advantages, so not with loss_type gspo, gmpo or luspo (one advantage per sequence) nor with "
        "off_policy_mask_threshold. With every estimator but grpo, scale_rewards must stay group. A NaN reward "
        "(every reward function declined) gets advantage 0 and is left out of the statistics.",
        choices=ADVANTAGE_ESTIMATORS.names())
    gamma: float = config_field(
        1.0, "advantage_estimator reinforce_plus_plus: the discount of the token-level return, token t of a "
        "completion gets gamma^k * reward before the whitening, k its tokens after t, a tool result's tokens between "
        "turns not counted (verl's algorithm.gamma; 1 = every token the reward). Range [0, 1].",
        ge=0.0, le=1.0)
    scale_rewards: str = config_field(
        "group", "Advantage scaling: advantage = (reward - group mean) / (std + eps) with the std of the "
        "group (group, the GRPO paper) or of all the step's rewards (batch, LitePPO); none = no division "
        "(Dr.GRPO). Groups whose rewards are all equal get advantage 0.",
        choices=SCALE_REWARDS)
    multi_objective_aggregation: str = config_field(
        "sum_then_normalize", "How several reward functions make one advantage (TRL's multi_objective_aggregation): "
        "sum_then_normalize = the weighted sum of the rewards, then the advantage_estimator and scale_rewards; "
        "normalize_then_sum = GDPO: each function's rewards normalised within their group, then weighted, summed and "
        "normalised over the step's batch (so a function with a wide range cannot drown the others; needs "
        "advantage_estimator grpo with scale_rewards group, which it replaces).",
        choices=MULTI_OBJECTIVE_AGGREGATIONS)
    mask_truncated_completions: bool = config_field(
        False, "Exclude completions that hit max_completion_length without a stop token from the loss "
        "(DAPO's overlong filtering); they still count in the reward metrics.")
    dynamic_sampling: bool = config_field(
        False, "DAPO's dynamic sampling: a group whose G rewards are all equal has advantage 0 and carries no "
        "gradient, so the step keeps only groups whose rewards differ and generates from further prompts (reading "
        "the dataset on, in order) until it has chunk_size * num_rollouts of them or max_sampling_rounds rounds ran; "
        "extra groups are dropped and a shortfall is filled with flat groups masked out of the loss. Logs "
        "sampling/rounds, sampling/kept_groups and frac_reward_zero_std over every group generated.")
    max_sampling_rounds: int = config_field(
        3, "Most generation rounds per step with dynamic_sampling (each reads chunk_size * num_rollouts prompts). "
        "Range >= 1.",
        ge=1)
    importance_sampling_correction: bool = config_field(
        False, "Correct the rollout/train mismatch (TRL's vllm_importance_sampling_correction): weight each token's "
        "policy loss by pi_train / pi_sampler of the sampled tokens, the trainer's log-probs of the policy that "
        "sampled (the old policy) against the sampler's own, as importance_sampling_mode says. The native sampler "
        "agrees with the trainer to ~1e-5 on CPU float32, so this matters for bfloat16/float16 sampling. The gap is "
        "logged either way: sampling/sampling_logp_difference/mean|max and sampling/importance_sampling_ratio/"
        "min|mean|max (the ratio as the mode computes it, applied or not).")
    importance_sampling_mode: str = config_field(
        "sequence_mask", "token_truncate = per-token ratio capped at importance_sampling_cap; token_mask = tokens "
        "whose ratio exceeds the cap get weight 0; sequence_truncate / sequence_mask = the same with one ratio per "
        "completion, exp(sum of its tokens' log-ratios). TRL's names and default.",
        choices=IS_MODES.names())
    importance_sampling_cap: float = config_field(
        3.0, "The cap C of importance_sampling_mode (TRL's vllm_importance_sampling_clip_max), and of the behaviour "
        "weight of loss_type decoupled (AReaL's behav_imp_weight_cap). Range >= 1.",
        ge=1.0)
    off_policy_mask_threshold: float = config_field(
        0.0, "Off-policy sequence masking (DeepSeek-V3.2; TRL's off_policy_mask_threshold): a completion with a "
        "negative advantage whose mean per-token KL from the sampler, mean(sampler logp - logp), exceeds this drops "
        "out of the policy term (its KL term stays); completions with a positive advantage always train. Logged as "
        "sampling/off_policy_masked_ratio. 0 = off. Range >= 0.",
        ge=0.0)
    rollout_rs: str = config_field(
        ROLLOUT_RS_OFF, "Rejection sampling of the rollout/train mismatch (verl's rollout_rs): tokens or whole "
        "completions whose divergence between the trainer's log-probs of the sampling policy and the sampler's own "
        "(d = logp_train - logp_sampler) leaves the bounds drop out of the policy term (their KL term stays and they "
        "still count in the loss's token and completion denominators, as with the masking importance_sampling_modes). "
        "Per-token divergences k1 = -d, k2 = d^2 / 2, k3 = exp(d) - 1 - d; token_kN judges each token, seq_sum_kN / "
        "seq_mean_kN / seq_max_kN a completion by the sum / mean / max over its tokens. The k1 criteria keep "
        "log(rollout_rs_threshold_lower) <= statistic <= log(rollout_rs_threshold) (ratio bounds, as verl's "
        "'lower_upper'); the others keep statistic <= rollout_rs_threshold. Logged with verl's names: "
        "rollout_corr/rollout_rs_masked_fraction, rollout_corr/rollout_rs_seq_masked_fraction and "
        "rollout_corr/rollout_rs_<criterion>_mean|max|min|fraction_high|fraction_low. Independent of "
        "importance_sampling_correction (both may be on). none = off.",
        choices=(ROLLOUT_RS_OFF,) + ROLLOUT_RS.names())
    rollout_rs_threshold: float = config_field(
        0.0, "rollout_rs: the upper bound (verl's rollout_rs_threshold): a ratio for the k1 criteria (e.g. 2: "
        "keep log-ratios up to log 2), the largest divergence kept for the others (e.g. 0.01 for seq_mean_k3). "
        "Required (> 0) with rollout_rs; 0 otherwise.",
        ge=0.0)
    rollout_rs_threshold_lower: float = config_field(
        0.0, "rollout_rs k1 criteria (token_k1, seq_sum_k1, seq_mean_k1): the lower ratio bound (verl's 'lower' of "
        "'lower_upper'); 0 = 1 / rollout_rs_threshold, verl's default. Must lie below rollout_rs_threshold.",
        ge=0.0)
    sync_ref_model: bool = config_field(
        False, "Update the reference model from the policy every ref_model_sync_steps steps (TR-DPO style), "
        "mixed by ref_model_mixup_alpha. Requires beta > 0 (otherwise there is no reference).")
    ref_model_sync_steps: int = config_field(
        64, "Training steps between reference updates when sync_ref_model is true. Range >= 1.",
        ge=1)
    ref_model_mixup_alpha: float = config_field(
        1.0, "Reference update when sync_ref_model is true: ref = alpha * policy + (1 - alpha) * ref. "
        "1.0 copies the policy. Range (0, 1].",
        gt=0.0, le=1.0)

    def check(self, errors: List[str]) -> None:
        """The algorithm's own cross-field rules: the loss's names, the reference's sync."""
        if self.advantage_estimator != "grpo" and self.scale_rewards != "group":
            errors.append(f"scale_rewards = {self.scale_rewards!r} applies to advantage_estimator grpo only, not "
                          f"{self.advantage_estimator!r}; leave scale_rewards at group")
        # TRL loss names carry their aggregation; a different explicit one is a contradiction.
        default_agg = AlgorithmConfig.__dataclass_fields__["loss_agg_mode"].default
        if self.loss_type in TRL_LOSS_TYPES and self.loss_agg_mode not in (default_agg, TRL_LOSS_TYPES[self.loss_type]):
            errors.append(f"loss_type = {self.loss_type!r} (TRL's name) means loss_agg_mode = "
                          f"{TRL_LOSS_TYPES[self.loss_type]!r}, but loss_agg_mode = {self.loss_agg_mode!r}; drop one "
                          "of them")
        need = POLICY_LOSS_AGGREGATION.get(self.loss_type)
        if need is not None and self.loss_agg_mode != need:
            errors.append(f"loss_type = {self.loss_type!r} is a mean over sequences and needs loss_agg_mode = "
                          f"{need!r}, not {self.loss_agg_mode!r}; leave loss_agg_mode at its default")
        for name in ("delta", "clip_ratio_c"):
            value = getattr(self, name)
            if 0 < value <= 1:
                errors.append(f"{name} = {value} caps a ratio at or below 1, which clips every on-policy token; use a "
                              f"value > 1 (e.g. {4 if name == 'delta' else 3}), or 0 for off")
            elif value and self.loss_type != "grpo" and self.loss_type not in TRL_LOSS_TYPES:
                errors.append(f"{name} = {value} applies to loss_type grpo (and TRL's dapo / bnpo / dr_grpo), not "
                              f"{self.loss_type!r}; set {name} 0 or use loss_type grpo")
        if self.multi_objective_aggregation == "normalize_then_sum" and (
                self.advantage_estimator != "grpo" or self.scale_rewards != "group"):
            errors.append(f"multi_objective_aggregation = 'normalize_then_sum' forms GDPO's advantages itself, with "
                          f"advantage_estimator = {self.advantage_estimator!r} and scale_rewards = "
                          f"{self.scale_rewards!r} as well; leave those at grpo and group")
        if self.advantage_estimator in PER_TOKEN_ADVANTAGE_ESTIMATORS:
            if self.loss_type in SEQUENCE_ADVANTAGE_LOSSES:
                errors.append(f"advantage_estimator = {self.advantage_estimator!r} gives one advantage per token, but "
                              f"loss_type = {self.loss_type!r} needs one per completion; use loss_type grpo (or "
                              "another token-level loss) or another advantage_estimator")
            if self.off_policy_mask_threshold > 0:
                errors.append(f"off_policy_mask_threshold = {self.off_policy_mask_threshold} masks completions by "
                              f"the sign of their advantage, but advantage_estimator = {self.advantage_estimator!r} "
                              "gives one per token; set off_policy_mask_threshold 0 or use another advantage_estimator")
        owners = [name for name, params in ADVANTAGE_ESTIMATOR_PARAMS.items() if "gamma" in params]
        if self.gamma != 1.0 and self.advantage_estimator not in owners:
            errors.append(f"gamma = {self.gamma} applies to advantage_estimator {' / '.join(owners)} only, not "
                          f"{self.advantage_estimator!r}; leave gamma at 1")
        self._check_rejection(errors)
        if self.loss_type == "clip_cov" and self.clip_cov_lb >= self.clip_cov_ub:
            errors.append(f"clip_cov_lb = {self.clip_cov_lb} >= clip_cov_ub = {self.clip_cov_ub}: no token can be "
                          "picked; set clip_cov_lb below clip_cov_ub")
        if (self.loss_type in IS_FOLDING_LOSSES and self.importance_sampling_correction
                and self.importance_sampling_mode not in TOKEN_IS_MODES):
            errors.append(f"loss_type = {self.loss_type!r} folds importance_sampling_correction's per-token weights "
                          f"into its sequence weight, but importance_sampling_mode = "
                          f"{self.importance_sampling_mode!r} gives one per completion; use "
                          f"{' or '.join(TOKEN_IS_MODES)} (as TRL requires)")
        if self.loss_type == "decoupled" and self.importance_sampling_correction:
            errors.append("loss_type = 'decoupled' with importance_sampling_correction = true: the decoupled loss "
                          "already weights each token by proximal/behaviour; set importance_sampling_correction false")
        if self.sync_ref_model and self.beta == 0:
            errors.append("sync_ref_model = true with beta = 0: the reference model is never used; "
                          "set beta > 0 or sync_ref_model false")


    def _check_rejection(self, errors: List[str]) -> None:
        """rollout_rs's bounds: a threshold with a criterion only, a lower bound with a k1 criterion only, below the
        upper one."""
        if self.rollout_rs == ROLLOUT_RS_OFF:
            for name in ("rollout_rs_threshold", "rollout_rs_threshold_lower"):
                if getattr(self, name):
                    errors.append(f"{name} = {getattr(self, name)} applies to rollout_rs only, which is "
                                  f"{ROLLOUT_RS_OFF!r}; set rollout_rs (e.g. seq_mean_k3) or {name} 0")
            return
        if self.rollout_rs_threshold <= 0:
            errors.append(f"rollout_rs = {self.rollout_rs!r} needs rollout_rs_threshold > 0 (verl's "
                          "rollout_rs_threshold, e.g. 2 for a k1 criterion, 0.01 for seq_mean_k3)")
            return
        two_sided = self.rollout_rs in TWO_SIDED_ROLLOUT_RS
        if self.rollout_rs_threshold_lower and not two_sided:
            errors.append(f"rollout_rs_threshold_lower = {self.rollout_rs_threshold_lower} applies to the k1 "
                          f"criteria ({', '.join(TWO_SIDED_ROLLOUT_RS)}), not {self.rollout_rs!r}, whose divergence "
                          "has an upper bound only; set rollout_rs_threshold_lower 0")
        lower = self.rollout_rs_threshold_lower or 1.0 / self.rollout_rs_threshold
        if two_sided and lower >= self.rollout_rs_threshold:
            errors.append(f"rollout_rs = {self.rollout_rs!r} keeps log-ratios within [log {lower:g}, log "
                          f"{self.rollout_rs_threshold:g}], which is empty; the lower bound "
                          "(rollout_rs_threshold_lower, by default 1 / rollout_rs_threshold) must lie below "
                          "rollout_rs_threshold (e.g. 2)")


@dataclass
class GRPORewardConfig(RewardConfig):
    """GRPO's reward: the rule reward functions (shared with PPO) and DAPO's overlong punishment."""

    overlong_buffer_length: int = config_field(
        0, "DAPO's soft overlong punishment: a completion longer than max_completion_length - "
        "overlong_buffer_length tokens gets an extra reward term falling linearly from 0 to -overlong_penalty at "
        "max_completion_length (logged as rewards/overlong/mean). 0 = off; DAPO used 4096 of 20480. Range "
        "[0, max_completion_length).",
        ge=0)
    overlong_penalty: float = config_field(
        1.0, "Largest overlong punishment (the term's value at max_completion_length). Range >= 0.",
        ge=0.0)

    def check(self, errors: List[str]) -> None:
        """The shared rules, at least one function, and no function named like the overlong term."""
        super().check(errors)
        if not self.reward_funcs:
            errors.append("reward_funcs is empty; give at least one reward function (e.g. accuracy)")
        if self.overlong_buffer_length and "overlong" in map(reward_spec_name, self.reward_funcs):
            errors.append("reward_funcs names a function 'overlong', the name of the overlong_buffer_length term; "
                          "rename it")


@dataclass
class GenerationConfig:
    """Sampling of completions (the generator / rollout side)."""

    max_prompt_length: int = config_field(
        320, "Longest prompt (tokens, after the chat template) the job accepts; the dataset must have been "
        "built with rlhf_data.py --max_prompt_length <= this (prompts are never truncated). Prompt + "
        "completion must fit the model's context length. Range >= 1.",
        ge=1)
    max_completion_length: int = config_field(
        160, "Maximum new tokens per completion; a completion reaching it without a stop token is "
        "'truncated' (see mask_truncated_completions, metric completions/clipped_ratio). Also the constant "
        "divisor of loss_agg_mode seq-mean-token-sum-norm. Range >= 1. The default fits the embedded "
        "135M model's CPU run (about half of its GSM8K answers finish within it); use 512-1024 for real runs.",
        ge=1)
    temperature: float = config_field(
        0.7, "Sampling temperature: logits are divided by it before top-k / top-p / min-p. Range > 0; lower "
        "is greedier. The policy's log-probs in the loss use the same temperature. The default suits the "
        "embedded 135M model, whose samples at 1.0 are mostly incoherent; 1.0 is usual for larger models. "
        "Range (0, 10]: above that every token is near-uniform noise.",
        gt=0.0, le=10.0)
    top_p: float = config_field(
        1.0, "Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p. "
        "Range (0, 1]; 1.0 = off.",
        gt=0.0, le=1.0)
    top_k: int = config_field(
        0, "Keep only the top_k most likely tokens before sampling. 0 = off. Range >= 0.",
        ge=0)
    min_p: float = config_field(
        0.0, "Drop tokens whose probability is below min_p * (probability of the most likely token). "
        "0.0 = off. Range [0, 1).",
        ge=0.0, lt=1.0)
    repetition_penalty: float = config_field(
        1.0, "Penalty on tokens already in the prompt or completion (CTRL / HF rule: positive logits divided "
        "by it, negative ones multiplied). 1.0 = off; > 1 discourages repetition. Range > 0.",
        gt=0.0)
    min_new_tokens: int = config_field(
        0, "Stop tokens are suppressed until a completion has this many tokens. Range "
        "[0, max_completion_length].",
        ge=0)
    stop_token_ids: List[int] = config_field(
        [], "Token ids that end a completion (the stop token is kept in the completion and the loss). "
        "[] = the tokenizer's eos and <|im_end|> ids.",
        ge=0)
    tools: List[str] = config_field(
        [], "Tools the policy may call during a rollout, each a built-in by name (calculator: + - * / // % ** on "
        "numbers, read with ast, bounded) or a user function by dotted path 'package.module:function' (a typed "
        "function with a Google-style docstring, whose JSON schema the model is shown). User tools run in the "
        "process that samples (a generator rank with gen_workers > 0). A turn that ends with "
        "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> (the Hermes form of Qwen2.5 and Qwen3) "
        "gets the results appended as the chat template's tool messages and the policy continues; the tool tokens "
        "are left out of the loss, the KL, the entropy and the length metrics (metrics tools/call_frequency, "
        "tools/failure_frequency, tools/turns/mean). The chat template shows the tools' schemas in the default "
        "data's prompts and in prompt rows without a 'tools' column of their own (a prompt mindrecord: convert it "
        "with mindrlhf-data --tools); a ChatML template without tool support gets the Hermes form. [] = one-turn "
        "rollouts. In PPO the tool tokens are also out of the value loss and GAE, which carries the final reward's "
        "credit across them to the earlier turns.")
    environment: str = config_field(
        "", "An environment class by dotted path 'package.module:Class' (TRL's environment_factory shape): one "
        "instance per completion, reset(**row) with the prompt row's columns (and solution) before it is sampled; "
        "its other public methods are tools the policy calls on that instance (shown in the prompts with the "
        "tools); an optional get_reward() is scored by the reward function 'environment'. reset must return None "
        "(prompts are tokenised once). Runs in the sampling process. '' = none. Not with gen_workers > 0.")
    max_tool_calling_iterations: int = config_field(
        5, "Tool rounds per completion at most (TRL's max_tool_calling_iterations): after that many, a turn's calls "
        "are not run and the completion ends there. All turns and tool results share max_completion_length. "
        "Range >= 0.",
        ge=0)
    max_tool_response_length: int = config_field(
        256, "A tool result longer than this many characters is cut there and ends in '...(truncated)' (verl's "
        "max_tool_response_length). 0 = no limit. Range >= 0.",
        ge=0)
    tool_timeout: float = config_field(
        10.0, "Seconds one tool call may run; a call still running then is stopped and its result is a timeout "
        "error the model reads (counted in tools/failure_frequency). 0 = no limit. Range >= 0.",
        ge=0.0)
    lora_sampler: str = config_field(
        "layers", "How a LoRA policy (lora_rank > 0) samples: 'layers' = the policy itself, its projections apply "
        "the adapters in every decode step (no second copy of the weights); 'merged' = a plain copy of the model "
        "that gets the merged projections W + (lora_alpha / lora_rank) B A after every update (one more copy of "
        "the weights, decode steps without the adapters' extra kernels: faster where decoding is launch-bound, as "
        "on CPU). Same completions either way up to float32 rounding. Needs lora_rank > 0.",
        choices=LORA_SAMPLERS)
    use_vllm: bool = config_field(
        False, "Generate the rollouts with vLLM instead of the built-in KV-cache sampler (MindRLHF's --use_vllm 1). "
        "On CPU: vLLM's CPU build, in a process and virtualenv of its own (vllm_python; `bash "
        "scripts/install_vllm.sh .venv-vllm` makes one), that gets the policy's weights in place after every "
        "update (metric time/sync). On Ascend: vLLM-MindSpore (untested here). Completions carry vLLM's sampled-token "
        "log-probs; the importance-sampling correction covers the rollout/train mismatch.")
    vllm_python: str = config_field(
        "", "The Python of vLLM's virtualenv, which runs the engine. '' = $MINDRLHF_VLLM_PYTHON, else the "
        "checkout's .venv-vllm/bin/python. Ignored with vllm_server.")
    vllm_server: str = config_field(
        "", "The Unix socket of an engine already running (`mindrlhf-vllm-serve --socket PATH`), shared across "
        "runs of one model architecture; '' = start an engine for this run and stop it at its end.")
    vllm_dtype: str = config_field(
        "auto", "The engine's dtype: 'auto' = bfloat16 where the CPU computes it natively (AVX-512-BF16 or AMX), "
        "else float32 (on a CPU without them vLLM's bfloat16 is slower than its float32; docs/design.md). The trainer "
        "keeps float32.",
        choices=("auto", "float32", "bfloat16"))
    vllm_max_model_len: int = config_field(
        0, "vLLM's max_model_len (prompt + completion tokens). 0 = max_prompt_length + max_completion_length.",
        ge=0)
    vllm_max_num_seqs: int = config_field(
        64, "vLLM's max_num_seqs: sequences decoded together.", ge=1)
    vllm_max_num_batched_tokens: int = config_field(
        0, "vLLM's max_num_batched_tokens (tokens per engine step). 0 = vLLM's default.", ge=0)
    vllm_kv_cache_gib: int = config_field(
        1, "KV-cache space of vLLM's CPU engine in GiB (its VLLM_CPU_KVCACHE_SPACE), allocated at its start.",
        ge=1)
    vllm_enforce_eager: bool = config_field(
        False, "Run vLLM's model without torch.compile (vLLM's enforce_eager, as `trl vllm-serve --enforce_eager`): "
        "the engine starts about a minute sooner on CPU and samples slower; for short runs. Ignored with vllm_server.")

    def check(self, errors: List[str]) -> None:
        if self.min_new_tokens > self.max_completion_length:
            errors.append(f"min_new_tokens = {self.min_new_tokens} > max_completion_length = "
                          f"{self.max_completion_length}; lower min_new_tokens")


@dataclass
class ModelConfig(ModelBaseConfig):
    """Weights and tokenizer of the policy, generator and reference models."""

    sft_path_train: str = config_field(
        "", "Policy (trained model) weights: a Hugging Face directory (config.json + safetensors) or a "
        "MindSpore checkpoint (full, or a folder of rank_{r} shards for the train layout), a training checkpoint "
        "folder (step_N) or a training run's output_dir (its newest intact checkpoint). '' = the "
        "packaged default model. Or, as in MindRLHF's tutorial, a MindFormers model YAML (.yaml): its "
        "parallel_config sets train_dp / train_tp / train_pp / train_micro_batches (data_parallel, "
        "model_parallel, pipeline_stage, micro_batch_num), its model.model_config architecture keys are checked "
        "against the checkpoint, every other key is listed once in the log as ignored, and the weights come from "
        "load_sft_checkpoint_train PATH. A layout field also given explicitly must agree with the YAML.")
    sft_path_infer: str = config_field(
        "", "Generator weights, e.g. the same checkpoint pre-sharded for the infer layout. '' = "
        "sft_path_train. The generator receives the policy's weights after every update anyway; this only "
        "sets its starting point. Or a MindFormers model YAML (the tutorial's predict YAML): its parallel_config "
        "sets infer_dp / infer_tp (pipeline_stage must be 1) and the weights come from load_sft_checkpoint_infer "
        "PATH (or from the policy).")
    ref_path: str = config_field(
        "", "Reference model weights (KL term, beta > 0). '' = sft_path_train.")
    load_sft_checkpoint_train: Union[bool, str] = config_field(
        True, "Load the policy weights: true = from sft_path_train; a path = from that checkpoint (MindRLHF's "
        "form: a full .ckpt/.safetensors, an HF directory, or a folder of rank_{r} shards written by "
        "transform_checkpoint.py for the train layout), which must then be the only weights named for the policy "
        "(sft_path_train '', the same path, or a model YAML); false (or '') = random initialisation with the "
        "model's architecture (debugging only).")
    load_sft_checkpoint_infer: Union[bool, str] = config_field(
        True, "Load the generator weights: true = from sft_path_infer; a path = from that checkpoint (full, HF, "
        "or rank_{r} shards for the infer layout; sft_path_infer must then be '', the same path or a model "
        "YAML); false (or '') = the generator starts from the policy's weights via the train-to-infer weight "
        "sync (no second load); then sft_path_infer must be '' or a model YAML.")
    load_ref_checkpoint: Union[bool, str] = config_field(
        True, "Load the reference weights: true = from ref_path (or the policy's checkpoint); a path = from "
        "that checkpoint (full, HF, or rank_{r} shards for the train layout; ref_path must then be '' or the "
        "same path); false (or '') = the reference starts as a copy of the initial policy (no second load); "
        "then ref_path must be ''.")

    def weight_fields(self, role: str) -> Tuple[str, "bool | str"]:
        """(path field, load field) values of ``role``: train, infer or ref."""
        return {"train": (self.sft_path_train, self.load_sft_checkpoint_train),
                "infer": (self.sft_path_infer, self.load_sft_checkpoint_infer),
                "ref": (self.ref_path, self.load_ref_checkpoint)}[role]

    def model_yaml(self, role: str) -> str:
        """The MindFormers model YAML given as ``sft_path_train`` / ``sft_path_infer``, or ''."""
        path = self.weight_fields(role)[0]
        return path if is_model_yaml(path) else ""

    def check(self, errors: List[str]) -> None:
        """The tokenizer's rules, then the weights': a load_* path and a different weights path for the same model,
        a model YAML with nothing to load, a path that loading switched off ignores."""
        super().check(errors)
        for role in ("train", "infer", "ref"):
            path, load = self.weight_fields(role)
            path_field = "ref_path" if role == "ref" else f"sft_path_{role}"
            load_field = "load_ref_checkpoint" if role == "ref" else f"load_sft_checkpoint_{role}"
            if isinstance(load, str) and path and not is_model_yaml(path) and path != load:
                errors.append(f"{load_field} = {load!r} and {path_field} = {path!r} name two different checkpoints; "
                              f"give the weights once ({path_field} may be a MindFormers model YAML instead)")
            if role == "ref" and is_model_yaml(path):
                errors.append(f"ref_path = {path!r} is a model YAML; ref_path names weights (the reference uses the "
                              "train layout): give a checkpoint, or use load_ref_checkpoint PATH")
        if self.model_yaml("train") and self.load_sft_checkpoint_train is True:
            errors.append(f"sft_path_train = {self.sft_path_train!r} is a model YAML, which holds no weights; give the "
                          "checkpoint with load_sft_checkpoint_train PATH")
        if self.model_yaml("train") and self.load_sft_checkpoint_train is False:
            errors.append(f"sft_path_train = {self.sft_path_train!r} (a model YAML) with load_sft_checkpoint_train = "
                          "false: the architecture is read from a checkpoint here; give it with "
                          "load_sft_checkpoint_train PATH")
        if self.ref_path and not self.load_ref_checkpoint:
            errors.append(f"ref_path = {self.ref_path!r} is ignored with load_ref_checkpoint = false; "
                          "set load_ref_checkpoint true or ref_path ''")
        if self.sft_path_infer and not self.load_sft_checkpoint_infer and not self.model_yaml("infer"):
            errors.append(f"sft_path_infer = {self.sft_path_infer!r} is ignored with load_sft_checkpoint_infer = "
                          "false; set load_sft_checkpoint_infer true or sft_path_infer ''")


@dataclass
class DataConfig:
    """Training prompts."""

    mind_dataset_dir: str = config_field(
        "", "The training prompts (GRPO and PPO; the seed's flag name, alias train_file): a .mindrecord written by "
        "rlhf_data.py (GSM8K, OpenR1-Math or generic question/answer JSONL; the answers feed the rule rewards), "
        "or prompt rows as JSONL (named .jsonl/.json or starting with '{'), a .parquet file (e.g. verl's GSM8K "
        "preprocessing output) or a datasets save_to_disk folder: ReaL's {\"prompt\": text} rows or TRL's "
        "prompt-only rows (prompt: a text, used as is, or a list of role/content messages, rendered with the chat "
        "template and its generation prompt). A row's other keys (columns) are passed to the reward functions as "
        "dataset columns (as TRL does; nested ones as dicts); the accuracy reward reads verl's "
        "reward_model.ground_truth, else 'solution', else the final answer of 'answer' (the number after GSM8K's "
        "'####'). Prompts longer than max_prompt_length and bad rows are skipped and named in the log. '' = the "
        "packaged GSM8K sample.",
        key_aliases=("train_file",))


@dataclass
class ParallelConfig(TrainLayoutConfig):
    """Device and parallel layouts of training (policy, reference) and generation."""

    infer_dp: int = config_field(
        1, "Generation data parallel: generator replicas, each sampling chunk_size / infer_dp prompts. With "
        "gen_workers > 0 it defaults to gen_workers / infer_tp. Range >= 1.",
        ge=1)
    infer_tp: int = config_field(
        1, "Generation tensor parallel. infer_dp * infer_tp must equal the training world size "
        "train_dp * train_tp * train_pp (the same processes train and generate), or gen_workers when that is "
        "set (the generator ranks). Range >= 1.",
        ge=1)
    gen_workers: int = config_field(
        0, "Disaggregated rollout: this many ranks of the msrun world only sample (the generator, infer_dp x infer_tp "
        "over them: ranks world - gen_workers .. world - 1) and the others only train (train_dp x train_tp x train_pp "
        "over ranks 0 .. world - gen_workers - 1; they also score the rewards and run the reference). Rollouts go "
        "generators -> trainers as one padded all-gather per step and the updated weights trainers -> generators as "
        "a broadcast (under train_tp/train_pp first assembled from the trainers' shards; each generator keeps its "
        "infer_tp slice). 0 = colocated: every rank generates, then trains (the default). With gen_workers > 0, "
        "infer_dp defaults to gen_workers / infer_tp and train_dp to the rest of the world / (train_tp * train_pp). "
        "GRPO and PPO (PPO's critic, reward model and reference run on the trainers), without LoRA; eval_steps "
        "runs on the trainers (not with train_pp > 1); save_data_file, replay_data_file and GRPO's dynamic_sampling "
        "work (the trainers tell the generators after each round whether another is needed; one step off, before "
        "they push their update). Range >= 0.",
        ge=0)
    max_staleness: int = config_field(
        0, "Disaggregated rollout's schedule (gen_workers > 0): the most policy updates a trained row may lag "
        "the policy that trains on it. 0 = synchronous: the generators wait for each update's weights, so every "
        "row is sampled by the current policy (the same numbers as colocated). 1 = one step off (verl's "
        "one-step-off-policy): the generators sample step t+1's rows with the weights of update t-1 while the "
        "trainers train step t, so every row after step 1 is one update old (staleness/mean, staleness/max). "
        "Values above 1 are accepted as a bound (a row older never trains); the schedule built is one step off. "
        "Correct the lag with importance_sampling_correction or loss_type decoupled. Colocated runs "
        "(gen_workers 0) take 0 only. Range >= 0.",
        ge=0)
    jit: bool = config_field(
        True, "Compile the decode step with mindspore.jit (decoding is dominated by per-kernel overhead, which "
        "jit removes); false = pynative, for debugging. The reference's and reward model's forward passes run "
        "the layer graphs (layer_graphs).")
    share_prompts: bool = config_field(
        True, "Encode each prompt once for all completions that share it: the sampler prefills each distinct "
        "prompt once and copies its KV cache to its num_generations rows, and the policy / reference / "
        "old-policy passes pack a micro-batch's completions of one prompt into one row behind a single copy "
        "of the prompt (Prefix Grouper's idea; same log-probs, loss and gradients up to float rounding). "
        "Training under pipeline parallelism (train_pp > 1) uses padded rows. false = every row carries "
        "its own prompt.")

    def layout_sizes(self) -> dict:
        return {**super().layout_sizes(), "infer_dp": self.infer_dp, "infer_tp": self.infer_tp}

    def check(self, errors: List[str]) -> None:
        super().check(errors)
        train_world, infer_world = self.train_dp * self.train_tp * self.train_pp, self.infer_dp * self.infer_tp
        if self.max_staleness and not self.gen_workers:
            errors.append(f"max_staleness {self.max_staleness} with gen_workers 0: a colocated run has no generation "
                          "to overlap with training; set gen_workers > 0 or max_staleness 0")
        if self.gen_workers:
            check_gen_workers(self, errors)
        elif train_world != infer_world:
            errors.append(f"train world size train_dp*train_tp*train_pp = {self.train_dp}*{self.train_tp}*"
                          f"{self.train_pp} = {train_world} != infer world size infer_dp*infer_tp = {self.infer_dp}*"
                          f"{self.infer_tp} = {infer_world}; the same processes train and generate")


def check_gen_workers(p: "ParallelConfig", errors: List[str]) -> None:
    """The layout rules of a disaggregated rollout (``gen_workers`` > 0): the generators' layout (infer_dp x
    infer_tp) fills the gen_workers ranks; the trainers' (train_dp x train_tp x train_pp) is checked against the
    world at launch (``groups.disaggregated_layouts``)."""
    if p.infer_dp * p.infer_tp != p.gen_workers:
        errors.append(f"gen_workers = {p.gen_workers} generator ranks but infer_dp*infer_tp = {p.infer_dp}*"
                      f"{p.infer_tp} = {p.infer_dp * p.infer_tp}; the generators' layout must fill them (leave "
                      f"infer_dp unset or set it to {max(p.gen_workers // p.infer_tp, 1)})")
    if not p.use_parallel:
        errors.append(f"gen_workers = {p.gen_workers} needs use_parallel true and msrun: the generators are "
                      "ranks of their own; set use_parallel true or gen_workers 0")


@dataclass
class RolloutTrainConfig(PolicyEvalTrainConfig):
    """Training loop of a stage that samples its data (GRPO, PPO): the shared loop, the evaluation while training,
    completion dumps and the experience record / replay."""

    log_completions_steps: int = config_field(
        10, "Write output_dir/completions_step_N.jsonl (prompt, completion, rewards and the stage's per-row "
        "values: GRPO's advantage, PPO's mean advantage; with tools also 'messages', the trajectory's turns, calls and "
        "tool results) every N steps and at the last step. 0 = never. Range >= 0.",
        ge=0)
    eval_steps: int = config_field(
        0, "Evaluate the policy every N steps and at the last step on held-out GSM8K questions (eval_file), with "
        "the run's own sampler after the step's weight sync (gen_workers > 0: the trainers, on a sampler over the "
        "policy, so the weights of that step at any max_staleness): the training prompt style, max_completion_length "
        "new tokens, greedy (or maj@k, eval_num_generations). Logged as eval/accuracy, eval/format_rate, "
        "eval/mean_length, eval/truncated_rate and eval/reward/<fn> (each of the run's reward functions averaged "
        "over the evaluated completions, given the question and its solution as columns; a function that fails "
        "on them logs nan; PPO without reward_funcs: the built-in accuracy and format rewards) in metrics.jsonl, "
        "TensorBoard and eval_accuracy.png: the numbers mindrlhf-eval gives for that step's checkpoint with the "
        "same questions and settings. 0 = never. Range >= 0.",
        ge=0)
    save_data_file: str = config_field(
        "", "Dump every step's experience (prompt and completion ids, masks, sampler log-probs, rewards per "
        "function, GRPO's advantages) as .npz files, one per step: <path without .npz>.step<N>.npz. For debugging "
        "and replay_data_file. '' = off.")
    replay_data_file: str = config_field(
        "", "Replay rollouts from a save_data_file dump (the same path given there) instead of generating "
        "(debugging; the 1-vs-N-worker parity tests). The dump must come from the same batch geometry "
        "(GRPO: chunk_size, num_rollouts, num_generations; PPO: batch_size, num_generations). With gen_workers > 0 "
        "the trainers replay (the same training as a recording with that many trainers) and the generator ranks, "
        "with nothing to sample, stop at the start. '' = off.")

    def check(self, errors: List[str]) -> None:
        super().check(errors)
        if self.save_data_file and self.save_data_file == self.replay_data_file:
            errors.append(f"save_data_file and replay_data_file are both {self.save_data_file!r}: the dump would "
                          "overwrite its own input; give save_data_file another path")


@dataclass
class TrainConfig(RolloutTrainConfig):
    """Training loop: length, seed, outputs, checkpoints, resume, logging, experience dumps."""

    grpo_epochs: int = config_field(
        0, "Passes over the prompt dataset (MindRLHF's grpo_epochs): the run is grpo_epochs * (dataset batches per "
        "epoch // num_rollouts) steps, a batch being chunk_size prompts (a partial batch at an epoch's end is "
        "dropped), or max_steps if given and smaller. The learning-rate decay spans that many steps, and a "
        "resumed run computes the same length from the same data. With dynamic_sampling a step may read more "
        "batches, so an epoch then counts steps, not prompts. 0 = max_steps alone. Range >= 0.",
        ge=0)


_PREAMBLE = """
Every field can be set in a YAML file passed with `--config`, grouped (`algorithm: {beta: 0.04}`)
or flat (`beta: 0.04`), and on the command line as `--<field> VALUE` (command-line flags override
the YAML). Lists are space-separated on the command line (`--reward_funcs accuracy format`); bools
take `true`/`false`, `True`/`False`, `1`/`0` or a bare flag (`--use_parallel`). Unknown keys are errors.
A field's **Alias** (MindRLHF's `grpo_configs.py` names: `start_lr`, `end_lr`, `batch_size`; and
`train_file`, the other stages' name of the training data) is another key for it, in YAML and as a
flag; a name and its alias with different values are an error.
The `bool | str` fields (`load_sft_checkpoint_train`, ...) take true/false or a checkpoint path.

**Batch geometry.** One training step reads `chunk_size * num_rollouts` prompts and samples
`num_generations` completions for each: `N = chunk_size * num_rollouts * num_generations`
completions. Generation: each of the `infer_dp` generator replicas samples `chunk_size / infer_dp`
prompts per call. Training: the `N` completions are cut into `N / mini_batch_size` mini-batches (one
optimizer update each), repeated `num_iterations` times; each of the `train_dp` ranks takes
`mini_batch_size / train_dp` completions of a mini-batch and accumulates gradients over micro-batches
of `micro_batch_size`, each cut into `train_micro_batches` pipeline micro-batches when `train_pp > 1`.
"""


class RolloutConfig(TrainingConfig):
    """What the configs of the stages that sample (GRPO, PPO) share: the batch geometry from one generation call's
    prompts down to a pipeline micro-batch, and its divisibility rules. A stage names the algorithm field of a
    call's prompts (``PROMPTS_FIELD``) and gives ``completions_per_step``, ``mini_batch_completions`` and the rule of
    its mini-batch count (``_mini_batch_error``)."""

    #: The algorithm field holding one generation call's prompts (each generator replica samples its share).
    PROMPTS_FIELD: ClassVar[str] = ""

    def generator_checkpoint(self) -> str:
        """The checkpoint the generator starts from when it is not the policy's own ('': the generator gets the
        policy's weights). A stage without generator weights of its own (PPO: the actor's) has none."""
        return ""

    @property
    def merged_sampler(self) -> bool:
        """Whether a LoRA policy samples through a plain copy holding its merged projections (``lora_sampler``
        merged, or vLLM's engine, which gets the merged weights)."""
        return self.model.lora and (self.generation.lora_sampler == "merged" or self.generation.use_vllm)

    @property
    def prompts_per_infer_rank(self) -> int:
        """Prompts each generator replica samples per generation call."""
        return getattr(self.algorithm, self.PROMPTS_FIELD) // self.parallel.infer_dp

    @property
    def micro_batch_completions(self) -> int:
        """Completions per forward/backward on one train rank; ``micro_batch_size`` with 0 resolved."""
        return self.algorithm.micro_batch_size or self.mini_batch_completions // self.parallel.train_dp

    def _mini_batch_error(self) -> Optional[str]:
        """Why the step's completions do not cut into the stage's mini-batches, or None."""
        raise NotImplementedError

    def _mini_batch_text(self) -> str:
        """The mini-batch as the stage's fields set it, for the errors below."""
        raise NotImplementedError

    def resolve(self, source: str) -> None:
        """With generator ranks (``gen_workers``) and no infer_dp given, the generators' layout follows them
        (gen_workers / infer_tp replicas over the gen_workers ranks)."""
        p = self.parallel
        # Only from a valid gen_workers: a negative one would make infer_dp negative too, and its range error
        # would then name a field the user never set beside the one they did.
        if p.gen_workers > 0 and "infer_dp" not in self.explicitly_set() and p.gen_workers % p.infer_tp == 0:
            p.infer_dp = p.gen_workers // p.infer_tp

    def _check_combinations(self, errors: List[str]) -> None:
        super()._check_combinations(errors)
        p = self.parallel
        if self.model.lora and (p.gen_workers or p.infer_tp != p.train_tp or p.infer_dp != p.train_dp
                                or p.train_pp > 1 or self.generator_checkpoint()):
            # GRPO's and PPO's sampler is then the trained model itself (its layers apply the adapters); a pipeline
            # stage holds only its layers, so it cannot sample.
            errors.append("LoRA samples with the trained policy itself (its layers apply the adapters), so the "
                          "generator must be the policy: use infer_tp = train_tp, infer_dp = train_dp, train_pp 1, "
                          "gen_workers 0 and no separate generator checkpoint (GRPO's sft_path_infer / "
                          "load_sft_checkpoint_infer)")
        vllm = self.generation.use_vllm
        if vllm and p.device_target == "Ascend" and importlib.util.find_spec("vllm_mindspore") is None:
            errors.append("use_vllm = true on Ascend needs the vllm_mindspore package; install vllm-mindspore or set "
                          "use_vllm false for the built-in sampler")
        if vllm and p.infer_tp > 1:
            errors.append(f"use_vllm = true with infer_tp = {p.infer_tp}: the vLLM engine samples whole models (its "
                          "tensor parallelism is not wired in); set infer_tp 1")
        if "environment" in self.reward.reward_funcs and not self.generation.environment:
            errors.append("reward_funcs has 'environment' (an environment's get_reward()) but environment is ''; set "
                          "environment to 'package.module:Class', or drop that reward")
        if self.generation.lora_sampler == "merged" and not self.model.lora:
            errors.append("lora_sampler = merged without LoRA: it chooses how adapters reach the sampler; set "
                          "lora_rank > 0 (or lora_init_from), or drop lora_sampler")
        if p.gen_workers:  # what a disaggregated rollout does not do yet, named (GRPO's and PPO's alike)
            if p.train_pp > 1 and self.train.eval_steps:
                # The trainers evaluate on a sampler over their own policy, and a pipeline stage holds only its
                # layers, so it cannot sample.
                errors.append(f"eval_steps = {self.train.eval_steps} with gen_workers = {p.gen_workers} and "
                              f"train_pp = {p.train_pp}: the trainers evaluate with their policy, which a pipeline "
                              "stage cannot sample; set eval_steps 0 or train_pp 1 (evaluate a checkpoint with "
                              "mindrlhf-eval)")
            if self.generation.environment:
                # get_reward() is read on the generator after the last turn and the wire format carries no reward.
                errors.append(f"environment with gen_workers = {p.gen_workers}: a disaggregated rollout does not "
                              "carry environments' rewards yet; set gen_workers 0, or use tools")

    def _check_batch_geometry(self, errors: List[str]) -> None:
        """Prompts per generator replica, and completions per step → mini-batch → rank → micro-batch → pipeline
        micro-batch: each must divide the one before (the first that does not is the one error)."""
        p, name = self.parallel, self.PROMPTS_FIELD
        prompts = getattr(self.algorithm, name)
        if prompts % p.infer_dp:
            errors.append(f"{name} = {prompts} is not divisible by infer_dp = {p.infer_dp} "
                          f"(each generator replica samples {name} / infer_dp prompts)")
        wrong = self._mini_batch_error()
        if wrong:
            errors.append(wrong)
            return
        mini = self.mini_batch_completions
        if mini % p.train_dp:
            errors.append(f"{self._mini_batch_text()} is not divisible by train_dp = {p.train_dp} "
                          "(completions per rank)")
            return
        per_rank = mini // p.train_dp
        micro = self.micro_batch_completions
        if per_rank % micro:
            errors.append(f"micro_batch_size = {micro} does not divide the completions per rank per mini-batch, "
                          f"mini-batch / train_dp = {mini} / {p.train_dp} = {per_rank}")
            return
        if micro % p.train_micro_batches:
            errors.append(f"micro_batch_size = {micro} is not divisible by train_micro_batches = "
                          f"{p.train_micro_batches} (pipeline micro-batches)")


@dataclass
class GRPOConfig(RolloutConfig):
    """All GRPO settings, one attribute per group: ``cfg.algorithm.beta``, ``cfg.train.max_steps``."""

    REFERENCE_PREAMBLE = _PREAMBLE
    REFERENCE_FILE = STAGES["grpo"].reference
    #: LoRA with the policy as its own generator, the reference (beta > 0) its base with the adapters off
    #: (``_check_combinations`` names what is not wired yet).
    LORA: ClassVar[bool] = True
    PROMPTS_FIELD = "chunk_size"
    # The reward fields were in the algorithm group before the reward group existed.
    MOVED_FIELDS = {f.name: "algorithm" for f in dataclasses.fields(GRPORewardConfig)}

    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    reward: GRPORewardConfig = dataclasses.field(default_factory=GRPORewardConfig)
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    # ---------------------------------------------------------------- derived sizes (see _PREAMBLE)
    @property
    def prompts_per_step(self) -> int:
        return self.algorithm.chunk_size * self.algorithm.num_rollouts

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.algorithm.num_generations

    @property
    def mini_batch_completions(self) -> int:
        """Completions per optimizer update (global); ``mini_batch_size`` with 0 resolved."""
        return self.algorithm.mini_batch_size or self.completions_per_step

    @property
    def mini_batches_per_step(self) -> int:
        return self.completions_per_step // self.mini_batch_completions

    @property
    def optimizer_steps_per_step(self) -> int:
        """Optimizer updates per training step."""
        return self.algorithm.num_iterations * self.mini_batches_per_step

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer update on one train rank."""
        return self.mini_batch_completions // self.parallel.train_dp // self.micro_batch_completions

    @property
    def uses_reference(self) -> bool:
        """Whether a reference model is built and its log-probs computed: only for a KL term (beta > 0)."""
        return self.algorithm.beta > 0

    @property
    def needs_old_logprobs(self) -> bool:
        """True when updates are off-policy (several updates per step), so logp_old must be computed."""
        return self.optimizer_steps_per_step > 1

    @property
    def policy_loss(self) -> Tuple[str, str]:
        """(policy loss, loss aggregation) the run uses: TRL's loss_type names resolved (TRL_LOSS_TYPES)."""
        a = self.algorithm
        if a.loss_type in TRL_LOSS_TYPES:
            return "grpo", TRL_LOSS_TYPES[a.loss_type]
        return a.loss_type, a.loss_agg_mode

    @property
    def policy_loss_params(self) -> Dict[str, float]:
        """The hyper-parameters of the run's policy loss by name (``registry.POLICY_LOSS_PARAMS``)."""
        return {name: getattr(self.algorithm, name) for name in POLICY_LOSS_PARAMS.get(self.policy_loss[0], ())}

    @property
    def advantage_estimator_params(self) -> Dict[str, float]:
        """The hyper-parameters of the run's advantage estimator by name (``registry.ADVANTAGE_ESTIMATOR_PARAMS``)."""
        return {name: getattr(self.algorithm, name) for name in ADVANTAGE_ESTIMATOR_PARAMS.get(self.advantage_estimator,
                                                                                               ())}

    @property
    def advantage_estimator(self) -> str:
        """The registered advantage estimator (``algorithms.get_advantage_estimator``) the run uses."""
        a = self.algorithm
        return _GRPO_SCALINGS[a.scale_rewards] if a.advantage_estimator == "grpo" else a.advantage_estimator

    # ---------------------------------------------------------------- weights and MindFormers model YAMLs
    def model_weights(self, role: str) -> str:
        """The checkpoint to load for ``role`` (train / infer / ref), or '' when there is none to load:
        the ``load_*`` path if one is given, else the role's path field unless it is a model YAML or
        loading is off. ('' for train = the packaged default model; for infer / ref = from the policy.)"""
        path, load = self.model.weight_fields(role)
        if isinstance(load, str):
            return load
        return path if load and not is_model_yaml(path) else ""

    def generator_checkpoint(self) -> str:
        """``sft_path_infer``'s checkpoint when it names another one than the policy's, as a separate generator
        (``RolloutConfig.generator_checkpoint``). The paths as given: two names of one checkpoint hold the same
        weights anyway."""
        infer = self.model_weights("infer")
        return infer if infer and infer != self.model_weights("train") else ""

    def model_yaml(self, role: str) -> str:
        """The MindFormers model YAML given as ``sft_path_train`` / ``sft_path_infer``, or ''."""
        return self.model.model_yaml(role)

    def resolve(self, source: str) -> None:
        """Take the train / infer layouts from MindFormers model YAMLs given as sft_path_train /
        sft_path_infer. A layout field the user set too must agree (one error naming both)."""
        explicit = self.explicitly_set()
        for side in ("train", "infer"):
            path = self.model_yaml(side)
            if not path:
                continue
            for name, (value, key) in read_model_yaml(path).layout(side).items():
                current = self.get(name)
                if name in explicit and current != value:
                    raise MindRLHFError(f"{source}: {name} = {current} conflicts with {key}: {value} in {path} "
                                        f"(sft_path_{side}); drop {name} or change the YAML")
                setattr(self.parallel, name, value)
        if not self.model_yaml("infer"):
            super().resolve(source)

    def _check_combinations(self, errors: List[str]) -> None:
        super()._check_combinations(errors)  # each group's own rules (its ``check``)
        # The rules across groups.
        a, g, o, m, t = self.algorithm, self.generation, self.optimizer, self.model, self.train
        if self.reward.overlong_buffer_length >= g.max_completion_length:
            errors.append(f"overlong_buffer_length = {self.reward.overlong_buffer_length} must be below "
                          f"max_completion_length = "
                          f"{g.max_completion_length} (the punishment starts that many tokens before the limit)")
        if m.lora and a.beta > 0 and a.sync_ref_model:
            # The reference is the frozen base with the adapters off (or a --ref_path model): nothing to sync into.
            errors.append(f"sync_ref_model = true with lora_rank = {m.lora_rank}: the reference of a LoRA run is the "
                          "frozen base with its adapters off; set sync_ref_model false")
        if a.beta > 0 and not m.load_ref_checkpoint and not m.load_sft_checkpoint_train:
            errors.append(f"beta = {a.beta} with load_ref_checkpoint = false and load_sft_checkpoint_train = false: "
                          "the reference would be a random model; load a checkpoint or set beta 0")
        if o.warmup_steps > t.max_steps and not (t.grpo_epochs and "max_steps" not in self.explicitly_set()):
            errors.append(f"warmup_steps = {o.warmup_steps} > max_steps = {t.max_steps}; "
                          "the learning rate would never reach lr")
        self._check_batch_geometry(errors)

    def _mini_batch_error(self) -> Optional[str]:
        a, n = self.algorithm, self.completions_per_step
        if n % self.mini_batch_completions:
            return (f"mini_batch_size = {self.mini_batch_completions} does not divide the completions per step, "
                    f"chunk_size*num_rollouts*num_generations = {a.chunk_size}*{a.num_rollouts}*{a.num_generations} "
                    f"= {n}")
        return None

    def _mini_batch_text(self) -> str:
        all_of_them = " (= all completions)" if not self.algorithm.mini_batch_size else ""
        return f"mini_batch_size = {self.mini_batch_completions}{all_of_them}"


def parse_args(argv: Optional[Sequence[str]] = None) -> GRPOConfig:
    """Build a ``GRPOConfig`` from ``--config PATH`` and ``--<field>`` flags, validated."""
    return GRPOConfig.parse_args(argv, description=f"GRPO training for MindSpore (see {GRPOConfig.REFERENCE_FILE})")

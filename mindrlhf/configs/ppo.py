"""The PPO configuration: the shared groups (``configs.common``), GRPO's generation and layout groups
(the same sampler and train → infer sync), and PPO's own: the four models' weights and the algorithm.

Defaults follow TRL's last ``PPOConfig`` (trl ≤ 0.2x: ``kl_coef`` 0.05, ``gamma`` 1, ``lam`` 0.95,
``cliprange`` / ``cliprange_value`` 0.2, ``vf_coef`` 0.1, ``num_ppo_epochs`` 4, ``kl_estimator`` k1) and
ReaL's PPO interface for what TRL does not have (``adv_norm``, ``value_norm``, the reward's scaling, bias
and clip).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, List, Optional, Sequence

from mindrlhf.configs.base import config_field
from mindrlhf.configs.common import ModelBaseConfig, OptimizerConfig, RewardConfig
from mindrlhf.configs.grpo_configs import (
    DataConfig,
    GenerationConfig,
    ParallelConfig,
    RolloutConfig,
    RolloutTrainConfig,
)
from mindrlhf.registry import KL_ESTIMATOR_FORMULAS, KL_ESTIMATORS, STAGES


@dataclass
class PPOModelConfig(ModelBaseConfig):
    """The actor's, critic's, reward model's and reference's weights, and the tokenizer."""

    model_path: str = config_field(
        "", "The actor (the trained policy): a Hugging Face directory, a MindSpore checkpoint (.ckpt / "
        ".safetensors with config.json beside it, or a folder of rank_{r} shards for the train layout), or a "
        "training checkpoint folder (step_N) of any mindrlhf stage, e.g. mindrlhf-sft's, or a training run's "
        "output_dir (its newest intact checkpoint, named in the log). '' = the packaged "
        "default model (SmolLM2-135M-Instruct).",
        key_aliases=("model",))
    critic_model_path: str = config_field(
        "", "The critic (value model), trained beside the actor with its own float32 masters and AdamW state: "
        "an HF *ForSequenceClassification directory with one label, a mindrlhf-rm checkpoint, or a causal LM "
        "whose lm_head is replaced by a new one-output score head. '' = reward_model_path if given (ReaL's and "
        "InstructGPT's choice), else model_path with a new score head.",
        key_aliases=("critic_model",))
    reward_model_path: str = config_field(
        "", "The reward model, run without gradients in dtype: a one-label sequence-classification model (an HF "
        "*ForSequenceClassification directory or a mindrlhf-rm checkpoint) sharing the actor's tokenizer; its "
        "score at each completion's last token is the completion's score (scaled by reward_output_scaling and "
        "reward_output_bias, then added to the reward_funcs). '' = no reward model (reward_funcs only).",
        key_aliases=("reward_model",))
    ref_model_path: str = config_field(
        "", "The reference model of the KL penalty (same forms as model_path), run without gradients. '' = a "
        "copy of the initial actor.",
        key_aliases=("ref_model",))
    offload_models: bool = config_field(
        False, "Release the reward model's and the reference's weights after their pass in each step and read "
        "them again from their files before the next (the reference from ref_model_path, or from model_path: "
        "the initial actor), so the actor's and critic's updates run without them in device memory. The same "
        "numbers either way. On CPU it does not pay (freed host memory is not returned before the reload: a "
        "higher peak and a slower step; figures in README.md's PPO section, bench/ppo_step.py --offload_models).")


@dataclass
class PPOAlgorithmConfig:
    """PPO: batch geometry, the KL-shaped reward, GAE and the clipped losses."""

    batch_size: int = config_field(
        4, "Prompts per step, over all ranks: each of the infer_dp generator replicas samples batch_size / "
        "infer_dp of them (x num_generations completions). Range >= 1.",
        ge=1)
    num_generations: int = config_field(
        1, "Completions sampled per prompt (PPO's baseline is the critic, so 1 is usual). Completions per step = "
        "batch_size * num_generations. Range >= 1.",
        ge=1)
    ppo_epochs: int = config_field(
        4, "Passes over each step's rollouts (TRL's num_ppo_epochs); every pass updates the actor and the critic "
        "once per mini-batch. Range >= 1.",
        ge=1)
    num_mini_batches: int = config_field(
        1, "Mini-batches per pass: the step's completions are cut into this many, one actor update and one critic "
        "update each. Must divide the completions per step, each mini-batch divisible by train_dp. Range >= 1.",
        ge=1)
    micro_batch_size: int = config_field(
        0, "Completions per forward/backward on one train rank (gradient accumulation). 0 = the rank's whole "
        "share of a mini-batch. Must divide it. The update does not change with it.",
        ge=0)
    recompute_old_logp: bool = config_field(
        False, "Where the old policy's log-probs come from (the ratio's denominator, the actor term of the KL "
        "penalty, objective/entropy). false: the sampler's own log-probs of the tokens it drew, as TRL's and "
        "ReaL's PPO take them from generation (no extra pass; its time: bench/README.md, ppo_step.py); true: "
        "one more actor forward over the rollout (verl's choice), for a sampler that computes in another dtype "
        "or layout than training, whose log-probs then differ from the trained model's.")
    kl_coef: float = config_field(
        0.05, "Weight of the per-token KL penalty in the reward: r_t = -kl_coef * KL_t, plus the score at the last "
        "completion token. Range >= 0; 0 skips the reference model.",
        ge=0.0)
    kl_estimator: str = config_field(
        "k1", f"Per-token KL estimator of the reward's penalty (k1: TRL's default), {KL_ESTIMATOR_FORMULAS}.",
        choices=KL_ESTIMATORS.names())
    gamma: float = config_field(
        1.0, "Discount of GAE. Range [0, 1].",
        ge=0.0, le=1.0)
    lam: float = config_field(
        0.95, "lambda of GAE: 0 = one-step TD advantages (low variance, biased by the critic), 1 = Monte-Carlo "
        "returns minus the value. Range [0, 1].",
        ge=0.0, le=1.0)
    cliprange: float = config_field(
        0.2, "Policy ratio clip: the surrogate uses clip(ratio, 1 - cliprange, 1 + cliprange). Range [0, 1).",
        ge=0.0, lt=1.0)
    cliprange_value: float = config_field(
        0.2, "Value clip: the value loss is 0.5 * max((V - R)^2, (clip(V, V_old +- cliprange_value) - R)^2). "
        "Range >= 0.",
        ge=0.0)
    vf_coef: float = config_field(
        0.1, "Weight of the value loss (the critic's loss is vf_coef x the clipped value loss). The critic has "
        "its own AdamW, whose updates do not depend on a constant factor except through max_grad_norm clipping "
        "and adam_eps; logged loss/value_avg is the loss before the factor. Range > 0.",
        gt=0.0)
    critic_lr: float = config_field(
        0.0, "Peak learning rate of the critic (same warmup and decay as lr). 0 = lr. Range [0, 0.1].",
        ge=0.0, le=0.1)
    adv_norm: bool = config_field(
        True, "Whiten the advantages over the step's completion tokens (zero mean, unit variance; TRL's "
        "whiten_advantages, ReaL's adv_norm).")
    value_norm: bool = config_field(
        False, "Running normalisation of the value targets (ReaL's value_norm, an exponential moving mean and "
        "variance): the critic learns normalised returns and GAE reads its de-normalised values. Kept in "
        "checkpoints.")
    value_norm_beta: float = config_field(
        0.99995, "Decay of value_norm's moving averages (ReaL's default). Range (0, 1).",
        gt=0.0, lt=1.0)


@dataclass
class PPORewardConfig(RewardConfig):
    """PPO's reward: the rule reward functions (shared with GRPO) and how the reward model's score is shaped (ReaL's
    scaling, bias and clip, the fixed truncation penalty)."""

    reward_output_scaling: float = config_field(
        1.0, "The reward model's score is multiplied by this (ReaL's reward_output_scaling).")
    reward_output_bias: float = config_field(
        0.0, "... and this is added to it (ReaL's reward_output_bias), before the reward_funcs are added.")
    max_reward_clip: float = config_field(
        0.0, "The score (reward model + reward_funcs) is clipped to +-max_reward_clip (ReaL's max_reward_clip). "
        "0 = no clip. Range >= 0.",
        ge=0.0)
    truncated_penalty: Optional[float] = config_field(
        None, "The score of a completion cut at max_completion_length without a stop token: this value instead "
        "of its reward model and reward_funcs score (the fixed penalty of ReaL; TRL's missing_eos_penalty "
        "subtracts instead). null = scored like the others.")


@dataclass
class PPOGenerationConfig(GenerationConfig):
    """Sampling of completions (the same sampler as GRPO)."""

    max_completion_length: int = config_field(
        160, "Maximum new tokens per completion; one reaching it without a stop token is 'truncated' "
        "(truncated_penalty, metric completions/clipped_ratio). Range >= 1.",
        ge=1, key_aliases=("max_new_tokens",))


@dataclass
class PPOTrainConfig(RolloutTrainConfig):
    """Training loop: length, seed, outputs, checkpoints, resume, logging, experience dumps."""

    max_steps: int = config_field(
        12, "PPO steps: each samples batch_size prompts x num_generations completions, scores them, and runs "
        "ppo_epochs x num_mini_batches actor and critic updates. Range >= 1.",
        ge=1)
    output_dir: str = config_field(
        "output/ppo", "Directory for logs, metrics, TensorBoard events, plots, completions dumps, the saved "
        "config and (by default) checkpoints. Created if missing.")


_PREAMBLE = """
Every field can be set in a YAML file passed with `--config` (grouped or flat) and on the command
line as `--<field> VALUE`; see the GRPO reference for the common syntax. `--model`, `--critic_model`,
`--reward_model`, `--ref_model`, `--train_file` and `--max_new_tokens` are other names of the fields
that carry them.

**Batch geometry.** A step samples `num_generations` completions for each of `batch_size` prompts
(`N = batch_size * num_generations`), then runs `ppo_epochs` passes over them, each cut into
`num_mini_batches` mini-batches of `N / num_mini_batches` completions: one actor update and one
critic update per mini-batch. Each of the `train_dp` ranks takes its share of a mini-batch and
accumulates gradients over micro-batches of `micro_batch_size` completions. Losses are means over the
mini-batch's completion tokens (all ranks), so an update does not depend on the number of ranks or
micro-batches.
"""


@dataclass
class PPOConfig(RolloutConfig):
    """All PPO settings, one attribute per group: ``cfg.algorithm.kl_coef``, ``cfg.reward.reward_funcs``,
    ``cfg.model.critic_model_path``."""

    REFERENCE_PREAMBLE = _PREAMBLE
    REFERENCE_FILE = STAGES["ppo"].reference
    #: LoRA: the actor and the critic each train their own adapters (the critic's score head in full); the actor
    #: samples with its adapters and, without ref_model_path, its base with the adapters off is the reference.
    LORA: ClassVar[bool] = True
    PROMPTS_FIELD = "batch_size"
    # The reward fields were in the algorithm group before the reward group existed.
    MOVED_FIELDS = {f.name: "algorithm" for f in dataclasses.fields(PPORewardConfig)}

    algorithm: PPOAlgorithmConfig = dataclasses.field(default_factory=PPOAlgorithmConfig)
    reward: PPORewardConfig = dataclasses.field(default_factory=PPORewardConfig)
    generation: PPOGenerationConfig = dataclasses.field(default_factory=PPOGenerationConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    model: PPOModelConfig = dataclasses.field(default_factory=PPOModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    train: PPOTrainConfig = dataclasses.field(default_factory=PPOTrainConfig)

    @property
    def prompts_per_step(self) -> int:
        return self.algorithm.batch_size

    @property
    def completions_per_step(self) -> int:
        return self.algorithm.batch_size * self.algorithm.num_generations

    @property
    def mini_batch_completions(self) -> int:
        """Completions per actor / critic update (global)."""
        return self.completions_per_step // self.algorithm.num_mini_batches

    @property
    def uses_reference(self) -> bool:
        """Whether the reference model is built: only for a KL penalty (kl_coef > 0)."""
        return self.algorithm.kl_coef > 0

    @property
    def critic_lr(self) -> float:
        """The critic's peak learning rate (``critic_lr``, 0 = ``lr``)."""
        return self.algorithm.critic_lr or self.optimizer.lr

    def _check_combinations(self, errors: List[str]) -> None:
        super()._check_combinations(errors)
        a, m = self.algorithm, self.model
        if not self.reward.reward_funcs and not m.reward_model_path:
            errors.append("no reward: reward_funcs is empty and reward_model_path is ''; give a reward model "
                          "(--reward_model DIR), reward functions (--reward_funcs accuracy), or both")
        if a.critic_lr and self.optimizer.min_lr > a.critic_lr:
            errors.append(f"min_lr = {self.optimizer.min_lr} > critic_lr = {a.critic_lr}; the critic's decay "
                          "would rise")
        self._check_batch_geometry(errors)

    def _mini_batch_error(self) -> Optional[str]:
        a, n = self.algorithm, self.completions_per_step
        if n % a.num_mini_batches:
            return (f"num_mini_batches = {a.num_mini_batches} does not divide the completions per step, "
                    f"batch_size*num_generations = {a.batch_size}*{a.num_generations} = {n}")
        return None

    def _mini_batch_text(self) -> str:
        return f"a mini-batch of {self.mini_batch_completions} completions (num_mini_batches = " \
               f"{self.algorithm.num_mini_batches})"


def parse_ppo_args(argv: Optional[Sequence[str]] = None) -> PPOConfig:
    """Build a ``PPOConfig`` from ``--config PATH`` and ``--<field>`` flags, validated."""
    return PPOConfig.parse_args(argv, description="PPO with a critic and a reward model for MindSpore (see "
                                "docs/config_reference_ppo.md)")

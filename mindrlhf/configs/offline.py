"""Configs of the stages that train on a fixed dataset of rows: SFT, the reward model, DPO and ORPO.

They share the groups of ``configs.common`` and two of their own: ``OfflineModelConfig`` (the model's
weights: ``--model``) and ``OfflineDataConfig`` (the jsonl files, the batch geometry, the length limit).
A stage's config adds its own fields to a subclass of either (``SFTDataConfig``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, List, Optional, Sequence

from mindrlhf.configs.base import config_field
from mindrlhf.configs.common import (
    ModelBaseConfig,
    OptimizerConfig,
    PolicyEvalTrainConfig,
    TrainingConfig,
    TrainLayoutConfig,
    TrainLoopConfig,
)
from mindrlhf.registry import PREFERENCE_LOSSES, STAGES


@dataclass
class OfflineModelConfig(ModelBaseConfig):
    """The trained model's weights and the tokenizer."""

    model_path: str = config_field(
        "", "The model to train: a Hugging Face directory (config.json + safetensors), a MindSpore checkpoint "
        "(.ckpt / .safetensors with config.json beside it, or a folder of rank_{r} shards for the train "
        "layout), a training checkpoint folder (step_N) of any mindrlhf stage, or a training run's output_dir (its "
        "newest intact checkpoint, named in the log). '' = the packaged default "
        "model (SmolLM2-135M-Instruct).",
        key_aliases=("model",))


@dataclass
class OfflineDataConfig:
    """Training and validation rows (JSONL, parquet or a datasets folder), batch geometry and the length limit."""

    train_file: str = config_field(
        "", "Training rows: a JSONL file (one JSON object per line), a .parquet file or a folder written by "
        "datasets' save_to_disk (a DatasetDict folder: pass one split's subfolder), the same row formats (see the "
        "README's data formats). '' = the packaged GSM8K sample as conversational rows (system prompt + question, "
        "the reference solution as the answer).")
    valid_file: str = config_field(
        "", "Validation rows in the same formats (JSONL, parquet or a save_to_disk folder), evaluated every "
        "eval_steps steps and at the end (eval/loss, ...). '' = no evaluation.")
    max_length: int = config_field(
        1024, "Longest row in tokens (prompt + completion + EOS); longer rows are cut at the end (the start is "
        "kept, as TRL does) and rows with no trained token left are dropped and counted. Range >= 2.",
        ge=2)
    batch_size: int = config_field(
        8, "Rows per optimizer step over all data-parallel ranks (TRL's per_device_train_batch_size x "
        "gradient_accumulation_steps x processes). Must be divisible by train_dp. Range >= 1.",
        ge=1)
    micro_batch_size: int = config_field(
        0, "Rows per forward/backward on one rank (gradient accumulation over batch_size / train_dp / "
        "micro_batch_size micro-batches; same update whatever the value: losses are normalised by the whole "
        "batch's counts). 0 = batch_size / train_dp (no accumulation). Range >= 0.",
        ge=0)
    num_epochs: int = config_field(
        0, "Passes over train_file: the run is num_epochs * (rows // batch_size) steps (a partial last batch of "
        "an epoch is dropped), or max_steps if given and smaller. 0 = max_steps alone. Range >= 0.",
        ge=0)
    micro_batch_order: str = config_field(
        "length", "The order a step's rows are cut into micro-batches in. length: longest first, so rows of "
        "like length share a micro-batch and less padding is computed (the loss is normalised by the whole "
        "step's counts, so the update is the same up to float rounding; with lora_dropout > 0 rows draw other "
        "masks). data: the order they were drawn in.",
        choices=("length", "data"))
    strict: bool = config_field(
        False, "A bad row (invalid JSON, missing or mistyped keys, nothing to train after max_length) is an "
        "error naming its file and line, instead of being skipped and counted in the log.")
    eval_steps: int = config_field(
        0, "Evaluate valid_file every N steps (and after the last). 0 = only after the last step. Range >= 0.",
        ge=0)

    def check(self, errors: List[str]) -> None:
        if self.micro_batch_size and self.micro_batch_size > self.batch_size:
            errors.append(f"micro_batch_size = {self.micro_batch_size} > batch_size = {self.batch_size}; "
                          "lower micro_batch_size")


@dataclass
class SFTDataConfig(OfflineDataConfig):
    """Training and validation rows (jsonl), batch geometry, the length limit and what is trained."""

    completion_only_loss: bool = config_field(
        True, "Train on the completion tokens only (prompt tokens masked out of the loss, as TRL does for "
        "prompt/completion rows; of a conversational completion only its assistant turns: tool messages are read, "
        "not trained, TRL's assistant_only_loss). false = every token after the first. Rows in the 'messages' "
        "format have no prompt: every token is trained.")
    packing: bool = config_field(
        False, "Pack several rows into each sequence of up to max_length tokens (best-fit decreasing, as TRL's "
        "packing_strategy='bfd'); every row keeps its own positions and attends only to itself, so the loss is "
        "unpacked training's. Fewer, fuller sequences: less padding computed. batch_size then counts packed "
        "sequences (as in TRL); validation rows are packed too.")


@dataclass
class PairDataConfig(OfflineDataConfig):
    """Preference pairs (jsonl), batch geometry (in pairs) and the length limit."""

    train_file: str = config_field(
        "", "Training pairs: ReaL's prompt/pos_answers/neg_answers or TRL's prompt/chosen/rejected rows in a JSONL "
        "file (one JSON object per line), a .parquet file or a datasets save_to_disk folder (see the README's data "
        "formats). Required: there is no packaged default "
        "(mindrlhf-data --pairs builds GSM8K pairs from a model's wrong answers).")

    max_pairs_per_prompt: int = config_field(
        0, "ReaL's pair rows (pos_answers / neg_answers lists): keep the first N pairs of each prompt. 0 = all. "
        "Range >= 0.",
        ge=0)


@dataclass
class RewardLossConfig:
    """The reward model's Bradley-Terry loss."""

    center_rewards_coefficient: float = config_field(
        0.0, "Adds coefficient * mean((r_chosen + r_rejected)^2) to the loss (Eisenstein et al. 2023; TRL's "
        "center_rewards_coefficient, suggested 0.01), pulling the rewards towards zero mean so their scale "
        "stays comparable across runs. 0 = off. Range >= 0.",
        ge=0.0)


@dataclass
class DPOModelConfig(OfflineModelConfig):
    """The policy's and the reference's weights and the tokenizer."""

    ref_model_path: str = config_field(
        "", "The reference model (same forms as model_path). '' = the initial policy (a copy of model_path's "
        "weights, as TRL does with ref_model=None); with LoRA, the policy's own base with its adapters switched off "
        "(no second copy of the weights; PEFT's disable_adapter, as TRL with a peft model).",
        key_aliases=("ref_model",))


@dataclass
class DPOLossConfig:
    """DPO's loss: type, strength, label smoothing and how the reference is run."""

    loss_type: str = config_field(
        "sigmoid", "sigmoid (DPO, Rafailov et al. 2023), ipo (Azar et al. 2023; log-probs averaged over tokens), "
        "hinge (SLiC, Zhao et al. 2023) or robust (Chowdhury et al. 2024). Formulas in docs/design.md.",
        choices=PREFERENCE_LOSSES.names())
    beta: float = config_field(
        0.1, "Strength of the implicit KL constraint to the reference (IPO's tau). Range > 0.",
        gt=0.0)
    label_smoothing: float = config_field(
        0.0, "Assumed rate of flipped preference labels in [0, 0.5): conservative DPO for sigmoid (Mitchell "
        "2023; TRL 1.16 ignores it for sigmoid), the noise rate of robust; unused by ipo and hinge.",
        ge=0.0, lt=0.5)
    precompute_ref_log_probs: bool = config_field(
        False, "Run the reference once over the training (and validation) pairs before training and release it: "
        "one model less in memory during training, one pass over the data more at the start.")


@dataclass
class ORPOLossConfig:
    """ORPO's loss: the chosen row's NLL plus lambda times the odds-ratio term."""

    beta: float = config_field(
        0.1, "lambda of ORPO (Hong et al. 2024; TRL's ORPOConfig.beta): the weight of the odds-ratio term "
        "-log sigmoid(log odds(chosen) - log odds(rejected)), from the completions' token-mean log-probs, against the "
        "NLL of the chosen row (prompt and completion tokens, as TRL). Also scales the logged rewards (beta * "
        "logps). Range > 0.",
        gt=0.0)


@dataclass
class OfflineTrainConfig(TrainLoopConfig):
    """Training loop: length, seed, outputs, checkpoints, resume, logging."""

    max_steps: int = config_field(
        20, "Optimizer steps, each on batch_size rows. With num_epochs the run ends at whichever limit comes "
        "first; when num_epochs is set and max_steps is not given, num_epochs alone sets the length. Range >= 1.",
        ge=1)
    output_dir: str = config_field(
        "output/sft", "Directory for logs, metrics, TensorBoard events, plots, the saved config and (by "
        "default) checkpoints. Created if missing.")


@dataclass
class PolicyTrainConfig(OfflineTrainConfig, PolicyEvalTrainConfig):
    """Training loop of SFT and DPO (the stages that train a policy on fixed rows): the shared loop and the GSM8K
    generation evaluation while training, off unless eval_generation."""

    eval_generation: bool = config_field(
        False, "Also evaluate the policy by generation while it trains, as GRPO/PPO's eval_steps does: every "
        "eval_steps steps and after the last (with valid_file's loss, if given), a sampler built on the trained "
        "policy (once, at the first evaluation; its compiled graphs released after each) answers eval_file's "
        "first eval_limit questions in the training prompt style (read from the first training row), greedy (or "
        "maj@k, eval_num_generations), eval_max_new_tokens new tokens. Logged as eval/accuracy, eval/format_rate, "
        "eval/mean_length, eval/truncated_rate and eval/reward/<fn> for the built-in accuracy reward and the "
        "prompt style's format reward (metrics.jsonl, TensorBoard, eval_accuracy.png): the numbers mindrlhf-eval "
        "gives for that step's checkpoint. Off by default (it adds eval_limit generations per evaluation); needs "
        "train_pp 1.")
    eval_max_new_tokens: int = config_field(
        256, "Completion length limit of eval_generation in tokens (mindrlhf-eval's --max_new_tokens). Range >= 1.",
        ge=1)


_PREAMBLE = """
Every field can be set in a YAML file passed with `--config` (grouped or flat) and on the command
line as `--<field> VALUE`; see the GRPO reference for the common syntax. `--model` is another name
of `model_path`.

**Batch geometry.** A step reads `batch_size` rows (over all data-parallel ranks): each of the
`train_dp` ranks takes `batch_size / train_dp` of them and accumulates gradients over micro-batches
of `micro_batch_size` rows (each cut into `train_micro_batches` pipeline micro-batches when
`train_pp > 1`). The loss is a mean over the whole step's trained tokens, so the update does not
depend on the number of ranks or micro-batches.
"""


_PAIR_PREAMBLE = """
Every field can be set in a YAML file passed with `--config` (grouped or flat) and on the command
line as `--<field> VALUE`; see the GRPO reference for the common syntax. `--model` is another name
of `model_path`.

**Batch geometry.** A step reads `batch_size` preference pairs over all data-parallel ranks (each
pair is two rows: prompt + chosen, prompt + rejected): each of the `train_dp` ranks takes
`batch_size / train_dp` pairs and accumulates gradients over micro-batches of `micro_batch_size`
pairs (each cut into `train_micro_batches` pipeline micro-batches when `train_pp > 1`). The loss is
a mean over the whole step's pairs, so the update does not depend on the number of ranks or
micro-batches.
"""


@dataclass
class OfflineConfig(TrainingConfig):
    """What the configs of SFT, the reward model and DPO share: the groups and the batch geometry."""

    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    model: OfflineModelConfig = dataclasses.field(default_factory=OfflineModelConfig)
    data: OfflineDataConfig = dataclasses.field(default_factory=OfflineDataConfig)
    parallel: TrainLayoutConfig = dataclasses.field(default_factory=TrainLayoutConfig)
    train: OfflineTrainConfig = dataclasses.field(default_factory=OfflineTrainConfig)

    @property
    def rows_per_rank(self) -> int:
        """Rows of a step on one data-parallel rank."""
        return self.data.batch_size // self.parallel.train_dp

    @property
    def micro_rows(self) -> int:
        """Rows per forward/backward on one rank (micro_batch_size, or the rank's whole share)."""
        return self.data.micro_batch_size or self.rows_per_rank

    def _check_combinations(self, errors: List[str]) -> None:
        super()._check_combinations(errors)
        d, p = self.data, self.parallel
        if d.batch_size % p.train_dp:
            errors.append(f"batch_size = {d.batch_size} is not divisible by train_dp = {p.train_dp}")
        elif self.rows_per_rank % self.micro_rows:
            errors.append(f"batch_size / train_dp = {self.rows_per_rank} rows per rank is not divisible by "
                          f"micro_batch_size = {self.micro_rows}")
        elif self.micro_rows % p.train_micro_batches:
            errors.append(f"micro_batch_size = {self.micro_rows} is not divisible by train_micro_batches = "
                          f"{p.train_micro_batches} (pipeline micro-batches)")
        t = self.train
        if isinstance(t, PolicyTrainConfig) and not t.eval_generation and t.eval_file:
            errors.append(f"eval_file = {t.eval_file!r} is given but eval_generation is false, so nothing would read "
                          "it; add eval_generation true (or drop eval_file)")
        if isinstance(t, PolicyTrainConfig) and t.eval_generation and p.train_pp > 1:
            errors.append(f"eval_generation with train_pp = {p.train_pp}: the evaluation samples with the trained "
                          "policy, which a pipeline stage holds only part of; use train_pp 1, or evaluate the "
                          "checkpoints with mindrlhf-eval")


@dataclass
class SFTConfig(OfflineConfig):
    """All SFT settings, one attribute per group: ``cfg.data.max_length``, ``cfg.optimizer.lr``."""

    REFERENCE_PREAMBLE = _PREAMBLE
    REFERENCE_FILE = STAGES["sft"].reference
    LORA: ClassVar[bool] = True  # lora_rank > 0 trains adapters (``trainer.entry.load_policy``)

    data: SFTDataConfig = dataclasses.field(default_factory=SFTDataConfig)
    train: PolicyTrainConfig = dataclasses.field(default_factory=PolicyTrainConfig)


@dataclass
class RMConfig(OfflineConfig):
    """All reward-model settings; ``batch_size`` and ``micro_batch_size`` count pairs."""

    REFERENCE_PREAMBLE = _PAIR_PREAMBLE
    REFERENCE_FILE = STAGES["rm"].reference
    LORA: ClassVar[bool] = True  # adapters plus the score head in full (PEFT's SEQ_CLS modules_to_save)

    data: PairDataConfig = dataclasses.field(default_factory=PairDataConfig)
    loss: RewardLossConfig = dataclasses.field(default_factory=RewardLossConfig)
    train: OfflineTrainConfig = dataclasses.field(default_factory=lambda: OfflineTrainConfig(output_dir="output/rm"))


@dataclass
class DPOConfig(OfflineConfig):
    """All DPO settings; ``batch_size`` and ``micro_batch_size`` count pairs."""

    REFERENCE_PREAMBLE = RMConfig.REFERENCE_PREAMBLE
    REFERENCE_FILE = STAGES["dpo"].reference
    LORA: ClassVar[bool] = True  # the reference without --ref_model: the policy's base, adapters switched off

    model: DPOModelConfig = dataclasses.field(default_factory=DPOModelConfig)
    data: PairDataConfig = dataclasses.field(default_factory=PairDataConfig)
    loss: DPOLossConfig = dataclasses.field(default_factory=DPOLossConfig)
    train: PolicyTrainConfig = dataclasses.field(default_factory=lambda: PolicyTrainConfig(output_dir="output/dpo"))


@dataclass
class ORPOConfig(OfflineConfig):
    """All ORPO settings; ``batch_size`` and ``micro_batch_size`` count pairs. No reference model."""

    REFERENCE_PREAMBLE = _PAIR_PREAMBLE + """
**ORPO's loss** (Hong et al. 2024, as TRL's `ORPOTrainer`): the NLL of the chosen rows (prompt and
completion tokens; a mean over the whole step's chosen-row tokens) plus `beta` times the mean over
the step's pairs of `-log sigmoid(log odds ratio)`, the odds read from each completion's token-mean
log-prob. There is no reference model: `--ref_model` is not an option of this stage.
"""
    REFERENCE_FILE = STAGES["orpo"].reference
    LORA: ClassVar[bool] = True  # no reference: the policy's adapters are all there is to wire

    data: PairDataConfig = dataclasses.field(default_factory=PairDataConfig)
    loss: ORPOLossConfig = dataclasses.field(default_factory=ORPOLossConfig)
    train: PolicyTrainConfig = dataclasses.field(default_factory=lambda: PolicyTrainConfig(output_dir="output/orpo"))


def _stage_parser(cls, title: str):
    """The ``parse_*_args`` of a stage: its config class built from ``--config PATH`` and ``--<field>`` flags,
    validated; ``title`` heads the ``--help``."""
    def parse(argv: Optional[Sequence[str]] = None):
        return cls.parse_args(argv, description=f"{title} for MindSpore (see {cls.REFERENCE_FILE})")

    parse.__doc__ = f"Build a ``{cls.__name__}`` from ``--config PATH`` and ``--<field>`` flags, validated."
    return parse


parse_sft_args = _stage_parser(SFTConfig, "Supervised fine-tuning")
parse_rm_args = _stage_parser(RMConfig, "Reward-model training")
parse_dpo_args = _stage_parser(DPOConfig, "Direct preference optimisation")
parse_orpo_args = _stage_parser(ORPOConfig, "Odds-ratio preference optimisation")

"""The GRPO configuration: one dataclass per group, YAML + command-line loading, validation.

``GRPOConfig`` holds the groups as attributes (``cfg.algorithm.beta``, ``cfg.parallel.train_tp``).
Field names are unique across groups, so YAML may be grouped (``algorithm: {beta: 0.04}``) or flat
(``beta: 0.04``) and every field is the flag ``--<name>``. ``docs/config_reference.md`` is generated
from the help text here by ``config_reference_markdown()``.

Usage::

    cfg = GRPOConfig.from_yaml("model_configs/qwen_grpo/grpo_tiny_cpu.yaml")
    cfg = parse_args(["--config", "grpo_config.yaml", "--beta", "0.04"])
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from mindrlhf.configs.base import GroupedConfig, config_field
from mindrlhf.configs.mindformers import is_model_yaml, read_model_yaml
from mindrlhf.errors import MindRLHFError
from mindrlhf.models.dtypes import DTYPE_ALIASES, DTYPES  # the one dtype table
from mindrlhf.rewards.manager import REWARD_ERRORS

KL_ESTIMATORS = ("k1", "k2", "k3")
POLICY_LOSS_TYPES = ("grpo", "gspo", "gspo-token")
#: TRL's loss_type names that are an aggregation of our token-level "grpo" loss (TRL's own "grpo" is ours).
TRL_LOSS_TYPES = {"bnpo": "token-mean", "dapo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
LOSS_TYPES = POLICY_LOSS_TYPES + tuple(TRL_LOSS_TYPES)
LOSS_AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
REWARD_SCALINGS = ("group", "batch", "none")
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
#: The registered estimator (algorithms.advantages) for advantage_estimator grpo and each scale_rewards.
_GRPO_SCALINGS = {"group": "grpo", "batch": "batch_std", "none": "dr_grpo"}
LR_SCHEDULES = ("cosine", "linear", "constant")
DEVICE_TARGETS = ("CPU", "Ascend", "GPU")


@dataclass
class AlgorithmConfig:
    """GRPO algorithm: group size, batch geometry, loss, KL, clipping, rewards, reference model."""

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
        "k3", "KL estimator per token, with d = logp_ref - logp: k1 = -d, k2 = d^2 / 2, "
        "k3 = exp(d) - d - 1 (unbiased, non-negative; the GRPO paper's). Used only when beta > 0.",
        choices=KL_ESTIMATORS)
    loss_type: str = config_field(
        "grpo", "Policy loss: grpo = per-token clipped ratio exp(logp - logp_old) (PPO-style); gspo = "
        "sequence-level ratio exp(mean_t(logp - logp_old)) clipped with the sequence advantage (GSPO; use "
        "much smaller epsilons, e.g. 3e-4 / 4e-4); gspo-token = GSPO's value with a per-token gradient. TRL's "
        "names are accepted and mean loss grpo with an aggregation: bnpo = token-mean, dapo = token-mean, dr_grpo = "
        "seq-mean-token-sum-norm (TRL's grpo is ours with the default seq-mean-token-mean); loss_agg_mode must then "
        "be left at its default or equal that aggregation. Log-ratios are clamped to +-20 before exp (verl's "
        "bound), so one off-policy outlier cannot overflow the update.",
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
    advantage_estimator: str = config_field(
        "grpo", "Advantage estimator: grpo = reward minus its group's mean, divided as scale_rewards says (group std: "
        "GRPO; batch std: LitePPO; none: Dr.GRPO); dr_grpo = grpo with no division (the same as scale_rewards none); "
        "rloo = reward minus the mean of the other rewards of its group (RLOO: G/(G-1) x (reward - group mean), no "
        "division). With dr_grpo and rloo, scale_rewards must stay group. A NaN reward (every "
        "reward function declined) gets advantage 0 and is left out of its group's statistics.",
        choices=ADVANTAGE_ESTIMATORS)
    scale_rewards: str = config_field(
        "group", "Advantage scaling: advantage = (reward - group mean) / (std + eps) with the std of the "
        "group (group, the GRPO paper) or of all the step's rewards (batch, LitePPO); none = no division "
        "(Dr.GRPO). Groups whose rewards are all equal get advantage 0.",
        choices=REWARD_SCALINGS)
    mask_truncated_completions: bool = config_field(
        False, "Exclude completions that hit max_completion_length without a stop token from the loss "
        "(DAPO's overlong filtering); they still count in the reward metrics.")
    overlong_buffer_length: int = config_field(
        0, "DAPO's soft overlong punishment: a completion longer than max_completion_length - "
        "overlong_buffer_length tokens gets an extra reward term falling linearly from 0 to -overlong_penalty at "
        "max_completion_length (logged as rewards/overlong/mean). 0 = off; DAPO used 4096 of 20480. Range "
        "[0, max_completion_length).",
        ge=0)
    overlong_penalty: float = config_field(
        1.0, "Largest overlong punishment (the term's value at max_completion_length). Range >= 0.",
        ge=0.0)
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
        choices=IS_MODES)
    importance_sampling_cap: float = config_field(
        3.0, "The cap C of importance_sampling_mode (TRL's vllm_importance_sampling_clip_max). Range >= 1.",
        ge=1.0)
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
    reward_funcs: List[str] = config_field(
        ["accuracy", "gsm8k_format"], "Reward functions, by registry name (accuracy: the GSM8K answer matches; "
        "gsm8k_format: the answer ends with its only '#### <number>' line, the default prompt style's format; format: "
        "<think>...</think><answer>...</answer>, the 'tags' prompt style's; boxed: a \\boxed{} answer matches) or by "
        "dotted path 'package.module:function' for user functions. The step reward is their weighted sum "
        "(reward_weights); each is logged as rewards/<name>/mean. Names must be unique. Use the format reward of "
        "the prompt style the data was built with (rlhf_data.py --prompt_style).")
    reward_weights: Optional[List[float]] = config_field(
        None, "Weight of each reward function, in reward_funcs order; null = 1.0 for all. Length must equal "
        "len(reward_funcs). Negative weights turn a reward into a penalty.")
    reward_errors: str = config_field(
        "raise", "What a reward function that raises does: raise = stop the run with one error naming the function "
        "and its exception; skip = score that call's completions None (they get no advantage) and train on, counting "
        "failed calls per function (metric rewards/<name>/failures). Reward functions are called as TRL calls them: "
        "fn(prompts=, completions=, completion_ids=, solution=, question=), all by keyword.",
        choices=REWARD_ERRORS)


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
    use_vllm: bool = config_field(
        False, "Generate with the optional vLLM-MindSpore backend (Ascend only; needs the vllm_mindspore "
        "package) instead of the built-in KV-cache sampler. Not wired in yet: the job refuses true (MindRLHF's "
        "--use_vllm 1), and on CPU it does not apply at all.")


@dataclass
class OptimizerConfig:
    """AdamW, learning-rate schedule, gradient clipping and non-finite guards."""

    lr: float = config_field(
        2e-5, "Peak learning rate of AdamW (reached after warmup_steps). Range > 0. The default suits the "
        "embedded 135M model's short CPU run (the README's results use it); use ~1e-6 for 0.5-1.5B models and "
        "~5e-7 for 7B. At most 0.1: Adam moves every weight by about lr per update, so larger values destroy "
        "any model (1e6 took |w| ~ 0.1 to 2e6 in one step, all finite). MindRLHF's name: start_lr (the "
        "decay's start).",
        gt=0.0, le=0.1, key_aliases=("start_lr",))
    min_lr: float = config_field(
        0.0, "Learning rate at the end of the cosine / linear decay (at the run's last step: max_steps, or "
        "grpo_epochs' end). Range [0, lr]. Unused with lr_schedule constant. MindRLHF's name: end_lr.",
        ge=0.0, key_aliases=("end_lr",))
    warmup_steps: int = config_field(
        0, "Training steps of linear warmup from ~0 to lr. Range [0, max_steps]. The schedule advances once per "
        "training step (all optimizer updates of a step use the same lr).",
        ge=0)
    lr_schedule: str = config_field(
        "cosine", "Learning rate after warmup: cosine or linear decay from lr to min_lr at max_steps, or "
        "constant lr.",
        choices=LR_SCHEDULES)
    weight_decay: float = config_field(
        0.0, "AdamW decoupled weight decay on weight matrices (not on biases, norms): each update scales them by "
        "1 - lr * weight_decay. Range [0, 1].",
        ge=0.0, le=1.0)
    adam_beta1: float = config_field(
        0.9, "AdamW first-moment decay. Range [0, 1).",
        ge=0.0, lt=1.0)
    adam_beta2: float = config_field(
        0.999, "AdamW second-moment decay. Range [0, 1). Large-model recipes often use 0.95.",
        ge=0.0, lt=1.0)
    adam_eps: float = config_field(
        1e-8, "AdamW epsilon added to the denominator. Range (0, 1e-2]: larger turns Adam into plain SGD with "
        "a tiny step.",
        gt=0.0, le=1e-2)
    max_grad_norm: float = config_field(
        1.0, "Clip the global gradient norm (over all ranks and parameters) to this value before each update; "
        "0 disables clipping. Range >= 0. The pre-clip norm is logged as grad_norm.",
        ge=0.0)
    max_consecutive_nonfinite: int = config_field(
        3, "An update whose loss or gradients contain NaN/inf is skipped (weights and optimizer state "
        "unchanged, logged); after this many consecutive skipped updates training stops with an error. "
        "Range >= 1. Under float16, an overflow skipped while the loss scale is above 1 does not count.",
        ge=1)
    loss_scale_init: float = config_field(
        65536.0, "float16 only: initial dynamic loss scale. The loss is multiplied by it before the backward "
        "pass (so small float16 gradients do not underflow) and the gradients divided by it in float32. An "
        "update whose gradients overflow is skipped and the scale halves (down to 1); after loss_scale_window "
        "finite updates in a row it doubles. Logged as loss_scale. Range >= 1.",
        ge=1.0)
    loss_scale_window: int = config_field(
        1000, "float16 only: finite updates in a row after which the loss scale doubles. Range >= 1.",
        ge=1)


@dataclass
class ModelConfig:
    """Weights and tokenizer of the policy, generator and reference models."""

    sft_path_train: str = config_field(
        "", "Policy (trained model) weights: a Hugging Face directory (config.json + safetensors) or a "
        "MindSpore checkpoint (full, or a folder of rank_{r} shards for the train layout). '' = the "
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
    vocab_path: str = config_field(
        "", "Tokenizer vocab.json (the seed's flag; give merges_file_path with it). '' = use tokenizer_dir.")
    merges_file_path: str = config_field(
        "", "Tokenizer merges.txt, paired with vocab_path. '' = use tokenizer_dir.")
    tokenizer_dir: str = config_field(
        "", "Directory with tokenizer.json or vocab.json + merges.txt, and tokenizer_config.json (chat "
        "template). Alternative to vocab_path / merges_file_path. '' = the directory of sft_path_train "
        "(or the packaged default model's tokenizer).")
    dtype: str = config_field(
        "float32", "Compute dtype of all models (bf16 / fp16 / fp32 accepted as aliases): the policy's forward "
        "and backward, the generator and the reference run in it and hold only copies in it. The policy's "
        "master weights and both Adam moments are always float32 (checkpoints store them); gradients are "
        "accumulated, reduced and clipped in float32; log-probs and the loss are computed in float32. float16 "
        "adds dynamic loss scaling (loss_scale_init). bfloat16 needs Ascend; float16 and float32 run on CPU.",
        choices=DTYPES, aliases=DTYPE_ALIASES)


@dataclass
class DataConfig:
    """Training prompts."""

    mind_dataset_dir: str = config_field(
        "", "The tokenised prompt dataset: the .mindrecord file written by rlhf_data.py (the seed's flag name). "
        "'' = the packaged GSM8K sample.")


@dataclass
class ParallelConfig:
    """Device and parallel layouts of training (policy, reference) and generation."""

    use_parallel: bool = config_field(
        False, "Run as one of several processes started by msrun (communication initialised). Required for "
        "any layout size > 1; a single process with use_parallel false uses one device.")
    train_dp: int = config_field(
        1, "Training data parallel: replicas of the policy, each processing mini_batch_size / train_dp "
        "completions per update (gradients all-reduced). Range >= 1.",
        ge=1)
    train_tp: int = config_field(
        1, "Training tensor parallel: attention heads and MLP columns split over this many devices "
        "(must divide the number of KV heads). Range >= 1.",
        ge=1)
    train_pp: int = config_field(
        1, "Training pipeline parallel: the layers split into this many stages. Range >= 1.",
        ge=1)
    train_micro_batches: int = config_field(
        1, "Pipeline micro-batches: each rank's micro-batch (micro_batch_size) is cut into this many pieces "
        "that flow through the train_pp stages; >= train_pp keeps the pipeline busy. Must be 1 when "
        "train_pp is 1.",
        ge=1)
    infer_dp: int = config_field(
        1, "Generation data parallel: generator replicas, each sampling chunk_size / infer_dp prompts. "
        "Range >= 1.",
        ge=1)
    infer_tp: int = config_field(
        1, "Generation tensor parallel. infer_dp * infer_tp must equal the training world size "
        "train_dp * train_tp * train_pp (the same processes train and generate). Range >= 1.",
        ge=1)
    device_target: str = config_field(
        "CPU", "Device for all models: CPU, Ascend (NPU, production) or GPU. The entry point sets it; "
        "library code never does.",
        choices=DEVICE_TARGETS)
    collective_timeout: int = config_field(
        600, "Seconds a collective (gradient all-reduce, gathering rollouts, ...) waits for the other workers "
        "before it fails. When a worker dies or hangs, every other worker then stops with one error line "
        "(exit code 3) instead of waiting forever, and msrun returns non-zero; rerun with --resume. Sets "
        "MS_CPU_COMM_OP_TIMEOUT (CPU) or HCCL_EXEC_TIMEOUT (Ascend) unless the environment already does; "
        "GPU (NCCL) has no such bound. Raise it if one worker can legitimately lag the others this long "
        "(compiling a large model, or rank 0 writing a large checkpoint while the others wait). Range 1..86400.",
        ge=1, le=86400)
    enable_compile_cache: bool = config_field(
        False, "Cache compiled graphs on disk (MindSpore compile cache, under output_dir) so a restart "
        "skips compilation.")
    jit: bool = config_field(
        True, "Compile the decode step and the reference model's forward pass with mindspore.jit (decoding is "
        "dominated by per-kernel overhead, which jit removes); false = pynative, for debugging.")
    train_jit: bool = config_field(
        False, "Compile the training forward+backward with mindspore.jit. About 2x faster on CPU, but a "
        "compiled CPU graph keeps all of its intermediate tensors allocated: for one SmolLM2-135M micro-batch "
        "of 4 packed completions, 9.6 GiB peak vs 4.3 GiB in pynative, so the default is pynative.")
    layer_graphs: bool = config_field(
        True, "With train_jit false, run the policy's decoder layers in training and in its log-prob passes "
        "as two compiled graphs (forward; recomputed forward + backward) that every layer shares, loading its "
        "weights before each call. Same gradients; on the SmolLM2-135M benchmark step the update took 29.7 s "
        "instead of 33.8 and peak RSS fell from 6.0 to 4.45 GiB (only each layer's input is kept for the "
        "backward). false = pynative layers.")
    share_prompts: bool = config_field(
        True, "Encode each prompt once for all completions that share it: the sampler prefills each distinct "
        "prompt once and copies its KV cache to its num_generations rows, and the policy / reference / "
        "old-policy passes pack a micro-batch's completions of one prompt into one row behind a single copy "
        "of the prompt (Prefix Grouper's idea; same log-probs, loss and gradients up to float rounding). "
        "Training under pipeline parallelism (train_pp > 1) uses padded rows. false = every row carries "
        "its own prompt.")


@dataclass
class TrainConfig:
    """Training loop: length, seed, outputs, checkpoints, resume, logging, experience dumps."""

    max_steps: int = config_field(
        12, "Training steps (the default run: ~70 s each for SmolLM2-135M on 2 CPU cores, ~15 min in all). One "
        "step = num_rollouts generation calls of chunk_size prompts, scoring, then num_iterations passes of "
        "optimizer updates. Range >= 1. With grpo_epochs the run ends at whichever limit comes first; when "
        "grpo_epochs is set and max_steps is not given, grpo_epochs alone sets the length.",
        ge=1)
    grpo_epochs: int = config_field(
        0, "Passes over the prompt dataset (MindRLHF's grpo_epochs): the run is grpo_epochs * (dataset batches per "
        "epoch // num_rollouts) steps, a batch being chunk_size prompts (a partial batch at an epoch's end is "
        "dropped), or max_steps if given and smaller. The learning-rate decay spans that many steps, and a "
        "resumed run computes the same length from the same data. With dynamic_sampling a step may read more "
        "batches, so an epoch then counts steps, not prompts. 0 = max_steps alone. Range >= 0.",
        ge=0)
    seed: int = config_field(
        42, "Seed for data order, initialisation and sampling; same seed and config = same run "
        "(resume restores the random state). Range >= 0.",
        ge=0)
    output_dir: str = config_field(
        "output/grpo", "Directory for logs, metrics, TensorBoard events, completions dumps, the saved "
        "config and (by default) checkpoints. Created if missing.")
    save_ckpt_dir: str = config_field(
        "", "Checkpoint directory (one sub-directory per saved step, written atomically). "
        "'' = output_dir/checkpoints.")
    save_steps: int = config_field(
        10, "Save a checkpoint (policy, optimizer, reference if synced, data position, RNG) every N steps; "
        "the last step is always saved. 0 = only the last step. Range >= 0.",
        ge=0)
    keep_last: int = config_field(
        3, "Keep the newest N checkpoints of this run and delete its older ones (another run's checkpoints in a "
        "shared save_ckpt_dir are never deleted). 0 = keep all. Range >= 0.",
        ge=0)
    overwrite_output_dir: bool = config_field(
        False, "Start a fresh run in an output_dir / save_ckpt_dir that holds another run's checkpoints or "
        "metrics.jsonl, replacing it: once the new run's model, data and rewards have loaded, the old run's "
        "checkpoints, metrics, TensorBoard events, completion dumps, config and plots are deleted (named in the "
        "log). Without it (and without resume) such a start is refused, so a run is never overwritten, nor later "
        "resumed from another run's checkpoint, by mistake.")
    resume: str = config_field(
        "", "Resume training: '' = start fresh; 'latest' (or 'auto') = the newest intact checkpoint in the "
        "checkpoint directory (refused when it holds several runs; a fresh start when there is no checkpoint "
        "and output_dir has no metrics, refused when it has); or a checkpoint folder (step_N). Refused when the "
        "checkpoint is past max_steps, or when save_ckpt_dir / output_dir hold another run's history. A bare "
        "--resume means 'latest'.",
        aliases={"auto": "latest"}, cli_const="latest")
    logging_steps: int = config_field(
        1, "Log metrics (reward, kl, clip_ratio, lengths, step_time, ...) every N steps. Range >= 1.",
        ge=1)
    log_completions_steps: int = config_field(
        10, "Write output_dir/completions_step_N.jsonl (prompt, completion, rewards, advantage) every N "
        "steps. 0 = never. Range >= 0.",
        ge=0)
    tensorboard: bool = config_field(
        True, "Also write metrics as TensorBoard event files under output_dir/tensorboard.")
    save_data_file: str = config_field(
        "", "Dump every step's experience (prompt and completion ids, masks, sampler log-probs, rewards per "
        "function, advantages) as .npz files, one per step: <path without .npz>.step<N>.npz. For debugging "
        "and replay_data_file. '' = off.")
    replay_data_file: str = config_field(
        "", "Replay rollouts from a save_data_file dump (the same path given there) instead of generating "
        "(debugging; the 1-vs-N-worker parity test). The dump must come from the same batch geometry "
        "(chunk_size, num_rollouts, num_generations). '' = off.")
    progress_bar: bool = config_field(
        True, "Show a tqdm progress bar over training steps (rank 0 only).")


_PREAMBLE = """
Every field can be set in a YAML file passed with `--config`, grouped (`algorithm: {beta: 0.04}`)
or flat (`beta: 0.04`), and on the command line as `--<field> VALUE` (command-line flags override
the YAML). Lists are space-separated on the command line (`--reward_funcs accuracy format`); bools
take `true`/`false`, `True`/`False`, `1`/`0` or a bare flag (`--use_parallel`). Unknown keys are errors.
A field's **Alias** (MindRLHF's `grpo_configs.py` names: `start_lr`, `end_lr`, `batch_size`) is
another key for it, in YAML and as a flag; a name and its alias with different values are an error.
The `bool | str` fields (`load_sft_checkpoint_train`, ...) take true/false or a checkpoint path.

**Batch geometry.** One training step reads `chunk_size * num_rollouts` prompts and samples
`num_generations` completions for each: `N = chunk_size * num_rollouts * num_generations`
completions. Generation: each of the `infer_dp` generator replicas samples `chunk_size / infer_dp`
prompts per call. Training: the `N` completions are cut into `N / mini_batch_size` mini-batches (one
optimizer update each), repeated `num_iterations` times; each of the `train_dp` ranks takes
`mini_batch_size / train_dp` completions of a mini-batch and accumulates gradients over micro-batches
of `micro_batch_size`, each cut into `train_micro_batches` pipeline micro-batches when `train_pp > 1`.
"""


@dataclass
class GRPOConfig(GroupedConfig):
    """All GRPO settings, one attribute per group: ``cfg.algorithm.beta``, ``cfg.train.max_steps``."""

    REFERENCE_PREAMBLE = _PREAMBLE

    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
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
    def prompts_per_infer_rank(self) -> int:
        """Prompts each generator replica samples per generation call."""
        return self.algorithm.chunk_size // self.parallel.infer_dp

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
    def micro_batch_completions(self) -> int:
        """Completions per forward/backward on one train rank; ``micro_batch_size`` with 0 resolved."""
        return self.algorithm.micro_batch_size or self.mini_batch_completions // self.parallel.train_dp

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer update on one train rank."""
        return self.mini_batch_completions // self.parallel.train_dp // self.micro_batch_completions

    @property
    def world_size(self) -> int:
        """Processes (devices): train_dp * train_tp * train_pp == infer_dp * infer_tp."""
        p = self.parallel
        return p.train_dp * p.train_tp * p.train_pp

    @property
    def needs_old_logprobs(self) -> bool:
        """True when updates are off-policy (several updates per step), so logp_old must be computed."""
        return self.optimizer_steps_per_step > 1

    @property
    def checkpoint_dir(self) -> str:
        """``save_ckpt_dir`` with '' resolved to ``output_dir/checkpoints``."""
        return self.train.save_ckpt_dir or os.path.join(self.train.output_dir, "checkpoints")

    # ---------------------------------------------------------------- cross-field rules
    @property
    def policy_loss(self) -> Tuple[str, str]:
        """(policy loss, loss aggregation) the run uses: TRL's loss_type names resolved (TRL_LOSS_TYPES)."""
        a = self.algorithm
        if a.loss_type in TRL_LOSS_TYPES:
            return "grpo", TRL_LOSS_TYPES[a.loss_type]
        return a.loss_type, a.loss_agg_mode

    @property
    def advantage_estimator(self) -> str:
        """The registered advantage estimator (``algorithms.get_advantage_estimator``) the run uses."""
        a = self.algorithm
        return _GRPO_SCALINGS[a.scale_rewards] if a.advantage_estimator == "grpo" else a.advantage_estimator

    # ---------------------------------------------------------------- weights and MindFormers model YAMLs
    def _weight_fields(self, role: str) -> Tuple[str, "bool | str"]:
        """(path field, load field) values of ``role``: train, infer or ref."""
        m = self.model
        return {"train": (m.sft_path_train, m.load_sft_checkpoint_train),
                "infer": (m.sft_path_infer, m.load_sft_checkpoint_infer),
                "ref": (m.ref_path, m.load_ref_checkpoint)}[role]

    def model_weights(self, role: str) -> str:
        """The checkpoint to load for ``role`` (train / infer / ref), or '' when there is none to load:
        the ``load_*`` path if one is given, else the role's path field unless it is a model YAML or
        loading is off. ('' for train = the packaged default model; for infer / ref = from the policy.)"""
        path, load = self._weight_fields(role)
        if isinstance(load, str):
            return load
        return path if load and not is_model_yaml(path) else ""

    def model_yaml(self, role: str) -> str:
        """The MindFormers model YAML given as ``sft_path_train`` / ``sft_path_infer``, or ''."""
        path = self._weight_fields(role)[0]
        return path if is_model_yaml(path) else ""

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

    def _check_weights(self, errors: List[str]) -> None:
        """A load_* path and a different weights path for the same model, or a model YAML with nothing to load."""
        m = self.model
        for role in ("train", "infer", "ref"):
            path, load = self._weight_fields(role)
            path_field = "ref_path" if role == "ref" else f"sft_path_{role}"
            load_field = "load_ref_checkpoint" if role == "ref" else f"load_sft_checkpoint_{role}"
            if isinstance(load, str) and path and not is_model_yaml(path) and path != load:
                errors.append(f"{load_field} = {load!r} and {path_field} = {path!r} name two different checkpoints; "
                              f"give the weights once ({path_field} may be a MindFormers model YAML instead)")
            if role == "ref" and is_model_yaml(path):
                errors.append(f"ref_path = {path!r} is a model YAML; ref_path names weights (the reference uses the "
                              "train layout): give a checkpoint, or use load_ref_checkpoint PATH")
        if self.model_yaml("train") and m.load_sft_checkpoint_train is True:
            errors.append(f"sft_path_train = {m.sft_path_train!r} is a model YAML, which holds no weights; give the "
                          "checkpoint with load_sft_checkpoint_train PATH")
        if self.model_yaml("train") and m.load_sft_checkpoint_train is False:
            errors.append(f"sft_path_train = {m.sft_path_train!r} (a model YAML) with load_sft_checkpoint_train = "
                          "false: the architecture is read from a checkpoint here; give it with "
                          "load_sft_checkpoint_train PATH")

    def _check_combinations(self, errors: List[str]) -> None:
        a, g, o, m, p, t = self.algorithm, self.generation, self.optimizer, self.model, self.parallel, self.train
        self._check_weights(errors)
        if a.overlong_buffer_length >= g.max_completion_length:
            errors.append(f"overlong_buffer_length = {a.overlong_buffer_length} must be below max_completion_length = "
                          f"{g.max_completion_length} (the punishment starts that many tokens before the limit)")
        if a.overlong_buffer_length and "overlong" in a.reward_funcs:
            errors.append("reward_funcs names a function 'overlong', the name of the overlong_buffer_length term; "
                          "rename it")
        if a.advantage_estimator != "grpo" and a.scale_rewards != "group":
            errors.append(f"scale_rewards = {a.scale_rewards!r} applies to advantage_estimator grpo only, not "
                          f"{a.advantage_estimator!r}; leave scale_rewards at group")

        # TRL loss names carry their aggregation; a different explicit one is a contradiction.
        default_agg = AlgorithmConfig.__dataclass_fields__["loss_agg_mode"].default
        if a.loss_type in TRL_LOSS_TYPES and a.loss_agg_mode not in (default_agg, TRL_LOSS_TYPES[a.loss_type]):
            errors.append(f"loss_type = {a.loss_type!r} (TRL's name) means loss_agg_mode = "
                          f"{TRL_LOSS_TYPES[a.loss_type]!r}, but loss_agg_mode = {a.loss_agg_mode!r}; drop one of them")

        # Rewards.
        if not a.reward_funcs:
            errors.append("reward_funcs is empty; give at least one reward function (e.g. accuracy)")
        duplicates = sorted({f for f in a.reward_funcs if a.reward_funcs.count(f) > 1})
        if duplicates:
            errors.append(f"reward_funcs lists {duplicates} more than once; each function once (use reward_weights)")
        if a.reward_weights is not None and len(a.reward_weights) != len(a.reward_funcs):
            errors.append(f"reward_weights has {len(a.reward_weights)} values {a.reward_weights} but reward_funcs has "
                          f"{len(a.reward_funcs)} {a.reward_funcs}; give one weight per function or null")

        # Reference model.
        if a.sync_ref_model and a.beta == 0:
            errors.append("sync_ref_model = true with beta = 0: the reference model is never used; "
                          "set beta > 0 or sync_ref_model false")
        if a.beta > 0 and not m.load_ref_checkpoint and not m.load_sft_checkpoint_train:
            errors.append(f"beta = {a.beta} with load_ref_checkpoint = false and load_sft_checkpoint_train = false: "
                          "the reference would be a random model; load a checkpoint or set beta 0")
        if m.ref_path and not m.load_ref_checkpoint:
            errors.append(f"ref_path = {m.ref_path!r} is ignored with load_ref_checkpoint = false; "
                          "set load_ref_checkpoint true or ref_path ''")
        if m.sft_path_infer and not m.load_sft_checkpoint_infer and not self.model_yaml("infer"):
            errors.append(f"sft_path_infer = {m.sft_path_infer!r} is ignored with load_sft_checkpoint_infer = false; "
                          "set load_sft_checkpoint_infer true or sft_path_infer ''")

        # Tokenizer.
        if bool(m.vocab_path) != bool(m.merges_file_path):
            errors.append(f"vocab_path = {m.vocab_path!r} and merges_file_path = {m.merges_file_path!r}: "
                          "give both or neither")
        if m.vocab_path and m.tokenizer_dir:
            errors.append(f"both vocab_path ({m.vocab_path!r}) and tokenizer_dir ({m.tokenizer_dir!r}) are set; "
                          "give one tokenizer source")

        # Generation.
        if g.min_new_tokens > g.max_completion_length:
            errors.append(f"min_new_tokens = {g.min_new_tokens} > max_completion_length = "
                          f"{g.max_completion_length}; lower min_new_tokens")
        if g.use_vllm and importlib.util.find_spec("vllm_mindspore") is None:
            errors.append("use_vllm = true but the vllm_mindspore package is not installed (it runs on Ascend "
                          "only); install vllm-mindspore or set use_vllm false for the built-in sampler")
        elif g.use_vllm and p.device_target != "Ascend":
            errors.append(f"use_vllm = true needs device_target Ascend (got {p.device_target!r}); "
                          "set use_vllm false for the built-in sampler")

        # Optimizer / schedule.
        if o.min_lr > o.lr:
            errors.append(f"min_lr = {o.min_lr} > lr = {o.lr}; min_lr must be <= lr")
        if o.warmup_steps > t.max_steps and not (t.grpo_epochs and "max_steps" not in self.explicitly_set()):
            errors.append(f"warmup_steps = {o.warmup_steps} > max_steps = {t.max_steps}; "
                          "the learning rate would never reach lr")

        # Outputs.
        if not t.output_dir:
            errors.append("output_dir is empty; give a directory for logs and checkpoints")
        if t.save_data_file and t.save_data_file == t.replay_data_file:
            errors.append(f"save_data_file and replay_data_file are both {t.save_data_file!r}: the dump would "
                          "overwrite its own input; give save_data_file another path")

        # Parallel layout.
        sizes = {"train_dp": p.train_dp, "train_tp": p.train_tp, "train_pp": p.train_pp,
                 "train_micro_batches": p.train_micro_batches, "infer_dp": p.infer_dp, "infer_tp": p.infer_tp}
        if not p.use_parallel:
            above_one = [f"{k} = {v}" for k, v in sizes.items() if v > 1]
            if above_one:
                errors.append(f"use_parallel = false but {', '.join(above_one)}; set use_parallel true "
                              "(and launch with msrun) or set them to 1")
        if p.train_micro_batches > 1 and p.train_pp == 1:
            errors.append(f"train_micro_batches = {p.train_micro_batches} with train_pp = 1: pipeline "
                          "micro-batches need train_pp > 1; use micro_batch_size for gradient accumulation")
        infer_world = p.infer_dp * p.infer_tp
        if self.world_size != infer_world:
            errors.append(f"train world size train_dp*train_tp*train_pp = {p.train_dp}*{p.train_tp}*{p.train_pp} = "
                          f"{self.world_size} != infer world size infer_dp*infer_tp = {p.infer_dp}*{p.infer_tp} = "
                          f"{infer_world}; the same processes train and generate")

        # Batch geometry.
        if a.chunk_size % p.infer_dp:
            errors.append(f"chunk_size = {a.chunk_size} is not divisible by infer_dp = {p.infer_dp} "
                          "(each generator replica samples chunk_size / infer_dp prompts)")
        n = self.completions_per_step
        mini = self.mini_batch_completions
        geometry = (f"chunk_size*num_rollouts*num_generations = {a.chunk_size}*{a.num_rollouts}*"
                    f"{a.num_generations} = {n}")
        if n % mini:
            errors.append(f"mini_batch_size = {mini} does not divide the completions per step, {geometry}")
            return
        if mini % p.train_dp:
            errors.append(f"mini_batch_size = {mini}{' (= all completions)' if not a.mini_batch_size else ''} "
                          f"is not divisible by train_dp = {p.train_dp} (completions per rank)")
            return
        per_rank = mini // p.train_dp
        micro = self.micro_batch_completions
        if per_rank % micro:
            errors.append(f"micro_batch_size = {micro} does not divide the completions per rank per mini-batch, "
                          f"mini_batch_size / train_dp = {mini} / {p.train_dp} = {per_rank}")
            return
        if micro % p.train_micro_batches:
            errors.append(f"micro_batch_size = {micro} is not divisible by train_micro_batches = "
                          f"{p.train_micro_batches} (pipeline micro-batches)")



def parse_args(argv: Optional[Sequence[str]] = None) -> GRPOConfig:
    """Build a ``GRPOConfig`` from ``--config PATH`` and ``--<field>`` flags, validated."""
    return GRPOConfig.parse_args(argv, description="GRPO training for MindSpore (see docs/config_reference.md)")


def config_reference_markdown() -> str:
    """The text of ``docs/config_reference.md`` (one table per group)."""
    return GRPOConfig.reference_markdown("GRPO configuration reference")

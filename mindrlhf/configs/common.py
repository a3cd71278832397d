"""Config groups every training stage shares: the optimizer and its schedule, the model's dtype and
tokenizer, the train layout and the training loop; and the rule rewards of the stages that sample (GRPO, PPO:
``RewardConfig``, their ``reward`` group). A stage's config (``GRPOConfig``; SFT, DPO, ...)
holds these groups, extends them with its own fields (``ParallelConfig(TrainLayoutConfig)`` adds the
generator's layout) and adds its own groups. Each group checks its own rules (``check``);
``TrainingConfig`` checks the rules between them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, List, Optional

from mindrlhf.configs.base import GroupedConfig, config_field
from mindrlhf.models.dtypes import DTYPE_ALIASES, DTYPES  # the one dtype table
from mindrlhf.models.family import PROJECTIONS  # LoRA's default targets
from mindrlhf.rewards.manager import REWARD_ERRORS, reward_spec_name

LR_SCHEDULES = ("cosine", "linear", "constant")
DEVICE_TARGETS = ("CPU", "Ascend", "GPU")
#: ``recompute`` values (``trainer.memory`` acts on them).
RECOMPUTE_MODES = ("auto", "full", "selective", "none")
LAYER_GRAPH_SHAPES = ("auto", "static", "dynamic")


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

    def check(self, errors: List[str]) -> None:
        if self.min_lr > self.lr:
            errors.append(f"min_lr = {self.min_lr} > lr = {self.lr}; min_lr must be <= lr")


@dataclass
class ModelBaseConfig:
    """The models' compute dtype and the tokenizer (a stage adds its weights' paths)."""

    vocab_path: str = config_field(
        "", "Tokenizer vocab.json (the seed's flag; give merges_file_path with it). '' = use tokenizer_dir.")
    merges_file_path: str = config_field(
        "", "Tokenizer merges.txt, paired with vocab_path. '' = use tokenizer_dir.")
    tokenizer_dir: str = config_field(
        "", "Directory with tokenizer.json or vocab.json + merges.txt, and tokenizer_config.json (chat "
        "template). Alternative to vocab_path / merges_file_path. '' = the trained model's directory "
        "(sft_path_train, or model_path for SFT/RM/DPO; the packaged default model's tokenizer by default).")
    dtype: str = config_field(
        "float32", "Compute dtype of all models (bf16 / fp16 / fp32 accepted as aliases): the policy's forward "
        "and backward, the generator and the reference run in it and hold only copies in it. The policy's "
        "master weights and both Adam moments are always float32 (checkpoints store them); gradients are "
        "accumulated, reduced and clipped in float32; log-probs and the loss are computed in float32. float16 "
        "adds dynamic loss scaling (loss_scale_init). bfloat16 needs Ascend; float16 and float32 run on CPU.",
        choices=DTYPES, aliases=DTYPE_ALIASES)
    lora_rank: int = config_field(
        0, "LoRA (Hu et al. 2021, PEFT's r): train rank-r adapters on the frozen trained model instead of all its "
        "weights. 0 = full fine-tune. The base then keeps no float32 master, gradient or Adam state (only the "
        "adapters do), checkpoints hold the adapters and the base's identity, and the run ends with a PEFT "
        "adapter folder output_dir/adapter (peft's PeftModel.from_pretrained loads it). Range >= 0. Every "
        "stage trains it (PPO: the actor and the critic, each with its own adapters).",
        ge=0)
    lora_alpha: float = config_field(
        8.0, "LoRA scaling numerator (PEFT's lora_alpha): an adapter adds (lora_alpha / lora_rank) * B A x. Range > 0.",
        gt=0.0)
    lora_dropout: float = config_field(
        0.0, "Dropout on an adapter's input (PEFT's lora_dropout: delta = scaling * B A dropout(x), a mask per "
        "adapted projection, kept inputs scaled by 1 / (1 - p)), active in the gradient passes only (sampling, "
        "log-prob, reference and eval passes see none). The mask is a hash of (seed, step, micro-batch, module, "
        "element), so a recomputed forward draws the same mask and --resume is exact; it depends on how rows "
        "fall into micro-batches and dp replicas, so layouts give the same update at 0 only. Range [0, 1).",
        ge=0.0, lt=1.0)
    lora_target_modules: List[str] = config_field(
        list(PROJECTIONS), "The decoder projections that get adapters, in PEFT's meaning: module names (a "
        "module matches when its name is one or ends with '.<one>', e.g. q_proj v_proj), all-linear (every "
        "projection), or one regex matched against whole module names such as model.layers.0.self_attn.q_proj. "
        "Default: every attention and MLP projection.")
    lora_init_from: str = config_field(
        "", "A PEFT adapter folder (adapter_config.json + adapter_model.safetensors, peft's save_pretrained or a "
        "mindrlhf run's output_dir/adapter) to start the adapters from; its adapter_config.json sets the rank, "
        "alpha, dropout and targets (lora_rank, if given, must equal its r). '' = PEFT's init (A random, B zero).")

    @property
    def lora(self) -> bool:
        """Whether the trained model gets LoRA adapters (``lora_rank`` > 0 or ``lora_init_from``)."""
        return self.lora_rank > 0 or bool(self.lora_init_from)

    def check(self, errors: List[str]) -> None:
        if not self.lora_target_modules:
            errors.append("lora_target_modules is empty; name projections (e.g. q_proj v_proj) or give a regex")
        if bool(self.vocab_path) != bool(self.merges_file_path):
            errors.append(f"vocab_path = {self.vocab_path!r} and merges_file_path = {self.merges_file_path!r}: "
                          "give both or neither")
        if self.vocab_path and self.tokenizer_dir:
            errors.append(f"both vocab_path ({self.vocab_path!r}) and tokenizer_dir ({self.tokenizer_dir!r}) are set; "
                          "give one tokenizer source")


@dataclass
class TrainLayoutConfig:
    """Device and the parallel layout of training (a stage with a generator adds its layout)."""

    use_parallel: bool = config_field(
        False, "Run as one of several processes started by msrun (communication initialised). Required for "
        "any layout size > 1; a single process with use_parallel false uses one device.")
    train_dp: int = config_field(
        1, "Training data parallel: replicas of the trained model, each processing its share of every update's "
        "batch (GRPO: mini_batch_size / train_dp completions; SFT/RM/DPO: batch_size / train_dp rows or pairs); "
        "gradients all-reduced. Range >= 1.",
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
    recompute: str = config_field(
        "auto", "How the training backward gets each layer's activations. auto: full when the layer graphs are "
        "static-shape (layer_graph_shapes, CPU's default) and the largest micro-batch's decoder forward is at "
        "least 20 GFLOP (as fast there, far less memory); otherwise none when its estimated activations fit "
        "memory_budget_gb, else full; the decision and its figures are logged once. full: the decoder layers "
        "run as two shared compiled graphs and each layer's forward is recomputed in its backward (only layer "
        "inputs are kept; least memory). selective: the same layer graphs, each layer's forward also keeping its "
        "linear layers' outputs, so the backward recomputes only the norms, RoPE, attention's core and the "
        "activation (faster than full, most with LoRA, for more memory; never picked by auto). none: the whole "
        "forward + backward is one compiled graph, compiled once for all input shapes, that keeps every "
        "activation (more memory). The same numbers either way (gradients equal to float rounding). Log-prob "
        "passes and frozen models (reference, reward model) always run the layer graphs. Replaces train_jit "
        "(true = none, false = full). Time and memory of each: bench/README.md (recompute.py, peer_trl.py).",
        choices=RECOMPUTE_MODES)
    memory_budget_gb: float = config_field(
        0.0, "GiB of activations recompute auto may keep per worker. 0 = derived when training starts: 80% "
        "of the device's free memory on Ascend / GPU, 80% of the host's available memory divided by the "
        "number of workers on CPU. Range >= 0.",
        ge=0.0)
    layer_graphs: bool = config_field(
        True, "Run the decoder layers of training (with recompute full) and of every log-prob pass as two "
        "compiled graphs (forward; recomputed forward + backward) that every layer shares, loading its "
        "weights before each call: less time and memory than pynative layers, the same numbers. false = "
        "pynative layers (for debugging: autodiff keeps their activations; slower). Figures: bench/README.md "
        "(peer_trl.py).")
    layer_graph_shapes: str = config_field(
        "auto", "How the layer graphs (layer_graphs) are compiled. static: once per input shape (the rows are "
        "padded to multiples of 32, so a run sees few shapes; the offline stages pad their micro-batches to at "
        "most 8 shapes chosen from their rows' lengths) for the first 8 shapes, which then run "
        "MindSpore's faster static-shape kernels (each shape's graphs keep their buffers; later shapes run the "
        "dynamic graphs). dynamic: one compile for every sequence length. auto: static on CPU, dynamic on "
        "Ascend and GPU. The same numbers either way. Figures: bench/README.md (train_flops.py "
        "--layer_graph_shapes).",
        choices=LAYER_GRAPH_SHAPES)

    def layout_sizes(self) -> dict:
        """The layout's sizes by field name (each must be 1 without use_parallel)."""
        return {"train_dp": self.train_dp, "train_tp": self.train_tp, "train_pp": self.train_pp,
                "train_micro_batches": self.train_micro_batches}

    def check(self, errors: List[str]) -> None:
        if not self.use_parallel:
            above_one = [f"{k} = {v}" for k, v in self.layout_sizes().items() if v > 1]
            if above_one:
                errors.append(f"use_parallel = false but {', '.join(above_one)}; set use_parallel true "
                              "(and launch with msrun) or set them to 1")
        if self.train_micro_batches > 1 and self.train_pp == 1:
            errors.append(f"train_micro_batches = {self.train_micro_batches} with train_pp = 1: pipeline "
                          "micro-batches need train_pp > 1; use micro_batch_size for gradient accumulation")


@dataclass
class TrainLoopConfig:
    """Training loop: length, seed, outputs, checkpoints, resume, logging."""

    max_steps: int = config_field(
        12, "Training steps (how long the default run takes: README.md's command 1). One step = num_rollouts "
        "generation calls of chunk_size prompts, scoring, then num_iterations passes of optimizer updates. "
        "Range >= 1. With grpo_epochs the run ends at whichever limit comes first; when grpo_epochs is set and "
        "max_steps is not given, grpo_epochs alone sets the length.",
        ge=1)
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
        10, "Save a checkpoint (the trained model's float32 weights, the optimizer, and the stage's state: GRPO's "
        "reference if synced and data position) every N steps; the last step is always saved. 0 = only the last "
        "step. Range >= 0.",
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
        1, "Log metrics (loss, grad_norm, the stage's own: GRPO's reward, kl, clip_ratio, ...) every N steps. "
        "Range >= 1.",
        ge=1)
    tensorboard: bool = config_field(
        True, "Also write metrics as TensorBoard event files under output_dir/tensorboard.")
    progress_bar: bool = config_field(
        True, "Show a tqdm progress bar over training steps (rank 0 only).")

    def check(self, errors: List[str]) -> None:
        if not self.output_dir:
            errors.append("output_dir is empty; give a directory for logs and checkpoints")


@dataclass
class PolicyEvalTrainConfig(TrainLoopConfig):
    """Training loop of a stage that trains a policy (GRPO, PPO, SFT, DPO): the shared loop and the GSM8K
    generation evaluation while it trains (``trainer.policy_eval``). When it runs is the stage's: GRPO/PPO's
    eval_steps, SFT/DPO's eval_generation."""

    eval_file: str = config_field(
        "", "The held-out questions of the evaluation while training (GRPO/PPO: eval_steps; SFT/DPO: "
        "eval_generation), read as mindrlhf-eval --data_path reads them: GSM8K-style question/answer rows in a "
        "JSONL file, a .parquet file or a datasets save_to_disk folder, or verl's GSM8K layout (prompt messages, "
        "reward_model.ground_truth). '' = the packaged GSM8K test sample (never the training questions).")
    eval_limit: int = config_field(
        64, "How many questions of eval_file the evaluation asks (the first N; 0 = all). Range >= 0.",
        ge=0)
    eval_num_generations: int = config_field(
        1, "Completions per question in the evaluation: 1 = greedy pass@1; k > 1 = maj@k (k samples, majority "
        "vote; GRPO/PPO at the run's temperature and top_p, SFT/DPO at mindrlhf-eval's defaults 0.7 and 1). "
        "Range >= 1.",
        ge=1)

    def check(self, errors: List[str]) -> None:
        super().check(errors)
        if self.eval_file and not Path(self.eval_file).exists():  # found now, not after the first evaluation
            errors.append(f"eval_file = {self.eval_file!r} does not exist; give GSM8K-style question/answer rows "
                          "(JSONL, parquet or a datasets folder), or '' for the packaged GSM8K test sample")


@dataclass
class RewardConfig:
    """The rule rewards of a stage that samples (GRPO, PPO): the reward functions, their weights and what a
    failing one does. Each stage extends it with its own reward terms."""

    reward_funcs: List[str] = config_field(
        ["accuracy", "gsm8k_format"], "Reward functions, by registry name (accuracy: the final answer matches the "
        "solution, numbers numerically, LaTeX mathematics such as $\\sqrt{2}$ or $\\{1,2\\}$ by math-verify as TRL's "
        "accuracy_reward; "
        "gsm8k_format: the answer ends with its only '#### <number>' line, the default prompt style's format; format: "
        "<think>...</think><answer>...</answer>, the 'tags' prompt style's; boxed: a \\boxed{} answer matches; "
        "environment: the rollout environment's get_reward(), with environment set) or by "
        "dotted path 'package.module:function' for user functions. The step reward is their weighted sum "
        "(reward_weights; PPO adds it to the reward model's score); each is logged as rewards/<name>/mean, as TRL "
        "names it: a built-in's name, else the function's __name__ (my_rewards:length_parity logs "
        "rewards/length_parity/mean). Names must be unique. Use the format reward of the prompt style the data was "
        "built with (rlhf_data.py --prompt_style). GRPO needs at least one; PPO: [] = the reward model alone (then "
        "reward_model_path is required).")
    reward_weights: Optional[List[float]] = config_field(
        None, "Weight of each reward function, in reward_funcs order; null = 1.0 for all. Length must equal "
        "len(reward_funcs). Negative weights turn a reward into a penalty.")
    reward_errors: str = config_field(
        "raise", "What a reward function that raises, or returns a value that is not a number (a string; numbers are "
        "float, int, bool, as in TRL), not finite (inf, NaN) or beyond float32's range, does: raise = stop the run "
        "with one error naming the function and its exception or value; skip = score those completions None and train "
        "on, counting failed calls per function (metric rewards/<name>/failures): GRPO gives them no advantage, PPO "
        "scores them by the reward model alone (0 without one). Reward functions are called as TRL calls them: "
        "fn(prompts=, completions=, completion_ids=, solution=, question=), all by keyword, and return one number or "
        "None per completion.",
        choices=REWARD_ERRORS)

    def check(self, errors: List[str]) -> None:
        """Each function once, each logged under its own name (``rewards/<name>/mean``), one weight per function."""
        funcs, weights = self.reward_funcs, self.reward_weights
        duplicates = sorted({f for f in funcs if funcs.count(f) > 1})
        if duplicates:
            errors.append(f"reward_funcs lists {duplicates} more than once; each function once (use reward_weights)")
        names = [reward_spec_name(f) for f in funcs]
        for name in sorted({n for n in names if names.count(n) > 1} - set(duplicates)):
            same = [f for f in funcs if reward_spec_name(f) == name]
            errors.append(f"reward_funcs {same} are all named {name!r} (logged as rewards/{name}/mean, TRL's name: "
                          "the function's __name__); rename one of the functions")
        if weights is not None and len(weights) != len(funcs):
            errors.append(f"reward_weights has {len(weights)} values {weights} but reward_funcs has "
                          f"{len(funcs)} {funcs}; give one weight per function or null")


class TrainingConfig(GroupedConfig):
    """What every stage's config has: the groups ``optimizer``, ``model``, ``parallel`` and ``train``
    (subclasses declare them, with their own group classes), the derived sizes and the shared rules."""

    @property
    def world_size(self) -> int:
        """Processes of the job: train_dp * train_tp * train_pp, plus the generator ranks of a disaggregated
        rollout (``gen_workers``, a rollout stage's)."""
        p = self.parallel
        return p.train_dp * p.train_tp * p.train_pp + getattr(p, "gen_workers", 0)

    @property
    def checkpoint_dir(self) -> str:
        """``save_ckpt_dir`` with '' resolved to ``output_dir/checkpoints``."""
        return self.train.save_ckpt_dir or os.path.join(self.train.output_dir, "checkpoints")

    #: Whether the stage trains LoRA adapters when the model group asks for them (``lora_rank``); a stage that
    #: does not refuses them, so no stage silently trains the full model instead.
    LORA: ClassVar[bool] = False

    def _check_combinations(self, errors: List[str]) -> None:
        for name, _ in self.groups():
            check = getattr(getattr(self, name), "check", None)
            if check is not None:
                check(errors)
        m = self.model
        if m.lora and not self.LORA:
            errors.append(f"lora_rank = {m.lora_rank} / lora_init_from = {m.lora_init_from!r}: this stage does not "
                          "train LoRA adapters yet; use lora_rank 0 and no "
                          "lora_init_from")

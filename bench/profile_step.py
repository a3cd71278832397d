"""Where one SmolLM2 update's time goes, kernel by kernel: MindSpore's CPU profiler on a stage's step.

    python bench/profile_step.py --stage sft            # or rm, dpo, grpo
    python bench/profile_step.py --stage grpo --recompute none --top 25

The stage is built exactly as ``train_flops.py`` builds it (its own code path, peer_trl's 8-row job; GRPO on
experience of peer_trl's SmolLM2 shape). ``--warmup`` updates compile and settle, then ``--steps`` updates run
under ``mindspore.Profiler`` (host CPU kernels). Printed: the wall time of the profiled steps, the time the
kernels account for (summed over kernels; both cores run one kernel at a time, so the sum is comparable to
wall time), the rest (Python, dispatch and graph launch, host-device copies: the "gap"), and a table of kernel
types by total time with their share, calls per step and mean time. Kernel names are MindSpore's (``MatMul``,
``BatchMatMul``, ``Softmax``, ``Mul``...); matmuls and the rest are summed apart, as ``train_flops.py`` splits
them.
"""
from __future__ import annotations

import argparse
import csv
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

MATMULS = ("MatMul", "BatchMatMul", "MatMulExt", "BatchMatMulExt", "Dense")


def kernel_table(out_dir: Path, by_scope: bool = False):
    """``{key: (total_ms, calls)}`` summed over the profiler's CPU op table(s) under ``out_dir``; the key is
    the kernel type, or with ``by_scope`` the type and the scope it ran in (``Gradients/...`` = a backward,
    ``Default/...`` = a forward in a graph, no scope = launched alone, e.g. the optimizer's per-parameter
    ops), the op numbers dropped."""
    table = defaultdict(lambda: [0.0, 0])
    files = list(out_dir.rglob("cpu_op_detail_info_*.csv"))
    if not files:
        raise SystemExit(f"no cpu_op_detail_info_*.csv under {out_dir}: the profiler wrote no CPU op table")
    for f in files:
        with open(f, newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                key = row["op_type"]
                if by_scope:
                    scope = re.sub(r"-op\d+$", "", row["full_op_name"]).rsplit("/", 1)[0]
                    key = f"{key} {scope}" if "/" in row["full_op_name"] else f"{key} (alone)"
                t = table[key]
                t[0] += float(row["op_total_time(ms)"])
                t[1] += int(row["op_occurrences"])
    return {k: (v[0], v[1]) for k, v in table.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", default="sft", choices=("sft", "rm", "dpo", "grpo"))
    ap.add_argument("--warmup", type=int, default=2, help="updates before profiling (the first compiles)")
    ap.add_argument("--steps", type=int, default=1, help="updates profiled")
    ap.add_argument("--recompute", choices=("auto", "full", "none"), default="auto",
                    help="the update's recompute mode (auto: what the CLI would pick)")
    ap.add_argument("--top", type=int, default=20, help="kernel types listed")
    ap.add_argument("--work_dir", help="where the stage's outputs and the profile go (default: a temp dir)")
    args = ap.parse_args(argv)

    import mindspore as ms
    from train_flops import build_stage  # a sibling script: `python bench/profile_step.py` puts bench/ on the path

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="profile_step_"))
    flags = ["--recompute", args.recompute]
    _, trainer, _, micro, scalars, _ = build_stage(args.stage, args.warmup + args.steps, str(work), flags=flags)
    updater = trainer.updater
    updater.set_lr(1e-9)
    for _ in range(args.warmup):
        updater.step(micro, scalars)
    prof = ms.Profiler(output_path=str(work / "profile"))
    t = time.perf_counter()
    for _ in range(args.steps):
        updater.step(micro, scalars)
    wall = (time.perf_counter() - t) * 1000 / args.steps
    prof.stop()  # writes the CPU op tables; analyse() would add a trace view that takes minutes and GiBs
    per_step = {k: (t_ms / args.steps, n / args.steps) for k, (t_ms, n) in kernel_table(work / "profile").items()}
    kernels = sum(v[0] for v in per_step.values())
    mm = sum(v[0] for k, v in per_step.items() if k in MATMULS)
    print(f"# {args.stage}: update {wall / 1000:.2f} s a step (recompute {updater.recompute}, "
          f"{len(micro)} micro-batches); kernels {kernels / 1000:.2f} s ({kernels / wall:.0%}): matmuls "
          f"{mm / 1000:.2f} s, other kernels {(kernels - mm) / 1000:.2f} s; outside kernels "
          f"{(wall - kernels) / 1000:.2f} s")
    for title, table in (("kernel", per_step), ("kernel and scope", {
            k: (t_ms / args.steps, n / args.steps) for k, (t_ms, n) in kernel_table(work / "profile", True).items()})):
        print(f"\n| {title} | s a step | share of step | calls a step | mean ms |")
        print("| --- | --- | --- | --- | --- |")
        for k, (t_ms, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"| {k} | {t_ms / 1000:.3f} | {t_ms / wall:.1%} | {n:.0f} | {t_ms / max(n, 1):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

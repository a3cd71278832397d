"""Colocated against disaggregated rollout: one GRPO job, three modes, each an msrun world of 2.

    python bench/disaggregated.py                               # tiny random Qwen2, both jobs, 4 steps
    python bench/disaggregated.py --model smollm2 --steps 3 --recompute full
    python bench/disaggregated.py --jobs heavy --repeats 2      # modes interleaved: A B C A B C

Modes (same seed, same global batch, same 2 processes):

* ``colocated``: dp2, both ranks sample their half of the prompts, then both train their half (today's default);
* ``sync``: ``--gen_workers 1 --max_staleness 0``: rank 1 samples every row, rank 0 trains on every row, in turn;
* ``async``: ``--gen_workers 1 --max_staleness 1 --loss_type decoupled``: the same, one step off (rank 1 samples
  step s+1 while rank 0 trains step s).

Jobs: ``default`` (``--completion`` new tokens) and ``heavy`` (generation-heavy: ``--heavy_completion`` new tokens,
every completion that long: ``min_new_tokens``). Unknown flags are config fields given to every run (e.g.
``--recompute full``). Per mode: the median step time of steps 3..N (steady state) and its phases from
``metrics.jsonl`` (generation: the generators' busy seconds, or colocated ``time/generate``; training: the rest of
the trainers' step but the weight push; weight sync: ``time/sync``; each side's idle seconds); the overlap
efficiency async step / max(generation, training + weight sync), both with the async run's own phases and with the
sync run's (which ran one side at a time, so each had the machine to itself); the projected step time of an
8-device job per mode (``project``; its model and assumptions in bench/README.md). The load average is printed
beside each run; a run waits (up to ``--mem_wait`` s) for ``--min_free_gib`` of available memory before it starts.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MODES = ("colocated", "sync", "async")
MODE_FLAGS = {
    "colocated": ["--train_dp", "2", "--infer_dp", "2"],
    "sync": ["--gen_workers", "1", "--max_staleness", "0"],
    "async": ["--gen_workers", "1", "--max_staleness", "1", "--loss_type", "decoupled"],
}


def _timing_key(key: str) -> bool:
    """A wall-clock metric of a step (kept per step in ``--json``)."""
    return key == "step_time" or key.startswith(("time/", "staleness/"))


def available_gib() -> float:
    """MemAvailable of /proc/meminfo in GiB (inf where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return float("inf")


def wait_for_memory(need: float, limit: float) -> float:
    """Wait until ``need`` GiB are available (the machine is shared), at most ``limit`` seconds; returns the GiB."""
    deadline = time.time() + limit
    while available_gib() < need and time.time() < deadline:
        print(f"  waiting: {available_gib():.1f} GiB available < {need} GiB", flush=True)
        time.sleep(20)
    return available_gib()


def prepare(root: Path, model: str, data_dir: Path, prompts: int) -> Dict[str, str]:
    """The model directory (the tiny random Qwen2 preset, the embedded SmolLM2, or a path) and a GSM8K mindrecord of
    ``prompts`` rows."""
    from mindrlhf.data.rlhf_data import convert_to_mindrecord
    from mindrlhf.tokenizer import Tokenizer

    if model == "smollm2":
        from mindrlhf.checkpoint.smollm2 import prepare_smollm2

        model_dir = Path(prepare_smollm2())
    elif model:
        model_dir = Path(model)
    else:
        from mindrlhf.testing import add_tokenizer, make_tiny_qwen2

        model_dir = add_tokenizer(make_tiny_qwen2(root / "tiny", hidden_size=64, intermediate_size=128,
                                                  max_position_embeddings=1024), data_dir / "qwen2.5-tokenizer")
    rows = (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[:prompts]
    jsonl = root / "prompts.jsonl"
    jsonl.write_text("\n".join(rows) + "\n")
    data = root / "prompts.mindrecord"
    convert_to_mindrecord(str(jsonl), str(data), Tokenizer.from_dir(model_dir), max_prompt_length=256,
                          show_progress=False)
    return {"model": str(model_dir), "data": str(data)}


def launch(argv: List[str], log_dir: Path, port: int) -> float:
    """One msrun world of 2 running ``mindrlhf-grpo`` with ``argv``; returns its wall seconds (raises on failure
    with the workers' log tails)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    cmd = [str(Path(sys.executable).parent / "msrun"), "--worker_num=2", "--local_worker_num=2",
           f"--master_port={port}", "--join=True", f"--log_dir={log_dir}", str(REPO / "examples/stages/run.py"),
           "grpo", *argv]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        logs = "\n".join(p.read_text(errors="replace")[-2500:] for p in sorted(log_dir.glob("*.log")))
        raise SystemExit(f"msrun failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}\n{logs}")
    return time.time() - t0


def phases(rows: List[dict], mode: str) -> Dict[str, float]:
    """Median seconds per step over steps 3..N of: the step, generation, training (the trainers' work but the weight
    push), weight sync, and each side's idle time."""
    # Steady state: step 1 compiles, and one step off, step 2's rows were sampled while step 1 compiled (ready at
    # once); a side's idle time covers the other side's step before (the generators': two steps before, one step
    # off), so it is steady from step 3 (4 one step off).
    rest = [r for r in rows if r["step"] >= 3] or rows
    late = [r for r in rows if r["step"] >= (4 if mode == "async" else 3)] or rest

    def med(f, rows=rest) -> float:
        return float(np.median([f(r) for r in rows]))

    out = {"step": med(lambda r: r["step_time"]), "sync": med(lambda r: r.get("time/sync", 0.0))}
    if mode == "colocated":
        out["generation"] = med(lambda r: r["time/generate"])
        out["training"] = med(lambda r: r["step_time"] - r["time/generate"] - r.get("time/sync", 0.0))
        out["generator_idle"] = out["trainer_idle"] = 0.0
    else:
        out["generation"] = med(lambda r: r["time/generator_busy"])
        out["training"] = med(lambda r: r["time/trainer_busy"] - r.get("time/sync", 0.0))
        out["generator_idle"] = med(lambda r: r["time/generator_idle"], late)
        out["trainer_idle"] = med(lambda r: r["time/trainer_idle"], late)
    out["staleness"] = float(np.mean([r.get("staleness/mean", 0.0) for r in rest]))
    return out


def project(measured: Dict[str, Dict[str, float]], devices: int = 8) -> Dict[str, Dict[str, float]]:
    """Step seconds of a ``devices``-device job with the same global batch, from the phases measured on 2 (see
    bench/README.md): the seconds of a phase are proportional to the rows per device doing it; one generator's
    and one trainer's seconds for the whole batch come from the sync run (each side had the machine alone then);
    colocated, every device samples and trains 1/devices of the rows and syncs its own copy (its measured
    ``sync``); disaggregated, K devices sample and devices - K train, and the weight push costs what it cost on 2;
    async takes the larger side times the measured overlap efficiency. Returns each mode's best K and step."""
    s, c, a = measured["sync"], measured["colocated"], measured["async"]
    gen1, train1, push = s["generation"], s["training"], s["sync"]
    efficiency = a["step"] / max(a["generation"], a["training"] + a["sync"])
    out = {"colocated": {"K": 0, "step": 2 * (c["generation"] + c["training"]) / devices + c["sync"]}}
    for mode in ("sync", "async"):
        best = None
        for k in range(1, devices):
            gen, train = gen1 / k, train1 / (devices - k) + push
            step = gen + train if mode == "sync" else max(gen, train) * efficiency
            if best is None or step < best["step"]:
                best = {"K": k, "step": step, "generation": gen, "training_sync": train}
        out[mode] = best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="'' (tiny random Qwen2), 'smollm2', or an HF dir")
    ap.add_argument("--data_dir", default=str(REPO / "tests" / "data"), help="folder with gsm8k/ (and the tiny "
                    "model's qwen2.5-tokenizer/)")
    ap.add_argument("--jobs", default="heavy,default", help="comma-separated: heavy, default")
    ap.add_argument("--steps", type=int, default=5, help="GRPO steps per run (medians of steps 3..N)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode, interleaved")
    ap.add_argument("--chunk_size", type=int, default=2, help="prompts per step (global)")
    ap.add_argument("--num_generations", type=int, default=4)
    ap.add_argument("--completion", type=int, default=32, help="max_completion_length of the default job")
    ap.add_argument("--heavy_completion", type=int, default=128, help="completion length of the heavy job "
                    "(min_new_tokens = max_completion_length)")
    ap.add_argument("--port", type=int, default=8231)
    ap.add_argument("--min_free_gib", type=float, default=0.0, help="wait for this much available memory first")
    ap.add_argument("--mem_wait", type=float, default=1800.0)
    ap.add_argument("--json", default="", help="also write the figures here")
    args, fields = ap.parse_known_args()

    root = Path(tempfile.mkdtemp(prefix="mindrlhf_bench_disagg_"))
    assets = prepare(root, args.model, Path(args.data_dir), prompts=max(16, args.chunk_size * args.steps))
    jobs = {"default": ["--max_completion_length", str(args.completion)],
            "heavy": ["--max_completion_length", str(args.heavy_completion),
                      "--min_new_tokens", str(args.heavy_completion)]}
    results: Dict[str, dict] = {}
    port = args.port
    for job in [j.strip() for j in args.jobs.split(",") if j.strip()]:
        runs: Dict[str, List[Dict[str, float]]] = {m: [] for m in MODES}
        for rep in range(args.repeats):
            for mode in MODES:  # interleaved, so a change of the machine's load hits every mode alike
                out = root / f"{job}_{mode}_{rep}"
                argv = ["--sft_path_train", assets["model"], "--mind_dataset_dir", assets["data"],
                        "--output_dir", str(out), "--max_steps", str(args.steps), "--use_parallel", "true",
                        "--chunk_size", str(args.chunk_size), "--num_generations", str(args.num_generations),
                        "--save_steps", str(10 ** 6), "--progress_bar", "false", "--tensorboard", "false",
                        "--log_completions_steps", "0", "--collective_timeout", "1800", "--temperature", "0.7",
                        *jobs[job], *MODE_FLAGS[mode], *fields]
                free = wait_for_memory(args.min_free_gib, args.mem_wait)
                load0 = os.getloadavg()[0]
                wall = launch(argv, root / f"log_{job}_{mode}_{rep}", port)
                port += 2
                rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
                p = phases(rows, mode)
                p["rows"] = [{k: v for k, v in r.items() if k == "step" or _timing_key(k)} for r in rows]
                p.update(wall=wall, load_before=load0, load_after=os.getloadavg()[0], free_gib=free,
                         mean_length=float(np.mean([r["completions/mean_length"] for r in rows])))
                runs[mode].append(p)
                print(f"[{job} {mode} #{rep + 1}] step {p['step']:.2f} s (gen {p['generation']:.2f}, train "
                      f"{p['training']:.2f}, sync {p['sync']:.3f}, idle g/t {p['generator_idle']:.2f}/"
                      f"{p['trainer_idle']:.2f}); load {load0:.2f} -> {p['load_after']:.2f}", flush=True)
                shutil.rmtree(out, ignore_errors=True)
        measured = {m: {k: float(np.median([r[k] for r in runs[m]])) for k in runs[m][0] if k != "rows"}
                    for m in MODES}
        a, s = measured["async"], measured["sync"]
        results[job] = {
            "measured": measured, "runs": runs,
            "overlap_efficiency": a["step"] / max(a["generation"], a["training"] + a["sync"]),
            "overlap_efficiency_vs_sync_phases": a["step"] / max(s["generation"], s["training"] + s["sync"]),
            "projected_8": project(measured)}
        _print({job: results[job]}, args, fields)
        if args.json:  # after every job: a long run keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=1))
    shutil.rmtree(root, ignore_errors=True)


def _print(results: dict, args, fields) -> None:
    """The table of every job (medians over repeats)."""
    print(f"\nmodel {args.model or 'tiny Qwen2 (random, hidden 64)'}; {args.chunk_size} prompts x G "
          f"{args.num_generations} per step, medians of steps 3..{args.steps}, msrun world 2; {' '.join(fields)}")
    for job, r in results.items():
        print(f"\njob {job}")
        print(f"{'mode':<10}{'step s':>8}{'gen s':>8}{'train s':>9}{'sync s':>8}{'idle g':>8}{'idle t':>8}"
              f"{'vs coloc':>9}{'load':>11}")
        base = r["measured"]["colocated"]["step"]
        for mode in MODES:
            m = r["measured"][mode]
            print(f"{mode:<10}{m['step']:>8.2f}{m['generation']:>8.2f}{m['training']:>9.2f}{m['sync']:>8.3f}"
                  f"{m['generator_idle']:>8.2f}{m['trainer_idle']:>8.2f}{m['step'] / base:>9.2f}"
                  f"  {m['load_before']:.2f}-{m['load_after']:.2f}")
        print(f"overlap efficiency (async step / max(gen, train + sync)): {r['overlap_efficiency']:.3f} with the "
              f"async run's phases, {r['overlap_efficiency_vs_sync_phases']:.3f} with the sync run's (target <= 1.15)")
        p = r["projected_8"]
        print("projected 8-device step: " + ", ".join(
            f"{mode} {p[mode]['step']:.2f} s" + (f" (K={p[mode]['K']} generators)" if p[mode]["K"] else "")
            for mode in MODES))


if __name__ == "__main__":
    main()

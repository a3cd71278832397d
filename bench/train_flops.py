"""Each stage's SmolLM2 update in GFLOP/s against this machine's sgemm peak, in one run.

    python bench/train_flops.py                           # sft, rm, dpo, grpo; MindSpore's matmul
    python bench/train_flops.py --stages sft,grpo --steps 4
    python bench/train_flops.py --cpu_matmul openblas     # the decoder's matmuls through numpy's OpenBLAS
    python bench/train_flops.py --stages grpo,sft --recompute full --layer_graph_shapes static,dynamic

Prints, in one run:

- the machine's float32 sgemm peak: numpy's ``matmul`` (its OpenBLAS; the header names the kernels OpenBLAS
  picked and ``OPENBLAS_CORETYPE``) on 2048^3, interleaved with MindSpore's ``ops.MatMul`` in ``mindspore.jit``
  on the same product (and the ``--cpu_matmul`` route's, when it is not MindSpore's), in this process;
- the matmul route the decoder uses (``--cpu_matmul``; ``ms`` = MindSpore's own, what the trainer runs);
- for each stage, one optimizer update of the embedded SmolLM2-135M-Instruct (float32) at a fixed batch, run
  through the stage's own code path: SFT, reward model and DPO are built as their CLIs build them
  (``bench/peer_trl.py``'s ``build_ours_stage``: ``parse_*_args``, ``setup_runtime``, ``build_trainer``; a step
  of peer_trl's job: 8 GSM8K rows or pairs, micro-batches of 4), the batch made by the stage's ``prepare`` and
  timed in ``trainer.updater.step`` (the stage's Objective and ``Updater``, with the layer graphs and the
  recompute mode the CLI defaults choose); GRPO is built as ``mindrlhf-grpo`` builds it (``build_ours_grpo``:
  peer_trl's SmolLM2 job, 2 prompts x 4 completions, micro-batches of 4) and its ``updater.step`` is timed on
  experience of that shape (prompt 126 tokens, 160 completion tokens, shared-prompt packed as the CLI packs).
  Each stage runs in its own child process, ``--steps`` updates, the first (compilation) left out.

Model FLOPs are counted analytically from the micro-batches the update runs on: forward = 2 x (linear-layer
weights) x (decoder positions, padding included: what is computed) + attention's two products (4 x score
pairs x heads x head_dim per layer, every pair the kernels form) + the vocabulary head's 2 x hidden x vocab per
logit row where the head forms logits (the log-prob heads: completion positions; the reward model's score
head: none); training = 3 x forward. With ``recompute full`` the layer graphs run each layer's forward (and
the chunked head's) again in the backward, with ``selective`` attention's products and the head's: those FLOPs
are printed apart ("+recompute") and are not in the GFLOP/s. The GFLOP/s are divided by the numpy peak measured
next to the steps in the same child.

Where the rest of the step goes: after the steps the child times the route's matmul (in ``mindspore.jit``) on
each of the update's product shapes (forward ``x Wᵀ`` and the two gradient products of every linear layer, at
the micro-batch's decoder positions, and the head's at its logit rows) and prints the matmul time the step's
FLOPs would take at those rates (recompute included; attention's batched products at the linear layers' mean
rate) beside the measured step: the difference is everything else (elementwise kernels, softmax, the loss,
dispatch, gradient accumulation, the optimizer).

``--layer_graph_shapes static,dynamic`` (``parallel.layer_graph_shapes``) runs each stage's updates with each
listed kind of layer graphs, interleaved in the one child (the order alternates every round; each kind's first
update, which compiles, left out), and prints each kind's median step, its gradient norm, the static shapes
compiled and the child's peak RSS: an A/B that a shared machine's drift cannot bias. ``--recompute full`` makes
the stages' gradient passes run the layer graphs (``none`` runs the whole-model graph, which the setting does not
change).
``static+gk`` among the kinds: the static layer graphs compiled with MindSpore's graph-kernel fusion
(``LayerGraphs.graph_kernel``, no config setting; ``--graph_kernel_flags`` sets its ``graph_kernel_flags``), e.g.
``--layer_graph_shapes static,static+gk`` (bench/README.md: its numbers move by up to 1.3e-5, not wired).

On a shared machine figures move; the load average is printed with each part.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from mindrlhf.configs.common import RECOMPUTE_MODES

REPO = Path(__file__).resolve().parents[1]
STAGE_NAMES = ("sft", "rm", "dpo", "grpo")
RESULT_TAG = "TRAIN_FLOPS_RESULT "


def _load() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[0] if Path("/proc/loadavg").exists() else "?"


def _numpy_peak(min_time: float = 0.3) -> float:
    """numpy's float32 2048^3 ``matmul`` rate, GFLOP/s."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2048, 2048)).astype(np.float32)
    b = rng.standard_normal((2048, 2048)).astype(np.float32)
    a @ b
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_time or not calls:
        a @ b
        calls += 1
    return 2.0 * 2048 ** 3 * calls / (time.perf_counter() - start) / 1e9


def _ms_rate(route: str, case: str, m: int, k: int, n: int, min_time: float) -> float:
    """GFLOP/s of ``route``'s 2-D float32 product (``matmul.py``'s operands of ``case``) inside ``mindspore.jit``."""
    import matmul as mm
    import mindspore as ms
    from mindspore import Tensor

    a, b, flop = mm._operands(case, m, k, n, np.random.default_rng(0))
    prim = mm._ms_routes(case)[route]
    fn = ms.jit(mm._call2(prim))
    ta, tb = Tensor(a), Tensor(b)
    return flop / mm._time(lambda: fn(ta, tb), min_time) / 1e9


# -- the FLOPs of an update -------------------------------------------------------------------------
def linear_shapes(config):
    """(label, K, N) of each linear layer of one decoder layer, ``y (M, N) = x (M, K) Wᵀ``."""
    h, q, kv, i = (config.hidden_size, config.num_attention_heads * config.head_dim,
                   config.num_key_value_heads * config.head_dim, config.intermediate_size)
    return (("q", h, q), ("k", h, kv), ("v", h, kv), ("o", q, h), ("gate", h, i), ("up", h, i), ("down", i, h))


def micro_extent(mb, packed_group: int = 0, logits: bool = True):
    """(decoder positions, attention score pairs per head, logit rows) of one micro-batch as the update
    computes it; ``packed_group``: completions per prompt packed behind one prompt copy (``models.packing``),
    with ``prompt_width`` columns of prompt; ``logits``: whether the head forms vocabulary logits at the completion
    positions (not the reward model's score head, whose rows have completions too)."""
    ids = mb["input_ids"]
    logit_rows = int(mb["completion_ids"].size) if "completion_ids" in mb and logits else 0
    if not packed_group:
        b, t = ids.shape
        return b * t, b * t * t, logit_rows
    from mindrlhf.trainer.memory import MicroBatchExtent

    c = mb["completion_ids"].shape[1]
    p = ids.shape[1] + 1 - c
    e = MicroBatchExtent.shared_prompts(ids.shape[0], packed_group, p, c - 1, packed=True)
    return e.tokens, e.score_pairs, logit_rows


def update_flops(config, extents, layers: int):
    """Forward FLOPs of the update's micro-batches: ``{"linear", "attention", "head"}`` (training = 3x)."""
    lin = sum(k * n for _, k, n in linear_shapes(config)) * layers
    att = 4 * config.num_attention_heads * config.head_dim * layers
    head = config.hidden_size * config.vocab_size
    return {"linear": sum(2.0 * t * lin for t, _, _ in extents),
            "attention": sum(float(att) * s for _, s, _ in extents),
            "head": sum(2.0 * r * head for _, _, r in extents)}


def matmul_seconds(config, extents, layers: int, route: str, recompute: str, min_time: float):
    """Seconds the update's matmuls take at the rates ``route`` reaches on their shapes (see the docstring),
    and the rates measured {(label, M, case): GFLOP/s}. ``recompute``: the update's mode (``full`` runs the
    linear layers' forward twice; ``full`` and ``selective`` attention's products and the head's)."""
    rates, seconds, lin_rates = {}, 0.0, []
    cases = ("nt", "nn", "tn")
    for tokens, _, rows in extents:
        for label, k, n in linear_shapes(config):
            for case in cases:
                key = (label, tokens, case)
                if key not in rates:
                    same = next((v for (lb, t, c), v in rates.items() if t == tokens and c == case
                                 and linear_shapes_same(config, lb, label)), None)
                    rates[key] = same or _ms_rate(route, case, tokens, k, n, min_time)
                lin_rates.append(rates[key])
                runs = 2 if case == "nt" and recompute == "full" else 1
                seconds += runs * 2.0 * tokens * k * n * layers / (rates[key] * 1e9)
        if rows:
            for case in cases:
                key = ("head", rows, case)
                if key not in rates:
                    rates[key] = _ms_rate(route, case, rows, config.hidden_size, config.vocab_size, min_time)
                runs = 2 if case == "nt" and recompute in ("full", "selective") else 1  # the chunked head recomputes
                seconds += runs * 2.0 * rows * config.hidden_size * config.vocab_size / (rates[key] * 1e9)
    att = update_flops(config, extents, layers)["attention"] * (4 if recompute in ("full", "selective") else 3)
    seconds += att / (statistics.mean(lin_rates) * 1e9)
    return seconds, {f"{lb} {m} {c}": round(v, 1) for (lb, m, c), v in rates.items()}


def linear_shapes_same(config, a: str, b: str) -> bool:
    """Whether linear layers ``a`` and ``b`` have the same product shape (one measurement serves both)."""
    shapes = {lb: (k, n) for lb, k, n in linear_shapes(config)}
    return shapes[a] == shapes[b]


# -- a stage in a child process ----------------------------------------------------------------------
def _grpo_micro(cfg, vocab: int, prompt_len: int = 126):
    """Experience micro-batches of ``cfg``'s shape (``chunk_size`` prompts x ``num_generations`` completions of
    ``max_completion_length`` tokens, ``micro_batch_size`` completions each), as ``GRPOTrainer.train_on`` cuts
    them; seeded random ids, advantages and log-probs."""
    rng = np.random.default_rng(0)
    a, g = cfg.algorithm, cfg.generation
    c, size = g.max_completion_length, cfg.micro_batch_completions
    prompts = np.repeat(rng.integers(1, vocab, (a.chunk_size, prompt_len)), a.num_generations, axis=0)
    completions = rng.integers(1, vocab, (len(prompts), c)).astype(np.int32)
    ids = np.concatenate([prompts, completions], axis=1)[:, :-1].astype(np.int32)
    mask = np.ones(completions.shape, np.float32)
    adv = np.repeat(rng.standard_normal((len(prompts), 1)), c, axis=1).astype(np.float32)
    zeros = np.zeros(completions.shape, np.float32)
    micro = [{"input_ids": ids[s:s + size], "attention_mask": np.ones_like(ids[s:s + size]),
              "completion_ids": completions[s:s + size], "completion_mask": mask[s:s + size],
              "advantages": adv[s:s + size], "old_logp": zeros[s:s + size], "ref_logp": zeros[s:s + size],
              "sampler_logp": zeros[s:s + size]} for s in range(0, len(ids), size)]
    return micro, (float(mask.sum()), float(len(prompts)))


def build_stage(stage: str, steps: int, work_dir: str, cpu_matmul: str = "ms", flags: Sequence[str] = ()):
    """``(cfg, trainer, model, micro, scalars, group)``: ``stage`` built through its own code path (``flags``:
    extra config flags, e.g. ``--recompute none``) with one update's micro-batches (``group``: completions
    packed per prompt, 0 for the offline stages)."""
    # Sibling bench scripts: ``python bench/<script>.py`` puts bench/ first on the module path.
    import peer_trl

    if cpu_matmul != "ms":
        import recompute

        recompute._route_matmuls(cpu_matmul)
    work = Path(work_dir) / stage
    work.mkdir(parents=True, exist_ok=True)
    if stage == "grpo":
        spec = peer_trl.make_spec("smollm2", steps, work, flags)
        cfg, trainer = peer_trl.build_ours_grpo(spec)
        micro, scalars = _grpo_micro(cfg, trainer.policy.config.vocab_size)
        group = cfg.algorithm.num_generations if cfg.parallel.share_prompts else 0
        return cfg, trainer, trainer.policy, micro, scalars, group
    spec = peer_trl.make_stage_spec(stage, steps, work, flags)
    cfg, trainer = peer_trl.build_ours_stage(spec)
    rows = trainer.dataset.global_indices(0, 0)
    micro, scalars = trainer.prepare(trainer.dataset.batch(0, 0), rows)
    # A preference pair's two rows are packed behind one copy of their prompt (the reward model's and DPO's
    # updaters share prompts): count the positions the packed rows compute, not the padded pair rows.
    pairs = stage in ("rm", "dpo") and trainer.updater.runner.share_prompts
    return cfg, trainer, trainer.model, micro, scalars, 2 if pairs else 0


def run_stage(args) -> dict:
    """One stage in this process: built through its own code path, ``--steps`` updates timed (for each kind of
    ``--layer_graph_shapes``, interleaved)."""
    import resource

    flags = ["--recompute", args.recompute] if args.recompute else []
    if args.graph_kernel_flags is not None:
        from mindrlhf.models import layer_graphs

        layer_graphs.GRAPH_KERNEL_FLAGS = args.graph_kernel_flags
    cfg, trainer, model, micro, scalars, group = build_stage(args.stage, args.steps, args.work_dir, args.cpu_matmul,
                                                             flags)
    updater = trainer.updater
    kinds = [k for k in (args.layer_graph_shapes or "").split(",") if k] or [""]
    # Tiny steps: every update sees (nearly) the same weights; comparing kinds, none at all (learning rate 0),
    # so their gradient norms must be equal.
    updater.set_lr(0.0 if len(kinds) > 1 else 1e-9)
    config, layers = model.config, len(model.layer_range)
    extents = [micro_extent(mb, group, logits=args.stage != "rm") for mb in micro]
    times, peaks, by_kind = [], [_numpy_peak()], {k: {"times": [], "grad_norm": []} for k in kinds}
    for i in range(args.steps):
        for kind in kinds if i % 2 == 0 else kinds[::-1]:  # alternate the order: neither kind always goes first
            if kind:
                updater.runner.static_layer_graphs = kind != "dynamic"
                updater.runner.graph_kernel = kind == "static+gk"
            t = time.perf_counter()
            res = updater.step(micro, scalars)
            by_kind[kind]["times"].append(time.perf_counter() - t)
            by_kind[kind]["grad_norm"].append(float(res["grad_norm"]))
            times.append(by_kind[kind]["times"][-1])
            peaks.append(_numpy_peak())
    mm_s, rates = matmul_seconds(config, extents, layers, args.cpu_matmul, updater.recompute, args.min_time)
    first = by_kind[kinds[0]]["times"]
    graphs = model.layer_graphs
    return {"stage": args.stage, "step_s": float(np.median(first[1:] or first)), "step_times": times,
            "peak": float(np.median(peaks)), "peaks": peaks, "recompute": updater.recompute,
            "layer_graphs": bool(cfg.parallel.layer_graphs), "micro_batches": len(micro),
            "rows": int(sum(mb["input_ids"].shape[0] for mb in micro)), "extents": extents,
            "flops": update_flops(config, extents, layers), "matmul_s": mm_s, "rates": rates,
            "loss": float(res["loss"]), "load": _load(), "kinds": {k: v for k, v in by_kind.items() if k},
            "static_shapes": graphs.static_shapes if graphs is not None else 0,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


# -- parent ------------------------------------------------------------------------------------------
def header(route: str, repeats: int) -> float:
    """Print the machine's peak, MindSpore's matmul and the route; return the median numpy peak."""
    import mindspore as ms

    ms.set_device("CPU")
    from mindrlhf.models import cpu_matmul

    if route == "openblas":
        cpu_matmul.build_openblas_kernel()
    print(f"# training GFLOP/s against this machine's sgemm peak: {os.cpu_count()} CPUs, MindSpore {ms.__version__}, "
          f"numpy {np.__version__} ({cpu_matmul.numpy_openblas().name}, OpenBLAS kernels {cpu_matmul.openblas_core()}, "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}); load {_load()}")
    routes = ["ms"] + ([route] if route != "ms" else [])
    peaks, gf = [], {r: [] for r in routes}
    for _ in range(repeats):
        for r in routes:
            peaks.append(_numpy_peak())
            gf[r].append(_ms_rate(r, "nt", 2048, 2048, 2048, 0.3))
    peak = statistics.median(peaks)
    print(f"numpy sgemm 2048^3 (the peak): {peak:.0f} GFLOP/s (range {min(peaks):.0f}-{max(peaks):.0f})")
    for r in routes:
        name = "MindSpore ops.MatMul (oneDNN), jit" if r == "ms" else f"route {r} (mindrlhf.models.cpu_matmul), jit"
        print(f"{name} 2048^3: {statistics.median(gf[r]):.0f} GFLOP/s "
              f"({statistics.median(gf[r]) / peak:.0%} of the peak)")
    print(f"matmul route of the decoder in this run: {route} "
          f"({'MindSpore MatMul, the trainer default' if route == 'ms' else 'Custom op via bench/recompute.py'})")
    return peak


def report(results, route: str, peak: float) -> None:
    """The table of each stage's update; ``peak``: the header's numpy peak (measured before any stage ran: a child's
    own peak, measured between its steps, can come out far lower beside MindSpore's runtime threads)."""
    print(f"\n## SmolLM2 update per stage (route {route}); GFLOP/s = 3 x forward FLOPs / step time, "
          "fraction of the header's numpy peak and of the one measured next to the steps in the stage's child")
    cols = ("stage", "micro-batches x rows", "positions", "recompute", "step s", "train GFLOP", "+recompute GFLOP",
            "GFLOP/s", "of peak (header / child)", "matmul s (share)", "rest s", "load")
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in results:
        if "error" in r:
            print(f"| {r['stage']} | failed: {r['error']} |")
            continue
        f = r["flops"]
        fwd = sum(f.values())
        train = 3 * fwd
        extra = fwd if r["recompute"] == "full" else (f["attention"] + f["head"] if r["recompute"] == "selective"
                                                     else 0.0)
        gfs = train / r["step_s"] / 1e9
        positions = sum(e[0] for e in r["extents"])
        share = r["matmul_s"] / r["step_s"]
        print(f"| {r['stage']} | {r['micro_batches']} x {r['rows'] // r['micro_batches']} | {positions} | "
              f"{r['recompute']} | {r['step_s']:.2f} | {train / 1e9:.1f} | {extra / 1e9:.1f} | {gfs:.0f} | "
              f"{gfs / peak:.0%} / {gfs / r['peak']:.0%} | {r['matmul_s']:.2f} ({share:.0%}) | "
              f"{r['step_s'] - r['matmul_s']:.2f} | {r['load']} |", flush=True)
    print("\nforward GFLOP by part (linear / attention / head); the numpy peak in the child; every step's time; "
          "the route's matmul rates on the update's shapes, median (range), GFLOP/s:")
    for r in results:
        if "error" not in r:
            f = r["flops"]
            lin = [v for k, v in r["rates"].items() if not k.startswith("head")]
            head = [v for k, v in r["rates"].items() if k.startswith("head")]
            rates = f"linear {statistics.median(lin):.0f} ({min(lin):.0f}-{max(lin):.0f})"
            if head:
                rates += f", head {statistics.median(head):.0f} ({min(head):.0f}-{max(head):.0f})"
            print(f"- {r['stage']}: {f['linear'] / 1e9:.1f} / {f['attention'] / 1e9:.1f} / {f['head'] / 1e9:.1f}; "
                  f"peak {r['peak']:.0f} ({min(r['peaks']):.0f}-{max(r['peaks']):.0f}); steps "
                  f"{', '.join(f'{t:.2f}' for t in r['step_times'])} s; matmul rates {rates}")
    kinds = [r for r in results if r.get("kinds")]
    if kinds:
        print("\n## layer graphs' shapes, interleaved in each stage's child (medians without each kind's first, "
              "compiling, update)")
        print("| stage | kind | median step s | steps s | grad_norm (distinct values) | static shapes | "
              "child peak RSS GiB |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in kinds:
            for kind, v in r["kinds"].items():
                t = v["times"]
                norms = ", ".join(f"{x:.7f}" for x in sorted(set(v["grad_norm"])))
                print(f"| {r['stage']} | {kind} | {np.median(t[1:] or t):.2f} | {', '.join(f'{x:.2f}' for x in t)} | "
                      f"{norms} | {r['static_shapes']} | {r['peak_rss_gib']:.2f} |")


def parser() -> argparse.ArgumentParser:
    """The command line of the parent and of each stage's child (``--stage``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default=",".join(STAGE_NAMES), help=f"comma-separated, of {', '.join(STAGE_NAMES)}")
    ap.add_argument("--steps", type=int, default=3, help="updates per stage (the first, compiling, is left out)")
    ap.add_argument("--cpu_matmul", default="ms", choices=("ms", "openblas", "numpy"),
                    help="the decoder's 2-D float32 matmuls: MindSpore's (ms, the trainer's) or a "
                         "mindrlhf.models.cpu_matmul route (bench/recompute.py's swap)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved peak / MindSpore measurements in the header")
    ap.add_argument("--min_time", type=float, default=0.2, help="seconds of calls per matmul-rate measurement")
    ap.add_argument("--layer_graph_shapes", default="",
                    help="comma-separated kinds of layer graphs (static, dynamic, static+gk: static with graph-kernel "
                         "fusion, LayerGraphs.graph_kernel) to run interleaved in each stage's child; default: the "
                         "config's (parallel.layer_graph_shapes)")
    ap.add_argument("--graph_kernel_flags", default=None,
                    help="graph_kernel_flags of the fused layer graphs (static+gk); default: "
                         "models.layer_graphs.GRAPH_KERNEL_FLAGS")
    ap.add_argument("--recompute", choices=RECOMPUTE_MODES, default=None,
                    help="the stages' recompute mode (default: the CLI's, auto)")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--work_dir", help=argparse.SUPPRESS)
    return ap


def child_args(args: argparse.Namespace, stage: str, work_dir: str) -> list:
    """The arguments of ``stage``'s child process: the parent's settings; the recompute mode only when one was
    given (the child then builds the stage with the CLI's default, as a user's run does)."""
    out = ["--stage", stage, "--work_dir", work_dir, "--steps", str(args.steps), "--cpu_matmul", args.cpu_matmul,
           "--min_time", str(args.min_time), "--layer_graph_shapes", args.layer_graph_shapes]
    if args.recompute:
        out += ["--recompute", args.recompute]
    if args.graph_kernel_flags is not None:
        out.append(f"--graph_kernel_flags={args.graph_kernel_flags}")
    return out


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.stage:  # a child: one stage, its result as the last line
        print(RESULT_TAG + json.dumps(run_stage(args)), flush=True)
        return 0
    stages = [s for s in args.stages.split(",") if s]
    bad = [s for s in stages if s not in STAGE_NAMES]
    if bad:
        ap.error(f"--stages: {bad} not among {STAGE_NAMES}")
    peak = header(args.cpu_matmul, args.repeats)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in stages:
            cmd = [sys.executable, __file__, *child_args(args, stage, tmp)]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT_TAG)), None)
            if proc.returncode or line is None:
                tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
                results.append({"stage": stage, "error": f"rc {proc.returncode}: {tail[0][:200]}"})
                print(proc.stderr[-3000:], file=sys.stderr)
            else:
                results.append(json.loads(line[len(RESULT_TAG):]))
            print(f"[{stage} done, load {_load()}]", flush=True)
    report(results, args.cpu_matmul, peak)
    print(f"load at the end: {_load()}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""What recompute costs: one update's loss and gradients with and without recomputing the forward.

    python bench/recompute.py                          # the embedded SmolLM2-135M-Instruct
    python bench/recompute.py --model tiny             # a small random Qwen2 (a quick check of the script)
    python bench/recompute.py --modes graphs,jit       # some of the ways only
    python bench/recompute.py --cpu_matmul openblas    # the decoder's matmuls through numpy's OpenBLAS
    python bench/recompute.py --modes graphs --cpu_matmul ms,openblas   # both, steps alternating in one process

The same update (GRPO's: completion log-probs of shared-prompt packed rows, a weighted sum) computed seven
ways, each in its own process so each peak RSS is its own:

- ``graphs``: ``recompute full``. The decoder layers run as the two shared compiled layer graphs; each layer's
  forward is recomputed in its backward (only its input is kept).
- ``eager``: pynative layers (``layer_graphs false``): autodiff keeps every activation, kernels run one
  by one.
- ``jit``: the whole forward + backward compiled (``recompute none``): activations kept, one graph, all
  dimensions dynamic (``layer_graphs.jit_any_shape``: compiled once for every sequence length).
- ``jit_static``: the same graph compiled for the exact input shapes (what ``train_jit`` did before 0b835aa:
  it compiled again for every new sequence length; here every step has the same shapes, so only the first
  compiles).
- ``layer_jit``: each layer compiled on its own and differentiated by pynative autodiff, which keeps the
  graph's forward results for its backward (no recompute, each layer's own graph).
- ``jit_recompute`` / ``jit_half``: the whole-model graph of ``jit`` with every decoder layer (or the first
  half of them) marked ``Cell.recompute()``: MindSpore's own selective recompute inside one compiled graph.

Each mode runs ``--steps`` updates of ``--micro_batches`` micro-batches (``--prompts`` prompts x
``--num_generations`` completions each); the first step compiles and is left out of the mean. The gradient
norm of the first step is printed beside the times: every way computes the same gradients.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MODES = ("graphs", "eager", "jit", "jit_static", "layer_jit", "jit_recompute", "jit_half")


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def _model_dir(name: str, root: Path) -> Path:
    if name == "smollm2":
        from mindrlhf.checkpoint.smollm2 import prepare_smollm2

        return Path(prepare_smollm2())
    if name == "tiny":
        from mindrlhf.testing import make_tiny_qwen2

        return make_tiny_qwen2(root / "tiny", hidden_size=64, intermediate_size=128, max_position_embeddings=1024)
    return Path(name)


def _micro_batches(args, vocab: int):
    """``micro_batches`` micro-batches of ``prompts`` prompts x ``num_generations`` completions (seeded)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(args.micro_batches):
        prompts = np.repeat(rng.integers(1, vocab, (args.prompts, args.prompt_len)), args.num_generations, axis=0)
        rows = args.prompts * args.num_generations
        completions = rng.integers(1, vocab, (rows, args.completion_len)).astype(np.int32)
        ids = np.concatenate([prompts, completions], axis=1)[:, :-1].astype(np.int32)
        out.append({"input_ids": ids, "attention_mask": np.ones_like(ids), "completion_ids": completions,
                    "weights": rng.normal(size=completions.shape).astype(np.float32)})
    return out


def _layer_jit(model) -> None:
    """Run ``model``'s decoder layers as one compiled graph each under pynative autodiff (mode ``layer_jit``)."""
    import mindspore as ms

    def compile_layer(i: int, layer):
        def run(x, rope, bias):
            return layer(x, rope, bias)

        run.__name__ = f"bench_layer_{i}"
        return ms.jit(run)

    compiled = {i: compile_layer(i, model.model.layers[i]) for i in model.layer_range}

    def layers(x, position_ids, bias):
        rope = model.rope_tables(position_ids)
        for i in model.layer_range:
            x = compiled[i](x, ms.mutable(tuple(rope)), ms.mutable(bias) if isinstance(bias, tuple) else bias)
        return x

    model._layers = layers


def _route_matmuls(route: str) -> None:
    """Build the decoder with ``route``'s float32 2-D matmuls (``mindrlhf.models.cpu_matmul``) where it makes
    ``ops.MatMul`` (the linear layers, the vocabulary head, rope's rotation): the prototype wiring, to measure a
    training update with it. Attention's ``BatchMatMul`` stays MindSpore's."""
    import types

    from mindspore import ops

    from mindrlhf.models import cpu_matmul, decoder, tp_layers

    table = cpu_matmul.matmul_ops(route)
    cases = {(False, False): "nn", (False, True): "nt", (True, False): "tn"}

    def matmul(transpose_a: bool = False, transpose_b: bool = False):
        return table[cases[(transpose_a, transpose_b)]]

    proxy = types.ModuleType("ops")
    proxy.__dict__.update(vars(ops))
    proxy.MatMul = matmul
    decoder.ops = tp_layers.ops = proxy


def _mindspore_matmuls() -> None:
    """Undo ``_route_matmuls``: the decoder built from here on uses MindSpore's ``ops.MatMul``."""
    from mindspore import ops

    from mindrlhf.models import decoder, tp_layers

    decoder.ops = tp_layers.ops = ops


def run_mode(args) -> list:
    """One mode in this process: one model per route of ``--cpu_matmul`` (comma-separated routes are built side by
    side and their updates alternate step by step, so a changing machine load hits each alike), ``steps``
    updates each timed; peak RSS (of the whole process: with several routes, of all their models)."""
    import mindspore as ms

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    from mindrlhf.models import load_model
    from mindrlhf.parallel.groups import data_parallel_groups
    from mindrlhf.parallel.pipeline import PipelineRunner

    if args.mode == "jit_static":
        import mindrlhf.parallel.pipeline as pipeline

        pipeline.jit_any_shape = lambda fn, name: ms.jit(fn)
    def loss(logp, weights):
        return (logp * weights).sum() / weights.size, ()

    routes = [r for r in args.cpu_matmul.split(",") if r]
    runners, micro = {}, None
    for route in routes:
        if route != "ms":
            _route_matmuls(route)
        else:
            _mindspore_matmuls()
        model = load_model(args.model_dir)
        if args.mode == "layer_jit":
            _layer_jit(model)
        if args.mode in ("jit_recompute", "jit_half"):
            marked = list(model.layer_range)
            for i in marked[: len(marked) // 2] if args.mode == "jit_half" else marked:
                model.model.layers[i].recompute()
        runners[route] = PipelineRunner(model, data_parallel_groups(0, 1), loss, jit=args.mode.startswith("jit"),
                                        layer_graphs=args.mode == "graphs", share_prompts=True)
        micro = micro or _micro_batches(args, model.config.vocab_size)
    loaded = _peak_gib()
    times, norm = {r: [] for r in routes}, {}
    for _ in range(args.steps):
        for route, runner in runners.items():
            t = time.perf_counter()
            grads, _, _ = runner.loss_and_grads(micro, ["weights"])
            arrays = [g.asnumpy() for g in grads]
            times[route].append(time.perf_counter() - t)
            if route not in norm:
                norm[route] = float(np.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in arrays)))
    from mindrlhf.trainer.memory import MicroBatchExtent, activation_bytes

    extent = MicroBatchExtent.shared_prompts(args.prompts * args.num_generations, args.num_generations,
                                             args.prompt_len, args.completion_len, packed=True)
    out = []
    for route in routes:
        rest = times[route][1:] or times[route]
        name = args.mode if len(routes) == 1 else f"{args.mode} {route}"
        out.append({"mode": name, "step_s": float(np.mean(rest)), "first_s": times[route][0],
                    "steps": times[route], "grad_norm": norm[route], "loaded_gib": loaded, "peak_gib": _peak_gib(),
                    "positions": int(sum(mb["input_ids"].size for mb in micro)),
                    "estimate_gib": activation_bytes(model.config, extent, layers=len(model.layer_range)) / 2 ** 30})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2, tiny, or an HF model directory")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--steps", type=int, default=3)
    # The defaults are the update of bench/peer_trl.py's smollm2 GRPO step: 2 prompts x 4 completions of 160 tokens
    # behind a ~126-token prompt, one prompt per micro-batch.
    p.add_argument("--micro_batches", type=int, default=2)
    p.add_argument("--prompts", type=int, default=1, help="prompts per micro-batch")
    p.add_argument("--num_generations", type=int, default=4, help="completions per prompt")
    p.add_argument("--prompt_len", type=int, default=126)
    p.add_argument("--completion_len", type=int, default=160)
    p.add_argument("--cpu_matmul", default="ms",
                   help="the decoder's 2-D float32 matmuls: MindSpore's (ms) or a mindrlhf.models.cpu_matmul route "
                        "(openblas, numpy); comma-separated (ms,openblas): one model per route in each mode's "
                        "process, their steps alternating")
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--model_dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [r for r in args.cpu_matmul.split(",") if r not in ("ms", "openblas", "numpy")]
    if bad:
        p.error(f"--cpu_matmul: {bad} not among ms, openblas, numpy")
    if args.mode:  # a child process: one mode, its result as the last line
        print(json.dumps(run_mode(args)), flush=True)
        return 0
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"--modes: {bad} not among {MODES}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(args.model, Path(tmp))
        child = [f"--{k}={getattr(args, k)}" for k in ("steps", "micro_batches", "prompts", "num_generations",
                                                        "prompt_len", "completion_len", "cpu_matmul")]
        results = []
        for mode in modes:
            proc = subprocess.run([sys.executable, __file__, *child, "--mode", mode, "--model_dir", str(model_dir)],
                                  cwd=REPO, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{mode}: failed (rc {proc.returncode})\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            results.extend(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"{args.model} (matmuls: {args.cpu_matmul}): {args.micro_batches} micro-batches x {args.prompts} "
          f"prompt(s) x {args.num_generations} "
          f"completions, prompt {args.prompt_len} + completion {args.completion_len} tokens; "
          f"means of steps 2..{args.steps}")
    print("| mode | step s | first step s | peak RSS GiB | RSS after load GiB | grad norm | every step s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['mode']} | {r['step_s']:.2f} | {r['first_s']:.2f} | {r['peak_gib']:.2f} | {r['loaded_gib']:.2f} "
              f"| {r['grad_norm']:.6g} | {', '.join(f'{t:.2f}' for t in r['steps'])} |")
    by_mode = {r["mode"]: r for r in results}
    if "graphs" in by_mode and "jit" in by_mode:  # what recompute auto's estimate says of the same micro-batch
        print(f"no recompute kept {by_mode['jit']['peak_gib'] - by_mode['graphs']['peak_gib']:.2f} GiB more peak "
              f"RSS than the layer graphs; trainer.memory estimates {by_mode['jit']['estimate_gib']:.2f} GiB")
    return 0 if len(results) == len(modes) else 1


if __name__ == "__main__":
    sys.exit(main())

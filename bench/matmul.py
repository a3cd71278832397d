"""float32 matmul routes on CPU against this machine's sgemm peak, in one process.

    python bench/matmul.py                        # everything below, SmolLM2 shapes at 1024 tokens
    python bench/matmul.py --repeats 5 --tokens 512
    python bench/matmul.py --skip settings,mlp    # parts: ops, mlp, bf16, coretype, settings

The peak is numpy's ``matmul`` (the OpenBLAS in numpy's wheel) in the same process; the header names the
kernels OpenBLAS picked (``OPENBLAS_CORETYPE`` in the environment overrides its CPU detection). Every figure is
measured right after a peak measurement of the same product (interleaved), ``--repeats`` times; the table
gives the median GFLOP/s and its range, and the median of the ratios to the adjacent peak, so a shared,
noisy machine still compares routes fairly. Routes:

- ``ms``: MindSpore's ``ops.MatMul`` (oneDNN under MindSpore's thread pool), PyNative and inside ``mindspore.jit``;
- ``numpy``: ``ops.Custom(func_type="pyfunc")`` calling numpy (``mindrlhf.models.cpu_matmul``);
- ``openblas``: ``ops.Custom(func_type="aot")``: a C++ kernel calling numpy's OpenBLAS ``cblas_sgemm64_``
  (built once with g++, the build time is printed).

Parts: ``ops``: the linear-layer products of SmolLM2-135M (hidden 576, intermediate 1536, 9 query / 3 kv heads
of 64, vocabulary 49152) at ``--tokens`` rows, forward ``x Wᵀ`` (nt) and backward ``dX = dY W`` (nn),
``dW = dYᵀ X`` (tn), the sampler's decode shapes (8 rows), and 2048³; ``mlp``: SmolLM2's MLP
(``down(silu(gate(x)) * up(x))``) forward + backward per route, and torch's as a reference; ``settings``:
MindSpore's own knobs (thread count, affinity, oneDNN environment variables), each in a child process
(environment variables are read at start-up), with the peak measured in that child and the float32 product's
error against float64 (``ONEDNN_DEFAULT_FPMATH_MODE=BF16`` would show bfloat16's); ``bf16``: MindSpore's
``MatMul`` on bfloat16 tensors (whether it runs on CPU, its speed against float32 interleaved, its error);
``coretype``: a second copy of numpy's OpenBLAS loaded with ``OPENBLAS_CORETYPE`` unset for that load only (its
own CPU detection), its sgemm against numpy's, interleaved.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# (label, M, K, N) of y = x Wᵀ with x (M, K), W (N, K); ``{t}`` is --tokens, ``{h}`` --head_rows
SMOLLM2 = (("q/o proj", "{t}", 576, 576), ("k/v proj", "{t}", 576, 192), ("gate/up", "{t}", 576, 1536),
           ("down", "{t}", 1536, 576), ("vocab head", "{h}", 576, 49152), ("decode gate/up", 8, 576, 1536),
           ("decode vocab", 8, 576, 49152), ("2048^3", 2048, 2048, 2048))
# MindSpore's own knobs: (label, extra environment, python run in the child before measuring)
SETTINGS = (
    ("default", {}, ""),
    ("threads_num(1)", {}, "ms.device_context.cpu.op_tuning.threads_num(1)"),
    ("threads_num(2)", {}, "ms.device_context.cpu.op_tuning.threads_num(2)"),
    ("threads_num(4)", {}, "ms.device_context.cpu.op_tuning.threads_num(4)"),
    ("set_cpu_affinity(True)", {}, "ms.runtime.set_cpu_affinity(True)"),
    ("OMP_NUM_THREADS=2", {"OMP_NUM_THREADS": "2"}, ""),
    ("ONEDNN_MAX_CPU_ISA=AVX2", {"ONEDNN_MAX_CPU_ISA": "AVX2"}, ""),
    ("ONEDNN_MAX_CPU_ISA=AVX512_CORE_AMX", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, ""),
    ("ONEDNN_DEFAULT_FPMATH_MODE=BF16", {"ONEDNN_DEFAULT_FPMATH_MODE": "BF16"}, ""),
    ("DNNL_PRIMITIVE_CACHE_CAPACITY=4096", {"DNNL_PRIMITIVE_CACHE_CAPACITY": "4096"}, ""),
)


def _time(fn, min_seconds: float) -> float:
    """Seconds per call of ``fn`` (which returns something ``_sync`` waits for), after one warm-up call.

    Each call is waited for: PyNative launches asynchronously, so an unsynchronised loop would queue far more
    than ``min_seconds`` of work (a 2048³ product a few microseconds each) and drain it at the end."""
    _sync(fn())
    calls, start = 0, time.perf_counter()
    while True:
        _sync(fn())
        calls += 1
        if time.perf_counter() - start >= min_seconds:
            break
    return (time.perf_counter() - start) / calls


def _sync(out) -> None:
    # asnumpy waits for the kernel (mindspore.runtime.synchronize does not support CPU in 2.10); the copy of the
    # output it adds is small beside the product for every shape here but the decode ones
    for o in out if isinstance(out, (tuple, list)) else (out,):
        if hasattr(o, "asnumpy"):
            o.asnumpy()


def _np_case(case: str, a, b):
    return {"nt": lambda: a @ b.T, "nn": lambda: a @ b, "tn": lambda: a.T @ b}[case]


def _operands(case: str, m: int, k: int, n: int, rng):
    """Operands of one product of the linear layer ``y (m, n) = x (m, k) Wᵀ``: the forward or a gradient."""
    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)
    if case == "nt":
        return r(m, k), r(n, k), 2.0 * m * k * n  # y = x Wᵀ
    if case == "nn":
        return r(m, n), r(n, k), 2.0 * m * k * n  # dX = dY W
    return r(m, n), r(m, k), 2.0 * m * k * n      # dW = dYᵀ X


def _ms_routes(case: str, jit_too: bool = True):
    """name -> primitive computing the ``case`` product, for every route available here."""
    from mindspore import ops

    from mindrlhf.models import cpu_matmul

    routes = {"ms": {"nt": ops.MatMul(transpose_b=True), "nn": ops.MatMul(),
                     "tn": ops.MatMul(transpose_a=True)}[case]}
    for route in cpu_matmul.ROUTES:
        routes[route] = cpu_matmul.matmul_ops(route)[case]
    return routes


def _call2(prim):
    """``prim(x, y)`` as a function ``mindspore.jit`` can parse (it rejects lambdas built in expressions)."""
    def call(x, y):
        return prim(x, y)
    return call


def _summary(values):
    return statistics.median(values), min(values), max(values)


def _fmt(gf, ratios) -> str:
    med, lo, hi = _summary(gf)
    return f"{med:7.1f} ({lo:.0f}-{hi:.0f})  {statistics.median(ratios):5.0%}"


def _load() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[0] if Path("/proc/loadavg").exists() else "?"


def part_ops(args, peak_out: list) -> None:
    import mindspore as ms
    from mindspore import Tensor

    rng = np.random.default_rng(0)
    modes = ("pynative", "jit")
    print(f"\n## ops: GFLOP/s median (range) and median fraction of the adjacent numpy peak; load {_load()}")
    header = ["shape", "case", "numpy peak"] + [f"{r} {m}" for r in ("ms", "numpy", "openblas") for m in modes]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for label, m, k, n in SMOLLM2:
        if args.shapes and label not in args.shapes.split(","):
            continue
        m = {"{t}": args.tokens, "{h}": args.head_rows}.get(m, m)
        for case in ("nt", "nn", "tn"):
            if label.startswith("decode") and case != "nt":
                continue  # the sampler runs forward only
            a, b, flop = _operands(case, m, k, n, rng)
            ta, tb = Tensor(a), Tensor(b)
            routes = {}
            for name, prim in _ms_routes(case).items():
                routes[f"{name} pynative"] = functools.partial(prim, ta, tb)
                routes[f"{name} jit"] = functools.partial(ms.jit(_call2(prim)), ta, tb)
            peaks, gf, ratio = [], {r: [] for r in routes}, {r: [] for r in routes}
            for _ in range(args.repeats):
                for name, fn in routes.items():
                    peak = flop / _time(_np_case(case, a, b), args.min_time) / 1e9
                    peaks.append(peak)
                    g = flop / _time(fn, args.min_time) / 1e9
                    gf[name].append(g)
                    ratio[name].append(g / peak)
            if label == "2048^3" and case == "nt":
                peak_out.extend(peaks)
            med, lo, hi = _summary(peaks)
            cells = [f"{label} {m}x{k}x{n}", case, f"{med:.0f} ({lo:.0f}-{hi:.0f})"]
            cells += [_fmt(gf[h], ratio[h]) for h in header[3:]]
            print("| " + " | ".join(cells) + " |", flush=True)
    print(f"load after: {_load()}")


def _mlp_numpy_flop(m: int, h: int, i: int) -> float:
    return 3 * 3 * 2.0 * m * h * i  # three matmuls, forward + two gradient products each


def part_mlp(args, peak: list) -> None:
    import mindspore as ms
    from mindspore import Tensor, ops

    from mindrlhf.models import cpu_matmul

    m, h, i = args.tokens, 576, 1536
    rng = np.random.default_rng(1)
    x = rng.standard_normal((m, h)).astype(np.float32)
    wg, wu = (rng.standard_normal((i, h)).astype(np.float32) * 0.04 for _ in range(2))
    wd = rng.standard_normal((h, i)).astype(np.float32) * 0.03
    dy = rng.standard_normal((m, h)).astype(np.float32)
    flop = _mlp_numpy_flop(m, h, i)
    t = [Tensor(v) for v in (x, wg, wu, wd, dy)]
    a_big = rng.standard_normal((2048, 2048)).astype(np.float32)
    b_big = rng.standard_normal((2048, 2048)).astype(np.float32)

    def make(nt):
        def loss(x, wg, wu, wd, dy):
            return (nt(ops.silu(nt(x, wg)) * nt(x, wu), wd) * dy).sum()
        return ms.grad(loss, grad_position=(0, 1, 2, 3))

    runs = {}
    for route, nt in (("ms", ops.MatMul(transpose_b=True)),
                      *((r, cpu_matmul.matmul_ops(r)["nt"]) for r in cpu_matmul.ROUTES)):
        g = make(nt)
        runs[f"{route} pynative"] = (lambda f: lambda: f(*t))(g)
        gj = ms.jit(g)
        runs[f"{route} jit"] = (lambda f: lambda: f(*t))(gj)
    try:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        tt = [torch.tensor(v, requires_grad=j < 4) for j, v in enumerate((x, wg, wu, wd, dy))]

        def torch_step():
            for v in tt[:4]:
                v.grad = None
            f = torch.nn.functional
            y = f.linear(f.silu(f.linear(tt[0], tt[1])) * f.linear(tt[0], tt[2]), tt[3])
            (y * tt[4]).sum().backward()
            return ()
        runs["torch (reference)"] = torch_step
    except ImportError:
        pass
    gf, ratio = {r: [] for r in runs}, {r: [] for r in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            p = 2.0 * 2048 ** 3 / _time(lambda: a_big @ b_big, args.min_time) / 1e9
            peak.append(p)
            g = flop / _time(fn, args.min_time) / 1e9
            gf[name].append(g)
            ratio[name].append(g / p)
    print(f"\n## SmolLM2 MLP forward+backward, {m} tokens (matmul FLOPs {flop / 1e9:.1f} G); "
          f"fraction of the adjacent 2048^3 numpy peak; load {_load()}")
    print("| route | GFLOP/s median (range) | fraction of peak |")
    print("| --- | --- | --- |")
    for name in runs:
        med, lo, hi = _summary(gf[name])
        print(f"| {name} | {med:.1f} ({lo:.0f}-{hi:.0f}) | {statistics.median(ratio[name]):.0%} |", flush=True)


def _rel_err(got, a, b) -> float:
    """Relative Frobenius error of ``got`` against ``a @ b.T`` computed in float64."""
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    return float(np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref))


def part_bf16(args) -> None:
    """MindSpore's ``MatMul`` on bfloat16 tensors on CPU: does it run, its speed against float32 (interleaved), and
    its error against a float64 product of the same (bfloat16-rounded) inputs, beside float32's."""
    import mindspore as ms
    from mindspore import Tensor, ops

    rng = np.random.default_rng(2)
    print(f"\n## bfloat16 MatMul (x Wᵀ) on CPU: GFLOP/s median (range), ratio to float32 adjacent; "
          f"relative error vs float64; load {_load()}")
    print("| shape | mode | float32 GFLOP/s | bfloat16 GFLOP/s | bf16 / f32 | f32 error | bf16 error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    mm = ops.MatMul(transpose_b=True)
    for name, (m, k, n) in (("2048^3", (2048, 2048, 2048)), ("gate/up", (args.tokens, 576, 1536))):
        a, b, flop = _operands("nt", m, k, n, rng)
        # round the inputs to bfloat16 once, so both products see the same numbers and only the arithmetic differs
        a32 = Tensor(a, ms.bfloat16).astype(ms.float32)
        b32 = Tensor(b, ms.bfloat16).astype(ms.float32)
        an, bn = a32.asnumpy(), b32.asnumpy()
        a16, b16 = a32.astype(ms.bfloat16), b32.astype(ms.bfloat16)
        for mode in ("pynative", "jit"):
            call = ms.jit(_call2(mm)) if mode == "jit" else mm
            try:
                out16 = call(a16, b16).astype(ms.float32).asnumpy()
            except Exception as exc:  # noqa: BLE001 - report what MindSpore says and go on
                why = next((x.strip() for x in str(exc).splitlines() if x.strip(" -")), type(exc).__name__)
                print(f"| {name} {m}x{k}x{n} | {mode} | - | fails: {why[:120]} | | | |")
                continue
            f32, f16 = [], []
            for _ in range(args.repeats):
                f32.append(flop / _time(functools.partial(call, a32, b32), args.min_time) / 1e9)
                f16.append(flop / _time(functools.partial(call, a16, b16), args.min_time) / 1e9)
            e32 = _rel_err(call(a32, b32).asnumpy(), an, bn)
            e16 = _rel_err(out16, an, bn)
            ratio = statistics.median(x / y for x, y in zip(f16, f32))
            print(f"| {name} {m}x{k}x{n} | {mode} | {statistics.median(f32):.1f} ({min(f32):.0f}-{max(f32):.0f}) | "
                  f"{statistics.median(f16):.1f} ({min(f16):.0f}-{max(f16):.0f}) | {ratio:.0%} | {e32:.1e} | "
                  f"{e16:.1e} |", flush=True)


def _second_openblas(tmp: Path):
    """A second copy of numpy's OpenBLAS, loaded with ``OPENBLAS_CORETYPE`` removed from the environment for that
    load only (OpenBLAS reads it when the library initialises): ``(library, kernels it picked)``. The copy has its
    own file (the dynamic loader would return numpy's already loaded one for the same file) and its own threads."""
    import ctypes
    import shutil

    from mindrlhf.models import cpu_matmul

    copy = tmp / "libopenblas_second.so"
    shutil.copy2(cpu_matmul.numpy_openblas(), copy)
    saved = os.environ.pop("OPENBLAS_CORETYPE", None)
    try:
        lib = ctypes.CDLL(str(copy))
    finally:
        if saved is not None:
            os.environ["OPENBLAS_CORETYPE"] = saved
    lib.openblas_get_corename64_.restype = ctypes.c_char_p
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.cblas_sgemm64_.argtypes = [ctypes.c_int] * 3 + [i64] * 3 + [f32, ptr, i64, ptr, i64, f32, ptr, i64]
    return lib, lib.openblas_get_corename64_().decode()


def part_coretype(args) -> None:
    """Whether a second OpenBLAS, loaded with ``OPENBLAS_CORETYPE`` unset for that load only, beats numpy's (which
    runs the kernels the environment asks for): its sgemm through ctypes, interleaved with numpy's."""
    import tempfile

    from mindrlhf.models import cpu_matmul

    with tempfile.TemporaryDirectory() as tmp:
        lib, core = _second_openblas(Path(tmp))
        print(f"\n## a second OpenBLAS loaded with OPENBLAS_CORETYPE unset (kernels {core}) against numpy's "
              f"(kernels {cpu_matmul.openblas_core()}, OPENBLAS_CORETYPE="
              f"{os.environ.get('OPENBLAS_CORETYPE', 'unset')}); x Wᵀ GFLOP/s median (range); load {_load()}")
        print("| shape | numpy | second OpenBLAS | ratio | max abs difference |")
        print("| --- | --- | --- | --- | --- |")
        rng = np.random.default_rng(3)
        for name, (m, k, n) in (("2048^3", (2048, 2048, 2048)), ("gate/up", (args.tokens, 576, 1536)),
                                ("down", (args.tokens, 1536, 576)), ("k/v proj", (args.tokens, 576, 192))):
            a, b, flop = _operands("nt", m, k, n, rng)
            c = np.empty((m, n), np.float32)

            # row-major (101), A as is (111), B transposed (112): c = a bᵀ
            second = functools.partial(lib.cblas_sgemm64_, 101, 111, 112, m, n, k, 1.0, a.ctypes.data, k,
                                       b.ctypes.data, k, 0.0, c.ctypes.data, n)
            g_np, g_2 = [], []
            for _ in range(args.repeats):
                g_np.append(flop / _time(_np_case("nt", a, b), args.min_time) / 1e9)
                g_2.append(flop / _time(second, args.min_time) / 1e9)
            second()
            diff = float(np.abs(c - a @ b.T).max())
            ratio = statistics.median(y / x for x, y in zip(g_np, g_2))
            print(f"| {name} {m}x{k}x{n} | {statistics.median(g_np):.0f} ({min(g_np):.0f}-{max(g_np):.0f}) | "
                  f"{statistics.median(g_2):.0f} ({min(g_2):.0f}-{max(g_2):.0f}) | {ratio:.0%} | {diff:.1e} |",
                  flush=True)


def settings_child(label: str, args) -> None:
    """In a child process: MindSpore's matmul under one setting, each figure next to a numpy peak."""
    import mindspore as ms
    from mindspore import Tensor, ops

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    setup = dict((s[0], s[2]) for s in SETTINGS)[label]
    if setup:
        exec(setup, {"ms": ms})  # noqa: S102 - one of the fixed SETTINGS lines above
    rng = np.random.default_rng(0)
    out = {}
    for name, (m, k, n) in (("2048^3", (2048, 2048, 2048)), ("gate/up", (args.tokens, 576, 1536))):
        a, b, flop = _operands("nt", m, k, n, rng)
        ta, tb = Tensor(a), Tensor(b)
        mm = ops.MatMul(transpose_b=True)
        for mode, fn in (("pynative", functools.partial(mm, ta, tb)),
                         ("jit", functools.partial(ms.jit(_call2(mm)), ta, tb))):
            gf, ratio = [], []
            for _ in range(args.repeats):
                p = flop / _time(_np_case("nt", a, b), args.min_time) / 1e9
                g = flop / _time(fn, args.min_time) / 1e9
                gf.append(g)
                ratio.append(g / p)
            out[f"{name} {mode}"] = (gf, ratio)
            out[f"{name} {mode} error"] = _rel_err(fn().asnumpy(), a, b)
    print("RESULT " + json.dumps(out))


def part_settings(args) -> None:
    print(f"\n## MindSpore's own settings (each in a child process; ms MatMul x Wᵀ); load {_load()}")
    cols = ["2048^3 pynative", "2048^3 jit", "gate/up pynative", "gate/up jit"]
    print("| setting | " + " | ".join(cols) + " | error vs float64 (2048^3 jit) |")
    print("|" + " --- |" * (len(cols) + 2))
    for label, env, _ in SETTINGS:
        cmd = [sys.executable, __file__, "--settings_child", label, "--repeats", str(args.repeats),
               "--min_time", str(args.min_time), "--tokens", str(args.tokens)]
        done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"| {label} | failed: {done.stderr.strip().splitlines()[-1:]} |")
            continue
        res = json.loads(line[len("RESULT "):])
        print(f"| {label} | " + " | ".join(_fmt(*res[c]) for c in cols) + f" | {res['2048^3 jit error']:.1e} |",
              flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024, help="rows of the SmolLM2 products (tokens of a micro-batch)")
    ap.add_argument("--head_rows", type=int, default=256,
                    help="rows of the vocabulary-head products (58 GFLOP each at 1024 rows: slow to repeat)")
    ap.add_argument("--shapes", default="", help="comma-separated labels of the ops part's shapes (default: all)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved measurements of each figure")
    ap.add_argument("--min_time", type=float, default=0.3, help="seconds of calls per measurement")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: ops, mlp, bf16, coretype, settings")
    ap.add_argument("--settings_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.settings_child:
        settings_child(args.settings_child, args)
        return
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    from mindrlhf.models import cpu_matmul

    skip = set(filter(None, args.skip.split(",")))
    cpu_matmul.build_openblas_kernel()
    print(f"# CPU float32 matmul routes: {os.cpu_count()} CPUs, MindSpore {ms.__version__}, numpy {np.__version__} "
          f"({cpu_matmul.numpy_openblas().name}, kernels {cpu_matmul.openblas_core()}, "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}); "
          f"OpenBLAS kernel build {cpu_matmul.last_build_seconds:.2f} s "
          f"(0.00 = cached); load {_load()}")
    peak: list = []
    if "ops" not in skip:
        part_ops(args, peak)
    if "mlp" not in skip:
        part_mlp(args, peak)
    if peak:
        med, lo, hi = _summary(peak)
        print(f"\nnumpy sgemm peak 2048^3 in this run: {med:.0f} GFLOP/s (range {lo:.0f}-{hi:.0f})")
    if "bf16" not in skip:
        part_bf16(args)
    if "coretype" not in skip:
        part_coretype(args)
    if "settings" not in skip:
        part_settings(args)
    print(f"load at the end: {_load()}")


if __name__ == "__main__":
    main()

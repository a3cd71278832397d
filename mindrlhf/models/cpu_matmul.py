"""float32 matmuls on CPU through the OpenBLAS numpy ships, as MindSpore ``Custom`` ops with their own backward.

On the issue's Xeon MindSpore 2.10's CPU ``MatMul`` (oneDNN under MindSpore's thread pool) ran float32 products
at about a third of numpy's OpenBLAS in the same process; on the Zen 5 measured since, it reaches 62-83% of
OpenBLAS's own AVX-512 kernels in compiled graphs (bench/README.md). This module wraps that BLAS in three
``ops.Custom`` primitives, one per transpose case of ``C = op(A) op(B)`` with 2-D
operands (``nn`` ``A B``, ``nt`` ``A Bᵀ`` -- the linear layers' forward --, ``tn`` ``Aᵀ B``), each with a
bprop made of the other two, so gradients flow through them in PyNative, ``mindspore.jit`` and the layer graphs.

Two routes (``matmul_ops(route)``):

- ``"openblas"``: ``Custom(func_type="aot")``: a small C++ kernel (``csrc/cpu_matmul.cc``) calling
  ``cblas_sgemm64_`` of ``numpy.libs/libopenblas64_*.so``, compiled with ``g++`` once and cached under
  ``$MINDRLHF_CACHE`` (default ``~/.cache/mindrlhf``) by a hash of the source, the library and the compiler.
- ``"numpy"``: ``Custom(func_type="pyfunc")``: the kernel calls back into Python (``numpy.matmul``); no
  compiler, but the Python call and the GIL cost per call.

A measured prototype, not used by the decoder: the SmolLM2 update ran slower with it (bench/README.md), so
the layers keep ``ops.MatMul``. CPU only (on other targets ``matmul_ops`` refuses).
"""
from __future__ import annotations

import glob
import hashlib
import os
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, Optional

import numpy as np

from mindrlhf.errors import MindRLHFError

ROUTES = ("numpy", "openblas")
CASES = ("nn", "nt", "tn")
_SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_matmul.cc"
_OPS: Dict[str, Dict[str, Callable]] = {}
#: seconds the last ``build_openblas_kernel`` spent compiling (0.0 when the cached library was reused)
last_build_seconds = 0.0


def numpy_openblas() -> Path:
    """The OpenBLAS shared library inside numpy's wheel (``numpy.libs/libopenblas64_*.so``)."""
    libs = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    found = sorted(glob.glob(str(libs / "libopenblas64_*.so")))
    if not found:
        raise MindRLHFError(f"no libopenblas64_*.so in {libs}: this numpy wheel does not ship OpenBLAS; "
                            "install numpy from PyPI's manylinux wheels or turn the OpenBLAS matmul route off")
    return Path(found[0])


def openblas_core() -> str:
    """The kernel family numpy's OpenBLAS picked for this CPU (``OPENBLAS_CORETYPE`` overrides its detection)."""
    import ctypes

    lib = ctypes.CDLL(str(numpy_openblas()))  # numpy already loaded it: the same handle, the same choice
    lib.openblas_get_corename64_.restype = ctypes.c_char_p
    return lib.openblas_get_corename64_().decode()


def _cache_dir() -> Path:
    return Path(os.environ.get("MINDRLHF_CACHE", Path.home() / ".cache" / "mindrlhf")) / "cpu_matmul"


def build_openblas_kernel() -> Path:
    """Compile ``csrc/cpu_matmul.cc`` against numpy's OpenBLAS (cached); the shared library's path."""
    global last_build_seconds
    blas = numpy_openblas()
    try:
        cxx = subprocess.run(["g++", "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise MindRLHFError(f"the OpenBLAS matmul route needs g++ to build its kernel ({exc}); "
                            "install g++ or turn the route off") from exc
    key = hashlib.sha256(_SOURCE.read_bytes() + str(blas).encode() + cxx.encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_matmul_{key}.so"
    last_build_seconds = 0.0
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    start = time.perf_counter()
    cmd = ["g++", "-O2", "-std=c++17", "-shared", "-fPIC", str(_SOURCE), "-o", str(tmp),
           str(blas), f"-Wl,-rpath,{blas.parent}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise MindRLHFError(f"building the OpenBLAS matmul kernel failed: {done.stderr.strip()[:300]}; "
                            "turn the route off")
    os.replace(tmp, out)  # atomic: concurrent ranks building the same key agree on the result
    last_build_seconds = time.perf_counter() - start
    return out


def _shape(case: str) -> Callable:
    if case == "nn":
        return lambda a, b: [a[0], b[1]]
    if case == "nt":
        return lambda a, b: [a[0], b[0]]
    return lambda a, b: [a[1], b[1]]


def _numpy_func(case: str) -> Callable:
    # pyfunc kernels get numpy arrays; transposed views are fine for np.matmul (OpenBLAS handles the layout)
    if case == "nn":
        return lambda a, b: np.matmul(a, b)
    if case == "nt":
        return lambda a, b: np.matmul(a, b.T)
    return lambda a, b: np.matmul(a.T, b)


def _make_ops(route: str) -> Dict[str, Callable]:
    import mindspore as ms
    from mindspore import ops

    table: Dict[str, Callable] = {}
    lib = build_openblas_kernel() if route == "openblas" else None

    # C = op(A) op(B): each gradient is again one of the three cases (no explicit transposes)
    def bprop_nn(a, b, out, dout):
        return table["nt"](dout, b), table["tn"](a, dout)

    def bprop_nt(a, b, out, dout):
        return table["nn"](dout, b), table["tn"](dout, a)

    def bprop_tn(a, b, out, dout):
        return table["nt"](b, dout), table["nn"](a, dout)

    bprops = {"nn": bprop_nn, "nt": bprop_nt, "tn": bprop_tn}
    for case in CASES:
        if route == "openblas":
            # out_shape None: the kernel's C++ MatMul*InferShape, which dynamic-shape graphs need
            # (the C++ infer path reads the op's registration, so it is given one: float32, CPU)
            reg = (ops.CustomRegOp(f"mindrlhf_cpu_matmul_{case}").input(0, "a").input(1, "b").output(0, "y")
                   .dtype_format(ops.DataType.F32_Default, ops.DataType.F32_Default, ops.DataType.F32_Default)
                   .target("CPU").get_op_info())
            table[case] = ops.Custom(f"{lib}:MatMul{case.upper()}", out_shape=None, out_dtype=ms.float32,
                                     func_type="aot", bprop=bprops[case], reg_info=reg)
        else:
            table[case] = ops.Custom(_numpy_func(case), out_shape=_shape(case), out_dtype=lambda a, b: a,
                                     func_type="pyfunc", bprop=bprops[case])
    return table


def matmul_ops(route: str = "openblas") -> Dict[str, Callable]:
    """The ``{"nn", "nt", "tn"}`` float32 2-D matmul primitives of ``route`` (built once per process).

    ``nt(x, w)`` is a linear layer's ``x wᵀ`` with ``w`` stored ``(out, in)``. CPU only."""
    import mindspore as ms

    if route not in ROUTES:
        raise MindRLHFError(f"unknown CPU matmul route {route!r}; use one of {', '.join(ROUTES)}")
    target = ms.get_context("device_target")
    if target != "CPU":
        raise MindRLHFError(f"the {route} matmul route runs on CPU only, but device_target is {target}; "
                            "use MindSpore's MatMul there")
    if route not in _OPS:
        _OPS[route] = _make_ops(route)
    return _OPS[route]


def linear(x, weight, route: Optional[str] = "openblas"):
    """``x @ weightᵀ`` over the last axis of ``x`` (any leading shape), ``weight`` ``(out, in)``."""
    nt = matmul_ops(route)["nt"]
    y = nt(x.reshape(-1, x.shape[-1]), weight)
    return y.reshape(x.shape[:-1] + (weight.shape[0],))

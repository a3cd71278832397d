"""The CPU matmul routes of ``mindrlhf.models.cpu_matmul``: forward and both gradients equal MindSpore's
``MatMul`` to float32 rounding, in PyNative, in ``mindspore.jit`` and in the layer graphs' all-dynamic-shape jit."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

from mindrlhf.errors import MindRLHFError
from mindrlhf.models import cpu_matmul
from mindrlhf.models.layer_graphs import jit_any_shape

RTOL = 1e-5


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    # the compiled kernel goes to a test-session folder, not the user's ~/.cache
    monkeypatch.setenv("MINDRLHF_CACHE", str(tmp_path_factory.getbasetemp() / "mindrlhf_cache"))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _mlp_grads(nt, x, wg, wu, wd, dy):
    """Gradients of ``sum(down(silu(gate x) * up x) * dy)`` w.r.t. x and the three weights, through ``nt``."""
    def loss(x, wg, wu, wd, dy):
        return (nt(ops.silu(nt(x, wg)) * nt(x, wu), wd) * dy).sum()
    return loss, ms.grad(loss, grad_position=(0, 1, 2, 3))


def _weighted(op, dout):
    """``sum(op(a, b) * dout)``: its gradients are op's backward applied to ``dout``."""
    def f(a, b):
        return (op(a, b) * dout).sum()
    return f


def _inputs(m=37, h=48, i=80, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, h)).astype(np.float32)
    wg, wu = (rng.standard_normal((i, h)).astype(np.float32) * 0.2 for _ in range(2))
    wd = rng.standard_normal((h, i)).astype(np.float32) * 0.2
    dy = rng.standard_normal((m, h)).astype(np.float32)
    return [Tensor(v) for v in (x, wg, wu, wd, dy)]


@pytest.mark.parametrize("route", cpu_matmul.ROUTES)
def test_each_case_and_its_gradients_equal_mindspores_matmul(route):
    """nn / nt / tn forward and d/dA, d/dB against ops.MatMul with the same transposes, PyNative and jit."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    table = cpu_matmul.matmul_ops(route)
    rng = np.random.default_rng(1)
    shapes = {"nn": ((33, 20), (20, 50)), "nt": ((33, 20), (50, 20)), "tn": ((20, 33), (20, 50))}
    for case, (sa, sb) in shapes.items():
        a, b = (Tensor(rng.standard_normal(s).astype(np.float32)) for s in (sa, sb))
        dout = Tensor(rng.standard_normal((33, 50)).astype(np.float32))
        ref_op = ops.MatMul(transpose_a=case == "tn", transpose_b=case == "nt")
        ours, ref = table[case](a, b), ref_op(a, b)
        assert ours.shape == ref.shape == (33, 50)
        assert _rel(ours.asnumpy(), ref.asnumpy()) <= RTOL

        f, f_ref = _weighted(table[case], dout), _weighted(ref_op, dout)
        want = ms.grad(f_ref, (0, 1))(a, b)
        for got in (ms.grad(f, (0, 1))(a, b), ms.jit(ms.grad(f, (0, 1)))(a, b)):
            for g, w in zip(got, want):
                assert g.shape == w.shape
                assert _rel(g.asnumpy(), w.asnumpy()) <= RTOL, (route, case)


@pytest.mark.parametrize("route", cpu_matmul.ROUTES)
def test_mlp_gradients_equal_mindspores_in_pynative_jit_and_dynamic_shape_jit(route):
    """A SwiGLU MLP (the decoder's) through the route: all four gradients match MindSpore's MatMul, for two
    sequence lengths, and (openblas) also in the layer graphs' compile (``jit_any_shape``: every dim dynamic)."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    nt = cpu_matmul.matmul_ops(route)["nt"]
    _, grad = _mlp_grads(nt, *_inputs())
    _, grad_ref = _mlp_grads(ops.MatMul(transpose_b=True), *_inputs())
    runs = [grad, ms.jit(grad)]
    if route == "openblas":
        # the aot kernel infers its shape in C++, so graphs compiled for any shape take it; a pyfunc op's
        # Python shape function is not re-run for dynamic shapes (MindSpore 2.10 fails inside its infer)
        runs.append(jit_any_shape(grad, f"cpu_matmul_test_mlp_{route}"))
    for m in (37, 21):
        args = _inputs(m=m, seed=m)
        want = grad_ref(*args)
        for got in (run(*args) for run in runs):
            for g, w in zip(got, want):
                assert g.shape == w.shape
                assert _rel(g.asnumpy(), w.asnumpy()) <= RTOL, (route, m)


def test_linear_keeps_leading_axes_and_the_kernel_build_is_cached():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    lib = cpu_matmul.build_openblas_kernel()
    assert cpu_matmul.build_openblas_kernel() == lib and cpu_matmul.last_build_seconds == 0.0
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 5, 12)).astype(np.float32)
    w = rng.standard_normal((7, 12)).astype(np.float32)
    y = cpu_matmul.linear(Tensor(x), Tensor(w))
    assert y.shape == (2, 5, 7)
    assert _rel(y.asnumpy(), x @ w.T) <= RTOL


def test_unknown_route_is_one_line_error():
    with pytest.raises(MindRLHFError, match="unknown CPU matmul route 'mkl'"):
        cpu_matmul.matmul_ops("mkl")

"""What a LoRA adapter costs in one projection's forward + backward, against the same linear trained in full.

    python bench/lora_linear.py            # SmolLM2's MLP up-projection, 1920 rows (a GRPO micro-batch)
    python bench/lora_linear.py --rows 1200 --din 576 --dout 576 --rank 16

One compiled ``mindspore.jit`` graph per variant, each the gradient of ``sum(y * dy)`` for a fixed upstream
gradient ``dy``, timed interleaved (variant after variant, ``--reps`` rounds, medians), float32 on CPU:

- ``frozen``: ``y = x W^T``, gradient of ``x`` only: what a frozen base costs (forward and input gradient).
- ``lora``: ``y = x W^T + ((x A^T) * s) B^T`` (the adapted linear as ``models.tp_layers`` computes it), gradients
  of ``x``, ``A`` and ``B``: what a LoRA layer costs.
- ``lora_outer``: the same with the scale on the ``(rows, out)`` product, ``((x A^T) B^T) * s`` (the order before
  the scale moved to the rank-r intermediate).
- ``merged``: ``y = x (W + s B A)^T`` in one product, with a hand-written backward (``dx = dy (W + s B A)``,
  ``dA = s (dy B)^T x``, ``dB = s dy^T (x A^T)``) so that the merged weight's full gradient is never formed.
- ``full``: ``y = x W^T``, gradients of ``x`` and ``W``: the full fine-tune of the linear.

``lora / full`` is the part of a training step's matmul time LoRA keeps; ``(lora - frozen) / frozen`` the adapter's
own overhead (its skinny rank-r products and the elementwise passes over ``(rows, out)``).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

import numpy as np


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1920, help="token positions of the micro-batch")
    p.add_argument("--din", type=int, default=576, help="input features")
    p.add_argument("--dout", type=int, default=1536, help="output features")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)

    import mindspore as ms
    from mindspore import Tensor, nn, ops

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    mm = ops.MatMul(transpose_b=True)
    rng = np.random.default_rng(0)

    def t(*shape, scale=1.0):
        return Tensor((rng.standard_normal(shape) * scale).astype(np.float32))

    x, w = t(args.rows, args.din), t(args.dout, args.din, scale=args.din ** -0.5)
    a, b = t(args.rank, args.din, scale=args.din ** -0.5), t(args.dout, args.rank, scale=args.rank ** -0.5)
    dy, s = t(args.rows, args.dout), 2.0

    def plain(x, w, a, b):
        return (mm(x, w) * dy).sum()

    def lora(x, w, a, b):
        return ((mm(x, w) + mm(mm(x, a) * s, b)) * dy).sum()

    def lora_outer(x, w, a, b):
        return ((mm(x, w) + mm(mm(x, a), b) * s) * dy).sum()

    mm_nn, mm_tn = ops.MatMul(), ops.MatMul(transpose_a=True)

    class Merged(nn.Cell):
        """``x (W + s B A)^T``; the backward forms dx, dA and dB only."""

        def construct(self, x, w, a, b):
            return mm(x, w + mm_nn(b * s, a))

        def bprop(self, x, w, a, b, out, dout):
            dyb = mm_nn(dout, b) * s
            return (mm_nn(dout, w + mm_nn(b * s, a)), ops.zeros_like(w), mm_tn(dyb, x),
                    mm_tn(dout, mm(x, a)) * s)

    merged_cell = Merged()

    def merged(x, w, a, b):
        return (merged_cell(x, w, a, b) * dy).sum()

    variants = {"frozen": ms.jit(ms.grad(plain, 0)), "lora": ms.jit(ms.grad(lora, (0, 2, 3))),
                "lora_outer": ms.jit(ms.grad(lora_outer, (0, 2, 3))), "merged": ms.jit(ms.grad(merged, (0, 2, 3))),
                "full": ms.jit(ms.grad(plain, (0, 1)))}
    # The merged variant computes the same gradients (to float32 rounding).
    ref, got = variants["lora"](x, w, a, b), variants["merged"](x, w, a, b)
    err = max(float(np.abs(g.asnumpy() - r.asnumpy()).max() / np.abs(r.asnumpy()).max()) for g, r in zip(got, ref))
    times = {name: [] for name in variants}
    for rep in range(args.reps + 1):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            out = fn(x, w, a, b)
            (out[0] if isinstance(out, tuple) else out).asnumpy()
            if rep:  # the first round compiles
                times[name].append(time.perf_counter() - t0)
    med = {name: float(np.median(v)) * 1e3 for name, v in times.items()}
    gflop = 2 * args.rows * args.din * args.dout / 1e9
    print(f"rows {args.rows}, {args.din} -> {args.dout}, rank {args.rank}; one x W^T = {gflop:.2f} GFLOP; "
          f"medians of {args.reps} interleaved rounds")
    for name, ms_ in med.items():
        print(f"  {name:10s} {ms_:8.2f} ms")
    print(f"lora / full {med['lora'] / med['full']:.3f}; adapter overhead (lora - frozen) / frozen "
          f"{(med['lora'] - med['frozen']) / med['frozen']:.3f}; scale on the rank-r intermediate / on the "
          f"(rows, out) product {med['lora'] / med['lora_outer']:.3f}")
    print(f"merged / lora {med['merged'] / med['lora']:.3f}; merged overhead (merged - frozen) / frozen "
          f"{(med['merged'] - med['frozen']) / med['frozen']:.3f}; merged gradients against lora's: max-element "
          f"error {err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

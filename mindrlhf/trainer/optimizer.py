"""AdamW with bias correction (the update of ``torch.optim.AdamW``), in MindSpore.

MindSpore's ``nn.AdamWeightDecay`` omits bias correction (its first step moves weights by
≈ 3.16 × lr with β2 = 0.999) and compiles its update at the first call, after which a new learning
rate written into its Parameter is not seen. Here the learning rate is a call argument and all
state is updated in place, so nothing goes stale and resumed runs continue bit-exactly.
"""
from __future__ import annotations

from typing import Dict, Sequence

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops


class AdamW(nn.Cell):
    """Decoupled weight decay Adam: p ← p − lr·wd·p − lr·m̂/(√v̂ + ε), with m̂, v̂ bias-corrected."""

    def __init__(self, params: Sequence[Parameter], *, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decay_filter=lambda p: len(p.shape) >= 2):
        super().__init__(auto_prefix=False)
        self.params = list(params)
        self.beta1, self.beta2, self.eps = float(betas[0]), float(betas[1]), float(eps)
        self.decay = [float(weight_decay) if decay_filter(p) else 0.0 for p in self.params]
        self.exp_avg = ms.ParameterTuple([Parameter(ops.zeros(p.shape, ms.float32), name=f"adam_m.{p.name}",
                                                    requires_grad=False) for p in self.params])
        self.exp_avg_sq = ms.ParameterTuple([Parameter(ops.zeros(p.shape, ms.float32), name=f"adam_v.{p.name}",
                                                       requires_grad=False) for p in self.params])
        self.step = Parameter(Tensor(np.zeros((), np.int32)), name="adam_step", requires_grad=False)

    def apply(self, grads: Sequence[Tensor], lr: float) -> None:
        """One update of every parameter with ``grads`` (same order as the params)."""
        t = int(self.step.asnumpy()) + 1
        self.step.copy_(Tensor(np.int32(t)))
        c1, c2 = 1.0 - self.beta1 ** t, 1.0 - self.beta2 ** t
        step_size = lr / c1
        for p, g, m, v, wd in zip(self.params, grads, self.exp_avg, self.exp_avg_sq, self.decay):
            g = g.astype(ms.float32)
            m.copy_(m * self.beta1 + g * (1.0 - self.beta1))
            v.copy_(v * self.beta2 + ops.square(g) * (1.0 - self.beta2))
            w = p.value().astype(ms.float32)
            if wd:
                w = w * (1.0 - lr * wd)
            w = w - step_size * m / (ops.sqrt(v / c2) + self.eps)
            p.copy_(w.astype(p.dtype))

    def state(self) -> Dict[str, Parameter]:
        """Moments and step counter by name (for checkpoints)."""
        out = {m.name: m for m in self.exp_avg}
        out.update({v.name: v for v in self.exp_avg_sq})
        out[self.step.name] = self.step
        return out

"""AdamW with bias correction (the update of ``torch.optim.AdamW``) on float32 master weights.

MindSpore's ``nn.AdamWeightDecay`` omits bias correction (its first step moves weights by
≈ 3.16 × lr with β2 = 0.999) and compiles its update at the first call, after which a new learning
rate written into its Parameter is not seen. Here the learning rate is a call argument and all
state is updated in place, so nothing goes stale and resumed runs continue bit-exactly.

Mixed precision: the model computes in its dtype (bf16 on Ascend, fp16 or fp32 on CPU), but the
update is made on float32 master weights held here, and the model's low-precision copy is then
refreshed from them. An Adam step is often far below a bf16/fp16 weight's spacing (bf16 near 1.0:
7.8e-3; a step at lr 5e-7: ~5e-7), so updating the low-precision weights directly loses it. A
float32 parameter is its own master (no copy, no extra memory).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindrlhf.errors import MindRLHFError


class AdamW(nn.Cell):
    """Decoupled weight decay Adam: w ← w − lr·wd·w − lr·m̂/(√v̂ + ε) on float32 masters w."""

    def __init__(self, params: Sequence[Parameter], *, masters: Optional[Sequence[Parameter]] = None,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 decay_filter=lambda p: len(p.shape) >= 2):
        """``params``: the model's parameters (any dtype). ``masters``: their float32 masters in the
        same order (e.g. a float32 copy of the model loaded from the checkpoint file); by default a
        float32 parameter is its own master and a low-precision one gets a float32 copy of itself."""
        super().__init__(auto_prefix=False)
        self.params = list(params)
        if masters is None:
            masters = [p if p.dtype == ms.float32 else
                       Parameter(p.value().astype(ms.float32), name=f"master.{p.name}", requires_grad=False)
                       for p in self.params]
        masters = list(masters)
        if len(masters) != len(self.params):
            raise MindRLHFError(f"{len(masters)} master weights for {len(self.params)} parameters")
        for p, w in zip(self.params, masters):
            if w.dtype != ms.float32 or tuple(w.shape) != tuple(p.shape) or w.name not in (p.name, f"master.{p.name}"):
                raise MindRLHFError(f"master weight of {p.name}: need a float32 {tuple(p.shape)} tensor of that "
                                    f"name, got {w.name} {w.dtype} {tuple(w.shape)}")
            if w is not p and w.name == p.name:  # a Cell's parameters need unique names
                w.name = f"master.{p.name}"
        self.masters = masters
        self.beta1, self.beta2, self.eps = float(betas[0]), float(betas[1]), float(eps)
        self.decay = [float(weight_decay) if decay_filter(p) else 0.0 for p in self.params]
        self.exp_avg = ms.ParameterTuple([Parameter(ops.zeros(p.shape, ms.float32), name=f"adam_m.{p.name}",
                                                    requires_grad=False) for p in self.params])
        self.exp_avg_sq = ms.ParameterTuple([Parameter(ops.zeros(p.shape, ms.float32), name=f"adam_v.{p.name}",
                                                       requires_grad=False) for p in self.params])
        self.step = Parameter(Tensor(np.zeros((), np.int32)), name="adam_step", requires_grad=False)
        self._fused = ops.AdamWeightDecay()

    def apply(self, grads: Sequence[Tensor], lr: float, grad_scale: float = 1.0) -> None:
        """One update of every parameter with ``grads`` (same order as the params), each multiplied
        by ``grad_scale`` first (gradient clipping, one tensor at a time)."""
        t = int(self.step.asnumpy()) + 1
        self.step.copy_(Tensor(np.int32(t)))
        c1, c2 = 1.0 - self.beta1 ** t, 1.0 - self.beta2 ** t
        # MindSpore's fused AdamWeightDecay kernel updates w, m, v in place (no temporaries the size
        # of a parameter) as w -= lr'·(m/(√v + ε') + wd'·w). Bias correction and decoupled decay
        # fold into its scalars: lr' = lr·√c2/c1, ε' = ε·√c2, wd' = lr·wd/lr', which gives
        # w·(1 - lr·wd) - lr/c1 · m/(√(v/c2) + ε), torch's AdamW.
        lr_op = lr * math.sqrt(c2) / c1
        scalars = [Tensor(np.float32(x)) for x in (lr_op, self.beta1, self.beta2, self.eps * math.sqrt(c2))]
        decays: Dict[float, Tensor] = {}
        for p, w, g, m, v, wd in zip(self.params, self.masters, grads, self.exp_avg, self.exp_avg_sq, self.decay):
            if wd not in decays:
                decays[wd] = Tensor(np.float32(lr * wd / lr_op if lr_op else 0.0))
            g = g if g.dtype == ms.float32 else g.astype(ms.float32)
            if grad_scale != 1.0:
                g = g * grad_scale
            self._fused(w, m, v, *scalars, decays[wd], g)
            if w is not p:  # in place: compiled graphs keep reading the model's storage
                p.copy_(w.value().astype(p.dtype))

    def refresh(self) -> None:
        """Write the masters into the model's low-precision copies (after loading masters)."""
        for p, w_master in zip(self.params, self.masters):
            if w_master is not p:
                p.copy_(w_master.value().astype(p.dtype))

    def master_weights(self) -> Dict[str, Parameter]:
        """The float32 master of each parameter, by the parameter's (HF) name."""
        return {p.name: w for p, w in zip(self.params, self.masters)}

    def state(self) -> Dict[str, Parameter]:
        """Moments and step counter by name (for checkpoints)."""
        out = {m.name: m for m in self.exp_avg}
        out.update({v.name: v for v in self.exp_avg_sq})
        out[self.step.name] = self.step
        return out

"""Our AdamW equals torch.optim.AdamW step by step (bias correction, decoupled decay, lr changes)."""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor

from mindrlhf.trainer.optimizer import AdamW


def test_adamw_matches_torch_over_steps_with_changing_lr():
    import torch

    rng = np.random.default_rng(0)
    w0 = {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    grads = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in w0.items()} for _ in range(4)]
    lrs = [1e-2, 5e-3, 0.0, 2e-2]  # includes lr = 0: the weights must not move at all that step

    tw = torch.nn.Parameter(torch.tensor(w0["w"]))
    tb = torch.nn.Parameter(torch.tensor(w0["b"]))
    topt = torch.optim.AdamW([{"params": [tw], "weight_decay": 0.1}, {"params": [tb], "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    mw, mb = Parameter(Tensor(w0["w"]), name="w"), Parameter(Tensor(w0["b"]), name="b")
    opt = AdamW([mw, mb], betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)  # 1-D params are not decayed
    for g, lr in zip(grads, lrs):
        for group in topt.param_groups:
            group["lr"] = lr
        tw.grad, tb.grad = torch.tensor(g["w"]), torch.tensor(g["b"])
        topt.step()
        before = mw.asnumpy().copy()
        opt.apply((Tensor(g["w"]), Tensor(g["b"])), lr)
        if lr == 0.0:
            np.testing.assert_array_equal(mw.asnumpy(), before)
        np.testing.assert_allclose(mw.asnumpy(), tw.detach().numpy(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(mb.asnumpy(), tb.detach().numpy(), rtol=1e-5, atol=1e-7)
    assert int(opt.state()["adam_step"].asnumpy()) == 4


def test_in_place_updates_reach_compiled_graphs():
    w = Parameter(Tensor(np.ones(3, np.float32)), name="w")

    def scale(x):
        return x * w

    f = ms.jit(scale)
    x = Tensor(np.ones(3, np.float32))
    np.testing.assert_array_equal(f(x).asnumpy(), 1.0)
    AdamW([w]).apply((Tensor(np.ones(3, np.float32)),), 0.5)
    np.testing.assert_allclose(f(x).asnumpy(), w.asnumpy())
    assert not np.allclose(w.asnumpy(), 1.0)

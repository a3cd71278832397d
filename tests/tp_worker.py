"""msrun worker for tests/test_tensor_parallel.py: one GRPO loss + gradient step on a dp × tp layout.

Every rank loads its slice of an HF checkpoint (``sharding.rank_state``) into a ``TPCausalLM``,
takes its data-parallel share of a fixed batch, computes the GRPO policy loss (token-mean over the
global token count) from vocab-parallel log-probs, differentiates it, sums the gradients over its
dp group, and writes ``{out}/{case}_rank{r}.npz`` with the loss, log-probs, gathered logits and
the gradient of each parameter slice (``grad/<HF name>``).

    msrun --worker_num=4 --local_worker_num=4 --master_port=P --join=True --log_dir=LOG \
        tests/tp_worker.py --dp 2 --tp 2 --out OUT --case NAME MODEL_DIR BATCH.npz [--case ...]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

BETA = 0.1  # KL weight: makes the loss value depend on the log-probs (on-policy, the surrogate does not)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, required=True, help="data-parallel size")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size")
    p.add_argument("--out", required=True, help="folder for the per-rank .npz results")
    p.add_argument("--case", nargs=3, action="append", required=True, metavar=("NAME", "MODEL_DIR", "BATCH"),
                   help="a case: its name, an HF model folder and the batch .npz (repeatable)")
    p.add_argument("--jit", action="store_true", help="compile the loss+gradient step with mindspore.jit")
    return p.parse_args(argv)


def check_primitives(groups, out_dir: Path) -> None:
    """Values and gradients of the tp region boundaries on small rank-dependent inputs → prims_rank{r}.npz."""
    import mindspore as ms
    from mindspore import Tensor

    from mindrlhf.parallel.tp_layers import CopyToTP, GatherFromTP, ReduceFromTP

    tp, t = groups.tp, groups.tp_rank
    x = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3) + 10.0 * groups.rank)
    weights = Tensor(np.arange(6 * tp, dtype=np.float32).reshape(2, 3 * tp) - 4.0)
    copy, reduce, gather = CopyToTP(tp, groups.tp_group), ReduceFromTP(tp, groups.tp_group), \
        GatherFromTP(tp, t, groups.tp_group)
    out = {}
    for name, fn in (("copy", lambda v: (copy(v) * (t + 1.0)).sum()),   # d/dv = Σ_ranks (rank + 1)
                     ("reduce", lambda v: (reduce(v) * 2.0).sum()),     # d/dv = 2 (identity backward)
                     ("gather", lambda v: (gather(v) * weights).sum())):  # d/dv = own columns of weights
        value, grad = ms.value_and_grad(fn)(x)
        out[name + "_value"], out[name + "_grad"] = value.asnumpy(), grad.asnumpy()
    out["gathered"] = gather(x).asnumpy()
    out["reduced"] = reduce(x).asnumpy()
    np.savez(out_dir / f"prims_rank{groups.rank}.npz", **out)


def main(argv=None) -> int:
    args = parse_args(argv)
    import mindspore as ms
    from mindspore import Tensor, ops
    from mindspore.communication import init

    from mindrlhf.algorithms import policy_loss
    from mindrlhf.checkpoint.hf_io import open_weights
    from mindrlhf.models import DecoderConfig, set_weights
    from mindrlhf.parallel.layout import ParallelLayout
    from mindrlhf.parallel.sharding import rank_state
    from mindrlhf.parallel.tp_layers import init_parallel_groups
    from mindrlhf.parallel.tp_model import TPCausalLM, dp_grad_reducer

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    init()
    layout = ParallelLayout(dp=args.dp, tp=args.tp)
    groups = init_parallel_groups(layout)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    check_primitives(groups, out_dir)
    for name, model_dir, batch_path in args.case:
        start = time.perf_counter()
        source = open_weights(model_dir)
        config = DecoderConfig.from_hf_dict(source.config, source=str(source.config_path))
        model = TPCausalLM(config, layout, groups.tp_rank, "float32", group=groups.tp_group)
        set_weights(model, rank_state(dict(source), config, layout, groups.rank), source=model_dir)

        batch = dict(np.load(batch_path, allow_pickle=False))
        rows = batch["input_ids"].shape[0] // layout.dp
        part = slice(groups.dp_rank * rows, (groups.dp_rank + 1) * rows)
        num_tokens = Tensor(np.float32(batch["completion_mask"].sum()))  # global: the whole batch
        inputs = [Tensor(batch[k][part]) for k in ("input_ids", "attention_mask", "completion_ids",
                                                    "completion_mask", "advantages", "ref_logp")]
        loaded = time.perf_counter()

        def loss_fn(input_ids, attention_mask, completion_ids, completion_mask, advantages, ref_logp, n_tok):
            logp = model.sequence_logprobs(input_ids, attention_mask, completion_ids, 1.0)
            loss, _ = policy_loss(logp, ops.stop_gradient(logp), advantages, completion_mask, ref_logp=ref_logp,
                                  loss_type="grpo", beta=BETA, kl_estimator="k3", loss_agg_mode="token-mean",
                                  global_num_tokens=n_tok)
            return loss, logp

        params = model.trainable_params()
        grad_fn = ms.value_and_grad(loss_fn, None, params, has_aux=True)
        if args.jit:
            grad_fn = ms.jit(grad_fn)
        (loss, logp), grads = grad_fn(*inputs, num_tokens)
        reducer = dp_grad_reducer(params, layout.dp, groups.dp_group)
        if reducer is not None:
            grads = reducer(grads)
        logits = model.gathered_logits(inputs[0], inputs[1], None, batch["completion_ids"].shape[1])

        result = {"loss": np.float32(loss.asnumpy()), "logp": logp.asnumpy(), "logits": logits.asnumpy(),
                  "coords": np.array([groups.dp_rank, groups.tp_rank], np.int64)}
        for p, g in zip(params, grads):
            result["grad/" + p.name] = g.asnumpy()
        tmp = out_dir / f".{name}_rank{groups.rank}.tmp.npz"
        np.savez(tmp, **result)
        os.replace(tmp, out_dir / f"{name}_rank{groups.rank}.npz")
        print(f"rank {groups.rank} case {name}: loss {float(result['loss']):.6f}, load {loaded - start:.1f}s, "
              f"step+write {time.perf_counter() - loaded:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

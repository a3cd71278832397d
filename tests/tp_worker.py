"""msrun worker for tests/test_tensor_parallel.py: one GRPO loss + gradient step on a dp × tp × pp layout.

Every rank loads its shard of an HF checkpoint (``sharding.rank_state``: its pipeline stage's
parameters, each cut to its tp slice) into ``CausalLM(config, dtype, groups.shard())``, takes its
data-parallel share of a fixed batch, cuts it into ``--micro`` micro-batches and runs the
``PipelineRunner`` (GPipe over the stages when pp > 1): GRPO policy loss (token-mean over the global
token count) from vocab-parallel log-probs, gradients, tied-embedding sync — or, for a
sequence-classification model (a reward model: ``score`` head), a logistic loss on its per-sequence
scores (``score_loss``); then sums the gradients over its dp group and writes
``{out}/{case}_rank{r}.npz`` with the loss (last stage), the head's output (``out``: log-probs or
scores), gathered logits (causal LM, pp = 1) and the gradient of each parameter slice (``grad/<HF name>``).

    msrun --worker_num=4 --local_worker_num=4 --master_port=P --join=True --log_dir=LOG \
        tests/tp_worker.py --dp 1 --tp 2 --pp 2 --out OUT --case NAME MODEL_DIR BATCH.npz [--case ...]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
from mindspore import ops  # module level: score_loss is compiled by mindspore.jit, which cannot import

BETA = 0.1  # KL weight: makes the loss value depend on the log-probs (on-policy, the surrogate does not)


def score_loss(scores, advantages, n_rows):
    """The score-head case's loss: ``softplus(-a * score)`` summed over rows / the global row count
    (a logistic loss with the advantages as signed labels); aux: the rows."""
    return ops.softplus(-advantages * scores[:, 0]).sum() / n_rows, (ops.ones_like(advantages).sum(),)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, required=True, help="data-parallel size")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--micro", type=int, default=1, help="micro-batches per rank and step")
    p.add_argument("--out", required=True, help="folder for the per-rank .npz results")
    p.add_argument("--case", nargs=3, action="append", required=True, metavar=("NAME", "MODEL_DIR", "BATCH"),
                   help="a case: its name, an HF model folder and the batch .npz (repeatable)")
    p.add_argument("--jit", action="store_true", help="compile the loss+gradient step with mindspore.jit")
    p.add_argument("--share", action="store_true", help="pack rows that share a prompt (share_prompts)")
    p.add_argument("--selective", action="store_true",
                   help="train through the layer graphs keeping each layer's linear outputs (recompute selective)")
    p.add_argument("--infer", nargs=2, type=int, default=None, metavar=("DP", "TP"),
                   help="also reshard each case's model in memory into this generation layout and write the shards")
    p.add_argument("--sharded", nargs=2, action="append", default=[], metavar=("NAME", "DIR"),
                   help="load this rank's shard from DIR/rank_{r} (transform_checkpoint.py output); write its logits")
    return p.parse_args(argv)


def check_primitives(groups, out_dir: Path) -> None:
    """Values and gradients of the tp region boundaries on small rank-dependent inputs → prims_rank{r}.npz."""
    import mindspore as ms
    from mindspore import Tensor

    from mindrlhf.models.tp_layers import CopyToTP, GatherFromTP, ReduceFromTP

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
    from mindspore import Tensor

    from mindrlhf.algorithms import policy_loss
    from mindrlhf.checkpoint.hf_io import open_weights
    from mindrlhf.models import DecoderConfig, set_weights
    from mindrlhf.models.decoder import CausalLM
    from mindrlhf.models.heads import head_for
    from mindrlhf.parallel import comm
    from mindrlhf.parallel.comm import grad_reducer
    from mindrlhf.parallel.groups import init_run_layout
    from mindrlhf.parallel.layout import ParallelLayout
    from mindrlhf.parallel.pipeline import PipelineRunner
    from mindrlhf.parallel.resharding import load_shard, reshard_model
    from mindrlhf.parallel.sharding import rank_state

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    comm.init_distributed()  # mindspore.communication.init() plus the rank/size mindrlhf's collectives use
    layout = ParallelLayout(dp=args.dp, tp=args.tp, pp=args.pp, micro_batches=args.micro)
    infer = ParallelLayout(dp=args.infer[0], tp=args.infer[1]) if args.infer else ParallelLayout(dp=layout.world_size)
    from mindspore.communication import get_group_size, get_rank

    run = init_run_layout(layout, infer, get_rank(), get_group_size())
    groups = run.groups
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    if args.pp == 1:
        check_primitives(groups, out_dir)

    def loss_fn(logp, completion_mask, advantages, ref_logp, n_tok):
        loss, _ = policy_loss(logp, ms.ops.stop_gradient(logp), advantages, completion_mask, ref_logp=ref_logp,
                              loss_type="grpo", beta=BETA, kl_estimator="k3", loss_agg_mode="token-mean",
                              global_num_tokens=n_tok)
        return loss, (completion_mask.sum(),)

    for name, model_dir, batch_path in args.case:
        start = time.perf_counter()
        source = open_weights(model_dir)
        config = DecoderConfig.from_hf_dict(source.config, source=str(source.config_path))
        model = CausalLM(config, "float32", groups.shard())
        set_weights(model, rank_state(dict(source), config, layout, groups.rank), source=model_dir)

        batch = dict(np.load(batch_path, allow_pickle=False))
        rows = batch["input_ids"].shape[0] // layout.dp
        mine = {k: v[groups.dp_rank * rows:(groups.dp_rank + 1) * rows] for k, v in batch.items()}
        per = rows // args.micro
        micro = [{k: v[m * per:(m + 1) * per] for k, v in mine.items()} for m in range(args.micro)]
        loaded = time.perf_counter()

        # Normalised by global counts (the whole batch), so the dp ranks' losses add up to one process's.
        if config.num_labels:
            fn, keys, count = score_loss, ("advantages",), float(batch["input_ids"].shape[0])
        else:
            fn, keys, count = loss_fn, ("completion_mask", "advantages", "ref_logp"), batch["completion_mask"].sum()
        runner = PipelineRunner(model, groups, fn, head=head_for(config), jit=args.jit, share_prompts=args.share,
                                layer_graphs=args.selective, keep_activations=args.selective)
        grads, loss, _ = runner.loss_and_grads(micro, keys, extra=(Tensor(np.float32(count)),))
        reducer = grad_reducer(runner.params, layout.dp, groups.dp_group)
        if reducer is not None:
            grads = reducer(grads)
        out = np.concatenate(runner.forward(micro))

        result = {"loss": np.float32(loss), "out": out,
                  "coords": np.array([groups.dp_rank, groups.tp_rank, groups.pp_rank], np.int64)}
        if args.pp == 1 and not config.num_labels:
            result["logits"] = model.gathered_logits(Tensor(mine["input_ids"]), Tensor(mine["attention_mask"]), None,
                                                     batch["completion_ids"].shape[1]).asnumpy()
        for p, g in zip(runner.params, grads):
            result["grad/" + p.name] = g.asnumpy()
        if args.infer:  # the generator's shards, rebuilt in memory from the train shards
            infer_model = CausalLM(config, "float32", run.infer_shard())
            reshard_model(model, layout, infer_model, infer, groups.rank, config)
            for n, p in infer_model.parameters_and_names():
                result["infer/" + n] = p.asnumpy()
        tmp = out_dir / f".{name}_rank{groups.rank}.tmp.npz"
        np.savez(tmp, **result)
        os.replace(tmp, out_dir / f"{name}_rank{groups.rank}.npz")
        print(f"rank {groups.rank} case {name}: loss {float(result['loss']):.6f}, load {loaded - start:.1f}s, "
              f"step+write {time.perf_counter() - loaded:.1f}s", flush=True)
    for name, ckpt_dir in args.sharded:
        model = load_shard(ckpt_dir, layout, groups.rank, tp_group=groups.tp_group)
        batch = dict(np.load(args.case[0][2], allow_pickle=False))
        logits = model.gathered_logits(Tensor(batch["input_ids"]), Tensor(batch["attention_mask"]), None,
                                       batch["completion_ids"].shape[1]).asnumpy()
        np.savez(out_dir / f"sharded_{name}_rank{groups.rank}.npz", logits=logits)
    return 0


if __name__ == "__main__":
    sys.exit(main())

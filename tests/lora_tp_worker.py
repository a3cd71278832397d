"""msrun worker of tests/test_lora.py: a tp shard with LoRA adapters, its loss and its adapter gradients.

Each rank builds its tp shard of an HF model, attaches the LoRA spec, loads the full adapter arrays given
(its slices are cut by ``set_adapter_weights``), and writes the loss and the gradient of every trainable
parameter (by name) of ``-sum(completion log-probs)``, the adapters assembled from the shards
(``gather_adapter_weights``) and the merged model (``gather_merged_weights`` of the shard) to ``<out>/rank{r}.npz``;
rank 0 writes the assembled adapters as a PEFT folder, ``<out>/adapter_tp``. With ``--dropout`` p > 0 also the loss
and gradients with the adapter dropout's seeds on (``drop_loss``, ``drop_grad/...``: a row-parallel shard must draw
its columns' slice of one process's mask).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--model", required=True, help="HF model folder")
    p.add_argument("--adapter", required=True, help=".npz of the full adapter arrays (model names)")
    p.add_argument("--batch", required=True, help=".npz with input_ids, attention_mask, completion_ids")
    p.add_argument("--r", type=int, required=True)
    p.add_argument("--alpha", type=float, required=True)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import mindspore as ms
    from mindspore import Tensor
    from mindspore.communication import get_group_size, get_rank

    from mindrlhf.checkpoint.hf_io import open_weights
    from mindrlhf.models import DecoderConfig, set_weights
    from mindrlhf.models.decoder import CausalLM
    from mindrlhf.models.lora import (
        LoRASpec,
        apply_lora,
        save_adapter,
        set_adapter_weights,
        set_dropout_seeds,
    )
    from mindrlhf.parallel import comm
    from mindrlhf.parallel.groups import init_run_layout
    from mindrlhf.parallel.layout import ParallelLayout
    from mindrlhf.parallel.resharding import gather_adapter_weights, gather_merged_weights
    from mindrlhf.parallel.sharding import rank_state

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    comm.init_distributed()
    layout = ParallelLayout(tp=args.tp)
    groups = init_run_layout(layout, ParallelLayout(dp=layout.world_size), get_rank(), get_group_size()).groups
    source = open_weights(args.model)
    config = DecoderConfig.from_hf_dict(source.config, source=str(source.config_path))
    model = CausalLM(config, "float32", groups.shard())
    set_weights(model, rank_state(dict(source), config, layout, groups.rank), source=args.model)
    apply_lora(model, LoRASpec(r=args.r, alpha=args.alpha, dropout=args.dropout))
    set_adapter_weights(model, dict(np.load(args.adapter, allow_pickle=False)))
    batch = {k: Tensor(v) for k, v in np.load(args.batch, allow_pickle=False).items()}
    params = model.trainable_params()

    def loss_fn():
        return -model.sequence_logprobs(batch["input_ids"], batch["attention_mask"], batch["completion_ids"]).sum()

    loss, grads = ms.value_and_grad(loss_fn, None, params)()
    result = {"loss": loss.asnumpy(), **{"grad/" + q.name: g.asnumpy() for q, g in zip(params, grads)}}
    adapters = gather_adapter_weights(model, layout, groups.rank)  # collectives: every rank
    result.update({"adapter/" + k: v for k, v in adapters.items()})
    result.update({"merged/" + k: v for k, v in gather_merged_weights(model, layout, groups.rank).items()})
    if comm.is_main():
        save_adapter(model, Path(args.out) / "adapter_tp", weights=adapters)
    if args.dropout:
        set_dropout_seeds(model, step=5)
        loss, grads = ms.value_and_grad(loss_fn, None, params)()
        result["drop_loss"] = loss.asnumpy()
        result.update({"drop_grad/" + q.name: g.asnumpy() for q, g in zip(params, grads)})
    np.savez(Path(args.out) / f"rank{groups.rank}.npz", **result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

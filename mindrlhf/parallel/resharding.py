"""Weights between layouts, in memory: full tensors from a sharded model, shards from full tensors.

The GRPO job trains in one layout (e.g. tp2 × pp2) and generates in another (e.g. dp2 × tp2). After
every update the generator's shards are rebuilt from the trainer's without touching the disk:
for each parameter (the same names, in the same order, on every rank) each trainer shard is
written into its slice of a zero buffer by exactly one holder — dp replica 0, tp rank ``t``, the
first pipeline stage holding it — and a world AllReduce-sum assembles the full tensor everywhere
(exact: every element is one value plus zeros). Each rank then cuts the slice its destination
shard needs (``sharding.shard_tensor``). One parameter is in flight at a time, so the extra memory
is the largest single tensor. AllReduce works on every backend (CPU mccl has no Send/Receive);
``sharding.reshard`` computes the minimal point-to-point plan for backends that have them.

The same assembly gives rank 0 the full policy and optimizer state for checkpoints, so a
checkpoint written under one layout resumes under any other.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, Iterator, Mapping, Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor

from mindrlhf.errors import MindRLHFError
from mindrlhf.models.config import DecoderConfig
from mindrlhf.models.family import LM_HEAD, SCORE
from mindrlhf.models.lora import adapter_shapes, adapter_weights, base_parameters, merge_into, merged_weights
from mindrlhf.parallel import comm
from mindrlhf.parallel.layout import ParallelLayout
from mindrlhf.parallel.sharding import _index, _interval, param_shape, shard_tensor, split_dim

# Optimizer moments are named "<prefix><parameter name>" and shard like their parameter.
STATE_PREFIXES = ("adam_m.", "adam_v.")


def base_name(name: str) -> str:
    """The model parameter a tensor shards like (strips optimizer-state prefixes)."""
    for prefix in STATE_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _value(tensor) -> np.ndarray:
    value = tensor.value() if isinstance(tensor, ms.Parameter) else tensor
    if isinstance(value, Tensor):
        if value.dtype == ms.bfloat16:
            value = value.astype(ms.float32)
        value = value.asnumpy()
    return np.asarray(value, np.float32)


def _tp_dim(name: str, layout: ParallelLayout) -> Optional[int]:
    """The dimension of ``name`` split over the layout's tp ranks (``None``: every tp rank holds all of it).
    By name (``sharding.split_dim``), so it covers tensors outside the config too (LoRA factors)."""
    return split_dim(name) if layout.tp > 1 else None


def _is_holder(name: str, config: DecoderConfig, layout: ParallelLayout, rank: int) -> bool:
    """Whether ``rank`` contributes its shard of ``name`` to the assembly (one per tp slice)."""
    c = layout.coords(rank)
    if c.dp != 0:
        return False
    if _tp_dim(name, layout) is None and c.tp != 0:
        return False  # replicated over tp: rank 0 of the tp group speaks for it
    return c.pp == layout.param_stages(name, config)[0]


def assemble(tensors: Mapping[str, object], names: Iterable[str], config: DecoderConfig,
             layout: ParallelLayout, rank: int, *, shapes: Optional[Mapping[str, Tuple[int, ...]]] = None
             ) -> Iterator[Tuple[str, np.ndarray]]:
    """``(name, full float32 array)`` for each name, on every rank (a collective: call on all ranks).

    ``tensors`` holds this rank's shards (parameters or optimizer moments, HF names); ``names``
    must be the same list in the same order on every rank. ``shapes``: the full shape of each parameter
    name (default: the config's; a LoRA model's adapters: ``models.lora.adapter_shapes``).
    """
    if comm.world_size() != layout.world_size:
        raise MindRLHFError(f"assembling tensors of layout {layout} needs its {layout.world_size} processes, but "
                            f"mindrlhf.parallel.comm sees {comm.world_size()}; "
                            "call comm.init_distributed() under msrun")
    for name in names:
        base = base_name(name)
        full = np.zeros(shapes[base] if shapes is not None else param_shape(base, config), np.float32)
        if name in tensors and _is_holder(base, config, layout, rank):
            local = _value(tensors[name])
            dim = _tp_dim(base, layout)
            if dim is None:
                full[...] = local
            else:
                start, stop = _interval(full.shape[dim], layout.tp, layout.coords(rank).tp)
                full[_index(full.ndim, dim, start, stop)] = local
        yield name, (comm.all_sum(full) if comm.world_size() > 1 else full)


def model_names(config: DecoderConfig) -> list:
    """Every parameter name of the full model, in model order (the order all ranks assemble in)."""
    return list(config.expected_shapes())


def gather_adapter_weights(model: ms.nn.Cell, layout: ParallelLayout, rank: int) -> Dict[str, np.ndarray]:
    """The full (unsharded) LoRA adapters of a tp/pp-sharded model, float32, on every rank: what
    ``models.lora.adapter_weights`` gives for the whole model on one process. A collective: every rank of ``layout``
    calls it. Each split factor is assembled from its tp slices, each stage's adapters from the stage holding them."""
    shapes = adapter_shapes(model.config, model.lora_spec)
    return dict(assemble(adapter_weights(model), list(shapes), model.config, layout, rank, shapes=shapes))


def gather_merged_weights(model: ms.nn.Cell, layout: ParallelLayout, rank: int) -> Dict[str, np.ndarray]:
    """The whole base model of a tp/pp-sharded LoRA model (HF names, float32) with every adapter merged, on every
    rank: what ``models.lora.merged_weights`` gives on one process. A collective: every rank of ``layout`` calls it
    (the base and the adapters are assembled, then merged on each rank)."""
    if layout.tp * layout.pp == 1:  # dp replicas each hold the whole model
        return merged_weights(model)
    adapters = gather_adapter_weights(model, layout, rank)
    base = dict(base_parameters(model))
    return merge_into(assemble(base, model_names(model.config), model.config, layout, rank), adapters,
                      model.lora_spec.scaling)


def reshard_arrays(src: ms.nn.Cell, src_layout: ParallelLayout, dst_layout: ParallelLayout, rank: int,
                   config: DecoderConfig) -> Iterator[Tuple[str, np.ndarray]]:
    """This rank's shard in ``dst_layout`` of every weight of ``src`` (this rank's shard in ``src_layout``),
    tensor by tensor: each is assembled from the source shards (a collective) and cut again."""
    dst_tp = dst_layout.coords(rank).tp
    for name, full in assemble(dict(src.parameters_and_names()), model_names(config), config, src_layout, rank):
        yield name, np.ascontiguousarray(shard_tensor(name, full, config, dst_layout, dst_tp))


def reshard_model(src: ms.nn.Cell, src_layout: ParallelLayout, dst: ms.nn.Cell, dst_layout: ParallelLayout,
                  rank: int, config: DecoderConfig) -> int:
    """Write ``src``'s weights (this rank's shard in ``src_layout``) into ``dst`` (its shard in
    ``dst_layout``), in place; returns how many of ``dst``'s parameters were written (all of them)."""
    dst_params = dict(dst.parameters_and_names())
    written = 0
    for name, piece in reshard_arrays(src, src_layout, dst_layout, rank, config):
        if name in dst_params:
            p = dst_params[name]
            p.copy_(Tensor(piece, dtype=p.dtype))
            written += 1
    if written != len(dst_params):
        raise MindRLHFError(f"resharding {src_layout} -> {dst_layout} wrote {written} of {len(dst_params)} "
                            "parameters; the two models are not the same architecture")
    return written


def _slice(name: str, array: np.ndarray, shape: Tuple[int, ...], layout: ParallelLayout, tp_rank: int,
           source: str) -> np.ndarray:
    """tp rank ``tp_rank``'s slice of the full tensor ``array`` of parameter ``name`` (full shape ``shape``)."""
    if tuple(array.shape) != tuple(shape):
        raise MindRLHFError(f"{source}: {name!r} has shape {tuple(array.shape)}, this model's is {tuple(shape)}; "
                            "the checkpoint belongs to another model or LoRA rank")
    dim = _tp_dim(name, layout)
    if dim is None:
        return array
    return array[_index(array.ndim, dim, *_interval(array.shape[dim], layout.tp, tp_rank))]


def load_full_into(params: Mapping[str, ms.Parameter], full: Iterable[Tuple[str, np.ndarray]],
                   config: DecoderConfig, layout: ParallelLayout, rank: int, *, source: str,
                   shapes: Optional[Mapping[str, Tuple[int, ...]]] = None) -> int:
    """Copy this rank's slices of full tensors (parameters or optimizer moments) into ``params``.

    Every name in ``params`` must come by; unknown names in ``full`` are an error (``source`` is
    named in the messages). ``shapes``: as for ``assemble`` (the tensors a full checkpoint of the
    model holds, by full shape). Returns how many tensors were written.
    """
    tp_rank = layout.coords(rank).tp
    known = shapes if shapes is not None else config.expected_shapes()
    seen = set()
    for name, array in full:
        if name not in params:
            if base_name(name) in known or name == "adam_step":
                continue  # another stage's tensor
            raise MindRLHFError(f"{source}: unexpected tensor {name!r} for this model")
        p = params[name]
        if base_name(name) not in known:
            piece = np.asarray(array)
        elif shapes is None:
            piece = shard_tensor(base_name(name), np.asarray(array), config, layout, tp_rank)
        else:
            piece = _slice(base_name(name), np.asarray(array), known[base_name(name)], layout, tp_rank, source)
        if tuple(piece.shape) != tuple(p.shape):
            raise MindRLHFError(f"{source}: {name!r} gives a shard of shape {tuple(piece.shape)} but this rank "
                                f"holds {tuple(p.shape)} under {layout}")
        # reshape: np.ascontiguousarray makes a 0-d array (the optimizer's step counter) 1-d, which copy_ refuses
        p.copy_(Tensor(np.ascontiguousarray(piece).reshape(piece.shape), dtype=p.dtype))
        seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise MindRLHFError(f"{source}: {len(missing)} tensors missing (e.g. {missing[0]!r})")
    return len(seen)


def rank_dirs(path) -> Dict[int, Path]:
    """``{r: path/rank_r}`` for a sharded checkpoint directory (``transform_checkpoint.py`` output), else {}."""
    path = Path(path)
    if not path.is_dir():
        return {}
    return {int(d.name[len("rank_"):]): d for d in path.glob("rank_*")
            if d.is_dir() and d.name[len("rank_"):].isdigit()}


def checkpoint_config(path) -> DecoderConfig:
    """The ``DecoderConfig`` of a checkpoint: a full one (HF directory, or a .ckpt/.safetensors with its
    config.json), or a directory of ``rank_{r}`` folders (the config is in each folder)."""
    from mindrlhf.checkpoint.hf_io import open_weights, read_json

    ranks = rank_dirs(path)
    if ranks:
        first = ranks[min(ranks)] / "config.json"
        return DecoderConfig.from_hf_dict(read_json(first), source=str(first))
    source = open_weights(path)
    return DecoderConfig.from_hf_dict(source.config, source=str(source.config_path))


def load_shard(path, layout: ParallelLayout, rank: int, *, dtype: str = "float32", tp_group: Optional[str] = None,
               config: Optional[DecoderConfig] = None, new_score_head: Optional[int] = None):
    """This rank's ``CausalLM`` shard of ``layout`` with weights from ``path``.

    ``path`` is a full checkpoint (HF directory, .ckpt/.safetensors with config.json) streamed
    tensor by tensor and cut to this rank's slices (online sharding: no offline step), or a
    directory of ``rank_{r}/`` folders written by ``transform_checkpoint.py`` for this layout
    (the strategy file next to them, when present, must describe the same layout).

    ``new_score_head=seed``: ``config`` is a sequence-classification model (``num_labels > 0``) and ``path``
    a causal LM: its ``lm_head`` is dropped and the ``score`` head drawn from N(0, initializer_range²)
    with a numpy generator seeded by ``seed`` (the same values on every rank), as transformers initialises
    a ``*ForSequenceClassification`` loaded from a causal LM.
    """
    from mindrlhf.checkpoint.hf_io import open_weights
    from mindrlhf.models.decoder import CausalLM
    from mindrlhf.models.family import is_derived_buffer
    from mindrlhf.models.weights import set_weights
    from mindrlhf.parallel.layout import ModelShard

    shard = ModelShard.of(layout, rank, tp_group)
    ranks = rank_dirs(path)
    if ranks:
        if sorted(ranks) != list(range(layout.world_size)):
            raise MindRLHFError(f"{path}: has rank folders {sorted(ranks)} but the layout {layout} has "
                                f"{layout.world_size} ranks; shard it for this layout with transform_checkpoint.py "
                                "or pass the full checkpoint (it is sharded on load)")
        files = sorted(ranks[rank].glob("*.ckpt")) or sorted(ranks[rank].glob("*.safetensors"))
        if not files:
            raise MindRLHFError(f"{ranks[rank]}: no .ckpt/.safetensors shard inside")
        source = open_weights(files[-1])  # MindSpore's rule: the last file in name order
        config = config or DecoderConfig.from_hf_dict(source.config, source=str(source.config_path))
        _check_strategy(path, config, layout)
        model = CausalLM(config, dtype, shard)
        set_weights(model, source, source=str(files[-1]))
        return model
    source = open_weights(path)
    config = config or DecoderConfig.from_hf_dict(source.config, source=str(source.config_path))
    layout.validate(config)
    model = CausalLM(config, dtype, shard)
    held = {n for n, _ in model.parameters_and_names()}
    known = config.expected_shapes()
    tp_rank = layout.coords(rank).tp

    def pieces():
        for name, array in source:
            if is_derived_buffer(name) or (name not in held and name in known):
                continue  # a derived buffer, or another pipeline stage's tensor
            if new_score_head is not None and name == LM_HEAD:
                continue  # the causal LM's head, replaced by the score head
            # Unknown names go through so set_weights reports them.
            yield name, shard_tensor(name, array, config, layout, tp_rank) if name in known else array

    set_weights(model, pieces(), source=str(path), missing_ok=(SCORE,) if new_score_head is not None else ())
    if new_score_head is not None and SCORE in held:
        std = float(config.extra.get("initializer_range", 0.02))
        score = np.random.default_rng(new_score_head).normal(0.0, std, known[SCORE]).astype(np.float32)
        model.score.weight.copy_(Tensor(score, dtype=model.score.weight.dtype))
    return model


def _check_strategy(path, config: DecoderConfig, layout: ParallelLayout) -> None:
    from mindrlhf.parallel.strategy import check_strategy, layout_of, read_strategy

    for name in ("strategy.json", "strategy.ckpt"):
        f = Path(path) / name
        if f.is_file():
            strategy = read_strategy(f)
            check_strategy(strategy, config, config_name=f"{path}/rank_0/config.json")
            found = layout_of(strategy, config)
            if found is not None and (found.dp, found.tp, found.pp) != (layout.dp, layout.tp, layout.pp):
                raise MindRLHFError(f"{path} was sharded for {found} but this run's layout is {layout}; "
                                    "reshard it with transform_checkpoint.py or pass the full checkpoint")
            return

"""Megatron-style tensor-parallel sharding of HF-named decoder parameters, in pure numpy.

Which dimension of each parameter is split across the ``tp`` ranks (HF shapes, Linear = (out, in)):

* **column-parallel** — split dim 0 (the output features): ``q_proj``, ``k_proj``, ``v_proj``
  weight and bias, ``gate_proj`` and ``up_proj`` weight (and bias with ``mlp_bias``). Heads are
  contiguous ``head_dim`` row blocks, so an even dim-0 split is a split by **contiguous head
  blocks**: tp rank ``t`` holds query heads ``[t*H/tp, (t+1)*H/tp)`` and key/value heads
  ``[t*KV/tp, (t+1)*KV/tp)`` — ``H/tp`` query heads and ``KV/tp`` kv heads per rank, and since
  ``H/KV`` query heads share one kv head and both are cut in the same proportion, every rank's
  query heads find their kv head on the same rank (GQA needs no communication).
* **row-parallel** — split dim 1 (the input features): ``o_proj.weight``, ``down_proj.weight``.
  A row-parallel bias (``down_proj.bias`` with ``mlp_bias``) is added after the all-reduce, so it
  is replicated.
* **vocab-parallel** — split dim 0 (the vocabulary rows): ``model.embed_tokens.weight`` and
  ``lm_head.weight``; rank ``t`` holds token ids ``[t*V/tp, (t+1)*V/tp)``.
* **replicated** — the RMSNorm weights (incl. a family's per-head q/k norms).

The split rule of each tensor is part of the model family's spec (``models.family``); this module
applies it.

Pipeline stages (``ParallelLayout.param_stages``) decide *which* parameters a rank holds; this
module decides *which slice*. Everything is numpy and device-free, so the same functions serve
the offline checkpoint tool, the MindSpore strategy writer and an in-memory reshard over
collectives (``reshard`` returns a plan of slices; moving them is the caller's business).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from mindrlhf.errors import MindRLHFError
from mindrlhf.models.config import DecoderConfig
from mindrlhf.models.family import COLUMN, REPLICATED, ROW, SPLIT_DIM, VOCAB, split_kind  # noqa: F401
from mindrlhf.parallel.layout import ParallelLayout

WeightsLike = Union[Mapping[str, np.ndarray], Iterable[Tuple[str, np.ndarray]]]


def param_shape(name: str, config: DecoderConfig) -> tuple:
    """Full (unsharded) shape of parameter ``name``; a clear error for a name the model lacks."""
    shapes = config.expected_shapes()
    if name not in shapes:
        raise MindRLHFError(f"parameter {name!r} is not part of this {config.model_type} model "
                            f"({config.num_hidden_layers} layers, tie_word_embeddings={config.tie_word_embeddings}, "
                            f"attention_bias={config.attention_bias}); use the config that belongs to the weights")
    return shapes[name]


def param_kind(name: str) -> str:
    """``column`` / ``row`` / ``vocab`` / ``replicated``: the family spec's split rule (``models.family``)."""
    return split_kind(name)


def split_dim(name: str) -> Optional[int]:
    """The dimension tp splits for ``name`` independent of the tp degree (``None``: replicated)."""
    return SPLIT_DIM[split_kind(name)]


def shard_spec(name: str, config: DecoderConfig, layout: ParallelLayout) -> Optional[int]:
    """The dimension of ``name`` split across the layout's tp ranks, or ``None`` if every rank holds all of it.

    ``None`` for norms and row-parallel biases, and for every parameter when ``tp == 1``.
    """
    shape = param_shape(name, config)
    dim = split_dim(name)
    if dim is None or layout.tp == 1:
        return None
    if shape[dim] % layout.tp:
        layout.validate(config)  # names the config field and tp
        raise MindRLHFError(f"parameter {name} dim {dim} of size {shape[dim]} is not divisible by tp={layout.tp}")
    return dim


def shard_shape(name: str, config: DecoderConfig, layout: ParallelLayout) -> tuple:
    """Shape of one tp rank's shard of ``name``."""
    shape = list(param_shape(name, config))
    dim = shard_spec(name, config, layout)
    if dim is not None:
        shape[dim] //= layout.tp
    return tuple(shape)


def _interval(size: int, parts: int, index: int) -> Tuple[int, int]:
    step = size // parts
    return index * step, (index + 1) * step


def _index(ndim: int, dim: Optional[int], start: int, stop: int) -> Tuple[slice, ...]:
    idx = [slice(None)] * ndim
    if dim is not None:
        idx[dim] = slice(start, stop)
    return tuple(idx)


def _check_full(name: str, array: np.ndarray, config: DecoderConfig) -> None:
    want = param_shape(name, config)
    if tuple(array.shape) != tuple(want):
        raise MindRLHFError(f"parameter {name} has shape {tuple(array.shape)} but the config implies {want}; "
                            "use the config that belongs to these weights")


def shard_tensor(name: str, array: np.ndarray, config: DecoderConfig, layout: ParallelLayout,
                 tp_rank: int) -> np.ndarray:
    """tp rank ``tp_rank``'s slice of the full parameter ``array`` (a view, no copy)."""
    if not 0 <= tp_rank < layout.tp:
        raise MindRLHFError(f"tp rank {tp_rank} is outside the layout {layout} (0..{layout.tp - 1})")
    array = np.asarray(array)
    _check_full(name, array, config)
    dim = shard_spec(name, config, layout)
    if dim is None:
        return array
    return array[_index(array.ndim, dim, *_interval(array.shape[dim], layout.tp, tp_rank))]


def merge_shards(name: str, shards: Sequence[np.ndarray], config: DecoderConfig,
                 layout: ParallelLayout, *, check_replicas: bool = True) -> np.ndarray:
    """Rebuild the full parameter from its ``tp`` shards given in tp-rank order.

    Replicated parameters must be identical on every rank (checked bit-exactly unless
    ``check_replicas=False``); the first copy is returned.
    """
    if len(shards) != layout.tp:
        raise MindRLHFError(f"parameter {name}: got {len(shards)} shard(s) but the layout {layout} has tp={layout.tp}")
    want = shard_shape(name, config, layout)
    for t, s in enumerate(shards):
        if tuple(np.shape(s)) != want:
            raise MindRLHFError(f"parameter {name}: shard of tp rank {t} has shape {tuple(np.shape(s))}, "
                                f"expected {want} for {layout}")
    dim = shard_spec(name, config, layout)
    if dim is None:
        first = np.asarray(shards[0])
        if check_replicas:
            for t, s in enumerate(shards[1:], start=1):
                if not np.array_equal(first, s, equal_nan=np.issubdtype(first.dtype, np.floating)):
                    raise MindRLHFError(f"parameter {name} is replicated but tp rank {t}'s copy differs from "
                                        "rank 0's; the shards come from different checkpoints or steps")
        return first
    return np.concatenate([np.asarray(s) for s in shards], axis=dim)


def _as_mapping(full_weights: WeightsLike) -> Mapping[str, np.ndarray]:
    return full_weights if isinstance(full_weights, Mapping) else dict(full_weights)


def rank_params(config: DecoderConfig, layout: ParallelLayout, rank: int) -> List[str]:
    """Names of the parameters global ``rank`` holds (its pipeline stage's), in model order."""
    return layout.stage_params(layout.coords(rank).pp, config)


def rank_state(full_weights: WeightsLike, config: DecoderConfig, layout: ParallelLayout,
               rank: int) -> Dict[str, np.ndarray]:
    """The parameters global ``rank`` holds: its pipeline stage's, each cut to its tp slice (views)."""
    layout.validate(config)
    weights = _as_mapping(full_weights)
    tp_rank = layout.coords(rank).tp
    out: Dict[str, np.ndarray] = {}
    for name in rank_params(config, layout, rank):
        if name not in weights:
            raise MindRLHFError(f"parameter {name} needed by rank {rank} of {layout} is missing from the weights")
        out[name] = shard_tensor(name, weights[name], config, layout, tp_rank)
    return out


# ---------------------------------------------------------------------------------------------
# resharding between layouts
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """Copy ``src_state[src_rank][name][src_index]`` into ``dst[name][dst_index]``."""

    src_rank: int
    src_index: Tuple[slice, ...]
    dst_index: Tuple[slice, ...]


@dataclass(frozen=True)
class ParamPlan:
    """How one destination rank assembles one parameter (its local shape) from source pieces."""

    name: str
    shape: Tuple[int, ...]
    pieces: Tuple[Piece, ...]


def _pick_replica(candidates: List[int], dst_rank: int, preferred: int) -> int:
    """``dst_rank`` itself when it holds the data (a local copy), else the preferred replica."""
    if dst_rank in candidates:
        return dst_rank
    return preferred if preferred in candidates else candidates[0]


def reshard(src_layout: ParallelLayout, dst_layout: ParallelLayout, config: DecoderConfig,
            dst_rank: int) -> Dict[str, ParamPlan]:
    """Plan which source-rank slices compose each parameter of ``dst_rank`` under ``dst_layout``.

    Both layouts hold the same model (e.g. training tp2/pp2 → inference dp2/tp2); ranks are
    numbered in each layout's own order. Each destination parameter is covered exactly once by
    pieces along its split dimension. Among source replicas (dp copies, the two copies of a tied
    embedding) a piece is read from ``dst_rank`` itself when that rank holds it in the source
    layout (no transfer), otherwise from source dp replica ``dst_dp % src.dp`` and the first
    stage holding the parameter — spreading the reads of destination replicas over source replicas.
    """
    src_layout.validate(config)
    dst_layout.validate(config)
    dc = dst_layout.coords(dst_rank)
    plans: Dict[str, ParamPlan] = {}
    for name in rank_params(config, dst_layout, dst_rank):
        full = param_shape(name, config)
        ndim = len(full)
        dim = split_dim(name)
        stages = src_layout.param_stages(name, config)
        d_lo, d_hi = (0, 0)
        if dim is not None:
            d_lo, d_hi = _interval(full[dim], dst_layout.tp, dc.tp)
        pieces: List[Piece] = []
        if dim is None:  # every source rank of the stage(s) holds all of it: read one copy
            whole = _index(ndim, None, 0, 0)
            candidates = [src_layout.rank_of(d, s, t) for s in stages for d in range(src_layout.dp)
                          for t in range(src_layout.tp)]
            preferred = src_layout.rank_of(dc.dp % src_layout.dp, stages[0], dc.tp % src_layout.tp)
            pieces.append(Piece(_pick_replica(candidates, dst_rank, preferred), whole, whole))
        else:
            for t in range(src_layout.tp):
                s_lo, s_hi = _interval(full[dim], src_layout.tp, t)
                lo, hi = max(s_lo, d_lo), min(s_hi, d_hi)
                if lo >= hi:
                    continue
                candidates = [src_layout.rank_of(d, s, t) for s in stages for d in range(src_layout.dp)]
                preferred = src_layout.rank_of(dc.dp % src_layout.dp, stages[0], t)
                pieces.append(Piece(_pick_replica(candidates, dst_rank, preferred),
                                    _index(ndim, dim, lo - s_lo, hi - s_lo), _index(ndim, dim, lo - d_lo, hi - d_lo)))
        plans[name] = ParamPlan(name, shard_shape(name, config, dst_layout), tuple(pieces))
    return plans


def apply_reshard(plan: Mapping[str, ParamPlan],
                  src_states: Mapping[int, Mapping[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    """Assemble a destination rank's parameters from source rank states (``{src_rank: {name: shard}}``)."""
    out: Dict[str, np.ndarray] = {}
    for name, pp in plan.items():
        buf: Optional[np.ndarray] = None
        for piece in pp.pieces:
            state = src_states.get(piece.src_rank)
            if state is None or name not in state:
                raise MindRLHFError(f"parameter {name}: source rank {piece.src_rank} (needed by the reshard plan) "
                                    "is missing or does not hold it")
            part = np.asarray(state[name])[piece.src_index]
            if buf is None:
                buf = np.empty(pp.shape, dtype=part.dtype)
            buf[piece.dst_index] = part
        out[name] = buf
    return out

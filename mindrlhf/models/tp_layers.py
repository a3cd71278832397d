"""Megatron-style tensor-parallel building blocks with explicit collectives and custom backward rules.

MindSpore's ``semi_auto_parallel`` is refused on CPU, so tensor parallelism (tp) is written out by
hand, as in Megatron-LM: every tp rank holds a slice of each big matrix (``sharding.shard_tensor``
decides which) and a handful of collectives over the **tp group** glue the slices together:

* ``CopyToTP``     forward identity,        backward AllReduce-sum (enters a column-parallel region);
* ``ReduceFromTP`` forward AllReduce-sum,   backward identity      (leaves a row-parallel region);
* ``GatherFromTP`` forward concat of slices, backward own slice    (full logits, evaluation only).

With these, the loss computed on every tp rank is the same number, and the gradient each rank gets
for its parameter slice is exactly the matching slice of the single-process gradient (replicated
parameters such as norms get the full gradient on every rank).

CPU facts (MindSpore 2.10, backend mccl) that shape this module: AllReduce works in sub-groups but
only with ``sum``; ``AllGather`` only in the world group ("AllGather only support mccl_world_group
on CPU"); ReduceScatter/AlltoAll/Send/Receive not at all. So every gather here is an AllReduce-sum
of zero-padded slices (``_gather_last``), and the global max of the vocab-parallel log-softmax is
taken over such a gather of the per-rank maxima. Autodiff of ``ops.AllReduce`` itself is an
AllReduce of the gradient, which is wrong for Megatron's regions, hence the ``bprop`` methods.

Every block degrades to plain single-process code when ``tp == 1`` (no collective is built), and
building a block never talks to the communication runtime (``ops.AllReduce`` does not check its
group when constructed), so shapes and names can be checked in-process without ``msrun``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from mindrlhf.errors import MindRLHFError
from mindrlhf.models.hash_dropout import dropout_multiplier


def _check_group(tp: int, group: Optional[str], what: str) -> None:
    if tp > 1 and not group:
        raise MindRLHFError(f"{what}: tp={tp} needs the tp communication group name "
                            "(see mindrlhf.parallel.groups.init_parallel_groups)")


def _divide(size: int, tp: int, what: str) -> int:
    if size % tp:
        raise MindRLHFError(f"{what}={size} is not divisible by tp={tp}; choose a tp that divides {size}")
    return size // tp


# ---------------------------------------------------------------------------------------------
# region boundaries (custom backward)
# ---------------------------------------------------------------------------------------------
class _TPRegion(nn.Cell):
    """A tp region boundary: the tp group's AllReduce-sum (``_sum``; identity at tp 1) and its checks."""

    def __init__(self, tp: int = 1, group: Optional[str] = None):
        super().__init__()
        _check_group(tp, group, type(self).__name__)
        self.tp = tp
        self.all_reduce = ops.AllReduce(group=group) if tp > 1 else None

    def _sum(self, x: Tensor) -> Tensor:
        if self.tp == 1:
            return x
        return self.all_reduce(x)


class CopyToTP(_TPRegion):
    """Identity forward; AllReduce-sum of the gradient over the tp group backward.

    Put in front of column-parallel work: a replicated activation feeds every rank's slice, so its
    gradient is the sum of the ranks' partial gradients.
    """

    def construct(self, x: Tensor) -> Tensor:
        return x

    def bprop(self, x, out, dout):
        return (self._sum(dout),)


class ReduceFromTP(_TPRegion):
    """AllReduce-sum over the tp group forward; identity backward.

    Ends a row-parallel region (partial sums → the replicated total). Every rank then computes the
    same downstream loss, so the gradient of the total is already correct on each rank and flows
    unchanged into each partial sum.
    """

    def construct(self, x: Tensor) -> Tensor:
        return self._sum(x)

    def bprop(self, x, out, dout):
        return (dout,)


def _gather_last(x: Tensor, tp: int, tp_rank: int, all_reduce) -> Tensor:
    """Concatenate the tp ranks' ``x`` along the last axis: AllReduce-sum of zero-padded slices.

    (``AllGather`` in a sub-group has no CPU kernel; padding costs ``tp``× the bytes, fine for the
    small tensors and the evaluation-only logits this is used for.)
    """
    if tp == 1:
        return x
    zeros = ops.zeros_like(x)
    parts = [zeros] * tp
    parts[tp_rank] = x
    return all_reduce(ops.concat(parts, axis=-1))


class GatherFromTP(_TPRegion):
    """Concatenate per-rank slices along the last axis (forward); keep this rank's slice of the gradient."""

    def __init__(self, tp: int = 1, tp_rank: int = 0, group: Optional[str] = None):
        super().__init__(tp, group)
        self.tp_rank = tp_rank

    def construct(self, x: Tensor) -> Tensor:
        return _gather_last(x, self.tp, self.tp_rank, self.all_reduce)

    def bprop(self, x, out, dout):
        if self.tp == 1:
            return (dout,)
        n = x.shape[-1]
        return (dout[..., self.tp_rank * n:(self.tp_rank + 1) * n],)


# ---------------------------------------------------------------------------------------------
# parallel linears and embedding (HF-shaped slices, parameters named weight / bias)
# ---------------------------------------------------------------------------------------------
class _AdaptableLinear(nn.Cell):
    """A linear that may carry a LoRA adapter (``models.lora.apply_lora`` attaches it; none by default).

    The adapter's factors are sub-cells ``lora_A`` / ``lora_B`` holding ``weight`` (PEFT's names and
    shapes: A (r, in), B (out, r)), so the layer's own ``construct`` is the only forward. Under tp one
    factor is split with the layer and the other replicated; the replicated one passes through
    ``lora_copy`` (a ``CopyToTP``: identity forward, gradient summed over the tp ranks backward),
    since each rank's backward only sees its own slice's share of that factor's gradient. ``lora_enabled``, a
    frozen scalar parameter (1, or 0 while ``models.lora.adapters_disabled``), multiplies the adapter's delta.
    With ``lora_dropout`` p > 0, ``lora_dropout_seed`` (a frozen int32 scalar parameter: -1 = off, set per
    micro-batch of a gradient pass by ``models.lora.set_dropout_seeds``) draws the input's mask by a hash
    (``models.hash_dropout``); ``lora_col_offset`` places this rank's input columns in the whole input, so a tp
    shard draws its slice of one process's mask.
    """

    def _no_adapter(self) -> None:
        self.lora_A = None
        self.lora_B = None
        self.lora_dropout = 0.0
        self.lora_dropout_seed = None
        self.lora_col_offset = 0
        self.lora_copy = None
        self.lora_scaling = 0.0
        self.lora_enabled = None

    def _lora_delta(self, x: Tensor, replicated_is_a: bool) -> Tensor:
        """``scaling * B A dropout(x)`` for 2-D ``x`` (rows, in_local) → (rows, out_local)."""
        if self.lora_dropout_seed is not None:  # a hash of (seed, index): the recomputed forward draws the same mask
            x = x * dropout_multiplier(x, self.lora_dropout_seed, self.lora_dropout, self.lora_col_offset)
        a, b = self.lora_A.weight, self.lora_B.weight
        if self.lora_copy is not None:
            if replicated_is_a:
                a = self.lora_copy(a)
            else:
                b = self.lora_copy(b)
        # ``lora_enabled`` (1 or 0, a frozen parameter: a graph input, not a constant) switches the adapter off for
        # the reference pass with the same compiled graphs (PEFT's ``disable_adapter``); times 1 is exact. Both
        # scalars multiply the rank-r intermediate rather than the (rows, out) delta: two elementwise passes over
        # rows x r values instead of rows x out (a measurable part of a LoRA step, bench/README.md); with a
        # power-of-two scaling (alpha = 2r, r = alpha, ...) the product is bit-identical either way.
        return self.matmul(self.matmul(x, a) * (self.lora_scaling * self.lora_enabled), b)


class ColumnParallelLinear(_AdaptableLinear):
    """``y_t = x W_tᵀ + b_t`` with this rank's ``(out/tp, in)`` rows of the HF ``(out, in)`` weight.

    The output stays split (``out/tp`` features per rank). ``copy_input=False`` skips the
    ``CopyToTP`` when the caller already put one in front of several linears sharing an input
    (q/k/v, gate/up): one gradient AllReduce instead of one per linear.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: int = 1, *,
                 group: Optional[str] = None, dtype: ms.Type = ms.float32, copy_input: bool = True):
        super().__init__()
        self.out_local = _divide(out_features, tp, "ColumnParallelLinear out_features")
        self.weight = Parameter(initializer(Normal(0.02), (self.out_local, in_features), dtype), name="weight")
        self.bias = Parameter(initializer("zeros", (self.out_local,), dtype), name="bias") if bias else None
        self.copy = CopyToTP(tp, group) if copy_input and tp > 1 else None
        self.matmul = ops.MatMul(transpose_b=True)
        self._no_adapter()

    def construct(self, x: Tensor) -> Tensor:
        if self.copy is not None:
            x = self.copy(x)
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        y = self.matmul(x, self.weight)
        if self.bias is not None:
            y = y + self.bias
        if self.lora_A is not None:  # B is split with the output, A replicated
            y = y + self._lora_delta(x, True)
        return y.reshape(lead + (self.out_local,))


class RowParallelLinear(_AdaptableLinear):
    """``y = Σ_t x_t W_tᵀ + b`` with this rank's ``(out, in/tp)`` columns of the HF weight.

    The input is already split (``in/tp`` features, the output of column-parallel work); the
    partial products are AllReduced and the (replicated) bias is added once, after the reduce.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: int = 1, *,
                 group: Optional[str] = None, dtype: ms.Type = ms.float32):
        super().__init__()
        self.out_features = out_features
        in_local = _divide(in_features, tp, "RowParallelLinear in_features")
        self.weight = Parameter(initializer(Normal(0.02), (out_features, in_local), dtype), name="weight")
        self.bias = Parameter(initializer("zeros", (out_features,), dtype), name="bias") if bias else None
        self.reduce = ReduceFromTP(tp, group) if tp > 1 else None
        self.matmul = ops.MatMul(transpose_b=True)
        self._no_adapter()

    def construct(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        y = self.matmul(x, self.weight)
        if self.lora_A is not None:  # A is split with the input, B replicated: a partial sum like x W_tᵀ
            y = y + self._lora_delta(x, False)
        if self.reduce is not None:
            y = self.reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(lead + (self.out_features,))


class _VocabSlice(nn.Cell):
    """This rank's rows ``[vocab_start, vocab_start + V/tp)`` of the vocabulary: which ids it holds
    (``_local_ids``), a logit of each target id (``_target``) and the max over all ranks' slices
    (``_global_max``)."""

    def __init__(self, vocab_size: int, tp: int = 1, tp_rank: int = 0, *, group: Optional[str] = None):
        super().__init__()
        _check_group(tp, group, type(self).__name__)
        self.tp, self.tp_rank = tp, tp_rank
        self.vocab_local = _divide(vocab_size, tp, "vocab_size")
        self.vocab_start = tp_rank * self.vocab_local
        self.gather_all = ops.AllReduce(group=group) if tp > 1 else None

    def _local_ids(self, ids: Tensor) -> Tuple[Tensor, Tensor]:
        """Each id's row in this slice (0 for an id another rank holds) and whether this rank holds it."""
        local = ids.astype(ms.int32) - self.vocab_start
        inside = ops.logical_and(local >= 0, local < self.vocab_local)
        return ops.select(inside, local, ops.zeros_like(local)), inside

    def _target(self, x: Tensor, target: Tensor) -> Tensor:
        """``x`` (B, T, V/tp) at each target id this rank holds, 0 where another rank holds it: (B, T)."""
        local, inside = self._local_ids(target)
        picked = ops.gather_elements(x, -1, local.expand_dims(-1)).squeeze(-1)
        return picked * inside.astype(picked.dtype)

    def _global_max(self, x: Tensor) -> Tensor:
        """The max of ``x`` (B, T, V/tp) over every rank's slice: (B, T, 1)."""
        m = x.max(axis=-1, keepdims=True)
        if self.tp > 1:
            m = _gather_last(m, self.tp, self.tp_rank, self.gather_all).max(axis=-1, keepdims=True)
        return m


class VocabParallelEmbedding(_VocabSlice):
    """Token embedding holding rows ``[tp_rank*V/tp, (tp_rank+1)*V/tp)`` of the ``(V, H)`` table.

    Ids outside this rank's range look up row 0 and are zeroed; the partial embeddings are
    AllReduced, so each id's row comes from exactly one rank.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: int = 1, tp_rank: int = 0, *,
                 group: Optional[str] = None, dtype: ms.Type = ms.float32):
        super().__init__(vocab_size, tp, tp_rank, group=group)
        self.weight = Parameter(initializer(Normal(0.02), (self.vocab_local, hidden_size), dtype), name="weight")
        self.reduce = ReduceFromTP(tp, group) if tp > 1 else None

    def construct(self, ids: Tensor) -> Tensor:
        if self.tp == 1:
            return ops.gather(self.weight, ids, 0)
        local, inside = self._local_ids(ids)
        rows = ops.gather(self.weight, local, 0)
        rows = rows * inside.astype(rows.dtype).expand_dims(-1)
        return self.reduce(rows)


# ---------------------------------------------------------------------------------------------
# vocab-parallel log-softmax at target ids
# ---------------------------------------------------------------------------------------------
class VocabParallelLogProb(_VocabSlice):
    """``log softmax(logits)[target]`` from per-rank vocabulary slices, exact and differentiable.

    ``logits`` (B, T, V/tp) float32 hold this rank's columns ``[vocab_start, vocab_start + V/tp)``.
    With a shift ``m`` equal on all ranks: ``logp = x[target] − m − log Σ_ranks Σ_v exp(x_v − m)``.
    ``m`` is the global max (a stop-gradient constant: the formula is exact for any shift, the max
    only keeps ``exp`` in range), gathered from the per-rank maxima; the sum of exponentials and
    the target logit (taken by the rank that owns the id, zero elsewhere) are ``ReduceFromTP``
    sums, so ordinary autodiff through them gives the exact gradient on each slice.
    """

    def __init__(self, vocab_size: int, tp: int = 1, tp_rank: int = 0, *, group: Optional[str] = None):
        super().__init__(vocab_size, tp, tp_rank, group=group)
        self.reduce = ReduceFromTP(tp, group)

    def construct(self, logits: Tensor, target: Tensor) -> Tensor:
        logits = logits.astype(ms.float32)
        shifted = logits - ops.stop_gradient(self._global_max(ops.stop_gradient(logits)))
        sum_exp = self.reduce(ops.exp(shifted).sum(axis=-1))  # (B, T)
        return self.reduce(self._target(shifted, target)) - ops.log(sum_exp)


class VocabParallelTokenStats(_VocabSlice):
    """Entropy of ``softmax(logits)`` and whether ``target`` is its argmax, from per-rank vocabulary
    slices (forward only: metrics, never differentiated).

    With the global max ``m`` as shift, ``Z = Σ exp(x − m)`` and ``S = Σ exp(x − m)·(x − m)`` (sums over
    all ranks' slices), the entropy is ``log Z − S / Z``; the target is the argmax when its shifted
    logit is 0 (ties count as correct, where ``argmax`` would pick the first of the tied ids).
    """

    def __init__(self, vocab_size: int, tp: int = 1, tp_rank: int = 0, *, group: Optional[str] = None):
        super().__init__(vocab_size, tp, tp_rank, group=group)
        self.sum = ops.AllReduce(group=group) if tp > 1 else None

    def construct(self, logits: Tensor, target: Tensor) -> Tuple[Tensor, Tensor]:
        logits = ops.stop_gradient(logits.astype(ms.float32))
        shifted = logits - self._global_max(logits)
        e = ops.exp(shifted)
        z, s = e.sum(axis=-1), (e * shifted).sum(axis=-1)
        picked = self._target(shifted, target)
        if self.sum is not None:
            z, s, picked = self.sum(z), self.sum(s), self.sum(picked)
        return ops.log(z) - s / z, (picked >= 0).astype(ms.float32)

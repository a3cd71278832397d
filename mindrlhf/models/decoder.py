"""One readable decoder for the Qwen2 / Qwen2.5 / Qwen3 / Llama family, in MindSpore.

RMSNorm, rotary embeddings (incl. Llama-3 rope scaling), grouped-query attention, SwiGLU MLP, optional q/k/v
bias (Qwen2), optional per-head q/k RMSNorm (Qwen3), tied or untied embeddings. Parameter names and shapes are
exactly the Hugging Face ones, so weights move between the two with a dtype cast only.

The same classes build one **shard** of the model (``ModelShard``): with ``tp > 1`` the linears
are Megatron column/row-parallel and the embedding/output projection vocab-parallel
(``models.tp_layers``; a parameter holds the slice ``parallel.sharding`` gives), and
with ``pp > 1`` the model holds one pipeline stage: its contiguous block of layers (still named
``model.layers.{global index}``), the embedding on the first stage, the final norm and output
projection on the last. A default ``ModelShard()`` is the whole single-process model.

Entry points: ``construct`` (logits, a full model), ``sequence_logprobs`` (completion log-probs,
vocab-parallel under tp), and the per-stage pieces ``stage_forward`` / ``completion_logprobs``
that the pipeline schedule (``mindrlhf.parallel.pipeline``) strings together. Generation with a
KV cache lives in ``mindrlhf.generation.native`` and reuses these layers.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import initializer

from mindrlhf.errors import MindRLHFError
from mindrlhf.models.config import DecoderConfig
from mindrlhf.models.dtypes import DTYPE_ALIASES, VALID_DTYPES
from mindrlhf.models.layer_graphs import LayerGraphs, per_tensor_graph
from mindrlhf.models.lora import adapt_like, adapted_projections
from mindrlhf.models.shard import ModelShard
from mindrlhf.models.tp_layers import (
    ColumnParallelLinear,
    CopyToTP,
    GatherFromTP,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLogProb,
    VocabParallelTokenStats,
)

# Additive mask value: large enough to zero a softmax weight, finite so a fully masked row
# (a left-padding query) stays a harmless uniform distribution instead of NaN.
MASK_VALUE = -1e9

_MS_DTYPES = {"float32": ms.float32, "bfloat16": ms.bfloat16, "float16": ms.float16}


def resolve_dtype(name: str) -> ms.Type:
    """The MindSpore dtype of any spelling in ``models.dtypes`` ("float32"/"fp32", "bf16", "fp16", ...)."""
    key = str(name).strip().lower()
    if key not in DTYPE_ALIASES:
        raise MindRLHFError(f"unsupported dtype {name!r}; use one of {', '.join(VALID_DTYPES)}")
    return _MS_DTYPES[DTYPE_ALIASES[key]]


def rope_inv_freq(config: DecoderConfig) -> np.ndarray:
    """Rotary inverse frequencies (float32), with Llama-3 scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (np.float32(config.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    scaling = config.rope_scaling
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


class RMSNorm(nn.Cell):
    """Root-mean-square norm computed in float32, scaled in the model dtype (as HF does)."""

    def __init__(self, dim: int, eps: float, dtype: ms.Type):
        super().__init__()
        self.weight = Parameter(initializer("ones", (dim,), dtype), name="weight")
        self.eps = eps

    def construct(self, x: Tensor) -> Tensor:
        x32 = x.astype(ms.float32)
        x32 = x32 * ops.rsqrt((x32 * x32).mean(-1, keep_dims=True) + self.eps)
        return self.weight * x32.astype(x.dtype)


def real_token_positions(attention_mask: Tensor) -> Tensor:
    """Positions (B, T) counting real tokens only (``cumsum(mask) - 1``; padding repeats the previous
    real position, left padding gets 0). ``host_positions`` is the same rule on the host.

    The mask may also number the rows packed into one sequence (1, 2, ... left to right, 0 for padding:
    ``trainer.offline.pack_rows``): each packed row then counts its positions from 0, as on its own.
    A 0/1 mask is the one-row case, so its positions are exactly the plain rule's."""
    seg = attention_mask.astype(ms.int32)
    positions = ops.relu(ops.cumsum((seg > 0).astype(ms.int32), 1) - 1)
    keys, queries = seg.expand_dims(1), seg.expand_dims(2)
    earlier_rows = ops.logical_and(keys > 0, keys < queries)  # (B, Tq, Tk): real tokens of the rows before
    return positions - earlier_rows.astype(ms.int32).sum(-1)


def host_positions(mask: np.ndarray, start: int = 0) -> np.ndarray:
    """``real_token_positions`` in numpy along the last axis, counting on from ``start`` real tokens
    already seen (the sampler's prefill and ``models.packing`` build positions on the host)."""
    return np.maximum(start + np.cumsum(mask, axis=-1) - 1, 0).astype(np.int64)


def attention_bias(attention_mask: Tensor) -> Tensor:
    """Additive float32 mask (B, 1, T, T): causal and no attending to padding (mask 0). With packed rows
    (mask values 1, 2, ...: see ``real_token_positions``) a token attends only to its own row's tokens;
    a padding query attends to every real token before it, as with a 0/1 mask (its output is never used)."""
    b, t = attention_mask.shape
    seg = attention_mask.astype(ms.int32)
    keys, queries = seg.expand_dims(1), seg.expand_dims(2)
    same_row = ops.logical_or(keys == queries, queries == 0)
    causal = ops.tril(ops.ones((t, t), ms.bool_)).expand_dims(0)
    allowed = ops.logical_and(ops.logical_and(causal, keys > 0), same_row)
    bias = ops.select(allowed, ops.zeros((b, t, t), ms.float32), ops.full((b, t, t), MASK_VALUE, dtype=ms.float32))
    return bias.expand_dims(1)  # broadcast over query groups


class Attention(nn.Cell):
    """Grouped-query attention over this tp rank's ``H/tp`` query and ``KV/tp`` key/value heads.

    Query heads are grouped per KV head so K/V are never repeated. Under tp the head blocks are
    contiguous (``parallel.sharding``), so a rank's query heads find their kv head locally and
    attention itself needs no communication; o_proj is row-parallel (one AllReduce).
    """

    def __init__(self, config: DecoderConfig, dtype: ms.Type, shard: ModelShard):
        super().__init__()
        h, d, tp, group = config.hidden_size, config.head_dim, shard.tp, shard.tp_group
        self.num_heads, self.num_kv_heads = config.num_attention_heads // tp, config.num_key_value_heads // tp
        self.head_dim = d
        self.group = self.num_heads // self.num_kv_heads
        bias = config.qkv_bias
        # One gradient AllReduce for q, k and v together (they share the input).
        self.copy = CopyToTP(tp, group) if tp > 1 else None
        kw = dict(group=group, dtype=dtype, copy_input=False)
        self.q_proj = ColumnParallelLinear(h, config.num_attention_heads * d, bias, tp, **kw)
        self.k_proj = ColumnParallelLinear(h, config.num_key_value_heads * d, bias, tp, **kw)
        self.v_proj = ColumnParallelLinear(h, config.num_key_value_heads * d, bias, tp, **kw)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, h, config.o_bias, tp, group=group, dtype=dtype)
        # Per-head RMSNorm of q and k before RoPE (the family's ``qk_norm``; replicated under tp).
        self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.upcast = dtype != ms.float32  # scores and softmax in float32 (a no-op cast is a kernel launch)
        self.scatter = ops.ScatterUpdate()
        self.bmm_qk = ops.BatchMatMul(transpose_b=True)
        self.bmm_pv = ops.BatchMatMul()
        # rotate_half(x) = [-x[d/2:], x[:d/2]] as one small matmul with a signed permutation
        # (exact): on CPU a matmul is several times faster than the slices, negation and concat.
        half = d // 2
        rot = np.zeros((d, d), np.float32)
        rot[np.arange(half) + half, np.arange(half)] = -1.0
        rot[np.arange(half), np.arange(half) + half] = 1.0
        self.rotation = Tensor(rot, dtype)
        self.matmul = ops.MatMul()

    def qkv(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """The q, k and v projections of ``x`` (B, T, hidden) as they leave the linear layers (B, T, width)."""
        if self.copy is not None:
            x = self.copy(x)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def position(self, q: Tensor, k: Tensor, v: Tensor, rope: Tuple[Tensor, ...]) -> Tuple[Tensor, Tensor, Tensor]:
        """The projections (``qkv``) split into heads, q and k normed (``qk_norm``) and rotated: q (B, T, H, d)
        carrying the 1/sqrt(d) score scale, k (B, T, KV, d) after RoPE, and v. ``rope``: ``CausalLM.rope_tables``
        (cos/sin already per head and scaled for q)."""
        b, t, _ = q.shape
        hk, d = self.num_kv_heads, self.head_dim
        q = q.reshape(b, t, self.num_heads, d)
        k = k.reshape(b, t, hk, d)
        v = v.reshape(b, t, hk, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos_q, sin_q, cos_k, sin_k = rope
        q = q * cos_q + self.matmul(q.reshape(-1, d), self.rotation).reshape(q.shape) * sin_q
        k = k * cos_k + self.matmul(k.reshape(-1, d), self.rotation).reshape(k.shape) * sin_k
        return q, k, v

    def construct(self, x: Tensor, rope: Tuple[Tensor, ...], bias, kv_cache=None) -> Tensor:
        """``bias``: an additive mask (B, 1, T, T) for padded rows, or (prompt bias, completion bias,
        slot key index) of shared-prompt packed rows (``models.packing``).

        With ``kv_cache = (k_cache, v_cache, index)`` (the sampler's ``CachedDecoder``) this step's K/V
        are written into the flat caches (B*KV*S, d) at rows ``index`` (B, KV, T) and the queries attend
        over the whole cache; ``bias`` is then (B, 1, 1, T, S)."""
        return self.output(*self.qkv(x), rope, bias, kv_cache)

    def output(self, q: Tensor, k: Tensor, v: Tensor, rope: Tuple[Tensor, ...], bias, kv_cache=None) -> Tensor:
        """The attention block's output (o_proj's) from the projections ``qkv`` gives; the rest as ``construct``."""
        b, t, _ = q.shape
        q, k, v = self.position(q, k, v, rope)
        if kv_cache is not None:
            k_cache, v_cache, index = kv_cache
            self.scatter(k_cache, index, k.transpose(0, 2, 1, 3))
            self.scatter(v_cache, index, v.transpose(0, 2, 1, 3))
            s = k_cache.shape[0] // (b * self.num_kv_heads)
            shape = (b, self.num_kv_heads, s, self.head_dim)
            out = self.attend(q, k_cache.reshape(shape), v_cache.reshape(shape), bias)
        elif isinstance(bias, tuple):
            out = self._shared_prompt(q, k, v, bias[0], bias[1], bias[2])
        else:
            out = self._attend(q, k, v, bias)
        return self.o_proj(out.reshape(b, t, -1))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        """Softmax attention, the one place scores are formed: q (B, Tq, H, d) carrying the 1/sqrt(d)
        scale, k/v (B, KV, Tk, d), an additive float32 bias broadcastable to (B, KV, H/KV, Tq, Tk)
        → (B, Tq, H, d). Query head j*g+r attends with kv head j, as HF's repeat_kv does, without
        repeating K/V: the g query heads of a kv head are stacked along the rows of one matmul."""
        b, tq, _, d = q.shape
        tk, hk, g = k.shape[2], self.num_kv_heads, self.group
        q = q.reshape(b, tq, hk, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hk, g * tq, d)
        scores = self.bmm_qk(q, k)
        if self.upcast:
            scores = scores.astype(ms.float32)
        probs = ops.softmax(scores.reshape(b, hk, g, tq, tk) + bias, axis=-1)
        if self.upcast:
            probs = probs.astype(v.dtype)
        out = self.bmm_pv(probs.reshape(b, hk, g * tq, tk), v)
        return out.reshape(b, hk, g, tq, d).transpose(0, 3, 1, 2, 4).reshape(b, tq, hk * g, d)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        """``attend`` for k/v (B, Tk, KV, d) as projected and a mask (B, 1, Tq, Tk)."""
        return self.attend(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), bias.expand_dims(1))

    def _shared_prompt(self, q: Tensor, k: Tensor, v: Tensor, prompt_bias: Tensor, completion_bias: Tensor,
                       slot_keys: Tensor) -> Tensor:
        """Attention over packed rows ``[prompt (P) | slot 1 (S) | ... | slot n (S)]``: the prompt attends
        to itself (``prompt_bias`` (B, 1, P, P)), and each slot's queries to the prompt's keys plus
        its own (``completion_bias`` (B*n, 1, S, P+S)); ``slot_keys`` (n*(P+S),) lists those key
        columns slot after slot. Never forming the score blocks where one completion would see
        another is what makes this cheaper than one (P+nS)² mask."""
        b, t, h, d = q.shape
        p, s, hk = prompt_bias.shape[2], completion_bias.shape[2], self.num_kv_heads
        n = completion_bias.shape[0] // b
        out_prompt = self._attend(q[:, :p], k[:, :p], v[:, :p], prompt_bias)
        # One gather builds every slot's keys (the prompt's, then its own): on CPU several times
        # faster, forward and backward, than broadcasting the prompt and concatenating.
        k_slots = ops.gather(k, slot_keys, 1).reshape(b * n, p + s, hk, d)
        v_slots = ops.gather(v, slot_keys, 1).reshape(b * n, p + s, hk, d)
        out_slots = self._attend(q[:, p:].reshape(b * n, s, h, d), k_slots, v_slots, completion_bias)
        return ops.concat((out_prompt, out_slots.reshape(b, n * s, h, d)), axis=1)


class MLP(nn.Cell):
    """SwiGLU ``down(silu(gate(x)) * up(x))``; gate/up column-parallel, down row-parallel under tp."""

    def __init__(self, config: DecoderConfig, dtype: ms.Type, shard: ModelShard):
        super().__init__()
        h, i, tp, group = config.hidden_size, config.intermediate_size, shard.tp, shard.tp_group
        bias = config.mlp_has_bias
        self.copy = CopyToTP(tp, group) if tp > 1 else None
        kw = dict(group=group, dtype=dtype, copy_input=False)
        self.gate_proj = ColumnParallelLinear(h, i, bias, tp, **kw)
        self.up_proj = ColumnParallelLinear(h, i, bias, tp, **kw)
        self.down_proj = RowParallelLinear(i, h, bias, tp, group=group, dtype=dtype)

    def construct(self, x: Tensor) -> Tensor:
        return self.down(*self.gate_up(x))

    def gate_up(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """The gate and up projections of ``x``."""
        if self.copy is not None:
            x = self.copy(x)
        return self.gate_proj(x), self.up_proj(x)

    def down(self, gate: Tensor, up: Tensor) -> Tensor:
        """``down(silu(gate) * up)``: the block's output from ``gate_up``'s."""
        return self.down_proj(ops.silu(gate) * up)


class DecoderLayer(nn.Cell):
    def __init__(self, config: DecoderConfig, dtype: ms.Type, shard: ModelShard):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype, shard)

    #: The layer's maths in four pieces, each ending in linear layers' outputs, and the parameters each holds
    #: (name prefixes). ``forward_kept`` runs them in order and returns the tensors between them, from which
    #: ``models.layer_graphs`` differentiates each piece on its own (the linear layers' forward never runs
    #: again in the backward; only the norms, RoPE, attention's core and the activation are recomputed).
    PIECES = (("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              ("self_attn.q_norm", "self_attn.k_norm", "self_attn.o_proj"),
              ("post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj"),
              ("mlp.down_proj",))

    def construct(self, x, rope, bias, kv_cache=None):
        """Pre-norm residual block; ``kv_cache`` as in ``Attention.construct`` (the sampler's path)."""
        return self.forward_kept(x, rope, bias, kv_cache)[0]

    def forward_kept(self, x, rope, bias, kv_cache=None):
        """The layer's output and the tensors between its ``PIECES``: the q/k/v projections, the attention
        block's output, the MLP's gate and up projections."""
        q, k, v = self.attention_inputs(x)
        attn = self.self_attn.output(q, k, v, rope, bias, kv_cache)
        h, gate, up = self.mlp_inputs(x, attn)
        return h + self.mlp.down(gate, up), (q, k, v, attn, gate, up)

    def attention_inputs(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Piece 1: the q/k/v projections of the normed input."""
        return self.self_attn.qkv(self.input_layernorm(x))

    def mlp_inputs(self, x: Tensor, attn: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Piece 3: the residual stream after attention and the MLP's gate and up projections of it, normed."""
        h = x + attn
        gate, up = self.mlp.gate_up(self.post_attention_layernorm(h))
        return h, gate, up


class _OtherStage(nn.Cell):
    """Stands in for a layer another pipeline stage owns, so owned layers keep their global names."""

    def construct(self, x):
        return x


class DecoderModel(nn.Cell):
    """Embedding + decoder layers + final norm (HF's ``model.*`` parameters), or a stage's part of them."""

    def __init__(self, config: DecoderConfig, dtype: ms.Type, shard: ModelShard):
        super().__init__()
        layers = shard.layer_range(config)
        # The last stage of a tied causal LM projects with the embedding table, so it holds a copy.
        if shard.is_first or (shard.is_last and config.tied_output):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard.tp,
                                                       shard.tp_rank, group=shard.tp_group, dtype=dtype)
        self.layers = nn.CellList([DecoderLayer(config, dtype, shard) if i in layers else _OtherStage()
                                   for i in range(layers.stop)])
        if shard.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


def row_chunks(rows, chunk: int) -> range:
    """Start offsets of ``chunk``-row slices of ``rows`` rows. In a dynamic-shape graph the row count is not
    known when it compiles (``ops.isconstant`` is false): then one chunk holds every row."""
    return range(0, rows, chunk) if ops.isconstant(rows) else range(0, 1)


def take_rows(x: Tensor, start: int, chunk: int) -> Tensor:
    """Rows ``start:start + chunk`` of ``x`` (all of them when the row count is dynamic: see ``row_chunks``)."""
    return x[start:start + chunk] if ops.isconstant(x.shape[0]) else x


_MATMUL_BT, _MATMUL, _MATMUL_AT = ops.MatMul(transpose_b=True), ops.MatMul(), ops.MatMul(transpose_a=True)
_REDUCE_MAX = ops.ReduceMax()


def _chunk_logits(h: Tensor, weight: Tensor, inv_t: Tensor) -> Tensor:
    """float32 ``h·Wᵀ · inv_t`` of one chunk of rows."""
    if h.dtype == ms.float32:  # scale the (rows, H) input, not the (rows, V) output
        return _MATMUL_BT(h * inv_t, weight)
    return _MATMUL_BT(h, weight).astype(ms.float32) * inv_t


def _chunk_token_logp(h: Tensor, weight: Tensor, ids: Tensor, inv_t: Tensor) -> Tensor:
    """One chunk's ``log softmax(h·Wᵀ · inv_t)[ids]`` (rows,)."""
    logp = ops.log_softmax(_chunk_logits(h, weight, inv_t), -1)
    return ops.gather_elements(logp, 1, ids.expand_dims(-1)).squeeze(-1)


def _chunk_token_logp_stats(h: Tensor, weight: Tensor, ids: Tensor, inv_t: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``_chunk_token_logp`` plus each row's entropy ``-Σ p·log p`` and 1.0 where ``ids`` is the argmax (ties count),
    from the same logits (metrics: ``ChunkedTokenLogProb``'s backward gives them no gradient)."""
    logp = ops.log_softmax(_chunk_logits(h, weight, inv_t), -1)
    picked = ops.gather_elements(logp, 1, ids.expand_dims(-1)).squeeze(-1)
    entropy = -(ops.exp(logp) * logp).sum(-1)
    return picked, entropy, (picked >= _REDUCE_MAX(logp, -1)).astype(ms.float32)


def _chunk_grads(h: Tensor, weight: Tensor, ids: Tensor, g: Tensor, inv_t: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """One chunk's backward (``ChunkedTokenLogProb``'s formulas) for ``g`` = upstream gradient · inv_t (rows, 1):
    (dh, g ⊙ h, the chunk's -pᵀ·(g ⊙ h) part of dW without its sign)."""
    p = ops.softmax(_chunk_logits(h, weight, inv_t), -1).astype(h.dtype)
    gh = g * h
    return g * (ops.gather(weight, ids, 0) - _MATMUL(p, weight)), gh, _MATMUL_AT(p, gh)


def _chunk_input_grad(h: Tensor, weight: Tensor, ids: Tensor, g: Tensor, inv_t: Tensor) -> Tensor:
    """``_chunk_grads``' dh alone, for a frozen output projection (its dW product is skipped)."""
    p = ops.softmax(_chunk_logits(h, weight, inv_t), -1).astype(h.dtype)
    return g * (ops.gather(weight, ids, 0) - _MATMUL(p, weight))


def _weight_grad(scaled: Tensor, token_ids: Tensor, softmax_part: Tensor) -> Tensor:
    """dW = Σ_rows onehotᵀ·(g ⊙ h) - Σ_chunks pᵀ·(g ⊙ h)."""
    return ops.unsorted_segment_sum(scaled, token_ids, softmax_part.shape[0]) - softmax_part


class CompiledChunks:
    """The chunk pieces as compiled graphs (``layer_graphs.per_tensor_graph``), for pynative callers: where the head
    runs between the layer graphs (``CausalLM.compiled_layers``), MindSpore's pynative MatMul ran its (rows, H) x
    (V, H) products at ~55-65% of the same product in a graph (bench/README.md). A whole-model graph inlines
    the plain functions instead (it cannot call these Python wrappers)."""

    token_logp = staticmethod(per_tensor_graph(_chunk_token_logp, "chunk_token_logp"))
    token_logp_stats = staticmethod(per_tensor_graph(_chunk_token_logp_stats, "chunk_token_logp_stats"))
    grads = staticmethod(per_tensor_graph(_chunk_grads, "chunk_grads"))
    input_grad = staticmethod(per_tensor_graph(_chunk_input_grad, "chunk_input_grad"))
    weight_grad = staticmethod(per_tensor_graph(_weight_grad, "weight_grad"))


def _join(parts) -> Tensor:
    """The chunks' rows as one tensor."""
    return parts[0] if len(parts) == 1 else ops.concat(parts)


class ChunkedTokenLogProb(nn.Cell):
    """``log softmax(h·Wᵀ · inv_t)[token]`` for hidden rows h (N, H) and an output projection W (V, H),
    a chunk of rows at a time, with a hand-written backward that recomputes each chunk's logits.

    The plain path keeps (N, V) float32 logits, their log-softmax and the gradients of both alive
    at once (for the 151,936-token Qwen vocabulary, ~0.3 GB per copy at 512 rows); here at most one
    chunk's logits exist and the backward needs nothing saved beyond h. With p = softmax and
    g the upstream gradient, d logp / d logits = inv_t · (onehot - p), so

        dh = g·inv_t ⊙ (W[token] - p·W)        dW = -pᵀ·(g·inv_t ⊙ h) + Σ_rows onehotᵀ·(g·inv_t ⊙ h)

    and the only (chunk, V)-sized work besides the matmuls is one softmax: on CPU, elementwise
    kernels over the vocabulary cost as much as the matmuls. One extra output-projection matmul
    per backward is the price. In pynative under ``CausalLM.compiled_layers`` each chunk's forward and backward
    run as compiled graphs (``CompiledChunks``).

    ``stats``: return ``(logp, entropy, correct)``, each row's entropy and argmax hit computed from the same
    chunk of logits (SFT's metrics; no gradient reaches them), instead of a second pass over the vocabulary.
    """

    def __init__(self, chunk_rows: int, stats: bool = False):
        super().__init__()
        self.chunk = max(1, int(chunk_rows))
        self.stats = bool(stats)
        self.compiled_chunks: Optional[CompiledChunks] = None  # set by CausalLM.compiled_layers (pynative only)
        #: False for a frozen output projection (LoRA's base): the backward forms dh alone, no dW product.
        self.weight_grad = True

    def construct(self, hidden: Tensor, weight: Tensor, token_ids: Tensor, inv_t: Tensor):
        """hidden (N, H), weight (V, H), token_ids (N,) int32, inv_t: 1/temperature (0-d float32) → (N,)
        (with ``stats``: a tuple of three (N,))."""
        pieces = self.compiled_chunks
        logp, entropy, correct = [], [], []
        for s in row_chunks(hidden.shape[0], self.chunk):
            h, ids = take_rows(hidden, s, self.chunk), take_rows(token_ids, s, self.chunk)
            if self.stats:
                picked, e, k = _chunk_token_logp_stats(h, weight, ids, inv_t) if pieces is None \
                    else pieces.token_logp_stats(h, weight, ids, inv_t)
                entropy.append(e)
                correct.append(k)
            else:
                picked = _chunk_token_logp(h, weight, ids, inv_t) if pieces is None \
                    else pieces.token_logp(h, weight, ids, inv_t)
            logp.append(picked)
        if not self.stats:
            return _join(logp)
        return _join(logp), _join(entropy), _join(correct)

    def bprop(self, hidden, weight, token_ids, inv_t, out, dout):
        if self.stats:
            dout = dout[0]  # entropy and argmax hit are metrics
        if not self.weight_grad:
            return self._input_grad(hidden, weight, token_ids, inv_t, dout), ops.zeros_like(weight), \
                ops.zeros_like(token_ids), ops.zeros_like(inv_t)
        pieces = self.compiled_chunks
        dh, scaled, dw = [], [], None
        for s in row_chunks(hidden.shape[0], self.chunk):
            h, ids = take_rows(hidden, s, self.chunk), take_rows(token_ids, s, self.chunk)
            g = (take_rows(dout, s, self.chunk) * inv_t).expand_dims(-1).astype(h.dtype)  # (rows, 1)
            dh_part, gh, part = _chunk_grads(h, weight, ids, g, inv_t) if pieces is None \
                else pieces.grads(h, weight, ids, g, inv_t)
            dh.append(dh_part)
            scaled.append(gh)
            dw = part if dw is None else dw + part
        dw = _weight_grad(_join(scaled), token_ids, dw) if pieces is None else pieces.weight_grad(_join(scaled),
                                                                                                token_ids, dw)
        return _join(dh), dw, ops.zeros_like(token_ids), ops.zeros_like(inv_t)

    def _input_grad(self, hidden, weight, token_ids, inv_t, dout):
        """dh alone (a frozen output projection): no dW product."""
        pieces = self.compiled_chunks
        dh = []
        for s in row_chunks(hidden.shape[0], self.chunk):
            h, ids = take_rows(hidden, s, self.chunk), take_rows(token_ids, s, self.chunk)
            g = (take_rows(dout, s, self.chunk) * inv_t).expand_dims(-1).astype(h.dtype)  # (rows, 1)
            dh.append(_chunk_input_grad(h, weight, ids, g, inv_t) if pieces is None
                      else pieces.input_grad(h, weight, ids, g, inv_t))
        return _join(dh)


class CausalLM(nn.Cell):
    """Qwen2 / Llama causal language model (or one tp × pp shard of it) with float32 logits.

    ``shard`` (default: the whole model) says which tp slice and pipeline stage this process holds;
    ``shard.tp_group`` must name the tp communication group when ``tp > 1``
    (``mindrlhf.parallel.groups.init_parallel_groups``). Building never touches the
    communication runtime, so shapes and names can be checked in one process.
    """

    def __init__(self, config: DecoderConfig, dtype: str = "float32", shard: Optional[ModelShard] = None):
        super().__init__()
        shard = shard or ModelShard()
        shard.validate(config)
        self.config, self.shard = config, shard
        self.tp, self.tp_rank = shard.tp, shard.tp_rank
        self.is_first, self.is_last = shard.is_first, shard.is_last  # plain bools: graph mode reads them
        self.compute_dtype = resolve_dtype(dtype)
        if self.compute_dtype == ms.bfloat16 and ms.get_context("device_target") == "CPU":
            raise MindRLHFError("dtype bfloat16: MindSpore has no CPU kernels for bf16 MatMul/Gather/Sigmoid; "
                                "use float32 (or float16) on CPU — bfloat16 is for Ascend")
        self.layer_range = shard.layer_range(config)
        self.model = DecoderModel(config, self.compute_dtype, shard)
        self.tie_word_embeddings = config.tied_output
        self.num_labels = config.num_labels
        if shard.is_last and config.num_labels:
            # HF's *ForSequenceClassification head: replicated under tp (the final hidden states are
            # replicated, so every tp rank computes the same scores and the same gradient).
            self.score = nn.Dense(config.hidden_size, config.num_labels, has_bias=False, dtype=self.compute_dtype)
        elif shard.is_last and not config.tie_word_embeddings:
            self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, False, shard.tp,
                                                group=shard.tp_group, dtype=self.compute_dtype, copy_input=False)
        self.head_copy = CopyToTP(shard.tp, shard.tp_group) if shard.tp > 1 else None
        self.gather_vocab = GatherFromTP(shard.tp, shard.tp_rank, shard.tp_group) if shard.tp > 1 else None
        self.vocab_logprob = VocabParallelLogProb(config.vocab_size, shard.tp, shard.tp_rank,
                                                  group=shard.tp_group) if shard.tp > 1 else None
        # Whole-vocabulary log-probs a chunk of rows at a time: ~64 MB of float32 logits per chunk.
        self.chunk_rows = max(1, (1 << 24) // config.vocab_size)
        self.chunked_logprob = ChunkedTokenLogProb(self.chunk_rows) if shard.tp == 1 else None
        self.chunked_logprob_stats = ChunkedTokenLogProb(self.chunk_rows, stats=True) if shard.tp == 1 else None
        self.vocab_stats = VocabParallelTokenStats(config.vocab_size, shard.tp, shard.tp_rank, group=shard.tp_group)
        self.inv_freq = Tensor(rope_inv_freq(config))
        self.head_matmul = ops.MatMul(transpose_b=True)
        self.num_layers = config.num_hidden_layers
        self._layer_graphs: Optional[LayerGraphs] = None  # built by the first ``compiled_layers``
        self._use_layer_graphs = False
        self._layer_graphs_lora = None  # the LoRA spec the layer graphs' template was built with
        self.lora_spec = None  # a ``models.lora.LoRASpec`` once ``models.lora.apply_lora`` attached adapters

    def sync_head_gradient(self) -> None:
        """Let the chunked log-prob head skip its output projection's gradient while that table is frozen
        (``requires_grad`` False, as LoRA leaves the base): one vocabulary-sized product less per chunk in every
        backward. Call after changing which parameters train; a stage without the vocabulary head keeps it."""
        if not self.is_last or self.num_labels:
            return
        for cell in self._chunked_heads():
            cell.weight_grad = bool(self.head_table().requires_grad)

    def set_chunk_rows(self, rows: int) -> None:
        """Rows of logits formed at a time by every chunked head piece (tests set small chunks)."""
        self.chunk_rows = max(1, int(rows))
        for cell in self._chunked_heads():
            cell.chunk = self.chunk_rows

    def _chunked_heads(self) -> Tuple[ChunkedTokenLogProb, ...]:
        """The chunked vocabulary-head cells this shard has (none under tp)."""
        return tuple(cell for cell in (self.chunked_logprob, self.chunked_logprob_stats) if cell is not None)

    # -- shared pieces -------------------------------------------------------------------------
    def rope(self, position_ids: Tensor) -> Tuple[Tensor, Tensor]:
        """cos/sin of shape (B, T, head_dim) for integer positions (B, T)."""
        freqs = position_ids.astype(ms.float32).expand_dims(-1) * self.inv_freq
        emb = ops.concat((freqs, freqs), axis=-1)
        return ops.cos(emb), ops.sin(emb)

    def rope_tables(self, position_ids: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """(cos_q, sin_q, cos_k, sin_k) for ``Attention.position``, made once per forward for all layers:
        (B, T, heads, d) in the compute dtype, q's carrying the 1/sqrt(d) score scale. Materialised
        per head because MindSpore's CPU kernels multiply equal shapes far faster than broadcasts."""
        cos, sin = self.rope(position_ids)
        cos, sin = cos.expand_dims(2), sin.expand_dims(2)
        scale = 1.0 / math.sqrt(self.config.head_dim)
        heads, kv_heads = self.config.num_attention_heads // self.tp, self.config.num_key_value_heads // self.tp
        tables = (ops.tile(cos * scale, (1, 1, heads, 1)), ops.tile(sin * scale, (1, 1, heads, 1)),
                  ops.tile(cos, (1, 1, kv_heads, 1)), ops.tile(sin, (1, 1, kv_heads, 1)))
        if self.compute_dtype == ms.float32:
            return tables
        return tuple(x.astype(self.compute_dtype) for x in tables)

    def head_table(self) -> Tensor:
        """This rank's rows of the output projection (the embedding table when tied)."""
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def logits(self, hidden: Tensor) -> Tensor:
        """Project final hidden states (B, T, H) to float32 logits (B, T, V/tp): this rank's vocabulary slice."""
        b, t, h = hidden.shape
        if self.head_copy is not None:
            hidden = self.head_copy(hidden)
        out = self.head_matmul(hidden.reshape(-1, h), self.head_table())
        return out.astype(ms.float32).reshape(b, t, -1)

    def gather_logits(self, local_logits: Tensor) -> Tensor:
        """Full-vocabulary logits from this rank's slice (identity without tp)."""
        return local_logits if self.gather_vocab is None else self.gather_vocab(local_logits)

    def token_logprobs(self, logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
        """``log softmax(logits / T)`` at ``token_ids``: (B, C, V/tp), (B, C) → (B, C) float32.

        Under tp the softmax normaliser is summed over the ranks' slices (full logits never exist).
        """
        if temperature != 1.0:
            logits = logits / temperature
        if self.vocab_logprob is not None:
            return self.vocab_logprob(logits, token_ids)
        logp = ops.log_softmax(logits, axis=-1)
        return ops.gather_elements(logp, 2, token_ids.astype(ms.int32).expand_dims(-1)).squeeze(-1)

    def head_logprobs(self, hidden: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
        """Final hidden states (B, C, H) (after the norm) → log-probs (B, C) float32 of ``token_ids``
        under ``softmax(logits / temperature)``: chunked without tp, vocab-parallel under tp."""
        if self.chunked_logprob is None:
            return self.token_logprobs(self.logits(hidden), token_ids, temperature)
        rows, table, ids, inv_t = self._chunked_head_inputs(hidden, token_ids, temperature)
        return self.chunked_logprob(rows, table, ids, inv_t).reshape(token_ids.shape)

    def _chunked_head_inputs(self, hidden: Tensor, token_ids: Tensor,
                             temperature: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """A chunked head's arguments: (B, C, H) hidden states and (B, C) ids flattened to rows, the output
        projection, and 1/temperature as a float32 scalar tensor."""
        b, c, h = hidden.shape
        return (hidden.reshape(b * c, h), self.head_table(), token_ids.astype(ms.int32).reshape(-1),
                ops.fill(ms.float32, (), 1.0 / temperature))

    # -- per-stage pieces (pipeline parallel) --------------------------------------------------
    def stage_forward(self, inputs: Tensor, attention_mask: Tensor) -> Tensor:
        """This stage's layers: token ids (first stage) or the previous stage's hidden states
        (B, T, H) in, hidden states (B, T, H) out (before the final norm)."""
        return self._layers(self.model.embed_tokens(inputs) if self.is_first else inputs,
                            real_token_positions(attention_mask), attention_bias(attention_mask))

    def _layers(self, x: Tensor, position_ids: Tensor, bias) -> Tensor:
        rope = self.rope_tables(position_ids)
        graphs = self._layer_graphs if self._use_layer_graphs else None
        for i in self.layer_range:
            layer = self.model.layers[i]
            x = layer(x, rope, bias) if graphs is None else graphs.run(layer, x, rope, bias)
        return x

    @contextlib.contextmanager
    def compiled_layers(self, static: bool = False, graph_kernel: bool = False, keep: bool = False):
        """Within this block (pynative only, never inside ``mindspore.jit``) the decoder layers run as
        two compiled graphs shared by all of them, recomputing each layer's forward in the backward
        (``models.layer_graphs``): faster than pynative layers and lighter than a compiled model; the
        vocabulary head's chunks run as compiled graphs too (``CompiledChunks``).
        ``static``: graphs compiled per input shape (a bounded number of them; ``LayerGraphs.static``)
        instead of one dynamic-shape pair; ``graph_kernel``: those static graphs compiled with MindSpore's
        graph-kernel fusion (``LayerGraphs.graph_kernel``); ``keep``: forwards that record gradients keep their
        linear layers' outputs and the backward recomputes only the rest (``LayerGraphs.keep``, ``recompute
        selective``)."""
        if self._layer_graphs is None or self._layer_graphs_lora is not self.lora_spec:
            self._layer_graphs = LayerGraphs(self._layer_template())
            self._layer_graphs_lora = self.lora_spec
        self._use_layer_graphs = True
        self._layer_graphs.static = static
        self._layer_graphs.graph_kernel = graph_kernel
        self._layer_graphs.keep = keep
        heads = self._chunked_heads()
        for cell in heads:
            cell.compiled_chunks = CompiledChunks
        try:
            yield
        finally:
            self._use_layer_graphs = False
            self._layer_graphs.keep = False
            self._layer_graphs.release_kept()
            for cell in heads:
                cell.compiled_chunks = None

    def _layer_template(self) -> nn.Cell:
        """The layer the shared graphs are compiled on: a ``DecoderLayer`` like this shard's, with the same LoRA
        adapters (frozen base, trainable factors) when the model has them (``models.lora.adapt_like``)."""
        template = DecoderLayer(self.config, self.compute_dtype, self.shard)
        if self.lora_spec is None:
            return template
        layers = [self.model.layers[i] for i in self.layer_range]
        if len({adapted_projections(layer) for layer in layers}) > 1:
            raise MindRLHFError(f"compiled layer graphs: LoRA target_modules {self.lora_spec.target_modules!r} adapt "
                                "different projections in different layers, and one compiled layer serves all; "
                                "target the same projections in every layer, or set layer_graphs false")
        adapt_like(template, layers[0])
        return template

    @property
    def layer_graphs(self) -> Optional[LayerGraphs]:
        """The shared layer graphs (None until the first ``compiled_layers``): how many static shapes they hold."""
        return self._layer_graphs

    def completion_logprobs(self, hidden: Tensor, completion_ids: Tensor, temperature: float = 1.0) -> Tensor:
        """Last stage: final norm, output projection and log-probs of the last C positions → (B, C)."""
        t, c = hidden.shape[1], completion_ids.shape[1]
        return self.head_logprobs(self.model.norm(hidden[:, t - c:]), completion_ids, temperature)

    def completion_logprobs_and_stats(self, hidden: Tensor, completion_ids: Tensor,
                                      temperature: float = 1.0) -> Tuple[Tensor, Tensor, Tensor]:
        """``completion_logprobs`` plus, per completion token, the entropy of the model's next-token
        distribution and whether the token is its argmax (float32 (B, C) each; metrics, no gradient)."""
        t, c = hidden.shape[1], completion_ids.shape[1]
        normed = self.model.norm(hidden[:, t - c:])
        if self.chunked_logprob_stats is not None:  # the statistics from the log-probs' own logits
            rows, table, ids, inv_t = self._chunked_head_inputs(normed, completion_ids, temperature)
            logp, entropy, correct = self.chunked_logprob_stats(rows, table, ids, inv_t)
            shape = completion_ids.shape
            return logp.reshape(shape), entropy.reshape(shape), correct.reshape(shape)
        entropy, correct = self.token_stats(ops.stop_gradient(normed), completion_ids, temperature)
        return self.head_logprobs(normed, completion_ids, temperature), entropy, correct

    def token_stats(self, hidden: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tuple[Tensor, Tensor]:
        """Entropy and argmax-hit (B, C) of ``softmax(logits / temperature)`` at final hidden states
        (after the norm), a chunk of rows at a time so (rows, V) float32 logits never exist whole."""
        b, c, h = hidden.shape
        flat, ids = hidden.reshape(b * c, h), token_ids.astype(ms.int32).reshape(b * c)
        entropy, correct = [], []
        for s in row_chunks(b * c, self.chunk_rows):
            h, t = take_rows(flat, s, self.chunk_rows), take_rows(ids, s, self.chunk_rows)
            logits = self.logits(h.expand_dims(0))
            if temperature != 1.0:
                logits = logits / temperature
            e, k = self.vocab_stats(logits, t.expand_dims(0))
            entropy.append(e.squeeze(0))
            correct.append(k.squeeze(0))
        if len(entropy) > 1:
            return ops.concat(entropy).reshape(b, c), ops.concat(correct).reshape(b, c)
        return entropy[0].reshape(b, c), correct[0].reshape(b, c)

    def sequence_scores(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        """Last stage of a sequence-classification model: the ``score`` head (float32, (B, num_labels))
        at each row's last real token (the rightmost mask 1, so left and right padding both work; HF
        reads the rightmost non-pad token, which is the same position when padding uses pad ids)."""
        b, t, h = hidden.shape
        last = ops.argmax(ops.arange(t, dtype=ms.int32).expand_dims(0) * attention_mask.astype(ms.int32), -1)
        rows = ops.gather(hidden.reshape(b * t, h), last.astype(ms.int32) + ops.arange(b, dtype=ms.int32) * t, 0)
        return self.score(self.model.norm(rows)).astype(ms.float32)

    def completion_values(self, hidden: Tensor, width: int) -> Tensor:
        """Last stage of a one-label sequence-classification model used as PPO's critic: the ``score`` head
        (float32, (B, C)) at the last ``width`` positions, the states before each completion token (the
        positions whose logits would predict it)."""
        t = hidden.shape[1]
        return self.score(self.model.norm(hidden[:, t - width:])).astype(ms.float32)[..., 0]

    # -- whole-model entry points (pp == 1) ----------------------------------------------------
    def scores(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Per-sequence scores (B, num_labels) of a sequence-classification model (a reward model)."""
        return self.sequence_scores(self.stage_forward(input_ids, attention_mask), attention_mask)

    def construct(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                  position_ids: Optional[Tensor] = None, logits_to_keep: int = 0) -> Tensor:
        """Logits (B, T, V) for ``input_ids`` (B, T); with ``logits_to_keep=n`` only the last n.

        ``attention_mask`` (B, T) marks real tokens with 1 and padding with 0 (left, right or
        both). Default positions count real tokens only (``cumsum(mask) - 1``), which is what
        generation with left-padded prompts uses, so training log-probs match sampling ones.
        Under tp the last axis is this rank's vocabulary slice ``[tp_rank*V/tp, (tp_rank+1)*V/tp)``.
        """
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = ops.ones((b, t), ms.int32)
        if position_ids is None:
            position_ids = real_token_positions(attention_mask)
        x = self._layers(self.model.embed_tokens(input_ids), position_ids, attention_bias(attention_mask))
        x = self.model.norm(x)
        if logits_to_keep > 0:
            x = x[:, t - logits_to_keep:]
        return self.logits(x)

    def sequence_logprobs(self, input_ids: Tensor, attention_mask: Tensor, completion_ids: Tensor,
                          temperature: float = 1.0) -> Tensor:
        """Per-token log-probs (B, C) of the completion part of ``[prompt | completion]``.

        ``input_ids``/``attention_mask`` are the full sequence minus its last token, so the last
        ``C`` logits predict exactly the ``C`` completion tokens. The same values on every tp rank.
        """
        return self.completion_logprobs(self.stage_forward(input_ids, attention_mask), completion_ids, temperature)

    def packed_logprobs(self, input_ids: Tensor, position_ids: Tensor, prompt_bias: Tensor, completion_bias: Tensor,
                        slot_keys: Tensor, gather_index: Tensor, completion_ids: Tensor,
                        temperature: float = 1.0) -> Tensor:
        """Per-token log-probs (N, C) of N completions packed with their shared prompts
        (``models.packing``): the biases say what each prompt / completion-slot position sees and
        ``gather_index`` (N, C) which positions' logits predict each completion token."""
        states = self._packed_states(input_ids, position_ids, prompt_bias, completion_bias, slot_keys, gather_index)
        return self.head_logprobs(states, completion_ids, temperature)

    def packed_values(self, input_ids: Tensor, position_ids: Tensor, prompt_bias: Tensor, completion_bias: Tensor,
                      slot_keys: Tensor, gather_index: Tensor) -> Tensor:
        """A critic's values (N, C) of N completions packed with their shared prompts: its ``score`` head at the
        positions ``gather_index`` names (those that predict each completion token), as ``completion_values``."""
        states = self._packed_states(input_ids, position_ids, prompt_bias, completion_bias, slot_keys, gather_index)
        return self.score(states).astype(ms.float32)[..., 0]

    def packed_scores(self, input_ids: Tensor, position_ids: Tensor, prompt_bias: Tensor, completion_bias: Tensor,
                      slot_keys: Tensor, gather_index: Tensor, score_index: Tensor) -> Tensor:
        """A sequence-classification model's scores (N, num_labels) of N rows packed with their shared prompts:
        its ``score`` head at each row's last real token, the position ``gather_index[n, score_index[n]]`` (the one
        that would predict a token after the row), as ``sequence_scores`` reads it in a padded row."""
        x = self._packed_hidden(input_ids, position_ids, prompt_bias, completion_bias, slot_keys)
        b, t, h = x.shape
        n, c = gather_index.shape
        last = ops.gather(gather_index.reshape(-1), ops.arange(n, dtype=ms.int32) * c + score_index.astype(ms.int32), 0)
        return self.score(self.model.norm(ops.gather(x.reshape(b * t, h), last, 0))).astype(ms.float32)

    def _packed_hidden(self, input_ids, position_ids, prompt_bias, completion_bias, slot_keys):
        """The decoder's hidden states (G, T, H) of a packed batch, before the final norm (``models.packing``)."""
        return self._layers(self.model.embed_tokens(input_ids), position_ids, (prompt_bias, completion_bias, slot_keys))

    def _packed_states(self, input_ids, position_ids, prompt_bias, completion_bias, slot_keys, gather_index):
        """The final-normed hidden states (N, C, H) at ``gather_index`` of a packed batch."""
        x = self._packed_hidden(input_ids, position_ids, prompt_bias, completion_bias, slot_keys)
        b, t, h = x.shape
        x = ops.gather(x.reshape(b * t, h), gather_index.reshape(-1), 0).reshape(*gather_index.shape, h)
        return self.model.norm(x)

    def gathered_logits(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                        position_ids: Optional[Tensor] = None, logits_to_keep: int = 0) -> Tensor:
        """Full-vocabulary logits on every tp rank (evaluation and tests)."""
        return self.gather_logits(self.construct(input_ids, attention_mask, position_ids, logits_to_keep))

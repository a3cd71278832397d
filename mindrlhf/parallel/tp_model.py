"""Tensor-parallel (Megatron-style) Qwen2 / Llama decoder for training: ``TPCausalLM``.

The same math as ``mindrlhf.models.decoder.CausalLM`` (RMSNorm, rope with positions
``cumsum(mask) − 1``, grouped-query attention, SwiGLU, tied or untied embeddings), with

* q/k/v and gate/up column-parallel: tp rank ``t`` holds query heads ``[t*H/tp, (t+1)*H/tp)``,
  kv heads ``[t*KV/tp, (t+1)*KV/tp)`` and MLP columns ``[t*I/tp, (t+1)*I/tp)`` (its query heads'
  kv heads are local, so attention needs no communication);
* o_proj and down_proj row-parallel (one AllReduce each per layer, forward);
* the embedding and the output projection vocab-parallel (tied: the same local slice);
* RMSNorm weights replicated.

Parameter names and shapes are the HF names with the slice ``sharding.shard_tensor`` gives, so
``set_weights(model, sharding.rank_state(full_weights, config, layout, rank))`` loads a rank.
``construct`` returns this rank's vocabulary slice of the logits; ``sequence_logprobs`` gives the
completion log-probs through a vocab-parallel log-softmax (the full logits are never built), and
``gathered_logits`` the full logits (evaluation/tests). Each tp rank ends with the same loss; the
gradient of each parameter slice is the slice of the single-process gradient. With data parallel
on top, sum those gradients over the dp group (``dp_grad_reducer``).
"""
from __future__ import annotations

import math
from typing import Optional

import mindspore as ms
from mindspore import Tensor, nn, ops

from mindrlhf.errors import MindRLHFError
from mindrlhf.models.config import DecoderConfig
from mindrlhf.models.decoder import MASK_VALUE, RMSNorm, resolve_dtype, rope_inv_freq, rotate_half
from mindrlhf.parallel.layout import ParallelLayout
from mindrlhf.parallel.tp_layers import (ColumnParallelLinear, CopyToTP, GatherFromTP, RowParallelLinear,
                                         VocabParallelEmbedding, VocabParallelLogProb)


class TPAttention(nn.Cell):
    """Grouped-query attention over this rank's ``H/tp`` query and ``KV/tp`` key/value heads."""

    def __init__(self, config: DecoderConfig, tp: int, group: Optional[str], dtype: ms.Type):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = config.num_key_value_heads // tp
        self.head_dim = d
        self.group = self.num_heads // self.num_kv_heads
        self.scale = 1.0 / math.sqrt(d)
        bias = config.attention_bias
        self.copy = CopyToTP(tp, group)  # one gradient AllReduce for q, k and v together
        kw = dict(group=group, dtype=dtype, copy_input=False)
        self.q_proj = ColumnParallelLinear(h, config.num_attention_heads * d, bias, tp, **kw)
        self.k_proj = ColumnParallelLinear(h, config.num_key_value_heads * d, bias, tp, **kw)
        self.v_proj = ColumnParallelLinear(h, config.num_key_value_heads * d, bias, tp, **kw)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, h, False, tp, group=group, dtype=dtype)
        self.bmm_qk = ops.BatchMatMul(transpose_b=True)
        self.bmm_pv = ops.BatchMatMul()

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor) -> Tensor:
        b, t, _ = x.shape
        hk, g, d = self.num_kv_heads, self.group, self.head_dim
        x = self.copy(x)
        q = self.q_proj(x).reshape(b, t, self.num_heads, d)
        k = self.k_proj(x).reshape(b, t, hk, d)
        v = self.v_proj(x).reshape(b, t, hk, d)
        cos, sin = cos.expand_dims(2).astype(q.dtype), sin.expand_dims(2).astype(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # Local query head j*g+r uses local kv head j: the contiguous head blocks keep HF's grouping.
        q = q.reshape(b, t, hk, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hk, g * t, d)
        k = k.transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        scores = self.bmm_qk(q, k).astype(ms.float32) * self.scale
        scores = scores.reshape(b, hk, g, t, t) + bias.expand_dims(1)
        probs = ops.softmax(scores, axis=-1).astype(v.dtype).reshape(b, hk, g * t, t)
        out = self.bmm_pv(probs, v).reshape(b, hk, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, -1)
        return self.o_proj(out)


class TPMLP(nn.Cell):
    """SwiGLU with gate/up column-parallel and down row-parallel: ``I/tp`` columns per rank."""

    def __init__(self, config: DecoderConfig, tp: int, group: Optional[str], dtype: ms.Type):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.copy = CopyToTP(tp, group)
        kw = dict(group=group, dtype=dtype, copy_input=False)
        self.gate_proj = ColumnParallelLinear(h, i, bias, tp, **kw)
        self.up_proj = ColumnParallelLinear(h, i, bias, tp, **kw)
        self.down_proj = RowParallelLinear(i, h, bias, tp, group=group, dtype=dtype)

    def construct(self, x: Tensor) -> Tensor:
        x = self.copy(x)
        return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))


class TPDecoderLayer(nn.Cell):
    def __init__(self, config: DecoderConfig, tp: int, group: Optional[str], dtype: ms.Type):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = TPAttention(config, tp, group, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = TPMLP(config, tp, group, dtype)

    def construct(self, x, cos, sin, bias):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, bias)
        return x + self.mlp(self.post_attention_layernorm(x))


class TPDecoderModel(nn.Cell):
    """Vocab-parallel embedding + decoder layers + final norm (HF's ``model.*`` parameters)."""

    def __init__(self, config: DecoderConfig, tp: int, tp_rank: int, group: Optional[str], dtype: ms.Type):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, tp_rank,
                                                   group=group, dtype=dtype)
        self.layers = nn.CellList([TPDecoderLayer(config, tp, group, dtype) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class TPCausalLM(nn.Cell):
    """One tp rank of a Qwen2 / Llama causal LM (training forward; no KV cache).

    ``layout``: the parallel layout (``pp`` must be 1); ``tp_rank``: this rank's tp coordinate;
    ``group``: the tp communication group's name (``init_parallel_groups(layout).tp_group``),
    required when ``layout.tp > 1``; building the model does not touch the communication runtime.
    """

    def __init__(self, config: DecoderConfig, layout: ParallelLayout, tp_rank: int, dtype: str = "float32",
                 *, group: Optional[str] = None):
        super().__init__()
        if layout.pp != 1:
            raise MindRLHFError(f"parallel layout {layout}: TPCausalLM supports pp=1 only; set pp=1")
        layout.validate(config)
        tp = layout.tp
        if not 0 <= tp_rank < tp:
            raise MindRLHFError(f"tp_rank {tp_rank} is outside the layout {layout} (0..{tp - 1})")
        if tp > 1 and not group:
            raise MindRLHFError(f"TPCausalLM with tp={tp} needs group=<tp group name>; "
                                "get it from mindrlhf.parallel.tp_layers.init_parallel_groups(layout)")
        self.config, self.layout, self.tp, self.tp_rank = config, layout, tp, tp_rank
        self.compute_dtype = resolve_dtype(dtype)
        if self.compute_dtype == ms.bfloat16 and ms.get_context("device_target") == "CPU":
            raise MindRLHFError("dtype bfloat16: MindSpore has no CPU kernels for bf16 MatMul/Gather/Sigmoid; "
                                "use float32 (or float16) on CPU — bfloat16 is for Ascend")
        self.vocab_local = config.vocab_size // tp
        self.vocab_start = tp_rank * self.vocab_local
        self.model = TPDecoderModel(config, tp, tp_rank, group, self.compute_dtype)
        self.tie_word_embeddings = config.tie_word_embeddings
        if not config.tie_word_embeddings:
            self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, False, tp, group=group,
                                                dtype=self.compute_dtype, copy_input=False)
        self.head_copy = CopyToTP(tp, group)
        self.head_matmul = ops.MatMul(transpose_b=True)
        self.gather_vocab = GatherFromTP(tp, tp_rank, group)
        self.vocab_logprob = VocabParallelLogProb(config.vocab_size, tp, tp_rank, group=group)
        self.inv_freq = Tensor(rope_inv_freq(config))

    def rope(self, position_ids: Tensor):
        """cos/sin of shape (B, T, head_dim) for integer positions (B, T)."""
        freqs = position_ids.astype(ms.float32).expand_dims(-1) * self.inv_freq
        emb = ops.concat((freqs, freqs), axis=-1)
        return ops.cos(emb), ops.sin(emb)

    def local_logits(self, hidden: Tensor) -> Tensor:
        """This rank's vocabulary slice of the float32 logits: (B, T, H) → (B, T, V/tp)."""
        b, t, h = hidden.shape
        table = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        out = self.head_matmul(self.head_copy(hidden).reshape(-1, h), table)
        return out.astype(ms.float32).reshape(b, t, -1)

    def construct(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                  position_ids: Optional[Tensor] = None, logits_to_keep: int = 0) -> Tensor:
        """Local logits (B, T, V/tp) (the last ``logits_to_keep`` positions when > 0).

        Same arguments and masking as ``CausalLM.construct``; the vocabulary columns are
        ``[vocab_start, vocab_start + V/tp)``.
        """
        return self.forward_logits(input_ids, attention_mask, position_ids, logits_to_keep)

    def forward_logits(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                       position_ids: Optional[Tensor] = None, logits_to_keep: int = 0) -> Tensor:
        """``construct`` as a plain method (graph mode cannot call ``self(...)`` from a method)."""
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = ops.ones((b, t), ms.int32)
        mask = attention_mask.astype(ms.int32)
        if position_ids is None:
            position_ids = ops.relu(ops.cumsum(mask, 1) - 1)
        causal = ops.tril(ops.ones((t, t), ms.bool_))
        allowed = ops.logical_and(causal.expand_dims(0), mask.astype(ms.bool_).expand_dims(1))
        bias = ops.select(allowed, ops.zeros((b, t, t), ms.float32), ops.full((b, t, t), MASK_VALUE, dtype=ms.float32))
        bias = bias.expand_dims(1)
        cos, sin = self.rope(position_ids)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, bias)
        x = self.model.norm(x)
        if logits_to_keep > 0:
            x = x[:, t - logits_to_keep:]
        return self.local_logits(x)

    def gathered_logits(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                        position_ids: Optional[Tensor] = None, logits_to_keep: int = 0) -> Tensor:
        """Full-vocabulary logits (B, T, V) on every tp rank (costs a gather of V floats per token)."""
        return self.gather_vocab(self.forward_logits(input_ids, attention_mask, position_ids, logits_to_keep))

    def token_logprobs(self, local_logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
        """Vocab-parallel ``log softmax(logits / T)`` at ``token_ids``: (B, C, V/tp), (B, C) → (B, C)."""
        if temperature != 1.0:
            local_logits = local_logits / temperature
        return self.vocab_logprob(local_logits, token_ids)

    def sequence_logprobs(self, input_ids: Tensor, attention_mask: Tensor, completion_ids: Tensor,
                          temperature: float = 1.0) -> Tensor:
        """Per-token log-probs of the completion part of ``[prompt | completion]`` (as
        ``trainer.train_step.sequence_logprobs``): the same (B, C) values on every tp rank."""
        logits = self.forward_logits(input_ids, attention_mask, None, completion_ids.shape[1])
        return self.token_logprobs(logits, completion_ids, temperature)


def dp_grad_reducer(parameters, dp: int, group: Optional[str]):
    """A reducer that SUMS gradients over the dp group (losses use global token counts), or ``None``.

    Not the world group: with tp > 1 the ranks of a tp group hold different slices of equal
    shapes, and a world-group reduce would silently add them together.
    """
    if dp == 1:
        return None
    if not group:
        raise MindRLHFError(f"dp={dp} needs the dp communication group name "
                            "(mindrlhf.parallel.tp_layers.init_parallel_groups(layout).dp_group)")
    return nn.DistributedGradReducer(parameters, mean=False, degree=dp, group=group)

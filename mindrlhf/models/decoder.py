"""One readable decoder for the Qwen2 / Qwen2.5 / Llama family, in MindSpore.

RMSNorm, rotary embeddings (incl. Llama-3 rope scaling), grouped-query attention, SwiGLU MLP,
optional q/k/v bias (Qwen2), tied or untied embeddings. Parameter names and shapes are exactly the
Hugging Face ones, so weights move between the two with a dtype cast only.

Two entry points share every layer:
- ``construct(input_ids, attention_mask, position_ids, logits_to_keep)``: a full forward pass
  (training, reference log-probs);
- ``forward_with_cache(...)``: prefill/decode against a static-shape KV cache (generation).
All shapes are static so that a jit-compiled step compiles once per shape bucket.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from mindrlhf.models.config import DecoderConfig

# Additive mask value: large enough to zero a softmax weight, finite so a fully masked row
# (a left-padding query) stays a harmless uniform distribution instead of NaN.
MASK_VALUE = -1e9

DTYPES = {"float32": ms.float32, "bfloat16": ms.bfloat16, "float16": ms.float16}


def resolve_dtype(name: str) -> ms.Type:
    """Map "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16" to a MindSpore dtype."""
    alias = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(name, name)
    if alias not in DTYPES:
        from mindrlhf.errors import MindRLHFError

        raise MindRLHFError(f"unsupported dtype {name!r}; use one of float32, bfloat16, float16 (or fp32, bf16, fp16)")
    return DTYPES[alias]


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


class Linear(nn.Cell):
    """y = x Wᵀ + b with an HF-shaped (out, in) weight; one 2-D MatMul(transpose_b) call."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: ms.Type):
        super().__init__()
        self.out_features = out_features
        self.weight = Parameter(initializer(Normal(0.02), (out_features, in_features), dtype), name="weight")
        self.bias = Parameter(initializer("zeros", (out_features,), dtype), name="bias") if bias else None
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        y = self.matmul(x.reshape(-1, x.shape[-1]), self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(lead + (self.out_features,))


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


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return ops.concat((-x[..., half:], x[..., :half]), axis=-1)


class Attention(nn.Cell):
    """Grouped-query attention; query heads are grouped per KV head so K/V are never repeated."""

    def __init__(self, config: DecoderConfig, dtype: ms.Type):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.group = self.num_heads // self.num_kv_heads
        self.scale = 1.0 / math.sqrt(d)
        bias = config.attention_bias
        self.q_proj = Linear(h, self.num_heads * d, bias, dtype)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias, dtype)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias, dtype)
        # HF Llama's attention_bias also covers o_proj; Qwen2 has q/k/v bias only.
        self.o_proj = Linear(self.num_heads * d, h, bias and config.model_type == "llama", dtype)
        self.bmm_qk = ops.BatchMatMul(transpose_b=True)
        self.bmm_pv = ops.BatchMatMul()

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor,
                  k_cache: Optional[Tensor] = None, v_cache: Optional[Tensor] = None,
                  cache_index: Optional[Tensor] = None):
        b, t, _ = x.shape
        hk, g, d = self.num_kv_heads, self.group, self.head_dim
        q = self.q_proj(x).reshape(b, t, self.num_heads, d)
        k = self.k_proj(x).reshape(b, t, hk, d)
        v = self.v_proj(x).reshape(b, t, hk, d)
        cos, sin = cos.expand_dims(2).astype(q.dtype), sin.expand_dims(2).astype(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # (b, hk, g*t, d): query head j*g+r attends with kv head j, as HF's repeat_kv does.
        q = q.reshape(b, t, hk, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hk, g * t, d)
        k = k.transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        if k_cache is not None:
            k_cache[:, :, cache_index:cache_index + t] = k
            v_cache[:, :, cache_index:cache_index + t] = v
            k, v = k_cache, v_cache
        s = k.shape[2]
        scores = self.bmm_qk(q, k).astype(ms.float32) * self.scale
        scores = scores.reshape(b, hk, g, t, s) + bias.expand_dims(1)
        probs = ops.softmax(scores, axis=-1).astype(v.dtype).reshape(b, hk, g * t, s)
        out = self.bmm_pv(probs, v).reshape(b, hk, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, -1)
        return self.o_proj(out), k_cache, v_cache


class MLP(nn.Cell):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: DecoderConfig, dtype: ms.Type):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(h, i, bias, dtype)
        self.up_proj = Linear(h, i, bias, dtype)
        self.down_proj = Linear(i, h, bias, dtype)

    def construct(self, x: Tensor) -> Tensor:
        return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Cell):
    def __init__(self, config: DecoderConfig, dtype: ms.Type):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def construct(self, x, cos, sin, bias, k_cache=None, v_cache=None, cache_index=None):
        attn, k_cache, v_cache = self.self_attn(self.input_layernorm(x), cos, sin, bias, k_cache, v_cache, cache_index)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_cache, v_cache


class Embedding(nn.Cell):
    """Token embedding whose table is named ``weight`` (HF's name), shape (vocab, hidden)."""

    def __init__(self, vocab: int, hidden: int, dtype: ms.Type):
        super().__init__()
        self.weight = Parameter(initializer(Normal(0.02), (vocab, hidden), dtype), name="weight")

    def construct(self, ids: Tensor) -> Tensor:
        return ops.gather(self.weight, ids, 0)


class DecoderModel(nn.Cell):
    """Embedding + decoder layers + final norm (HF's ``model.*`` parameters)."""

    def __init__(self, config: DecoderConfig, dtype: ms.Type):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.CellList([DecoderLayer(config, dtype) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class CausalLM(nn.Cell):
    """Qwen2 / Llama causal language model returning float32 logits."""

    def __init__(self, config: DecoderConfig, dtype: str = "float32"):
        super().__init__()
        self.config = config
        self.compute_dtype = resolve_dtype(dtype)
        if self.compute_dtype == ms.bfloat16 and ms.get_context("device_target") == "CPU":
            from mindrlhf.errors import MindRLHFError

            raise MindRLHFError("dtype bfloat16: MindSpore has no CPU kernels for bf16 MatMul/Gather/Sigmoid; "
                                "use float32 (or float16) on CPU — bfloat16 is for Ascend")
        self.model = DecoderModel(config, self.compute_dtype)
        self.tie_word_embeddings = config.tie_word_embeddings
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, self.compute_dtype)
        self.inv_freq = Tensor(rope_inv_freq(config))
        self.head_matmul = ops.MatMul(transpose_b=True)
        self.num_layers = config.num_hidden_layers

    # -- shared pieces -------------------------------------------------------------------------
    def rope(self, position_ids: Tensor) -> Tuple[Tensor, Tensor]:
        """cos/sin of shape (B, T, head_dim) for integer positions (B, T)."""
        freqs = position_ids.astype(ms.float32).expand_dims(-1) * self.inv_freq
        emb = ops.concat((freqs, freqs), axis=-1)
        return ops.cos(emb), ops.sin(emb)

    def logits(self, hidden: Tensor) -> Tensor:
        """Project final hidden states (B, T, H) to float32 logits (B, T, V)."""
        b, t, h = hidden.shape
        table = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        out = self.head_matmul(hidden.reshape(-1, h), table)
        return out.astype(ms.float32).reshape(b, t, -1)

    # -- full forward --------------------------------------------------------------------------
    def construct(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                  position_ids: Optional[Tensor] = None, logits_to_keep: int = 0) -> Tensor:
        """Logits (B, T, V) for ``input_ids`` (B, T); with ``logits_to_keep=n`` only the last n.

        ``attention_mask`` (B, T) marks real tokens with 1 and padding with 0 (left, right or
        both). Default positions count real tokens only (``cumsum(mask) - 1``), which is what
        generation with left-padded prompts uses, so training log-probs match sampling ones.
        """
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = ops.ones((b, t), ms.int32)
        mask = attention_mask.astype(ms.int32)
        if position_ids is None:
            position_ids = ops.relu(ops.cumsum(mask, 1) - 1)
        causal = ops.tril(ops.ones((t, t), ms.bool_))
        allowed = ops.logical_and(causal.expand_dims(0), mask.astype(ms.bool_).expand_dims(1))
        bias = ops.select(allowed, ops.zeros((b, t, t), ms.float32), ops.full((b, t, t), MASK_VALUE, dtype=ms.float32))
        bias = bias.expand_dims(1)  # (B, 1, T, T), broadcast over query groups
        cos, sin = self.rope(position_ids)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x, _, _ = layer(x, cos, sin, bias)
        x = self.model.norm(x)
        if logits_to_keep > 0:
            x = x[:, t - logits_to_keep:]
        return self.logits(x)

    # -- cached forward (generation) -----------------------------------------------------------
    def forward_with_cache(self, input_ids: Tensor, position_ids: Tensor, attn_bias: Tensor,
                           caches: Tuple[Tensor, ...], cache_index: Tensor, logits_to_keep: int = 1):
        """Run ``input_ids`` (B, t) writing K/V at cache columns ``[cache_index, cache_index + t)``.

        ``caches`` holds 2 × num_layers tensors (B, kv_heads, S, head_dim) (k0, v0, k1, v1, …);
        ``attn_bias`` (B, t, S) is the additive float32 mask over cache columns (0 = may attend,
        MASK_VALUE = may not); ``cache_index`` is a 0-d int64 Tensor so one compiled graph serves
        every decode step. Returns (logits of the last ``logits_to_keep`` positions, new caches).
        """
        cos, sin = self.rope(position_ids)
        bias = attn_bias.expand_dims(1)
        x = self.model.embed_tokens(input_ids)
        new_caches = ()
        for i, layer in enumerate(self.model.layers):
            x, k, v = layer(x, cos, sin, bias, caches[2 * i], caches[2 * i + 1], cache_index)
            new_caches = new_caches + (k, v)
        x = self.model.norm(x[:, x.shape[1] - logits_to_keep:])
        return self.logits(x), new_caches

    def new_cache(self, batch_size: int, max_len: int) -> Tuple[Tensor, ...]:
        """Zeroed static KV cache: 2 × num_layers tensors of shape (B, kv_heads, max_len, head_dim)."""
        c = self.config
        shape = (batch_size, c.num_key_value_heads, max_len, c.head_dim)
        return tuple(ops.zeros(shape, self.compute_dtype) for _ in range(2 * c.num_hidden_layers))

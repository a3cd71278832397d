"""Recompute or keep activations: the ``recompute`` setting every stage's update shares.

Three ways to run the training backward (``parallel.PipelineRunner``):

- ``full``: the decoder layers run as the two shared layer graphs (``models.layer_graphs``); each layer's
  forward is recomputed in its backward, so only each layer's input is kept. Least memory.
- ``selective``: the same layer graphs, but each layer's forward also keeps its linear layers' outputs
  (``DecoderLayer.forward_kept``), so the backward recomputes only the norms, RoPE, attention's core and the
  activation, never a projection (``kept_bytes`` per micro-batch).
- ``none``: the whole forward + backward is one compiled graph (``layer_graphs.jit_any_shape``) that keeps
  every intermediate tensor: nothing is recomputed, at several times the memory (a compiled CPU graph holds
  all of its intermediates at once, not only those the backward needs).

``auto`` picks ``none`` when the largest micro-batch's estimated activations (``activation_bytes``) fit the
worker's memory budget (``memory_budget``) and ``full`` otherwise, and says so once in the log. With static-shape
layer graphs (CPU's default) it picks ``full`` whenever the decoder's forward over that micro-batch is at least
``STATIC_FULL_GFLOP``: there the static-shape kernels make the recomputing layer graphs about as fast as the
whole-model graph (SFT on SmolLM2 faster, GRPO's update within 10%) at a third of its memory, so keeping every
activation buys nothing. Below it (tiny models) a step is dispatch-bound, each new shape's compile costs more
than the static kernels win back, and the memory rule decides as before. ``auto`` never picks ``selective``: it
saves 2-13% of a step for 0.45-1.4 GiB more (a full fine-tune gains least, LoRA most: bench/README.md), a trade
only the user can make.

The estimate counts the tensors a compiled decoder layer forms per token and per attention score, forward
and backward (see ``activation_bytes``); the head's share and one overall factor are fitted to two measured
points (``bench/recompute.py``: SmolLM2-135M, and a 2-layer model whose activations are mostly logits).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Optional, Tuple

log = logging.getLogger(__name__)

#: Measured / counted, with ``HEAD_BYTES``, on two micro-batches of a 126-token prompt and 4 packed completions
#: (bench/README.md, recompute.py): SmolLM2-135M (completions of 160, 766 positions) kept 6.4 GiB more peak RSS
#: without recompute than with it, where the count gives 5.07; a random 2-layer Qwen2 of width 64 with Qwen's
#: 151,936-token vocabulary (completions of 128) kept 0.94, estimated 0.98. The rest is what the count leaves
#: out (allocator slack, the graph's own gradient buffers).
CALIBRATION = 1.26
#: Bytes per logit row and vocabulary entry: 2.5 float32 tensors (logits and their gradient, and part of the
#: log-softmax's; fitted, see ``CALIBRATION``).
HEAD_BYTES = 10
#: Of the budget, what a decision may plan to use: the rest is slack for everything the estimate ignores.
BUDGET_FRACTION = 0.8
#: Decoder forward GFLOP per micro-batch from which ``auto`` picks ``full`` with static layer graphs. Measured
#: (bench/README.md, "recompute auto with static layer graphs"): SmolLM2-135M's GRPO and SFT micro-batches
#: (~130-160 GFLOP) ran as fast or faster with ``full`` at 28-39% of the memory; the 4-layer width-256 peer model
#: (~5 GFLOP) ran its update 2.6 s a step with ``none`` and several times that with ``full`` (a compile per shape).
STATIC_FULL_GFLOP = 20.0


@dataclass(frozen=True)
class MicroBatchExtent:
    """The largest micro-batch one rank trains on, as the estimate needs it.

    ``tokens``: positions the decoder runs over; ``score_pairs``: (query, key) pairs whose attention scores
    are formed, per head; ``logit_rows``: positions whose full-vocabulary logits the head forms (0 for a
    score or value head)."""

    tokens: int
    score_pairs: int
    logit_rows: int

    @classmethod
    def padded(cls, rows: int, length: int, logit_rows: Optional[int] = None) -> "MicroBatchExtent":
        """``rows`` sequences of ``length`` tokens (every score of a row formed); logits at every position
        unless ``logit_rows`` says otherwise."""
        tokens = rows * length
        return cls(tokens, rows * length * length, tokens if logit_rows is None else logit_rows)

    @classmethod
    def shared_prompts(cls, completions: int, group: int, prompt: int, completion: int,
                       packed: bool) -> "MicroBatchExtent":
        """``completions`` rows of a ``prompt``-token prompt and ``completion`` tokens, ``group`` of them per
        prompt; with ``packed`` (``models.packing``) each prompt's completions form one row in which a
        completion attends to its prompt and itself only."""
        if not packed:
            return cls.padded(completions, prompt + completion, completions * completion)
        slots = max(1, min(completions, group))
        rows = math.ceil(completions / slots)
        return cls(rows * (prompt + slots * completion),
                   rows * (prompt * prompt + slots * completion * (prompt + completion)),
                   completions * completion)


def rollout_extent(cfg) -> MicroBatchExtent:
    """The largest training micro-batch of a GRPO or PPO config: ``micro_batch_size`` completions of the
    longest prompt and completion, packed per prompt with ``share_prompts``."""
    g = cfg.generation
    return MicroBatchExtent.shared_prompts(cfg.micro_batch_completions, cfg.algorithm.num_generations,
                                           g.max_prompt_length, g.max_completion_length,
                                           packed=cfg.parallel.share_prompts)


def _shard_widths(config, tp: int) -> Tuple[int, int, int, int, int]:
    """A ``tp``-way shard's widths: hidden, head dim, q (heads x head dim), k or v, MLP intermediate."""
    d = config.head_dim
    return (config.hidden_size, d, config.num_attention_heads * d // tp, config.num_key_value_heads * d // tp,
            config.intermediate_size // tp)


def activation_bytes(config, extent: MicroBatchExtent, *, layers: int, tp: int = 1, dtype_bytes: int = 4) -> int:
    """Estimated bytes a whole-model compiled training graph holds beyond the layer graphs for one
    micro-batch of ``extent`` on a rank owning ``layers`` decoder layers of a ``tp``-way shard.

    Per layer and token, forward then backward (twice the forward's count): the two RMSNorms (float32,
    5 tensors of H each), q (projection, RoPE's 4, 2 layout copies), k and v (8 of KV·d together), the
    attention output (2 of q), o_proj and the residual (2 of H), the MLP (4 of I) and its residual (2 of H).
    Per head and score pair: scores, masked scores and softmax, and their 3 gradients, in float32. Per
    logit row: ``HEAD_BYTES`` per vocabulary entry (the compiled graph forms every row's logits at once
    where the chunked head never holds more than one chunk)."""
    h, _, q, kv, inter = _shard_widths(config, tp)
    per_token = 2 * (10 * h * 4 // dtype_bytes + 9 * q + 8 * kv + 4 * inter + 4 * h) * dtype_bytes
    per_pair = 6 * 4 * (config.num_attention_heads // tp)
    per_layer = extent.tokens * per_token + extent.score_pairs * per_pair
    head = extent.logit_rows * HEAD_BYTES * (config.vocab_size // tp)
    return int(CALIBRATION * (layers * per_layer + head))


def kept_bytes(config, extent: MicroBatchExtent, *, layers: int, tp: int = 1, dtype_bytes: int = 4) -> int:
    """Bytes ``recompute selective`` keeps for one micro-batch of ``extent`` on a rank owning ``layers`` decoder
    layers of a ``tp``-way shard: per layer and token the outputs of ``DecoderLayer.forward_kept`` (q, k, v, the
    attention block's output, the MLP's gate and up)."""
    h, _, q, kv, inter = _shard_widths(config, tp)
    return layers * extent.tokens * (q + 2 * kv + h + 2 * inter) * dtype_bytes


def decoder_gflop(config, extent: MicroBatchExtent, *, layers: int, tp: int = 1) -> float:
    """GFLOP of the decoder layers' forward over ``extent`` on a rank owning ``layers`` layers of a ``tp``-way
    shard: the projections (2 per weight and position) and attention's two products (2 x 2 x head dims per
    score pair and head)."""
    h, d, q, kv, inter = _shard_widths(config, tp)
    weights = h * (2 * q + 2 * kv) + 3 * h * inter
    per_layer = 2 * weights * extent.tokens + 4 * d * (config.num_attention_heads // tp) * extent.score_pairs
    return layers * per_layer / 1e9


def decode_bytes(config, rows: int, positions: int, dtype_bytes: int) -> int:
    """A lower bound on what sampling ``rows`` sequences of ``positions`` tokens at once holds: their KV cache (every
    layer's keys and values in the compute dtype) and one step's float32 logits."""
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_bytes
    return rows * (positions * kv + config.vocab_size * 4)


def _mem_available() -> Optional[int]:
    """MemAvailable of /proc/meminfo in bytes (Linux), else None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def memory_budget(device_target: str, workers: int, budget_gb: float = 0.0) -> Tuple[int, str]:
    """Bytes this worker's training may add for activations, and where the figure came from.

    ``budget_gb`` > 0 is taken as given. Otherwise on Ascend / GPU the device's free memory now; on CPU
    the host's available memory now shared by ``workers`` processes (all workers assumed on one host,
    the cautious case); either times ``BUDGET_FRACTION``."""
    if budget_gb > 0:
        return int(budget_gb * 2 ** 30), "memory_budget_gb"
    if device_target in ("Ascend", "GPU"):
        import mindspore as ms

        props = ms.hal.get_device_properties(int(os.environ.get("DEVICE_ID", "0")), device_target)
        free = getattr(props, "free_memory", None) or getattr(props, "total_memory", 0)
        return int(BUDGET_FRACTION * free), f"{BUDGET_FRACTION:.0%} of the {device_target} device's free memory"
    available = _mem_available()
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    share = f" / {workers} workers" if workers > 1 else ""
    return int(BUDGET_FRACTION * available / max(1, workers)), f"{BUDGET_FRACTION:.0%} of available host memory{share}"


def resolve_recompute(setting: str, config, extent: MicroBatchExtent, *, layers: int, tp: int, dtype_bytes: int,
                      device_target: str, workers: int, budget_gb: float = 0.0, reserved: int = 0,
                      what: str = "policy", static_layers: bool = False) -> Tuple[str, int]:
    """``(mode, bytes)``: ``full``, ``selective`` or ``none`` for ``setting`` and the activation bytes that plans to
    keep (0 with ``full``). ``auto`` picks ``full`` when ``static_layers`` (static-shape layer graphs) and the
    decoder's work reaches ``STATIC_FULL_GFLOP``; otherwise it decides between ``none`` and ``full`` by the estimate
    against the budget less ``reserved`` (what models trained earlier in this process plan to keep: a compiled graph
    holds its buffers for the process's life). It logs the decision once with its figures. ``setting`` is one of
    ``configs.common.RECOMPUTE_MODES`` (the config checks it)."""
    if setting == "full":
        return "full", 0
    kw = dict(layers=layers, tp=tp, dtype_bytes=dtype_bytes)
    if setting == "selective":
        return "selective", kept_bytes(config, extent, **kw)
    need = activation_bytes(config, extent, **kw)
    if setting == "none":
        return "none", need
    work = decoder_gflop(config, extent, layers=layers, tp=tp)
    if static_layers and work >= STATIC_FULL_GFLOP:
        log.info("recompute auto -> full for the %s: its largest micro-batch (%d positions, %.0f GFLOP through "
                 "the decoder) runs as fast through the static-shape layer graphs recomputing each layer as "
                 "through one graph keeping ~%.2f GiB of activations (recompute none keeps them anyway)",
                 what, extent.tokens, work, need / 2 ** 30)
        return "full", 0
    budget, source = memory_budget(device_target, workers, budget_gb)
    if reserved:
        source += f", less {reserved / 2 ** 30:.2f} GiB planned for another model"
    mode = "none" if need <= budget - reserved else "full"
    # Worded as the decision it is: the figure is what the whole graph WOULD keep, not what the run will use.
    log.info("recompute auto -> %s for the %s: without recompute its largest micro-batch (%d positions) would "
             "hold ~%.2f GiB of activations; budget %.2f GiB (%s)%s", mode, what, extent.tokens, need / 2 ** 30,
             (budget - reserved) / 2 ** 30, source,
             "" if mode == "none" else "; so each layer is recomputed in the backward instead (memory_budget_gb "
             "or recompute none keeps the activations anyway)")
    return mode, need if mode == "none" else 0

"""LoRA's adapter dropout as a counter-based hash mask computed inside the graph.

Why a hash and not MindSpore's random ops: the compiled layer graphs recompute each layer's forward in its
backward (``models.layer_graphs``), and a stateful random op (``nn.Dropout``, ``ops.dropout``) draws another mask
there, so the gradient would belong to a different forward; MindSpore 2.10's seed/offset random ops
(``DropoutExt``, ``UniformExt``, ``rand_like_ext``) have no CPU kernel. A hash of (seed, element index) is a pure
function of the graph's inputs: the recomputed forward draws the same mask, and so do pynative, the whole-model
``jit`` and the layer graphs.

The mask of the element at (row, global column) of a (rows, in_features) input: a row hash ``fmix32(row * G ^ seed)``
and a column hash ``fmix32(column * G ^ seed ^ K)`` (murmur3's finaliser, ``G`` = 0x9E3779B1, ``K`` = 0x5BD1E995, in
wrapping int32 arithmetic; a logical shift is an arithmetic shift with the sign's copies masked off), each over one
row or column only, then per element ``h = (row hash ^ column hash) * 0x85EBCA6B``; the element is kept when
``h``'s top 24 bits (as a signed number, + 2**23) are at least ``p * 2**24``, and a kept element is scaled by
``1 / (1 - p)`` (inverted dropout, as torch's and PEFT's). Per element that is four integer passes (xor, multiply,
shift, compare) and the scaling: the full murmur3 per element cost ~5x a 576 x 576 projection on CPU (measured).
The index uses the column in the whole (unsharded) input, so a row-parallel layer's slice of the input draws the
slice of one process's mask. ``seed`` < 0 is dropout off: the threshold is 0 and the scale 1, so every multiplier
is exactly 1.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, ops

#: murmur3 fmix32's constants, the golden-ratio multiplier and the column hash's salt, as int32 (their uint32 bits).
FMIX_1 = 0x85EBCA6B - (1 << 32)
FMIX_2 = 0xC2B2AE35 - (1 << 32)
GOLDEN = 0x9E3779B1 - (1 << 32)
COLUMN_SALT = 0x5BD1E995
#: The hash's bits compared with ``p * 2**24``.
BITS = 24


def threshold(p: float) -> int:
    """The top-24-bit value below which an element is dropped (keep probability ``1 - threshold / 2**24``)."""
    return int(round(p * (1 << BITS)))


def _shift_right(h: Tensor, k: int) -> Tensor:
    """Logical right shift of int32 ``h`` (MindSpore's is arithmetic: mask the sign's copies off)."""
    return ops.bitwise_and(ops.bitwise_right_shift(h, k), (1 << (32 - k)) - 1)


def _fmix32(h: Tensor) -> Tensor:
    h = ops.bitwise_xor(h, _shift_right(h, 16)) * FMIX_1
    h = ops.bitwise_xor(h, _shift_right(h, 13)) * FMIX_2
    return ops.bitwise_xor(h, _shift_right(h, 16))


def dropout_multiplier(x: Tensor, seed: Tensor, p: float, col_offset: int) -> Tensor:
    """The multiplier (0 or ``1 / (1 - p)``; all 1 when ``seed`` < 0) of 2-D ``x`` (rows, in_local), whose columns
    are ``[col_offset, col_offset + in_local)`` of the whole input (the hash needs no width); ``seed``: an int32
    scalar."""
    # Cumulative sums rather than ``arange``: they follow a dynamic-shape graph's row count.
    rows = ops.cumsum(ops.ones_like(x[:, :1], dtype=ms.int32), 0) - 1
    cols = ops.cumsum(ops.ones_like(x[:1], dtype=ms.int32), 1) - 1 + col_offset
    row_hash = _fmix32(ops.bitwise_xor(rows * GOLDEN, seed))
    col_hash = _fmix32(ops.bitwise_xor(ops.bitwise_xor(cols * GOLDEN, seed), COLUMN_SALT))
    h = ops.bitwise_xor(row_hash, col_hash) * FMIX_1
    on = (seed >= 0).astype(ms.int32)
    # Off: threshold 0 (every element kept) and scale 1, both scalars, so the multiplier is exactly 1.
    keep = ops.bitwise_right_shift(h, 32 - BITS) >= on * threshold(p) - (1 << (BITS - 1))
    scale = on.astype(x.dtype) * (1.0 / (1.0 - p)) + (1 - on).astype(x.dtype)
    return keep.astype(x.dtype) * scale

"""Shared-prompt packing: a GRPO group's prompt encoded once for all of its completions.

A training row is ``[prompt (P) | completion (C)][:-1]``, and a group's G rows repeat the same
prompt, so most of a forward/backward pass recomputes that prompt G times (the idea of Prefix
Grouper, arXiv 2506.05433). Packed, the group is ONE row::

    [prompt (P) | c_1[:-1] (C-1) | c_2[:-1] (C-1) | ... | c_k[:-1] (C-1)]

under which prompt tokens see the (real) prompt causally and completion ``j``'s tokens see the
real prompt tokens plus completion ``j``'s own tokens up to themselves — exactly what each of them
sees in its own padded row. The mask comes in two blocks (``Attention._shared_prompt``): the prompt
over itself (P × P) and each slot over the prompt and itself (C-1 × P+C-1), so the score blocks in
which one completion would see another (masked anyway) are never computed. Positions count real tokens as in the
padded row (the prompt's real tokens from 0, completion ``j``'s tokens from the prompt's length),
so even the (unused) logits at padding positions are the padded row's.
The logits that predict completion ``j``'s tokens sit at the prompt's last column (its first
token: shared by the whole group) and at its own slot's columns; ``gather_index`` picks them in
the original row order, so the log-probs come out as ``(rows, C)`` as before and the loss, the
gradients and every metric are unchanged (up to float summation order).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Tuple

import numpy as np

from mindrlhf.models.decoder import MASK_VALUE, host_positions


@dataclass
class PackedBatch:
    """Inputs of ``CausalLM.packed_logprobs`` for one micro-batch."""

    input_ids: np.ndarray        # (groups, T) int32, T = P + slots * S
    position_ids: np.ndarray     # (groups, T) int32
    prompt_bias: np.ndarray      # (groups, 1, P, P) float32, additive: the prompt over itself
    completion_bias: np.ndarray  # (groups * slots, 1, S, P + S) float32: a slot over the prompt and itself
    slot_keys: np.ndarray        # (slots * (P + S),) int32: each slot's key columns, the prompt's then its own
    gather_index: np.ndarray     # (rows, C) int32: flat index into (groups * T) of each logit used

    def arrays(self) -> Tuple[np.ndarray, ...]:
        """The fields in ``CausalLM.packed_logprobs``'s argument order (their declaration order)."""
        return tuple(getattr(self, f.name) for f in fields(self))  # no copies (astuple deep-copies)


def group_rows(input_ids: np.ndarray, attention_mask: np.ndarray, prompt_width: int) -> np.ndarray:
    """Group id of each row: consecutive rows with the same prompt (ids and mask) share one."""
    prompt = np.concatenate([input_ids[:, :prompt_width], attention_mask[:, :prompt_width]], axis=1)
    new = np.ones(len(prompt), bool)
    new[1:] = (prompt[1:] != prompt[:-1]).any(axis=1)
    return np.cumsum(new) - 1


def pack_shared_prompts(input_ids: np.ndarray, attention_mask: np.ndarray,
                        completion_width: int) -> Optional[PackedBatch]:
    """Pack rows ``[prompt | completion][:-1]`` (prompts left-padded to a common width, completions
    ``completion_width`` wide) so each run of rows with the same prompt becomes one row.

    Returns None when no two rows share a prompt (packing would save nothing).
    """
    rows, width = input_ids.shape
    c = completion_width
    p = width - (c - 1)  # prompt columns
    if p < 1 or c < 1:
        raise ValueError(f"rows of width {width} cannot hold a prompt and {c} completion tokens")
    group = group_rows(input_ids, attention_mask, p)
    n_groups = int(group[-1]) + 1
    if n_groups == rows:
        return None
    member = np.zeros(rows, np.int64)  # index of the row within its group
    for r in range(1, rows):
        member[r] = member[r - 1] + 1 if group[r] == group[r - 1] else 0
    slots = int(member.max()) + 1
    seg = c - 1  # each completion contributes its tokens but the last as inputs
    t = p + slots * seg
    ids = np.zeros((n_groups, t), np.int32)
    mask = np.zeros((n_groups, t), bool)
    pos = np.zeros((n_groups, t), np.int32)
    gather = np.zeros((rows, c), np.int32)
    for r in range(rows):
        g, j = int(group[r]), int(member[r])
        prompt_mask = attention_mask[r, :p].astype(bool)
        if j == 0:
            ids[g, :p] = input_ids[r, :p]
            mask[g, :p] = prompt_mask
            pos[g, :p] = host_positions(prompt_mask)
        cols = slice(p + j * seg, p + (j + 1) * seg)
        ids[g, cols] = input_ids[r, p:]
        mask[g, cols] = attention_mask[r, p:].astype(bool)
        # As the padded row counts them: real tokens so far minus one (padding repeats the last).
        pos[g, cols] = host_positions(mask[g, cols], start=int(prompt_mask.sum()))
        gather[r, 0] = g * t + p - 1
        gather[r, 1:] = g * t + p + j * seg + np.arange(seg)
    prompt_real = mask[:, :p]  # (groups, P): real prompt tokens
    prompt_allowed = np.tril(np.ones((p, p), bool))[None] & prompt_real[:, None, :]
    slot_mask = mask[:, p:].reshape(n_groups, slots, seg)
    # Keys of a slot's queries: the prompt's columns, then the slot's own (causally).
    slot_allowed = np.concatenate([
        np.broadcast_to(prompt_real[:, None, None, :], (n_groups, slots, seg, p)),
        np.tril(np.ones((seg, seg), bool))[None, None] & slot_mask[:, :, None, :]], axis=3)
    slot_keys = np.concatenate([np.r_[np.arange(p), p + j * seg + np.arange(seg)] for j in range(slots)])
    return PackedBatch(ids, pos, _bias(prompt_allowed), _bias(slot_allowed.reshape(n_groups * slots, seg, p + seg)),
                       slot_keys.astype(np.int32), gather)


def _bias(allowed: np.ndarray) -> np.ndarray:
    """Additive float32 mask (N, 1, Tq, Tk) from a boolean (N, Tq, Tk)."""
    return np.where(allowed, 0.0, MASK_VALUE).astype(np.float32)[:, None]

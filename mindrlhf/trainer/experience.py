"""Rollouts turned into fixed-shape training arrays, and their dump/replay files.

One row per completion. ``prompt_ids`` are LEFT-padded to a common length P and completions
RIGHT-padded to C, so ``[prompt | completion]`` has every completion starting at column P,
which is what lets the training forward keep only the last C logits.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from mindrlhf.errors import MindRLHFError


@dataclass
class Experience:
    """Arrays for one step on one rank (N completions)."""

    prompt_ids: np.ndarray        # (N, P) int32, left-padded
    prompt_mask: np.ndarray       # (N, P) int32
    completion_ids: np.ndarray    # (N, C) int32, right-padded
    completion_mask: np.ndarray   # (N, C) float32: 1 for tokens that count in the loss
    sampler_logp: np.ndarray      # (N, C) float32: log-probs returned by the sampler
    truncated: np.ndarray         # (N,) bool: hit max_completion_length without a stop token
    rewards: np.ndarray           # (N,) float32, NaN where every reward function declined
    reward_per_fn: np.ndarray     # (N, F) float32
    advantages: np.ndarray        # (N,) float32 per completion (GRPO); (N, C) per token for PPO (ppo.PPOTargets)
    prompt_index: np.ndarray      # (N,) int64: global dataset row of the prompt
    old_logp: Optional[np.ndarray] = None   # (N, C), only for off-policy updates
    ref_logp: Optional[np.ndarray] = None   # (N, C), only when beta > 0
    extras: Dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.prompt_ids.shape[0])

    def train_inputs(self) -> Dict[str, np.ndarray]:
        """input_ids/attention_mask of ``[prompt | completion]`` minus the last token."""
        ids = np.concatenate([self.prompt_ids, self.completion_ids], axis=1)[:, :-1]
        mask = np.concatenate([self.prompt_mask, (self.completion_ids_mask())], axis=1)[:, :-1]
        return {"input_ids": ids.astype(np.int32), "attention_mask": mask.astype(np.int32)}

    def completion_ids_mask(self) -> np.ndarray:
        """1 for every generated token (also those excluded from the loss), 0 for padding."""
        return self.extras["completion_present"].astype(np.int32)

    def map(self, fn) -> "Experience":
        """A new Experience with ``fn`` applied to every array (None fields stay None)."""
        kw = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "extras":
                kw[f.name] = {k: fn(v) for k, v in value.items()}
            else:
                kw[f.name] = None if value is None else fn(value)
        return Experience(**kw)

    def rows(self, index: np.ndarray) -> "Experience":
        """A new Experience with the selected rows."""
        return self.map(lambda a: a[index])


def concat_experiences(parts: Sequence[Experience], pad_id: int) -> Experience:
    """Rows of ``parts`` one after another; prompts left-padded and completions right-padded to the
    widest part (padding: ``pad_id`` ids, 0 masks and values). old/ref log-probs must not be set yet."""
    P = max(e.prompt_ids.shape[1] for e in parts)
    C = max(e.completion_ids.shape[1] for e in parts)

    def widen(e: Experience) -> Experience:
        def pad(a: np.ndarray, left: int, right: int, value=0) -> np.ndarray:
            return np.pad(a, ((0, 0), (left, right)), constant_values=value)

        c = C - e.completion_ids.shape[1]
        out = e.map(lambda a: a)
        out.prompt_ids = pad(e.prompt_ids, P - e.prompt_ids.shape[1], 0, pad_id)
        out.prompt_mask = pad(e.prompt_mask, P - e.prompt_mask.shape[1], 0)
        out.completion_ids = pad(e.completion_ids, 0, c, pad_id)
        out.completion_mask = pad(e.completion_mask, 0, c)
        out.sampler_logp = pad(e.sampler_logp, 0, c)
        out.extras = {k: pad(v, 0, c) for k, v in e.extras.items()}  # per-token (N, C) arrays
        return out

    if any(e.old_logp is not None or e.ref_logp is not None for e in parts):
        raise MindRLHFError("concat_experiences: join rollouts before old/ref log-probs are computed")
    widened = [widen(e) for e in parts]
    kw = {f.name: np.concatenate([getattr(e, f.name) for e in widened]) for f in fields(Experience)
          if f.name not in ("extras", "old_logp", "ref_logp")}
    return Experience(**kw, extras={k: np.concatenate([e.extras[k] for e in widened]) for k in widened[0].extras})


def left_pad(seqs: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple:
    """(ids, mask) of shape (len(seqs), length) with each sequence flush right."""
    ids = np.full((len(seqs), length), pad_id, np.int32)
    mask = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, length - len(s):] = s
            mask[i, length - len(s):] = 1
    return ids, mask


def right_pad(seqs: Sequence[Sequence[float]], length: int, pad, dtype) -> np.ndarray:
    out = np.full((len(seqs), length), pad, dtype)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s[:length]
    return out


def bucket(n: int, multiple: int, cap: Optional[int] = None) -> int:
    """Round ``n`` up to a multiple (fewer distinct shapes → fewer compilations), capped."""
    v = max(multiple, -(-n // multiple) * multiple)
    return min(v, cap) if cap else v


# -- dump / replay (--save_data_file / --replay_data_file) -----------------------------------
_ARRAYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampler_logp", "truncated",
           "rewards", "reward_per_fn", "advantages", "prompt_index")


def step_file(base: str, step: int) -> Path:
    """The dump file of one step: ``<base without .npz>.step<N>.npz``."""
    p = Path(base)
    stem = p.name[:-4] if p.name.endswith(".npz") else p.name
    return p.with_name(f"{stem}.step{step}.npz")


def save_experience(exp: Experience, path: Path, completions_text: Optional[List[str]] = None) -> None:
    """Write the arrays of a step (all ranks gathered) to an .npz (no pickled objects)."""
    arrays = {k: getattr(exp, k) for k in _ARRAYS}
    arrays["completion_present"] = exp.extras["completion_present"]
    if "tool_mask" in exp.extras:  # a tool-using rollout: its policy tokens, which the length metrics count
        arrays["tool_mask"] = exp.extras["tool_mask"]
    if completions_text is not None:
        arrays["completions_text"] = np.array(completions_text, dtype=np.str_)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


def load_experience(path: Path) -> Experience:
    """Read a dump written by ``save_experience``."""
    if not path.is_file():
        raise MindRLHFError(f"replay file {path} not found; point --replay_data_file at the --save_data_file "
                            f"base path of a previous run (files <base>.step<N>.npz)")
    with np.load(path, allow_pickle=False) as data:
        kw = {k: data[k] for k in _ARRAYS}
        extras = {"completion_present": data["completion_present"]}
        if "tool_mask" in data.files:
            extras["tool_mask"] = data["tool_mask"]
    return Experience(**kw, extras=extras)

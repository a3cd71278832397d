"""Training heads: what the last pipeline stage computes from the decoder's final hidden states.

``parallel.pipeline.PipelineRunner`` runs the decoder layers (a whole model, a tp shard or one
pipeline stage) and hands the last stage's hidden states (B, T, H), before the final norm, to a head:

* ``LogProbHead`` (per token): log-probs (B, C) of the completion tokens ``completion_ids`` under
  ``softmax(logits / temperature)``, vocab-parallel under tp (GRPO's policy, SFT, DPO); with
  ``stats=True`` also each token's entropy and argmax hit (SFT's metrics), as a tuple;
* ``ScoreHead`` (per sequence): a sequence-classification model's ``score`` head (B, num_labels) at
  each row's last real token (a reward model; with a shared-prompt packed form for pairs);
* ``ValueHead`` (per token): a one-label model's ``score`` head at each completion position (PPO's critic;
  with a shared-prompt packed form, as ``LogProbHead``'s).

A head names the micro-batch arrays it reads (``keys``, passed after the attention mask) and builds its
forward as a closure over the model: graph mode (``mindspore.jit``) cannot read the attributes of a
plain Python object a closure captures, so nothing of ``self`` is used inside the returned function.
Whatever runs the head (one process, tp, pp, micro-batches) gives the same values: the runner's tests
check each head under msrun against one process.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol, Tuple

import numpy as np

from mindrlhf.errors import MindRLHFError


class Head(Protocol):
    """What ``PipelineRunner`` needs of a head (see the module docstring)."""

    #: Micro-batch arrays the head reads after ``attention_mask``, in order.
    keys: Tuple[str, ...]

    def build(self, model) -> Callable:
        """``f(hidden (B, T, H), attention_mask (B, T), *keys) -> Tensor`` on the model's last stage."""

    def build_packed(self, model) -> Optional[Callable]:
        """``f(*PackedBatch.arrays(), *keys) -> Tensor`` over shared-prompt packed rows, or ``None``
        when the head has no packed form (the runner then trains on padded rows)."""

    def output_shapes(self, micro_batch: Dict[str, np.ndarray]) -> List[Tuple[int, ...]]:
        """Shapes of the head's float32 outputs for ``micro_batch`` (one: a tensor; several: a tuple)."""


class LogProbHead:
    """Per-token log-probs (B, C) of ``completion_ids``: the last C positions of the (full sequence minus
    its last token) input predict the C completion tokens. ``stats``: return ``(logp, entropy, correct)``,
    the entropy of each position's next-token distribution and 1.0 where the token is its argmax."""

    keys = ("completion_ids",)

    def __init__(self, temperature: float = 1.0, *, stats: bool = False):
        if not temperature > 0:
            raise MindRLHFError(f"log-prob head temperature {temperature!r} must be > 0")
        self.temperature = float(temperature)
        self.stats = bool(stats)

    def build(self, model) -> Callable:
        temperature = self.temperature
        if self.stats:
            def logprobs_and_stats(hidden, attention_mask, completion_ids):
                return model.completion_logprobs_and_stats(hidden, completion_ids, temperature)
            return logprobs_and_stats

        def logprobs(hidden, attention_mask, completion_ids):
            return model.completion_logprobs(hidden, completion_ids, temperature)
        return logprobs

    def build_packed(self, model) -> Optional[Callable]:
        if self.stats:
            return None
        temperature = self.temperature

        def packed(input_ids, position_ids, prompt_bias, completion_bias, slot_keys, gather_index, completion_ids):
            return model.packed_logprobs(input_ids, position_ids, prompt_bias, completion_bias, slot_keys,
                                         gather_index, completion_ids, temperature)
        return packed

    def output_shapes(self, micro_batch: Dict[str, np.ndarray]) -> List[Tuple[int, ...]]:
        return [tuple(micro_batch["completion_ids"].shape)] * (3 if self.stats else 1)


class ScoreHead:
    """Per-sequence scores (B, num_labels) of a model built with a ``score`` head (``num_labels > 0``), at each
    row's last real token. ``packed``: the micro-batches are in the log-prob head's prompt / completion layout
    with ``score_index`` (B,), the number of completion tokens before the row ends (``rm.pair_micro_batches``),
    so rows sharing a prompt can be packed (``models.packing``) and scored where each row ends."""

    def __init__(self, num_labels: int = 1, *, packed: bool = False):
        self.num_labels = int(num_labels)
        self.packed = bool(packed)
        #: ``score_index`` is read by the packed form only; the padded form finds the last real token in the mask.
        self.keys: Tuple[str, ...] = ("score_index",) if packed else ()

    def build(self, model) -> Callable:
        if model.config.num_labels != self.num_labels:
            what = "a causal LM" if not model.config.num_labels else f"{model.config.num_labels} labels"
            raise MindRLHFError(f"a score head of {self.num_labels} label(s) needs a sequence-classification model "
                                f"with as many; this {model.config.model_type} model has {what}")

        if self.packed:
            def scores_of_rows(hidden, attention_mask, score_index):
                return model.sequence_scores(hidden, attention_mask)
            return scores_of_rows

        def scores(hidden, attention_mask):
            return model.sequence_scores(hidden, attention_mask)
        return scores

    def build_packed(self, model) -> Optional[Callable]:
        if not self.packed:
            return None

        def packed(input_ids, position_ids, prompt_bias, completion_bias, slot_keys, gather_index, score_index):
            return model.packed_scores(input_ids, position_ids, prompt_bias, completion_bias, slot_keys, gather_index,
                                       score_index)
        return packed

    def output_shapes(self, micro_batch: Dict[str, np.ndarray]) -> List[Tuple[int, ...]]:
        return [(micro_batch["input_ids"].shape[0], self.num_labels)]


class ValueHead:
    """Per-token values (B, C) of a one-label sequence-classification model (PPO's critic): its ``score`` head
    at the positions that predict the C completion tokens ``completion_ids`` (only their width is read)."""

    keys = ("completion_ids",)

    def build(self, model) -> Callable:
        if model.config.num_labels != 1:
            what = "a causal LM" if not model.config.num_labels else f"{model.config.num_labels} labels"
            raise MindRLHFError(f"a value head needs a one-label sequence-classification model (a critic); this "
                                f"{model.config.model_type} model has {what}")

        def values(hidden, attention_mask, completion_ids):
            return model.completion_values(hidden, completion_ids.shape[1])
        return values

    def build_packed(self, model) -> Optional[Callable]:
        def packed(input_ids, position_ids, prompt_bias, completion_bias, slot_keys, gather_index, completion_ids):
            return model.packed_values(input_ids, position_ids, prompt_bias, completion_bias, slot_keys, gather_index)
        return packed

    def output_shapes(self, micro_batch: Dict[str, np.ndarray]) -> List[Tuple[int, ...]]:
        return [tuple(micro_batch["completion_ids"].shape)]


def head_for(config) -> "Head":
    """The natural training head of a model config: scores for a sequence-classification model, completion
    log-probs (temperature 1) for a causal LM."""
    return ScoreHead(config.num_labels) if config.num_labels else LogProbHead()

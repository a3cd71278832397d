"""The policy update: loss and gradients over micro-batches, reduction, clipping, AdamW step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from mindrlhf.algorithms import policy_loss
from mindrlhf.parallel import comm
from mindrlhf.trainer.optimizer import AdamW

LOSS_METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def token_logprobs(logits: Tensor, token_ids: Tensor, temperature: float) -> Tensor:
    """log softmax(logits / T) at ``token_ids``: (B, C, V), (B, C) → (B, C) float32."""
    if temperature != 1.0:
        logits = logits / temperature
    logp = ops.log_softmax(logits, axis=-1)
    return ops.gather_elements(logp, 2, token_ids.astype(ms.int32).expand_dims(-1)).squeeze(-1)


def sequence_logprobs(model: nn.Cell, input_ids: Tensor, attention_mask: Tensor, completion_ids: Tensor,
                      temperature: float) -> Tensor:
    """Per-token log-probs of the completion part of ``[prompt | completion]`` under ``model``.

    ``input_ids``/``attention_mask`` are the full sequence minus its last token, so the last
    ``C`` logits predict exactly the ``C`` completion tokens.
    """
    logits = model(input_ids, attention_mask, None, completion_ids.shape[1])
    return token_logprobs(logits, completion_ids, temperature)


@dataclass
class LossSettings:
    """The algorithm fields the loss needs (a slice of the GRPO config)."""

    loss_type: str
    loss_agg_mode: str
    epsilon_low: float
    epsilon_high: float
    beta: float
    kl_estimator: str
    max_completion_length: int
    temperature: float
    off_policy: bool


class PolicyUpdater:
    """Accumulates gradients over micro-batches and applies one AdamW step per mini-batch.

    Losses are normalised by GLOBAL token/sequence counts of the mini-batch, and gradients are
    summed (not averaged) over data-parallel ranks, so the update is the same whatever the number
    of ranks or micro-batches.
    """

    def __init__(self, model: nn.Cell, loss: LossSettings, *, lr: float, weight_decay: float,
                 betas: Sequence[float], eps: float, max_grad_norm: float, jit: bool = True):
        self.model = model
        self.loss = loss
        self.max_grad_norm = max_grad_norm
        self.params = model.trainable_params()
        # Decay matrices only: biases and norm scales (1-D) are not weight-decayed.
        self.optimizer = AdamW(self.params, betas=betas, eps=eps, weight_decay=weight_decay)
        self.lr = float(lr)
        self.reducer = comm.grad_reducer(self.params)
        grad_fn = ms.value_and_grad(self._loss_fn, None, self.params, has_aux=True)
        self._grad_fn = ms.jit(grad_fn) if jit else grad_fn
        self._norm_fn = ms.jit(self._global_norm) if jit else self._global_norm

    def _loss_fn(self, input_ids, attention_mask, completion_ids, completion_mask, advantages, old_logp,
                 ref_logp, num_tokens, num_seqs):
        s = self.loss
        logp = sequence_logprobs(self.model, input_ids, attention_mask, completion_ids, s.temperature)
        # On-policy: old == current (detached), so the ratio is exactly 1 and needs no extra forward.
        old = old_logp if s.off_policy else ops.stop_gradient(logp)
        loss, metrics = policy_loss(
            logp, old, advantages, completion_mask, ref_logp=ref_logp if s.beta > 0 else None,
            loss_type=s.loss_type, epsilon_low=s.epsilon_low, epsilon_high=s.epsilon_high, beta=s.beta,
            kl_estimator=s.kl_estimator, loss_agg_mode=s.loss_agg_mode,
            max_completion_length=s.max_completion_length, global_num_tokens=num_tokens, global_num_seqs=num_seqs)
        # Metrics are masked means over this micro-batch; weight them by its token count so the
        # caller can form exact global means.
        tokens = completion_mask.sum()
        return loss, tuple(metrics[k] * tokens for k in LOSS_METRICS) + (tokens,)

    @staticmethod
    def _global_norm(grads):
        total = ops.zeros((), ms.float32)
        for g in grads:
            total = total + ops.sum(ops.square(g.astype(ms.float32)))
        return ops.sqrt(total)

    def set_lr(self, lr: float) -> None:
        self.lr = float(lr)

    def step(self, micro_batches: Sequence[Dict[str, np.ndarray]], num_tokens: float, num_seqs: float) -> Dict[str, float]:
        """One optimizer step over this rank's micro-batches of a mini-batch.

        ``num_tokens``/``num_seqs``: valid completion tokens / sequences of the whole mini-batch
        over all ranks. Returns loss (global), grad_norm, token-weighted metric sums and whether
        the update was skipped because the loss or gradients were not finite.
        """
        grads = None
        loss_sum = 0.0
        metric_sums = np.zeros(len(LOSS_METRICS) + 1, np.float64)
        n_tok, n_seq = Tensor(np.float32(num_tokens)), Tensor(np.float32(num_seqs))
        for mb in micro_batches:
            (loss, aux), g = self._grad_fn(
                Tensor(mb["input_ids"]), Tensor(mb["attention_mask"]), Tensor(mb["completion_ids"]),
                Tensor(mb["completion_mask"]), Tensor(mb["advantages"]), Tensor(mb["old_logp"]),
                Tensor(mb["ref_logp"]), n_tok, n_seq)
            grads = g if grads is None else tuple(a + b for a, b in zip(grads, g))
            loss_sum += float(loss.asnumpy())
            metric_sums += np.array([float(x.asnumpy()) for x in aux])
        if self.reducer is not None:
            grads = self.reducer(grads)
        loss_sum = float(comm.all_sum(np.array([loss_sum], np.float32))[0])
        metric_sums = comm.all_sum(metric_sums.astype(np.float32)).astype(np.float64)
        # A plain tuple of tensors is a jit constant (recompiles each call); mutable makes it an input.
        norm = float(self._norm_fn(ms.mutable(tuple(grads))).asnumpy())
        finite = bool(np.isfinite(loss_sum) and np.isfinite(norm))
        if finite:
            if self.max_grad_norm > 0 and norm > self.max_grad_norm:
                scale = Tensor(np.float32(self.max_grad_norm / (norm + 1e-6)))
                grads = tuple(g * scale.astype(g.dtype) for g in grads)
            self.optimizer.apply(grads, self.lr)
        out = {"loss": loss_sum, "grad_norm": norm, "skipped": 0.0 if finite else 1.0}
        tokens = max(metric_sums[-1], 1.0)
        out.update({k: metric_sums[i] / tokens for i, k in enumerate(LOSS_METRICS)})
        return out

    def optimizer_state(self) -> Dict[str, ms.Parameter]:
        """Optimizer moments and step counter by name (for checkpoints)."""
        return self.optimizer.state()

"""The policy update: loss and gradients over micro-batches, reduction, clipping, AdamW step.

Mixed precision: the forward and backward run in the model's dtype; gradients are accumulated,
reduced and clipped in float32 and applied to float32 master weights (``AdamW``). Under float16
the loss is multiplied by a dynamic loss scale (``mindspore.amp.DynamicLossScaler``) so small
gradients do not underflow; an update whose gradients overflow is skipped and the scale halves.
bfloat16 has float32's range and needs no scaling: the two paths differ only in that.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, amp, nn, ops

from mindrlhf.algorithms import get_is_mode, policy_loss
from mindrlhf.parallel import comm
from mindrlhf.parallel.groups import ParallelGroups, data_parallel_groups
from mindrlhf.parallel.pipeline import PipelineRunner
from mindrlhf.trainer.optimizer import AdamW
from mindrlhf.utils import faults

# The loss's aux values per micro-batch: token-weighted means, the token count, sums, then maxima.
LOSS_METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                "sampling/sampling_logp_difference/mean")
IS_SUMS = ("is_ratio_sum", "is_ratio_count")
IS_MAXIMA = ("sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/max",
             "-sampling/importance_sampling_ratio/min")
LOSS_KEYS = ("completion_mask", "advantages", "old_logp", "ref_logp", "sampler_logp")  # micro-batch arrays read


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
    is_correction: bool = False
    is_mode: str = "sequence_mask"
    is_cap: float = 3.0


class PolicyUpdater:
    """Accumulates gradients over micro-batches and applies one AdamW step per mini-batch.

    Losses are normalised by GLOBAL token/sequence counts of the mini-batch, and gradients are
    summed (not averaged) over the data-parallel group, so the update is the same whatever the
    number of ranks or micro-batches. The model may be a tp × pp shard (``groups`` says where this
    rank sits); the pipeline schedule, the dp reduction and a norm over the whole model are handled
    here so the trainer sees one update per call.
    """

    def __init__(self, model: nn.Cell, loss: LossSettings, *, lr: float, weight_decay: float,
                 betas: Sequence[float], eps: float, max_grad_norm: float, jit: bool = True,
                 groups: Optional[ParallelGroups] = None, masters: Optional[Sequence[Parameter]] = None,
                 loss_scale_init: float = 65536.0, loss_scale_window: int = 1000, share_prompts: bool = False,
                 layer_graphs: bool = False):
        """``masters``: float32 master weights in the order of the model's trainable parameters (see
        ``AdamW``). ``loss_scale_init`` / ``loss_scale_window``: dynamic loss scaling, float16 only.
        ``share_prompts``: pack completions that share a prompt (``models.packing``). ``layer_graphs``:
        without ``jit``, run the decoder layers as shared compiled graphs (``models.layer_graphs``)."""
        self.model = model
        self.loss = loss
        self.max_grad_norm = max_grad_norm
        self.groups = groups or data_parallel_groups(comm.rank(), comm.world_size())
        self.runner = PipelineRunner(model, self.groups, self._loss_from_logp, temperature=loss.temperature, jit=jit,
                                     share_prompts=share_prompts, layer_graphs=layer_graphs)
        self.params = self.runner.params
        # Decay matrices only: biases and norm scales (1-D) are not weight-decayed.
        self.optimizer = AdamW(self.params, masters=masters, betas=betas, eps=eps, weight_decay=weight_decay)
        # The scale doubles after loss_scale_window finite updates in a row and halves (down to 1) on overflow.
        self.scaler = amp.DynamicLossScaler(float(loss_scale_init), 2, int(loss_scale_window)) \
            if model.compute_dtype == ms.float16 else None
        self.lr = float(lr)
        g = self.groups
        self.reducer = comm.grad_reducer(self.params, g.dp, None if g.dp == comm.world_size() else g.dp_group)
        # This rank's loss counts once per dp replica: on the last stage, tp rank 0.
        self.reports_loss = model.is_last and g.tp_rank == 0
        self.norm_weights = _norm_weights([p.name for p in self.params], g, model.config.tie_word_embeddings)
        self._sumsq_fn = ms.jit(self._sum_squares) if jit else self._sum_squares

    def _loss_from_logp(self, logp, completion_mask, advantages, old_logp, ref_logp, sampler_logp, num_tokens,
                        num_seqs, loss_scale):
        s = self.loss
        # On-policy: old == current (detached), so the ratio is exactly 1 and needs no extra forward.
        old = old_logp if s.off_policy else ops.stop_gradient(logp)
        # Rollout/train mismatch: the trainer's log-probs of the sampling policy vs the sampler's own.
        valid = completion_mask > 0
        gap = ops.where(valid, ops.stop_gradient(old).astype(ms.float32) - sampler_logp, 0.0)
        mask = valid.astype(ms.float32)
        weights = get_is_mode(s.is_mode)(gap, mask, s.is_cap)
        loss, metrics = policy_loss(
            logp, old, advantages, completion_mask, ref_logp=ref_logp if s.beta > 0 else None,
            loss_type=s.loss_type, epsilon_low=s.epsilon_low, epsilon_high=s.epsilon_high, beta=s.beta,
            kl_estimator=s.kl_estimator, loss_agg_mode=s.loss_agg_mode,
            max_completion_length=s.max_completion_length, global_num_tokens=num_tokens, global_num_seqs=num_seqs,
            is_weights=weights if s.is_correction else None)
        # Means are over this micro-batch; weighted by its token count, the caller forms exact global means.
        tokens = mask.sum()
        metrics["sampling/sampling_logp_difference/mean"] = ops.abs(gap).sum() / ops.maximum(tokens, 1.0)
        # Ratio statistics over what the ratio is per: valid tokens, or completions with a valid token.
        counted = mask if weights.shape[-1] != 1 else (mask.sum(axis=-1, keepdims=True) > 0).astype(ms.float32)
        weights = ops.broadcast_to(weights, counted.shape)
        inf = float("inf")
        aux = tuple(metrics[k] * tokens for k in LOSS_METRICS) + (tokens,)
        aux += ((weights * counted).sum(), counted.sum())
        aux += (ops.abs(gap).max(), ops.where(counted > 0, weights, -inf).max(),
                -ops.where(counted > 0, weights, inf).min())
        return loss * loss_scale, aux

    @staticmethod
    def _sum_squares(grads):
        return ops.stack([ops.sum(ops.square(g.astype(ms.float32))) for g in grads])

    def global_grad_norm(self, grads) -> float:
        """L2 norm of the whole model's gradient, the same number on every rank.

        Each shard's squares are weighted so that a tp-replicated tensor (norms) and the two
        pipeline copies of a tied embedding count once; summing over all ranks then counts every
        dp replica once, hence the division by dp.
        """
        # A plain tuple of tensors is a jit constant (recompiles each call); mutable makes it an input.
        sq = self._sumsq_fn(ms.mutable(tuple(grads))).asnumpy().astype(np.float64)
        local = float(np.dot(sq, self.norm_weights))
        if self.groups.tp * self.groups.pp > 1:
            local = float(comm.all_sum(np.array([local], np.float32))[0]) / self.groups.dp
        return math.sqrt(max(local, 0.0)) if np.isfinite(local) else float("nan")

    def set_lr(self, lr: float) -> None:
        self.lr = float(lr)

    @property
    def loss_scale(self) -> float:
        """The current dynamic loss scale (1.0 when the model does not compute in float16)."""
        return float(self.scaler.scale_value.asnumpy()) if self.scaler is not None else 1.0

    def loss_scale_state(self) -> Dict[str, float]:
        """Loss scale and its count of finite updates in a row (for checkpoints); empty without scaling."""
        if self.scaler is None:
            return {}
        return {"loss_scale": self.loss_scale, "loss_scale_counter": int(self.scaler.counter.asnumpy())}

    def load_loss_scale_state(self, state: Dict[str, float]) -> None:
        """Restore what ``loss_scale_state`` returned (a checkpoint of a non-float16 run leaves it as is)."""
        if self.scaler is not None and "loss_scale" in state:
            self.scaler.scale_value.copy_(Tensor(np.float32(state["loss_scale"])))
            self.scaler.counter.copy_(Tensor(np.int32(state["loss_scale_counter"])))

    def logprobs(self, micro_batches: Sequence[Dict[str, np.ndarray]]) -> List[np.ndarray]:
        """The policy's completion log-probs of each micro-batch (the same on every rank of a replica)."""
        return self.runner.logprobs(micro_batches)

    def step(self, micro_batches: Sequence[Dict[str, np.ndarray]], num_tokens: float,
             num_seqs: float) -> Dict[str, float]:
        """One optimizer step over this rank's micro-batches of a mini-batch.

        ``num_tokens``/``num_seqs``: valid completion tokens / sequences of the whole mini-batch
        over all ranks. Returns loss (global), grad_norm, token-weighted metric sums, whether the
        update was skipped because the loss or gradients were not finite, and whether that was a
        float16 overflow above the loss scale's floor (the scale then halves; ``overflow``).
        """
        n_tok, n_seq = Tensor(np.float32(num_tokens)), Tensor(np.float32(num_seqs))
        scale = self.loss_scale
        grads, loss_sum, aux = self.runner.loss_and_grads(micro_batches, LOSS_KEYS,
                                                          extra=(n_tok, n_seq, Tensor(np.float32(scale))))
        faults.point("grad_allreduce", comm.rank())
        if self.reducer is not None:
            grads = self.reducer(grads)
        if self.scaler is not None:
            grads = self.scaler.unscale(tuple(grads))
        n_sums = len(LOSS_METRICS) + 1 + len(IS_SUMS)
        mine = np.zeros(1 + n_sums, np.float32)
        maxima = np.full((1, len(IS_MAXIMA)), -np.inf, np.float32)
        if self.reports_loss:
            mine[0], mine[1:] = loss_sum, aux[:, :n_sums].sum(axis=0)
            maxima = aux[:, n_sums:].max(axis=0, keepdims=True).astype(np.float32)
        sums = comm.all_sum(mine).astype(np.float64)
        maxima = comm.all_gather(maxima).max(axis=0)
        loss_sum, metric_sums = float(sums[0]) / scale, sums[1:]
        norm = self.global_grad_norm(grads)
        finite = bool(np.isfinite(loss_sum) and np.isfinite(norm))
        if finite:
            clip = self.max_grad_norm / (norm + 1e-6) if 0 < self.max_grad_norm < norm else 1.0
            self.optimizer.apply(grads, self.lr, grad_scale=float(np.float32(clip)))
        if self.scaler is not None:  # the same decision on every rank: loss and norm are global
            self.scaler.adjust(Tensor(finite))
        out = {"loss": loss_sum, "grad_norm": norm, "skipped": 0.0 if finite else 1.0,
               "overflow": 1.0 if not finite and scale > 1.0 else 0.0}
        tokens = max(metric_sums[len(LOSS_METRICS)], 1.0)
        out.update({k: metric_sums[i] / tokens for i, k in enumerate(LOSS_METRICS)})
        ratio_sum, ratio_count = metric_sums[len(LOSS_METRICS) + 1:]
        out["sampling/importance_sampling_ratio/mean"] = ratio_sum / ratio_count if ratio_count else 0.0
        for k, v in zip(IS_MAXIMA, maxima):
            v = float(v) if np.isfinite(v) else 0.0  # no valid token anywhere
            out[k[1:] if k.startswith("-") else k] = -v if k.startswith("-") else v
        return out

    def optimizer_state(self) -> Dict[str, ms.Parameter]:
        """Optimizer moments and step counter by name (for checkpoints)."""
        return self.optimizer.state()

    def master_weights(self) -> Dict[str, ms.Parameter]:
        """The float32 master weights by parameter name (what checkpoints store as the policy)."""
        return self.optimizer.master_weights()

    def refresh_weights(self) -> None:
        """Recast the model's compute copy from the master weights (after they were loaded)."""
        self.optimizer.refresh()


def _norm_weights(names: Sequence[str], groups: ParallelGroups, tied: bool) -> np.ndarray:
    """Per-parameter weight of its squared gradient in the global norm (see ``global_grad_norm``)."""
    from mindrlhf.parallel.layout import EMBED
    from mindrlhf.parallel.sharding import split_dim

    w = np.ones(len(names), np.float64)
    for i, name in enumerate(names):
        if groups.tp > 1 and split_dim(name) is None:
            w[i] /= groups.tp
        if name == EMBED and tied and groups.pp > 1:  # the first and last stage both hold it
            w[i] /= 2.0
    return w

"""The update every stage shares: loss and gradients over micro-batches, reduction, clipping, AdamW.

``Updater(model, objective, head=...)`` knows nothing of any algorithm. The ``objective`` (GRPO's
clipped policy loss, a DPO or reward-model loss, ...) says which micro-batch arrays it reads
(``inputs``), is differentiated on the output of the model's head (``models.heads``: completion
log-probs or per-sequence scores), and returns its loss and a tuple of auxiliary values, each
reduced by name over micro-batches and ranks as ``aux`` declares (``sum``, ``max`` or ``min``);
``objective.metrics(reduced)`` turns those into the step's metrics. Aux values after the declared
scalars that are tensors with rows (a per-row output of the loss, e.g. the values PPO's critic computes
on its way) are not reduced: ``step(..., outputs=[])`` hands them back, one array per micro-batch.
``evaluate`` runs the same objective on the forward pass alone (no gradients, no update): a stage's
evaluation is its training loss and metrics on other rows, with the same global-count normalisation.

Mixed precision: the forward and backward run in the model's dtype; gradients are accumulated,
reduced and clipped in float32 and applied to float32 master weights (``AdamW``). Under float16
the loss is multiplied by a dynamic loss scale (``mindspore.amp.DynamicLossScaler``) so small
gradients do not underflow; an update whose gradients overflow is skipped and the scale halves.
bfloat16 has float32's range and needs no scaling: the two paths differ only in that.
"""
from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, amp, nn, ops

from mindrlhf.models.heads import Head
from mindrlhf.models.layer_graphs import per_tensor_graph
from mindrlhf.models.lora import has_dropout, set_dropout_seeds
from mindrlhf.parallel import comm
from mindrlhf.parallel.groups import ParallelGroups, data_parallel_groups
from mindrlhf.parallel.pipeline import PipelineRunner
from mindrlhf.trainer.memory import MicroBatchExtent, resolve_recompute
from mindrlhf.trainer.optimizer import AdamW
from mindrlhf.utils import faults

log = logging.getLogger(__name__)

#: How an auxiliary value of the loss is reduced over micro-batches and data-parallel ranks.
REDUCTIONS = ("sum", "max", "min")


class Objective(Protocol):
    """What ``Updater`` differentiates (see the module docstring)."""

    #: Micro-batch arrays passed to ``loss`` after the head's output, in this order.
    inputs: Tuple[str, ...]
    #: (name, reduction) of each auxiliary value ``loss`` returns, in order.
    aux: Tuple[Tuple[str, str], ...]

    def loss(self, head_out: Tensor, *args: Tensor) -> Tuple[Tensor, Tuple[Tensor, ...]]:
        """``(loss, aux)`` of one micro-batch; ``args`` are ``inputs`` then the step's scalars."""

    def metrics(self, reduced: Dict[str, float]) -> Dict[str, float]:
        """The step's metrics from the reduced aux values (e.g. sums divided by a count)."""


def _sum_squares_of(g: Tensor) -> Tensor:
    """Σ g² in float32: rows first, then the row sums (MindSpore's CPU reduction of a whole tensor to one number
    is 5-10x slower than the two steps; bench/README.md "Where an update's time goes"); the same float32 sums."""
    return ops.sum(ops.sum(ops.square(g.astype(ms.float32)), -1))


# A graph per gradient, not pynative kernels nor one graph over every gradient: on CPU MindSpore's pynative
# kernels took ~1 s a step for SmolLM2's 272 gradients against 0.15-0.33 s in graphs, and one graph over all of
# them took ~20 s to compile (bench/README.md).
_sum_squares_graph = per_tensor_graph(_sum_squares_of, "sum_squares_of")


class Updater:
    """Accumulates gradients over micro-batches and applies one AdamW step per call of ``step``.

    Gradients are summed (not averaged) over the data-parallel group, so an objective normalised by
    GLOBAL counts (passed as the step's scalars) gives the same update whatever the number of ranks or
    micro-batches. The model may be a tp × pp shard (``groups`` says where this rank sits); the pipeline
    schedule, the dp reduction and a norm over the whole model are handled here.
    """

    def __init__(self, model: nn.Cell, objective: Objective, *, lr: float, weight_decay: float,
                 betas: Sequence[float], eps: float, max_grad_norm: float, jit: bool = True,
                 groups: Optional[ParallelGroups] = None, masters: Optional[Sequence[Parameter]] = None,
                 loss_scale_init: float = 65536.0, loss_scale_window: int = 1000, share_prompts: bool = False,
                 layer_graphs: bool = False, static_layer_graphs: bool = False, head: Optional[Head] = None,
                 keep_activations: bool = False):
        """``masters``: float32 master weights in the order of the model's trainable parameters (see
        ``AdamW``). ``loss_scale_init`` / ``loss_scale_window``: dynamic loss scaling, float16 only.
        ``share_prompts``: pack completions that share a prompt (``models.packing``). ``jit``: the gradient
        pass as one compiled whole-model graph (``recompute none``). ``layer_graphs``: run the decoder layers
        as shared compiled graphs (``models.layer_graphs``) in forward passes, and in the gradient pass
        without ``jit``; ``static_layer_graphs``: those graphs compiled per input shape (``PipelineRunner``).
        ``head``: what the objective is differentiated on (``models.heads``; default: completion
        log-probs at temperature 1). ``keep_activations``: the layer graphs of the gradient pass keep each
        layer's linear outputs (``recompute selective``)."""
        for name, how in objective.aux:
            if how not in REDUCTIONS:
                raise ValueError(f"objective aux {name!r}: reduction {how!r} is not one of {REDUCTIONS}")
        self.model = model
        self.objective = objective
        #: ``none``: the gradient pass is one compiled whole-model graph keeping every activation (``jit``);
        #: ``selective``: the layer graphs keeping each layer's linear outputs; ``full``: layers recomputed in the
        #: backward (layer graphs) or pynative layers.
        self.recompute = "none" if jit else ("selective" if keep_activations and layer_graphs else "full")
        #: Estimated bytes the whole-model graph keeps allocated (set by ``build_updater``; 0 unless ``none``).
        self.activation_bytes = 0
        self.max_grad_norm = max_grad_norm
        self.groups = groups or data_parallel_groups(comm.rank(), comm.world_size())
        loss_fn = objective.loss

        def scaled_loss(head_out, *args):  # the loss scale is the last scalar
            loss, aux = loss_fn(head_out, *args[:-1])
            return loss * args[-1], aux

        self.runner = PipelineRunner(model, self.groups, scaled_loss, head=head, jit=jit,
                                     share_prompts=share_prompts, layer_graphs=layer_graphs,
                                     static_layer_graphs=static_layer_graphs, keep_activations=keep_activations)
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
        self.norm_weights = _norm_weights([p.name for p in self.params], g, model.config.tied_output)

    @staticmethod
    def _sum_squares(grads):
        return ops.stack([_sum_squares_graph(g) for g in grads])

    def global_grad_norm(self, grads) -> float:
        """L2 norm of the whole model's gradient, the same number on every rank.

        Each shard's squares are weighted so that a tp-replicated tensor (norms) and the two
        pipeline copies of a tied embedding count once; summing over all ranks then counts every
        dp replica once, hence the division by dp.
        """
        sq = self._sum_squares(grads).asnumpy().astype(np.float64)
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

    def forward(self, micro_batches: Sequence[Dict[str, np.ndarray]]) -> List[np.ndarray]:
        """The head's output of each micro-batch without gradients (the same on every rank of a replica)."""
        return self.runner.forward(micro_batches)

    def evaluate(self, micro_batches: Sequence[Dict[str, np.ndarray]], scalars: Sequence[float] = ()
                 ) -> Dict[str, float]:
        """The objective on this rank's ``micro_batches`` without gradients: ``{"loss": ..., **metrics}``, the loss
        and aux values reduced over micro-batches and ranks exactly as ``step`` reduces them (``scalars``: the
        global counts that normalise the loss, as in ``step``). Every rank calls it (the reduction is a
        collective); a rank may pass no micro-batches (a replica without rows of its own)."""
        extra = [Tensor(np.float32(s)) for s in scalars]
        loss_sum, rows = 0.0, []
        for mb, out in zip(micro_batches, self.forward(micro_batches)):
            head_out = tuple(Tensor(o) for o in out) if isinstance(out, tuple) else Tensor(out)
            loss, aux = self.objective.loss(head_out, *[Tensor(mb[k]) for k in self.objective.inputs], *extra)
            loss_sum += float(loss.asnumpy())
            rows.append(np.array([float(v.asnumpy()) for v in aux if v.ndim == 0], np.float64))
        loss_sum, reduced = self._reduce(loss_sum, np.stack(rows) if rows else None)
        return {"loss": loss_sum, **self.objective.metrics(reduced)}

    def step(self, micro_batches: Sequence[Dict[str, np.ndarray]], scalars: Sequence[float] = (),
             outputs: Optional[List[np.ndarray]] = None) -> Dict[str, float]:
        """One optimizer step over this rank's micro-batches.

        ``scalars``: numbers every micro-batch's loss gets after its arrays (e.g. the global token and
        sequence counts of the mini-batch). ``outputs``: a list the loss's per-row aux outputs are appended
        to (computed before this step's update). Returns the global loss, grad_norm, whether the update was
        skipped because the loss or gradients were not finite, whether that was a float16 overflow
        above the loss scale's floor (the scale then halves; ``overflow``), and the objective's metrics.
        """
        scale = self.loss_scale
        extra = tuple(Tensor(np.float32(s)) for s in scalars) + (Tensor(np.float32(scale)),)
        grads, loss_sum, aux = self._loss_and_grads(micro_batches, extra, outputs)
        faults.point("grad_allreduce", comm.rank())
        if self.reducer is not None:
            grads = self.reducer(grads)
        if self.scaler is not None:
            grads = self.scaler.unscale(tuple(grads))
        loss_sum, reduced = self._reduce(loss_sum, aux)
        loss_sum /= scale
        norm = self.global_grad_norm(grads)
        finite = bool(np.isfinite(loss_sum) and np.isfinite(norm))
        if finite:
            clip = self.max_grad_norm / (norm + 1e-6) if 0 < self.max_grad_norm < norm else 1.0
            self.optimizer.apply(grads, self.lr, grad_scale=float(np.float32(clip)))
        if self.scaler is not None:  # the same decision on every rank: loss and norm are global
            self.scaler.adjust(Tensor(finite))
        out = {"loss": loss_sum, "grad_norm": norm, "skipped": 0.0 if finite else 1.0,
               "overflow": 1.0 if not finite and scale > 1.0 else 0.0}
        out.update(self.objective.metrics(reduced))
        return out

    def _loss_and_grads(self, micro_batches, extra, outputs):
        """The runner's loss and gradients: the only training passes, so LoRA's adapter dropout is on here alone.
        Each micro-batch's masks are drawn from (the run's seed, the optimizer step, the dp replica, the micro-batch,
        the module): the step is the optimizer's counter, which checkpoints hold, so a resumed run draws the same
        masks; every other pass (sampling, log-probs, the reference, evaluation) sees the seeds at -1, dropout off."""
        if not has_dropout(self.model):
            return self.runner.loss_and_grads(micro_batches, self.objective.inputs, extra=extra, outputs=outputs)
        step, dp_rank = int(self.optimizer.step.asnumpy()), self.groups.dp_rank

        def seeds(m: int) -> None:
            set_dropout_seeds(self.model, step, dp_rank, m)

        try:
            return self.runner.loss_and_grads(micro_batches, self.objective.inputs, extra=extra, outputs=outputs,
                                              before=seeds)
        finally:
            set_dropout_seeds(self.model, None)

    def _reduce(self, loss_sum: float, aux: Optional[np.ndarray]) -> Tuple[float, Dict[str, float]]:
        """The loss and each aux value over micro-batches and ranks (each dp replica counted once; ``aux`` None:
        this rank computed no loss)."""
        names = self.objective.aux
        sums = [i for i, (_, how) in enumerate(names) if how == "sum"]
        extremes = [i for i, (_, how) in enumerate(names) if how != "sum"]
        sign = np.array([1.0 if names[i][1] == "max" else -1.0 for i in extremes], np.float32)
        mine = np.zeros(1 + len(sums), np.float32)
        top = np.full((1, len(extremes)), -np.inf, np.float32)
        if self.reports_loss and aux is not None:
            mine[0], mine[1:] = loss_sum, aux[:, sums].sum(axis=0)
            top = (aux[:, extremes] * sign).max(axis=0, keepdims=True).astype(np.float32)
        total = comm.all_sum(mine).astype(np.float64)
        top = comm.all_gather(top).max(axis=0) * sign  # a minimum is the negated maximum of the negations
        reduced = {names[i][0]: float(v) for i, v in zip(sums, total[1:])}
        reduced.update({names[i][0]: float(v) for i, v in zip(extremes, top)})
        return float(total[0]), reduced

    def optimizer_state(self) -> Dict[str, ms.Parameter]:
        """Optimizer moments and step counter by name (for checkpoints)."""
        return self.optimizer.state()

    def master_weights(self) -> Dict[str, ms.Parameter]:
        """The float32 master weights by parameter name (what checkpoints store as the model)."""
        return self.optimizer.master_weights()

    def refresh_weights(self) -> None:
        """Recast the model's compute copy from the master weights (after they were loaded)."""
        self.optimizer.refresh()

    def release_graphs(self) -> None:
        """Free the compiled whole-model gradient graph (``recompute none``) once training is over."""
        self.runner.release_graphs()


def build_updater(cfg, model: nn.Cell, objective: Objective, *, extent: MicroBatchExtent,
                  head: Optional[Head] = None, groups: Optional[ParallelGroups] = None,
                  masters: Optional[Sequence[Parameter]] = None, share_prompts: bool = False,
                  what: str = "policy", reserved: int = 0) -> Updater:
    """The ``Updater`` a stage's config describes: AdamW and loss scaling from ``cfg.optimizer``; recompute
    (``trainer.memory``: ``auto`` decides from ``extent``, the largest micro-batch a rank trains on, less
    ``reserved``: another updater's ``activation_bytes`` in the same process) and layer graphs from
    ``cfg.parallel``. ``what`` names the model in the log."""
    o, p = cfg.optimizer, cfg.parallel
    groups = groups or data_parallel_groups(comm.rank(), comm.world_size())
    mode, kept = resolve_recompute(p.recompute, model.config, extent, layers=len(model.layer_range), tp=groups.tp,
                                   dtype_bytes=4 if model.compute_dtype == ms.float32 else 2,
                                   device_target=p.device_target, workers=comm.world_size(),
                                   budget_gb=p.memory_budget_gb, reserved=reserved, what=what,
                                   static_layers=p.layer_graphs and static_layer_graphs(p))
    # Every worker must run the same graphs (the same collectives in the same order): if any worker's budget
    # is too small, all recompute.
    if p.recompute == "auto" and comm.world_size() > 1 and comm.all_sum(np.array([mode == "full"], np.float32))[0]:
        if mode != "full":
            log.info("recompute auto -> full for the %s: another worker's budget is too small", what)
        mode, kept = "full", 0
    updater = Updater(model, objective, lr=o.lr, weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2),
                      eps=o.adam_eps, max_grad_norm=o.max_grad_norm, jit=mode == "none", groups=groups,
                      masters=masters, loss_scale_init=o.loss_scale_init, loss_scale_window=o.loss_scale_window,
                      share_prompts=share_prompts, layer_graphs=p.layer_graphs,
                      static_layer_graphs=static_layer_graphs(p), head=head, keep_activations=mode == "selective")
    # What stays allocated for the run: the whole-model graph's buffers (``none``); selective's kept tensors are
    # freed by each backward, before another model trains.
    updater.activation_bytes = kept if mode == "none" else 0
    return updater


def build_frozen_runner(cfg, model: nn.Cell, groups: ParallelGroups, head: Head, *,
                        share_prompts: bool = False) -> PipelineRunner:
    """A ``PipelineRunner`` for a model that runs without gradients (a reference, a reward model): its layers
    as the shared layer graphs (``cfg.parallel.layer_graphs``), whatever ``recompute`` says. Why not a
    whole-model ``mindspore.jit`` forward: a compiled CPU graph keeps all of its intermediates allocated, so
    a forward pass would hold a whole model's activations where the layer graphs hold one layer's."""
    return PipelineRunner(model, groups, head=head, share_prompts=share_prompts,
                          layer_graphs=cfg.parallel.layer_graphs, static_layer_graphs=static_layer_graphs(cfg.parallel))


def static_layer_graphs(parallel) -> bool:
    """Whether the layer graphs are compiled per input shape: ``parallel.layer_graph_shapes`` static, or auto
    on CPU (where MindSpore's static-shape kernels are the faster ones; other targets keep the dynamic graphs)."""
    shapes = parallel.layer_graph_shapes
    return shapes == "static" or (shapes == "auto" and parallel.device_target == "CPU")


class ReleasableModel:
    """A model that runs without gradients (``build_frozen_runner``) whose weights can be released between
    uses (``offload_models``): ``release()`` swaps every parameter's storage for a one-element placeholder,
    and the next ``forward`` first reads the weights again through ``reload`` (a function that loads a fresh
    copy of the model from its files). ``Parameter.set_data`` swaps storage, which a whole-model compiled
    graph would not see, so this needs the pynative / layer-graph runner, whose layer graphs take each
    layer's weights as inputs on every call."""

    def __init__(self, runner: PipelineRunner, model: nn.Cell, reload=None):
        self.runner, self.model, self.reload = runner, model, reload
        self.released = False

    def forward(self, micro_batches: Sequence[Dict[str, np.ndarray]]) -> List:
        """``runner.forward``, the weights read back first if they were released."""
        if self.released:
            fresh = dict(self.reload().parameters_and_names())
            for name, param in self.model.parameters_and_names():
                param.set_data(fresh[name].value(), slice_shape=True)
            self.released = False
        return self.runner.forward(micro_batches)

    def release(self) -> None:
        """Free the weights until the next ``forward`` (nothing to do without ``reload``)."""
        if self.reload is None or self.released:
            return
        for param in self.model.get_parameters():
            param.set_data(Tensor(np.zeros(1, np.float32), param.dtype), slice_shape=True)
        self.released = True


class AdaptersOff:
    """The base of a LoRA model as a frozen runner: ``runner`` (``build_frozen_runner`` over the LoRA model itself)
    run with every adapter switched off (``models.lora.adapters_disabled``), so the reference of a stage trained
    with LoRA is the trained model's own frozen base, through the same compiled graphs, with no second copy of its
    weights (PEFT's ``disable_adapter``, as TRL uses it when a peft model is given no reference)."""

    def __init__(self, runner: PipelineRunner, model: nn.Cell):
        self.runner, self.model = runner, model

    def forward(self, micro_batches: Sequence[Dict[str, np.ndarray]]) -> List:
        """``runner.forward`` of the base (the adapters are on again afterwards)."""
        from mindrlhf.models.lora import adapters_disabled

        with adapters_disabled(self.model):
            return self.runner.forward(micro_batches)

    def release(self) -> None:
        """Nothing to free: the weights are the trained model's."""


def build_frozen_model(cfg, model: nn.Cell, groups: ParallelGroups, head: Head, *, share_prompts: bool = False,
                       reload=None) -> ReleasableModel:
    """``build_frozen_runner``'s runner for ``model``, releasable when ``reload`` is given (see
    ``ReleasableModel``)."""
    runner = build_frozen_runner(cfg, model, groups, head, share_prompts=share_prompts)
    return ReleasableModel(runner, model, reload)


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

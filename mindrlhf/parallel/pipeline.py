"""Pipeline parallelism: stage-to-stage hand-off and a GPipe schedule for loss, gradients and log-probs.

Each pipeline stage is a ``CausalLM`` built for its ``ModelShard`` (a block of layers; embedding on
the first stage, final norm and output projection on the last). A step is cut into micro-batches:

* forward: stage ``s`` takes micro-batch ``m``'s hidden states from stage ``s-1`` (token ids on the
  first stage), runs its layers and hands the result to ``s+1``; the last stage runs the head
  (``models.heads``: completion log-probs, or a per-sequence score) and the loss;
* backward (GPipe: after all forwards, micro-batches in reverse order): the last stage
  differentiates the loss with respect to its parameters and its input hidden states and hands
  that input gradient back; every other stage differentiates ``sum(output · output_gradient)``,
  the vector-Jacobian product, recomputing its forward from the stashed input (only stage inputs
  are kept between the two phases, so memory does not grow with the layers held).

Parameter gradients are accumulated over micro-batches on each stage; with tied embeddings the
first and last stage copies' gradients are summed over the embedding group (``sync_tied``).

Hand-off (``StageLink``) uses ``Send``/``Receive`` where the backend has them (Ascend, GPU) and,
where it does not (CPU/mccl), an AllReduce-sum over the two-rank group of adjacent stages in which
the receiver contributes zeros — a send built from a supported collective. Both sides know the
shape in advance: every stage holds the micro-batch's ids and mask.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mindrlhf.errors import MindRLHFError
from mindrlhf.models.heads import Head, LogProbHead
from mindrlhf.models.layer_graphs import jit_any_shape, per_tensor_graph, release_compiled
from mindrlhf.models.packing import PackedBatch, pack_shared_prompts
from mindrlhf.parallel.groups import ParallelGroups

log = logging.getLogger(__name__)

P2P_BACKENDS = ("auto", "collective", "send_recv")

# loss_fn(head output, *loss_inputs) -> (scalar loss, tuple of scalar aux values)
LossFn = Callable[..., Tuple[Tensor, Tuple[Tensor, ...]]]


def resolve_p2p_backend(backend: str, device_target: str) -> str:
    """``auto`` → ``send_recv`` on Ascend/GPU, ``collective`` on CPU (mccl has no Send/Receive)."""
    if backend not in P2P_BACKENDS:
        raise MindRLHFError(f"p2p backend {backend!r}: use one of {', '.join(P2P_BACKENDS)}")
    if backend == "auto":
        return "collective" if device_target == "CPU" else "send_recv"
    if backend == "send_recv" and device_target == "CPU":
        raise MindRLHFError("p2p backend send_recv: MindSpore has no CPU Send/Receive kernels; use collective "
                            "(or auto)")
    return backend


class StageLink:
    """Hands tensors between this pipeline stage and its neighbours (same dp and tp coordinates)."""

    def __init__(self, groups: ParallelGroups, backend: str = "auto"):
        self.groups = groups
        layout = groups.layout
        self.backend = resolve_p2p_backend(backend, ms.get_context("device_target"))
        self.prev_rank = groups.rank - layout.stage_size if groups.pp_rank > 0 else None
        self.next_rank = groups.rank + layout.stage_size if groups.pp_rank < layout.pp - 1 else None
        self._ops: Dict[tuple, object] = {}

    def _reduce(self, group: Optional[str]):
        if group is None:
            raise MindRLHFError("pipeline hand-off across a stage boundary that does not exist")
        key = ("reduce", group)
        if key not in self._ops:
            self._ops[key] = ops.AllReduce(group=group)
        return self._ops[key]

    def _send(self, x: Tensor, dest: int) -> None:
        key = ("send", dest)
        if key not in self._ops:
            self._ops[key] = ops.Send(sr_tag=0, dest_rank=dest)
        self._ops[key](x)

    def _recv(self, src: int, shape: Tuple[int, ...], dtype: ms.Type) -> Tensor:
        key = ("recv", src, tuple(shape), dtype)
        if key not in self._ops:
            self._ops[key] = ops.Receive(sr_tag=0, src_rank=src, shape=list(shape), dtype=dtype)
        return self._ops[key]()

    def send_next(self, x: Tensor) -> None:
        if self.backend == "send_recv":
            self._send(x, self.next_rank)
        else:
            self._reduce(self.groups.next_group)(x)

    def send_prev(self, x: Tensor) -> None:
        if self.backend == "send_recv":
            self._send(x, self.prev_rank)
        else:
            self._reduce(self.groups.prev_group)(x)

    def recv_prev(self, shape: Tuple[int, ...], dtype: ms.Type) -> Tensor:
        if self.backend == "send_recv":
            return self._recv(self.prev_rank, shape, dtype)
        return self._reduce(self.groups.prev_group)(ops.zeros(shape, dtype))

    def recv_next(self, shape: Tuple[int, ...], dtype: ms.Type) -> Tensor:
        if self.backend == "send_recv":
            return self._recv(self.next_rank, shape, dtype)
        return self._reduce(self.groups.next_group)(ops.zeros(shape, dtype))


class PipelineRunner:
    """Runs a (possibly pipelined) ``CausalLM`` shard and a training head over micro-batches.

    Micro-batch dicts carry ``input_ids`` and ``attention_mask`` (numpy), the head's arrays
    (``head.keys``: ``completion_ids`` for the default ``LogProbHead``) and whatever the loss needs
    (``loss_keys``, passed to ``loss_fn`` after the head's output). The head (``models.heads``) runs on
    the last stage; with ``pp == 1`` this is plain value-and-grad per micro-batch, and results are
    identical either way.
    """

    def __init__(self, model, groups: ParallelGroups, loss_fn: Optional[LossFn] = None, *, head: Optional[Head] = None,
                 jit: bool = False, p2p_backend: str = "auto", share_prompts: bool = False,
                 layer_graphs: bool = False, static_layer_graphs: bool = False, graph_kernel: bool = False,
                 keep_activations: bool = False):
        """``head``: default ``LogProbHead()`` (completion log-probs at temperature 1). ``jit``: compile
        each gradient piece whole, once for every shape of its inputs (``models.layer_graphs.jit_any_shape``):
        nothing recomputed, every activation kept (``recompute none``). ``share_prompts``: pack rows that
        share a prompt when the head has a packed form. ``layer_graphs``: run the decoder layers as the
        model's shared compiled layer graphs (``CausalLM.compiled_layers``) in forward passes, and in
        gradient passes unless ``jit``; ``static_layer_graphs``: those graphs compiled per input shape (a
        bounded number; ``models.layer_graphs``), else for all shapes at once; ``graph_kernel``: the static
        ones compiled with graph-kernel fusion (``LayerGraphs.graph_kernel``); ``keep_activations``: gradient
        passes through the layer graphs keep each layer's linear outputs (``recompute selective``)."""
        self.model, self.groups = model, groups
        self.head = head if head is not None else LogProbHead()
        self.loss_fn = loss_fn
        self.params = model.trainable_params()
        self.first, self.last = model.is_first, model.is_last
        self.pipelined = groups.pp > 1
        # Shared-prompt packing (models.packing) for whole models; pipeline stages use padded rows.
        packable = self.head.build_packed(model) is not None
        self.share_prompts = share_prompts and packable and not self.pipelined
        if share_prompts and self.pipelined:
            log.info("share_prompts: pipeline stages (pp > 1) train on padded rows; shared-prompt packing "
                     "covers whole models and tensor-parallel shards")
        self.link = StageLink(groups, p2p_backend) if self.pipelined else None
        self.hidden = model.config.hidden_size
        self.dtype = model.compute_dtype
        self._jit = jit
        self._layer_graphs = layer_graphs
        #: Static-shape layer graphs (``parallel.layer_graph_shapes``); may be switched between passes.
        self.static_layer_graphs = static_layer_graphs
        #: Graph-kernel fusion of the static layer graphs (no setting: measured, not wired; bench/README.md).
        self.graph_kernel = graph_kernel
        self.keep_activations = keep_activations
        self._fns: Dict[str, Callable] = {}
        self._builders = self._pieces()
        # Names of the whole-model graphs compiled for this runner: freed by ``release_graphs`` or when the runner
        # is garbage-collected (MindSpore would keep them, and their buffers, for the process's life).
        self._compiled: List[str] = []
        weakref.finalize(self, _release_all, self._compiled)
        # Only a tied causal LM keeps an embedding copy on the last stage (layout.param_stages).
        tied = groups.embed_group is not None and model.config.tied_output
        self._tied_reduce = ops.AllReduce(group=groups.embed_group) if tied else None
        self._pp_sum = ops.AllReduce(group=groups.pp_group) if groups.pp_group else None

    # -- compiled pieces -----------------------------------------------------------------------
    # Closures over locals (the model Cell, the head's function, the loss function), not over
    # ``self``: graph mode cannot resolve attributes of a plain Python object captured by a closure.
    # ``inputs`` is token ids on the first stage (every stage of an unpipelined model) and the
    # previous stage's hidden states elsewhere; ``stage_forward`` knows which.
    def _pieces(self):
        model, loss_fn = self.model, self.loss_fn
        head, packed_head = self.head.build(model) if self.last else None, self.head.build_packed(model)
        n_head = len(self.head.keys)
        n_packed = len(PackedBatch.__dataclass_fields__) + n_head

        def stage(inputs, attention_mask):
            return model.stage_forward(inputs, attention_mask)

        def output(inputs, attention_mask, *head_inputs):
            return head(model.stage_forward(inputs, attention_mask), attention_mask, *head_inputs)

        def loss(inputs, attention_mask, *rest):
            return loss_fn(output(inputs, attention_mask, *rest[:n_head]), *rest[n_head:])

        def loss_packed(*args):
            return loss_fn(packed_head(*args[:n_packed]), *args[n_packed:])

        def vjp(inputs, attention_mask, dout):  # sum(out · dout): its gradient is the vector-Jacobian product
            return (model.stage_forward(inputs, attention_mask) * dout).sum()

        params = self.params
        return {
            "stage": lambda: stage,
            "output": lambda: output,
            "output_packed": lambda: packed_head,
            "grad": lambda: ms.value_and_grad(loss, None, params, has_aux=True),
            "grad_packed": lambda: ms.value_and_grad(loss_packed, None, params, has_aux=True),
            "grad_last": lambda: ms.value_and_grad(loss, 0, params, has_aux=True),
            "grad_first": lambda: ms.value_and_grad(vjp, None, params),
            "grad_middle": lambda: ms.value_and_grad(vjp, 0, params),
        }

    def _execution(self, grads: bool = False):
        """The layer graphs for a forward pass, and for a gradient pass unless it is one compiled graph (a
        whole-model graph traces the plain layers)."""
        if self._layer_graphs and not (grads and self._jit):
            return self.model.compiled_layers(static=self.static_layer_graphs, graph_kernel=self.graph_kernel,
                                              keep=grads and self.keep_activations)
        return contextlib.nullcontext()

    def _get(self, name: str) -> Callable:
        """The named piece, built (and, when jit, a gradient piece compiled once for all input shapes) on first
        use."""
        if name not in self._fns:
            fn = self._builders[name]()
            if self._whole(name):
                graph = f"{name}_{id(self):x}"
                self._compiled.append(graph)
                fn = jit_any_shape(fn, graph)
            self._fns[name] = fn
        return self._fns[name]

    def _whole(self, name: str) -> bool:
        """Whether the named piece is compiled whole (the gradient pieces, with ``jit``)."""
        return self._jit and name.startswith("grad")

    def release_graphs(self) -> None:
        """Free this runner's compiled whole-model graphs (``recompute none``); a later call compiles again."""
        _release_all(self._compiled)
        self._fns = {k: v for k, v in self._fns.items() if not self._whole(k)}

    def _model_inputs(self, mb) -> Tuple[str, List[Tensor]]:
        """Which whole-model pieces to run (``""`` padded rows, ``"_packed"``) and their inputs before the loss's."""
        head_inputs = [Tensor(mb[k]) for k in self.head.keys]
        packed = pack_shared_prompts(mb["input_ids"], mb["attention_mask"], mb["completion_ids"].shape[1]) \
            if self.share_prompts else None
        if packed is None:
            return "", [Tensor(mb["input_ids"]), Tensor(mb["attention_mask"])] + head_inputs
        return "_packed", [Tensor(a) for a in packed.arrays()] + head_inputs

    def _hidden_shape(self, mb) -> Tuple[int, int, int]:
        b, t = mb["input_ids"].shape
        return (b, t, self.hidden)

    # -- forward only --------------------------------------------------------------------------
    def forward(self, micro_batches: Sequence[Dict[str, np.ndarray]]) -> List[np.ndarray]:
        """The head's output of each micro-batch (completion log-probs (B, C) for ``LogProbHead``; a tuple
        of arrays for a head with several outputs), on every stage of the pipeline."""
        with self._execution():
            return self._forward(micro_batches)

    def _forward(self, micro_batches):
        if not self.pipelined:
            out = []
            for mb in micro_batches:
                kind, inputs = self._model_inputs(mb)
                out.append(_to_numpy(self._get("output" + kind)(*inputs)))
            return out
        stage, last = self._get("stage"), self._get("output")
        out = []
        for mb in micro_batches:
            mask = Tensor(mb["attention_mask"])
            x = Tensor(mb["input_ids"]) if self.first else self.link.recv_prev(self._hidden_shape(mb), self.dtype)
            if self.last:
                value = last(x, mask, *[Tensor(mb[k]) for k in self.head.keys])
            else:
                self.link.send_next(stage(x, mask))
                shapes = self.head.output_shapes(mb)
                value = ops.zeros(shapes[0], ms.float32) if len(shapes) == 1 else \
                    tuple(ops.zeros(s, ms.float32) for s in shapes)
            # The last stage's values reach every stage of this pipeline (others add zeros).
            value = self._pp_sum(value) if not isinstance(value, tuple) else tuple(self._pp_sum(v) for v in value)
            out.append(_to_numpy(value))
        return out

    # -- loss and gradients --------------------------------------------------------------------
    def loss_and_grads(self, micro_batches: Sequence[Dict[str, np.ndarray]], loss_keys: Sequence[str],
                       extra: Sequence[Tensor] = (), outputs: Optional[List[np.ndarray]] = None,
                       before: Optional[Callable[[int], None]] = None):
        """Sum over micro-batches of ``loss_fn(head output, *mb[loss_keys], *extra)`` and its parameter gradients.

        Returns ``(grads, loss_sum, aux_rows)``: float32 gradients of this shard's parameters (tied
        embedding copies already summed), and on the last stage the summed loss and each micro-batch's
        scalar aux values as rows (n_micro, n_aux), for the caller to reduce (0.0 and None on other stages).
        Aux values that are not scalars (per-row outputs of the loss) are appended to ``outputs``, one
        array per micro-batch in order, when it is given (last stage only). ``before(m)`` runs before each
        model pass of micro-batch ``m`` (its forward and, pipelined, its recomputed forward and backward): LoRA's
        dropout seeds (``models.lora.set_dropout_seeds``).
        """
        if self.loss_fn is None:
            raise MindRLHFError("PipelineRunner.loss_and_grads needs the runner to be built with a loss_fn")

        def loss_inputs(mb):
            return [Tensor(mb[k]) for k in loss_keys] + list(extra)

        if not self.pipelined:
            with self._execution(grads=True):
                total = _GradientSum(outputs)
                for m, mb in enumerate(micro_batches):
                    if before is not None:
                        before(m)
                    kind, inputs = self._model_inputs(mb)
                    total.add(*self._get("grad" + kind)(*inputs, *loss_inputs(mb)))
                return self._finish(total)
        return self._pipelined_grads(micro_batches, loss_inputs, outputs, before)

    def _pipelined_grads(self, micro_batches, loss_inputs, outputs=None, before=None):
        stage = self._get("stage")
        # GPipe forward: stash each micro-batch's stage input.
        stash = []
        with self._execution():
            for m, mb in enumerate(micro_batches):
                if before is not None:
                    before(m)
                mask = Tensor(mb["attention_mask"])
                x = Tensor(mb["input_ids"]) if self.first else self.link.recv_prev(self._hidden_shape(mb), self.dtype)
                stash.append(x)
                if not self.last:
                    self.link.send_next(stage(x, mask))
        with self._execution(grads=True):
            return self._pipelined_backward(micro_batches, stash, loss_inputs, outputs, before)

    def _pipelined_backward(self, micro_batches, stash, loss_inputs, outputs, before=None):
        """Backward, micro-batches in reverse order (the order the neighbours expect)."""
        total = _GradientSum(outputs)
        for m in reversed(range(len(micro_batches))):
            mb, x = micro_batches[m], stash[m]
            if before is not None:  # the backward recomputes the stage's forward: the same masks as its forward
                before(m)
            mask = Tensor(mb["attention_mask"])
            if self.last:
                head_inputs = [Tensor(mb[k]) for k in self.head.keys]
                (loss, aux), (gx, gp) = self._get("grad_last")(x, mask, *head_inputs, *loss_inputs(mb))
            else:
                dout = self.link.recv_next(self._hidden_shape(mb), self.dtype)
                if self.first:
                    _, gp = self._get("grad_first")(x, mask, dout)
                    gx = None
                else:
                    _, (gx, gp) = self._get("grad_middle")(x, mask, dout)
                loss, aux = None, None
            if not self.first:
                self.link.send_prev(gx)
            total.add((loss, aux), gp)
            stash[m] = None  # this micro-batch's stage input is no longer needed
        return self._finish(total)

    def _finish(self, total: "_GradientSum"):
        return self.sync_tied(total.grads), total.loss_sum, total.aux_rows

    def sync_tied(self, grads: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
        """Sum the gradients of the tied embedding's copies on the first and last stage."""
        if self._tied_reduce is None:
            return grads
        names = [p.name for p in self.params]
        return tuple(self._tied_reduce(g) if n == "model.embed_tokens.weight" else g for n, g in zip(names, grads))


def _release_all(names: List[str]) -> None:
    for name in names:
        release_compiled(name)
    names.clear()


def _to_numpy(value):
    """A head's output (a tensor or a tuple of them) as numpy."""
    return tuple(v.asnumpy() for v in value) if isinstance(value, tuple) else value.asnumpy()


def _add_float32(total: Tensor, g: Tensor) -> Tensor:
    return total + g.astype(ms.float32)


# A graph per gradient: MindSpore's pynative CPU kernels ran this sum 2-5x slower on SmolLM2's gradients
# (bench/README.md).
_accumulate = per_tensor_graph(_add_float32, "add_float32")


class _GradientSum:
    """Running sum of micro-batch gradients and losses; the scalar aux values kept per micro-batch, and the
    others (per-row outputs) appended to ``outputs`` when a list is given.

    Summed as each micro-batch finishes, so at most two gradient sets (the sum and the newest)
    exist at once rather than one per micro-batch. Gradients are summed (and later reduced,
    clipped and applied) in float32 whatever the compute dtype: adding many bf16/fp16
    micro-batch gradients would round every partial sum.
    """

    def __init__(self, outputs: Optional[List[np.ndarray]] = None):
        self.grads: Optional[Tuple[Tensor, ...]] = None
        self.loss_sum = 0.0
        self._aux: List[np.ndarray] = []
        self._outputs = outputs

    def add(self, loss_aux, grads) -> None:
        loss, aux = loss_aux
        if self.grads is None:
            self.grads = tuple(g if g.dtype == ms.float32 else g.astype(ms.float32) for g in grads)
        else:  # one tensor at a time, so each old partial sum is freed as its successor exists
            total, self.grads = list(self.grads), None
            for i, g in enumerate(grads):
                total[i] = _accumulate(total[i], g)
            self.grads = tuple(total)
        if loss is not None:
            self.loss_sum += float(loss.asnumpy())
            self._aux.append(np.array([float(v.asnumpy()) for v in aux if v.ndim == 0], np.float64))
            if self._outputs is not None:
                self._outputs.extend(v.asnumpy() for v in aux if v.ndim > 0)

    @property
    def aux_rows(self) -> Optional[np.ndarray]:
        """(micro-batches, aux values), or None where no loss was computed (not the last stage)."""
        return np.stack(self._aux) if self._aux else None

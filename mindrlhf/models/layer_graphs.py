"""Decoder layers of pynative training run as two compiled graphs shared by every layer.

Why: a decoder layer compiled with ``mindspore.jit`` runs its forward and backward ~1.7x faster on
CPU than pynative (no per-kernel dispatch, graph-mode kernels), but compiling the whole training
step keeps every intermediate tensor of every layer allocated (SmolLM2-135M: 9.6 GiB vs 4.3), and a
compiled graph per layer keeps ~110 MB each. So one *template* layer is compiled twice — forward,
and backward (the forward recomputed, then its vector-Jacobian product) — and each real layer
loads its weights into the template before running either graph. Only each layer's input
survives between the forward and the backward (activation checkpointing at layer granularity).

With ``keep`` (``recompute selective``) a forward that records gradients runs a third graph that also returns
the tensors between the layer's ``DecoderLayer.PIECES`` (its linear layers' outputs), and a fourth graph
differentiates each piece from them on its own: the linear layers' forward products never run again, only
the norms, RoPE, attention's core and the activation are recomputed (Megatron's selective recomputation;
``ms.grad`` of a piece drops the products whose values its gradient does not use). The kept tensors wait
in ``LayerGraphs`` between a layer's forward and its backward.

Two kinds of graphs (``LayerGraphs.static``): *dynamic* graphs declare every input dimension dynamic, so
one compile serves every sequence length; *static* graphs are compiled for one input shape each (the
trainer's rows are padded to multiples of 32, so a run sees few shapes) and run MindSpore's static-shape
CPU kernels, which are faster (bench/README.md), with the same numbers. Each static graph keeps its
buffers allocated, so at most ``STATIC_VARIANTS`` input shapes get static graphs per template; the
shapes after those run the dynamic graphs (never evicted and compiled again: a run whose lengths keep
changing would compile at every step).

The layer's own ``construct`` is the only definition of its maths: both graphs trace the template,
a ``DecoderLayer`` of the same config, dtype and shard (so tensor-parallel collectives are in the
graph too). Gradients reach the real layer's parameters because they are passed to a custom-bprop
cell as inputs; they equal the pynative path's to float rounding (tests/test_layer_graphs.py).
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import Callable, Dict, List, Sequence, Tuple

import mindspore as ms
from mindspore import Tensor, nn, ops

from mindrlhf.errors import MindRLHFError

log = logging.getLogger(__name__)


def dynamic_signature(arg):
    """The all-dynamic signature of a tensor (or a tuple of tensors) for ``mindspore.enable_dynamic``."""
    if isinstance(arg, (tuple, list)):
        return tuple(dynamic_signature(a) for a in arg)
    return Tensor(shape=[None] * arg.ndim, dtype=arg.dtype)


def jit_any_shape(fn: Callable, name: str) -> Callable:
    """``fn(*tensors)`` compiled with ``mindspore.jit`` once for inputs of any shape: every dimension is
    dynamic (the ranks and dtypes are the first call's). A static-shape graph compiles again for each new
    sequence length and keeps each compiled graph's buffers allocated. ``name`` must be unique per ``fn``
    (MindSpore keys compiled functions by name and source line)."""
    def whole(args):
        return fn(*args)

    whole.__name__ = name
    compiled = []

    def call(*args):
        if not compiled:
            compiled.append(ms.enable_dynamic(args=dynamic_signature(args))(ms.jit(whole)))
        return compiled[0](ms.mutable(tuple(args)))

    return call


def per_tensor_graph(fn: Callable, name: str) -> Callable:
    """``fn(tensor, ...)`` (tensor arguments only) for pynative callers, compiled with ``mindspore.jit`` once per
    ranks and dtypes of its arguments, every dimension dynamic (``jit_any_shape``): MindSpore's CPU kernels run
    several times faster in a graph than in pynative (the vocabulary head's chunks, the per-gradient loops of the
    update; bench/README.md). Explicit dynamic signatures rather than ``jit(dynamic=1)``, whose shape
    detection crashed the process now and then (seen in the test suite: a segmentation fault in its compile)."""
    graphs: Dict[Tuple, Callable] = {}

    def call(*args):
        key = tuple((a.ndim, a.dtype) for a in args)
        if key not in graphs:
            graphs[key] = jit_any_shape(fn, f"{name}_{len(graphs)}")
        return graphs[key](*args)

    return call


def release_compiled(name: str) -> None:
    """Free the graphs ``jit_any_shape(fn, name)`` compiled: MindSpore otherwise keeps a compiled graph, and the
    buffers it holds, for the life of the process (a process that builds several trainers, such as a test
    session, would keep every one's). Uses MindSpore 2.10's executor, as ``mindspore.ms_memory_recycle`` does
    for all graphs at once."""
    from mindspore.graph.api import _cell_graph_executor, ms_compile_cache

    phases = {p for p in ms_compile_cache if f"{name}." in p}  # a phase is ``...<function name>.<arguments key>``
    if not phases:
        return
    _cell_graph_executor.del_net_res(None, phases)
    if os.getenv("MS_DEV_JIT_PIPELINE") != "0":
        from mindspore._c_expression import JitExecutor_

        JitExecutor_.get_instance().del_net_res(None, phases)
    ms_compile_cache.difference_update(phases)


def _inputs(rope, bias):
    """Tuples go in as ``mutable`` (graph inputs, as ``enable_dynamic`` needs, not constants)."""
    return ms.mutable(tuple(rope)), (ms.mutable(bias) if isinstance(bias, tuple) else bias)


#: Input shapes a template compiles static graphs for (forward and backward each); later shapes run the
#: dynamic graphs. Chosen by measurement (bench/README.md): a training run with bucketed lengths sees
#: a handful of shapes per pass, and each static pair holds its buffers (tens to hundreds of MB on SmolLM2).
STATIC_VARIANTS = 8

#: ``graph_kernel_flags`` of the fused static layer graphs (``LayerGraphs.graph_kernel``; "" = AKG's defaults).
#: Fusion is no setting: measured (bench/README.md, ``bench/train_flops.py --layer_graph_shapes
#: static,static+gk``), fusing multiplies with adds moves SmolLM2's gradients by up to 1.3e-5 relative, beyond
#: the 1e-5 the decoder's parity holds, and the flags that keep the numbers exact fuse only adds and copies.
GRAPH_KERNEL_FLAGS = ""


class _FusedOnFirstCall:
    """A ``mindspore.jit`` function compiled with graph-kernel fusion. ``enable_graph_kernel`` is a process-wide
    context setting that MindSpore reads when it compiles a graph (a compiled graph keeps what it was compiled
    with), so it is switched on for this function's first call only: the model's other graphs (the sampler's
    decode steps, which fusion makes slower, the whole-model graphs) compile as before."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.compiled = False

    def __call__(self, *args):
        if self.compiled:
            return self.fn(*args)
        before = ms.get_context("enable_graph_kernel"), ms.get_context("graph_kernel_flags")
        ms.set_context(enable_graph_kernel=True, graph_kernel_flags=GRAPH_KERNEL_FLAGS)
        try:
            out = self.fn(*args)
        finally:
            ms.set_context(enable_graph_kernel=before[0], graph_kernel_flags=before[1])
        self.compiled = True
        return out


def _shape_key(x: Tensor, rope, bias) -> Tuple:
    """The input shapes (and dtypes) a static graph is compiled for."""
    parts = (x, *rope, *(bias if isinstance(bias, tuple) else (bias,)))
    return tuple((tuple(a.shape), str(a.dtype)) for a in parts)


class LayerGraphs:
    """Runs decoder layers through the compiled forward/backward graphs of ``template``
    (a layer built like them and never trained itself). ``static``: use static-shape graphs for the
    first ``max_static`` input shapes (the dynamic graphs after that); ``graph_kernel``: compile those static
    graphs with MindSpore's graph-kernel fusion (``GRAPH_KERNEL_FLAGS``; the dynamic graphs are never fused);
    both set per use by ``CausalLM.compiled_layers``."""

    graph_kernel = False

    def __init__(self, template: nn.Cell, max_static: int = STATIC_VARIANTS):
        self.template = template
        # Every parameter is loaded per layer; only the trainable ones are differentiated (a LoRA layer's frozen
        # base is loaded too but gets no gradient, its adapters do).
        self.weights = tuple(template.get_parameters())
        self.trainable = tuple(bool(w.requires_grad) for w in self.weights)
        self.static = False
        self.max_static = max_static
        self._graphs: Dict[bool, Tuple[Dict, Dict]] = {}  # packed -> ({kind: dynamic graph}, {kind: function})
        self._static_graphs: Dict[Tuple, Dict] = {}  # (packed, fused, input shapes) -> {kind: graph}
        self._static_names: List[str] = []
        self._bound_logged = False
        # MindSpore keeps compiled graphs (and their buffers) for the process's life: free the static ones
        # with the template (a process that builds several models, such as a test session). Not at exit:
        # by then MindSpore's runtime may be torn down, and freeing graphs into it aborted the interpreter
        # (exit 134) in a process that had imported torch first.
        weakref.finalize(self, _release_names, self._static_names).atexit = False
        self._layer_weights: Dict[int, Tuple] = {}
        self._pieces = _piece_weights(template, self.weights, self.trainable)
        by_piece = [id(w) for piece in self._pieces for w in piece]  # backward_kept's gradient order
        self._piece_order = tuple(by_piece.index(id(w)) for w, t in zip(self.weights, self.trainable) if t)
        #: Forward passes that record gradients keep the pieces' outputs for the backward (``recompute
        #: selective``); set per use by ``CausalLM.compiled_layers``.
        self.keep = False
        self._kept: Dict[int, Tuple] = {}  # a kept forward's key -> its pieces' outputs, until its backward
        self._next_key = 0
        self._cells = {(packed, keep): (_KeptGraphLayer if keep else _GraphLayer)(self, packed=packed)
                       for packed in (True, False) for keep in (True, False)}

    @property
    def static_shapes(self) -> int:
        """How many input shapes have static graphs."""
        return len(self._static_graphs)

    def run(self, layer: nn.Cell, x: Tensor, rope: Tuple[Tensor, ...], bias) -> Tensor:
        """``layer(x, rope, bias)`` computed by the shared graphs (differentiable in pynative)."""
        packed = isinstance(bias, tuple)
        args = (*rope, *(bias if packed else (bias,)), *self._weights_of(layer))
        if not (self.keep and _recording_gradients()):
            return self._cells[(packed, False)](x, *args)
        self._next_key += 1  # the key goes in as a tensor: the backward gets its inputs back, not these objects
        return self._cells[(packed, True)](x, Tensor([self._next_key], ms.int32), *args)

    def release_kept(self) -> None:
        """Drop kept tensors whose backward never ran (a forward recorded under a gradient it did not reach)."""
        self._kept.clear()

    @property
    def kept_count(self) -> int:
        """How many layer forwards' kept tensors wait for their backward."""
        return len(self._kept)

    def _weights_of(self, layer: nn.Cell) -> Tuple:
        key = id(layer)
        if key not in self._layer_weights:
            weights = tuple(layer.get_parameters())
            if len(weights) != len(self.weights):
                raise MindRLHFError(f"layer graphs: a layer has {len(weights)} parameters, the template "
                                    f"{len(self.weights)}; build the template like the model's layers")
            for t, w, trainable in zip(self.weights, weights, self.trainable):
                if t.shape != w.shape or t.dtype != w.dtype or bool(w.requires_grad) != trainable:
                    raise MindRLHFError(f"layer graphs: {w.name} is {w.dtype}{w.shape} but the compiled template "
                                        f"holds {t.dtype}{t.shape}; build the template like the model's layers")
            self._layer_weights[key] = weights
        return self._layer_weights[key]

    def _load(self, weights: Sequence[Tensor]) -> None:
        for t, w in zip(self.weights, weights):
            ops.assign(t, w)

    def _functions(self, packed: bool, suffix: str) -> Dict[str, Callable]:
        """Fresh functions of the template (forward, backward; forward_kept, backward_kept), named for
        MindSpore's compile cache."""
        layer = self.template
        weights = tuple(w for w, trainable in zip(self.weights, self.trainable) if trainable)
        w1, w2, w3, w4 = self._pieces

        def forward(x, rope, bias):
            return layer(x, rope, bias)

        def weighted_sum(x, rope, bias, dout):  # its gradient is the vector-Jacobian product
            return (layer(x, rope, bias) * dout).sum()

        def backward(x, rope, bias, dout):
            return ms.grad(weighted_sum, 0, weights)(x, rope, bias, dout)

        def forward_kept(x, rope, bias):
            return layer.forward_kept(x, rope, bias)

        # The pieces of ``backward_kept``: each the sum of a piece's outputs times their gradients, whose gradient is
        # the piece's vector-Jacobian product. Module-level-like (every tensor an argument, no closure over the
        # graph's tensors): closures failed to compile in the dynamic-shape graphs of packed rows.
        def mlp_output(gate, up, dout):
            return (layer.mlp.down(gate, up) * dout).sum()

        def mlp_inputs(x, attn, dout, dgate, dup):
            h, gate, up = layer.mlp_inputs(x, attn)
            return (h * dout).sum() + (gate * dgate).sum() + (up * dup).sum()

        def attention(q, k, v, rope, bias, dattn):
            return (layer.self_attn.output(q, k, v, rope, bias) * dattn).sum()

        def attention_inputs(x, dq, dk, dv):
            q, k, v = layer.attention_inputs(x)
            return (q * dq).sum() + (k * dk).sum() + (v * dv).sum()

        def backward_kept(x, kept, rope, bias, dout):
            q, k, v, attn, gate, up = kept  # last piece first
            (dgate, dup), g4 = ms.grad(mlp_output, (0, 1), w4)(gate, up, dout)
            (dx, dattn), g3 = ms.grad(mlp_inputs, (0, 1), w3)(x, attn, dout, dgate, dup)
            (dq, dk, dv), g2 = ms.grad(attention, (0, 1, 2), w2)(q, k, v, rope, bias, dattn)
            dx1, g1 = ms.grad(attention_inputs, 0, w1)(x, dq, dk, dv)
            return dx + dx1, g1 + g2 + g3 + g4

        functions = dict(forward=forward, backward=backward, forward_kept=forward_kept, backward_kept=backward_kept)
        # Each template's graphs are distinct by design; distinct names keep MindSpore from warning
        # that one function "has been compiled again" (it keys functions by name and source line), and
        # let ``release_compiled`` free one static set by its name.
        for kind, fn in functions.items():
            fn.__name__ = f"{'packed' if packed else 'padded'}_layer_{kind}_{id(self):x}{suffix}"
        return functions

    def _graph(self, kind: str, x: Tensor, rope, bias, kept=None) -> Callable:
        """The compiled ``kind`` graph (``_functions``) for packed or padded rows, compiled on first call: static
        for this input shape when ``static`` and the bound allows, else the dynamic one."""
        packed = isinstance(bias, tuple)
        graphs = None
        if self.static:
            fused = bool(self.graph_kernel)
            key = (packed, fused, _shape_key(x, rope, bias))
            graphs = self._static_graphs.get(key)
            if graphs is None and len(self._static_graphs) < self.max_static:
                functions = self._functions(packed, f"_{'gk' if fused else 's'}{len(self._static_graphs)}")
                self._static_names.extend(fn.__name__ for fn in functions.values())
                graphs = {k: (_FusedOnFirstCall(ms.jit(fn)) if fused else ms.jit(fn)) for k, fn in functions.items()}
                self._static_graphs[key] = graphs
                log.info("layer graphs: static graphs for input %s (%d of %d)", tuple(x.shape),
                         len(self._static_graphs), self.max_static)
            if graphs is None and not self._bound_logged:
                self._bound_logged = True
                log.info("layer graphs: %d input shapes have static graphs (the bound); further shapes run the "
                         "dynamic-shape graphs", self.max_static)
        if graphs is None:
            if packed not in self._graphs:
                self._graphs[packed] = ({}, self._functions(packed, ""))
            graphs, functions = self._graphs[packed]
            if kind not in graphs:
                sig = dict(x=dynamic_signature(x), rope=dynamic_signature(rope), bias=dynamic_signature(bias))
                if kind.startswith("backward"):
                    sig["dout"] = dynamic_signature(x)
                if kept is not None:
                    sig["kept"] = dynamic_signature(kept)
                graphs[kind] = ms.enable_dynamic(**sig)(ms.jit(functions[kind]))
        return graphs[kind]

    def forward(self, x: Tensor, rope, bias, weights) -> Tensor:
        self._load(weights)
        return self._graph("forward", x, rope, bias)(x, *_inputs(rope, bias))

    def backward(self, x: Tensor, rope, bias, weights, dout: Tensor):
        """(input gradient, gradients of the trainable weights) for upstream gradient ``dout``."""
        self._load(weights)
        return self._graph("backward", x, rope, bias)(x, *_inputs(rope, bias), dout)

    def forward_kept(self, x: Tensor, rope, bias, weights, key: int) -> Tensor:
        """``forward``, keeping the pieces' outputs under ``key`` for ``backward_kept``."""
        self._load(weights)
        out, kept = self._graph("forward_kept", x, rope, bias)(x, *_inputs(rope, bias))
        self._kept[key] = kept
        return out

    def backward_kept(self, x: Tensor, rope, bias, weights, key: int, dout: Tensor):
        """``backward`` from the tensors ``forward_kept`` kept under ``key`` (released here)."""
        kept = self._kept.pop(key, None)
        if kept is None:
            raise MindRLHFError("layer graphs: a layer's backward found no kept forward tensors (released before the "
                                "backward ran); run the gradient pass inside one compiled_layers block")
        self._load(weights)
        dx, dweights = self._graph("backward_kept", x, rope, bias, kept)(x, ms.mutable(tuple(kept)),
                                                                          *_inputs(rope, bias), dout)
        # Wait for it: left to run ahead, pynative queued the layers' backward graphs behind each other and a SmolLM2
        # gradient pass took 21-23 s instead of 15 (bench/README.md); what it waits on is not known.
        dx.asnumpy()
        return dx, tuple(dweights[i] for i in self._piece_order)


def _recording_gradients() -> bool:
    """Whether pynative is recording this forward for a gradient (MindSpore 2.10's executor; outside a custom-bprop
    cell's ``construct``, where it reads False)."""
    from mindspore.common.api import _pynative_executor

    return bool(_pynative_executor.requires_grad())


def _piece_weights(template: nn.Cell, weights: Sequence, trainable: Sequence[bool]) -> Tuple[Tuple, ...]:
    """The template's trainable parameters by ``DecoderLayer.PIECES`` (name prefixes), each piece's in the
    order of ``weights``; every trainable parameter in exactly one piece."""
    names = {id(w): name for name, w in template.parameters_and_names()}
    pieces = tuple([] for _ in template.PIECES)
    for w, t in zip(weights, trainable):
        if not t:
            continue
        owners = [i for i, prefixes in enumerate(template.PIECES) if names[id(w)].startswith(prefixes)]
        if len(owners) != 1:
            raise MindRLHFError(f"layer graphs: parameter {names[id(w)]} is in {len(owners)} of the layer's pieces "
                                "(DecoderLayer.PIECES); name it in exactly one")
        pieces[owners[0]].append(w)
    return tuple(tuple(p) for p in pieces)


def _release_names(names: List[str]) -> None:
    for name in names:
        release_compiled(name)
    names.clear()


class _GraphLayer(nn.Cell):
    """One layer call as a single differentiable pynative op: inputs (x, 4 rope tables, 3 packed-row
    masks or 1 padded mask, the layer's weights), backward by the compiled graph."""

    def __init__(self, graphs: LayerGraphs, packed: bool):
        super().__init__()
        self.graphs = graphs
        self.num_bias = 3 if packed else 1
        self._zeros: Tuple[Tuple, Tuple] = ((), ())  # (input signature, zero gradients for it)
        self._frozen_zeros: Tuple[Tuple, Tuple] = ((), ())  # the same for a LoRA layer's frozen base weights

    def _split(self, args):
        n = self.num_bias
        rope, bias, weights = tuple(args[:4]), tuple(args[4:4 + n]), args[4 + n:]
        return rope, (bias if n == 3 else bias[0]), weights

    def construct(self, x, *args):
        rope, bias, weights = self._split(args)
        return self.graphs.forward(x, rope, bias, weights)

    def bprop(self, x, *args):
        inputs, dout = args[:-2], args[-1]  # args[-2] is the forward's output
        rope, bias, weights = self._split(inputs)
        dx, dweights = self.graphs.backward(x, rope, bias, weights, dout)
        return (dx,) + self._other_grads(inputs, weights, dweights)

    def _other_grads(self, inputs, weights, dweights) -> Tuple:
        """A gradient per input after the rows ``x`` (and a kept forward's key): zeros for the rope tables and masks,
        then the weights' (``_weight_grads``)."""
        return self._constant_grads(inputs[:4 + self.num_bias]) + self._weight_grads(weights, dweights)

    def _weight_grads(self, weights, dweights) -> Tuple:
        """A gradient per weight input: the graph's for the trainable ones, zeros for a frozen base's (nothing
        differentiates them; they are allocated once per layer shape, like ``_constant_grads``)."""
        if all(self.graphs.trainable):
            return tuple(dweights)
        frozen = iter(self._zero_grads([w for w, t in zip(weights, self.graphs.trainable) if not t]))
        trained = iter(dweights)
        return tuple(next(trained) if t else next(frozen) for t in self.graphs.trainable)

    def _zero_grads(self, frozen) -> Tuple:
        signature = tuple((tuple(w.shape), w.dtype) for w in frozen)
        if signature != self._frozen_zeros[0]:
            self._frozen_zeros = (signature, tuple(ops.zeros(shape, dtype) for shape, dtype in signature))
        return self._frozen_zeros[1]

    def _constant_grads(self, constants) -> Tuple:
        """Zero gradients for the rope tables and masks (they hold no parameters). Every layer of a
        step gets the same ones, so they are allocated once per shape, not once per layer."""
        signature = tuple((a.shape, a.dtype) for a in constants)
        if signature != self._zeros[0]:
            self._zeros = (signature, tuple(ops.zeros(shape, dtype) for shape, dtype in signature))
        return self._zeros[1]


class _KeptGraphLayer(_GraphLayer):
    """``_GraphLayer`` keeping the pieces' outputs (``LayerGraphs.keep``): inputs (x, key, then as
    ``_GraphLayer``); ``key`` (an int32 tensor of one value) names the kept tensors for the backward."""

    def construct(self, x, key, *args):
        rope, bias, weights = self._split(args)
        return self.graphs.forward_kept(x, rope, bias, weights, self.graphs._next_key)  # ``key``'s value

    def bprop(self, x, key, *args):
        inputs, dout = args[:-2], args[-1]
        rope, bias, weights = self._split(inputs)
        dx, dweights = self.graphs.backward_kept(x, rope, bias, weights, int(key.asnumpy()[0]), dout)
        return (dx, ops.zeros_like(key)) + self._other_grads(inputs, weights, dweights)

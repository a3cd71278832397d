"""LoRA adapters on a frozen ``CausalLM``, and PEFT's adapter directory format.

``apply_lora(model, LoRASpec(...))`` freezes every base parameter (``requires_grad=False``) and gives
each targeted decoder projection (q/k/v/o, gate/up/down) two trainable factors, so the projection
computes ``y = W x + b + (alpha / r) * B A dropout(x)`` in its own ``construct``
(``models.tp_layers._AdaptableLinear``): the model keeps one forward. Names and shapes are PEFT's:
``model.layers.0.self_attn.q_proj.lora_A.weight`` (r, in) and ``...lora_B.weight`` (out, r); PEFT's
file prefixes them with ``base_model.model.``. The default init is PEFT's (A kaiming-uniform with
a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)); B zero), drawn with numpy per tensor name and seed
for the whole (unsharded) factor, then sliced, so every tp layout holds the same adapter.

Under tp the factors follow their layer: a column-parallel layer splits B with its output rows
(A replicated), a row-parallel layer splits A with its input columns (B replicated, its delta added
to the partial sum before the layer's reduce); see ``tp_layers`` for the replicated factor's gradient.

``save_adapter`` / ``load_adapter`` write and read ``adapter_config.json`` + ``adapter_model.safetensors``
as ``peft`` does (tests/test_lora.py checks the logits against peft on transformers, both ways);
``merged_weights`` gives the base weights with ``scaling * B A`` added, for a merged HF export;
``merge_adapter`` does the same to weights streamed from files (``convert_weight --reverse --adapter``).
SFT, RM, DPO, ORPO, GRPO and PPO train them (``trainer.entry.load_policy(..., lora=cfg.model)``; the compiled
layer graphs carry the same adapters through ``adapt_like``). ``adapters_disabled`` runs the base (the reference of
DPO, GRPO and PPO: each adapter's ``lora_enabled`` switch, a graph input, set to 0); ``modules_to_save`` (a reward
model's ``score``) are trained in full and saved with the adapters. See docs/design.md, "LoRA".
Adapter dropout (``LoRASpec.dropout`` > 0) is a hash mask (``models.hash_dropout``) whose per-module seeds
``set_dropout_seeds`` sets for a gradient pass (``trainer.update.Updater``) and turns off (-1) afterwards.
"""
from __future__ import annotations

import contextlib
import math
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn

from mindrlhf.errors import MindRLHFError
from mindrlhf.models.family import PROJECTIONS  # every attention and MLP projection: the default targets
from mindrlhf.models.tp_layers import ColumnParallelLinear, CopyToTP, RowParallelLinear

#: PEFT's prefix of the transformers model's names in ``adapter_model.safetensors``.
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_LAYER_MODULE = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(\w+)$")


@dataclass(frozen=True)
class LoRASpec:
    """What to adapt and how (PEFT's ``LoraConfig`` meaning of each field).

    ``target_modules``: module names (a module matches when its name equals one or ends with ``.<one>``),
    PEFT's ``"all-linear"`` (every projection), or one regex string matched against the whole module name
    (``re.fullmatch``), over the decoder layers' projections, e.g. ``model.layers.0.self_attn.q_proj``.
    Scaling is ``alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``)."""

    r: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    target_modules: Union[str, Tuple[str, ...]] = PROJECTIONS
    use_rslora: bool = False
    seed: int = 0
    #: PEFT's ``modules_to_save``: modules outside the decoder layers (a head) trained in full and saved with the
    #: adapters, e.g. a reward model's ``score`` (PEFT's sequence-classification task adds ``classifier`` and
    #: ``score``); a name matches a module as ``target_modules``' names do, and names matching nothing are ignored.
    modules_to_save: Tuple[str, ...] = ()
    task_type: str = "CAUSAL_LM"  # PEFT's task type: CAUSAL_LM, or SEQ_CLS for a model with a score head
    extra: Dict[str, Any] = field(default_factory=dict, compare=False)  # PEFT keys kept for writing back

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r <= 0:
            raise MindRLHFError(f"LoRA rank r={self.r!r} must be a positive integer; use e.g. 8 or 16")
        if not 0.0 <= self.dropout < 1.0:
            raise MindRLHFError(f"LoRA dropout={self.dropout!r} must be in [0, 1)")
        if self.target_modules == "all-linear":  # PEFT's shorthand: every linear but the output layer
            object.__setattr__(self, "target_modules", PROJECTIONS)
        object.__setattr__(self, "modules_to_save", tuple(self.modules_to_save or ()))
        if not isinstance(self.target_modules, str):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
            if not self.target_modules:
                raise MindRLHFError("LoRA target_modules is empty; name modules (e.g. q_proj v_proj) or give a regex")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def matches(self, module: str) -> bool:
        """Whether the module named ``module`` (e.g. ``model.layers.0.mlp.up_proj``) gets an adapter."""
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module) is not None
        return any(module == t or module.endswith("." + t) for t in self.target_modules)


def _adaptable(model: nn.Cell) -> List[Tuple[str, nn.Cell]]:
    """The decoder layers' projections this shard holds, by HF module name."""
    return [(name, cell) for name, cell in model.cells_and_names()
            if isinstance(cell, (ColumnParallelLinear, RowParallelLinear)) and _LAYER_MODULE.fullmatch(name)]


def lora_modules(model: nn.Cell) -> List[Tuple[str, nn.Cell]]:
    """The projections carrying an adapter, by module name (empty for a model without LoRA)."""
    return [(name, cell) for name, cell in _adaptable(model) if cell.lora_A is not None]


def adapted_by(model: nn.Cell, spec: LoRASpec) -> List[str]:
    """The module names of ``model``'s projections that ``spec``'s targets adapt (whatever the model carries now)."""
    return [name for name, _ in _adaptable(model) if spec.matches(name)]


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _is_saved(name: str, modules_to_save: Sequence[str]) -> bool:
    """Whether the parameter ``name`` (e.g. ``score.weight``) belongs to one of PEFT's ``modules_to_save``."""
    module = _module_of(name)
    return ".lora_" not in name and any(module == t or module.endswith("." + t) for t in modules_to_save)


def saved_modules(model: nn.Cell, spec: Optional[LoRASpec] = None) -> List[Tuple[str, Parameter]]:
    """The parameters of ``spec``'s (default: the model's) ``modules_to_save``, by name (e.g. ``score.weight``)."""
    spec = spec or getattr(model, "lora_spec", None)
    if spec is None or not spec.modules_to_save:
        return []
    return [(name, param) for name, param in model.parameters_and_names() if _is_saved(name, spec.modules_to_save)]


def _init_array(name: str, shape: Tuple[int, int], seed: int) -> np.ndarray:
    """PEFT's A init for the whole factor: kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(shape[1])
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


def _full_shapes(cell: nn.Cell, r: int, tp: int) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """The unsharded (A, B) shapes of ``cell``'s adapter."""
    out_local, in_local = cell.weight.shape
    if isinstance(cell, ColumnParallelLinear):
        return (r, in_local), (out_local * tp, r)
    return (r, in_local * tp), (out_local, r)


def _local(cell: nn.Cell, a: np.ndarray, b: np.ndarray, tp: int, tp_rank: int) -> Tuple[np.ndarray, np.ndarray]:
    """This tp rank's slices of full (A, B): B's rows for a column-parallel layer, A's columns for a row one."""
    if tp == 1:
        return a, b
    if isinstance(cell, ColumnParallelLinear):
        n = b.shape[0] // tp
        return a, b[tp_rank * n:(tp_rank + 1) * n]
    n = a.shape[1] // tp
    return a[:, tp_rank * n:(tp_rank + 1) * n], b


def _attach_dropout(cell: nn.Cell, name: str, p: float, tp: int, tp_rank: int) -> None:
    """Give ``cell`` adapter dropout ``p`` (none at 0): its seed parameter, off (-1) until a gradient pass sets it
    (``set_dropout_seeds``), and where its input columns sit in the whole input (a row-parallel layer's input is
    split over the tp ranks; a column-parallel layer's is whole)."""
    cell.lora_dropout = float(p)
    if p <= 0:
        cell.lora_dropout_seed = None
        return
    in_local = cell.weight.shape[1]
    row = isinstance(cell, RowParallelLinear)
    cell.lora_col_offset = tp_rank * in_local if row else 0
    # A frozen parameter, like ``lora_enabled``: an input of every compiled graph, loaded per layer by the layer
    # graphs, so new seeds reach the same graphs without recompiling.
    cell.lora_dropout_seed = Parameter(Tensor(np.int32(-1)), name=f"{name}.{DROPOUT_SEED}", requires_grad=False)


#: The suffix of an adapter's dropout seed parameter (a frozen int32 scalar; -1 = dropout off).
DROPOUT_SEED = "lora_dropout_seed"


def _switch(dtype: ms.Type, name: str) -> Parameter:
    """An adapted linear's ``lora_enabled``: a frozen scalar (1 = adapter on) multiplying its delta. A parameter, so
    the compiled graphs read it as an input (the layer graphs load it per layer like the weights) and one graph serves
    the adapted model and its base (``adapters_disabled``)."""
    return Parameter(Tensor(1.0, dtype), name=name, requires_grad=False)


class _Factor(nn.Cell):
    """One LoRA factor: a cell holding ``weight``, so its parameter is named ``...lora_A.weight`` as in PEFT."""

    def __init__(self, array: np.ndarray, dtype: ms.Type, name: str):
        super().__init__()
        self.weight = Parameter(Tensor(array, dtype), name=name, requires_grad=True)


def apply_lora(model: nn.Cell, spec: LoRASpec) -> List[str]:
    """Freeze ``model`` (a ``CausalLM`` or a shard of one) and attach ``spec``'s adapters (PEFT's init);
    returns the adapted module names. Only the adapters are trainable parameters afterwards."""
    if getattr(model, "lora_spec", None) is not None:
        raise MindRLHFError("apply_lora: the model already has LoRA adapters; apply them once (or load_adapter)")
    tp, tp_rank = model.shard.tp, model.shard.tp_rank
    targets = [(name, cell) for name, cell in _adaptable(model) if spec.matches(name)]
    if not targets:
        raise MindRLHFError(f"LoRA target_modules {spec.target_modules!r} match no decoder projection of this model; "
                            f"use names among {', '.join(PROJECTIONS)} or a regex over e.g. "
                            "'model.layers.0.self_attn.q_proj'")
    saved = saved_modules(model, spec)
    inside = [name for name, _ in saved if name.startswith("model.")]
    if inside:
        raise MindRLHFError(f"LoRA modules_to_save {list(spec.modules_to_save)!r} names {inside[0]!r}, a part of the "
                            "decoder; only heads outside the decoder layers (e.g. score) can be trained in full")
    for param in model.get_parameters():
        param.requires_grad = False
    for _, param in saved:  # trained in full beside the adapters (PEFT's ModulesToSaveWrapper)
        param.requires_grad = True
    for name, cell in targets:
        a_shape, b_shape = _full_shapes(cell, spec.r, tp)
        a, b = _local(cell, _init_array(f"{name}.lora_A.weight", a_shape, spec.seed),
                      np.zeros(b_shape, np.float32), tp, tp_rank)
        dtype = cell.weight.dtype
        cell.lora_A = _Factor(a, dtype, f"{name}.lora_A.weight")
        cell.lora_B = _Factor(b, dtype, f"{name}.lora_B.weight")
        _attach_dropout(cell, name, spec.dropout, tp, tp_rank)
        cell.lora_copy = CopyToTP(tp, model.shard.tp_group) if tp > 1 else None
        cell.lora_scaling = float(spec.scaling)
        cell.lora_enabled = _switch(dtype, f"{name}.lora_enabled")
        # Attaching a cell renames its parameters relative to the parent; give them the full model names.
        cell.lora_A.weight.name, cell.lora_B.weight.name = f"{name}.lora_A.weight", f"{name}.lora_B.weight"
        cell.lora_enabled.name = f"{name}.lora_enabled"
    model.lora_spec = spec
    model.sync_head_gradient()
    return [name for name, _ in targets]


def adapted_projections(layer: nn.Cell) -> Tuple[str, ...]:
    """The names (relative to ``layer``) of the projections of one decoder layer that carry an adapter."""
    return tuple(name for name, cell in layer.cells_and_names()
                 if isinstance(cell, (ColumnParallelLinear, RowParallelLinear)) and cell.lora_A is not None)


def adapt_like(template: nn.Cell, layer: nn.Cell) -> None:
    """Give ``template`` (a decoder layer built like ``layer``, e.g. the compiled layer graphs' template) adapters of
    ``layer``'s shapes, dtype and scaling, and freeze its base as ``apply_lora`` froze ``layer``'s: the template's
    factors are placeholders, a layer's own factors are loaded into them before each call."""
    cells = dict(template.cells_and_names())
    for param in template.get_parameters():
        param.requires_grad = False
    for name in adapted_projections(layer):
        source, target = dict(layer.cells_and_names())[name], cells[name]
        for which in ("lora_A", "lora_B"):
            weight = getattr(source, which).weight
            setattr(target, which, _Factor(np.zeros(weight.shape, np.float32), weight.dtype, f"{name}.{which}.weight"))
            getattr(target, which).weight.name = f"{name}.{which}.weight"
        # The tp copy holds no parameters: the template shares the layer's. The dropout seed is a parameter,
        # loaded per layer like the switch.
        target.lora_copy = source.lora_copy
        target.lora_dropout, target.lora_col_offset = source.lora_dropout, source.lora_col_offset
        target.lora_scaling = source.lora_scaling
        if source.lora_dropout_seed is not None:  # before the switch: the layer's parameter order (apply_lora's)
            target.lora_dropout_seed = Parameter(Tensor(np.int32(-1)), name=f"{name}.{DROPOUT_SEED}",
                                                 requires_grad=False)
            target.lora_dropout_seed.name = f"{name}.{DROPOUT_SEED}"
        target.lora_enabled = _switch(source.lora_enabled.dtype, f"{name}.lora_enabled")
        target.lora_enabled.name = f"{name}.lora_enabled"


def is_switch(name: str) -> bool:
    """Whether parameter ``name`` is an adapter's on/off switch or dropout seed (not a weight: no file holds it)."""
    return name.endswith(".lora_enabled") or name.endswith("." + DROPOUT_SEED)


def has_dropout(model: nn.Cell) -> bool:
    """Whether ``model``'s adapters have dropout (``lora_dropout`` > 0)."""
    return any(cell.lora_dropout_seed is not None for _, cell in lora_modules(model))


def dropout_seed(run_seed: int, step: int, dp_rank: int, micro_batch: int, module: str) -> int:
    """The non-negative int32 seed of one adapter's dropout mask: a hash of the run's seed, the optimizer step, the
    data-parallel replica, the micro-batch and the module (its name and PEFT task, so a PPO actor's and critic's
    masks differ). A pure function: a resumed run draws the masks an uninterrupted one draws."""
    words = [run_seed & 0xFFFFFFFF, step, dp_rank, micro_batch, zlib.crc32(module.encode())]
    return int(np.random.SeedSequence(words).generate_state(1)[0] & 0x7FFFFFFF)


def set_dropout_seeds(model: nn.Cell, step: Optional[int], dp_rank: int = 0, micro_batch: int = 0) -> None:
    """Switch adapter dropout on with the masks of (``step``, ``dp_rank``, ``micro_batch``) for the next forward and
    its backward, or off (``step`` None: seed -1, every multiplier exactly 1). Written in place, so the compiled
    graphs read the new seeds."""
    spec = model.lora_spec
    for name, cell in lora_modules(model):
        if cell.lora_dropout_seed is None:
            continue
        seed = -1 if step is None else dropout_seed(spec.seed, step, dp_rank, micro_batch, f"{spec.task_type}:{name}")
        cell.lora_dropout_seed.copy_(Tensor(np.int32(seed)))


@contextlib.contextmanager
def adapters_disabled(model: nn.Cell) -> Iterator[None]:
    """Within this block ``model`` computes as its base, bit for bit (PEFT's ``disable_adapter``): every adapter's
    switch is 0, so each delta is multiplied by 0 in the same compiled graphs. The reference of DPO with LoRA is the
    policy itself in this block: no second copy of the base."""
    switches = [cell.lora_enabled for _, cell in lora_modules(model)]
    for switch in switches:
        switch.copy_(Tensor(0.0, switch.dtype))  # in place: a compiled graph keeps reading the same storage
    try:
        yield
    finally:
        for switch in switches:
            switch.copy_(Tensor(1.0, switch.dtype))


def _require_whole(model: nn.Cell, what: str, fix: str) -> None:
    if model.shard.tp > 1 or model.shard.pp > 1:
        raise MindRLHFError(f"{what}: this model is one tp/pp shard; {fix} (on every rank: the shards are assembled "
                            "with a collective)")


def adapter_shapes(config, spec: LoRASpec) -> Dict[str, Tuple[int, ...]]:
    """Every adapter factor and module to save of the WHOLE model ``config`` describes with ``spec``'s adapters
    (all pipeline stages), by name, with its full (unsharded) shape, in model order: the same list on every rank,
    so the shards can be assembled tensor by tensor (``parallel.resharding.gather_adapter_weights``)."""
    from mindrlhf.models.family import COLUMN, ROW, split_kind

    out: Dict[str, Tuple[int, ...]] = {}
    shapes = config.expected_shapes()
    for name, shape in shapes.items():
        module = _module_of(name)
        if (name.endswith(".weight") and _LAYER_MODULE.fullmatch(module) and split_kind(name) in (COLUMN, ROW)
                and spec.matches(module)):
            out[f"{module}.lora_A.weight"] = (spec.r, shape[1])
            out[f"{module}.lora_B.weight"] = (shape[0], spec.r)
    for name, shape in shapes.items():
        module = _module_of(name)
        if not name.startswith("model.") and any(module == t or module.endswith("." + t) for t in spec.modules_to_save):
            out[name] = tuple(shape)
    return out


def adapter_weights(model: nn.Cell) -> Dict[str, np.ndarray]:
    """The adapters as float32 arrays under the model's names (``...q_proj.lora_A.weight``), and the modules to save
    (``score.weight``)."""
    out = {}
    for _, cell in lora_modules(model):
        for factor in (cell.lora_A, cell.lora_B):
            out[factor.weight.name] = factor.weight.value().astype(ms.float32).asnumpy()
    for name, param in saved_modules(model):
        out[name] = param.value().astype(ms.float32).asnumpy()
    return out


def set_adapter_weights(model: nn.Cell, tensors: Dict[str, np.ndarray], source: str = "adapter") -> None:
    """Copy full (unsharded) adapter arrays, by the model's names, into this shard's factors; every
    adapter must be given, with its full shape. The modules to save are set when given (an adapter trained
    without them leaves e.g. a new score head as it is)."""
    spec = getattr(model, "lora_spec", None)
    if spec is None:
        raise MindRLHFError(f"{source}: the model has no LoRA adapters to set; apply_lora or load_adapter first")
    tp, tp_rank = model.shard.tp, model.shard.tp_rank
    expected = set()
    for name, cell in lora_modules(model):
        a_shape, b_shape = _full_shapes(cell, spec.r, tp)
        keys = (f"{name}.lora_A.weight", f"{name}.lora_B.weight")
        expected.update(keys)
        for key, shape in zip(keys, (a_shape, b_shape)):
            if key not in tensors:
                raise MindRLHFError(f"{source}: no tensor for {key!r}; the adapter does not match this model "
                                    "(target_modules or architecture differ)")
            if tuple(tensors[key].shape) != shape:
                raise MindRLHFError(f"{source}: {key!r} has shape {tuple(tensors[key].shape)}, this model needs "
                                    f"{shape}; the adapter was trained on another architecture or rank")
        a, b = _local(cell, tensors[keys[0]], tensors[keys[1]], tp, tp_rank)
        cell.lora_A.weight.copy_(Tensor(np.ascontiguousarray(a), cell.lora_A.weight.dtype))
        cell.lora_B.weight.copy_(Tensor(np.ascontiguousarray(b), cell.lora_B.weight.dtype))
    for name, param in saved_modules(model):
        expected.add(name)
        if name in tensors:
            if tuple(tensors[name].shape) != tuple(param.shape):
                raise MindRLHFError(f"{source}: {name!r} has shape {tuple(tensors[name].shape)}, this model needs "
                                    f"{tuple(param.shape)}; the adapter was trained on another model")
            param.copy_(Tensor(np.ascontiguousarray(tensors[name]), param.dtype))
    unknown = sorted(set(tensors) - expected)
    if unknown:
        raise MindRLHFError(f"{source}: {len(unknown)} tensors match no adapted module of this model "
                            f"({', '.join(unknown[:3])}); the adapter is for another architecture")


def _merged(weight: np.ndarray, a: np.ndarray, b: np.ndarray, scaling: float) -> np.ndarray:
    """``W + scaling * B A`` as float32 (the product in float64, one rounding)."""
    return (weight + scaling * (b.astype(np.float64) @ a.astype(np.float64))).astype(np.float32)


def base_parameters(model: nn.Cell) -> Iterator[Tuple[str, Parameter]]:
    """The base model's parameters of an adapted ``model`` (HF names): all but the LoRA factors and switches."""
    for name, param in model.parameters_and_names():
        if ".lora_A." not in name and ".lora_B." not in name and not is_switch(name):
            yield name, param


def merge_into(base: Iterable[Tuple[str, np.ndarray]], adapters: Dict[str, np.ndarray], scaling: float
               ) -> Dict[str, np.ndarray]:
    """Whole base weights ``(HF name, float32 array)`` with each adapter of ``adapters`` (whole factors by the model's
    names, ``adapter_weights``' keys) merged into its projection: ``W + scaling * B A``. A module to save (score) is
    a parameter of the model: its trained value is the base's."""
    out = {}
    for name, value in base:
        module = _module_of(name)
        if f"{module}.lora_A.weight" in adapters and name.endswith(".weight"):
            value = _merged(value, adapters[f"{module}.lora_A.weight"], adapters[f"{module}.lora_B.weight"], scaling)
        out[name] = value
    return out


def merged_weights(model: nn.Cell) -> Dict[str, np.ndarray]:
    """The base model's weights (HF names, float32) with every adapter merged: ``W + scaling * B A``
    (a plain ``CausalLM`` of the same config loads them: a merged export). A tp/pp shard's whole merged model is
    ``parallel.resharding.gather_merged_weights`` (a collective)."""
    _require_whole(model, "merged_weights", "use parallel.resharding.gather_merged_weights(model, layout, rank)")
    return merged_shard_weights(model)


def merged_shard_weights(model: nn.Cell, changed_only: bool = False) -> Dict[str, np.ndarray]:
    """This shard's weights (HF names, float32, its own slices) with every adapter merged into its projection: what a
    plain ``CausalLM`` shard of the same layout loads to compute as the adapted one (GRPO's and PPO's merged sampler,
    ``lora_sampler merged``). The merge needs no collective: an adapter is split with its layer (a column-parallel
    B with the output rows, a row-parallel A with the input columns), so each shard's ``scaling * B A`` is its slice
    of the whole delta. ``changed_only``: just what an update changes (the merged projections and the modules to
    save; the rest of the base is frozen)."""
    adapters = dict(lora_modules(model))
    saved = {name for name, _ in saved_modules(model)}
    out = {}
    for name, param in model.parameters_and_names():
        if ".lora_A." in name or ".lora_B." in name or is_switch(name):
            continue
        module = name[:-len(".weight")] if name.endswith(".weight") else None
        if changed_only and module not in adapters and name not in saved:
            continue
        value = param.value().astype(ms.float32).asnumpy()
        if module in adapters:
            cell = adapters[module]
            value = _merged(value, cell.lora_A.weight.value().astype(ms.float32).asnumpy(),
                            cell.lora_B.weight.value().astype(ms.float32).asnumpy(), cell.lora_scaling)
        out[name] = value
    return out


def merge_adapter(specs: Dict[str, Tuple[Tuple[int, ...], str]], stream: Iterable[Tuple[str, np.ndarray]],
                  spec: LoRASpec, adapter: Dict[str, np.ndarray], source: str = "adapter"
                  ) -> Iterator[Tuple[str, np.ndarray]]:
    """A base model's weights streamed as ``(HF name, float32 array)`` with ``adapter`` (``read_adapter``'s
    tensors) merged into them, one tensor at a time (no model is built: any size fits). ``specs`` (name ->
    (shape, dtype), what ``hf_io.WeightSource.specs`` gives) is checked first, so a mismatch is one error
    before anything is written: every adapter needs its base weight, of shape (B's rows, A's columns).

    The tensors of ``spec.modules_to_save`` (a reward model's or critic's ``score.weight``, trained in full) replace
    the base's tensor of that name, of the same shape, or, where the base has none (a causal LM under a SEQ_CLS
    adapter: the caller drops its ``lm_head`` and writes a classifier's config), follow the stream."""
    pairs, whole = {}, {}
    for key in adapter:
        module, sep, factor = key.rpartition(".lora_")
        if sep and factor in ("A.weight", "B.weight"):
            pairs.setdefault(module, {})[factor[0]] = adapter[key]
        elif _is_saved(key, spec.modules_to_save):
            whole[key] = np.asarray(adapter[key], np.float32)
        else:
            raise MindRLHFError(f"{source}: tensor {key!r} is neither a LoRA factor (lora_A / lora_B) nor in "
                                f"modules_to_save {list(spec.modules_to_save)}; the adapter_config.json does not "
                                "describe this adapter file")
    for name, array in sorted(whole.items()):
        base = specs.get(name)
        if base is not None and tuple(base[0]) != array.shape:
            raise MindRLHFError(f"{source}: {name} has shape {array.shape} but the model's {name} has "
                                f"{tuple(base[0])}; merge it into the model it was trained on")
    for module, factors in sorted(pairs.items()):  # the first mismatch in name order
        if set(factors) != {"A", "B"}:
            raise MindRLHFError(f"{source}: {module} has lora_{'AB'.replace(''.join(factors), '')} missing; "
                                "the adapter file is incomplete")
        base = specs.get(f"{module}.weight")
        want = (factors["B"].shape[0], factors["A"].shape[1])
        if base is None or tuple(base[0]) != want:
            found = "is not in the model" if base is None else f"has shape {tuple(base[0])}"
            raise MindRLHFError(f"{source}: the adapter of {module} needs a {want} weight, but {module}.weight "
                                f"{found}; merge it into the model it was trained on")

    def merged() -> Iterator[Tuple[str, np.ndarray]]:
        for name, array in stream:
            if name in whole:
                yield name, whole[name]
                continue
            factors = pairs.get(name[:-len(".weight")]) if name.endswith(".weight") else None
            yield name, (array if factors is None else _merged(array, factors["A"], factors["B"], spec.scaling))
        for name in sorted(set(whole) - set(specs)):
            yield name, whole[name]

    return merged()


# ---------------------------------------------------------------------------------------------
# PEFT's adapter directory
# ---------------------------------------------------------------------------------------------
#: PEFT LoraConfig keys whose non-default values this implementation cannot honour, with the default.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none",
                "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
                "exclude_modules": None, "target_parameters": None, "use_qalora": False, "lora_bias": False,
                "trainable_token_indices": None, "megatron_config": None, "layer_replication": None,
                "alora_invocation_tokens": None, "use_bdlora": None, "arrow_config": None, "kasa_config": None,
                "monteclora_config": None, "velora_config": None}


def peft_config(spec: LoRASpec, base_model_name_or_path: Optional[str] = None) -> Dict[str, Any]:
    """``adapter_config.json`` contents for ``spec`` (PEFT's keys; peft fills any it does not find)."""
    targets = spec.target_modules if isinstance(spec.target_modules, str) else sorted(spec.target_modules)
    config = dict(spec.extra)
    config.update({
        "peft_type": "LORA", "task_type": spec.task_type, "base_model_name_or_path": base_model_name_or_path,
        "modules_to_save": list(spec.modules_to_save) or None,
        "r": spec.r, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "target_modules": targets,
        "use_rslora": spec.use_rslora, "init_lora_weights": True, "inference_mode": True, "revision": None,
        **_UNSUPPORTED})
    return config


def spec_from_peft(config: Dict[str, Any], source: str = ADAPTER_CONFIG) -> LoRASpec:
    """The ``LoRASpec`` of a PEFT ``adapter_config.json``; settings this implementation lacks are refused."""
    if config.get("peft_type") != "LORA":
        raise MindRLHFError(f"{source}: peft_type {config.get('peft_type')!r} is not LORA; only LoRA adapters "
                            "can be loaded")
    for key, default in _UNSUPPORTED.items():
        value = config.get(key, default)
        if value != default and not (not default and not value):  # None, {}, [] and False all mean "off"
            raise MindRLHFError(f"{source}: {key}={value!r} is not supported by mindrlhf's LoRA; train the adapter "
                                f"with {key}={default!r}")
    targets = config.get("target_modules")
    if targets is None:
        raise MindRLHFError(f"{source}: target_modules is missing; give the adapted module names")
    try:
        return LoRASpec(r=int(config["r"]), alpha=float(config.get("lora_alpha", 8)),
                        dropout=float(config.get("lora_dropout", 0.0)),
                        target_modules=targets if isinstance(targets, str) else tuple(targets),
                        use_rslora=bool(config.get("use_rslora", False)),
                        modules_to_save=tuple(config.get("modules_to_save") or ()),
                        task_type=str(config.get("task_type") or "CAUSAL_LM"),
                        extra={k: v for k, v in config.items() if k not in _UNSUPPORTED})
    except KeyError as err:
        raise MindRLHFError(f"{source}: key {err} is missing; is this a PEFT adapter_config.json?") from None


def save_adapter(model: nn.Cell, out_dir: Union[str, Path], base_model_name_or_path: Optional[str] = None,
                 weights: Optional[Dict[str, np.ndarray]] = None) -> Path:
    """Write ``model``'s adapters as a PEFT adapter directory (``peft.PeftModel.from_pretrained`` loads
    it onto the transformers model); returns the directory. ``weights``: the whole model's adapters when ``model``
    is a tp/pp shard (``parallel.resharding.gather_adapter_weights``, a collective every rank calls before one rank
    writes)."""
    from mindrlhf.checkpoint.hf_io import StreamingSafetensorsWriter, write_json_atomic

    spec = getattr(model, "lora_spec", None)
    if spec is None:
        raise MindRLHFError("save_adapter: the model has no LoRA adapters; apply_lora or load_adapter first")
    if weights is None:
        _require_whole(model, "save_adapter",
                       "pass weights=parallel.resharding.gather_adapter_weights(model, layout, rank)")
        weights = adapter_weights(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writer = StreamingSafetensorsWriter(out / ADAPTER_WEIGHTS, {"format": "pt"})
    try:
        for name, array in sorted(weights.items()):
            writer.add(PEFT_PREFIX + name, np.ascontiguousarray(array, np.float32), "float32")
        writer.close()
    except BaseException:
        writer.abort()
        raise
    write_json_atomic(out / ADAPTER_CONFIG, peft_config(spec, base_model_name_or_path))
    return out


def adapter_files(model: nn.Cell, base_model_name_or_path: Optional[str] = None,
                  weights: Optional[Dict[str, np.ndarray]] = None) -> Dict[str, bytes]:
    """The files of ``save_adapter``'s folder as bytes, by file name (a training checkpoint holds them, so its
    folder is a PEFT adapter folder too); ``weights`` as for ``save_adapter``."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = save_adapter(model, tmp, base_model_name_or_path, weights)
        return {name: (out / name).read_bytes() for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)}


def read_adapter(adapter_dir: Union[str, Path]) -> Tuple[LoRASpec, Dict[str, np.ndarray]]:
    """A PEFT adapter directory's spec and its tensors (float32, the model's names: the PEFT prefix removed)."""
    from mindrlhf.checkpoint.hf_io import iter_safetensors, read_json
    from mindrlhf.checkpoint.manifest import verify_files

    path = Path(adapter_dir)
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise MindRLHFError(f"{path}: not a PEFT adapter directory (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}); "
                            "save it with peft's save_pretrained or mindrlhf.models.lora.save_adapter")
    verify_files([path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS])  # a training checkpoint's: against its manifest
    spec = spec_from_peft(read_json(path / ADAPTER_CONFIG), str(path / ADAPTER_CONFIG))
    tensors = {}
    for name, array in iter_safetensors(path / ADAPTER_WEIGHTS):
        if not name.startswith(PEFT_PREFIX):
            raise MindRLHFError(f"{path / ADAPTER_WEIGHTS}: tensor {name!r} lacks PEFT's {PEFT_PREFIX!r} prefix; "
                                "is it a PEFT adapter of a causal LM?")
        tensors[name[len(PEFT_PREFIX):]] = np.asarray(array, np.float32)
    return spec, tensors


def load_adapter(model: nn.Cell, adapter_dir: Union[str, Path]) -> LoRASpec:
    """Attach the adapters of a PEFT adapter directory to ``model`` (a base ``CausalLM`` or a shard of it)
    and return their spec."""
    spec, tensors = read_adapter(adapter_dir)
    apply_lora(model, spec)
    set_adapter_weights(model, tensors, str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    return spec


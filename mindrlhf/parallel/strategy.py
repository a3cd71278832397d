"""MindSpore parallel-strategy files for a :class:`ParallelLayout`: write, read back, check.

On CPU MindSpore cannot compile ``semi_auto_parallel`` graphs, so it never writes strategy files
for us; we write them from the layout instead and hand them to ``mindspore.transform_checkpoints``
(see ``mindrlhf.tools.transform_checkpoint``). Format facts, checked on MindSpore 2.10 CPU:

* A strategy file is a ``ParallelStrategyMap`` protobuf (any name not ending in ``.json``) or the
  equivalent JSON (``.json``); MindSpore picks the parser from the suffix, and so do we.
* Each parameter has an entry with ``dev_matrix`` (the device arrangement of its pipeline stage;
  ours is ``[dp, tp]``), ``tensor_map`` (one number per tensor dim: ``-1`` = not split, ``k`` =
  split over device-matrix axis ``k`` *counted from the right*, so ``0`` is tp), ``field``,
  ``opt_weight_shard_step`` / ``opt_weight_shard_size`` (optimizer sharding; 0 here),
  ``param_split_shape`` / ``indices_offset`` (uneven manual embedding splits; empty here) and, in
  JSON, ``tensor_shape`` (the full shape). In protobuf ``field``, ``opt_weight_shard_*`` and
  ``current_stage`` are proto2 *required* and ``param_split_shape`` / ``indices_offset`` must be
  present (possibly empty) or ``transform_checkpoints`` fails with "list index out of range"; the
  JSON reader needs ``field`` and ``opt_weight_shard_*`` too.
* Pipeline parallelism: each stage compiles its own file (entries unprefixed, a
  ``parallel_strategy_item`` carrying the stage number); ``mindspore.parallel.merge_pipeline_strategys``
  merges them into one file whose entries are named ``"{stage}-{param}"``. ``transform_checkpoints``
  wants the merged file. ``write_strategy(..., stage=None)`` writes the merged file directly
  (unprefixed when ``pp == 1``); ``stage=s`` writes stage ``s``'s file in the compiled form.
* ``transform_checkpoints`` does not check a strategy against the checkpoint: a parameter absent
  from the strategy is copied whole to every rank, and an indivisible split fails deep in C++.
  Hence :func:`check_strategy`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from mindrlhf.errors import MindRLHFError
from mindrlhf.models.config import DecoderConfig
from mindrlhf.parallel.layout import ParallelLayout
from mindrlhf.parallel.sharding import shard_spec

PathLike = Union[str, "os.PathLike[str]"]
LAYOUT_NODE = "mindrlhf.ParallelLayout"  # name of the placeholder operator strategy we record


@dataclass(frozen=True)
class StrategyEntry:
    """One parameter's layout as MindSpore stores it (plus the pipeline stages that hold it)."""

    dev_matrix: Tuple[int, ...]
    tensor_map: Tuple[int, ...]
    stages: Tuple[int, ...] = (0,)
    tensor_shape: Optional[Tuple[int, ...]] = None  # JSON only; protobuf has no shape
    field: int = 0
    opt_weight_shard_step: int = 0
    opt_weight_shard_size: int = 0
    param_split_shape: Tuple[int, ...] = ()
    indices_offset: Tuple[int, ...] = ()

    def splits(self) -> Tuple[int, ...]:
        """Number of slices along each tensor dimension."""
        return tuple(1 if m < 0 else self.dev_matrix[len(self.dev_matrix) - 1 - m] for m in self.tensor_map)

    def to_json(self) -> Dict[str, object]:
        d: Dict[str, object] = {"dev_matrix": list(self.dev_matrix), "tensor_map": list(self.tensor_map)}
        if self.tensor_shape is not None:
            d["tensor_shape"] = list(self.tensor_shape)
        d.update(field=self.field, opt_weight_shard_step=self.opt_weight_shard_step,
                 opt_weight_shard_size=self.opt_weight_shard_size,
                 param_split_shape=list(self.param_split_shape), indices_offset=list(self.indices_offset))
        return d


@dataclass
class Strategy:
    """A strategy file read back: ``{param: StrategyEntry}`` with pipeline stages folded in."""

    path: Path
    format: str  # "json" or "protobuf"
    entries: Dict[str, StrategyEntry]
    stages: Tuple[int, ...] = field(default=(0,))

    @property
    def stage_size(self) -> int:
        """Devices per pipeline stage (product of the device matrix)."""
        first = next(iter(self.entries.values()))
        n = 1
        for d in first.dev_matrix:
            n *= d
        return n

    @property
    def world_size(self) -> int:
        return self.stage_size * len(self.stages)


def strategy_format(path: PathLike) -> str:
    """``json`` for a ``.json`` name, else ``protobuf`` (MindSpore's rule)."""
    return "json" if str(path).endswith(".json") else "protobuf"


def strategy_entries(config: DecoderConfig, layout: ParallelLayout) -> Dict[str, StrategyEntry]:
    """The entry of every model parameter under ``layout`` (model order)."""
    layout.validate(config)
    dev_matrix = (layout.dp, layout.tp)
    entries: Dict[str, StrategyEntry] = {}
    for name, shape in config.expected_shapes().items():
        dim = shard_spec(name, config, layout)
        tensor_map = tuple(0 if d == dim else -1 for d in range(len(shape)))
        entries[name] = StrategyEntry(dev_matrix, tensor_map, layout.param_stages(name, config), tuple(shape))
    return entries


def _layout_item(layout: ParallelLayout, stage: int) -> Tuple[str, Dict[str, object]]:
    # A placeholder operator strategy: merge_pipeline_strategys reads the stage from the first one.
    return f"{LAYOUT_NODE}.stage{stage}", {"stage": stage, "parallel_strategy": [[layout.dp, layout.tp, layout.pp]]}


def write_strategy(path: PathLike, config: DecoderConfig, layout: ParallelLayout, *,
                   stage: Optional[int] = None) -> Path:
    """Write the strategy file of ``layout`` for ``config`` (JSON if ``path`` ends in ``.json``, else protobuf).

    ``stage=None``: one file for all stages (merged naming ``"{stage}-{param}"`` when ``pp > 1``),
    what ``transform_checkpoints`` takes. ``stage=s``: only stage ``s``'s parameters, unprefixed,
    like the file MindSpore compiles on that stage (merge them with ``merge_pipeline_strategys``).
    """
    path = Path(path)
    entries = strategy_entries(config, layout)
    if stage is not None and not 0 <= stage < layout.pp:
        raise MindRLHFError(f"stage {stage} is outside the layout {layout} (0..{layout.pp - 1})")
    stages = range(layout.pp) if stage is None else [stage]
    prefixed = stage is None and layout.pp > 1
    items: List[Tuple[str, StrategyEntry]] = []
    for s in stages:
        for name, e in entries.items():
            if s in e.stages:
                items.append((f"{s}-{name}" if prefixed else name, e))
    current = 0 if stage is None else stage
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    if strategy_format(path) == "json":
        doc = {"current_stage": current,
               "parallel_strategy_item": dict(_layout_item(layout, s) for s in stages),
               "parallel_layout_item": {n: e.to_json() for n, e in items}}
        tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    else:
        from mindspore.train import node_strategy_pb2 as pb

        msg = pb.ParallelStrategyMap()
        msg.current_stage = current
        for s in stages:
            node, strat = _layout_item(layout, s)
            item = msg.parallel_strategy_item.add()
            item.node_name = node
            item.parallel_strategys.stage = s
            for dims in strat["parallel_strategy"]:
                item.parallel_strategys.parallel_strategy.add().dim.extend(dims)
        for name, e in items:
            item = msg.parallel_layout_item.add()
            item.param_name = name
            lay = item.parallel_layouts
            lay.dev_matrix.add().dim.extend(e.dev_matrix)
            lay.tensor_map.add().dim.extend(e.tensor_map)
            lay.param_split_shape.add().dim.extend(e.param_split_shape)  # must exist, even empty
            lay.indices_offset.add().dim.extend(e.indices_offset)
            lay.field = e.field
            lay.opt_weight_shard_step = e.opt_weight_shard_step
            lay.opt_weight_shard_size = e.opt_weight_shard_size
        tmp.write_bytes(msg.SerializeToString())
    os.replace(tmp, path)
    return path


def _split_stage(name: str) -> Tuple[int, str]:
    head, sep, rest = name.partition("-")
    if sep and head.isdigit():
        return int(head), rest
    return 0, name


def read_strategy(path: PathLike) -> Strategy:
    """Read a strategy file (ours or MindSpore's), folding ``"{stage}-{param}"`` entries into stages."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        raise MindRLHFError(f"strategy file {path} not found or empty; pass an existing strategy file "
                            "(or --layout dp,tp,pp to write one)")
    raw: List[Tuple[str, StrategyEntry]] = []
    fmt = strategy_format(path)
    if fmt == "json":
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            items = doc["parallel_layout_item"]
            for name, it in items.items():
                raw.append((name, StrategyEntry(
                    tuple(int(x) for x in it["dev_matrix"]), tuple(int(x) for x in it["tensor_map"]),
                    tensor_shape=tuple(int(x) for x in it["tensor_shape"]) if "tensor_shape" in it else None,
                    field=int(it["field"]), opt_weight_shard_step=int(it["opt_weight_shard_step"]),
                    opt_weight_shard_size=int(it["opt_weight_shard_size"]),
                    param_split_shape=tuple(int(x) for x in it.get("param_split_shape", [])),
                    indices_offset=tuple(int(x) for x in it.get("indices_offset", [])))))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise MindRLHFError(f"strategy file {path}: not a MindSpore JSON strategy ({type(err).__name__}: {err}); "
                                "regenerate it with --layout") from None
    else:
        from google.protobuf.message import DecodeError
        from mindspore.train import node_strategy_pb2 as pb

        msg = pb.ParallelStrategyMap()
        try:
            msg.ParseFromString(path.read_bytes())
        except (DecodeError, OSError) as err:
            raise MindRLHFError(f"strategy file {path}: not a ParallelStrategyMap protobuf ({err}); JSON strategy "
                                "files must end in .json") from None
        for item in msg.parallel_layout_item:
            lay = item.parallel_layouts
            if len(lay.dev_matrix) != 1 or len(lay.tensor_map) != 1:
                raise MindRLHFError(f"strategy file {path}: entry {item.param_name} uses a multi-axis layout "
                                    "(several dev_matrix/tensor_map rows), which mindrlhf does not support")
            raw.append((item.param_name, StrategyEntry(
                tuple(lay.dev_matrix[0].dim), tuple(lay.tensor_map[0].dim),
                field=lay.field, opt_weight_shard_step=lay.opt_weight_shard_step,
                opt_weight_shard_size=lay.opt_weight_shard_size,
                param_split_shape=tuple(lay.param_split_shape[0].dim) if len(lay.param_split_shape) else (),
                indices_offset=tuple(lay.indices_offset[0].dim) if len(lay.indices_offset) else ())))
    if not raw:
        raise MindRLHFError(f"strategy file {path} has no parameter entries (parallel_layout_item); "
                            "regenerate it with --layout")
    entries: Dict[str, StrategyEntry] = {}
    for prefixed, e in raw:
        stage, name = _split_stage(prefixed)
        if name in entries:
            old = entries[name]
            if (old.dev_matrix, old.tensor_map) != (e.dev_matrix, e.tensor_map):
                raise MindRLHFError(f"strategy file {path}: parameter {name} has different layouts on stages "
                                    f"{old.stages} and {stage}; mindrlhf needs one layout per parameter")
            entries[name] = StrategyEntry(**{**old.__dict__, "stages": tuple(sorted(set(old.stages) | {stage}))})
        else:
            entries[name] = StrategyEntry(**{**e.__dict__, "stages": (stage,)})
    stages = tuple(sorted({s for e in entries.values() for s in e.stages}))
    if stages != tuple(range(len(stages))):
        raise MindRLHFError(f"strategy file {path} holds pipeline stages {list(stages)}, not 0..{len(stages) - 1}; "
                            "merge the files of all stages (mindspore.parallel.merge_pipeline_strategys)")
    return Strategy(path, fmt, entries, stages)


def check_strategy(strategy: Strategy, config: DecoderConfig, *, config_name: str = "the config") -> None:
    """Raise a one-line ``MindRLHFError`` unless ``strategy`` describes exactly this model's parameters.

    Compares names (first missing / unexpected one), ``tensor_shape`` where recorded (JSON), that
    every split divides its dimension, that tensor maps fit the shapes, and that all entries agree on
    the devices per stage.
    """
    src = f"strategy file {strategy.path}"
    shapes = config.expected_shapes()
    fix = (f"it was written for another model; regenerate it for {config_name} "
           "(--layout dp,tp,pp --config …) or pass the matching --config")
    for name, want in shapes.items():  # model order: report the first difference
        e = strategy.entries.get(name)
        if e is None:
            continue
        if e.tensor_shape is not None and tuple(e.tensor_shape) != tuple(want):
            raise MindRLHFError(f"{src}: parameter {name} has tensor_shape {tuple(e.tensor_shape)} but "
                                f"{config_name} implies {tuple(want)}; {fix}")
    missing = [n for n in shapes if n not in strategy.entries]
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MindRLHFError(f"{src}: no entry for parameter {missing[0]} {tuple(shapes[missing[0]])}{more} "
                            f"of {config_name}; {fix}")
    unexpected = [n for n in strategy.entries if n not in shapes]
    if unexpected:
        more = f" (+{len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise MindRLHFError(f"{src}: entry for parameter {unexpected[0]}{more} which {config_name} does not "
                            f"have; {fix}")
    size = strategy.stage_size
    for name, want in shapes.items():
        e = strategy.entries[name]
        n = 1
        for d in e.dev_matrix:
            n *= d
        if n != size:
            raise MindRLHFError(f"{src}: parameter {name} has device matrix {list(e.dev_matrix)} ({n} devices) but "
                                f"other entries use {size} devices per stage; the file is inconsistent")
        if len(e.tensor_map) != len(want) or any(m >= len(e.dev_matrix) for m in e.tensor_map):
            raise MindRLHFError(f"{src}: parameter {name} has tensor_map {list(e.tensor_map)} which does not fit "
                                f"shape {tuple(want)} and device matrix {list(e.dev_matrix)}; {fix}")
        for dim, (size_d, parts) in enumerate(zip(want, e.splits())):
            if size_d % parts:
                raise MindRLHFError(f"{src}: parameter {name} {tuple(want)} dim {dim} of size {size_d} cannot be "
                                    f"split into {parts} equal parts; use a layout that divides it")
        if e.opt_weight_shard_size > 1 or e.param_split_shape:
            raise MindRLHFError(f"{src}: parameter {name} uses optimizer sharding or a manual split, which the "
                                "mindrlhf checkpoint tools do not support; transform it with MindSpore directly")


def local_shape(entry: StrategyEntry, full_shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """Shape of one device's slice of a parameter under ``entry``."""
    return tuple(s // p for s, p in zip(full_shape, entry.splits()))


def layout_of(strategy: Strategy, config: DecoderConfig) -> Optional[ParallelLayout]:
    """The :class:`ParallelLayout` whose strategy ``strategy`` is exactly, else ``None``.

    ``None`` means a strategy mindrlhf did not write (e.g. compiled by MindSpore on Ascend); such
    files still work with ``transform_checkpoints`` but not with the numpy sharding.
    """
    first = next(iter(strategy.entries.values()))
    if len(first.dev_matrix) != 2:
        return None
    dp, tp = first.dev_matrix
    try:
        layout = ParallelLayout(dp=dp, tp=tp, pp=len(strategy.stages)).validate(config)
        expected = strategy_entries(config, layout)
    except MindRLHFError:
        return None
    for name, e in expected.items():
        got = strategy.entries.get(name)
        if got is None or (got.dev_matrix, got.tensor_map, got.stages) != (e.dev_matrix, e.tensor_map, e.stages):
            return None
    if set(strategy.entries) != set(expected):
        return None
    return layout


__all__ = ["StrategyEntry", "Strategy", "strategy_entries", "write_strategy", "read_strategy", "check_strategy",
           "layout_of", "local_shape", "strategy_format"]

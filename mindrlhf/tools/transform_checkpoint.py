"""Offline checkpoint sharding: full ↔ sharded ↔ another layout, via MindSpore's transform.

Full checkpoint → sharded for a layout (the strategy file is written for you)::

    mindrlhf-transform-checkpoint --src_checkpoint model.ckpt --dst_checkpoint out/ --layout 1,2,2

Sharded → another layout / → one full file::

    mindrlhf-transform-checkpoint --src_checkpoint out/ --dst_checkpoint infer/ --layout 2,2,1
    mindrlhf-transform-checkpoint --src_checkpoint out/ --dst_checkpoint full/ --merge

Or with strategy files made elsewhere: ``--dst_strategy FILE`` (and ``--src_strategy FILE`` for a
sharded source; a directory of per-stage files is merged with ``merge_pipeline_strategys``).

The source is a MindSpore ``.ckpt``/``.safetensors`` file or an HF directory (config next to it,
or ``--config``), or a sharded directory ``SRC/rank_{r}/*.ckpt`` (MindSpore's layout: the last
``.ckpt`` of a rank directory in name order is used). A sharded source's strategy defaults to the
``SRC/strategy.json``/``SRC/strategy.ckpt`` this tool writes. Output, MindSpore's convention::

    DST/rank_{r}/<prefix>{r}.ckpt     one per destination rank (--merge: DST/rank_0/<prefix>0.ckpt)
    DST/strategy.json|.ckpt           the destination strategy (reuse it as --src_strategy)
    DST/config.json, DST/rank_{r}/config.json   so every rank file loads with ``open_weights``

Engines. ``mindspore`` (the default) does the slicing with ``mindspore.transform_checkpoint_by_rank``
— the per-rank form of ``mindspore.transform_checkpoints`` (same files, same names; we call it rank
by rank for a progress bar and because ``transform_checkpoints`` deep-copies every loaded source
tensor once per destination rank). It reads only ``.ckpt``: a full ``.safetensors``/HF source is
first streamed into a temporary ``.ckpt`` inside DST (one extra copy on disk). ``numpy`` uses
``mindrlhf.parallel.sharding`` (``rank_state``/``reshard``) and handles what MindSpore's ``.ckpt``
path cannot — sharded ``.safetensors`` sources — but only for strategies of a
:class:`ParallelLayout` (``--layout`` or files this tool wrote); ``auto`` picks ``numpy`` exactly
for those sources. Both produce bit-identical tensors (tested); dtypes (bf16/fp16/fp32) are kept.

Checks before anything is written: the strategies describe this model (names, shapes,
divisibility — MindSpore itself copies unknown parameters whole and fails deep in C++ on an
indivisible split), the source tensors match the config, every source rank is present. Nothing
is written into the source directory; results are assembled in ``DST/.staging-*`` and moved into
place at the end, so a failed run leaves DST as it was.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from mindrlhf.checkpoint import hf_io
from mindrlhf.checkpoint.manifest import verify_files
from mindrlhf.errors import MindRLHFError
from mindrlhf.models.config import DecoderConfig
from mindrlhf.parallel import sharding
from mindrlhf.parallel.layout import ParallelLayout
from mindrlhf.parallel.strategy import Strategy, check_strategy, layout_of, local_shape, read_strategy, write_strategy
from mindrlhf.utils.cli import run_cli
from mindrlhf.utils.fs import is_inside

STRATEGY_NAMES = ("strategy.json", "strategy.ckpt")
_DTYPE_OF_CODE = hf_io.DTYPE_OF_SAFETENSORS_CODE
_CODE_OF_DTYPE = hf_io.SAFETENSORS_CODE


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(
        prog="mindrlhf-transform-checkpoint",
        description="Shard a full MindSpore/HF checkpoint for a dp/tp/pp layout, re-shard a sharded checkpoint "
                    "for another layout, or merge shards into one full checkpoint (uses "
                    "mindspore.transform_checkpoints' machinery; writes DST/rank_{r}/<prefix>{r}.ckpt).")
    p.add_argument("--src_checkpoint", required=True,
                   help="source: a full .ckpt/.safetensors file (config.json next to it), an HF model directory, "
                        "or a sharded directory with rank_0/, rank_1/, … holding .ckpt files")
    p.add_argument("--dst_checkpoint", required=True,
                   help="output directory; receives rank_{r}/<prefix>{r}.ckpt, strategy and config.json "
                        "(must not be inside the source directory)")
    p.add_argument("--dst_strategy", default=None,
                   help="destination strategy file (MindSpore protobuf, or JSON ending in .json) or a directory "
                        "of per-pipeline-stage files to merge; alternative to --layout / --merge")
    p.add_argument("--src_strategy", default=None,
                   help="strategy of a sharded source (file or directory of per-stage files); default: "
                        "SRC/strategy.json or SRC/strategy.ckpt written by this tool")
    p.add_argument("--layout", default=None,
                   help="destination layout dp,tp,pp (e.g. 1,2,2): writes its strategy file and uses it; "
                        "alternative to --dst_strategy / --merge")
    p.add_argument("--merge", action="store_true",
                   help="merge a sharded source into one full checkpoint (DST/rank_0/<prefix>0.ckpt)")
    p.add_argument("--config", default=None,
                   help="model config.json (or its directory); default: next to the source checkpoint "
                        "(SRC/config.json for a sharded source)")
    p.add_argument("--prefix", default="checkpoint_",
                   help="output file name prefix: rank r is written to rank_{r}/<prefix>{r}.ckpt "
                        "(default: checkpoint_)")
    p.add_argument("--strategy_format", choices=("json", "protobuf"), default="json",
                   help="format of the strategy file written for --layout: json (strategy.json, records shapes) "
                        "or protobuf (strategy.ckpt, ParallelStrategyMap); default json")
    p.add_argument("--engine", choices=("auto", "mindspore", "numpy"), default="auto",
                   help="mindspore: mindspore.transform_checkpoint_by_rank; numpy: mindrlhf.parallel.sharding "
                        "(layouts only, any source format); auto: mindspore unless the shards are .safetensors")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the rank_*/ directories, strategy and config already in --dst_checkpoint")
    p.add_argument("--no_progress", action="store_true", help="do not show the progress bar")
    return p


# ---------------------------------------------------------------------------------------------
@dataclass
class Source:
    """What we are reading: kind ``full`` (one file / HF dir) or ``sharded`` (``rank_{r}`` dirs)."""

    path: Path
    kind: str
    input_dir: Path  # never written into
    rank_files: Dict[int, Path]  # sharded: rank -> chosen file


def _rank_dirs(path: Path) -> Dict[int, Path]:
    out = {}
    for d in glob.glob(os.path.join(str(path), "rank_[0-9]*")):
        suffix = os.path.basename(d)[len("rank_"):]
        if suffix.isdigit() and os.path.isdir(d):
            out[int(suffix)] = Path(d)
    return out


def _open_source(path: Path) -> Source:
    if not path.exists():
        raise MindRLHFError(f"--src_checkpoint {path}: not found; pass a .ckpt/.safetensors file, an HF model "
                            "directory or a sharded directory with rank_*/ subdirectories")
    if path.is_file():
        if path.suffix.lower() not in (".ckpt", ".safetensors"):
            raise MindRLHFError(f"--src_checkpoint {path}: must end in .ckpt or .safetensors")
        verify_files([path])  # a training checkpoint's policy.ckpt: checked against its manifest
        return Source(path, "full", path.parent, {})
    ranks = _rank_dirs(path)
    if not ranks:
        if (path / "config.json").is_file() and hf_io.hf_safetensors_files(path):
            verify_files(hf_io.model_files(path))
            return Source(path, "full", path, {})
        raise MindRLHFError(f"--src_checkpoint {path}: a directory without rank_*/ subdirectories or HF "
                            "safetensors; pass a checkpoint file, an HF directory or a sharded directory")
    files: Dict[int, Path] = {}
    for r, d in sorted(ranks.items()):
        ckpts = sorted(d.glob("*.ckpt")) or sorted(d.glob("*.safetensors"))
        if not ckpts:
            raise MindRLHFError(f"--src_checkpoint {path}: {d} holds no .ckpt/.safetensors file; every rank "
                                "directory needs its shard")
        files[r] = ckpts[-1]  # MindSpore's rule: the last file in name order
    verify_files(files.values())
    return Source(path, "sharded", path, files)


def _load_config(args: argparse.Namespace, src: Source) -> Tuple[DecoderConfig, Dict[str, Any], Path]:
    if args.config:
        cfg = Path(args.config)
        cfg = cfg / "config.json" if cfg.is_dir() else cfg
    elif src.kind == "full" and src.path.is_dir():
        cfg = src.path / "config.json"
    elif src.kind == "full":
        cfg = hf_io.ms_config_path(src.path)
    else:
        cfg = next((c for c in (src.path / "config.json", src.path / "rank_0" / "config.json") if c.is_file()),
                   src.path / "config.json")
    if not cfg.is_file():
        raise MindRLHFError(f"model config {cfg} not found; pass --config with the model's config.json")
    raw = hf_io.read_json(cfg)
    return DecoderConfig.from_hf_dict(raw, source=str(cfg)), raw, cfg


def _resolve_strategy(arg: str, staging: Path, tag: str, flag: str) -> Path:
    """A strategy file; a directory of per-stage files is merged by MindSpore into ``staging``."""
    path = Path(arg)
    if path.is_dir():
        import mindspore as ms

        files = sorted(path.glob("*.ckpt")) + sorted(path.glob("*.json"))
        if not files:
            raise MindRLHFError(f"{flag} {path}: directory holds no strategy files (*.ckpt or *.json)")
        ext = ".json" if files[0].suffix == ".json" else ".ckpt"
        merged = staging / f"{tag}_merged_strategy{ext}"
        try:
            ms.parallel.merge_pipeline_strategys(str(path), str(merged))
        except (ValueError, TypeError, RuntimeError) as err:
            raise MindRLHFError(f"{flag} {path}: MindSpore cannot merge these per-stage strategy files ({err})") \
                from None
        return merged
    if not path.is_file():
        raise MindRLHFError(f"{flag} {path}: strategy file not found")
    return path


def _check_full_source(src: Source, config: Dict[str, Any], cfg_path: Path) -> Tuple[hf_io.WeightSource, List[str]]:
    """Open a full source with the given config (wherever it lives) and check its tensors against it."""
    path = src.path
    if path.is_dir():
        source = hf_io.WeightSource(path, "hf", config, cfg_path, hf_io.hf_tensor_specs(path),
                                    lambda: hf_io.iter_hf_tensors(path))
    elif path.suffix == ".safetensors":
        header, _ = hf_io.read_safetensors_header(path)
        specs = {k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"}
        source = hf_io.WeightSource(path, "safetensors", config, cfg_path, specs,
                                    lambda: hf_io.iter_safetensors(path))
    else:  # .ckpt: the specs need one full parse (protobuf has no header)
        _, dtypes, shapes = _read_ckpt(path, arrays=False)
        specs = {n: (shapes[n], _CODE_OF_DTYPE.get(dtypes[n], dtypes[n])) for n in shapes}
        source = hf_io.WeightSource(path, "ckpt", config, cfg_path, specs, lambda: hf_io.iter_ms_checkpoint(path))
    skip = hf_io.check_tensor_specs(source.specs, config, source=str(path), config_file=str(cfg_path))
    return source, skip


def _read_ckpt(path: Path, arrays: bool = True) -> Tuple[Dict[str, np.ndarray], Dict[str, str], Dict[str, tuple]]:
    """A MindSpore .ckpt: tensors (bf16 widened to float32, exact; skipped if not ``arrays``), dtypes, shapes."""
    import mindspore as ms
    from mindspore import dtype as mstype

    try:
        params = ms.load_checkpoint(str(path))
    except (ValueError, RuntimeError, TypeError) as err:
        raise hf_io.load_error(path, err, "re-create it") from None
    names = {mstype.float16: "float16", mstype.float32: "float32", mstype.bfloat16: "bfloat16"}
    out, dtypes, shapes = {}, {}, {}
    for name in list(params):
        p = params.pop(name)
        dtypes[name], shapes[name] = names.get(p.dtype, str(p.dtype)), tuple(p.shape)
        if arrays:
            data = p.asnumpy()
            out[name] = hf_io.bf16_bits_to_fp32(data.view(np.uint16)) if p.dtype == mstype.bfloat16 else data
    return out, dtypes, shapes


def _read_shard(path: Path) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """A shard's tensors (bf16 widened to float32, exact) and dtype names."""
    if path.suffix == ".safetensors":
        header, _ = hf_io.read_safetensors_header(path)
        dtypes = {k: _DTYPE_OF_CODE.get(v["dtype"], v["dtype"]) for k, v in header.items() if k != "__metadata__"}
        return dict(hf_io.iter_safetensors(path)), dtypes
    arrays, dtypes, _ = _read_ckpt(path)
    return arrays, dtypes


def _check_shard(path: Path, rank: int, arrays: Dict[str, Any], strategy: Strategy,
                 config: DecoderConfig) -> None:
    """Names and local shapes of source ``rank``'s shard against the source strategy."""
    stage = rank // strategy.stage_size
    shapes = config.expected_shapes()
    want = {n: local_shape(e, shapes[n]) for n, e in strategy.entries.items() if stage in e.stages}
    for name, shape in want.items():
        if name not in arrays:
            raise MindRLHFError(f"{path}: shard of rank {rank} lacks parameter {name} that strategy "
                                f"{strategy.path} puts on stage {stage}; wrong strategy or model")
        got = tuple(np.shape(arrays[name]))
        if got != shape:
            raise MindRLHFError(f"{path}: parameter {name} has shape {got} but strategy {strategy.path} gives "
                                f"rank {rank} a {shape} slice; wrong strategy or model")
    extra = [n for n in arrays if n not in want]
    if extra:
        raise MindRLHFError(f"{path}: shard of rank {rank} holds parameter {extra[0]} which strategy "
                            f"{strategy.path} does not place on stage {stage}; wrong strategy or model")


def _progress(total: int, desc: str, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="rank", desc=desc, disable=disable, file=sys.stderr)


def _single_dtype(dtypes: Dict[str, str], where: str) -> str:
    kinds = sorted(set(dtypes.values()))
    if len(kinds) != 1 or kinds[0] not in ("float32", "float16", "bfloat16"):
        raise MindRLHFError(f"{where}: tensors have dtypes {', '.join(kinds)}; the numpy engine writes one float "
                            "dtype per file — use --engine mindspore")
    return kinds[0]


# ---------------------------------------------------------------------------------------------
def _run_mindspore(src: Source, staged_full: Optional[Path], src_strategy: Optional[Path],
                   dst_strategy: Optional[Path], world: int, out: Path, prefix: str, no_progress: bool) -> None:
    import mindspore as ms

    files = {0: staged_full} if src.kind == "full" else src.rank_files
    with _progress(world, "transform", no_progress) as bar:
        for r in range(world):
            s, d = (str(src_strategy) if src_strategy else None), (str(dst_strategy) if dst_strategy else None)
            (out / f"rank_{r}").mkdir(parents=True, exist_ok=True)
            target = out / f"rank_{r}" / f"{prefix}{r}.ckpt"
            try:
                needed = ms.rank_list_for_transform(r, s, d)
                missing = [n for n in needed if n not in files]
                if missing:
                    raise MindRLHFError(f"--src_checkpoint {src.path}: rank {missing[0]}'s shard is needed for "
                                        f"destination rank {r} but rank_{missing[0]}/ is missing")
                ms.transform_checkpoint_by_rank(r, {n: str(files[n]) for n in needed}, str(target), s, d)
            except MindRLHFError:
                raise
            except (ValueError, TypeError, RuntimeError) as err:
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise MindRLHFError(f"mindspore.transform_checkpoint_by_rank failed for rank {r} ({first}); "
                                    "try --engine numpy for mindrlhf layouts") from None
            bar.update(1)


def _run_numpy(src: Source, full_source: Optional[hf_io.WeightSource], skip: List[str],
               src_layout: Optional[ParallelLayout], dst_layout: ParallelLayout, config: DecoderConfig,
               src_strat: Optional[Strategy], out: Path, prefix: str, no_progress: bool) -> None:
    if src.kind == "full":
        assert full_source is not None
        weights = {n: a for n, a in full_source if n not in skip}
        dtype = _single_dtype({n: _DTYPE_OF_CODE.get(c, c) for n, (_, c) in full_source.specs.items()
                               if n not in skip}, str(src.path))
        states = None
    else:
        assert src_layout is not None and src_strat is not None
        states, dtypes = {}, {}
        for r, f in sorted(src.rank_files.items()):
            states[r], dt = _read_shard(f)
            _check_shard(f, r, states[r], src_strat, config)
            dtypes.update(dt)
        dtype = _single_dtype(dtypes, str(src.path))
    with _progress(dst_layout.world_size, "transform", no_progress) as bar:
        for r in range(dst_layout.world_size):
            if states is None:
                tensors = sharding.rank_state(weights, config, dst_layout, r)
            else:
                tensors = sharding.apply_reshard(sharding.reshard(src_layout, dst_layout, config, r), states)
            (out / f"rank_{r}").mkdir(parents=True, exist_ok=True)
            hf_io.save_ms_checkpoint(tensors.items(), out / f"rank_{r}" / f"{prefix}{r}.ckpt", dtype)
            bar.update(1)


# ---------------------------------------------------------------------------------------------
def _main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    modes = [m for m, on in (("--layout", args.layout), ("--dst_strategy", args.dst_strategy),
                             ("--merge", args.merge)) if on]
    if len(modes) != 1:
        raise MindRLHFError(f"pass exactly one of --layout dp,tp,pp, --dst_strategy FILE or --merge (got "
                            f"{', '.join(modes) or 'none'})")
    if not args.prefix or os.sep in args.prefix or "/" in args.prefix or args.prefix in (".", ".."):
        raise MindRLHFError(f"--prefix {args.prefix!r}: must be a plain file name prefix without '/'")
    src = _open_source(Path(args.src_checkpoint))
    dst = Path(args.dst_checkpoint)
    if dst.exists() and not dst.is_dir():
        raise MindRLHFError(f"--dst_checkpoint {dst} is a file; pass a directory")
    if is_inside(dst, src.input_dir) or is_inside(src.input_dir, dst):
        raise MindRLHFError(f"--dst_checkpoint {dst} overlaps the source directory {src.input_dir.resolve()}; "
                            "write the result somewhere else (inputs are never modified)")
    if args.src_strategy and src.kind == "full":
        raise MindRLHFError(f"--src_strategy is for a sharded source, but {src.path} is one full checkpoint; drop it")
    if args.merge and src.kind == "full":
        raise MindRLHFError(f"--merge needs a sharded source (rank_*/ directories); {src.path} is already full")
    old = [p for p in dst.iterdir() if not p.name.startswith(".staging-")] if dst.is_dir() else []
    if old and not args.overwrite:
        raise MindRLHFError(f"--dst_checkpoint {dst} exists and is not empty; pass --overwrite to replace its "
                            "rank_*/ directories, strategy and config")
    config, raw_config, cfg_path = _load_config(args, src)
    cfg_name = str(cfg_path)

    created = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    staging = dst / f".staging-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        # -- strategies ---------------------------------------------------------------------
        src_strategy_path: Optional[Path] = None
        src_strat: Optional[Strategy] = None
        src_layout: Optional[ParallelLayout] = None
        if src.kind == "sharded":
            if args.src_strategy:
                src_strategy_path = _resolve_strategy(args.src_strategy, staging, "src", "--src_strategy")
            else:
                src_strategy_path = next((src.path / n for n in STRATEGY_NAMES if (src.path / n).is_file()), None)
                if src_strategy_path is None:
                    raise MindRLHFError(f"--src_checkpoint {src.path} is sharded but has no strategy.json or "
                                        "strategy.ckpt; pass --src_strategy with the strategy it was saved with")
            src_strat = read_strategy(src_strategy_path)
            check_strategy(src_strat, config, config_name=cfg_name)
            src_layout = layout_of(src_strat, config)
            ranks = sorted(src.rank_files)
            if ranks != list(range(src_strat.world_size)):
                have = set(ranks)
                missing = [r for r in range(src_strat.world_size) if r not in have]
                what = (f"rank_{missing[0]}/ is missing" if missing else
                        f"it has rank_{max(ranks)}/ beyond the strategy's {src_strat.world_size} ranks")
                raise MindRLHFError(f"--src_checkpoint {src.path}: strategy {src_strategy_path} is for "
                                    f"{src_strat.world_size} ranks but {what}; pass the matching --src_strategy")

        dst_strategy_path: Optional[Path] = None
        dst_layout: Optional[ParallelLayout] = None
        if args.layout:
            dst_layout = ParallelLayout.parse(args.layout).validate(config)
            name = "strategy.json" if args.strategy_format == "json" else "strategy.ckpt"
            dst_strategy_path = write_strategy(staging / name, config, dst_layout)
        elif args.dst_strategy:
            dst_strategy_path = _resolve_strategy(args.dst_strategy, staging, "dst", "--dst_strategy")
        if dst_strategy_path is not None:
            dst_strat = read_strategy(dst_strategy_path)
            check_strategy(dst_strat, config, config_name=cfg_name)
            dst_layout = dst_layout or layout_of(dst_strat, config)
            world = dst_strat.world_size
        else:  # --merge
            dst_layout, world = ParallelLayout(1, 1, 1), 1

        # -- engine -------------------------------------------------------------------------
        safetensors_shards = src.kind == "sharded" and any(f.suffix == ".safetensors" for f in src.rank_files.values())
        engine = args.engine
        if engine == "auto":
            engine = "numpy" if safetensors_shards else "mindspore"
        if engine == "mindspore" and safetensors_shards:
            raise MindRLHFError(f"--src_checkpoint {src.path}: .safetensors shards need --engine numpy (or auto)")
        if engine == "numpy" and (dst_layout is None or (src.kind == "sharded" and src_layout is None)):
            which = "--dst_strategy" if dst_layout is None else "--src_strategy"
            raise MindRLHFError(f"--engine numpy needs mindrlhf layouts, but the {which} file is not the strategy of "
                                "a dp,tp,pp layout; use --engine mindspore")

        # -- source checks ------------------------------------------------------------------
        full_source, skip, staged_full = None, [], None
        if src.kind == "full":
            full_source, skip = _check_full_source(src, raw_config, cfg_path)
            if engine == "mindspore":
                staged_full = staging / "src" / "rank_0" / "full.ckpt"
                staged_full.parent.mkdir(parents=True)
                if src.path.is_file() and src.path.suffix == ".ckpt" and not skip:
                    os.symlink(src.path.resolve(), staged_full)
                else:  # MindSpore's transform reads .ckpt only: stream a temporary copy
                    dtype = _single_dtype({n: _DTYPE_OF_CODE.get(c, c) for n, (_, c) in full_source.specs.items()
                                           if n not in skip}, str(src.path))
                    hf_io.save_ms_checkpoint(((n, a) for n, a in full_source if n not in skip), staged_full, dtype)
        elif engine == "mindspore":
            assert src_strat is not None
            for stage in src_strat.stages:  # one shard per stage: catches a strategy/model mismatch early
                r = stage * src_strat.stage_size
                arrays, _ = _read_shard(src.rank_files[r])
                _check_shard(src.rank_files[r], r, arrays, src_strat, config)
                del arrays

        # -- transform ----------------------------------------------------------------------
        out = staging / "out"
        out.mkdir()
        if engine == "mindspore":
            _run_mindspore(src, staged_full, src_strategy_path, dst_strategy_path, world, out, args.prefix,
                           args.no_progress)
        else:
            assert dst_layout is not None
            _run_numpy(src, full_source, skip, src_layout, dst_layout, config, src_strat, out, args.prefix,
                       args.no_progress)
        for r in range(world):
            hf_io.write_json_atomic(out / f"rank_{r}" / "config.json", raw_config)
        hf_io.write_json_atomic(out / "config.json", raw_config)
        if dst_strategy_path is not None:
            shutil.copyfile(dst_strategy_path, out / ("strategy.json" if dst_strategy_path.suffix == ".json"
                                                      else "strategy.ckpt"))

        # -- move into place ----------------------------------------------------------------
        if args.overwrite:
            for p in list(_rank_dirs(dst).values()):
                shutil.rmtree(p)
            for n in STRATEGY_NAMES + ("config.json",):
                if (dst / n).is_file():
                    (dst / n).unlink()
        for p in sorted(out.iterdir()):
            if (dst / p.name).exists():
                raise MindRLHFError(f"--dst_checkpoint {dst}: {p.name} already exists; pass --overwrite")
            os.replace(p, dst / p.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created and dst.is_dir() and not any(dst.iterdir()):
            dst.rmdir()  # a failed run leaves no empty output directory behind

    what = "merged" if args.merge else f"layout {dst_layout}" if dst_layout else f"strategy {args.dst_strategy}"
    nbytes = sum(f.stat().st_size for f in dst.glob("rank_*/*.ckpt"))
    print(f"wrote {world} rank checkpoint(s) ({what}; {nbytes / 2**20:.1f} MiB) from {src.kind} source {src.path} "
          f"with the {engine} engine in {time.perf_counter() - start:.1f}s -> {dst}/rank_*/{args.prefix}<rank>.ckpt")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``mindrlhf-transform-checkpoint``); errors print ``error: ...`` and return 2."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

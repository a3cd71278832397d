"""Weight I/O shared by the converter, the model loader and the trainer.

Tensor names are the Hugging Face names everywhere (see docs/CONTRIBUTING.md), so moving weights
between an HF directory and a MindSpore checkpoint is a dtype cast and a container change.

Readers yield ``(name, np.ndarray)`` one tensor at a time. numpy has no bfloat16, so bf16 tensors
are widened to float32 (exact: a bf16 value is the top 16 bits of a float32); float16/float32
come back as stored. Writers take any iterable of ``(name, np.ndarray)`` and a target dtype
(``fp32``/``float32``, ``bf16``/``bfloat16``, ``fp16``/``float16``); bf16 is rounded to nearest-even
(the same bits as ``torch.Tensor.to(torch.bfloat16)``) and kept as its uint16 bit pattern until the
bytes hit the file.

Memory. Everything streams except reading a ``.ckpt``:

* HF directory / MindSpore ``.safetensors`` → tensors: one tensor at a time (``safe_open`` mmaps
  each shard, so file-backed page cache of up to one shard shows in RSS; it is reclaimable).
* ``save_ms_checkpoint(..., "x.ckpt")``: one tensor at a time. ``mindspore.save_checkpoint`` only
  takes a complete list, but a ``.ckpt`` file is a plain concatenation of serialized ``Checkpoint``
  protobuf messages (MindSpore itself writes one message per tensor chunk), so we call it once per
  tensor and append; the result is byte-identical to one call with the full list (tested).
* ``save_ms_checkpoint(..., "x.safetensors")`` and ``save_hf_dir``: one tensor at a time. The
  safetensors header (names, shapes, offsets) precedes the data and neither MindSpore nor the
  ``safetensors`` library can append, so data is spooled to ``<out>.data.tmp`` next to the output
  and the final file is header + a chunked copy of the spool: 2x the file size on disk for a
  moment, never in RAM.
* MindSpore ``.ckpt`` → tensors: ``mindspore.load_checkpoint`` reads and parses the whole protobuf,
  about 2x the file size at its peak; tensors are then handed out and dropped one by one. Prefer
  ``.safetensors`` for large models.

Measured (anonymous RSS above an idle ``import mindspore``; Llama-shaped model, 337M parameters,
1.35 GB fp32 HF input, largest tensor 262 MB fp32): HF → bf16 ``.safetensors`` +0.5 GB, HF → bf16
``.ckpt`` +0.9 GB (flat over the tensors: MindSpore copies a tensor ~3x while serializing it),
bf16 ``.safetensors`` → HF +0.5 GB, bf16 ``.ckpt`` (642 MB) → HF +1.3 GB. For Qwen2.5-7B (largest
tensor 2.2 GB in fp32) that extrapolates to ~4.5 GB, ~8 GB, ~4.5 GB and ~30 GB.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import numpy as np

from mindrlhf.errors import MindRLHFError
from mindrlhf.models.config import DecoderConfig

# Re-exported here (``mindrlhf.checkpoint``) for callers; the tables live in models.dtypes / models.family.
from mindrlhf.models.dtypes import DTYPE_ALIASES, VALID_DTYPES, normalize_dtype  # noqa: F401
from mindrlhf.models.family import DERIVED_SUFFIXES, get_family, is_derived_buffer  # noqa: F401
from mindrlhf.utils.fs import write_text_atomic

PathLike = Union[str, "os.PathLike[str]"]
TensorIter = Iterable[Tuple[str, np.ndarray]]

# ---------------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------------
# safetensors dtype codes of the three dtypes we write, both ways
SAFETENSORS_CODE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
DTYPE_OF_SAFETENSORS_CODE = {code: name for name, code in SAFETENSORS_CODE.items()}
# safetensors dtype codes we can read: code -> numpy dtype of the stored bytes
_ST_READ = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}
READABLE_DTYPE_CODES = tuple(_ST_READ)

HF_SHARD_BYTES = 2_000_000_000  # default max bytes per HF shard (decimal GB, like HF's "2GB")
SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_SAFETENSORS = "model.safetensors"
_COPY_CHUNK = 64 << 20  # bytes per read/write when assembling a safetensors file
_CAST_CHUNK = 1 << 24  # elements per chunk when rounding to bf16 (bounds the uint32 temporary)


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 values given as their uint16 bit pattern to float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest-even, like torch/MindSpore); return the uint16 bits."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    flat = x.reshape(-1).view(np.uint32)
    out = np.empty(flat.shape, dtype=np.uint16)
    for start in range(0, flat.size, _CAST_CHUNK):  # chunks bound the uint32 temporary
        u = flat[start:start + _CAST_CHUNK]
        r = u >> 16
        r &= 1
        r += 0x7FFF
        r += u
        r >>= 16
        out[start:start + _CAST_CHUNK] = r
        nan = np.isnan(u.view(np.float32))
        if nan.any():  # the rounding add could carry a NaN into Inf/sign: keep it a quiet NaN
            out[start:start + _CAST_CHUNK][nan] = ((u[nan] >> 16) | 0x0040).astype(np.uint16)
    return out.reshape(x.shape)


def cast_for_storage(arr: np.ndarray, dtype: str) -> np.ndarray:
    """Cast ``arr`` to the storage form of ``dtype``: float32/float16 arrays, bf16 as uint16 bits."""
    dtype = normalize_dtype(dtype)
    if dtype == "bfloat16":
        return fp32_to_bf16_bits(arr)
    return np.ascontiguousarray(arr, dtype=np.float32 if dtype == "float32" else np.float16)


def _as_le_bytes(arr: np.ndarray) -> memoryview:
    """A zero-copy little-endian byte view of a contiguous array (safetensors is little-endian)."""
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and sys.byteorder == "big"):
        arr = arr.byteswap().view(arr.dtype.newbyteorder("<"))
    return memoryview(arr.reshape(-1)).cast("B")


# ---------------------------------------------------------------------------------------------
# reading safetensors (HF directories and MindSpore .safetensors)
# ---------------------------------------------------------------------------------------------
def read_safetensors_header(path: PathLike) -> Tuple[Dict[str, Any], int]:
    """Return ``(header, data_start)`` of a safetensors file without reading tensor data. A file whose size is not
    the one its header describes (cut short by a copy or a save, or with bytes appended) is a one-line error here,
    before any model is built: the ``safetensors`` reader would only fail at the first read, with a traceback."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError("file shorter than 8 bytes")
            (n,) = struct.unpack("<Q", head)
            if n > 100_000_000:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n).decode("utf-8"))
            size = os.fstat(f.fileno()).st_size
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        data_end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, UnicodeDecodeError, TypeError, KeyError, IndexError) as err:
        raise MindRLHFError(f"{path}: not a readable safetensors file ({err}); re-download or re-save it") from None
    if size != 8 + n + data_end:
        what = "truncated" if size < 8 + n + data_end else "damaged (bytes past its last tensor)"
        raise MindRLHFError(f"{path}: the safetensors file is {what}: {size} bytes, its header describes "
                            f"{8 + n + data_end}; re-download or re-save it (or use another checkpoint)")
    return header, 8 + n


def _file_specs(path: Path) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    header, _ = read_safetensors_header(path)
    return {k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"}


def iter_safetensors(path: PathLike) -> Iterator[Tuple[str, np.ndarray]]:
    """Stream ``(name, array)`` from one safetensors file in on-disk order; bf16 → float32."""
    from safetensors import safe_open

    path = Path(path)
    header, data_start = read_safetensors_header(path)
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, meta in entries.items():
        if meta["dtype"] not in _ST_READ:
            raise MindRLHFError(
                f"{path}: tensor {name!r} has dtype {meta['dtype']}; only float checkpoints "
                f"({', '.join(_ST_READ)}) are supported — dequantize or re-save it in bf16/fp16/fp32")
    order = sorted(entries, key=lambda k: entries[k]["data_offsets"][0])  # sequential disk reads
    with safe_open(str(path), framework="numpy") as f, open(path, "rb") as raw:
        for name in order:
            meta = entries[name]
            if meta["dtype"] == "BF16":
                # numpy has no bfloat16: read the raw bits ourselves and widen exactly
                begin, end = meta["data_offsets"]
                raw.seek(data_start + begin)
                buf = raw.read(end - begin)
                if len(buf) != end - begin:
                    raise MindRLHFError(f"{path}: tensor {name!r} is truncated; re-download the file")
                bits = np.frombuffer(buf, dtype="<u2").reshape(meta["shape"])
                arr = bf16_bits_to_fp32(bits)
                del buf, bits
            else:
                arr = f.get_tensor(name)
            yield name, arr


def hf_safetensors_files(hf_dir: PathLike) -> List[Path]:
    """The safetensors files of an HF model directory (sharded via the index, or single)."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise MindRLHFError(f"{hf_dir}: not a directory; pass the Hugging Face model directory "
                            "(with config.json and *.safetensors)")
    index = hf_dir / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise MindRLHFError(f"{index}: invalid index ({err}); re-download it from the HF model") from None
        files = [hf_dir / fn for fn in sorted(set(weight_map.values()))]
        missing = [str(p.name) for p in files if not p.is_file()]
        if missing:
            raise MindRLHFError(f"{index} lists shard(s) {', '.join(missing)} that are not in {hf_dir}; "
                                "download every shard of the model")
        return files
    single = hf_dir / SINGLE_SAFETENSORS
    if single.is_file():
        return [single]
    shards = sorted(hf_dir.glob("model-*-of-*.safetensors"))
    if shards:  # shards without an index: names come from the shard headers
        return shards
    bins = sorted(p.name for p in hf_dir.glob("*.bin"))
    if bins:
        raise MindRLHFError(
            f"{hf_dir} has only {', '.join(bins)}: PyTorch .bin (pickle) weights are unsupported; re-save as "
            "safetensors with transformers: AutoModelForCausalLM.from_pretrained(DIR)"
            ".save_pretrained(NEW_DIR, safe_serialization=True)")
    raise MindRLHFError(f"{hf_dir} has no model.safetensors or {SAFETENSORS_INDEX}; "
                        "download the model's *.safetensors files into it")


def hf_tensor_specs(hf_dir: PathLike) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """``name -> (shape, safetensors dtype code)`` for every tensor of an HF dir (headers only)."""
    specs: Dict[str, Tuple[Tuple[int, ...], str]] = {}
    for path in hf_safetensors_files(hf_dir):
        for name, spec in _file_specs(path).items():
            if name in specs:
                raise MindRLHFError(f"{path}: tensor {name!r} also appears in another shard; re-download the model")
            specs[name] = spec
    return specs


def iter_hf_tensors(hf_dir: PathLike) -> Iterator[Tuple[str, np.ndarray]]:
    """Stream ``(name, array)`` from an HF directory's safetensors, one tensor at a time.

    bf16 tensors are widened to float32 exactly; float16/float32 are returned as stored.
    """
    files = hf_safetensors_files(hf_dir)
    for path in files:
        yield from iter_safetensors(path)


def read_hf_config(hf_dir: PathLike) -> Dict[str, Any]:
    """Read ``config.json`` of an HF model directory."""
    hf_dir = Path(hf_dir)
    path = hf_dir / "config.json"
    if not path.is_file():
        raise MindRLHFError(f"{hf_dir} has no config.json; it needs the config.json of the Hugging Face model "
                            "its weights come from")
    return read_json(path)


def read_json(path: PathLike) -> Dict[str, Any]:
    """Read a JSON object (a model or generation config) with a one-line error if it is invalid."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise MindRLHFError(f"{path}: invalid JSON ({err}); restore it from the Hugging Face model") from None
    if not isinstance(data, dict):
        raise MindRLHFError(f"{path}: expected a JSON object; restore it from the Hugging Face model")
    return data


# ---------------------------------------------------------------------------------------------
# expected names and shapes (from the model family's spec, ``models.family``)
# ---------------------------------------------------------------------------------------------

def expected_hf_shapes(config: Dict[str, Any], *, config_file: str = "config.json") -> Dict[str, Tuple[int, ...]]:
    """``name -> shape`` of every parameter of the causal LM ``config`` (a parsed config.json) describes.

    The bias, norm and tying rules are the family's (``models.family``); ``lm_head.weight`` is absent
    when ``tie_word_embeddings`` is true.
    """
    get_family(config.get("model_type"), source=config_file)

    def need(key: str) -> int:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise MindRLHFError(f"{config_file}: {key} must be a positive integer, got {value!r}; "
                                "use the config.json of the Hugging Face model")
        return value

    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        need(key)
    for key in ("num_key_value_heads", "head_dim"):
        if config.get(key) is not None:
            need(key)
    if config.get("head_dim") is None and config["hidden_size"] % config["num_attention_heads"]:
        raise MindRLHFError(f"{config_file}: hidden_size {config['hidden_size']} is not divisible by "
                            f"num_attention_heads {config['num_attention_heads']}; set head_dim")
    return DecoderConfig.from_hf_dict(config, source=config_file, check_rope=False).expected_shapes()


def check_tensor_specs(specs: Dict[str, Tuple[Tuple[int, ...], str]], config: Dict[str, Any], *,
                       source: str, config_file: str) -> List[str]:
    """Check a checkpoint's tensors against the config before converting; return the names to skip.

    ``specs`` maps name -> ``(shape, dtype code)`` (``hf_tensor_specs`` / ``WeightSource.specs``).
    Derived buffers (``rotary_emb.inv_freq``) are skipped silently, and so is ``lm_head.weight``
    when embeddings are tied (HF ignores it too). Raises a one-line ``MindRLHFError`` naming
    ``source`` and ``config_file`` for a wrong shape, a missing, unexpected or non-float tensor.
    """
    expected = expected_hf_shapes(config, config_file=config_file)
    tied = bool(config.get("tie_word_embeddings", False))
    skip = [n for n in specs if is_derived_buffer(n) or (tied and n == "lm_head.weight")]
    for name, want in expected.items():  # model order, so the first bad tensor is reported
        if name in specs and tuple(specs[name][0]) != want:
            raise MindRLHFError(f"{source}: tensor {name} has shape {tuple(specs[name][0])} but {config_file} "
                                f"implies {want}; use the config.json that belongs to these weights")
    missing = [n for n in expected if n not in specs]
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise MindRLHFError(f"{source}: missing tensor(s) {', '.join(missing[:5])}{more} required by "
                            f"{config_file}; check that every shard is present and the config matches")
    unexpected = [n for n in specs if n not in expected and n not in skip]
    if unexpected:
        more = f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise MindRLHFError(f"{source}: unexpected tensor(s) {', '.join(unexpected[:5])}{more} not in a "
                            f"{config.get('model_type')} model per {config_file}; check the model type and config")
    for name in expected:
        if specs[name][1] not in READABLE_DTYPE_CODES:
            raise MindRLHFError(f"{source}: tensor {name} is stored as {specs[name][1]}; only float weights "
                                f"({', '.join(READABLE_DTYPE_CODES)}) are supported — dequantize them first")
    return skip


# ---------------------------------------------------------------------------------------------
# writing safetensors, streaming
# ---------------------------------------------------------------------------------------------
class StreamingSafetensorsWriter:
    """Write a safetensors file tensor by tensor with O(one tensor) RAM.

    Data goes to ``<path>.data.tmp``; ``close()`` writes the header and copies the spool after it
    into ``<path>.tmp``, then renames it to ``path`` (so a crash never leaves a half file at ``path``).
    """

    def __init__(self, path: Path, metadata: Dict[str, str]):
        self.path = Path(path)
        self.metadata = dict(metadata)
        self.spool_path = self.path.with_name(self.path.name + ".data.tmp")
        self.tmp_path = self.path.with_name(self.path.name + ".tmp")
        self._spool = open(self.spool_path, "wb")
        self.entries: Dict[str, Dict[str, Any]] = {}
        self.nbytes = 0
        self.numel = 0

    def add(self, name: str, stored: np.ndarray, dtype: str) -> None:
        """Append one tensor already in storage form (see ``cast_for_storage``)."""
        if name in self.entries:
            raise MindRLHFError(f"tensor {name!r} given twice while writing {self.path}; pass each name once")
        data = _as_le_bytes(stored)
        self._spool.write(data)
        self.entries[name] = {"dtype": SAFETENSORS_CODE[dtype], "shape": list(stored.shape),
                              "data_offsets": [self.nbytes, self.nbytes + data.nbytes]}
        self.nbytes += data.nbytes
        self.numel += int(stored.size)

    def close(self) -> None:
        self._spool.close()
        header = {"__metadata__": self.metadata, **self.entries}
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        blob += b" " * (-len(blob) % 8)  # the spec allows space padding; keeps the data 8-byte aligned
        with open(self.tmp_path, "wb") as out, open(self.spool_path, "rb") as spool:
            out.write(struct.pack("<Q", len(blob)))
            out.write(blob)
            shutil.copyfileobj(spool, out, _COPY_CHUNK)
        os.remove(self.spool_path)
        os.replace(self.tmp_path, self.path)

    def abort(self) -> None:
        try:
            self._spool.close()
        finally:
            for p in (self.spool_path, self.tmp_path):
                if p.exists():
                    p.unlink()


# ---------------------------------------------------------------------------------------------
# MindSpore checkpoints
# ---------------------------------------------------------------------------------------------
@dataclass
class SaveSummary:
    """What a save wrote: tensor count, parameter count, bytes of tensor data, dtype, files."""

    num_tensors: int
    num_params: int
    nbytes: int
    dtype: str
    paths: List[Path] = field(default_factory=list)


def _ms_format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix == ".ckpt":
        return "ckpt"
    if suffix == ".safetensors":
        return "safetensors"
    raise MindRLHFError(f"{path}: a MindSpore checkpoint must end in .ckpt or .safetensors; rename the output")


def _to_ms_tensor(stored: np.ndarray, dtype: str):
    import mindspore as ms
    from mindspore import dtype as mstype

    if dtype == "bfloat16":
        # reinterpret the rounded bits; no second rounding and no device op involved
        return ms.Tensor(stored).view(mstype.bfloat16)
    return ms.Tensor(stored)


def save_ms_checkpoint(tensors: TensorIter, path: PathLike, dtype: str = "float32") -> SaveSummary:
    """Write ``(name, array)`` pairs to a MindSpore checkpoint (``.ckpt`` or ``.safetensors``).

    Each tensor is cast to ``dtype`` as it arrives and the source copy is dropped, so RAM stays at
    about one tensor for both formats (see the module docstring for how). The file is written to
    a temporary name and renamed at the end; ``mindspore.load_checkpoint(path, format=...)`` loads it.
    """
    import mindspore as ms

    path = Path(path)
    fmt = _ms_format(path)
    dtype = normalize_dtype(dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = SaveSummary(0, 0, 0, dtype, [path])
    seen = set()
    if fmt == "safetensors":
        writer = StreamingSafetensorsWriter(path, {"format": "ms"})
        try:
            for name, arr in tensors:
                stored = cast_for_storage(arr, dtype)
                del arr
                writer.add(name, stored, dtype)
                del stored
            writer.close()
        except BaseException:
            writer.abort()
            raise
        summary.num_tensors, summary.num_params, summary.nbytes = len(writer.entries), writer.numel, writer.nbytes
        return summary

    tmp = path.with_name(path.name + ".tmp")
    part = path.with_name(path.name + ".part.ckpt")
    try:
        with open(tmp, "wb") as out:
            for name, arr in tensors:
                if name in seen:
                    raise MindRLHFError(f"tensor {name!r} given twice while writing {path}; pass each name once")
                seen.add(name)
                stored = cast_for_storage(arr, dtype)
                del arr
                # one save_checkpoint call per tensor, appended: identical bytes to a single call
                ms.save_checkpoint([{"name": name, "data": _to_ms_tensor(stored, dtype)}], str(part))
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, _COPY_CHUNK)
                os.chmod(part, 0o600)  # MindSpore marks its files read-only
                os.remove(part)
                summary.num_tensors += 1
                summary.num_params += int(stored.size)
                summary.nbytes += int(stored.nbytes)
                del stored
        os.replace(tmp, path)
    finally:
        for p in (tmp, part):
            if p.exists():
                os.chmod(p, 0o600)
                p.unlink()
    return summary


def _ms_param_to_numpy(param) -> np.ndarray:
    """A MindSpore tensor as numpy without running a device op; bf16 widened to float32."""
    from mindspore import dtype as mstype

    arr = param.asnumpy()
    if param.dtype == mstype.bfloat16:
        return bf16_bits_to_fp32(arr.view(np.uint16))
    return arr


def _ms_dtype_code(param) -> str:
    from mindspore import dtype as mstype

    return {mstype.float32: "F32", mstype.float16: "F16", mstype.bfloat16: "BF16",
            mstype.float64: "F64"}.get(param.dtype, str(param.dtype))


def load_error(path: Path, err: Exception, fix: str) -> MindRLHFError:
    """One line for a checkpoint MindSpore failed to load: its first message line and what to do. A .ckpt is
    one protobuf message read whole, and MindSpore refuses it when less memory is free than its size; the
    file is fine then, so the fix is memory, not ``fix`` (re-converting)."""
    msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "available memory" in msg:
        fix = "the file is intact: free memory (other processes hold it) and run again"
    return MindRLHFError(f"{path}: MindSpore cannot load this checkpoint ({msg}); {fix}")


def _load_ckpt_params(path: Path) -> Dict[str, Any]:
    import mindspore as ms

    try:
        return ms.load_checkpoint(str(path), format=_ms_format(path))
    except (ValueError, RuntimeError, TypeError) as err:
        raise load_error(path, err, "re-convert it") from None


def iter_ms_checkpoint(path: PathLike) -> Iterator[Tuple[str, np.ndarray]]:
    """Stream ``(name, array)`` from a MindSpore ``.ckpt``/``.safetensors``; bf16 → float32."""
    path = Path(path)
    if not path.is_file():
        raise MindRLHFError(f"{path}: checkpoint file not found; pass an existing .ckpt or .safetensors file")
    if _ms_format(path) == "safetensors":
        yield from iter_safetensors(path)
        return
    params = _load_ckpt_params(path)
    for name in list(params):
        yield name, _ms_param_to_numpy(params.pop(name))


def load_ms_checkpoint(path: PathLike) -> Dict[str, np.ndarray]:
    """Load a MindSpore checkpoint into ``{name: array}`` (bf16 widened to float32, others native)."""
    return dict(iter_ms_checkpoint(path))


def ms_config_path(ckpt_path: PathLike) -> Path:
    """The model config of a MindSpore checkpoint: ``<stem>.config.json`` if present, else ``config.json``.

    ``convert_weight`` writes ``config.json`` next to the checkpoint; ``<stem>.config.json`` lets
    several checkpoints with different configs share one directory.
    """
    ckpt_path = Path(ckpt_path)
    specific = ckpt_path.with_name(ckpt_path.stem + ".config.json")
    if specific.is_file():
        return specific
    shared = ckpt_path.with_name("config.json")
    if shared.is_file():
        return shared
    raise MindRLHFError(f"{ckpt_path}: no model config next to it; put the HF config.json (or "
                        f"{specific.name}) in {ckpt_path.parent}")


@dataclass
class WeightSource:
    """Weights plus their config; iterate once to stream ``(name, array)`` (bf16 → float32).

    ``specs`` maps every stored name to ``(shape, dtype code)`` before any data is converted, so
    callers can validate first and stream after.
    """

    path: Path
    kind: str  # "hf", "ckpt" or "safetensors"
    config: Dict[str, Any]
    config_path: Path
    specs: Dict[str, Tuple[Tuple[int, ...], str]]
    _iter: Callable[[], Iterator[Tuple[str, np.ndarray]]] = field(repr=False)

    def __iter__(self) -> Iterator[Tuple[str, np.ndarray]]:
        return self._iter()


def _weights_path(path: PathLike) -> Path:
    """The file or HF directory a model path loads from: a training run's folder stands for its newest intact
    checkpoint (``run_record.model_of_run``), and a training checkpoint folder (``step_N/``) loads its
    ``policy.ckpt``."""
    from mindrlhf.checkpoint.run_record import model_of_run  # here, not on import: it reads checkpoints with MindSpore

    path = model_of_run(path)
    if path.is_dir() and (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        raise MindRLHFError(f"{path} holds LoRA adapters (a PEFT adapter folder), not a model; give its base model "
                            "and this folder as --lora_init_from, or merge it into a full model first "
                            "(mindrlhf.models.lora.merged_weights, README: LoRA)")
    if path.is_dir() and (path / "policy.ckpt").is_file() and not any(
            (path / name).is_file() for name in (SINGLE_SAFETENSORS, SAFETENSORS_INDEX)):
        return path / "policy.ckpt"
    return path


def model_files(path: PathLike) -> List[Path]:
    """The files ``open_weights(path)`` reads: an HF directory's config.json and weight files, or a
    checkpoint file and its config; for a directory of ``rank_{r}/`` shards (``transform_checkpoint``),
    every file in those folders."""
    path = Path(path)
    ranks = sorted(d for d in path.glob("rank_*") if d.is_dir()) if path.is_dir() else []
    if ranks:
        return sorted(f for d in ranks for f in d.iterdir() if f.is_file())
    path = _weights_path(path)
    if path.is_dir():
        return [path / "config.json", *hf_safetensors_files(path)]
    if not path.is_file():
        raise MindRLHFError(f"{path}: not found; pass an HF model directory or a .ckpt/.safetensors file")
    return [ms_config_path(path), path]


def open_weights(path: PathLike) -> WeightSource:
    """Open an HF model directory, a MindSpore checkpoint file (with its config next to it) or a
    training checkpoint folder (``step_N/``: its ``policy.ckpt``). Files of a training checkpoint are
    checked against its manifest first (``checkpoint.manifest.verify_files``)."""
    from mindrlhf.checkpoint.manifest import verify_files

    path = _weights_path(path)
    if path.is_dir():
        config = read_hf_config(path)
        verify_files(model_files(path))
        return WeightSource(path, "hf", config, path / "config.json", hf_tensor_specs(path),
                            lambda: iter_hf_tensors(path))
    if not path.is_file():
        raise MindRLHFError(f"{path}: not found; pass an HF model directory or a .ckpt/.safetensors file")
    fmt = _ms_format(path)
    config_path = ms_config_path(path)
    verify_files([config_path, path])
    config = read_json(config_path)
    if fmt == "safetensors":
        return WeightSource(path, fmt, config, config_path, _file_specs(path), lambda: iter_safetensors(path))
    params = _load_ckpt_params(path)  # .ckpt: one protobuf, parsed at once (1x its size in RAM)
    specs = {n: (tuple(p.shape), _ms_dtype_code(p)) for n, p in params.items()}

    def _drain() -> Iterator[Tuple[str, np.ndarray]]:
        for name in list(params):
            yield name, _ms_param_to_numpy(params.pop(name))

    return WeightSource(path, fmt, config, config_path, specs, _drain)


def load_weights(path: PathLike) -> Tuple[Dict[str, Any], Iterator[Tuple[str, np.ndarray]]]:
    """``(config, iterator of (name, array))`` from an HF dir or a MindSpore checkpoint file."""
    source = open_weights(path)
    return source.config, iter(source)


# ---------------------------------------------------------------------------------------------
# HF directories
# ---------------------------------------------------------------------------------------------
_TORCH_DTYPE_NAME = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
_HF_WEIGHT_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


def is_hf_weight_file(name: str) -> bool:
    """Whether a file name is one of an HF export's weight files (a shard, the single file or the index)."""
    return bool(_HF_WEIGHT_FILE.match(name)) or name == SAFETENSORS_INDEX


def config_with_dtype(config: Dict[str, Any], dtype: str) -> Dict[str, Any]:
    """A copy of an HF config with its dtype field(s) (``torch_dtype`` and/or ``dtype``) set."""
    dtype = normalize_dtype(dtype)
    out = dict(config)
    keys = [k for k in ("torch_dtype", "dtype") if k in out] or ["torch_dtype"]
    for k in keys:
        out[k] = _TORCH_DTYPE_NAME[dtype]
    return out


def config_dtype(config: Dict[str, Any], default: str = "float32") -> str:
    """The dtype an HF config declares (``torch_dtype``/``dtype``) if it is one we write, else ``default``."""
    for key in ("torch_dtype", "dtype"):
        value = config.get(key)
        if isinstance(value, str) and value.lower() in DTYPE_ALIASES:
            return DTYPE_ALIASES[value.lower()]
    return normalize_dtype(default)


def write_json_atomic(path: PathLike, data: Dict[str, Any]) -> None:
    """Write JSON (indent 2, like HF) atomically (``utils.fs.write_text_atomic``: a failed write is one
    error line and leaves the old file)."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n", "the JSON file")


def save_hf_dir(tensors: TensorIter, config: Dict[str, Any], out_dir: PathLike, dtype: str = "float32", *,
                generation_config: Optional[Dict[str, Any]] = None,
                max_shard_bytes: int = HF_SHARD_BYTES) -> SaveSummary:
    """Write an HF model directory that ``transformers`` loads.

    Writes ``config.json`` (dtype field updated), ``generation_config.json`` when given, and
    ``model.safetensors`` — or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
    when the weights exceed ``max_shard_bytes`` (a tensor larger than that gets a shard of its own).
    Streams tensor by tensor. Stale ``model*.safetensors``/index files already in ``out_dir`` are
    removed so the result never mixes two exports.
    """
    dtype = normalize_dtype(dtype)
    if max_shard_bytes <= 0:
        raise MindRLHFError(f"max shard size {max_shard_bytes} for {out_dir} must be positive; e.g. 2GB")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: List[StreamingSafetensorsWriter] = []
    weight_map: Dict[str, int] = {}
    summary = SaveSummary(0, 0, 0, dtype, [])
    try:
        for name, arr in tensors:
            if name in weight_map:
                raise MindRLHFError(f"tensor {name!r} given twice while writing {out_dir}; pass each name once")
            stored = cast_for_storage(arr, dtype)
            del arr
            if not shards or (shards[-1].entries and shards[-1].nbytes + stored.nbytes > max_shard_bytes):
                if shards:
                    shards[-1].close()
                shards.append(StreamingSafetensorsWriter(out_dir / f"model.shard{len(shards):05d}.safetensors",
                                                          {"format": "pt"}))
            shards[-1].add(name, stored, dtype)
            weight_map[name] = len(shards) - 1
            summary.num_tensors += 1
            summary.num_params += int(stored.size)
            summary.nbytes += int(stored.nbytes)
            del stored
        if not shards:
            raise MindRLHFError(f"no tensors to write to {out_dir}; the input checkpoint is empty")
        shards[-1].close()
    except BaseException:
        for w in shards:
            w.abort()
            if w.path.exists():
                w.path.unlink()
        raise

    # replace any previous export, then move the new shards to HF's names
    for old in out_dir.iterdir():
        if old.is_file() and is_hf_weight_file(old.name):
            old.unlink()
    n = len(shards)
    names = [SINGLE_SAFETENSORS] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for w, final in zip(shards, names):
        os.replace(w.path, out_dir / final)
        summary.paths.append(out_dir / final)
    if n > 1:
        index = {"metadata": {"total_size": summary.nbytes},
                 "weight_map": {k: names[v] for k, v in sorted(weight_map.items())}}
        write_json_atomic(out_dir / SAFETENSORS_INDEX, index)
        summary.paths.append(out_dir / SAFETENSORS_INDEX)
    write_json_atomic(out_dir / "config.json", config_with_dtype(config, dtype))
    summary.paths.append(out_dir / "config.json")
    if generation_config is not None:
        write_json_atomic(out_dir / "generation_config.json", generation_config)
        summary.paths.append(out_dir / "generation_config.json")
    return summary

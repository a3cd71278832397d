"""GGUF (llama.cpp format) → Hugging Face model directory, as a library (the CLI: ``tools/gguf_to_hf.py``).

Supports the families of ``models.family`` that name a GGUF architecture (``llama``: Llama, Mistral,
SmolLM, ...; ``qwen2``: Qwen2 / Qwen2.5) and GPT2-style byte-level BPE tokenizers. Tensor names, shapes
and the rotary row order come from the family spec; the weights are written by ``hf_io.save_hf_dir``
(the same bf16 rounding and shard writer as every other export). The output directory holds
``config.json``, ``generation_config.json``, ``model.safetensors`` (or shards plus an index),
``tokenizer.json``, ``vocab.json``, ``merges.txt``, ``tokenizer_config.json`` and
``special_tokens_map.json``: ``transformers`` and mindrlhf load it like any HF checkpoint.

File-format facts this relies on (from the GGUF spec / llama.cpp converter):

* GGUF lists a tensor's dims in ``ne`` order (fastest-varying first), i.e. reversed relative to
  numpy. ``gguf.GGUFReader`` already returns arrays in numpy order, so a dequantised 2-D weight is
  ``(rows, cols)`` = HF Linear ``(out, in)``.
* Quantised blocks run along a row (the ``in`` dim), so reordering rows after dequantisation is
  exact.
* For ``llama`` the converter reorders the rows of ``attn_q``/``attn_k`` (per head: the two
  rotary halves are interleaved) to match llama.cpp's rotary kernel; HF expects the halves layout,
  so we undo it (the family's ``gguf_permuted_qk``). ``qwen2`` uses the NEOX rotary kernel in
llama.cpp and is stored unpermuted.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from mindrlhf.checkpoint.hf_io import bf16_bits_to_fp32, expected_hf_shapes, is_hf_weight_file, save_hf_dir
from mindrlhf.errors import MindRLHFError
from mindrlhf.models.dtypes import DTYPES, normalize_dtype
from mindrlhf.models.family import FAMILIES, ModelFamily, gguf_family

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_PRE_TOKENIZERS",
    "SUPPORTED_QUANT_TYPES",
    "convert_gguf_to_hf",
    "read_gguf_metadata",
    "unpermute_rotary_rows",
]

SUPPORTED_ARCHITECTURES = tuple(f.gguf_arch for f in FAMILIES.values() if f.gguf_arch)
SUPPORTED_DTYPES = DTYPES
# Float types are decoded here; block formats by gguf.quants.dequantize (a numpy port of ggml's
# dequantisers; tests check it against ggml's C code on files llama.cpp quantised). IQ*/TQ*/Q8_1
# are left out on purpose: not verified.
SUPPORTED_QUANT_TYPES = (
    "F32", "F16", "BF16", "F64",
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)
# tokenizer.ggml.pre -> how HF pre-tokenizes: a Split regex (None = GPT-2's regex, built into
# ByteLevel), digits split one by one, NFC normaliser, BPE ignore_merges, tokenizer_class.
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS: Dict[str, Dict[str, Any]] = {
    # GPT-2's own regex lives inside tokenizers' ByteLevel(use_regex=True).
    "gpt2": dict(regex=None, digits=False, nfc=False, ignore_merges=False, cls="GPT2Tokenizer"),
    # SmolLM / SmolLM2: every digit is its own pre-token, then the GPT-2 regex.
    "smollm": dict(regex=None, digits=True, nfc=False, ignore_merges=False, cls="GPT2Tokenizer"),
    "qwen2": dict(regex=_QWEN2_REGEX, digits=False, nfc=True, ignore_merges=False, cls="Qwen2Tokenizer"),
    "llama-bpe": dict(regex=_LLAMA3_REGEX, digits=False, nfc=False, ignore_merges=True,
                      cls="PreTrainedTokenizerFast"),
}
SUPPORTED_PRE_TOKENIZERS = tuple(_PRE_TOKENIZERS)

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4
DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
def _import_gguf():
    try:
        import gguf  # noqa: F401  (optional dependency: only the GGUF importer needs it)
    except ImportError as err:
        raise MindRLHFError(
            f"the 'gguf' package is required to read GGUF files ({err}); install it with: pip install gguf"
        ) from None
    return gguf


def _open_reader(gguf_path: Path):
    gguf = _import_gguf()
    if not gguf_path.exists():
        raise MindRLHFError(f"GGUF file not found: {gguf_path}; pass the path of an existing .gguf file")
    if not gguf_path.is_file():
        raise MindRLHFError(f"GGUF path {gguf_path} is not a file; pass the path of a .gguf file")
    try:
        return gguf.GGUFReader(str(gguf_path), "r")
    except Exception as err:  # the reader raises ValueError/KeyError/IndexError on bad input
        reason = " ".join(str(err).split()) or type(err).__name__
        raise MindRLHFError(
            f"cannot read {gguf_path} as GGUF ({reason}); the file is corrupt, truncated or not a GGUF "
            f"file: re-download it (or upgrade gguf with pip install -U gguf if it is a newer format)"
        ) from None


def _field_value(field) -> Any:
    """Decode one GGUF key/value field to a Python value (works across gguf versions)."""
    from gguf import GGUFValueType

    types = list(field.types)
    if not types:
        return None

    def scalar(part, vtype):
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        value = part[0].item()
        return bool(value) if vtype == GGUFValueType.BOOL else value

    if types[0] == GGUFValueType.ARRAY:
        if len(types) > 2:  # nested arrays: never used by the keys we read
            return None
        sub = types[1] if len(types) > 1 else GGUFValueType.UINT8
        return [scalar(field.parts[i], sub) for i in field.data]
    return scalar(field.parts[field.data[0]], types[0])


def _metadata(reader, gguf_path: Path) -> Dict[str, Any]:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = _field_value(field)
        except (UnicodeDecodeError, IndexError, ValueError) as err:
            raise MindRLHFError(
                f"metadata key {key!r} in {gguf_path} cannot be decoded ({err}); the file is corrupt: re-download it"
            ) from None
    return meta


def read_gguf_metadata(gguf_path: os.PathLike) -> Dict[str, Any]:
    """Return the key/value metadata of a GGUF file as plain Python values."""
    path = Path(gguf_path)
    return _metadata(_open_reader(path), path)


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------
def _f32(value: float) -> float:
    """GGUF stores floats as float32; print the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _require(meta: Dict[str, Any], key: str, gguf_path: Path) -> Any:
    if key not in meta:
        raise MindRLHFError(
            f"metadata key {key!r} is missing from {gguf_path}; the file was not written by a llama.cpp "
            f"converter for this architecture: re-export it with convert_hf_to_gguf.py"
        )
    return meta[key]


_MISSING = object()


def _number(meta: Dict[str, Any], key: str, gguf_path: Path, default: Any = _MISSING) -> Any:
    """A numeric hyper-parameter; per-layer lists (some GGUFs store e.g. head counts per layer) must be uniform."""
    value = _require(meta, key, gguf_path) if default is _MISSING else meta.get(key, default)
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise MindRLHFError(
                f"{gguf_path}: {key} varies across layers ({value[:6]}...); HF llama/qwen2 configs need one value: "
                f"this model variant is not supported"
            )
        value = value[0]
    if not isinstance(value, (int, float)):
        raise MindRLHFError(f"{gguf_path}: {key}={value!r} is not a number; the file is corrupt: re-download it")
    return value


def _build_config(meta: Dict[str, Any], gguf_path: Path, family: ModelFamily, vocab_rows: int, has_lm_head: bool,
                  has_attn_bias: bool, dtype: str) -> Dict[str, Any]:
    arch = family.gguf_arch
    hidden = int(_number(meta, f"{arch}.embedding_length", gguf_path))
    n_head = int(_number(meta, f"{arch}.attention.head_count", gguf_path))
    n_kv = int(_number(meta, f"{arch}.attention.head_count_kv", gguf_path, n_head))
    head_dim = int(_number(meta, f"{arch}.attention.key_length", gguf_path, hidden // n_head))
    rope_dim = int(_number(meta, f"{arch}.rope.dimension_count", gguf_path, head_dim))
    if rope_dim != head_dim:
        raise MindRLHFError(
            f"{gguf_path}: {arch}.rope.dimension_count={rope_dim} differs from the head size {head_dim} "
            f"(partial rotary); HF {arch} models rotate the whole head, so this file cannot be converted"
        )
    cfg: Dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": vocab_rows,
        "hidden_size": hidden,
        "intermediate_size": int(_number(meta, f"{arch}.feed_forward_length", gguf_path)),
        "num_hidden_layers": int(_number(meta, f"{arch}.block_count", gguf_path)),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_number(meta, f"{arch}.context_length", gguf_path, 4096)),
        "rms_norm_eps": _f32(_number(meta, f"{arch}.attention.layer_norm_rms_epsilon", gguf_path)),
        "rope_theta": _f32(_number(meta, f"{arch}.rope.freq_base", gguf_path, 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch, gguf_path),
        "tie_word_embeddings": not has_lm_head,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,  # transformers >= 5 spelling of torch_dtype
    }
    # transformers >= 5 keeps rope settings in rope_parameters; older versions read the two keys above.
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_theta"], **(cfg["rope_scaling"] or {})}
    cfg.update(family.gguf_config(cfg, has_attn_bias))
    for hf_key, gguf_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                             ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                             ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if gguf_key in meta:
            cfg[hf_key] = int(meta[gguf_key])
    return cfg


def _rope_scaling(meta: Dict[str, Any], arch: str, gguf_path: Path) -> Optional[Dict[str, Any]]:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in ("none", None) or factor is None or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": _f32(factor)}
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            out["original_max_position_embeddings"] = int(orig)
        return out
    raise MindRLHFError(
        f"{gguf_path}: {arch}.rope.scaling.type={kind!r} is not supported (supported: none, linear, yarn); "
        f"convert from the original HF checkpoint instead"
    )


# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------
def unpermute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order for one projection (weight ``(n_heads*head_dim, in)`` or bias).

    llama.cpp stores, per head, rows ``[r0, r_{d/2}, r1, r_{d/2+1}, ...]`` (interleaved rotary
    pairs); HF keeps the two halves ``[r0..r_{d/2-1}, r_{d/2}..r_{d-1}]``.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads with an even head size")
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _check_type(tensor, gguf_path: Path) -> str:
    """Return the tensor's type name; raise if we cannot dequantise it."""
    name = getattr(tensor.tensor_type, "name", str(tensor.tensor_type))
    if name not in SUPPORTED_QUANT_TYPES:
        raise MindRLHFError(
            f"tensor {tensor.name!r} in {gguf_path} has type {name}, which this converter does not support "
            f"(supported: {', '.join(SUPPORTED_QUANT_TYPES)}); re-quantise the model to one of them "
            f"(e.g. llama-quantize ... Q8_0) or start from the original HF checkpoint"
        )
    return name


def _dequantize(tensor, gguf_path: Path) -> np.ndarray:
    """Return the tensor as float32 in numpy (= HF) order."""
    from gguf import GGMLQuantizationType as QT

    qtype = tensor.tensor_type
    name = _check_type(tensor, gguf_path)
    shape = tuple(int(d) for d in reversed([int(x) for x in tensor.shape]))
    data = np.asarray(tensor.data)
    if qtype == QT.F32:
        out = data.view(np.float32).astype(np.float32, copy=True)
    elif qtype == QT.F16:
        out = data.view(np.float16).astype(np.float32)
    elif qtype == QT.F64:
        out = data.view(np.float64).astype(np.float32)
    elif qtype == QT.BF16:
        out = bf16_bits_to_fp32(data.view(np.uint16))
    else:
        from gguf import quants

        if not hasattr(quants, "dequantize"):
            raise MindRLHFError(
                f"the installed gguf package cannot dequantise {name} (tensor {tensor.name!r}); "
                f"upgrade it: pip install -U gguf"
            )
        out = quants.dequantize(data, qtype)
    out = np.ascontiguousarray(out, dtype=np.float32)
    if out.size != int(np.prod(shape)):
        raise MindRLHFError(
            f"tensor {tensor.name!r} in {gguf_path} holds {out.size} values for shape {shape}; the file is "
            f"corrupt: re-download it"
        )
    return out.reshape(shape)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------
def _added_token_entry(content: str, special: bool) -> Dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": special}


def _write_tokenizer(meta: Dict[str, Any], cfg: Dict[str, Any], out: Path, gguf_path: Path) -> Dict[str, Any]:
    """Write vocab.json, merges.txt, tokenizer.json, tokenizer_config.json, special_tokens_map.json."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        kind = {"llama": "SentencePiece (llama)", None: "none"}.get(model, repr(model))
        raise MindRLHFError(
            f"{gguf_path}: tokenizer.ggml.model is {kind}; only GPT2-style byte-level BPE tokenizers "
            f"(tokenizer.ggml.model = 'gpt2') are supported: use the tokenizer files of the original HF model"
        )
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if pre not in _PRE_TOKENIZERS:
        raise MindRLHFError(
            f"{gguf_path}: pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_PRE_TOKENIZERS)}); use the tokenizer files of the original HF model"
        )
    spec = _PRE_TOKENIZERS[pre]
    tokens: List[str] = list(_require(meta, "tokenizer.ggml.tokens", gguf_path))
    merges_raw: List[str] = list(_require(meta, "tokenizer.ggml.merges", gguf_path))
    token_types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(token_types) != len(tokens):
        raise MindRLHFError(f"{gguf_path}: tokenizer.ggml.token_type has {len(token_types)} entries for "
                            f"{len(tokens)} tokens; the file is corrupt: re-download it")
    if len(tokens) > cfg["vocab_size"]:
        raise MindRLHFError(f"{gguf_path}: {len(tokens)} tokens but only {cfg['vocab_size']} embedding rows; "
                            f"the file is corrupt: re-download it")
    vocab: Dict[str, int] = {}
    for idx, tok in enumerate(tokens):
        vocab.setdefault(tok, idx)  # keep the first id of a duplicated string, as llama.cpp does
    merges: List[Tuple[str, str]] = []
    for line in merges_raw:
        parts = line.split(" ")
        if len(parts) != 2:
            raise MindRLHFError(f"{gguf_path}: merge rule {line!r} is not 'left right'; the file is corrupt")
        merges.append((parts[0], parts[1]))

    def token_at(key: str) -> Optional[str]:
        idx = meta.get(key)
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
    unk, pad = token_at("tokenizer.ggml.unknown_token_id"), token_at("tokenizer.ggml.padding_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", False))

    specials = [(i, t) for i, (t, k) in enumerate(zip(tokens, token_types)) if k == _TOKEN_CONTROL]
    user_defined = [(i, t) for i, (t, k) in enumerate(zip(tokens, token_types)) if k == _TOKEN_USER_DEFINED]

    # tokenizer.json (the fast tokenizer the rest of the stack prefers)
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    bpe_kwargs: Dict[str, Any] = dict(vocab=vocab, merges=merges, fuse_unk=False)
    if spec["ignore_merges"]:
        bpe_kwargs["ignore_merges"] = True
    tok = Tokenizer(models.BPE(**bpe_kwargs))
    if spec["nfc"]:
        tok.normalizer = normalizers.NFC()
    steps = []
    if spec["digits"]:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if spec["regex"] is not None:
        steps.append(pre_tokenizers.Split(Regex(spec["regex"]), behavior="isolated", invert=False))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, trim_offsets=False,
                                          use_regex=spec["regex"] is None))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    if (add_bos and bos) or (add_eos and eos):
        head = f"{bos}:0 " if add_bos and bos else ""
        tail = f" {eos}:0" if add_eos and eos else ""
        pair_b = (f" {bos}:1" if add_bos and bos else "") + " $B:1" + (f" {eos}:1" if add_eos and eos else "")
        special_ids = {t: vocab[t] for t in {bos if add_bos else None, eos if add_eos else None} if t}
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{head}$A:0{tail}", pair=f"{head}$A:0{tail}{pair_b}",
                                          special_tokens=list(special_ids.items())),
        ])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = sorted([(i, t, True) for i, t in specials] + [(i, t, False) for i, t in user_defined])
    for _, content, special in added:
        token = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False,
                           single_word=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    tok.save(str(out / "tokenizer.json"))

    # slow-tokenizer files: vocab.json + merges.txt
    with open(out / "vocab.json", "w", encoding="utf-8") as fh:
        json.dump(vocab, fh, ensure_ascii=False)
    with open(out / "merges.txt", "w", encoding="utf-8") as fh:
        fh.write("#version: 0.2\n")
        fh.writelines(f"{a} {b}\n" for a, b in merges)

    named = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}
    extra = [t for _, t in specials if t not in named.values()]
    tok_cfg: Dict[str, Any] = {
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "add_prefix_space": add_prefix_space,
        "added_tokens_decoder": {str(i): _added_token_entry(t, s) for i, t, s in added},
        "additional_special_tokens": extra,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": cfg["max_position_embeddings"],
        "tokenizer_class": spec["cls"],
    }
    tok_cfg.update({k: v for k, v in named.items()})
    template = meta.get("tokenizer.chat_template")
    if template:
        tok_cfg["chat_template"] = template
    with open(out / "tokenizer_config.json", "w", encoding="utf-8") as fh:
        json.dump(tok_cfg, fh, ensure_ascii=False, indent=2)

    special_map: Dict[str, Any] = {k: _added_token_entry(v, True) for k, v in named.items() if v is not None}
    for entry in special_map.values():
        entry.pop("special")
    if extra:
        special_map["additional_special_tokens"] = extra
    with open(out / "special_tokens_map.json", "w", encoding="utf-8") as fh:
        json.dump(special_map, fh, ensure_ascii=False, indent=2)
    return {"pre": pre, "n_tokens": len(tokens), "n_merges": len(merges), "n_special": len(specials),
            "chat_template": bool(template)}


def _generation_config(meta: Dict[str, Any], cfg: Dict[str, Any]) -> Dict[str, Any]:
    gen: Dict[str, Any] = {}
    if "bos_token_id" in cfg:
        gen["bos_token_id"] = cfg["bos_token_id"]
    eos_ids = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                      "tokenizer.ggml.eom_token_id") if k in meta]
    eos_ids = list(dict.fromkeys(eos_ids))
    if eos_ids:
        gen["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if "pad_token_id" in cfg:
        gen["pad_token_id"] = cfg["pad_token_id"]
    # Sampling defaults a model author stored in the GGUF (general.sampling.*), if any.
    for gguf_key, hf_key in (("general.sampling.temp", "temperature"), ("general.sampling.top_k", "top_k"),
                             ("general.sampling.top_p", "top_p")):
        if gguf_key in meta:
            gen[hf_key] = _f32(meta[gguf_key]) if hf_key != "top_k" else int(meta[gguf_key])
            gen["do_sample"] = True
    return gen


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------
def _check_paths(src: Path, out: Path, overwrite: bool) -> None:
    src_res, out_res = src.resolve(), out.resolve()
    if out_res == src_res.parent or out_res in src_res.parents:
        raise MindRLHFError(
            f"output_dir {out} contains the input GGUF {src}; never write into the input's directory: "
            f"choose a new directory"
        )
    if out.exists() and not out.is_dir():
        raise MindRLHFError(f"output_dir {out} exists and is not a directory; choose a new directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise MindRLHFError(
            f"output_dir {out} exists and is not empty; choose a new directory or pass --overwrite "
            f"(overwrite=True) to replace the converted files in it"
        )


def _publish(staging: Path, out: Path) -> None:
    """Move the finished files from ``staging`` into ``out`` (a rename when ``out`` is new or empty)."""
    # mkdtemp makes the staging dir 0700 (and some writers make files 0600): give the result the
    # permissions of a normally created directory.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)
    for path in staging.iterdir():
        os.chmod(path, 0o666 & ~umask)
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.replace(staging, out)
        return
    # --overwrite on a non-empty dir: replace our files one by one, drop stale weight files of an
    # earlier conversion, leave anything else the user keeps there alone.
    ours = {p.name for p in staging.iterdir()}
    for old in out.iterdir():
        if old.name not in ours and old.is_file() and is_hf_weight_file(old.name):
            old.unlink()
    for name in sorted(ours):
        os.replace(staging / name, out / name)
    shutil.rmtree(staging, ignore_errors=True)


def convert_gguf_to_hf(
    gguf_path: os.PathLike,
    output_dir: os.PathLike,
    dtype: str = "float32",
    *,
    overwrite: bool = False,
    progress: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Convert ``gguf_path`` into an HF model directory at ``output_dir`` and return that path.

    ``dtype`` is the weight dtype written (``float32``, ``bfloat16`` or ``float16``). Files are
    written to a temporary sibling directory first, so a failed run leaves ``output_dir`` as it was.
    Weights larger than ``max_shard_bytes`` are split into ``model-0000i-of-0000n.safetensors`` with
    an index, as ``save_pretrained`` does. The GGUF file and its directory are only read.
    """
    return convert_gguf(Path(gguf_path), Path(output_dir), dtype, overwrite=overwrite, progress=progress,
                        max_shard_bytes=max_shard_bytes)[0]


def convert_gguf(src: Path, out: Path, dtype: str = "float32", *, overwrite: bool = False, progress: bool = True,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Tuple[Path, Dict[str, Any]]:
    """``convert_gguf_to_hf`` that also returns what it wrote (architecture, parameter and tensor counts,
    dtype, weight files, tokenizer summary, GGUF tensor types) for the CLI's report."""
    dtype = normalize_dtype(dtype, where="dtype")
    reader = _open_reader(src)
    _check_paths(src, out, overwrite)
    meta = _metadata(reader, src)
    family = gguf_family(meta.get("general.architecture"), source=str(src))
    arch = family.gguf_arch
    n_layers = int(_number(meta, f"{arch}.block_count", src))
    by_name = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in by_name:
        raise MindRLHFError(
            f"{src}: rope_freqs.weight (Llama-3.1-style rope frequency scaling) is not supported; convert the "
            f"original HF checkpoint instead"
        )
    unknown = [n for n in by_name if family.gguf_to_hf_name(n, n_layers) is None]
    if unknown:
        raise MindRLHFError(
            f"{src}: tensor(s) {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''} do not belong to a "
            f"{arch} decoder with {n_layers} layers; the file is not a plain {arch} model: "
            "use the original HF checkpoint"
        )
    if "token_embd.weight" not in by_name:
        raise MindRLHFError(f"{src}: tensor token_embd.weight is missing; the file is corrupt: re-download it")
    vocab_rows = int(by_name["token_embd.weight"].shape[-1])  # ne = (hidden, vocab)
    has_attn_bias = any(n.endswith(".attn_q.bias") for n in by_name)
    cfg = _build_config(meta, src, family, vocab_rows, "output.weight" in by_name, has_attn_bias, dtype)

    expected = expected_hf_shapes(cfg, config_file=f"{src} (its metadata)")
    mapped = {family.gguf_to_hf_name(n, n_layers): n for n in by_name}
    missing = [k for k in expected if k not in mapped]
    extra = [mapped[k] for k in mapped if k not in expected]
    if missing or extra:
        what = (f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}" if missing
                else f"unexpected {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}")
        raise MindRLHFError(f"{src}: tensors do not match a {arch} model with this metadata ({what}); "
                            f"the file is corrupt or from an unsupported variant: use the original HF checkpoint")
    # Check every type before spending time on dequantisation.
    types = sorted({_check_type(t, src) for t in reader.tensors})

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        tok_info = _write_tokenizer(meta, cfg, staging, src)
        summary = save_hf_dir(_hf_tensors(reader, family, cfg, expected, src, progress), cfg, staging, dtype,
                              generation_config=_generation_config(meta, cfg), max_shard_bytes=max_shard_bytes)
        _publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shard_files = [p.name for p in summary.paths if p.suffix == ".safetensors"]
    return out, {"architecture": arch, "n_params": summary.num_params, "n_tensors": len(expected), "dtype": dtype,
                 "shards": shard_files, "tokenizer": tok_info, "types": types}


def _hf_tensors(reader, family: ModelFamily, cfg: Dict[str, Any], expected: Dict[str, Tuple[int, ...]], src: Path,
                progress: bool) -> Iterator[Tuple[str, np.ndarray]]:
    """``(HF name, float32 array in HF layout)`` for every GGUF tensor, dequantised one at a time."""
    from tqdm import tqdm

    n_layers = cfg["num_hidden_layers"]
    for tensor in tqdm(reader.tensors, desc="dequantising", unit="tensor", disable=not progress):
        hf = family.gguf_to_hf_name(tensor.name, n_layers)
        array = _dequantize(tensor, src)
        if array.shape != expected[hf]:
            raise MindRLHFError(
                f"tensor {tensor.name!r} in {src} has shape {array.shape}, expected {expected[hf]} for {hf} "
                f"from the file's metadata; the file is corrupt: re-download it"
            )
        if family.gguf_permuted_qk and re.search(r"\.attn_[qk]\.(weight|bias)$", tensor.name):
            heads = cfg["num_attention_heads"] if ".attn_q." in tensor.name else cfg["num_key_value_heads"]
            array = unpermute_rotary_rows(array, heads)
        yield hf, array

"""Tiny random Hugging Face checkpoints for tests, benchmarks and bug reports.

torch and transformers (the ``test`` extra) are imported inside the functions, so importing this
module needs neither; nothing else in the ``mindrlhf`` package imports it. It imports nothing of
``mindrlhf`` at module level either, so another virtualenv (TRL's, ``tests/make_trl_stage_reference.py``)
can load this file by its path and build the same models.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict

QWEN_VOCAB = 151936  # Qwen2.5 embedding rows; covers every id of the real Qwen tokenizer


# The tiny configs of each family (HF config kwargs): small enough for CPU tests, shaped to exercise
# what the family differs in (GQA everywhere; Qwen2's q/k/v bias and tied embeddings; Llama untied;
# Qwen3's q/k norm and a head_dim that is not hidden/heads).
_TINY: Dict[str, Dict[str, Any]] = {
    "qwen2": dict(vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  bos_token_id=151643, eos_token_id=151645, torch_dtype="float32"),
    "llama": dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                  rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, torch_dtype="float32"),
    "qwen3": dict(vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  bos_token_id=151643, eos_token_id=151645, torch_dtype="float32"),
}


def _build(family: str, kind: str, seed: int, overrides: Dict[str, Any]):
    """A random transformers model of ``family`` (``CausalLM`` or ``SequenceClassification``), with the
    weights a missed family rule would hide made large enough to show."""
    import torch
    import transformers

    prefix = {"qwen2": "Qwen2", "llama": "Llama", "qwen3": "Qwen3"}[family]
    cfg = dict(_TINY[family])
    cfg.update(overrides)
    torch.manual_seed(seed)
    config = getattr(transformers, prefix + "Config")(**cfg)
    model = getattr(transformers, f"{prefix}For{kind}")(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if family == "qwen2":  # random init has tiny q/k biases; a missed bias must show up
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
            if family == "qwen3":  # the q/k norm weights start at 1; spread them so a wrong norm shows
                layer.self_attn.q_norm.weight.normal_(1.0, 0.5)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.5)
        if kind == "SequenceClassification":  # HF's 0.02-std init gives near-zero scores
            model.score.weight.normal_(0.0, 1.0)
    return model


def _save(model, path: os.PathLike) -> Path:
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_qwen2(path: os.PathLike, *, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random Qwen2 (q/k/v bias, tied embeddings, GQA) to ``path``; return it."""
    return _save(_build("qwen2", "CausalLM", seed, overrides), path)


def make_tiny_llama(path: os.PathLike, *, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random Llama (untied embeddings, GQA, no bias) to ``path``; return it."""
    return _save(_build("llama", "CausalLM", seed, overrides), path)


def make_tiny_qwen3(path: os.PathLike, *, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random Qwen3 (per-head q/k RMSNorm, no bias, head_dim 32 != hidden/heads = 16, tied
    embeddings, GQA) to ``path``; return it."""
    return _save(_build("qwen3", "CausalLM", seed, overrides), path)


def make_tiny_reward_model(path: os.PathLike, *, family: str = "qwen2", num_labels: int = 1, seed: int = 0,
                           **overrides: Any) -> Path:
    """Save a tiny random HF ``<Family>ForSequenceClassification`` (a reward model or critic: the
    family's tiny decoder with a ``score`` head of ``num_labels`` outputs) to ``path``; return it."""
    overrides = dict(num_labels=num_labels, **overrides)
    overrides.setdefault("pad_token_id", _TINY[family]["eos_token_id"])
    return _save(_build(family, "SequenceClassification", seed, overrides), path)


# The parity models (tests/make_trl_stage_reference.py, tests/test_trl_stage_parity.py): Qwen2 with the real
# Qwen2.5 vocabulary (every id the tokenizer gives has its row) and a narrow body (hidden 32), so a step
# over a dozen rows takes seconds in TRL and here.
PARITY_QWEN2: Dict[str, Any] = dict(
    vocab_size=QWEN_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645,
    pad_token_id=151643)


def numpy_init(name: str, shape, seed: int):
    """A float32 weight drawn with numpy's ``default_rng((seed, crc32(name)))``: the same array in any
    virtualenv, whatever torch's RNG or the parameters' order. Scales give a non-trivial model: norms
    1 + N(0, 0.1); biases N(0, 0.5); the embedding N(0, 0.5); matrices N(0, 1/fan_in), the two that write
    into the residual stream (o_proj, down_proj) 10x smaller, so the stream keeps its token and the tied
    head tends to predict the input again (entropy ~5 nats, repeated words are predicted: accuracies
    are not all 0)."""
    import zlib

    import numpy as np

    x = np.random.default_rng([seed, zlib.crc32(name.encode())]).standard_normal(tuple(shape))
    if name.endswith("norm.weight"):
        x = 1.0 + 0.1 * x
    elif name.endswith(".bias"):
        x = 0.5 * x
    elif "embed_tokens" in name:
        x = 0.5 * x
    else:
        x = x / np.sqrt(shape[-1]) * (0.1 if ("o_proj" in name or "down_proj" in name) else 1.0)
    return x.astype(np.float32)


def make_numpy_qwen2(path: os.PathLike, *, seed: int, kind: str = "CausalLM", **overrides: Any) -> Path:
    """Save a ``PARITY_QWEN2`` model (``Qwen2ForCausalLM``, or ``Qwen2ForSequenceClassification`` with
    ``kind="SequenceClassification"``, one label unless overridden) whose every weight is ``numpy_init``'s:
    identical files from any torch / transformers that writes these names. Returns ``path``."""
    import torch
    import transformers

    cfg = dict(PARITY_QWEN2, **overrides)
    if kind == "SequenceClassification":
        cfg.setdefault("num_labels", 1)
    model = getattr(transformers, f"Qwen2For{kind}")(transformers.Qwen2Config(**cfg)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head is the embedding: listed once
            param.copy_(torch.from_numpy(numpy_init(name, param.shape, seed)))
    return _save(model, path)


def make_numpy_tiny(path: os.PathLike, family: str, *, seed: int, **overrides: Any) -> Path:
    """Save the tiny ``family`` CausalLM (``make_tiny_<family>``'s config, ``overrides`` applied) with every
    weight ``numpy_init``'s: identical files in any virtualenv (tests/make_peft_reference.py). Returns ``path``."""
    import torch
    import transformers

    prefix = {"qwen2": "Qwen2", "llama": "Llama", "qwen3": "Qwen3"}[family]
    config = getattr(transformers, prefix + "Config")(**dict(_TINY[family], **overrides))
    model = getattr(transformers, prefix + "ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.from_numpy(numpy_init(name, param.shape, seed)))
    return _save(model, path)


def lora_numpy_init(name: str, shape, seed: int):
    """A random LoRA factor (both A and B non-zero, unlike PEFT's init, so an adapter changes the logits):
    N(0, 1) / sqrt(fan_in) from numpy's ``default_rng((seed, crc32(name)))`` (name without PEFT's prefix)."""
    import zlib

    import numpy as np

    x = np.random.default_rng([seed, zlib.crc32(name.encode())]).standard_normal(tuple(shape))
    return (x / np.sqrt(shape[-1])).astype(np.float32)


def weights_checksum(path: os.PathLike) -> Dict[str, Any]:
    """``{"tensors", "numel", "sum", "sum_sq", "sha256"}`` of the safetensors weights in folder ``path``
    (float64 sums; the digest covers each tensor's name, dtype, shape and bytes in name order)."""

    from safetensors.numpy import load_file

    arrays: Dict[str, Any] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        arrays.update(load_file(str(f)))
    return array_checksum(arrays)


def array_checksum(arrays: Dict[str, Any]) -> Dict[str, Any]:
    """``weights_checksum`` of named numpy arrays."""
    import hashlib

    import numpy as np

    digest, total, total_sq, numel = hashlib.sha256(), 0.0, 0.0, 0
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        digest.update(a.tobytes())
        w = a.astype(np.float64)
        total, total_sq, numel = total + float(w.sum()), total_sq + float((w * w).sum()), numel + a.size
    return {"tensors": len(arrays), "numel": numel, "sum": total, "sum_sq": total_sq, "sha256": digest.hexdigest()}


def add_tokenizer(model_dir: os.PathLike, tokenizer_dir: os.PathLike) -> Path:
    """Copy a tokenizer's files (not its config.json) next to a model; return the model folder."""
    import shutil

    from mindrlhf.tokenizer import TOKENIZER_FILES

    model_dir = Path(model_dir)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, model_dir / name)
    return model_dir


def padded_batch(vocab: int, seed: int = 0):
    """``(ids (3, 12), mask)``: random token ids with one left-padded and one right-padded row."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (3, 12))
    mask = np.ones((3, 12), np.int64)
    mask[1, :4] = 0   # left padding
    mask[2, 9:] = 0   # right padding
    return ids, mask


def random_pairs(vocab: int, lengths, seed: int = 0):
    """``(prompts, chosen, rejected)``: seeded random int32 ids (from 3 up: no special tokens) of the given
    ``(prompt, chosen, rejected)`` lengths, one triple a pair; the pair stages' tests build their cases on them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts, chosen, rejected = [], [], []
    for lp, lc, lr in lengths:
        prompts.append(rng.integers(3, vocab, lp).astype(np.int32))
        chosen.append(rng.integers(3, vocab, lc).astype(np.int32))
        rejected.append(rng.integers(3, vocab, lr).astype(np.int32))
    return prompts, chosen, rejected


def hf_logits(hf_dir: os.PathLike, ids, mask):
    """transformers' float32 logits of ``ids`` under ``mask``, positions counting real tokens (as ours do)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    pos = np.clip(mask.cumsum(1) - 1, 0, None)
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(pos)).logits.numpy()

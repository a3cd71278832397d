"""Tiny random Hugging Face checkpoints for tests, benchmarks and bug reports.

torch and transformers (the ``test`` extra) are imported inside the functions, so importing this
module needs neither; nothing else in the ``mindrlhf`` package imports it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

QWEN_VOCAB = 151936  # Qwen2.5 embedding rows; covers every id of the real Qwen tokenizer


def make_tiny_qwen2(path: os.PathLike, *, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random Qwen2 (q/k/v bias, tied embeddings, GQA) to ``path``; return it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = dict(
        vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151645, torch_dtype="float32",
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg)).eval()
    # Random init has tiny q/k biases; make them large enough that a missed bias shows up.
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_llama(path: os.PathLike, *, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random Llama (untied embeddings, GQA, no bias) to ``path``; return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, torch_dtype="float32",
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_qwen3(path: os.PathLike, *, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random Qwen3 (per-head q/k RMSNorm, no bias, head_dim 32 != hidden/heads = 16, tied
    embeddings, GQA) to ``path``; return it."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = dict(
        vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151645, torch_dtype="float32",
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**cfg)).eval()
    # The q/k norm weights start at 1; spread them so that a norm applied wrongly (or not at all) shows.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.normal_(1.0, 0.5)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.5)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


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

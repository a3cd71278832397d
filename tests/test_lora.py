"""LoRA adapters (``mindrlhf.models.lora``): parity with peft on transformers, both ways through PEFT's adapter
directory; B = 0 changes nothing; a merged model equals the adapter forward; gradients reach only the adapters.

peft lives only in the bench virtualenv (bench/.venv-trl or $MINDRLHF_TRL_VENV): its logits and files are
recorded in tests/data/peft_reference.json by tests/make_peft_reference.py, and rerun live when that venv is here."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from grpo_runs import launch_env
from make_peft_reference import ADAPTER_SEED, ADAPTERS, IDS, MASK, MODEL_SEED, VOCAB
from mindrlhf.errors import MindRLHFError
from mindrlhf.models import load_model
from mindrlhf.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    LoRASpec,
    adapter_weights,
    apply_lora,
    load_adapter,
    merged_weights,
    read_adapter,
    save_adapter,
    set_adapter_weights,
)

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests" / "data" / "peft_reference.json"
#: LoraConfig keys whose values decide the adapter's maths (the rest are peft's bookkeeping).
MATHS_KEYS = ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "use_rslora", "bias", "fan_in_fan_out",
              "use_dora", "modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern")


def _reference() -> dict:
    return json.loads(REFERENCE.read_text(encoding="utf-8"))


def _logits(model) -> np.ndarray:
    """Logits at the real tokens (a padding query's output is never used; transformers' differs)."""
    out = model(Tensor(np.array(IDS, np.int32)), Tensor(np.array(MASK, np.int32))).asnumpy()
    return out[np.array(MASK, bool)]


def _peft(logits) -> np.ndarray:
    return np.array(logits, np.float32)[np.array(MASK, bool)]


def _base(tmp_path: Path, family: str):
    """The recorded base model (its checksum checked) loaded by mindrlhf, and its folder."""
    from mindrlhf.testing import make_numpy_tiny, weights_checksum

    path = make_numpy_tiny(tmp_path / family, family, seed=MODEL_SEED, vocab_size=VOCAB)
    want, got = _reference()["families"][family]["model"], weights_checksum(path)
    assert got["sha256"] == want["sha256"], f"{family}: not the model peft ran; rerun tests/make_peft_reference.py"
    return load_model(path), path


def _random_adapter(model) -> dict:
    """``lora_numpy_init`` arrays (A and B non-zero) for every adapter of ``model``, by model name."""
    from mindrlhf.testing import lora_numpy_init

    return {name: lora_numpy_init(name, array.shape, ADAPTER_SEED) for name, array in adapter_weights(model).items()}


def _write_peft_dir(path: Path, config: dict, tensors: dict) -> Path:
    """The adapter dir peft wrote (its recorded adapter_config.json, the same tensors under peft's names)."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    (path / ADAPTER_CONFIG).write_text(json.dumps(config), encoding="utf-8")
    save_file({PEFT_PREFIX + k: v for k, v in tensors.items()}, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("family", sorted(ADAPTERS))
def test_peft_adapter_dir_gives_peft_logits_and_ours_is_the_same_dir(tmp_path, family):
    """peft's saved adapter dir -> ours: the recorded peft logits (<= 1e-4); ours -> peft: the dir we write
    holds byte-identical tensors under peft's names and the same LoRA settings as the one peft wrote."""
    from mindrlhf.testing import array_checksum

    ref = _reference()["families"][family]
    model, _ = _base(tmp_path, family)
    cfg = dict(ADAPTERS[family])
    spec = LoRASpec(r=cfg.pop("r"), alpha=cfg.pop("lora_alpha"), use_rslora=cfg.pop("use_rslora", False),
                    target_modules=cfg.pop("target_modules"))
    probe = load_model(tmp_path / family)
    apply_lora(probe, spec)
    tensors = _random_adapter(probe)
    assert array_checksum({PEFT_PREFIX + k: v for k, v in tensors.items()}) == ref["adapter"]
    peft_dir = _write_peft_dir(tmp_path / "peft_adapter", ref["adapter_config"], tensors)

    loaded = load_adapter(model, peft_dir)
    assert loaded.scaling == pytest.approx(ref["lora_config"]["lora_alpha"] / (
        np.sqrt(ref["lora_config"]["r"]) if ref["lora_config"].get("use_rslora") else ref["lora_config"]["r"]))
    got, want = _logits(model), _peft(ref["logits"])
    assert np.abs(got - want).max() <= 1e-4
    base = _logits(load_model(tmp_path / family))
    assert np.abs(base - want).max() > 1e-2  # the adapter matters

    ours = save_adapter(model, tmp_path / "ours")
    _, ours_tensors = read_adapter(ours)
    from safetensors.numpy import load_file

    written = load_file(str(ours / ADAPTER_WEIGHTS))
    assert array_checksum(written) == ref["adapter"]
    assert set(ours_tensors) == set(tensors)
    config = json.loads((ours / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    for key in MATHS_KEYS:
        assert config[key] == ref["adapter_config"][key] or (not config[key] and not ref["adapter_config"][key]), key
    targets = ref["adapter_config"]["target_modules"]
    assert (config["target_modules"] == targets if isinstance(targets, str)
            else sorted(config["target_modules"]) == sorted(targets))


def _venv_python() -> Path:
    venv = Path(os.environ.get("MINDRLHF_TRL_VENV", REPO / "bench" / ".venv-trl"))
    return venv / "bin" / "python"


def _needs_peft() -> Path:
    python = _venv_python()
    if not python.is_file():
        pytest.skip(f"no bench virtualenv with peft at {python.parents[1]} (bench/README.md; or set MINDRLHF_TRL_VENV)")
    return python


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_peft_loads_the_adapter_dir_we_write(tmp_path, family):
    """Live: peft (in its venv) loads the dir save_adapter wrote onto the transformers model: same logits."""
    python = _needs_peft()
    model, _ = _base(tmp_path, family)
    cfg = dict(ADAPTERS[family])
    apply_lora(model, LoRASpec(r=cfg["r"], alpha=cfg["lora_alpha"], use_rslora=cfg.get("use_rslora", False),
                               target_modules=cfg["target_modules"]))
    set_adapter_weights(model, _random_adapter(model))
    out = save_adapter(model, tmp_path / "ours", base_model_name_or_path=str(tmp_path / family))
    result = tmp_path / "peft_logits.json"
    proc = subprocess.run([str(python), str(REPO / "tests" / "make_peft_reference.py"), "--family", family,
                           "--adapter_dir", str(out), "--output", str(result)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    peft_logits = _peft(json.loads(result.read_text(encoding="utf-8"))["logits"])
    assert np.abs(_logits(model) - peft_logits).max() <= 1e-4


@pytest.mark.slow
def test_recorded_reference_is_what_peft_gives_today(tmp_path):
    """peft run now gives the recorded files and logits (same models, adapters, settings)."""
    python = _needs_peft()
    out = tmp_path / "fresh.json"
    proc = subprocess.run([str(python), str(REPO / "tests" / "make_peft_reference.py"), "--output", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh, recorded = json.loads(out.read_text(encoding="utf-8")), _reference()
    for family, want in recorded["families"].items():
        got = fresh["families"][family]
        assert got["model"]["sha256"] == want["model"]["sha256"], family
        assert got["adapter"]["sha256"] == want["adapter"]["sha256"], family
        if fresh["peft"] == recorded["peft"]:
            assert got["adapter_config"] == want["adapter_config"], family
        assert np.abs(np.array(got["logits"]) - np.array(want["logits"])).max() <= 1e-5, family


@pytest.mark.parametrize("maker", ["make_tiny_qwen2", "make_tiny_qwen3"])
def test_zero_b_leaves_the_logits_bit_identical(tmp_path, maker):
    """PEFT's init (B = 0): the adapted model's logits are exactly the base's; A is U(+-1/sqrt(in))."""
    import mindrlhf.testing as testing

    path = getattr(testing, maker)(tmp_path / "m")
    model = load_model(path)
    ids, mask = testing.padded_batch(model.config.vocab_size)
    base = model(Tensor(ids), Tensor(mask)).asnumpy()
    names = apply_lora(model, LoRASpec(r=4, alpha=16))
    assert len(names) == 7 * model.config.num_hidden_layers
    np.testing.assert_array_equal(model(Tensor(ids), Tensor(mask)).asnumpy(), base)
    weights = adapter_weights(model)
    a = weights["model.layers.0.mlp.down_proj.lora_A.weight"]
    bound = 1 / np.sqrt(model.config.intermediate_size)
    assert a.shape == (4, model.config.intermediate_size) and np.abs(a).max() <= bound and a.std() > bound / 3
    assert not any(np.any(v) for k, v in weights.items() if ".lora_B." in k)


def test_merged_weights_equal_the_adapter_forward(tmp_path):
    from mindrlhf.testing import make_tiny_llama, padded_batch

    path = make_tiny_llama(tmp_path / "m")
    model = load_model(path)
    apply_lora(model, LoRASpec(r=4, alpha=8, target_modules=("q_proj", "o_proj", "gate_proj", "down_proj")))
    set_adapter_weights(model, _random_adapter(model))
    ids, mask = padded_batch(model.config.vocab_size)
    adapted = model(Tensor(ids), Tensor(mask)).asnumpy()
    merged = load_model(path)
    from mindrlhf.models import set_weights

    set_weights(merged, merged_weights(model), source="merged")
    got = merged(Tensor(ids), Tensor(mask)).asnumpy()
    assert np.abs(got - adapted).max() <= 1e-5
    assert np.abs(adapted - load_model(path)(Tensor(ids), Tensor(mask)).asnumpy()).max() > 1e-2


def test_gradients_reach_only_the_adapters(tmp_path):
    """Only A and B are trainable; mindspore.grad over the trainable parameters returns their gradients
    (non-zero, and a step along them lowers the loss); no base parameter asks for a gradient."""
    from mindrlhf.testing import make_tiny_qwen2, padded_batch

    model = load_model(make_tiny_qwen2(tmp_path / "m"))
    apply_lora(model, LoRASpec(r=2, alpha=4))
    set_adapter_weights(model, _random_adapter(model))
    trainable = model.trainable_params()
    assert trainable and all(".lora_A." in p.name or ".lora_B." in p.name for p in trainable)
    assert len(trainable) == 2 * 7 * model.config.num_hidden_layers
    assert not any(p.requires_grad for n, p in model.parameters_and_names() if ".lora_" not in n)
    ids, mask = padded_batch(model.config.vocab_size)
    ids_t, mask_t = Tensor(ids), Tensor(mask)

    def loss_fn():
        return -model.sequence_logprobs(ids_t[:, :-1], mask_t[:, :-1], ids_t[:, -4:]).mean()

    loss, grads = ms.value_and_grad(loss_fn, None, trainable)()
    assert len(grads) == len(trainable)
    assert all(np.abs(g.asnumpy()).max() > 0 for g in grads)
    for p, g in zip(trainable, grads):
        p.set_data(p.value() - 1e-2 * g)
    assert float(loss_fn().asnumpy()) < float(loss.asnumpy())


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_layer_graphs_train_the_adapters_like_pynative_and_jit(tmp_path, dropout):
    """The compiled layer graphs (recompute full and selective) load every parameter of a layer into a template carrying
    the same adapters and differentiate only the adapters: the loss and each adapter gradient equal the pynative and
    the whole-model jit ones (<= 1e-5 relative), the base gets none, and the weights the graphs read are the layers'.
    With adapter dropout on (seeds set as a gradient pass sets them) too: the backward's recomputed forward draws the
    forward's masks (a redrawn mask would give another gradient), and the masks change the loss."""
    from mindrlhf.models.lora import set_dropout_seeds
    from mindrlhf.testing import make_tiny_qwen2
    from test_packing import _rows

    model = load_model(make_tiny_qwen2(tmp_path / "m"))
    apply_lora(model, LoRASpec(r=4, alpha=8, dropout=dropout,
                               target_modules=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")))
    set_adapter_weights(model, _random_adapter(model))
    if dropout:
        undropped = float(model.sequence_logprobs(*[Tensor(a) for a in _rows(model.config.vocab_size)[:3]],
                                                  0.7).sum().asnumpy())
        set_dropout_seeds(model, step=3, dp_rank=0, micro_batch=1)
    ids, mask, comp, present = _rows(model.config.vocab_size)
    weights = Tensor(np.random.default_rng(0).normal(size=present.shape).astype(np.float32) * present)

    def loss_fn():
        return (model.sequence_logprobs(Tensor(ids), Tensor(mask), Tensor(comp), 0.7) * weights).sum()

    params = model.trainable_params()
    assert all(".lora_" in p.name for p in params)
    grad_fn = ms.value_and_grad(loss_fn, None, params)
    eager = grad_fn()
    with model.compiled_layers():
        graphs = grad_fn()
    with model.compiled_layers(keep=True):
        kept = grad_fn()
    for other in (graphs, kept, ms.jit(grad_fn)()):  # recompute full, selective, none
        np.testing.assert_allclose(float(other[0].asnumpy()), float(eager[0].asnumpy()), rtol=1e-5)
        for p, want, got in zip(params, eager[1], other[1]):
            want, got = want.asnumpy(), got.asnumpy()
            assert np.linalg.norm(want) > 0, p.name
            assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want), p.name
    base = [p for n, p in model.parameters_and_names() if ".lora_" not in n]
    assert base and not any(p.requires_grad for p in base)
    for keep in (False, True):
        with model.compiled_layers(keep=keep):  # asking for the base's gradient gives nothing through the graphs
            frozen = ms.grad(loss_fn, None, [model.model.layers[0].self_attn.q_proj.weight, model.head_table()])()
        assert not np.any(frozen[0].asnumpy())
    # the frozen output projection: the chunked head forms no dW product at all
    assert model.chunked_logprob.weight_grad is False and not np.any(frozen[1].asnumpy())
    if dropout:
        dropped = float(model.sequence_logprobs(*[Tensor(a) for a in (ids, mask, comp)], 0.7).sum().asnumpy())
        assert abs(dropped - undropped) > 1e-3


def test_tp_shards_split_the_adapter_with_their_layer(tiny_qwen2_dir):
    """Built in-process (no collective runs): column-parallel layers hold B's rows, row-parallel A's columns,
    and the slices of both ranks put together are the single-process adapter."""
    from mindrlhf.models import DecoderConfig
    from mindrlhf.models.decoder import CausalLM
    from mindrlhf.models.shard import ModelShard

    config = DecoderConfig.from_file(tiny_qwen2_dir)
    whole = CausalLM(config)
    spec = LoRASpec(r=4, alpha=8)
    apply_lora(whole, spec)
    full = _random_adapter(whole)
    shards = []
    for rank in range(2):
        shard = CausalLM(config, shard=ModelShard(tp=2, tp_rank=rank, tp_group="tp"))
        apply_lora(shard, spec)
        set_adapter_weights(shard, full)
        shards.append(adapter_weights(shard))
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    qa, qb, oa, ob = (f"{q}.lora_A.weight", f"{q}.lora_B.weight", f"{o}.lora_A.weight", f"{o}.lora_B.weight")
    np.testing.assert_array_equal(np.concatenate([s[qb] for s in shards], 0), full[qb])
    np.testing.assert_array_equal(shards[1][qa], full[qa])
    np.testing.assert_array_equal(np.concatenate([s[oa] for s in shards], 1), full[oa])
    np.testing.assert_array_equal(shards[0][ob], full[ob])
    # PEFT's init is drawn for the whole factor, then sliced: every layout starts from the same adapter.
    init = CausalLM(config, shard=ModelShard(tp=2, tp_rank=1, tp_group="tp"))
    apply_lora(init, spec)
    np.testing.assert_array_equal(adapter_weights(init)[f"{o}.lora_A.weight"],
                                  adapter_weights(whole)[f"{o}.lora_A.weight"][:, config.num_attention_heads *
                                                                              config.head_dim // 2:])


def test_one_line_errors(tmp_path, tiny_qwen2_dir):
    model = load_model(tiny_qwen2_dir)
    assert LoRASpec(target_modules="all-linear").target_modules == LoRASpec().target_modules
    with pytest.raises(MindRLHFError, match="has no LoRA adapters to set"):
        set_adapter_weights(model, {})
    with pytest.raises(MindRLHFError, match="match no decoder projection"):
        apply_lora(model, LoRASpec(target_modules=("qkv",)))
    with pytest.raises(MindRLHFError, match="must be a positive integer"):
        LoRASpec(r=0)
    apply_lora(model, LoRASpec(r=2))
    with pytest.raises(MindRLHFError, match="already has LoRA"):
        apply_lora(model, LoRASpec(r=2))
    dora = _write_peft_dir(tmp_path / "dora", {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "use_dora": True,
                                               "target_modules": ["q_proj"]}, {})
    with pytest.raises(MindRLHFError, match="use_dora=True is not supported"):
        load_adapter(load_model(tiny_qwen2_dir), dora)
    with pytest.raises(MindRLHFError, match="not a PEFT adapter directory"):
        load_adapter(load_model(tiny_qwen2_dir), tmp_path)
    wrong = save_adapter(model, tmp_path / "r2")
    config = json.loads((wrong / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    (wrong / ADAPTER_CONFIG).write_text(json.dumps(dict(config, r=3)), encoding="utf-8")
    with pytest.raises(MindRLHFError, match="this model needs"):
        load_adapter(load_model(tiny_qwen2_dir), wrong)


@pytest.mark.slow
@pytest.mark.msrun
def test_tp2_adapter_gradients_equal_single_process(tmp_path, tiny_qwen2_dir):
    """tp=2 under msrun: the loss and every adapter gradient slice equal one process's (the replicated factor's
    gradient is summed over the tp ranks: A of a column-parallel layer, B of a row-parallel one), with the adapter
    dropout off and on (its masks indexed by the whole input's columns: a row-parallel shard draws its slice of one
    process's mask). The adapters assembled from the shards are the full ones on every rank, the merged model of the
    shards equals one process's bit for bit, and the PEFT folder written from the shards is byte-identical to one
    process's."""
    import sys

    from mindrlhf.models.lora import set_dropout_seeds
    from mindrlhf.testing import padded_batch

    spec = LoRASpec(r=4, alpha=8.0, dropout=0.3)  # the worker parses --alpha as a float: the same adapter_config.json
    model = load_model(tiny_qwen2_dir)
    apply_lora(model, spec)
    full = _random_adapter(model)
    set_adapter_weights(model, full)
    ids, mask = padded_batch(model.config.vocab_size)
    batch = {"input_ids": ids[:, :-1], "attention_mask": mask[:, :-1], "completion_ids": ids[:, -4:]}
    params = model.trainable_params()
    tensors = {k: Tensor(v) for k, v in batch.items()}

    def loss_fn():
        return -model.sequence_logprobs(tensors["input_ids"], tensors["attention_mask"],
                                        tensors["completion_ids"]).sum()

    loss, grads = ms.value_and_grad(loss_fn, None, params)()
    want = {p.name: g.asnumpy() for p, g in zip(params, grads)}
    set_dropout_seeds(model, step=5)
    drop_loss, drop_grads = ms.value_and_grad(loss_fn, None, params)()
    assert abs(float(drop_loss.asnumpy()) - float(loss.asnumpy())) > 1e-3
    drop_want = {p.name: g.asnumpy() for p, g in zip(params, drop_grads)}
    np.savez(tmp_path / "adapter.npz", **full)
    np.savez(tmp_path / "batch.npz", **batch)
    log_dir = tmp_path / "log"
    env = launch_env({"PYTHONUNBUFFERED": "1"})
    cmd = [str(Path(sys.executable).parent / "msrun"), "--worker_num=2", "--local_worker_num=2", "--master_port=8313",
           "--join=True", f"--log_dir={log_dir}", str(REPO / "tests" / "lora_tp_worker.py"), "--tp", "2",
           "--model", str(tiny_qwen2_dir), "--adapter", str(tmp_path / "adapter.npz"),
           "--batch", str(tmp_path / "batch.npz"), "--r", "4", "--alpha", "8", "--dropout", "0.3", "--out",
           str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(log_dir.glob("*.log")))
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}\n{logs}"
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    for res in ranks:
        np.testing.assert_allclose(float(res["loss"]), float(loss.asnumpy()), rtol=1e-5)
        np.testing.assert_allclose(float(res["drop_loss"]), float(drop_loss.asnumpy()), rtol=1e-5)
    for key, name, g in [("grad/", n, g) for n, g in want.items()] + [("drop_grad/", n, g)
                                                                      for n, g in drop_want.items()]:
        got = [res[key + name] for res in ranks]
        split_b = ".lora_B." in name and any(f".{m}." in name for m in ("q_proj", "k_proj", "v_proj", "gate_proj",
                                                                         "up_proj"))
        split_a = ".lora_A." in name and any(f".{m}." in name for m in ("o_proj", "down_proj"))
        if split_b:
            got = np.concatenate(got, 0)
        elif split_a:
            got = np.concatenate(got, 1)
        else:  # replicated: each rank holds the full gradient
            np.testing.assert_allclose(got[1], got[0], rtol=1e-5, atol=1e-6, err_msg=name)
            got = got[0]
        np.testing.assert_allclose(got, g, rtol=1e-4, atol=1e-5 * np.abs(g).max(), err_msg=name)  # float32 sums
        assert np.abs(g).max() > 0, name
    merged = merged_weights(model)
    one = save_adapter(model, tmp_path / "adapter_one")
    for res in ranks:
        assert {k[len("adapter/"):] for k in res if k.startswith("adapter/")} == set(full)
        for name, value in full.items():
            np.testing.assert_array_equal(res["adapter/" + name], value, err_msg=name)
        assert {k[len("merged/"):] for k in res if k.startswith("merged/")} == set(merged)
        for name, value in merged.items():
            np.testing.assert_array_equal(res["merged/" + name], value, err_msg=name)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        assert (tmp_path / "adapter_tp" / name).read_bytes() == (one / name).read_bytes(), name


def _python_block(name: str) -> str:
    text = (REPO / name).read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    return next(b for b in blocks if "load_adapter(model" in b)


def test_the_lora_tutorial_example_runs_and_its_merged_export_equals_the_adapter(tmp_path):
    """The LoRA tutorial's library block (docs/tutorials/lora.md), run as written on a tiny Llama and an adapter
    dir: the merged HF export it writes gives the adapted model's logits, and the adapter it writes back reads as
    the same adapter."""
    import re

    from mindrlhf.testing import make_tiny_llama, padded_batch

    base = make_tiny_llama(tmp_path / "base")
    model = load_model(base)
    apply_lora(model, LoRASpec(r=4, alpha=8))
    full = _random_adapter(model)
    set_adapter_weights(model, full)
    save_adapter(model, tmp_path / "adapter")
    code = _python_block("docs/tutorials/lora.md")
    strip = re.compile(r"\s*#.*$", re.M)
    assert strip.sub("", _python_block("docs/zh/guide.md")) == strip.sub("", code)  # the same code in both languages
    for old, new in (("base_hf_dir", base), ("adapter_dir", tmp_path / "adapter"),
                     ("merged_hf_dir", tmp_path / "merged"), ("adapter_copy", tmp_path / "copy")):
        code = code.replace(f'"{old}"', repr(str(new)))
    exec(compile(code, "docs/tutorials/lora.md", "exec"), {})  # noqa: S102 - the tutorial's own example
    ids, mask = padded_batch(model.config.vocab_size)
    want = model(Tensor(ids), Tensor(mask)).asnumpy()
    assert np.abs(load_model(tmp_path / "merged")(Tensor(ids), Tensor(mask)).asnumpy() - want).max() <= 1e-5
    spec, tensors = read_adapter(tmp_path / "copy")
    assert spec.r == 4 and spec.scaling == 2.0 and set(tensors) == set(full)
    assert all(np.array_equal(tensors[k], full[k]) for k in full)


def test_adapted_model_compiles_with_jit_and_dropout_acts_only_with_seeds(tmp_path):
    """Graph mode compiles the adapted linears (the stages' steps and the sampler are jit-compiled) to the
    pynative logits; lora_dropout is off until a gradient pass sets the seeds (training mode alone changes nothing),
    then the compiled graph reads the new seeds (no recompile) and gives pynative's dropped logits, and seeds off
    give the undropped logits bit for bit."""
    from mindrlhf.models.lora import has_dropout, set_dropout_seeds
    from mindrlhf.testing import make_tiny_qwen3, padded_batch

    model = load_model(make_tiny_qwen3(tmp_path / "m"))
    apply_lora(model, LoRASpec(r=4, alpha=8, dropout=0.1))
    assert has_dropout(model)
    set_adapter_weights(model, _random_adapter(model))
    ids, mask = padded_batch(model.config.vocab_size)
    eager = model(Tensor(ids), Tensor(mask)).asnumpy()

    def forward(i, m):
        return model(i, m)

    compiled = ms.jit(forward)
    np.testing.assert_allclose(compiled(Tensor(ids), Tensor(mask)).asnumpy(), eager, rtol=0, atol=1e-5)
    model.set_train(True)
    np.testing.assert_array_equal(model(Tensor(ids), Tensor(mask)).asnumpy(), eager)
    set_dropout_seeds(model, step=0)
    dropped = model(Tensor(ids), Tensor(mask)).asnumpy()
    assert np.abs(dropped - eager).max() > 1e-3
    np.testing.assert_allclose(compiled(Tensor(ids), Tensor(mask)).asnumpy(), dropped, rtol=0, atol=1e-5)
    set_dropout_seeds(model, None)
    np.testing.assert_array_equal(model(Tensor(ids), Tensor(mask)).asnumpy(), eager)
    assert not has_dropout(load_model(make_tiny_qwen3(tmp_path / "m")))


def _numpy_keep(seed: int, rows: int, in_features: int, p: float, cols=None) -> np.ndarray:
    """The hash mask of models.hash_dropout written again in numpy (uint32 arithmetic): murmur3's fmix32 of
    row * 0x9E3779B1 ^ seed per row and of column * 0x9E3779B1 ^ seed ^ 0x5BD1E995 per column, their xor times
    0x85EBCA6B per element; kept where its top 24 bits, read as a signed number plus 2**23, are >= p * 2**24."""
    def fmix(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    cols = np.arange(in_features) if cols is None else cols
    s = np.uint64(seed & 0xFFFFFFFF)
    row = fmix(((np.arange(rows, dtype=np.uint64) * 0x9E3779B1) & 0xFFFFFFFF) ^ s)
    col = fmix(((cols.astype(np.uint64) * 0x9E3779B1) & 0xFFFFFFFF) ^ s ^ np.uint64(0x5BD1E995))
    h = ((row[:, None] ^ col[None, :]) * 0x85EBCA6B) & 0xFFFFFFFF
    top = (h >> 8).astype(np.int64)
    signed = np.where(top >= 1 << 23, top - (1 << 24), top)  # an int32's arithmetic shift by 8
    return signed + (1 << 23) >= int(round(p * (1 << 24)))


def test_adapter_dropout_is_the_hash_mask_numpy_computes(tmp_path):
    """An adapted linear at p = 0.5 with a given seed computes W x + scaling * B A (mask * x / (1 - p)) with numpy's
    mask of the same hash (<= 1e-5); over a large input the kept fraction is 1 - p (p = 0.5 and 0.1); other seeds
    (modules, micro-batches, steps, dp replicas) give other masks; a row-parallel tp shard draws its columns' slice of
    one process's mask."""
    from mindrlhf.models import DecoderConfig
    from mindrlhf.models.decoder import CausalLM
    from mindrlhf.models.hash_dropout import dropout_multiplier
    from mindrlhf.models.lora import dropout_seed, lora_modules, set_dropout_seeds
    from mindrlhf.models.shard import ModelShard
    from mindrlhf.testing import make_tiny_qwen2

    path = make_tiny_qwen2(tmp_path / "m")
    model = load_model(path)
    apply_lora(model, LoRASpec(r=4, alpha=8, dropout=0.5, seed=7))
    set_adapter_weights(model, _random_adapter(model))
    set_dropout_seeds(model, step=2, dp_rank=1, micro_batch=3)
    cells = dict(lora_modules(model))
    name = "model.layers.1.mlp.down_proj"
    cell = cells[name]
    seed = dropout_seed(7, 2, 1, 3, f"CAUSAL_LM:{name}")
    assert int(cell.lora_dropout_seed.asnumpy()) == seed >= 0
    x = np.random.default_rng(0).normal(size=(6, cell.weight.shape[1])).astype(np.float32)
    keep = _numpy_keep(seed, 6, x.shape[1], 0.5)
    w, a, b = (t.asnumpy().astype(np.float64) for t in (cell.weight, cell.lora_A.weight, cell.lora_B.weight))
    want = x @ w.T + cell.lora_scaling * ((x * keep / 0.5) @ a.T) @ b.T
    np.testing.assert_allclose(cell(Tensor(x)).asnumpy(), want, rtol=0, atol=1e-5)
    assert 0.3 < keep.mean() < 0.7

    big = Tensor(np.ones((512, 1024), np.float32))
    for p in (0.5, 0.1):
        for s in (1, 12345, 2 ** 31 - 1):
            got = dropout_multiplier(big, Tensor(np.int32(s)), p, 0).asnumpy()
            np.testing.assert_array_equal(got, _numpy_keep(s, 512, 1024, p) * np.float32(1 / (1 - p)))
            assert abs((got > 0).mean() - (1 - p)) < 0.005, (p, s)
    masks = [dropout_multiplier(big, Tensor(np.int32(s)), 0.5, 0).asnumpy() > 0 for s in (1, 2)]
    assert 0.45 < (masks[0] != masks[1]).mean() < 0.55  # independent-looking masks for neighbouring seeds
    np.testing.assert_array_equal(dropout_multiplier(big, Tensor(np.int32(-1)), 0.5, 0).asnumpy(), 1.0)
    seeds = [int(c.lora_dropout_seed.asnumpy()) for c in cells.values()]
    assert len(set(seeds)) == len(seeds)  # a mask per module
    assert len({dropout_seed(7, *k, name) for k in ((2, 1, 3), (2, 1, 4), (3, 1, 3), (2, 0, 3))}) == 4

    config = DecoderConfig.from_file(path)
    o = "model.layers.0.self_attn.o_proj"
    in_features = config.num_attention_heads * config.head_dim
    for rank in range(2):  # built in-process, no collective runs
        shard = CausalLM(config, shard=ModelShard(tp=2, tp_rank=rank, tp_group="tp"))
        apply_lora(shard, LoRASpec(r=4, alpha=8, dropout=0.5))
        row = dict(lora_modules(shard))[o]
        half = in_features // 2
        assert row.lora_col_offset == rank * half
        got = dropout_multiplier(Tensor(np.ones((8, half), np.float32)), Tensor(np.int32(99)), 0.5,
                                 row.lora_col_offset).asnumpy()
        np.testing.assert_array_equal(got > 0, _numpy_keep(99, 8, in_features, 0.5)[:, rank * half:(rank + 1) * half])


def test_a_split_factor_counts_as_split_in_the_grad_norm_and_the_shapes_cover_every_stage(tiny_qwen2_dir):
    """Under tp the global grad norm weights each shard's squares: a factor split with its layer (B of a
    column-parallel layer, A of a row-parallel one) counts each rank's slice once, a replicated factor (the other one)
    1/tp on each rank. ``adapter_shapes`` lists the whole model's adapters (every pipeline stage's) with the shapes
    one process holds, so every rank assembles the same tensors for a checkpoint."""
    from mindrlhf.models.family import COLUMN, REPLICATED, ROW, split_kind
    from mindrlhf.models.lora import adapter_shapes
    from mindrlhf.parallel.groups import ParallelGroups
    from mindrlhf.parallel.layout import ParallelLayout
    from mindrlhf.trainer.update import _norm_weights

    names = ["model.layers.0.self_attn.q_proj.lora_A.weight", "model.layers.0.self_attn.q_proj.lora_B.weight",
             "model.layers.1.mlp.down_proj.lora_A.weight", "model.layers.1.mlp.down_proj.lora_B.weight",
             "score.weight"]
    assert [split_kind(n) for n in names] == [REPLICATED, COLUMN, ROW, REPLICATED, REPLICATED]
    groups = ParallelGroups(ParallelLayout(tp=2), 0, 0, 0, 0, "tp", None, None, None, None, None)
    assert _norm_weights(names, groups, tied=False).tolist() == [0.5, 1.0, 1.0, 0.5, 0.5]
    model = load_model(tiny_qwen2_dir)
    spec = LoRASpec(r=4, alpha=8, target_modules=("q_proj", "down_proj"), modules_to_save=("score",))
    apply_lora(model, spec)
    want = {name: array.shape for name, array in adapter_weights(model).items()}
    assert adapter_shapes(model.config, spec) == want and len(want) == 4 * model.config.num_hidden_layers

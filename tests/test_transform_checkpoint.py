"""Parallel layouts, Megatron sharding, MindSpore strategy files and the offline transform tool."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict

import numpy as np
import pytest

from mindrlhf.checkpoint.hf_io import load_ms_checkpoint, open_weights, save_ms_checkpoint
from mindrlhf.errors import MindRLHFError
from mindrlhf.models.config import DecoderConfig
from mindrlhf.parallel import sharding
from mindrlhf.parallel.layout import ParallelLayout
from mindrlhf.parallel.strategy import check_strategy, layout_of, read_strategy, strategy_entries, write_strategy
from mindrlhf.tools.transform_checkpoint import main as transform


# ---------------------------------------------------------------------------------------------
# fixtures: the tiny HF models as MindSpore checkpoints with config.json next to them
# ---------------------------------------------------------------------------------------------
def _as_ckpt(hf_dir: Path, out_dir: Path, dtype: str = "float32") -> Path:
    out_dir.mkdir(parents=True)
    save_ms_checkpoint(open_weights(hf_dir), out_dir / "model.ckpt", dtype)
    shutil.copyfile(hf_dir / "config.json", out_dir / "config.json")
    return out_dir / "model.ckpt"


@pytest.fixture(scope="module")
def qwen_ckpt(tiny_qwen2_dir, tmp_path_factory) -> Path:
    """Qwen2: tied embeddings, q/k/v bias, 4 heads / 2 kv heads, 2 layers."""
    return _as_ckpt(tiny_qwen2_dir, tmp_path_factory.mktemp("qwen_src") / "src")


@pytest.fixture(scope="module")
def llama_ckpt(tiny_llama_dir, tmp_path_factory) -> Path:
    """Llama: separate lm_head, no bias, 8 heads / 2 kv heads, 3 layers."""
    return _as_ckpt(tiny_llama_dir, tmp_path_factory.mktemp("llama_src") / "src")


def _config(ckpt: Path) -> DecoderConfig:
    return DecoderConfig.from_file(ckpt.parent / "config.json")


def _run(capsys, *args: str) -> str:
    code = transform([*map(str, args), "--no_progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def _fail(capsys, *args: str) -> str:
    code = transform([*map(str, args), "--no_progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def _shards(out: Path, world: int) -> Dict[int, Dict[str, np.ndarray]]:
    assert sorted(p.name for p in out.glob("rank_*")) == sorted(f"rank_{r}" for r in range(world))
    return {r: load_ms_checkpoint(out / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in range(world)}


def _assert_same(got: Dict[str, np.ndarray], want: Dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        assert got[name].dtype == want[name].dtype, name
        assert np.array_equal(got[name], want[name]), name  # bit-exact (no NaNs in these weights)


# ---------------------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------------------
def test_rank_coordinates_and_groups_megatron_order():
    lay = ParallelLayout(dp=2, tp=2, pp=2)
    assert [tuple(lay.coords(r)) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1), (0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1)]  # (dp, pp, tp)
    assert all(lay.rank_of(*lay.coords(r)) == r for r in range(8))
    assert lay.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.tp_group(6) == [6, 7] and lay.dp_group(5) == [5, 7] and lay.pp_group(2) == [2, 6]
    assert lay.stage_ranks(1) == [4, 5, 6, 7]
    assert ParallelLayout.parse("2, 1, 4") == ParallelLayout(2, 1, 4)


def test_pipeline_stage_ownership(qwen_ckpt, llama_ckpt):
    qwen, llama = _config(qwen_ckpt), _config(llama_ckpt)
    lay = ParallelLayout(1, 1, 2)
    assert list(lay.stage_layers(0, qwen)) == [0] and list(lay.stage_layers(1, qwen)) == [1]
    first, last = lay.stage_params(0, qwen), lay.stage_params(1, qwen)
    # tied embeddings: the first stage embeds, the last stage projects with its own copy
    assert "model.embed_tokens.weight" in first and "model.embed_tokens.weight" in last
    assert "model.norm.weight" in last and "model.norm.weight" not in first
    assert all(n.startswith("model.layers.1.") for n in last if n.startswith("model.layers."))
    lay3 = ParallelLayout(1, 1, 3)
    assert "model.embed_tokens.weight" not in lay3.stage_params(2, llama)  # untied: lm_head instead
    assert {"lm_head.weight", "model.norm.weight"} <= set(lay3.stage_params(2, llama))
    assert lay3.param_stages("model.layers.1.mlp.up_proj.weight", llama) == (1,)


@pytest.mark.parametrize("layout, world, fields, message", [
    (ParallelLayout(2, 2, 1), 8, {}, "world size 8 != dp*tp*pp = 4"),
    (ParallelLayout(1, 3, 1), None, {}, "num_attention_heads=8 is not divisible by tp=3"),
    (ParallelLayout(1, 4, 1), None, {}, "num_key_value_heads=2 is not divisible by tp=4"),
    (ParallelLayout(1, 2, 1), None, {"vocab_size": 1001}, "vocab_size=1001 is not divisible by tp=2"),
    (ParallelLayout(1, 2, 1), None, {"intermediate_size": 161}, "intermediate_size=161 is not divisible by tp=2"),
    (ParallelLayout(1, 1, 2), None, {}, "num_hidden_layers=3 is not divisible by pp=2"),
])
def test_layout_validation_names_both_numbers(tiny_llama_dir, layout, world, fields, message):
    raw = json.loads((tiny_llama_dir / "config.json").read_text())
    raw.update(fields)
    config = DecoderConfig.from_hf_dict(raw)
    with pytest.raises(MindRLHFError) as err:
        layout.validate(config, world_size=world)
    assert message in str(err.value)
    with pytest.raises(MindRLHFError, match="tp=0"):
        ParallelLayout(1, 0, 1)


# ---------------------------------------------------------------------------------------------
# sharding (numpy)
# ---------------------------------------------------------------------------------------------
def test_shard_specs_and_hand_slices(llama_ckpt):
    config, full = _config(llama_ckpt), load_ms_checkpoint(llama_ckpt)
    lay = ParallelLayout(1, 2, 1)
    p = "model.layers.0."
    assert sharding.shard_spec(p + "self_attn.q_proj.weight", config, lay) == 0
    assert sharding.shard_spec(p + "mlp.gate_proj.weight", config, lay) == 0
    assert sharding.shard_spec(p + "self_attn.o_proj.weight", config, lay) == 1
    assert sharding.shard_spec(p + "mlp.down_proj.weight", config, lay) == 1
    assert sharding.shard_spec("lm_head.weight", config, lay) == 0
    assert sharding.shard_spec(p + "input_layernorm.weight", config, lay) is None
    assert sharding.shard_spec(p + "self_attn.q_proj.weight", config, ParallelLayout(2, 1, 1)) is None
    with pytest.raises(MindRLHFError, match="model.layers.7.mlp.up_proj.weight"):
        sharding.shard_spec("model.layers.7.mlp.up_proj.weight", config, lay)
    hd = config.head_dim  # 8 heads, 2 kv heads: tp rank 1 holds q heads 4..7 and kv head 1
    k = sharding.shard_tensor(p + "self_attn.k_proj.weight", full[p + "self_attn.k_proj.weight"], config, lay, 1)
    assert np.array_equal(k, full[p + "self_attn.k_proj.weight"][hd:2 * hd])
    q = sharding.shard_tensor(p + "self_attn.q_proj.weight", full[p + "self_attn.q_proj.weight"], config, lay, 1)
    assert np.array_equal(q, full[p + "self_attn.q_proj.weight"][4 * hd:8 * hd])
    o = sharding.shard_tensor(p + "self_attn.o_proj.weight", full[p + "self_attn.o_proj.weight"], config, lay, 0)
    assert np.array_equal(o, full[p + "self_attn.o_proj.weight"][:, :4 * hd])
    emb = sharding.shard_tensor("model.embed_tokens.weight", full["model.embed_tokens.weight"], config, lay, 1)
    assert np.array_equal(emb, full["model.embed_tokens.weight"][500:])
    for name, arr in full.items():
        shards = [sharding.shard_tensor(name, arr, config, lay, t) for t in range(2)]
        assert np.array_equal(sharding.merge_shards(name, shards, config, lay), arr)


@pytest.mark.parametrize("model, train, infer", [
    ("qwen", ParallelLayout(1, 2, 2), ParallelLayout(2, 2, 1)),  # the train→infer case of the issue
    ("llama", ParallelLayout(1, 2, 3), ParallelLayout(3, 2, 1)),
    ("llama", ParallelLayout(2, 1, 1), ParallelLayout(1, 2, 3)),
])
def test_reshard_plan_reproduces_direct_shards(model, train, infer, qwen_ckpt, llama_ckpt):
    ckpt = qwen_ckpt if model == "qwen" else llama_ckpt
    config, full = _config(ckpt), load_ms_checkpoint(ckpt)
    train_states = {r: {n: a.copy() for n, a in sharding.rank_state(full, config, train, r).items()}
                    for r in range(train.world_size)}
    for r in range(infer.world_size):
        plan = sharding.reshard(train, infer, config, r)
        got = sharding.apply_reshard(plan, train_states)
        _assert_same(got, sharding.rank_state(full, config, infer, r))
        for pp in plan.values():  # pieces tile the destination exactly once
            cover = np.zeros(pp.shape, np.int32)
            for piece in pp.pieces:
                cover[piece.dst_index] += 1
            assert (cover == 1).all(), pp.name
        if r in range(train.world_size):  # data the rank already holds is never fetched from elsewhere
            own = train_states[r]
            for name, pp in plan.items():
                if name in own and sharding.shard_spec(name, config, train) is None and len(pp.pieces) == 1:
                    assert pp.pieces[0].src_rank == r, name


# ---------------------------------------------------------------------------------------------
# strategy files
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".json", ".ckpt"])
def test_strategy_files_roundtrip_and_mindspore_reads_them(qwen_ckpt, tmp_path, suffix):
    import mindspore as ms

    config, lay = _config(qwen_ckpt), ParallelLayout(2, 2, 2)
    merged = read_strategy(write_strategy(tmp_path / f"s{suffix}", config, lay))
    expected = strategy_entries(config, lay)
    assert merged.stages == (0, 1) and merged.stage_size == 4 and merged.world_size == 8
    for name, e in expected.items():
        got = merged.entries[name]
        assert (got.dev_matrix, got.tensor_map, got.stages) == ((2, 2), e.tensor_map, e.stages)
        assert got.param_split_shape == () and got.indices_offset == ()
    assert expected["model.layers.0.self_attn.o_proj.weight"].tensor_map == (-1, 0)
    assert expected["model.embed_tokens.weight"].stages == (0, 1)
    assert layout_of(merged, config) == lay
    check_strategy(merged, config)
    # per-stage files in MindSpore's compiled form, merged by MindSpore, equal our merged file
    stage_dir = tmp_path / "stages"
    for s in range(2):
        write_strategy(stage_dir / f"stage{s}{suffix}", config, lay, stage=s)
    ms.parallel.merge_pipeline_strategys(str(stage_dir), str(tmp_path / f"ms_merged{suffix}"))
    ms_merged = read_strategy(tmp_path / f"ms_merged{suffix}")
    assert {n: (e.dev_matrix, e.tensor_map, e.stages) for n, e in ms_merged.entries.items()} == \
           {n: (e.dev_matrix, e.tensor_map, e.stages) for n, e in merged.entries.items()}
    layouts = ms.parallel.build_searched_strategy(str(tmp_path / f"s{suffix}"))
    assert list(layouts["1-model.norm.weight"].dev_matrix[0].dim) == [2, 2]


def test_strategy_for_another_model_is_rejected(qwen_ckpt, llama_ckpt, tmp_path):
    qwen, llama = _config(qwen_ckpt), _config(llama_ckpt)
    lay = ParallelLayout(1, 2, 1)
    with pytest.raises(MindRLHFError, match=r"model.embed_tokens.weight has tensor_shape \(151936, 64\) but .* "
                                            r"implies \(1000, 64\)"):
        check_strategy(read_strategy(write_strategy(tmp_path / "q.json", qwen, lay)), llama, config_name="llama")
    # protobuf records no shapes: the parameter names give it away
    with pytest.raises(MindRLHFError, match="no entry for parameter model.layers.2"):
        check_strategy(read_strategy(write_strategy(tmp_path / "q.ckpt", qwen, lay)), llama, config_name="llama")
    with pytest.raises(MindRLHFError, match=r"no entry for parameter model.layers.0.self_attn.q_proj.bias \(64,\)"):
        check_strategy(read_strategy(write_strategy(tmp_path / "l.ckpt", llama, lay)), qwen, config_name="qwen")


# ---------------------------------------------------------------------------------------------
# the CLI
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model, layout", [("llama", "1,2,1"), ("qwen", "1,2,2"), ("llama", "2,2,1")])
def test_full_to_sharded_to_merged_is_bit_exact(model, layout, qwen_ckpt, llama_ckpt, tmp_path, capsys):
    ckpt = qwen_ckpt if model == "qwen" else llama_ckpt
    config, full = _config(ckpt), load_ms_checkpoint(ckpt)
    lay = ParallelLayout.parse(layout)
    src_listing = sorted(p.name for p in ckpt.parent.iterdir())
    out = _run(capsys, "--src_checkpoint", ckpt, "--dst_checkpoint", tmp_path / "sharded", "--layout", layout)
    assert f"wrote {lay.world_size} rank checkpoint(s)" in out
    shards = _shards(tmp_path / "sharded", lay.world_size)
    for r in range(lay.world_size):  # each rank holds exactly its stage's parameters, sliced by numpy's rule
        _assert_same(shards[r], sharding.rank_state(full, config, lay, r))
        assert (tmp_path / "sharded" / f"rank_{r}" / "config.json").is_file()
    assert layout_of(read_strategy(tmp_path / "sharded" / "strategy.json"), config) == lay
    _run(capsys, "--src_checkpoint", tmp_path / "sharded", "--dst_checkpoint", tmp_path / "merged", "--merge")
    _assert_same(_shards(tmp_path / "merged", 1)[0], full)
    # the merged rank file is a normal checkpoint: config next to it, loads with open_weights
    assert sorted(dict(open_weights(tmp_path / "merged" / "rank_0" / "checkpoint_0.ckpt"))) == sorted(full)
    assert sorted(p.name for p in ckpt.parent.iterdir()) == src_listing  # source dir untouched


def test_sharded_tp2_to_other_layouts(llama_ckpt, tmp_path, capsys):
    config, full = _config(llama_ckpt), load_ms_checkpoint(llama_ckpt)
    _run(capsys, "--src_checkpoint", llama_ckpt, "--dst_checkpoint", tmp_path / "tp2", "--layout", "1,2,1")
    _run(capsys, "--src_checkpoint", tmp_path / "tp2", "--dst_checkpoint", tmp_path / "tp1", "--layout", "1,1,1")
    _assert_same(_shards(tmp_path / "tp1", 1)[0], full)
    # explicit --src_strategy / --dst_strategy (protobuf), sharded -> dp2 x tp1 x pp3
    write_strategy(tmp_path / "dst.ckpt", config, ParallelLayout(2, 1, 3))
    _run(capsys, "--src_checkpoint", tmp_path / "tp2", "--src_strategy", tmp_path / "tp2" / "strategy.json",
         "--dst_checkpoint", tmp_path / "dp2pp3", "--dst_strategy", tmp_path / "dst.ckpt", "--prefix", "net")
    lay = ParallelLayout(2, 1, 3)
    for r in range(6):
        got = load_ms_checkpoint(tmp_path / "dp2pp3" / f"rank_{r}" / f"net{r}.ckpt")
        _assert_same(got, sharding.rank_state(full, config, lay, r))
    assert (tmp_path / "dp2pp3" / "strategy.ckpt").is_file()


def test_engines_agree_and_keep_bf16(tiny_qwen2_dir, qwen_ckpt, tmp_path, capsys):
    import mindspore as ms

    config = _config(qwen_ckpt)
    bf16 = _as_ckpt(tiny_qwen2_dir, tmp_path / "bf16", "bf16")
    for engine in ("mindspore", "numpy"):
        _run(capsys, "--src_checkpoint", bf16, "--dst_checkpoint", tmp_path / f"a_{engine}", "--layout", "1,2,2",
             "--engine", engine)
        _run(capsys, "--src_checkpoint", tmp_path / f"a_{engine}", "--dst_checkpoint", tmp_path / f"b_{engine}",
             "--layout", "2,2,1", "--engine", engine)
    for stage in ("a", "b"):
        ms_shards, np_shards = _shards(tmp_path / f"{stage}_mindspore", 4), _shards(tmp_path / f"{stage}_numpy", 4)
        for r in range(4):
            _assert_same(np_shards[r], ms_shards[r])
    raw = ms.load_checkpoint(str(tmp_path / "b_mindspore" / "rank_3" / "checkpoint_3.ckpt"))
    assert {p.dtype for p in raw.values()} == {ms.bfloat16}
    # an HF directory is a valid full source too (streamed into a temporary .ckpt for MindSpore)
    _run(capsys, "--src_checkpoint", tiny_qwen2_dir, "--dst_checkpoint", tmp_path / "from_hf", "--layout", "2,2,1")
    full = load_ms_checkpoint(qwen_ckpt)
    for r, got in _shards(tmp_path / "from_hf", 4).items():
        _assert_same(got, sharding.rank_state(full, config, ParallelLayout(2, 2, 1), r))


def test_cli_errors(qwen_ckpt, llama_ckpt, tmp_path, capsys):
    # a strategy written for model A used with model B: one line naming the parameter and shapes
    _run(capsys, "--src_checkpoint", qwen_ckpt, "--dst_checkpoint", tmp_path / "q", "--layout", "1,2,1")
    err = _fail(capsys, "--src_checkpoint", llama_ckpt, "--dst_checkpoint", tmp_path / "l",
                "--dst_strategy", tmp_path / "q" / "strategy.json")
    assert "model.embed_tokens.weight has tensor_shape (151936, 64)" in err and "(1000, 64)" in err
    assert not (tmp_path / "l").exists()  # nothing written
    # a sharded checkpoint of model A read with model B's config
    err = _fail(capsys, "--src_checkpoint", tmp_path / "q", "--dst_checkpoint", tmp_path / "l2", "--merge",
                "--config", llama_ckpt.parent / "config.json")
    assert "model.embed_tokens.weight" in err
    # layout errors name both numbers
    err = _fail(capsys, "--src_checkpoint", llama_ckpt, "--dst_checkpoint", tmp_path / "x", "--layout", "1,4,1")
    assert "num_key_value_heads=2" in err and "tp=4" in err
    # never write into the source directory; refuse to clobber without --overwrite
    err = _fail(capsys, "--src_checkpoint", llama_ckpt, "--dst_checkpoint", llama_ckpt.parent / "out",
                "--layout", "1,2,1")
    assert "overlaps the source directory" in err
    err = _fail(capsys, "--src_checkpoint", qwen_ckpt, "--dst_checkpoint", tmp_path / "q", "--layout", "1,2,1")
    assert "--overwrite" in err
    _run(capsys, "--src_checkpoint", qwen_ckpt, "--dst_checkpoint", tmp_path / "q", "--layout", "1,1,1",
         "--overwrite")
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == ["config.json", "rank_0", "strategy.json"]
    # a missing rank
    _run(capsys, "--src_checkpoint", qwen_ckpt, "--dst_checkpoint", tmp_path / "q2", "--layout", "1,2,1")
    shutil.rmtree(tmp_path / "q2" / "rank_1")
    err = _fail(capsys, "--src_checkpoint", tmp_path / "q2", "--dst_checkpoint", tmp_path / "m", "--merge")
    assert "rank_1/ is missing" in err
    err = _fail(capsys, "--src_checkpoint", qwen_ckpt, "--dst_checkpoint", tmp_path / "m", "--merge")
    assert "--merge needs a sharded source" in err


def test_mindspore_batch_api_per_stage_strategies_and_safetensors_shards(llama_ckpt, tmp_path, capsys):
    import mindspore as ms

    config, full = _config(llama_ckpt), load_ms_checkpoint(llama_ckpt)
    lay = ParallelLayout(1, 2, 3)
    _run(capsys, "--src_checkpoint", llama_ckpt, "--dst_checkpoint", tmp_path / "tool", "--layout", "1,2,3",
         "--strategy_format", "protobuf")
    # mindspore.transform_checkpoints itself, fed our protobuf strategy, writes the same shards
    (tmp_path / "ms_src" / "rank_0").mkdir(parents=True)
    shutil.copyfile(llama_ckpt, tmp_path / "ms_src" / "rank_0" / "model.ckpt")
    ms.transform_checkpoints(str(tmp_path / "ms_src"), str(tmp_path / "ms_out"), "checkpoint_", None,
                             str(tmp_path / "tool" / "strategy.ckpt"))
    tool, batch = _shards(tmp_path / "tool", 6), _shards(tmp_path / "ms_out", 6)
    for r in range(6):
        _assert_same(batch[r], tool[r])
    # a directory of per-stage strategy files (MindSpore's compiled form) is merged by MindSpore
    for s in range(3):
        write_strategy(tmp_path / "stages" / f"strategy_stage{s}.json", config, lay, stage=s)
    _run(capsys, "--src_checkpoint", tmp_path / "tool", "--src_strategy", tmp_path / "stages",
         "--dst_checkpoint", tmp_path / "merged", "--merge")
    _assert_same(_shards(tmp_path / "merged", 1)[0], full)
    # .safetensors shards: MindSpore's .ckpt transform cannot read them, the numpy engine can
    st = tmp_path / "st"
    for r in range(6):
        (st / f"rank_{r}").mkdir(parents=True)
        save_ms_checkpoint(sharding.rank_state(full, config, lay, r).items(), st / f"rank_{r}" / "w.safetensors")
    shutil.copyfile(tmp_path / "tool" / "strategy.ckpt", st / "strategy.ckpt")
    shutil.copyfile(llama_ckpt.parent / "config.json", st / "config.json")
    err = _fail(capsys, "--src_checkpoint", st, "--dst_checkpoint", tmp_path / "st_ms", "--merge",
                "--engine", "mindspore")
    assert "--engine numpy" in err
    out = _run(capsys, "--src_checkpoint", st, "--dst_checkpoint", tmp_path / "st_merged", "--merge")
    assert "numpy engine" in out
    _assert_same(_shards(tmp_path / "st_merged", 1)[0], full)

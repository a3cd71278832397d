"""Decoder layers run as shared compiled graphs (models.layer_graphs) equal pynative layers."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from grpo_runs import byhand
from test_packing import _rows


def _grads_three_ways(model, loss):
    """Loss value and every parameter's gradient, with pynative layers and with the layer graphs recomputing each
    layer (recompute full) and keeping its linear outputs (recompute selective)."""
    import mindspore as ms

    params = model.trainable_params()
    fn = ms.value_and_grad(loss, None, params)
    plain = fn()
    with model.compiled_layers():
        graphs = fn()
    with model.compiled_layers(keep=True):
        kept = fn()
    return params, plain, graphs, kept


def _assert_same(params, plain, *others):
    v_plain, g_plain = plain
    for v_graphs, g_graphs in others:
        np.testing.assert_allclose(v_graphs.asnumpy(), v_plain.asnumpy(), rtol=1e-5)
        for p, a, b in zip(params, g_plain, g_graphs):
            a, b = a.asnumpy(), b.asnumpy()
            assert np.linalg.norm(a) > 0, p.name
            # A key bias shifts all of a query's scores equally, which the softmax cancels: its true
            # gradient is 0 and both paths hold rounding noise, so it gets a looser bound.
            rtol = 1e-3 if p.name.endswith("k_proj.bias") else 1e-5
            assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(a), p.name


def _check_batch(model, seed: int, rows: slice) -> None:
    from mindspore import Tensor

    from mindrlhf.models.packing import pack_shared_prompts

    ids, mask, comp, present = (a[rows] for a in _rows(model.config.vocab_size, seed))
    weights = Tensor(np.random.default_rng(seed).normal(size=present.shape).astype(np.float32) * present)
    packed = pack_shared_prompts(ids, mask, comp.shape[1])

    def padded_loss():
        return (model.sequence_logprobs(Tensor(ids), Tensor(mask), Tensor(comp), 0.7) * weights).sum()

    def packed_loss():
        logp = model.packed_logprobs(*(Tensor(a) for a in packed.arrays()), Tensor(comp), 0.7)
        return (logp * weights).sum()

    _assert_same(*_grads_three_ways(model, padded_loss))
    _assert_same(*_grads_three_ways(model, packed_loss))
    with model.compiled_layers(keep=True):  # forward only (log-prob passes): nothing recorded, nothing kept
        got = model.sequence_logprobs(Tensor(ids), Tensor(mask), Tensor(comp), 0.7).asnumpy()
        assert model.layer_graphs.kept_count == 0
    want = model.sequence_logprobs(Tensor(ids), Tensor(mask), Tensor(comp), 0.7).asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory):
    """Qwen3: per-head q/k norms inside the attention piece."""
    from mindrlhf.testing import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"), vocab_size=1000)


@pytest.mark.parametrize("which", ["tiny_qwen2_dir", "tiny_llama_dir", "tiny_qwen3_dir"])
def test_layer_graphs_equal_pynative_layers_packed_and_padded(which, request):
    """Log-probs and all parameter gradients (the layer graphs recomputing each layer, and keeping its linear
    outputs), for shared-prompt packed rows and for padded rows of
    prompts of different lengths; then a second, differently shaped batch through the same graphs
    (dynamic shapes: no stale shape, no recompilation needed for correctness)."""
    from mindrlhf.models import load_model

    model = load_model(request.getfixturevalue(which))
    _check_batch(model, 0, slice(None))
    _check_batch(model, 1, slice(0, 4))
    assert not model._use_layer_graphs  # the block ends: plain layers again


def _static_equals_dynamic(model, width: int) -> None:
    """Loss and gradients through the static and the dynamic layer graphs, padded and packed rows of
    ``width`` completion columns, exactly equal."""
    import mindspore as ms
    from mindspore import Tensor

    from mindrlhf.models.packing import pack_shared_prompts

    ids, mask, comp, present = _rows(model.config.vocab_size)
    i, m, c = ids[:, :8 + width - 1], mask[:, :8 + width - 1], comp[:, :width]
    weights = Tensor(np.random.default_rng(width).normal(size=c.shape).astype(np.float32) * present[:, :width])
    packed = pack_shared_prompts(i, m, width)

    def padded_loss():
        return (model.sequence_logprobs(Tensor(i), Tensor(m), Tensor(c), 0.7) * weights).sum()

    def packed_loss():
        return (model.packed_logprobs(*(Tensor(a) for a in packed.arrays()), Tensor(c), 0.7) * weights).sum()

    params = model.trainable_params()
    for loss in (padded_loss, packed_loss):
        fn = ms.value_and_grad(loss, None, params)
        with model.compiled_layers(static=False):
            dynamic = fn()
        with model.compiled_layers(static=True):
            static = fn()
        np.testing.assert_array_equal(static[0].asnumpy(), dynamic[0].asnumpy())
        for p, a, b in zip(params, dynamic[1], static[1]):
            np.testing.assert_array_equal(b.asnumpy(), a.asnumpy(), err_msg=p.name)


def test_static_layer_graphs_equal_the_dynamic_ones_for_two_lengths(tiny_qwen2_dir):
    """parallel.layer_graph_shapes static: the layer graphs compiled per input shape give the loss and every
    gradient of the dynamic-shape graphs exactly, for padded and shared-prompt packed rows of two sequence
    lengths; beyond ``max_static`` shapes the dynamic graphs run (still the same numbers), no more compiles."""
    from mindrlhf.models import load_model

    model = load_model(tiny_qwen2_dir)
    with model.compiled_layers():
        pass
    model.layer_graphs.max_static = 3  # of the 4 shapes below, the last runs the dynamic graphs
    for width in (6, 4):  # completion columns: rows of 13 and 11 tokens
        _static_equals_dynamic(model, width)
    assert model.layer_graphs.static_shapes == 3


# Torch imported before MindSpore (as mindrlhf.testing does when it writes a model), then a stage trained through
# the static layer graphs: the finalizer freeing them ran at interpreter exit into a torn-down MindSpore runtime.
_TORCH_FIRST = """
import json, sys
from pathlib import Path
from mindrlhf.testing import add_tokenizer, make_tiny_qwen2
root = Path(sys.argv[1])
model = add_tokenizer(make_tiny_qwen2(root / "model", seed=5), sys.argv[2])
from mindrlhf import sft
rows = root / "rows.jsonl"
rows.write_text("".join(json.dumps({"prompt": f"Q: {i}?\\nA:", "completion": f" {8 * i}"}) + "\\n" for i in range(4)))
assert sft.main(["--model", str(model), "--train_file", str(rows), "--output_dir", str(root / "out"),
                 "--max_steps", "1", "--batch_size", "2", "--micro_batch_size", "2", "--max_length", "64",
                 "--recompute", "full", "--layer_graph_shapes", "static", "--progress_bar", "false",
                 "--save_steps", "0", "--tensorboard", "false"]) == 0
print("trained")
"""


@pytest.mark.slow
def test_a_process_that_imported_torch_first_exits_cleanly_after_static_layer_graphs(tmp_path, qwen_tokenizer_dir):
    """A process that trained through static layer graphs after importing torch exits 0 (it aborted with
    exit 134, "PyThreadState_Get ... GIL is released", when the graphs were freed at exit)."""
    import subprocess
    import sys

    script = tmp_path / "torch_first.py"
    script.write_text(_TORCH_FIRST)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(qwen_tokenizer_dir)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "trained" in proc.stdout, proc.stderr[-2000:]


def test_layer_graphs_follow_the_weights(tiny_qwen2_dir):
    """The graphs read each layer's current weights: after a layer changes, so does the output."""
    from mindspore import Tensor

    from mindrlhf.models import load_model

    model = load_model(tiny_qwen2_dir)
    ids, mask, comp, _ = _rows(model.config.vocab_size)
    args = (Tensor(ids), Tensor(mask), Tensor(comp))
    with model.compiled_layers():
        before = model.sequence_logprobs(*args).asnumpy()
        w = model.model.layers[1].mlp.down_proj.weight
        w.set_data(Tensor(w.asnumpy() * 1.5))
        after = model.sequence_logprobs(*args).asnumpy()
    np.testing.assert_allclose(after, model.sequence_logprobs(*args).asnumpy(), rtol=1e-5, atol=1e-6)
    assert np.abs(after - before).max() > 1e-3


def test_a_released_frozen_model_frees_its_weights_and_reads_them_back(tiny_qwen2_dir, tmp_path):
    """offload_models (trainer.update.ReleasableModel): release() leaves every parameter a one-element
    placeholder; the next forward reads the weights back through reload and the layer graphs use them — the
    same log-probs as before, or, reloaded from another model's files, that model's log-probs."""
    from mindrlhf.models import load_model
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.parallel.groups import data_parallel_groups
    from mindrlhf.parallel.pipeline import PipelineRunner
    from mindrlhf.testing import make_tiny_qwen2
    from mindrlhf.trainer.update import ReleasableModel

    other = make_tiny_qwen2(tmp_path / "other", seed=11)
    model = load_model(tiny_qwen2_dir)
    ids, mask, comp, _ = _rows(model.config.vocab_size)
    micro = [{"input_ids": ids, "attention_mask": mask, "completion_ids": comp}]
    runner = PipelineRunner(model, data_parallel_groups(0, 1), head=LogProbHead(), layer_graphs=True)
    source = [tiny_qwen2_dir]
    frozen = ReleasableModel(runner, model, reload=lambda: load_model(source[0]))
    before = frozen.forward(micro)[0]
    frozen.release()
    assert all(p.shape == (1,) for p in model.get_parameters())
    np.testing.assert_array_equal(frozen.forward(micro)[0], before)
    assert all(p.shape != (1,) for p in model.get_parameters())
    source[0] = other
    frozen.release()
    want = PipelineRunner(load_model(other), data_parallel_groups(0, 1), head=LogProbHead(),
                          layer_graphs=True).forward(micro)[0]
    np.testing.assert_array_equal(frozen.forward(micro)[0], want)
    assert np.abs(want - before).max() > 1e-3


@pytest.mark.parametrize("share", [pytest.param(True, id="packed"), pytest.param(
    False, id="padded", marks=byhand(False, "the packed rows run every layer graph and recompute mode").marks)])
def test_recompute_none_full_and_selective_give_the_same_losses_and_gradients(tiny_qwen2_dir, share):
    """``recompute none`` (``PipelineRunner(jit=True)``: the gradient pass one whole-model graph, compiled once
    for every shape by ``layer_graphs.jit_any_shape``), ``recompute full`` (the layer graphs, each layer's
    forward recomputed) and ``recompute selective`` (the layer graphs keeping each layer's linear outputs: no kept
    tensor left after a pass) give pynative's loss, aux values and every gradient, for the log-prob head and the
    statistics head (whose chunked pieces the whole graph takes as one chunk), on batches of three widths;
    the whole graph is compiled once for all of them, forward passes never use it, and it is freed with the
    runner."""
    import mindspore as ms
    from mindspore.graph.api import ms_compile_cache

    from mindrlhf.models import load_model
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.parallel.groups import data_parallel_groups
    from mindrlhf.parallel.pipeline import PipelineRunner

    model = load_model(tiny_qwen2_dir)
    model.set_chunk_rows(4)  # several chunks outside the whole graph, so its one chunk is compared with a loop

    def loss(logp, weights):
        return (logp * weights).sum(), (weights.sum(),)

    def stats_loss(out, weights):
        logp, entropy, correct = out
        return (logp * weights).sum() + 0.1 * (entropy * weights).sum(), ((correct * weights).sum(),)

    ways = {"pynative": dict(jit=False), "full": dict(jit=False, layer_graphs=True),
            "selective": dict(jit=False, layer_graphs=True, keep_activations=True),
            "none": dict(jit=True, layer_graphs=True)}
    groups = data_parallel_groups(0, 1)
    runners = {w: (PipelineRunner(model, groups, loss, share_prompts=share, **kw),
                   PipelineRunner(model, groups, stats_loss, head=LogProbHead(0.7, stats=True), share_prompts=share,
                                  **kw)) for w, kw in ways.items()}
    for seed, rows in ((0, slice(None)), (1, slice(0, 4)), (2, slice(1, 6))):
        ids, mask, comp, present = (a[rows] for a in _rows(model.config.vocab_size, seed))
        if seed == 2:  # a wider prompt and completion than the first batch
            ids, mask = np.pad(ids, ((0, 0), (5, 0))), np.pad(mask, ((0, 0), (5, 0)))
            comp, present = np.pad(comp, ((0, 0), (0, 3))), np.pad(present, ((0, 0), (0, 3)))
            ids, mask = np.concatenate([ids, comp[:, -4:-1]], 1), np.concatenate([mask, np.zeros_like(ids[:, :3])], 1)
        weights = (np.random.default_rng(seed).normal(size=present.shape) * present).astype(np.float32)
        mb = {"input_ids": ids.astype(np.int32), "attention_mask": mask.astype(np.int32),
              "completion_ids": comp.astype(np.int32), "weights": weights}
        for head in (0, 1):
            (g0, l0, a0), *others = (runners[w][head].loss_and_grads([mb], ["weights"]) for w in ways)
            for g1, l1, a1 in others:
                assert l1 == pytest.approx(l0, rel=1e-5)
                np.testing.assert_allclose(a1, a0, rtol=1e-5)
                for p, a, b in zip(model.trainable_params(), g0, g1):
                    a, b = a.asnumpy(), b.asnumpy()
                    # See _assert_same; the four ways sum in other orders, and a key projection's gradient is
                    # partly cancelled by the softmax too (1.01e-5 of its norm on an AMD Zen 5 box).
                    rtol = 1e-3 if p.name.endswith("k_proj.bias") else 3e-5
                    assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(a), (seed, head, p.name)
            assert model.layer_graphs.kept_count == 0
            # Forward passes run the layer graphs either way: the same arrays.
            for x, y in zip(*(np.atleast_1d(runners[w][head].forward([mb])[0]) for w in ("none", "full"))):
                np.testing.assert_array_equal(x, y)
    # One compiled whole-model graph per runner served every shape (MindSpore's set of compiled phases names
    # the piece; a static-shape jit adds one phase per new shape), and only for the gradient pass.
    for runner in runners["none"]:
        phases = [phase for phase in ms_compile_cache if f"_{id(runner):x}" in phase]
        assert len(phases) == 1 and "grad" in phases[0], phases
    assert ms.get_context("mode") == ms.PYNATIVE_MODE
    # The graphs are freed by release_graphs (the end of training) or with the runner (a process building several
    # trainers, like this test session, would otherwise keep every one's graph and buffers).
    released, dropped = (f"_{id(r):x}." for r in runners["none"])
    runners["none"][0].release_graphs()
    assert not [p for p in ms_compile_cache if released in p]
    del runners, runner
    gc.collect()
    assert not [p for p in ms_compile_cache if dropped in p]


@pytest.mark.slow
def test_graph_kernel_fusion_is_scoped_to_the_static_layer_graphs(tiny_qwen2_dir, tmp_path, monkeypatch):
    """LayerGraphs.graph_kernel (a measurement hook of bench/train_flops.py, no setting): the static layer graphs
    compiled with MindSpore's graph-kernel fusion (AKG) give the unfused graphs' loss and gradients within 1e-5
    (not bit for bit: the fusion did happen), and the process-wide ``enable_graph_kernel`` is off again after
    their compile, so no other graph is fused."""
    pytest.importorskip("decorator")  # AKG's TVM imports it; MindSpore does not require it
    import mindspore as ms
    from mindspore import Tensor

    from mindrlhf.models import load_model

    monkeypatch.chdir(tmp_path)  # AKG writes a log into the working directory
    monkeypatch.setenv("MS_COMPILER_CACHE_PATH", str(tmp_path))  # and its kernels under the cache path
    model = load_model(tiny_qwen2_dir)
    ids, mask, comp, present = _rows(model.config.vocab_size)
    weights = Tensor(np.random.default_rng(0).normal(size=comp.shape).astype(np.float32) * present)

    def loss():
        return (model.sequence_logprobs(Tensor(ids), Tensor(mask), Tensor(comp), 0.7) * weights).sum()

    params = model.trainable_params()
    fn = ms.value_and_grad(loss, None, params)
    with model.compiled_layers(static=True):
        plain = fn()
    with model.compiled_layers(static=True, graph_kernel=True):
        fused = fn()
    assert not ms.get_context("enable_graph_kernel")
    assert model.layer_graphs.static_shapes == 2  # one unfused, one fused pair
    np.testing.assert_allclose(fused[0].asnumpy(), plain[0].asnumpy(), rtol=1e-5)
    moved = 0.0
    for p, a, b in zip(params, plain[1], fused[1]):
        a, b = a.asnumpy(), b.asnumpy()
        rtol = 1e-3 if p.name.endswith("k_proj.bias") else 1e-5
        assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(a), p.name
        moved = max(moved, float(np.abs(a - b).max()))
    assert moved > 0  # the fused kernels ran

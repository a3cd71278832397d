"""Tensor-parallel shards of ``CausalLM`` (``ModelShard(tp>1)``) against the single-process model.

In process: parameter names/shapes of every rank equal ``sharding.rank_state``'s, and a tp=1
a tp shard reproduces ``CausalLM``'s logits, log-probs and gradients. Under msrun
(``tests/tp_worker.py``): tp=2 on 2 ranks and dp=2 × tp=2 on 4 ranks, for the tiny Qwen2 (q/k/v
bias, tied embeddings, GQA 4/2) and the tiny Llama (untied, GQA 8/2): the GRPO loss, the gathered
logits, the log-probs and each rank's gradient slice equal the single-process values. The same
launches run a tiny reward model (a ``score`` head, ``models.heads.ScoreHead``) under tp2, pp2 and
tp2 × pp2: its loss, scores and gradient slices equal one process too.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from grpo_runs import byhand, byhand_only, launch_env
from mindrlhf.parallel.layout import ParallelLayout
from tp_worker import BETA, score_loss

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "tp_worker.py"
PROMPT, COMPLETION, BATCH = 6, 5, 4


def _batch(vocab: int, seed: int, shared: bool = False) -> dict:
    """A fixed GRPO micro-batch: left-padded prompts, right-padded completions, mixed advantages.
    ``shared``: rows 0-1 and rows 2-3 are two completions of one prompt each (GRPO groups)."""
    rng = np.random.default_rng(seed)
    prompt_len = np.array([6, 6, 4, 4]) if shared else np.array([6, 3, 4, 1])
    completion_len = np.array([5, 2, 4, 3])
    prompt = rng.integers(0, vocab, (BATCH, PROMPT)).astype(np.int32)
    if shared:
        prompt[1], prompt[3] = prompt[0], prompt[2]
    prompt_mask = (np.arange(PROMPT)[None, :] >= PROMPT - prompt_len[:, None]).astype(np.int32)
    completion = rng.integers(0, vocab, (BATCH, COMPLETION)).astype(np.int32)
    completion_mask = (np.arange(COMPLETION)[None, :] < completion_len[:, None]).astype(np.int32)
    # Padding ids are arbitrary tokens (any id, like a real pad id) — masked out everywhere.
    full_ids = np.concatenate([prompt * prompt_mask, completion], axis=1)
    full_mask = np.concatenate([prompt_mask, completion_mask], axis=1)
    return {
        "input_ids": full_ids[:, :-1], "attention_mask": full_mask[:, :-1],
        "completion_ids": completion, "completion_mask": completion_mask.astype(np.float32),
        "advantages": np.array([1.3, -0.7, 0.4, -1.1], np.float32),
        # Reference log-probs near a uniform model's, for the KL term.
        "ref_logp": (-np.log(vocab) + 0.5 * rng.standard_normal((BATCH, COMPLETION))).astype(np.float32),
    }


def _reference(model_dir: Path, batch: dict):
    """Single-process loss, completion logits, head output (log-probs, or scores of a reward model) and
    gradients (HF names) of the same step."""
    import mindspore as ms
    from mindspore import Tensor, ops

    from mindrlhf.algorithms import policy_loss
    from mindrlhf.models import load_model

    model = load_model(model_dir)
    if model.config.num_labels:
        def score_step(input_ids, attention_mask, advantages):
            scores = model.scores(input_ids, attention_mask)
            return score_loss(scores, advantages, Tensor(np.float32(BATCH)))[0], scores

        params = model.trainable_params()
        (loss, scores), grads = ms.value_and_grad(score_step, None, params, has_aux=True)(
            *[Tensor(batch[k]) for k in ("input_ids", "attention_mask", "advantages")])
        return (model.config, float(loss.asnumpy()), None, scores.asnumpy(),
                {p.name: g.asnumpy() for p, g in zip(params, grads)})
    c = batch["completion_ids"].shape[1]
    inputs = [Tensor(batch[k]) for k in ("input_ids", "attention_mask", "completion_ids", "completion_mask",
                                         "advantages", "ref_logp")]
    n_tok = Tensor(np.float32(batch["completion_mask"].sum()))

    def loss_fn(input_ids, attention_mask, completion_ids, completion_mask, advantages, ref_logp):
        logits = model(input_ids, attention_mask, None, c)
        logp = ops.gather_elements(ops.log_softmax(logits, axis=-1), 2, completion_ids.expand_dims(-1)).squeeze(-1)
        loss, _ = policy_loss(logp, ops.stop_gradient(logp), advantages, completion_mask, ref_logp=ref_logp,
                              loss_type="grpo", beta=BETA, kl_estimator="k3", loss_agg_mode="token-mean",
                              global_num_tokens=n_tok)
        return loss, (logits, logp)

    params = model.trainable_params()
    (loss, (logits, logp)), grads = ms.value_and_grad(loss_fn, None, params, has_aux=True)(*inputs)
    return (model.config, float(loss.asnumpy()), logits.asnumpy(), logp.asnumpy(),
            {p.name: g.asnumpy() for p, g in zip(params, grads)})


def _msrun(n: int, argv, log_dir: Path, port: int) -> None:
    # cwd outside the checkout: MindSpore writes rank_*/ folders (graph dumps on a compile error) there.
    env = launch_env({"PYTHONUNBUFFERED": "1"})
    cmd = [str(Path(sys.executable).parent / "msrun"), f"--worker_num={n}", f"--local_worker_num={n}",
           f"--master_port={port}", "--join=True", f"--log_dir={log_dir}", str(WORKER), *argv]
    proc = subprocess.run(cmd, cwd=log_dir.parent, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        logs = "\n".join(p.read_text()[-3000:] for p in sorted(log_dir.glob("*.log")))
        raise AssertionError(f"msrun failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}\n{logs}")


def _check_case(name: str, model_dir: Path, batch: dict, out: Path, layout) -> None:
    from mindrlhf.parallel.sharding import rank_params, shard_tensor

    config, loss, logits, logp, grads = _reference(model_dir, batch)
    rows = BATCH // layout.dp
    dp_losses = []
    for rank in range(layout.world_size):
        res = dict(np.load(out / f"{name}_rank{rank}.npz", allow_pickle=False))
        c = layout.coords(rank)
        assert res["coords"].tolist() == [c.dp, c.tp, c.pp]
        part = slice(c.dp * rows, (c.dp + 1) * rows)
        if layout.pp == 1 and logits is not None:
            np.testing.assert_allclose(res["logits"], logits[part], rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name} rank {rank}: gathered logits")
        # Every stage of the pipeline ends with the last stage's head output (log-probs or scores).
        np.testing.assert_allclose(res["out"], logp[part], rtol=1e-5, atol=1e-5,
                                   err_msg=f"{name} rank {rank}: head output")
        if c.pp == layout.pp - 1:
            if c.tp == 0:
                dp_losses.append(float(res["loss"]))
            else:  # every tp rank of a replica computes the same loss
                np.testing.assert_allclose(float(res["loss"]), dp_losses[-1], rtol=1e-6)
        else:
            assert float(res["loss"]) == 0.0  # only the last stage computes the loss
        got = {k[len("grad/"):]: v for k, v in res.items() if k.startswith("grad/")}
        held = rank_params(config, layout, rank)
        assert sorted(got) == sorted(held), f"{name} rank {rank}: gradient names differ"
        for pname in held:
            want = shard_tensor(pname, grads[pname], config, layout, c.tp)
            assert got[pname].shape == want.shape, (name, rank, pname)
            np.testing.assert_allclose(got[pname], want, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name} rank {rank}: gradient of {pname}")
        # Not a vacuous comparison: every slice carries gradient.
        assert all(np.abs(g).max() > 0 for g in got.values()), (name, rank)
    total = sum(dp_losses)  # dp ranks' losses are normalised by the global token count: they add up
    assert len(dp_losses) == layout.dp
    assert abs(total - loss) <= 1e-5 * abs(loss), (name, total, loss)


def _check_primitives(out: Path, dp: int, tp: int) -> None:
    """CopyToTP / ReduceFromTP / GatherFromTP values and gradients in every tp group (see tp_worker)."""
    from mindrlhf.parallel.layout import ParallelLayout

    layout = ParallelLayout(dp=dp, tp=tp)
    xs = {r: np.arange(6, dtype=np.float32).reshape(2, 3) + 10.0 * r for r in range(layout.world_size)}
    weights = np.arange(6 * tp, dtype=np.float32).reshape(2, 3 * tp) - 4.0
    for rank in range(layout.world_size):
        res = dict(np.load(out / f"prims_rank{rank}.npz", allow_pickle=False))
        t, group = layout.coords(rank).tp, layout.tp_group(rank)
        np.testing.assert_array_equal(res["copy_grad"], np.full((2, 3), sum(range(1, tp + 1)), np.float32))
        np.testing.assert_array_equal(res["reduced"], sum(xs[r] for r in group))
        np.testing.assert_array_equal(res["reduce_grad"], np.full((2, 3), 2.0, np.float32))
        np.testing.assert_array_equal(res["gathered"], np.concatenate([xs[r] for r in group], axis=1))
        np.testing.assert_array_equal(res["gather_grad"], weights[:, 3 * t:3 * (t + 1)])


def _run_layout(tmp_path: Path, layout, port: int, cases, jit: bool, infer=None, sharded=(), share=False,
                selective=False) -> Path:
    out = tmp_path / "out"
    argv = ["--dp", str(layout.dp), "--tp", str(layout.tp), "--pp", str(layout.pp),
            "--micro", str(layout.micro_batches), "--out", str(out)] + (["--jit"] if jit else []) + \
        (["--share"] if share else []) + (["--selective"] if selective else [])
    if infer is not None:
        argv += ["--infer", str(infer.dp), str(infer.tp)]
    for name, ckpt_dir in sharded:
        argv += ["--sharded", name, str(ckpt_dir)]
    for name, model_dir, batch in cases:
        path = tmp_path / f"{name}_batch.npz"
        np.savez(path, **batch)
        argv += ["--case", name, str(model_dir), str(path)]
    _msrun(layout.world_size, argv, tmp_path / "log", port)
    if layout.pp == 1:
        _check_primitives(out, layout.dp, layout.tp)
    for name, model_dir, batch in cases:
        _check_case(name, model_dir, batch, out, layout)
    return out


def _check_resharded(out: Path, name: str, model_dir: Path, infer) -> None:
    """Every generator parameter equals its slice of the full weights, bit for bit."""
    from mindrlhf.models import DecoderConfig, get_weights, load_model
    from mindrlhf.parallel.sharding import shard_tensor

    config = DecoderConfig.from_file(model_dir)
    full = get_weights(load_model(model_dir))
    for rank in range(infer.world_size):
        res = dict(np.load(out / f"{name}_rank{rank}.npz", allow_pickle=False))
        got = {k[len("infer/"):]: v for k, v in res.items() if k.startswith("infer/")}
        assert sorted(got) == sorted(full), (name, rank)
        for pname, value in got.items():
            np.testing.assert_array_equal(value, shard_tensor(pname, full[pname], config, infer,
                                                              infer.coords(rank).tp), err_msg=f"{name} {pname}")


def _cases(tiny_qwen2_dir: Path, tiny_llama_dir: Path, shared: bool = False, reward_dir: Optional[Path] = None):
    """The two causal LMs' cases, plus a reward model's (score head) when ``reward_dir`` is given."""
    from mindrlhf.models import DecoderConfig

    dirs = [d for d in (tiny_qwen2_dir, tiny_llama_dir, reward_dir) if d is not None]
    vocab = {d: DecoderConfig.from_file(d).vocab_size for d in dirs}
    cases = [("qwen2", tiny_qwen2_dir, _batch(vocab[tiny_qwen2_dir], 1, shared)),
             ("llama", tiny_llama_dir, _batch(vocab[tiny_llama_dir], 2, shared))]
    if reward_dir is not None:
        cases.append(("reward", reward_dir, _batch(vocab[reward_dir], 3)))
    return cases


@pytest.fixture(scope="module")
def tiny_reward_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 reward model (score head, tied-embedding config) with 2 layers, so pp=2 divides it."""
    from mindrlhf.testing import make_tiny_reward_model

    return make_tiny_reward_model(tmp_path_factory.mktemp("tiny_reward"), family="qwen2", seed=4)


@pytest.fixture(scope="module")
def tiny_llama4_dir(tmp_path_factory) -> Path:
    """A 4-layer untied Llama with attention_bias (q/k/v and o_proj biases), so pp=2 divides it."""
    from mindrlhf.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama4"), seed=3, num_hidden_layers=4,
                           attention_bias=True)


# --- in process --------------------------------------------------------------------------------
@pytest.mark.parametrize("dp,tp,pp", [(1, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (1, 2, 2)])
def test_shard_names_and_shapes_match_rank_state(tiny_qwen2_dir, tiny_llama4_dir, dp, tp, pp):
    from mindrlhf.models import DecoderConfig, get_weights, load_model, set_weights
    from mindrlhf.models.decoder import CausalLM
    from mindrlhf.parallel.groups import group_name
    from mindrlhf.parallel.layout import ModelShard, ParallelLayout
    from mindrlhf.parallel.sharding import rank_state

    layout = ParallelLayout(dp=dp, tp=tp, pp=pp)
    for model_dir in (tiny_qwen2_dir, tiny_llama4_dir):
        config = DecoderConfig.from_file(model_dir)
        full = get_weights(load_model(model_dir))
        for rank in range(layout.world_size):
            group = group_name("tp", layout.tp_group(rank)) if tp > 1 else None
            model = CausalLM(config, "float32", ModelShard.of(layout, rank, group))
            state = rank_state(full, config, layout, rank)
            have = {n: tuple(p.shape) for n, p in model.parameters_and_names()}
            assert have == {n: tuple(a.shape) for n, a in state.items()}
            assert set_weights(model, state) == len(state)
            last = layout.coords(rank).pp == pp - 1
            assert ("lm_head.weight" in have) == (last and not config.tie_word_embeddings)
            # A tied model's last stage holds a copy of the embedding as its output projection.
            assert ("model.embed_tokens.weight" in have) == (layout.coords(rank).pp == 0
                                                             or (last and config.tie_word_embeddings))


def test_tp1_model_equals_causal_lm(tiny_qwen2_dir):
    """With tp=1 (no collectives) the TP code path is the single-process model: logits, logp, grads."""
    import mindspore as ms
    from mindspore import Tensor, ops

    from mindrlhf.algorithms import policy_loss
    from mindrlhf.models import DecoderConfig, get_weights, load_model, set_weights
    from mindrlhf.models.decoder import CausalLM
    from mindrlhf.parallel.layout import ModelShard

    config = DecoderConfig.from_file(tiny_qwen2_dir)
    batch = _batch(config.vocab_size, 1)
    _, loss, logits, logp, grads = _reference(tiny_qwen2_dir, batch)
    model = CausalLM(config, "float32", ModelShard())
    set_weights(model, get_weights(load_model(tiny_qwen2_dir)))
    inputs = [Tensor(batch[k]) for k in ("input_ids", "attention_mask", "completion_ids", "completion_mask",
                                         "advantages", "ref_logp")]
    n_tok = Tensor(np.float32(batch["completion_mask"].sum()))

    def loss_fn(input_ids, attention_mask, completion_ids, completion_mask, advantages, ref_logp):
        lp = model.sequence_logprobs(input_ids, attention_mask, completion_ids)
        value, _ = policy_loss(lp, ops.stop_gradient(lp), advantages, completion_mask, ref_logp=ref_logp,
                               loss_type="grpo", beta=BETA, kl_estimator="k3", loss_agg_mode="token-mean",
                               global_num_tokens=n_tok)
        return value, lp

    params = model.trainable_params()
    (got_loss, got_logp), got = ms.value_and_grad(loss_fn, None, params, has_aux=True)(*inputs)
    np.testing.assert_allclose(model.gathered_logits(inputs[0], inputs[1], None, COMPLETION).asnumpy(), logits,
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_logp.asnumpy(), logp, rtol=1e-5, atol=1e-5)
    assert abs(float(got_loss.asnumpy()) - loss) <= 1e-5 * abs(loss)
    for p, g in zip(params, got):
        np.testing.assert_allclose(g.asnumpy(), grads[p.name], rtol=1e-5, atol=1e-6, err_msg=p.name)


def test_tp_model_rejects_bad_layouts(tiny_llama_dir):
    from mindrlhf.errors import MindRLHFError
    from mindrlhf.models import DecoderConfig
    from mindrlhf.models.decoder import CausalLM
    from mindrlhf.parallel.layout import ModelShard

    config = DecoderConfig.from_file(tiny_llama_dir)  # 2 kv heads, 3 layers
    with pytest.raises(MindRLHFError, match="num_key_value_heads=2 is not divisible by tp=4"):
        CausalLM(config, "float32", ModelShard(tp=4, tp_group="g"))
    with pytest.raises(MindRLHFError, match="needs tp_group="):
        ModelShard(tp=2)
    with pytest.raises(MindRLHFError, match="num_hidden_layers=3 is not divisible by pp=2"):
        CausalLM(config, "float32", ModelShard(pp=2, stage=1))
    with pytest.raises(MindRLHFError, match="stage 2 is outside pp=2"):
        ModelShard(pp=2, stage=2)


# --- msrun ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.msrun
def test_tp2_matches_single_process(tiny_qwen2_dir, tiny_llama_dir, tiny_reward_dir, tmp_path):
    """tp=2 on 2 ranks, the step compiled with mindspore.jit (custom bprops in graph mode). Also: a
    checkpoint sharded for tp=2 by transform_checkpoint.py loads into the tp=2 run (each rank reads its
    rank_{r} folder) and reproduces the single-process logits."""
    from mindrlhf.tools.transform_checkpoint import main as transform

    sharded = tmp_path / "sharded_llama"
    assert transform(["--src_checkpoint", str(tiny_llama_dir), "--dst_checkpoint", str(sharded),
                      "--layout", "1,2,1"]) == 0
    qwen2, llama, reward = _cases(tiny_qwen2_dir, tiny_llama_dir, reward_dir=tiny_reward_dir)
    cases = [llama, qwen2, reward]  # llama first: its batch feeds the sharded check
    out = _run_layout(tmp_path, ParallelLayout(tp=2), 8263, cases, jit=True, sharded=[("llama", sharded)])
    _, _, logits, _, _ = _reference(tiny_llama_dir, cases[0][2])
    for rank in range(2):
        got = np.load(out / f"sharded_llama_rank{rank}.npz")["logits"]
        np.testing.assert_allclose(got, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.msrun
@byhand_only("tp2 and dp2 each launch in CI (this file, test_grpo_e2e)")
def test_dp2_tp2_matches_single_process(tiny_qwen2_dir, tiny_llama_dir, tiny_reward_dir, tmp_path):
    """dp=2 × tp=2 on 4 ranks, eager (PyNative): gradient slices summed over the dp group."""
    _run_layout(tmp_path, ParallelLayout(dp=2, tp=2), 8267,
                _cases(tiny_qwen2_dir, tiny_llama_dir, reward_dir=tiny_reward_dir), jit=False)


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.parametrize("pp", [1, byhand(2, "pp=2 falls back to padded rows, which tp2_pp2 trains")])
def test_shared_prompt_packing_under_tp2_and_pp2_matches_single_process(tiny_qwen2_dir, tiny_llama4_dir, tmp_path,
                                                                        pp):
    """Rows sharing prompts, packed on each tp rank (tp=2), or padded on pipeline stages (pp=2 falls
    back), trained through the layer graphs keeping each layer's linear outputs (recompute selective): loss,
    log-probs and gradient slices equal the single-process padded step."""
    layout = ParallelLayout(tp=2) if pp == 1 else ParallelLayout(pp=2, micro_batches=1)
    _run_layout(tmp_path, layout, 8279 + pp, _cases(tiny_qwen2_dir, tiny_llama4_dir, shared=True), jit=False,
                share=True, selective=True)


@pytest.mark.slow
@pytest.mark.msrun
@byhand_only("test_tp2_pp2_matches_single_process runs the same cases on pipeline stages")
def test_pp2_matches_single_process(tiny_qwen2_dir, tiny_llama4_dir, tiny_reward_dir, tmp_path):
    """pp=2 on 2 ranks, 2 micro-batches (GPipe): tied embedding copies summed, untied lm_head on stage 1,
    the reward model's score head on stage 1 (and no embedding copy there)."""
    _run_layout(tmp_path, ParallelLayout(pp=2, micro_batches=2), 8271,
                _cases(tiny_qwen2_dir, tiny_llama4_dir, reward_dir=tiny_reward_dir), jit=False)


@pytest.mark.slow
@pytest.mark.msrun
def test_tp2_pp2_matches_single_process(tiny_qwen2_dir, tiny_llama4_dir, tiny_reward_dir, tmp_path):
    """tp=2 × pp=2 on 4 ranks, 2 micro-batches, the stage steps compiled with mindspore.jit; then the
    in-memory reshard into the generation layout dp=2 × tp=2."""
    infer = ParallelLayout(dp=2, tp=2)
    out = _run_layout(tmp_path, ParallelLayout(tp=2, pp=2, micro_batches=2), 8275,
                      _cases(tiny_qwen2_dir, tiny_llama4_dir, reward_dir=tiny_reward_dir), jit=True, infer=infer)
    # Train (tp2, pp2) -> generate (dp2, tp2), in memory: every infer shard is the exact slice.
    _check_resharded(out, "qwen2", tiny_qwen2_dir, infer)
    _check_resharded(out, "llama", tiny_llama4_dir, infer)

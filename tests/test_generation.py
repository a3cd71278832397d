"""Rollout engine: NativeSampler against the model's full (uncached) forward, token selection
against numpy / Hugging Face references, parameter validation."""
from __future__ import annotations

import numpy as np
import pytest
from mindspore import Tensor

from grpo_runs import byhand
from mindrlhf.errors import MindRLHFError
from mindrlhf.generation import (
    Completion,
    NativeSampler,
    SamplingParams,
    apply_repetition_penalty,
    filter_weights,
    select_tokens,
)
from mindrlhf.generation.selection import inverse_cdf, top_values
from mindrlhf.models import get_weights, load_model, set_weights

# Multiplying the (tied) embedding sharpens a random model's next-token distributions, so greedy
# paths are not a repeat of one token and sampled tokens have clearly different probabilities.
SHARPEN = 12.0


def _sharpened(hf_dir):
    model = load_model(hf_dir)
    w = get_weights(model)
    key = "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"
    w[key] = w[key] * SHARPEN
    set_weights(model, w)
    return model


@pytest.fixture(scope="module")
def qwen(tiny_qwen2_dir):
    return _sharpened(tiny_qwen2_dir)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return _sharpened(tiny_llama_dir)


@pytest.fixture(scope="module")
def qwen_sampler(qwen):
    return NativeSampler(qwen, length_bucket=8)


@pytest.fixture(scope="module")
def llama_sampler(llama):
    return NativeSampler(llama, length_bucket=8)


def _prompts(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _full_logits(model, prompt, completion):
    """Log-softmax inputs: full-forward logits predicting each completion token (len(completion), V)."""
    ids = np.array([list(prompt) + list(completion)], np.int32)
    logits = model(Tensor(ids)).asnumpy()[0]
    return logits[len(prompt) - 1:len(prompt) - 1 + len(completion)].astype(np.float64)


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# -- end to end against the full forward ---------------------------------------------------------------
@pytest.mark.parametrize("which", ["qwen", "llama"])
def test_greedy_equals_stepwise_argmax_of_full_forward(which, request):
    model = request.getfixturevalue(which)
    sampler = request.getfixturevalue(f"{which}_sampler")
    prompts = _prompts(model.config.vocab_size, (3, 11, 6, 1))
    out = sampler.generate(prompts, SamplingParams(temperature=0.0, max_tokens=7))
    assert [c.prompt_index for c in out] == [0, 1, 2, 3]
    # reference: one uncached, left-padded batch forward per step (positions = cumsum(mask) - 1)
    seqs = [list(p) for p in prompts]
    for _ in range(7):
        width = max(map(len, seqs))
        ids = np.array([[0] * (width - len(q)) + q for q in seqs], np.int32)
        mask = np.array([[0] * (width - len(q)) + [1] * len(q) for q in seqs], np.int32)
        logits = model(Tensor(ids), Tensor(mask), logits_to_keep=1).asnumpy()[:, -1]
        for q, row in zip(seqs, logits):
            q.append(int(row.argmax()))
    for prompt, seq, comp in zip(prompts, seqs, out):
        assert comp.token_ids == seq[len(prompt):]
        assert comp.finish_reason == "length"
        # greedy log-probs are taken at temperature 1
        ref = _log_softmax(_full_logits(model, prompt, comp.token_ids))[np.arange(7), comp.token_ids]
        np.testing.assert_allclose(comp.logprobs, ref, atol=1e-4)
    assert len(set(tuple(c.token_ids) for c in out)) > 1


@pytest.mark.parametrize("which", ["qwen", "llama"])
def test_sampled_logprobs_equal_full_forward_log_softmax(which, request):
    model = request.getfixturevalue(which)
    sampler = request.getfixturevalue(f"{which}_sampler")
    prompts = _prompts(model.config.vocab_size, (5, 2, 9), seed=1)
    params = SamplingParams(n=2, temperature=0.7, top_k=50, top_p=0.9, max_tokens=6, seed=3, entropy=True)
    out = sampler.generate(prompts, params)
    assert [c.prompt_index for c in out] == [0, 0, 1, 1, 2, 2]
    for comp in out:
        logits = _full_logits(model, prompts[comp.prompt_index], comp.token_ids)
        logp_all = _log_softmax(logits / 0.7)
        ref = logp_all[np.arange(len(comp.token_ids)), comp.token_ids]
        assert len(comp.logprobs) == len(comp.token_ids) == len(comp.entropies) == 6
        np.testing.assert_allclose(comp.logprobs, ref, atol=1e-4)
        # entropy of the temperature-scaled policy (before top-k/top-p), as the trainer would compute it
        np.testing.assert_allclose(comp.entropies, -(np.exp(logp_all) * logp_all).sum(-1), atol=1e-4)
        # every sampled token survived top-k = 50 of the full-forward logits
        kth = np.sort(logits, axis=-1)[:, -50]
        assert np.all(logits[np.arange(6), comp.token_ids] >= kth - 1e-4)


def test_same_seed_same_samples_different_seed_different(qwen_sampler, qwen):
    prompts = _prompts(qwen.config.vocab_size, (4, 7))
    p = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=11)
    a = qwen_sampler.generate(prompts, p)
    qwen_sampler.generate(prompts, SamplingParams(n=1, max_tokens=3, seed=5))  # unrelated call in between
    b = qwen_sampler.generate(prompts, p)
    c = qwen_sampler.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=12))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    # the n completions of one prompt differ from each other
    assert len({tuple(x.token_ids) for x in a[:3]}) > 1


def test_chunking_and_batch_size_do_not_change_samples(qwen):
    prompts = _prompts(qwen.config.vocab_size, (4, 9, 2, 6, 5))
    p = SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=2)
    whole = NativeSampler(qwen, length_bucket=8).generate(prompts, p)
    chunked_sampler = NativeSampler(qwen, length_bucket=8, max_batch_size=3)
    chunked = chunked_sampler.generate(prompts, p)
    assert [c.prompt_index for c in chunked] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert [c.token_ids for c in whole] == [c.token_ids for c in chunked]
    np.testing.assert_allclose([c.logprobs for c in whole], [c.logprobs for c in chunked], atol=1e-5)
    # the same sampler serves other batch sizes afterwards
    one = chunked_sampler.generate(prompts[:1], SamplingParams(n=1, temperature=0.0, max_tokens=5))
    assert len(one) == 1 and len(one[0].token_ids) == 5


def test_stop_tokens_min_tokens_max_tokens(qwen_sampler, qwen):
    prompts = _prompts(qwen.config.vocab_size, (3, 6))
    greedy = qwen_sampler.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    stop = greedy[0].token_ids[2]  # a token the greedy path emits at step 2
    out = qwen_sampler.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop]))
    first = greedy[0].token_ids.index(stop)
    assert out[0].token_ids == greedy[0].token_ids[:first + 1]  # stop token included
    assert out[0].finish_reason == "stop"
    assert len(out[0].logprobs) == len(out[0].token_ids)
    if stop not in greedy[1].token_ids:
        assert out[1].token_ids == greedy[1].token_ids and out[1].finish_reason == "length"
    # min_tokens: the stop token is suppressed before it, so row 0 runs past step `first`
    out = qwen_sampler.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, min_tokens=first + 1,
                                                        stop_token_ids=[stop]))
    assert stop not in out[0].token_ids[:first + 1]
    assert out[0].token_ids[:first] == greedy[0].token_ids[:first]
    # max_tokens = min_tokens forces the exact length
    out = qwen_sampler.generate(prompts, SamplingParams(temperature=1.0, max_tokens=4, min_tokens=4,
                                                        stop_token_ids=[stop], seed=1))
    assert all(len(c.token_ids) == 4 and c.finish_reason == "length" and stop not in c.token_ids for c in out)


def test_rows_that_stop_early_leave_the_others_unchanged(qwen):
    """Finished rows drop out (the batch shrinks); the remaining rows continue exactly."""
    prompts = _prompts(qwen.config.vocab_size, (3, 5, 4, 8, 2), seed=4)
    ref = NativeSampler(qwen, length_bucket=8, shrink_batch=False)
    greedy = ref.generate(prompts, SamplingParams(temperature=0.0, max_tokens=9))
    stop = greedy[0].token_ids[1]
    params = SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=[stop])
    a = ref.generate(prompts, params)
    shrinking = NativeSampler(qwen, length_bucket=8, shrink_batch=True)
    b = shrinking.generate(prompts, params)
    shrinking.generate(prompts[::-1], SamplingParams(temperature=1.0, max_tokens=9, stop_token_ids=[stop], seed=1))
    c = shrinking.generate(prompts, params)  # graphs and caches of the shrunk batches are reused
    for g, x, y, z in zip(greedy, a, b, c):
        n = g.token_ids.index(stop) + 1 if stop in g.token_ids else 9
        assert x.token_ids == y.token_ids == z.token_ids == g.token_ids[:n]
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
        np.testing.assert_allclose(x.logprobs, z.logprobs, atol=1e-5)
    assert sum(x.finish_reason == "stop" for x in a) >= 1


def test_long_prompts_prefilled_in_pieces_give_the_same_results(llama, llama_sampler):
    prompts = _prompts(llama.config.vocab_size, (3, 19, 11), seed=2)
    p = SamplingParams(n=2, temperature=0.9, max_tokens=5, seed=8)
    pieces = NativeSampler(llama, length_bucket=8, prefill_chunk=8).generate(prompts, p)
    whole = llama_sampler.generate(prompts, p)
    assert [c.token_ids for c in pieces] == [c.token_ids for c in whole]
    np.testing.assert_allclose([c.logprobs for c in pieces], [c.logprobs for c in whole], atol=1e-5)


def test_cache_bucket_shares_graphs_across_prompt_lengths_without_changing_results(llama):
    """Prompts of 5 and 21 tokens pad to different prefill lengths (8, 24) but one 64-column cache:
    the second request reuses the first one's cell; a cache with no spare columns samples the same."""
    params = SamplingParams(n=2, temperature=0.9, max_tokens=6, seed=3)
    short = _prompts(llama.config.vocab_size, (5, 4), seed=4)
    long = _prompts(llama.config.vocab_size, (21, 17), seed=5)
    shared = NativeSampler(llama, length_bucket=8, cache_bucket=64, shrink_batch=False)
    a = shared.generate(short, params)
    b = shared.generate(long, params)
    assert sorted(shared._graphs) == [(2, 64), (4, 64)]  # prefill of the 2 distinct prompts, decode of 4 rows
    tight = NativeSampler(llama, length_bucket=8, cache_bucket=1, shrink_batch=False)
    for prompts, got in ((short, a), (long, b)):
        want = tight.generate(prompts, params)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        np.testing.assert_allclose([c.logprobs for c in got], [c.logprobs for c in want], atol=1e-5)
    assert sorted(tight._graphs) == [(2, 14), (2, 30), (4, 14), (4, 30)]  # P + max_tokens, unrounded


def test_top_k_1_equals_greedy(llama_sampler, llama):
    prompts = _prompts(llama.config.vocab_size, (5, 3))
    greedy = llama_sampler.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    topk1 = llama_sampler.generate(prompts, SamplingParams(temperature=1.3, top_k=1, max_tokens=6, seed=9))
    assert [c.token_ids for c in greedy] == [c.token_ids for c in topk1]


def test_load_weights_changes_outputs_without_recompiling(tiny_qwen2_dir, qwen):
    from mindspore.graph import api  # the set of compiled graph phases

    model = load_model(tiny_qwen2_dir)
    sampler = NativeSampler(model, length_bucket=8)
    prompts = _prompts(model.config.vocab_size, (4, 6))
    params = SamplingParams(n=2, temperature=0.8, max_tokens=5, seed=4)
    before = sampler.generate(prompts, params)
    compiled = len(api.ms_compile_cache)
    new_weights = get_weights(qwen)
    sampler.load_weights(new_weights)
    after = sampler.generate(prompts, params)
    assert len(api.ms_compile_cache) == compiled  # same shapes, same Parameters: nothing recompiled
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    fresh = NativeSampler(qwen, length_bucket=8).generate(prompts, params)
    assert [c.token_ids for c in after] == [c.token_ids for c in fresh]
    np.testing.assert_allclose([c.logprobs for c in after], [c.logprobs for c in fresh], atol=1e-5)


def test_weights_replaced_with_set_data_are_seen(tiny_llama_dir, llama):
    """``Parameter.set_data`` swaps a Parameter's storage, which already compiled graphs do not
    see: the sampler notices and recompiles instead of sampling from stale weights."""
    model = load_model(tiny_llama_dir)
    sampler = NativeSampler(model, length_bucket=8)
    prompts = _prompts(model.config.vocab_size, (3, 5))
    params = SamplingParams(temperature=0.0, max_tokens=4)
    before = sampler.generate(prompts, params)
    new = get_weights(llama)
    for name, param in model.parameters_and_names():
        param.set_data(Tensor(new[name]))
    after = sampler.generate(prompts, params)
    expected = NativeSampler(llama, length_bucket=8).generate(prompts, params)
    # (scaling lm_head keeps the greedy path: compare the log-probs)
    np.testing.assert_allclose([c.logprobs for c in after], [c.logprobs for c in expected], atol=1e-5)
    assert not np.allclose([c.logprobs for c in after], [c.logprobs for c in before], atol=1e-2)


def test_eager_mode_matches_jit(llama, llama_sampler):
    prompts = _prompts(llama.config.vocab_size, (2, 7))
    p = SamplingParams(n=2, temperature=0.9, top_p=0.8, max_tokens=4, seed=6)
    a = llama_sampler.generate(prompts, p)
    b = NativeSampler(llama, length_bucket=8, jit=False).generate(prompts, p)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


def test_stats_and_model_parameter_names_untouched(qwen_sampler, qwen):
    names = [p.name for p in qwen.get_parameters()]
    out = qwen_sampler.generate(_prompts(qwen.config.vocab_size, (3,)), SamplingParams(max_tokens=3))
    st = qwen_sampler.last_stats
    assert st["tokens"] == sum(len(c.token_ids) for c in out) == 3 and st["sequences"] == 1
    assert {"prefill_s", "decode_s", "sample_s", "compile_s", "total_s", "tokens_per_s"} <= set(st)
    assert qwen_sampler.tokens_generated >= 3
    assert [p.name for p in qwen.get_parameters()] == names
    assert names[0] == "model.embed_tokens.weight"


# -- bad input ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 1.0),
    ("repetition_penalty", 0.0), ("max_tokens", 0), ("min_tokens", -1), ("stop_token_ids", [-3]),
    ("seed", 1.5), ("temperature", float("nan")),
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value}).validate()


def test_bad_requests_raise_clear_errors(llama_sampler):
    with pytest.raises(MindRLHFError, match="prompt 1 is empty"):
        llama_sampler.generate([[1, 2], []], SamplingParams())
    with pytest.raises(MindRLHFError, match="max_tokens=600 .*max length 512"):
        llama_sampler.generate([[1, 2]], SamplingParams(max_tokens=600))
    with pytest.raises(MindRLHFError, match="prompt 0 has token id 1000 outside"):
        llama_sampler.generate([[1, 1000]], SamplingParams())
    with pytest.raises(MindRLHFError, match="SamplingParams.min_tokens=5 .*max_tokens=2"):
        llama_sampler.generate([[1]], SamplingParams(max_tokens=2, min_tokens=5))
    with pytest.raises(MindRLHFError, match="SamplingParams.stop_token_ids.*outside the vocabulary"):
        llama_sampler.generate([[1]], SamplingParams(stop_token_ids=[5000]))
    with pytest.raises(MindRLHFError, match="non-empty list"):
        llama_sampler.generate([], SamplingParams())


# -- token selection on small logits ---------------------------------------------------------------------
def _np_filter(logits, t, top_k, top_p, min_p):
    """Reference: HF's warper order with a full sort (probabilities after temperature)."""
    p = np.exp((logits - logits.max(-1, keepdims=True)) / t)
    p = p / p.sum(-1, keepdims=True)
    keep = np.ones_like(p, bool)
    for r in range(p.shape[0]):
        if top_k:
            keep[r] &= p[r] >= np.sort(p[r])[::-1][top_k - 1]
        if top_p < 1:
            q = np.where(keep[r], p[r], 0)
            q = q / q.sum()
            order = np.argsort(-q, kind="stable")
            above = np.cumsum(q[order]) - q[order]  # mass of strictly more likely tokens
            k = np.zeros_like(keep[r])
            k[order] = above < top_p
            keep[r] &= k
        if min_p > 0:
            q = np.where(keep[r], p[r], 0)
            keep[r] &= q >= min_p * q.max()
    out = np.where(keep, p, 0)
    return out / out.sum(-1, keepdims=True)


@pytest.mark.parametrize("top_k,top_p,min_p", [(3, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2), (5, 0.8, 0.1),
                                               (50, 0.95, 0.0), (0, 0.3, 0.0), (0, 1.0, 0.0)])
def test_filters_match_numpy_reference(top_k, top_p, min_p):
    rng = np.random.default_rng(top_k + int(100 * top_p))
    logits = (rng.standard_normal((4, 300)) * 2).astype(np.float32)
    for t in (0.7, 1.0):
        _, _, w = select_tokens(logits, rng.random(4), temperature=t, top_k=top_k, top_p=top_p, min_p=min_p,
                                return_weights=True)
        got = w / w.sum(-1, keepdims=True)
        np.testing.assert_allclose(got, _np_filter(logits.astype(np.float64), t, top_k, top_p, min_p), atol=1e-6)


def test_entropy_equals_numpy_on_the_same_logits():
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((5, 1000)) * 4 + 20).astype(np.float32)  # large offsets, peaked rows
    logits[0] = 0.0  # uniform: entropy log(V)
    for t in (0.5, 1.0):
        _, _, ent = select_tokens(logits, rng.random(5), temperature=t, top_k=10, top_p=0.9, entropy=True)
        logp = _log_softmax(logits.astype(np.float64) / t)
        np.testing.assert_allclose(ent, -(np.exp(logp) * logp).sum(-1), rtol=1e-5, atol=1e-5)
        assert ent[0] == pytest.approx(np.log(1000), rel=1e-6)
    tok, lp = select_tokens(logits, rng.random(5))  # two values unless asked
    assert tok.shape == lp.shape == (5,)


def test_filters_match_hugging_face_warpers():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((3, 2000)) * 3).astype(np.float32)
    x = torch.tensor(logits)
    for proc in (TemperatureLogitsWarper(0.8), TopKLogitsWarper(40), TopPLogitsWarper(0.85), MinPLogitsWarper(0.05)):
        x = proc(None, x)
    ref = torch.softmax(x, -1).numpy()
    _, _, w = select_tokens(logits, rng.random(3), temperature=0.8, top_k=40, top_p=0.85, min_p=0.05,
                            return_weights=True)
    np.testing.assert_allclose(w / w.sum(-1, keepdims=True), ref, atol=1e-6)


def test_min_p_hand_case():
    # probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.2 keeps p >= 0.1 → the first three
    p = np.array([[0.5, 0.3, 0.15, 0.05]])
    w = filter_weights(p.astype(np.float32).copy(), min_p=0.2)
    np.testing.assert_allclose(w, [[0.5, 0.3, 0.15, 0.0]], rtol=1e-6)
    # min_p 0.4 keeps p >= 0.2 → the first two; top_p 0.45: the first token alone reaches it
    np.testing.assert_allclose(filter_weights(p.astype(np.float32).copy(), min_p=0.4), [[0.5, 0.3, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(filter_weights(p.astype(np.float32).copy(), top_p=0.45), [[0.5, 0, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(filter_weights(p.astype(np.float32).copy(), top_p=0.55), [[0.5, 0.3, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(filter_weights(p.astype(np.float32).copy(), top_p=0.81), [[0.5, 0.3, 0.15, 0]],
                               rtol=1e-6)
    np.testing.assert_allclose(filter_weights(p.astype(np.float32).copy(), top_k=2), [[0.5, 0.3, 0, 0]], rtol=1e-6)


def test_top_values_and_filters_on_a_wide_vocabulary():
    rng = np.random.default_rng(5)
    w = rng.random((3, 151936)).astype(np.float32) ** 8
    for k in (1, 7, 256, 1000, 151936):
        np.testing.assert_array_equal(top_values(w, k), -np.sort(-w, axis=1)[:, :k])
    # peaked rows (threshold among the top candidates) and a flat row (full-sort fallback)
    logits = (rng.standard_normal((3, 151936)) * np.array([[4.0], [3.0], [0.1]])).astype(np.float32)
    for top_k, top_p in ((0, 0.9), (40, 1.0), (1000, 0.5), (0, 0.2)):
        _, _, w = select_tokens(logits, rng.random(3), temperature=1.0, top_k=top_k, top_p=top_p,
                                return_weights=True)
        ref = _np_filter(logits.astype(np.float64), 1.0, top_k, top_p, 0.0)
        np.testing.assert_array_equal(w > 0, ref > 0)
        np.testing.assert_allclose(w / w.sum(-1, keepdims=True), ref, atol=1e-7)


def test_repetition_penalty_matches_hugging_face():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((2, 50)) * 2).astype(np.float32)
    seen = [[3, 7, 7, 20, 49], [0, 3]]
    for penalty in (1.3, 0.7):
        pairs = sorted({(r, t) for r, ts in enumerate(seen) for t in ts})
        rows, cols = np.array(pairs).T
        ours = apply_repetition_penalty(logits, rows, cols, penalty)
        ids = torch.tensor([seen[0], seen[1] + [3, 3, 0]])  # ragged rows padded with repeats
        ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, torch.tensor(logits)).numpy()
        np.testing.assert_allclose(ours, ref, rtol=1e-6)
        # the sampling distribution select_tokens uses is softmax of the penalised logits / T
        _, lp, w = select_tokens(logits, rng.random(2), temperature=0.9, repetition_penalty=penalty,
                                 present=(rows, cols), return_weights=True)
        np.testing.assert_allclose(w / w.sum(-1, keepdims=True), np.exp(_log_softmax(ref.astype(np.float64) / 0.9)),
                                   atol=1e-6)


def test_repetition_penalty_in_generation_changes_distribution_not_logprobs(llama, llama_sampler):
    prompts = _prompts(llama.config.vocab_size, (6,), seed=8)
    plain = llama_sampler.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    pen = llama_sampler.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=5.0))
    assert pen[0].token_ids != plain[0].token_ids
    # greedy with a strong penalty never repeats a token of the prompt or of its own output
    assert len(set(pen[0].token_ids)) == 8 and not set(pen[0].token_ids) & set(prompts[0])
    ref = _log_softmax(_full_logits(llama, prompts[0], pen[0].token_ids))[np.arange(8), pen[0].token_ids]
    np.testing.assert_allclose(pen[0].logprobs, ref, atol=1e-4)  # log-probs stay the raw policy's


def test_logprob_andinverse_cdf_sampling_statistics():
    logits = np.log(np.array([[0.1, 0.2, 0.0001, 0.6999]], np.float32))
    n = 20000
    u = np.random.default_rng(0).random(n)
    toks = np.array([inverse_cdf(np.exp(logits).astype(np.float32), u[i:i + 1])[0] for i in range(0, n)])
    freq = np.bincount(toks, minlength=4) / n
    np.testing.assert_allclose(freq, [0.1, 0.2, 0.0001, 0.6999], atol=0.01)
    tok, lp = select_tokens(logits, np.array([0.05]), temperature=1.0)
    assert tok[0] == 0 and lp[0] == pytest.approx(np.log(0.1), abs=1e-5)
    tok, lp = select_tokens(logits, np.array([0.5]), temperature=0.0)
    assert tok[0] == 3 and lp[0] == pytest.approx(np.log(0.6999), abs=1e-5)
    # zero-weight tokens are never drawn, even at u = 0 or u → 1
    w = np.array([[0.0, 1.0, 0.0, 2.0, 0.0]], np.float32)
    assert inverse_cdf(w, np.array([0.0]))[0] == 1 and inverse_cdf(w, np.array([0.9999999]))[0] == 3


def test_completion_is_a_plain_record():
    c = Completion(prompt_index=0, token_ids=[1], logprobs=[-0.5], finish_reason="stop")
    assert c.token_ids == [1] and c.finish_reason == "stop"


@pytest.mark.parametrize("which", ["qwen", byhand("llama", "qwen's run shares the same prefill")])
def test_shared_prompt_prefill_gives_the_same_completions(which, request):
    """Each distinct prompt prefilled once and its cache copied to its n rows: token for token and
    log-prob for log-prob what prefilling every row gives, greedy and sampled, with prompts of
    different lengths in one chunk."""
    model = request.getfixturevalue(which)
    prompts = [[5, 17, 42, 8, 99, 3], [7, 7, 21], [11, 250, 4, 4, 60, 2, 9, 30, 1]]
    shared = NativeSampler(model, share_prompts=True)
    each = NativeSampler(model, share_prompts=False)
    for params in (SamplingParams(n=3, temperature=0.0, max_tokens=10, seed=0),
                   SamplingParams(n=4, temperature=1.0, top_p=0.9, max_tokens=10, seed=123)):
        a, b = shared.generate(prompts, params), each.generate(prompts, params)
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
        assert [c.prompt_index for c in a] == [i for i in range(3) for _ in range(params.n)]
        for x, y in zip(a, b):
            np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)
    # The shared path prefilled a batch of the 3 distinct prompts, not of all 12 rows.
    assert any(batch == 3 for batch, _ in shared._graphs) and not any(batch == 3 for batch, _ in each._graphs)


def test_a_continuation_prefills_only_what_follows_a_kept_completion(qwen):
    """Inside ``reuse_prefixes`` the rows that stop with ids ``keep`` accepts keep their cache (taken when a shrinking
    batch drops them, or at the end); the next call's prompts that extend them (a tool turn: completion + appended
    ids) prefill only the rest and sample what a sampler prefilling all of it samples, token for token and log-prob
    for log-prob, in one batch or in chunks, with a fresh prompt among them; nothing is kept after the block, nor
    across new weights."""
    vocab = qwen.config.vocab_size
    prompts = _prompts(vocab, (5, 13, 9, 3), seed=6)
    hot = dict(n=2, temperature=4.0, top_k=8, max_tokens=9, seed=0)  # varied paths from the sharpened model
    reference = NativeSampler(qwen, length_bucket=8, prefill_chunk=8)
    paths = [c.token_ids for c in reference.generate(prompts, SamplingParams(**hot))]
    rng = np.random.default_rng(1)
    second = SamplingParams(n=1, temperature=0.7, max_tokens=8, seed=4)

    def turn_two(turn_one):
        rows = [prompts[c.prompt_index] + c.token_ids + rng.integers(0, vocab, 2 + i % 5).tolist()
                for i, c in enumerate(turn_one) if c.finish_reason == "stop"]
        return rows + _prompts(vocab, (7,), seed=9)  # and one prompt that extends nothing

    # The same draws with stop ids taken from the paths: rows stop at different steps (and leave the shrinking
    # batch), some run to the limit; then every row stops.
    for batch, stop_at in ((None, {0: 3, 2: 5, 5: 2}), (3, {r: 2 + r % 5 for r in range(8)})):
        first = SamplingParams(**hot, stop_token_ids=sorted({paths[r][k] for r, k in stop_at.items()}))
        keep = lambda ids, skip=paths[0][stop_at[0]]: ids[-1] != skip  # noqa: E731 - row 0's stop id: not kept
        reusing = NativeSampler(qwen, length_bucket=8, prefill_chunk=8, max_batch_size=batch)
        with reusing.reuse_prefixes(keep):
            one = reusing.generate(prompts, first)
            stopped = [c for c in one if c.finish_reason == "stop"]
            assert len({len(c.token_ids) for c in stopped}) >= 3 and len(stopped) >= len(stop_at)
            assert reusing.last_stats["kept_rows"] == sum(keep(c.token_ids) for c in stopped) > 0
            assert [c.token_ids for c in one] == [c.token_ids for c in reference.generate(prompts, first)]
            prompts_two = turn_two(one)
            two = reusing.generate(prompts_two, second)
            assert reusing.last_stats["reused_tokens"] > 0
        want = reference.generate(prompts_two, second)
        assert reference.last_stats["reused_tokens"] == 0
        assert [c.token_ids for c in two] == [c.token_ids for c in want]
        for x, y in zip(two, want):
            np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)
        reusing.generate(prompts_two, second)  # after the block: prefilled whole
        assert reusing.last_stats["reused_tokens"] == 0 and not reusing._kept
    # Weights loaded inside the block drop what was kept (it was computed with the old ones).
    with reusing.reuse_prefixes(keep):
        one = reusing.generate(prompts, first)
        reusing.load_weights(get_weights(qwen))
        reusing.generate(turn_two(one), second)
        assert reusing.last_stats["reused_tokens"] == 0


def test_a_kept_cache_is_bounded_by_keep_bytes(qwen):
    prompts = _prompts(qwen.config.vocab_size, (6, 6), seed=2)
    hot = dict(temperature=4.0, top_k=8, max_tokens=6, seed=0)
    sampler = NativeSampler(qwen, length_bucket=8)  # one sampler: its compiled graphs serve every call
    paths = [c.token_ids for c in sampler.generate(prompts, SamplingParams(**hot))]
    stops = [p[2] for p in paths]
    params = SamplingParams(**hot, stop_token_ids=stops)
    lengths = [1 + next(k for k, t in enumerate(p) if t in stops) for p in paths]
    needs = [6 + n - 1 for n in lengths]  # prompt and completion but the stop id, which is never fed
    c = qwen.config
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4
    for budget, rows in ((0, 0), (needs[0] * per_token, 1), ((needs[0] + needs[1] - 1) * per_token, 1),
                         (sum(needs) * per_token, 2)):
        sampler.keep_bytes = budget
        with sampler.reuse_prefixes(lambda ids: True):
            out = sampler.generate(prompts, params)
            assert [len(x.token_ids) for x in out] == lengths and sampler.last_stats["kept_rows"] == rows

"""Training heads (``models.heads``) and the sequence-classification (``score``) model.

A reward model / critic is the family's decoder with HF's ``score`` head: its scores equal
transformers' ``*ForSequenceClassification`` for every family, its config and tensor table round-trip,
the pipeline layout puts the head on the last stage, and ``PipelineRunner`` with a ``ScoreHead`` gives
the loss and gradients of the plain model. (tp2 / pp2 against one process: tests/test_tensor_parallel.py.)
"""
from __future__ import annotations

import numpy as np
import pytest

from mindrlhf.errors import MindRLHFError
from mindrlhf.testing import make_tiny_reward_model, padded_batch


@pytest.fixture(scope="module")
def reward_dirs(tmp_path_factory):
    """A tiny reward model of each family (Qwen2 tied, Llama untied, Qwen3 q/k norm), 1 label; and a
    3-label Llama."""
    root = tmp_path_factory.mktemp("reward_models")
    dirs = {fam: make_tiny_reward_model(root / fam, family=fam, seed=i) for i, fam in
            enumerate(("qwen2", "llama", "qwen3"))}
    dirs["llama3labels"] = make_tiny_reward_model(root / "llama3", family="llama", num_labels=3, seed=5)
    return dirs


def _hf_scores(model_dir, ids, mask):
    """transformers' pooled scores, padding filled with the pad id (how HF finds the last real token)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = np.where(mask > 0, ids, model.config.pad_token_id)
    pos = np.clip(mask.cumsum(1) - 1, 0, None)
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(pos)).logits.numpy()


@pytest.mark.parametrize("name", ["qwen2", "llama", "qwen3", "llama3labels"])
def test_scores_equal_transformers(reward_dirs, name):
    """Left-padded, right-padded and full rows: our score at the last real token equals transformers'."""
    from mindspore import Tensor

    from mindrlhf.models import load_model

    model = load_model(reward_dirs[name])
    ids, mask = padded_batch(model.config.vocab_size, seed=3)
    # Real ids must not be the pad id, or HF would stop at them (ours reads the mask).
    ids = np.where(ids == model.config.pad_token_id, ids + 1, ids)
    want = _hf_scores(reward_dirs[name], ids, mask)
    got = model.scores(Tensor(ids.astype(np.int32)), Tensor(mask.astype(np.int32))).asnumpy()
    assert got.shape == want.shape == (3, model.config.num_labels)
    assert np.abs(want).max() > 0.1  # not a vacuous comparison of near-zero scores
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_score_model_config_and_tensor_table(reward_dirs):
    """num_labels from architectures/id2label; score.weight replaces lm_head (even for a tied config); it
    lives on the last pipeline stage, replicated under tp; to_hf_dict writes a loadable classifier config."""
    from mindrlhf.models import DecoderConfig
    from mindrlhf.parallel.layout import ParallelLayout
    from mindrlhf.parallel.sharding import split_dim

    config = DecoderConfig.from_file(reward_dirs["qwen2"])
    assert config.num_labels == 1 and config.tie_word_embeddings and not config.tied_output
    shapes = config.expected_shapes()
    assert shapes["score.weight"] == (1, 64) and "lm_head.weight" not in shapes
    assert list(shapes)[-1] == "score.weight"
    layout = ParallelLayout(pp=2)
    assert layout.param_stages("score.weight", config) == (1,)
    # No embedding copy on the last stage: a classifier never projects onto the vocabulary.
    assert layout.param_stages("model.embed_tokens.weight", config) == (0,)
    assert split_dim("score.weight") is None
    hf = config.to_hf_dict()
    assert hf["architectures"] == ["Qwen2ForSequenceClassification"] and hf["id2label"] == {"0": "LABEL_0"}
    again = DecoderConfig.from_hf_dict(hf)
    assert again.num_labels == 1 and again.expected_shapes() == shapes
    three = DecoderConfig.from_file(reward_dirs["llama3labels"])
    assert three.num_labels == 3 and three.expected_shapes()["score.weight"] == (3, 64)
    causal = dict(hf, architectures=["Qwen2ForCausalLM"])
    causal.pop("id2label")
    assert DecoderConfig.from_hf_dict(causal).num_labels == 0


def test_runner_score_head_equals_plain_gradient(reward_dirs):
    """PipelineRunner + ScoreHead over two micro-batches: the summed loss and gradients of a logistic
    loss on the scores equal value_and_grad of the whole model on the whole batch."""
    import mindspore as ms
    from mindspore import Tensor, ops

    from mindrlhf.models import load_model
    from mindrlhf.models.heads import ScoreHead
    from mindrlhf.parallel.groups import data_parallel_groups
    from mindrlhf.parallel.pipeline import PipelineRunner

    model = load_model(reward_dirs["llama"])
    ids, mask = padded_batch(model.config.vocab_size, seed=4)
    ids, mask = np.concatenate([ids, ids[::-1]]).astype(np.int32), np.concatenate([mask, mask[:, ::-1]]).astype(
        np.int32)
    labels = np.array([1.0, -1.0, 0.5, -0.25, 2.0, -1.0], np.float32)

    def loss_fn(scores, y, n):
        return ops.softplus(-y * scores[:, 0]).sum() / n, (scores[:, 0].max(),)

    runner = PipelineRunner(model, data_parallel_groups(0, 1), loss_fn, head=ScoreHead(1))
    micro = [{"input_ids": ids[s:s + 3], "attention_mask": mask[s:s + 3], "y": labels[s:s + 3]} for s in (0, 3)]
    grads, loss, aux = runner.loss_and_grads(micro, ("y",), extra=(Tensor(np.float32(6)),))
    scores = np.concatenate(runner.forward(micro))

    def whole(i, m, y):
        s = model.scores(i, m)
        return ops.softplus(-y * s[:, 0]).sum() / 6.0, s
    (want_loss, want_scores), want = ms.value_and_grad(whole, None, runner.params, has_aux=True)(
        Tensor(ids), Tensor(mask), Tensor(labels))
    np.testing.assert_allclose(scores, want_scores.asnumpy(), rtol=1e-6, atol=1e-6)
    assert abs(loss - float(want_loss.asnumpy())) <= 1e-6 * abs(loss)
    assert aux.shape == (2, 1)
    np.testing.assert_allclose(aux[:, 0], [scores[:3, 0].max(), scores[3:, 0].max()], rtol=1e-6)
    for p, g, w in zip(runner.params, grads, want):
        assert np.abs(w.asnumpy()).max() > 0, p.name
        np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-5, atol=1e-7, err_msg=p.name)


def test_score_head_refuses_a_causal_lm(tiny_llama_dir, reward_dirs):
    from mindrlhf.models import load_model
    from mindrlhf.models.heads import LogProbHead, ScoreHead, head_for
    from mindrlhf.parallel.groups import data_parallel_groups
    from mindrlhf.parallel.pipeline import PipelineRunner

    lm = load_model(tiny_llama_dir)
    with pytest.raises(MindRLHFError, match="needs a sequence-classification model .* has a causal LM"):
        PipelineRunner(lm, data_parallel_groups(0, 1), head=ScoreHead(1))
    assert isinstance(head_for(lm.config), LogProbHead)
    rm = load_model(reward_dirs["llama3labels"])
    assert isinstance(head_for(rm.config), ScoreHead) and head_for(rm.config).num_labels == 3
    with pytest.raises(MindRLHFError, match="score head of 1 label"):
        PipelineRunner(rm, data_parallel_groups(0, 1), head=ScoreHead(1))
    with pytest.raises(MindRLHFError, match="temperature 0.0 must be > 0"):
        LogProbHead(0.0)


def test_logprob_head_stats_equal_the_full_softmax(tiny_llama_dir):
    """LogProbHead(stats=True): log-probs as without stats, and per-token entropy and argmax hit equal
    numpy's on the full logits; with a chunk smaller than the rows (several chunks) as well."""
    from mindspore import Tensor

    from mindrlhf.models import load_model
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.parallel.groups import data_parallel_groups
    from mindrlhf.parallel.pipeline import PipelineRunner

    model = load_model(tiny_llama_dir)
    ids, mask = padded_batch(model.config.vocab_size, seed=5)
    ids, mask = ids.astype(np.int32), mask.astype(np.int32)
    logits = model.gathered_logits(Tensor(ids[:, :-1]), Tensor(mask[:, :-1])).asnumpy().astype(np.float64)
    logp_all = logits - logits.max(-1, keepdims=True)
    logp_all -= np.log(np.exp(logp_all).sum(-1, keepdims=True))
    target = ids[:, 1:]
    want_logp = np.take_along_axis(logp_all, target[..., None], -1)[..., 0]
    want_entropy = -(np.exp(logp_all) * logp_all).sum(-1)
    want_correct = (logits.argmax(-1) == target).astype(np.float32)
    mb = {"input_ids": ids[:, :-1], "attention_mask": mask[:, :-1], "completion_ids": target}
    for chunk in (model.chunk_rows, 5):
        model.set_chunk_rows(chunk)
        plain = PipelineRunner(model, data_parallel_groups(0, 1), head=LogProbHead()).forward([mb])[0]
        logp, entropy, correct = PipelineRunner(model, data_parallel_groups(0, 1),
                                                head=LogProbHead(stats=True)).forward([mb])[0]
        np.testing.assert_array_equal(logp, plain)
        np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(entropy, want_entropy, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(correct, want_correct)
    greedy = {**mb, "completion_ids": logits.argmax(-1).astype(np.int32)}
    _, _, correct = PipelineRunner(model, data_parallel_groups(0, 1), head=LogProbHead(stats=True)).forward([greedy])[0]
    assert correct.min() == 1.0  # every argmax token is a hit


def test_value_head_equals_transformers_score_at_each_completion_position(reward_dirs):
    """PPO's critic: ValueHead's values (B, C) are transformers' ``score`` of the final hidden states at the C
    positions before each completion token (right-padded rows), through PipelineRunner; a causal LM or a
    3-label model is refused."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from mindrlhf.models import load_model
    from mindrlhf.models.heads import ValueHead
    from mindrlhf.parallel.groups import data_parallel_groups
    from mindrlhf.parallel.pipeline import PipelineRunner

    model = load_model(reward_dirs["qwen2"])
    rng = np.random.default_rng(7)
    full = rng.integers(1, model.config.vocab_size, (2, 9)).astype(np.int32)
    mask = np.array([[1] * 9, [1] * 6 + [0] * 3], np.int32)
    c = 4
    micro = [{"input_ids": full[:, :-1], "attention_mask": mask[:, :-1], "completion_ids": full[:, -c:]}]
    got = PipelineRunner(model, data_parallel_groups(0, 1), head=ValueHead()).forward(micro)[0]
    hf = AutoModelForSequenceClassification.from_pretrained(reward_dirs["qwen2"], dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = hf.model(input_ids=torch.tensor(full[:, :-1]).long(),
                          attention_mask=torch.tensor(mask[:, :-1]).long()).last_hidden_state
        want = hf.score(hidden)[..., 0].numpy()[:, -c:]
    assert got.shape == (2, c) and np.abs(want).max() > 0.1
    real = mask[:, 1:][:, -c:] > 0  # positions predicting a real token (the padded row's last ones are not)
    np.testing.assert_allclose(got[real], want[real], rtol=1e-4, atol=1e-4)
    with pytest.raises(MindRLHFError, match="3 labels"):
        ValueHead().build(load_model(reward_dirs["llama3labels"]))

"""The reward-model stage (``mindrlhf.rm``): loss, gradients and metrics against transformers' reward model,
and a causal LM turned into a reward model."""
from __future__ import annotations

import numpy as np
import pytest

from mindrlhf.testing import make_tiny_reward_model


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    return make_tiny_reward_model(tmp_path_factory.mktemp("rm"), family="qwen2", seed=7, vocab_size=500,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _pairs(vocab: int, seed: int = 0):
    """Prompts (of 3, 5, 2 and 3 tokens) and their chosen and rejected completions (ids)."""
    rng = np.random.default_rng(seed)
    prompts, chosen, rejected = [], [], []
    for lp, lc, lr in ((3, 6, 9), (5, 4, 4), (2, 11, 3), (3, 7, 8)):
        prompts.append(rng.integers(1, vocab, lp).astype(np.int32))
        chosen.append(rng.integers(1, vocab, lc).astype(np.int32))
        rejected.append(rng.integers(1, vocab, lr).astype(np.int32))
    return prompts, chosen, rejected


def _torch_reference(model_dir, chosen, rejected, center):
    """TRL's RewardTrainer math on transformers' model: rows [chosen; rejected], right-padded with the pad id,
    reward at the last non-pad token, -logsigmoid(r_c - r_r).mean() (+ centering), and its gradients."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    rows = chosen + rejected
    width = max(len(r) for r in rows)
    pad = model.config.pad_token_id
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], att[i, :len(r)] = torch.tensor(r), 1
    rewards = model(input_ids=ids, attention_mask=att).logits[:, 0]
    rc, rr = rewards.chunk(2)
    loss = -torch.nn.functional.logsigmoid(rc - rr).mean() + center * ((rc + rr) ** 2).mean()
    loss.backward()
    r = rewards.detach().numpy().astype(np.float64)
    rc, rr = rc.detach(), rr.detach()
    metrics = {"accuracy": float((rc > rr).float().mean()), "margin": float((rc - rr).mean()),
               "mean_reward": r.mean(), "min_reward": r.min(), "max_reward": r.max()}
    return loss.item(), metrics, {n: p.grad.numpy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("pairs_per_micro,center,share,widen", [
    (4, 0.0, True, False), (1, 0.01, True, False), (4, 0.0, False, False), (2, 0.0, True, True)])
def test_rm_step_equals_transformers_reward_model(reward_dir, pairs_per_micro, center, share, widen):
    """One reward-model update (Bradley-Terry over the step's pairs, optional centering): loss, gradients,
    accuracy, margin and the reward statistics equal TRL's math on transformers' Qwen2ForSequenceClassification
    (each pair's rows whole and right-padded), as one micro-batch of 4 pairs or four of 1, with each pair's two
    rows packed behind one copy of their prompt (``share``) or padded (the pipeline-stage layout), and with the
    prompt and completion parts padded on to wider grid widths (``widen``)."""
    from mindrlhf.models import load_model
    from mindrlhf.models.heads import ScoreHead
    from mindrlhf.rm import RMObjective, pair_micro_batches
    from mindrlhf.trainer.update import Updater

    model = load_model(reward_dir)
    prompts, completions_c, completions_r = _pairs(model.config.vocab_size)
    chosen = [np.r_[p, c] for p, c in zip(prompts, completions_c)]
    rejected = [np.r_[p, r] for p, r in zip(prompts, completions_r)]
    want_loss, want, want_grads = _torch_reference(reward_dir, chosen, rejected, center)
    updater = Updater(model, RMObjective(center), head=ScoreHead(1, packed=True), lr=0.0, weight_decay=0.0,
                      betas=(0.9, 0.999), eps=1e-8, max_grad_norm=0.0, jit=False, share_prompts=share)
    assert updater.runner.share_prompts == share
    micro = pair_micro_batches(prompts, completions_c, completions_r, pairs_per_micro, pad_id=0,
                               shapes=[(64, 96)] if widen else None)
    if widen:  # the parts' widths, not their bucket's (32 each)
        assert {(mb["input_ids"].shape[1], mb["completion_ids"].shape[1]) for mb in micro} == {(64 + 96 - 1, 96)}
    import mindspore as ms

    grads, loss, _ = updater.runner.loss_and_grads(micro, (), extra=(ms.Tensor(np.float32(4)),
                                                                     ms.Tensor(np.float32(1))))
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    for p, g in zip(updater.params, grads):  # float32 noise relative to each tensor's gradient scale
        want_g = want_grads[p.name]
        np.testing.assert_allclose(g.asnumpy(), want_g, rtol=1e-4, atol=1e-4 * np.abs(want_g).max(), err_msg=p.name)
    res = updater.step(micro, (4.0,))
    for k, v in want.items():
        assert res[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_a_causal_lm_becomes_a_reward_model(tiny_qwen2_dir):
    """load_policy(num_labels=1) on a causal LM: every decoder weight as in the file, no lm_head, a seeded
    N(0, 0.02) score head (the same seed gives the same head); a 3-label classifier is refused."""
    from mindrlhf.errors import MindRLHFError
    from mindrlhf.models import get_weights, load_model
    from mindrlhf.parallel.groups import RunLayout, data_parallel_groups
    from mindrlhf.parallel.layout import ParallelLayout
    from mindrlhf.parallel.resharding import checkpoint_config
    from mindrlhf.trainer.entry import load_policy

    layout = RunLayout(train=ParallelLayout(), infer=ParallelLayout(), groups=data_parallel_groups(0, 1),
                       infer_tp_group=None, rank=0)
    config = checkpoint_config(tiny_qwen2_dir)
    rm, masters = load_policy(str(tiny_qwen2_dir), config, layout, "float32", num_labels=1, seed=3)
    assert masters is None and rm.config.num_labels == 1
    got, lm = get_weights(rm), get_weights(load_model(tiny_qwen2_dir))
    assert set(got) == (set(lm) - {"lm_head.weight"}) | {"score.weight"}
    for name in set(got) - {"score.weight"}:
        np.testing.assert_array_equal(got[name], lm[name], err_msg=name)
    score = got["score.weight"]
    assert score.shape == (1, 64) and 0.01 < score.std() < 0.03
    again, _ = load_policy(str(tiny_qwen2_dir), config, layout, "float32", num_labels=1, seed=3)
    np.testing.assert_array_equal(get_weights(again)["score.weight"], score)
    three = config.__class__(**{**config.__dict__, "num_labels": 3})
    with pytest.raises(MindRLHFError, match="3 labels; this stage needs 1"):
        load_policy(str(tiny_qwen2_dir), three, layout, "float32", num_labels=1)

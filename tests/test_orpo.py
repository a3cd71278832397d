"""The ORPO stage (``mindrlhf.orpo``): loss, gradients and TRL's metrics against a float64 hand computation of
TRL's ORPO math on transformers' model (one micro-batch or several, an empty prompt), the odds-ratio formulas by
hand, the micro-batch layout, evaluation, and the command's one-line refusals. (Step 1 against TRL's own
ORPOTrainer: tests/test_trl_stage_parity.py; a run with resume and msrun: tests/test_offline_stages.py.)"""
from __future__ import annotations

import math

import numpy as np
import pytest

BETA = 0.25


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from mindrlhf.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("orpo") / "policy", seed=11)


def _pairs(vocab: int, seed: int = 0):
    """Four pairs of random ids, the second with an empty prompt."""
    from mindrlhf.testing import random_pairs

    return random_pairs(vocab, ((5, 6, 9), (0, 4, 5), (8, 11, 3), (3, 7, 8)), seed)


def _hand_reference(policy_dir, pairs, beta):
    """TRL 1.16's ORPO (trl/experimental/orpo/orpo_trainer.py) written out in float64 on transformers' model:
    every pair's two rows ``prompt + completion``; the completions' token-mean log-probs c, r; log odds
    ``(c - r) - (log(1 - e^c) - log(1 - e^r))``; loss = mean NLL over the chosen rows' tokens after the first
    (prompt included: TRL's cross_entropy_loss on the chosen rows) - beta * mean log sigmoid(log odds)."""
    import torch
    from transformers import AutoModelForCausalLM

    prompts, chosen, rejected = pairs
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float64)
    rows = [np.r_[p, c] for p, cr in zip(prompts, zip(chosen, rejected)) for c in cr]
    starts = [max(len(p), 1) for p in prompts for _ in (0, 1)]  # the first scored completion position
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    comp = torch.zeros((len(rows), width), dtype=torch.float64)
    for i, (r, s) in enumerate(zip(rows, starts)):
        ids[i, :len(r)], att[i, :len(r)] = torch.tensor(r), 1
        comp[i, s:len(r)] = 1.0
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=att).logits[:, :-1], -1)
    per = logp.gather(-1, ids[:, 1:, None])[..., 0]
    comp, real = comp[:, 1:], att[:, 1:].double()
    mean = (per * comp).sum(-1) / comp.sum(-1)
    c, r = mean[0::2], mean[1::2]
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    ratio = torch.nn.functional.logsigmoid(log_odds)
    nll = -(per * real)[0::2].sum() / real[0::2].sum()
    loss = nll - (beta * ratio).mean()
    loss.backward()
    metrics = {"rewards/chosen": beta * c.mean().item(), "rewards/rejected": beta * r.mean().item(),
               "rewards/accuracies": (c > r).double().mean().item(), "rewards/margins": beta * (c - r).mean().item(),
               "logps/chosen": c.mean().item(), "logps/rejected": r.mean().item(), "nll_loss": nll.item(),
               "log_odds_ratio": ratio.mean().item(), "log_odds_chosen": log_odds.mean().item()}
    return loss.item(), metrics, {n: p.grad.numpy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("pairs_per_micro,widen", [(4, False), (1, False), (2, False), (2, True)])
def test_orpo_step_equals_a_float64_hand_computation(policy_dir, pairs_per_micro, widen):
    """One ORPO update: loss, gradients and every TRL metric equal the float64 hand computation, whether the four
    pairs are one micro-batch or several (the NLL is normalised by the step's token count, the odds-ratio term by
    its pair count, both passed as the step's scalars), and with the rows padded on to a wider grid width
    (``widen``)."""
    import mindspore as ms

    from mindrlhf.models import load_model
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.orpo import METRICS, ORPOObjective, nll_token_count, orpo_micro_batches
    from mindrlhf.trainer.update import Updater

    model = load_model(policy_dir)
    pairs = _pairs(model.config.vocab_size)
    want_loss, want, want_grads = _hand_reference(policy_dir, pairs, BETA)
    micro = orpo_micro_batches(*pairs, pairs_per_micro, pad_id=0, shapes=[(32, 96)] if widen else None)
    if widen:  # the completion part's grid width, not its bucket's
        assert {mb["completion_ids"].shape[1] for mb in micro} == {96}
    objective = ORPOObjective(BETA)
    updater = Updater(model, objective, head=LogProbHead(), lr=0.0, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                      max_grad_norm=0.0, jit=False)
    scalars = (4.0, float(nll_token_count(pairs[0], pairs[1])))
    assert scalars[1] == 5 + 5 + 3 + 18 + 9  # every chosen row's tokens after its first
    grads, loss, _ = updater.runner.loss_and_grads(micro, objective.inputs,
                                                   extra=tuple(ms.Tensor(np.float32(s)) for s in (*scalars, 1.0)))
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for p, g in zip(updater.params, grads):
        want_g = want_grads[p.name]
        np.testing.assert_allclose(g.asnumpy(), want_g, rtol=1e-4, atol=1e-4 * np.abs(want_g).max(), err_msg=p.name)
    res = updater.step(micro, scalars)
    assert set(METRICS) == set(want)
    for k, v in want.items():
        assert res[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert res["loss"] == pytest.approx(want_loss, rel=1e-5)


def _log1mexp(x: float) -> float:
    return math.log(-math.expm1(x))


def test_odds_ratio_formulas_and_gradients_by_hand():
    """``log1mexp`` on both sides of -ln 2 and near 0 (where 1 - e^x cancels: MindSpore's CPU expm1 and log1p are
    not accurate there), finite at 0; ``orpo_log_odds`` and ``odds_ratio_loss`` against math, with gradients."""
    import mindspore as ms

    from mindrlhf.algorithms.supervised import log1mexp, odds_ratio_loss, orpo_log_odds

    x = np.array([-30.0, -5.0, -0.7, -0.69, -1e-2, -1e-3, -1e-6], np.float32)
    exact = [_log1mexp(v) for v in x.astype(np.float64)]
    got = log1mexp(ms.Tensor(x)).asnumpy()
    np.testing.assert_allclose(got, exact, rtol=1e-6, atol=1e-7)
    grad = ms.grad(lambda t: log1mexp(t).sum())(ms.Tensor(x)).asnumpy()
    # d/dx log(1 - e^x) = -e^x / (1 - e^x) = -1 / expm1(-x)
    np.testing.assert_allclose(grad, [-1.0 / math.expm1(-v) for v in x.astype(np.float64)], rtol=1e-4)
    # a completion of probability 1 (every token's log-prob 0 in float32): capped at -1e-7, finite with gradient 0
    at_zero = log1mexp(ms.Tensor(np.zeros(1, np.float32)))
    assert at_zero.asnumpy()[0] == pytest.approx(_log1mexp(-1e-7), rel=1e-5)
    assert ms.grad(lambda t: log1mexp(t).sum())(ms.Tensor(np.zeros(1, np.float32))).asnumpy()[0] == 0.0

    c = np.array([-0.5, -2.0, -9.0], np.float32)
    r = np.array([-1.5, -1.0, -9.5], np.float32)
    want_z = [(a - b) - (_log1mexp(a) - _log1mexp(b)) for a, b in zip(c.astype(float), r.astype(float))]
    z = orpo_log_odds(ms.Tensor(c), ms.Tensor(r))
    np.testing.assert_allclose(z.asnumpy(), want_z, rtol=1e-5, atol=1e-6)
    want_loss = [BETA * math.log1p(math.exp(-v)) for v in want_z]  # -beta * log sigmoid(z)
    np.testing.assert_allclose(odds_ratio_loss(z, BETA).asnumpy(), want_loss, rtol=1e-5)
    # d loss / d c = -beta * (1 - sigmoid(z)) * dz/dc, with dz/dc = 1 + e^c / (1 - e^c) = 1 / (1 - e^c)
    gc = ms.grad(lambda a: odds_ratio_loss(orpo_log_odds(a, ms.Tensor(r)), BETA).sum())(ms.Tensor(c)).asnumpy()
    want_gc = [-BETA / (1 + math.exp(v)) / -math.expm1(a) for v, a in zip(want_z, c.astype(float))]
    np.testing.assert_allclose(gc, want_gc, rtol=1e-4)


def test_orpo_micro_batches_layout():
    """Each row's first token is the context and the rest is scored: ``completion_mask`` on the completion,
    ``nll_mask`` on the chosen row's scored tokens (prompt included); an empty prompt's first completion token
    is the context."""
    from mindrlhf.orpo import orpo_micro_batches

    prompts = [np.array([5, 6], np.int32), np.array([], np.int32)]
    chosen = [np.array([7, 8, 9], np.int32), np.array([10, 11], np.int32)]
    rejected = [np.array([12], np.int32), np.array([13, 14, 15], np.int32)]
    (mb,) = orpo_micro_batches(prompts, chosen, rejected, 2, pad_id=0, bucket=4)
    np.testing.assert_array_equal(mb["input_ids"][:, -4:], [[5, 6, 7, 8], [5, 6, 12, 0], [10, 11, 0, 0],
                                                            [13, 14, 15, 0]])
    np.testing.assert_array_equal(mb["completion_ids"], [[6, 7, 8, 9], [6, 12, 0, 0], [11, 0, 0, 0], [14, 15, 0, 0]])
    np.testing.assert_array_equal(mb["completion_mask"], [[0, 1, 1, 1], [0, 1, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(mb["nll_mask"], [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    # two micro-batches of one pair: the same rows, each pair's own widths
    a, b = orpo_micro_batches(prompts, chosen, rejected, 1, pad_id=0, bucket=4)
    np.testing.assert_array_equal(b["nll_mask"], [[1, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(a["completion_mask"], mb["completion_mask"][:2])


def test_orpo_refuses_a_reference_and_a_missing_train_file_in_one_line(tmp_path, capsys):
    """ORPO has no reference model: --ref_model is an unknown option (one line, exit 2), as is a run without
    --train_file."""
    from mindrlhf import orpo

    out = str(tmp_path / "o")
    assert orpo.main(["--output_dir", out, "--ref_model", "some/dir"]) == 2
    err = capsys.readouterr().err
    assert "ref_model" in err and len(err.strip().splitlines()) == 1, err
    assert orpo.main(["--model", str(tmp_path / "m"), "--output_dir", out]) == 2
    err = capsys.readouterr().err
    assert "--train_file is required" in err and len(err.strip().splitlines()) == 1, err

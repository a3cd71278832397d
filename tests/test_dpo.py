"""The DPO stage (``mindrlhf.dpo``): loss, gradients and metrics against TRL's DPO math on transformers'
models (a reference different from the policy), each loss type, shared-prompt packing, and the reference
precomputed once."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def policy_and_ref(tmp_path_factory):
    from mindrlhf.testing import make_tiny_llama

    root = tmp_path_factory.mktemp("dpo")
    return make_tiny_llama(root / "policy", seed=11), make_tiny_llama(root / "ref", seed=12)


def _pairs(vocab: int, seed: int = 0):
    """Four pairs of random ids."""
    from mindrlhf.testing import random_pairs

    return random_pairs(vocab, ((5, 6, 9), (2, 4, 4), (8, 11, 3), (3, 7, 8)), seed)


def _torch_logps(model, prompts, completions, token_mean):
    """Sum (or token mean) over completion tokens of log p(token | prefix), one right-padded forward."""
    import torch

    rows = [np.r_[p, c] for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    comp = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (r, p) in enumerate(zip(rows, prompts)):
        ids[i, :len(r)], att[i, :len(r)] = torch.tensor(r), 1
        comp[i, len(p):len(r)] = True
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=att).logits[:, :-1], -1)
    per = logp.gather(-1, ids[:, 1:, None])[..., 0] * comp[:, 1:]
    seq = per.sum(-1)
    return seq / comp[:, 1:].sum(-1) if token_mean else seq


def _torch_reference(policy_dir, ref_dir, pairs, loss_type, beta, smoothing):
    import torch
    from transformers import AutoModelForCausalLM

    prompts, chosen, rejected = pairs
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    ipo = loss_type == "ipo"
    pc, pr = _torch_logps(policy, prompts, chosen, ipo), _torch_logps(policy, prompts, rejected, ipo)
    with torch.no_grad():
        rc, rr = _torch_logps(ref, prompts, chosen, ipo), _torch_logps(ref, prompts, rejected, ipo)
    z = (pc - pr) - (rc - rr)
    logsig = torch.nn.functional.logsigmoid
    per = {"sigmoid": -(1 - smoothing) * logsig(beta * z) - smoothing * logsig(-beta * z),
           "robust": (-(1 - smoothing) * logsig(beta * z) + smoothing * logsig(-beta * z)) / (1 - 2 * smoothing),
           "hinge": torch.relu(1 - beta * z), "ipo": (z - 1 / (2 * beta)) ** 2}[loss_type]
    loss = per.mean()
    loss.backward()
    cr, rj = (beta * (pc - rc)).detach(), (beta * (pr - rr)).detach()
    metrics = {"rewards/chosen": cr.mean().item(), "rewards/rejected": rj.mean().item(),
               "rewards/accuracies": (cr > rj).float().mean().item(), "rewards/margins": (cr - rj).mean().item(),
               "logps/chosen": pc.mean().item(), "logps/rejected": pr.mean().item()}
    return loss.item(), metrics, {n: p.grad.numpy() for n, p in policy.named_parameters()}


@pytest.mark.parametrize("loss_type,beta,smoothing,pairs_per_micro,share,widen", [
    ("sigmoid", 0.5, 0.2, 1, False, False), ("ipo", 0.5, 0.0, 2, True, False), ("robust", 0.3, 0.1, 4, True, False),
    ("sigmoid", 0.5, 0.0, 2, True, True)])
def test_dpo_step_equals_trl_math(policy_and_ref, loss_type, beta, smoothing, pairs_per_micro, share, widen):
    """One DPO update against a reference that differs from the policy: loss, gradients and TRL's metrics equal
    the formulas on transformers' models, for the loss types (hinge: by hand in test_supervised_losses), with and
    without the pair's shared prompt packed once, as one micro-batch or several, and with the prompt and
    completion parts padded on to wider grid widths (``widen``)."""
    import mindspore as ms

    from mindrlhf.dpo import DPOObjective, pair_logp_micro_batches
    from mindrlhf.models import load_model
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.parallel.groups import data_parallel_groups
    from mindrlhf.parallel.pipeline import PipelineRunner
    from mindrlhf.trainer.update import Updater

    policy_dir, ref_dir = policy_and_ref
    model = load_model(policy_dir)
    pairs = _pairs(model.config.vocab_size)
    want_loss, want, want_grads = _torch_reference(policy_dir, ref_dir, pairs, loss_type, beta, smoothing)
    micro = pair_logp_micro_batches(*pairs, pairs_per_micro, pad_id=0,
                                    shapes=[(64, 96)] if widen else None)
    if widen:  # the parts' widths, not their bucket's (32 each)
        assert {(mb["input_ids"].shape[1], mb["completion_ids"].shape[1]) for mb in micro} == {(64 + 96 - 1, 96)}
    ref_runner = PipelineRunner(load_model(ref_dir), data_parallel_groups(0, 1), head=LogProbHead(),
                                share_prompts=share)
    for mb, lp in zip(micro, ref_runner.forward(micro)):
        mb["ref_logp"] = lp
    objective = DPOObjective(loss_type, beta, smoothing)
    updater = Updater(model, objective, head=LogProbHead(), lr=0.0, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                      max_grad_norm=0.0, jit=False, share_prompts=share)
    grads, loss, _ = updater.runner.loss_and_grads(micro, objective.inputs, extra=(ms.Tensor(np.float32(4)),
                                                                                   ms.Tensor(np.float32(1))))
    assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    for p, g in zip(updater.params, grads):
        want_g = want_grads[p.name]
        np.testing.assert_allclose(g.asnumpy(), want_g, rtol=1e-4, atol=1e-4 * np.abs(want_g).max(), err_msg=p.name)
    res = updater.step(micro, (4.0,))
    for k, v in want.items():
        assert res[k] == pytest.approx(v, rel=1e-5, abs=1e-5), k


def test_reference_equal_to_policy_gives_ln2_and_zero_rewards(policy_and_ref):
    """TRL's step-1 facts with reference = initial policy: loss ln 2, every reward 0, accuracies 0 (strict >)."""
    from mindrlhf.dpo import DPOObjective, pair_logp_micro_batches
    from mindrlhf.models import load_model
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.trainer.update import Updater

    model = load_model(policy_and_ref[0])
    micro = pair_logp_micro_batches(*_pairs(model.config.vocab_size, seed=2), 4, pad_id=0)
    updater = Updater(model, DPOObjective("sigmoid", 0.1, 0.0), head=LogProbHead(), lr=0.0, weight_decay=0.0,
                      betas=(0.9, 0.999), eps=1e-8, max_grad_norm=0.0, jit=False)
    micro[0]["ref_logp"] = updater.forward(micro)[0]
    res = updater.step(micro, (4.0,))
    assert res["loss"] == pytest.approx(np.log(2.0), rel=1e-6)
    assert res["rewards/accuracies"] == 0.0 and res["rewards/chosen"] == 0.0 and res["rewards/margins"] == 0.0
    assert res["grad_norm"] > 0


def test_shape_grid_adds_the_shape_that_saves_the_most_positions():
    """Micro-batch (prompt, completion) shapes seen (32, 32) x5, (32, 96) x2, (96, 32) x3, with (96, 96) the widest
    the rows form, a prompt position weighing 1 and a completion's 2. Alone, (96, 96) pads 5 x 192 + 2 x 64 + 3 x
    128 = 1,472. A second shape: (32, 32) leaves 2 x 64 + 3 x 128 = 512, (96, 32) leaves 5 x 64 + 2 x 64 = 448
    (the (32, 32) fit it too), (32, 96) 5 x 128 + 3 x 128 = 1,024: it takes (96, 32). A third: (32, 32) leaves 128,
    (32, 96) 5 x 64 = 320; a fourth, (32, 96), leaves 0. Each shape goes to the cheapest grid shape as wide in both
    parts; past the grid it stays."""
    from mindrlhf.trainer.offline import grid_shape, shape_grid

    seen = {(32, 32): 5, (32, 96): 2, (96, 32): 3}
    assert shape_grid(seen, (96, 96), 1) == [(96, 96)]
    assert shape_grid(seen, (96, 96), 2) == [(96, 32), (96, 96)]
    grid = shape_grid(seen, (96, 96), 3)
    assert grid == [(32, 32), (96, 32), (96, 96)]
    assert shape_grid(seen, (96, 96), 8) == [(32, 32), (32, 96), (96, 32), (96, 96)]  # nothing more saves
    assert [grid_shape(s, grid) for s in ((1, 1), (64, 32), (32, 64), (128, 32))] == [(32, 32), (96, 32), (96, 96),
                                                                                      (128, 32)]


def test_pair_shape_grids_hold_every_micro_batch_of_any_step(tmp_path):
    """Pairs of 20-300-token prompts and 10-400-token completions (more than 8 bucketed shapes): the grid a DPO
    run with static layer graphs takes has 8 shapes, and every micro-batch of 2 pairs that steps of 4 random pairs
    form, longest first, has one of them, for a few percent more positions than the bucket alone."""
    from mindrlhf.configs.offline import parse_dpo_args
    from mindrlhf.dpo import pair_logp_micro_batches
    from mindrlhf.trainer.offline import longest_first, pair_lengths, pair_shape_grid

    rng = np.random.default_rng(0)

    def rows(low, high):
        return [np.ones(int(n), np.int32) for n in rng.integers(low, high, 200)]

    prompts, chosen, rejected = rows(20, 300), rows(10, 400), rows(10, 400)
    cfg = parse_dpo_args(["--model", "m", "--train_file", "f", "--output_dir", str(tmp_path), "--batch_size", "4",
                          "--micro_batch_size", "2", "--layer_graph_shapes", "static"])
    grid = pair_shape_grid(cfg, *pair_lengths(prompts, chosen, rejected))
    assert len(grid) == 8
    seen, positions = set(), {}
    for _ in range(100):
        pick = rng.choice(200, 4, replace=False)
        step = longest_first({"p": [prompts[i] for i in pick], "c": [chosen[i] for i in pick],
                              "r": [rejected[i] for i in pick]},
                             [2 * len(prompts[i]) + len(chosen[i]) + len(rejected[i]) for i in pick])
        for shapes in (grid, None):
            for mb in pair_logp_micro_batches(step["p"], step["c"], step["r"], 2, 0, shapes=shapes):
                width_c = mb["completion_ids"].shape[1]
                shape = (mb["input_ids"].shape[1] + 1 - width_c, width_c)
                positions[shapes is None] = positions.get(shapes is None, 0) + shape[0] + 2 * shape[1]
                if shapes is not None:
                    seen.add(shape)
    assert seen <= set(grid) and len(seen) > 4
    assert 1 < positions[False] / positions[True] < 1.1, positions


def test_pair_micro_batches_layout():
    from mindrlhf.dpo import pair_logp_micro_batches

    prompts = [np.array([5, 6], np.int32), np.array([], np.int32)]
    chosen = [np.array([7, 8, 9], np.int32), np.array([10, 11], np.int32)]
    rejected = [np.array([12], np.int32), np.array([13, 14, 15], np.int32)]
    (mb,) = pair_logp_micro_batches(prompts, chosen, rejected, 2, pad_id=0, bucket=4)
    assert mb["input_ids"].shape == (4, 7) and mb["completion_ids"].shape == (4, 4)
    np.testing.assert_array_equal(mb["input_ids"][0], [0, 0, 5, 6, 7, 8, 9])
    np.testing.assert_array_equal(mb["completion_ids"][1], [12, 0, 0, 0])
    np.testing.assert_array_equal(mb["completion_mask"][1], [1, 0, 0, 0])
    # an empty prompt: the first completion token becomes the context (nothing could predict it)
    np.testing.assert_array_equal(mb["input_ids"][2], [0, 0, 0, 10, 11, 0, 0])
    np.testing.assert_array_equal(mb["completion_mask"][2], [1, 0, 0, 0])
    np.testing.assert_array_equal(mb["completion_ids"][3], [14, 15, 0, 0])

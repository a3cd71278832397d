"""The SFT stage (``mindrlhf.sft``): its loss and gradients against torch's cross-entropy, metrics by hand,
micro-batch invariance, and the command end to end (fresh run, outputs, resume)."""
from __future__ import annotations

import numpy as np
import pytest


def _rows(vocab: int, seed: int = 0):
    """Four rows of different lengths: ids and their trained-token masks (prompt 0, completion 1)."""
    rng = np.random.default_rng(seed)
    ids, masks = [], []
    for prompt, completion in ((5, 7), (2, 3), (9, 4), (1, 10)):
        ids.append(rng.integers(0, vocab, prompt + completion).astype(np.int32))
        masks.append(np.r_[np.zeros(prompt), np.ones(completion)].astype(np.int8))
    return ids, masks


def _torch_reference(model_dir, ids, masks):
    """transformers' mean cross-entropy over the completion tokens of all rows (labels -100 elsewhere, as
    TRL's completion-only loss), its gradients, the argmax accuracy and the mean entropy over those tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    width = max(len(r) for r in ids)
    x = torch.zeros((len(ids), width), dtype=torch.long)
    att = torch.zeros((len(ids), width), dtype=torch.long)
    labels = torch.full((len(ids), width), -100, dtype=torch.long)
    for i, (r, m) in enumerate(zip(ids, masks)):
        x[i, :len(r)], att[i, :len(r)] = torch.tensor(r), 1
        labels[i, :len(r)] = torch.where(torch.tensor(m) > 0, torch.tensor(r, dtype=torch.long), -100)
    logits = model(input_ids=x, attention_mask=att).logits[:, :-1]
    target = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                             ignore_index=-100)
    loss.backward()
    keep = target != -100
    with torch.no_grad():
        logp = torch.log_softmax(logits, -1)
        accuracy = (logits.argmax(-1) == target)[keep].float().mean().item()
        entropy = (-(logp.exp() * logp).sum(-1))[keep].mean().item()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    return loss.item(), accuracy, entropy, grads


@pytest.mark.parametrize("micro", [4, 1])
def test_sft_loss_and_gradients_equal_torch_cross_entropy(tiny_llama_dir, micro):
    """One SFT update's loss (token mean over the whole batch), gradients, mean_token_accuracy and
    entropy equal transformers' completion-only cross-entropy, whether the 4 rows run as one
    micro-batch or four (the loss is normalised by the step's token count)."""
    from mindrlhf.models import load_model
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.sft import SFTObjective
    from mindrlhf.sft import sft_micro_batches as micro_batches
    from mindrlhf.trainer.update import Updater

    model = load_model(tiny_llama_dir)
    ids, masks = _rows(model.config.vocab_size)
    want_loss, want_acc, want_entropy, want_grads = _torch_reference(tiny_llama_dir, ids, masks)
    updater = Updater(model, SFTObjective(), head=LogProbHead(stats=True), lr=0.0, weight_decay=0.0,
                      betas=(0.9, 0.999), eps=1e-8, max_grad_norm=0.0, jit=False)
    trained = float(sum(m[1:].sum() for m in masks))
    micro_list = micro_batches(ids, masks, micro, pad_id=0)
    assert len(micro_list) == 4 // micro
    grads, loss, _ = updater.runner.loss_and_grads(micro_list, SFTObjective.inputs, extra=_scalars(trained))
    assert abs(loss - want_loss) <= 1e-5 * want_loss
    for p, g in zip(updater.params, grads):
        np.testing.assert_allclose(g.asnumpy(), want_grads[p.name], rtol=1e-4, atol=1e-6, err_msg=p.name)
    res = updater.step(micro_list, (trained,))
    assert abs(res["loss"] - want_loss) <= 1e-5 * want_loss
    want_norm = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in want_grads.values()))
    assert abs(res["grad_norm"] - want_norm) <= 1e-4 * want_norm
    assert res["mean_token_accuracy"] == pytest.approx(want_acc, abs=1e-6)
    assert res["entropy"] == pytest.approx(want_entropy, rel=1e-5)


def _scalars(trained):
    import mindspore as ms

    return (ms.Tensor(np.float32(trained)), ms.Tensor(np.float32(1.0)))  # token count, loss scale


def test_prompt_tokens_change_nothing_when_masked(tiny_llama_dir):
    """With completion-only loss, a prompt token's own prediction is outside the loss: replacing the
    targets of masked positions (the prompt's next tokens, shifted out) leaves loss and gradients equal;
    unmasking them changes both (so the comparison can fail)."""
    from mindrlhf.models import load_model
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.sft import SFTObjective
    from mindrlhf.sft import sft_micro_batches as micro_batches
    from mindrlhf.trainer.update import Updater

    model = load_model(tiny_llama_dir)
    ids, masks = _rows(model.config.vocab_size, seed=1)
    updater = Updater(model, SFTObjective(), head=LogProbHead(stats=True), lr=0.0, weight_decay=0.0,
                      betas=(0.9, 0.999), eps=1e-8, max_grad_norm=0.0, jit=False)
    trained = float(sum(m[1:].sum() for m in masks))

    def run(mbs):
        grads, loss, _ = updater.runner.loss_and_grads(mbs, SFTObjective.inputs, extra=_scalars(trained))
        return loss, [g.asnumpy() for g in grads]

    base = micro_batches(ids, masks, 4, pad_id=0)
    loss, grads = run(base)
    changed = [dict(mb) for mb in base]
    target = changed[0]["completion_ids"].copy()
    target[changed[0]["completion_mask"] == 0] = 7  # every untrained target (prompt and padding) replaced
    changed[0]["completion_ids"] = target
    loss2, grads2 = run(changed)
    assert loss2 == loss
    for a, b in zip(grads, grads2):
        np.testing.assert_array_equal(a, b)
    unmasked = [dict(mb, completion_mask=np.ones_like(mb["completion_mask"])) for mb in base]  # padding too
    loss3, _ = run(unmasked)
    assert loss3 != loss


def test_micro_batches_split_at_the_first_trained_token_and_bucket():
    """The head's layout: each row's untrained start left-padded, the rest right-padded, both to multiples of 32;
    completion_ids are the columns after the prompt (what the last C input positions predict)."""
    from mindrlhf.sft import sft_micro_batches as micro_batches

    ids = [np.array([5, 6, 7], np.int32), np.array([8, 9, 4, 4], np.int32)]
    masks = [np.array([0, 1, 1], np.int8), np.array([0, 0, 1, 0], np.int8)]
    (mb,) = micro_batches(ids, masks, 2, pad_id=3)
    assert mb["input_ids"].shape == (2, 64 - 1) and mb["completion_ids"].shape == (2, 32)
    np.testing.assert_array_equal(mb["input_ids"][0, 30:35], [3, 5, 6, 7, 3])
    np.testing.assert_array_equal(mb["input_ids"][1, 30:35], [8, 9, 4, 4, 3])
    np.testing.assert_array_equal(mb["attention_mask"][1, 29:35], [0, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(mb["completion_ids"][:, :3], [[6, 7, 3], [4, 4, 3]])
    np.testing.assert_array_equal(mb["completion_mask"][:, :3], [[1, 1, 0], [1, 0, 0]])
    assert mb["completion_mask"].sum() == 3  # every trained token once


def test_pack_rows_is_best_fit_decreasing():
    """Hand-worked bins of capacity 10: longest row first, each into the fullest sequence it fits, the earliest
    such on a tie; rows beyond the capacity are refused."""
    from mindrlhf.trainer.offline import pack_rows

    # 8 → new (2 left); 7 → new (3 left); 5 → new (5 left); 3 → the one with 3 left; 2 → the one with 2 left.
    assert pack_rows([3, 8, 5, 2, 7], 10) == [[1, 3], [4, 0], [2]]
    # Ties: both 6s open sequences with 4 left; the first 4 goes to the earlier, the second to the other.
    assert pack_rows([4, 4, 6, 6], 10) == [[2, 0], [3, 1]]
    assert pack_rows([3, 3, 3], 3, block=2) == [[0], [1], [2]]
    assert pack_rows([2, 2, 2, 2], 4, block=3) == [[0, 1], [2], [3]]  # blocks pack apart (TRL's map batches)
    with pytest.raises(ValueError, match="11 tokens"):
        pack_rows([11], 10)


def test_packed_positions_and_attention_are_per_row():
    """A mask numbering packed rows restarts positions at each row and blocks attention across rows; a 0/1
    mask keeps the plain rule (padding repeats the last position; a padding query sees the real tokens)."""
    import mindspore as ms

    from mindrlhf.models.decoder import MASK_VALUE, attention_bias, real_token_positions

    mask = ms.Tensor(np.array([[1, 1, 1, 2, 2, 3, 0, 0], [0, 1, 1, 1, 1, 1, 0, 0]], np.int32))
    np.testing.assert_array_equal(real_token_positions(mask).asnumpy(),
                                  [[0, 1, 2, 0, 1, 0, 5, 5], [0, 0, 1, 2, 3, 4, 4, 4]])  # padding: the plain rule
    bias = attention_bias(mask).asnumpy()[:, 0]
    allowed = bias == 0
    assert (bias[~allowed] == MASK_VALUE).all()
    seg = np.array([1, 1, 1, 2, 2, 3, 0, 0])
    want = np.tril(np.ones((8, 8), bool)) & (seg[None] > 0) & ((seg[None] == seg[:, None]) | (seg[:, None] == 0))
    np.testing.assert_array_equal(allowed[0], want)
    assert allowed[0, 4].tolist() == [False, False, False, True, True, False, False, False]
    plain = np.array([0, 1, 1, 1, 1, 1, 0, 0], bool)
    np.testing.assert_array_equal(allowed[1], np.tril(np.ones((8, 8), bool)) & plain[None])


def test_packed_loss_gradients_and_metrics_equal_unpacked(tiny_llama_dir):
    """Four rows packed into two sequences of up to 24 tokens train exactly as the four padded rows: the same
    loss, gradients, mean_token_accuracy and entropy (float32 summation order aside). With the segments
    dropped (one causal mask over each sequence) the loss differs, so the comparison can fail."""
    from types import SimpleNamespace

    from mindrlhf.models import load_model
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.sft import SFTObjective, sequences
    from mindrlhf.sft import sft_micro_batches as micro_batches
    from mindrlhf.trainer.update import Updater

    model = load_model(tiny_llama_dir)
    ids, masks = _rows(model.config.vocab_size, seed=2)
    rows = SimpleNamespace(input_ids=ids, completion_mask=masks)
    packed = sequences(rows, max_length=24)  # rows of 12, 5, 13 and 11 tokens: (13 + 11) and (12 + 5)
    assert [len(s) for s in packed["input_ids"]] == [24, 17]
    np.testing.assert_array_equal(packed["input_ids"][1], np.r_[ids[0], ids[1]])
    np.testing.assert_array_equal(packed["segments"][1], np.r_[np.full(12, 1), np.full(5, 2)])
    trained = float(sum(m.sum() for m in masks))
    assert trained == sum(m.sum() for m in packed["trained"])
    updater = Updater(model, SFTObjective(), head=LogProbHead(stats=True), lr=0.0, weight_decay=0.0,
                      betas=(0.9, 0.999), eps=1e-8, max_grad_norm=0.0, jit=False)

    def run(mbs):
        grads, loss, aux = updater.runner.loss_and_grads(mbs, SFTObjective.inputs, extra=_scalars(trained))
        return loss, [g.asnumpy() for g in grads], np.asarray(aux).sum(0)  # aux rows: one per micro-batch

    loss, grads, aux = run(micro_batches(ids, masks, 4, pad_id=0))
    packed_mbs = micro_batches(packed["input_ids"], packed["trained"], 2, pad_id=0, segments=packed["segments"])
    assert packed_mbs[0]["attention_mask"].max() == 2
    loss_p, grads_p, aux_p = run(packed_mbs)
    assert abs(loss_p - loss) <= 1e-6 * loss
    for a, b in zip(grads, grads_p):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(aux_p, aux, rtol=1e-5)  # trained tokens, correct, entropy sums
    leaky = [dict(mb, attention_mask=(mb["attention_mask"] > 0).astype(np.int32)) for mb in packed_mbs]
    assert abs(run(leaky)[0] - loss) > 1e-3 * loss


def test_shared_cuts_and_length_order_train_as_row_cuts_in_data_order(tiny_llama_dir):
    """Rows of 5+7, 2+3, 9+4 and 1+10 tokens (untrained start + trained rest) in micro-batches of 2, bucket 4. Cut
    at each row's first trained token, the data order pads to 16 and 24 columns; a shared cut (the earliest first
    trained token, rounded down to the bucket) makes the second 16 wide, and ``auto`` takes it there only (a tie
    keeps the row cuts); longest first (``longest_first``) both are 16 with ``auto``. Every layout gives the same
    loss (1e-6), gradients and metric sums: only padding and the head's untrained columns change."""
    from mindrlhf.models import load_model
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.sft import SFTObjective
    from mindrlhf.sft import sft_micro_batches as micro_batches
    from mindrlhf.trainer.offline import longest_first
    from mindrlhf.trainer.update import Updater

    model = load_model(tiny_llama_dir)
    ids, masks = _rows(model.config.vocab_size, seed=3)
    trained = float(sum(m.sum() for m in masks))
    updater = Updater(model, SFTObjective(), head=LogProbHead(stats=True), lr=0.0, weight_decay=0.0,
                      betas=(0.9, 0.999), eps=1e-8, max_grad_norm=0.0, jit=False)

    def run(mbs):
        grads, loss, aux = updater.runner.loss_and_grads(mbs, SFTObjective.inputs, extra=_scalars(trained))
        return loss, [g.asnumpy() for g in grads], np.asarray(aux).sum(0)

    def widths(mbs):  # input columns + the dropped last one; the head's columns
        return [(mb["input_ids"].shape[1] + 1, mb["completion_ids"].shape[1]) for mb in mbs]

    rows = longest_first({"input_ids": ids, "trained": masks, "index": np.arange(4)}, [len(r) for r in ids])
    np.testing.assert_array_equal(rows["index"], [2, 0, 3, 1])
    layouts = {
        "row": micro_batches(ids, masks, 2, pad_id=0, bucket=4, cut="row"),
        "shared": micro_batches(ids, masks, 2, pad_id=0, bucket=4, cut="shared"),
        "auto": micro_batches(ids, masks, 2, pad_id=0, bucket=4),
        "auto, longest first": micro_batches(rows["input_ids"], rows["trained"], 2, pad_id=0, bucket=4),
        "widths 20, 28": micro_batches(rows["input_ids"], rows["trained"], 2, pad_id=0, bucket=4, widths=[20, 28]),
    }
    assert widths(layouts["row"]) == [(16, 8), (24, 12)]
    assert widths(layouts["shared"]) == [(16, 12), (16, 12)]  # cut after 2 (2 < 4) and after 1
    assert widths(layouts["auto"]) == [(16, 8), (16, 12)]
    assert widths(layouts["auto, longest first"]) == [(16, 12), (16, 12)]  # shared after 4; a tie: row cuts
    # both cuts of each micro-batch widen to 20: a tie, so row cuts, the completions padded on (12 + 8, 4 + 16)
    assert widths(layouts["widths 20, 28"]) == [(20, 8), (20, 16)]
    loss, grads, aux = run(layouts["row"])
    for name, mbs in layouts.items():
        assert int(sum(mb["completion_mask"].sum() for mb in mbs)) == trained, name
        got_loss, got_grads, got_aux = run(mbs)
        assert abs(got_loss - loss) <= 1e-6 * loss, name
        for a, b in zip(grads, got_grads):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(got_aux, aux, rtol=1e-5, err_msg=name)


def test_width_grid_pads_least_within_the_count():
    """Widths 32, 32, 64, 96 x3, 128, 160, 192 in 3 widths ending at 192: 32/96/192 pads 32 (64 -> 96) + 64 + 32
    (128, 160 -> 192) = 128 columns, every other choice more (64/96/192: 160; 96/160/192: 192; 32/128/192: 192). As
    few distinct widths as allowed: no grid. A width past the grid stays as it is."""
    from mindrlhf.trainer.offline import grid_width, width_grid

    assert width_grid([32, 32, 64, 96, 96, 96, 128, 160, 192], 192, 3) == [32, 96, 192]
    assert width_grid([32, 64, 96], 128, 4) is None
    assert width_grid([32, 32, 64, 96, 96, 160], 128, 3) == [32, 96, 128]  # a row wider than top counts at top
    assert [grid_width(w, [32, 96, 192]) for w in (1, 32, 33, 192, 224)] == [32, 32, 96, 192, 224]


def test_micro_batch_widths_hold_every_micro_batch_of_any_step():
    """Rows of 20-700 tokens whose first trained token falls anywhere: the grid has at most 8 widths, and every
    micro-batch of 3 that steps of 6 random rows form, longest first with the cut ``auto`` picks, is one of them."""
    from mindrlhf.sft import micro_batch_widths, sft_micro_batches, split_point
    from mindrlhf.trainer.offline import longest_first

    rng = np.random.default_rng(0)
    ids, trained = [], []
    for _ in range(200):
        n = int(rng.integers(20, 700))
        ids.append(np.ones(n, np.int32))
        trained.append((np.arange(n) >= rng.integers(1, n)).astype(np.int8))
    grid = micro_batch_widths(ids, [split_point(m) for m in trained], 8)
    assert grid is not None and len(grid) <= 8
    seen = set()
    for _ in range(100):
        pick = rng.choice(len(ids), 6, replace=False)
        rows = longest_first({"input_ids": [ids[i] for i in pick], "trained": [trained[i] for i in pick]},
                             [len(ids[i]) for i in pick])
        for mb in sft_micro_batches(rows["input_ids"], rows["trained"], 3, 0, widths=grid):
            seen.add(mb["input_ids"].shape[1] + 1)
    assert seen <= set(grid) and len(seen) > 4

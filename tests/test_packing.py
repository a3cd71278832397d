"""Shared-prompt packing (models.packing): the packed forward/backward equals the padded one."""
from __future__ import annotations

import numpy as np
import pytest

from mindrlhf.models.packing import group_rows, pack_shared_prompts
from mindrlhf.trainer.experience import left_pad, right_pad


def _rows(vocab: int, seed: int = 0):
    """Six rows: 3 completions of prompt A (5 tokens), 2 of prompt B (3 tokens), 1 of prompt C
    (8 tokens); prompts left-padded to 8 columns, completions of 1-6 tokens right-padded to 6."""
    rng = np.random.default_rng(seed)
    a, b, c = (list(rng.integers(1, vocab, n)) for n in (5, 3, 8))
    prompts = [a, a, a, b, b, c]
    completions = [list(rng.integers(1, vocab, n)) for n in (6, 2, 4, 1, 6, 3)]
    prompt_ids, prompt_mask = left_pad(prompts, 8, 0)
    comp_ids = right_pad(completions, 6, 0, np.int32)
    present = right_pad([[1] * len(x) for x in completions], 6, 0, np.int32)
    ids = np.concatenate([prompt_ids, comp_ids], axis=1)[:, :-1].astype(np.int32)
    mask = np.concatenate([prompt_mask, present], axis=1)[:, :-1].astype(np.int32)
    return ids, mask, comp_ids, present.astype(np.float32)


def test_groups_and_layout_by_hand():
    ids, mask, comp, present = _rows(50)
    assert group_rows(ids, mask, 8).tolist() == [0, 0, 0, 1, 1, 2]
    packed = pack_shared_prompts(ids, mask, 6)
    # 3 groups; the widest has 3 completion slots of 5 input tokens behind the 8 prompt columns.
    assert packed.input_ids.shape == (3, 8 + 3 * 5)
    assert packed.prompt_bias.shape == (3, 1, 8, 8) and packed.completion_bias.shape == (3 * 3, 1, 5, 8 + 5)
    # Row 1 (group 0, slot 1): its first token is predicted at the prompt's last column, the rest
    # at slot 1's columns 8 + 5 .. 8 + 9.
    assert packed.gather_index[1].tolist() == [7, 13, 14, 15, 16, 17]
    assert packed.gather_index[3].tolist() == [23 + 7, 23 + 8, 23 + 9, 23 + 10, 23 + 11, 23 + 12]
    # Prompt A has 5 real tokens (positions 0-4); completion tokens continue at 5, 6, ...; row 1's
    # completion has 2 tokens, and its padding repeats the last position, as in its padded row.
    assert packed.position_ids[0, 3:8].tolist() == [0, 1, 2, 3, 4]
    assert packed.position_ids[0, 8:13].tolist() == [5, 6, 7, 8, 9]
    assert packed.position_ids[0, 13:18].tolist() == [5, 6, 6, 6, 6]
    prompt = packed.prompt_bias[0, 0] == 0  # prompt A over itself: real tokens (columns 3-7), causally
    assert prompt[5, 3:6].all() and not prompt[5, :3].any() and not prompt[5, 6:].any()
    # Packed column 14 is group 0, slot 1, token 1: the real prompt, then its own slot causally.
    slot = packed.completion_bias[0 * 3 + 1, 0] == 0
    assert slot[1, 3:8].all() and not slot[1, :3].any()
    assert slot[1, 8:10].all() and not slot[1, 10:].any()
    # Slot j's keys: the 8 prompt columns, then its own 5 columns.
    assert packed.slot_keys.tolist() == [*range(8), *range(8, 13), *range(8), *range(13, 18), *range(8), *range(18, 23)]
    # Group 1 has two completions: its third slot is empty and sees only the real prompt.
    empty = packed.completion_bias[1 * 3 + 2, 0] == 0
    assert empty[:, 5:8].all() and not empty[:, :5].any() and not empty[:, 8:].any()
    assert pack_shared_prompts(ids[[0, 3, 5]], mask[[0, 3, 5]], 6) is None  # nothing shared


@pytest.mark.parametrize("which", ["tiny_qwen2_dir", "tiny_llama_dir"])
def test_packed_logprobs_and_gradients_equal_the_padded_rows(which, request):
    import mindspore as ms
    from mindspore import Tensor

    from mindrlhf.models import load_model

    model = load_model(request.getfixturevalue(which))
    ids, mask, comp, present = _rows(model.config.vocab_size)
    packed = pack_shared_prompts(ids, mask, 6)
    weights = Tensor(np.random.default_rng(1).normal(size=present.shape).astype(np.float32) * present)

    def padded():
        return model.sequence_logprobs(Tensor(ids), Tensor(mask), Tensor(comp), 0.7)

    def shared():
        return model.packed_logprobs(Tensor(packed.input_ids), Tensor(packed.position_ids), Tensor(packed.prompt_bias),
                                     Tensor(packed.completion_bias), Tensor(packed.slot_keys),
                                     Tensor(packed.gather_index), Tensor(comp), 0.7)

    want, got = padded().asnumpy(), shared().asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # padding positions included
    params = model.trainable_params()
    g_pad = ms.grad(lambda: (padded() * weights).sum(), None, params)()
    g_pack = ms.grad(lambda: (shared() * weights).sum(), None, params)()
    for p, a, b in zip(params, g_pad, g_pack):
        a, b = a.asnumpy(), b.asnumpy()
        assert np.linalg.norm(a) > 0, p.name
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(a), p.name


def test_packed_critic_values_and_gradients_equal_the_padded_rows(tmp_path):
    """PPO's critic (``ValueHead``'s packed form): a one-label model's values at the positions predicting each
    completion token, and their gradients, are those of the padded rows (valid positions; a padded row's
    positions after its last token predict nothing and are never trained)."""
    import mindspore as ms
    from mindspore import Tensor

    from mindrlhf.models import load_model
    from mindrlhf.testing import make_tiny_reward_model

    model = load_model(make_tiny_reward_model(tmp_path / "critic", seed=3))
    ids, mask, comp, present = _rows(model.config.vocab_size)
    packed = pack_shared_prompts(ids, mask, 6)
    weights = Tensor(np.random.default_rng(2).normal(size=present.shape).astype(np.float32) * present)

    def padded():
        return model.completion_values(model.stage_forward(Tensor(ids), Tensor(mask)), comp.shape[1])

    def shared():
        arrays = (packed.input_ids, packed.position_ids, packed.prompt_bias, packed.completion_bias, packed.slot_keys,
                  packed.gather_index)
        return model.packed_values(*map(Tensor, arrays))

    want, got = padded().asnumpy(), shared().asnumpy()
    real = present > 0
    assert np.abs(want[real]).max() > 0.01
    np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=1e-5)
    params = model.trainable_params()
    g_pad = ms.grad(lambda: (padded() * weights).sum(), None, params)()
    g_pack = ms.grad(lambda: (shared() * weights).sum(), None, params)()
    for p, a, b in zip(params, g_pad, g_pack):
        a, b = a.asnumpy(), b.asnumpy()
        if p.name != "model.embed_tokens.weight":  # rows of unused tokens: 0 both ways
            assert np.linalg.norm(a) > 0, p.name
        assert np.linalg.norm(a - b) <= 1e-5 * max(np.linalg.norm(a), 1e-12), p.name


@pytest.mark.slow
def test_grpo_steps_with_shared_prompts_equal_padded_rows(grpo_assets, tmp_path):
    """Replayed rollouts, reference KL and two iterations (old-policy log-probs): the same loss,
    grad norm, KL, clip metrics and updated weights with and without shared-prompt packing."""
    import mindspore as ms

    from grpo_runs import assert_same_updated_weights, grpo_args, is_timing, read_rows, run_inprocess

    dump = tmp_path / "exp" / "rollouts.npz"
    common = dict(max_steps=2, beta=0.04, num_iterations=2, micro_batch_size=4, lr=1e-4,
                  reward_funcs=["e2e_rewards:length_reward"])
    assert run_inprocess(grpo_args(grpo_assets, tmp_path / "record", save_data_file=dump, **common)) == 0
    runs = {}
    for share in ("true", "false"):
        runs[share] = tmp_path / f"share_{share}"
        assert run_inprocess(grpo_args(grpo_assets, runs[share], replay_data_file=dump, share_prompts=share,
                                       **common)) == 0
    packed, padded = read_rows(runs["true"]), read_rows(runs["false"])
    for a, b in zip(packed, padded):
        assert a["grad_norm"] > 0 and a["kl"] > 0
        for key in a:
            if not is_timing(key):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    weights = [ms.load_checkpoint(str(runs[s] / "checkpoints" / "step_00000002" / "policy.ckpt")) for s in runs]
    assert_same_updated_weights(*weights, lr=1e-4)

"""The rollout step's shape (trainer.rollout): ``collect`` returns a typed ``ScoredRollout`` (texts, prompts,
solutions and the policy version of every row, the reward step timed on its own), ``PhaseTimer`` fills the
step's ``time/*`` in the order the phases ran, and ``mini_batch`` is the one slicing GRPO and PPO train with."""
from __future__ import annotations

import numpy as np
import pytest

from grpo_runs import grpo_args


def test_phase_timer_adds_each_phase_in_the_order_first_run():
    from mindrlhf.trainer.rollout import PhaseTimer

    timer = PhaseTimer()
    for name in ("time/b", "time/a", "time/b"):
        with timer(name):
            pass
    with pytest.raises(ZeroDivisionError), timer("time/failed"):
        _ = 1 / 0  # a phase that raises is still timed
    assert list(timer.times) == ["time/b", "time/a", "time/failed"]
    assert all(v >= 0.0 for v in timer.times.values())


@pytest.mark.slow
def test_collect_returns_the_scored_rows_and_mini_batches_slice_them(grpo_assets, tmp_path):
    from mindrlhf import grpo
    from mindrlhf.configs import parse_args
    from mindrlhf.trainer.rollout import PhaseTimer

    cfg = parse_args(grpo_args(grpo_assets, tmp_path / "run", max_steps=2, chunk_size=2, num_generations=4,
                               tensorboard="false"))
    trainer = grpo.build_trainer(cfg)
    timer = PhaseTimer()
    scored = trainer.collect(1, timer)
    exp = scored.exp
    assert len(exp) == len(scored.texts) == len(scored.prompts) == len(scored.solutions) == 8
    assert list(timer.times) == ["time/generate", "time/reward"]
    np.testing.assert_array_equal(scored.policy_version, np.zeros(8, np.int64))  # sampled by the initial policy
    present = exp.extras["completion_present"] > 0
    for i in range(8):
        assert scored.texts[i] == trainer.tokenizer.decode(exp.completion_ids[i][present[i]].tolist(),
                                                           skip_special_tokens=True)
        assert scored.prompts[i] == exp.prompt_ids[i][exp.prompt_mask[i] > 0].tolist()
        assert scored.solutions[i] == trainer.dataset.solution[int(exp.prompt_index[i])]
    # The reward step scored every row; GRPO's advantages are group-relative (each group of 4 sums to 0).
    assert np.isfinite(exp.rewards).all()
    np.testing.assert_allclose(exp.advantages.reshape(2, 4).sum(1), 0.0, atol=1e-5)

    # Mini-batch k of n holds rows j = k mod n, its denominators count its loss tokens and non-empty rows.
    exp.completion_mask[1, :] = 0.0  # a row with no loss token counts in no denominator
    for k in range(2):
        mb = trainer.mini_batch(exp, k, 2)
        rows = np.arange(k, 8, 2)
        np.testing.assert_array_equal(np.concatenate(mb.pieces), rows)
        assert mb.num_tokens == exp.completion_mask[rows].sum()
        assert mb.num_seqs == (exp.completion_mask[rows].sum(1) > 0).sum()
        micro = mb.micro(advantages=exp.advantages)
        np.testing.assert_array_equal(np.concatenate([m["advantages"] for m in micro]), exp.advantages[rows])
        np.testing.assert_array_equal(np.concatenate([m["completion_ids"] for m in micro]), exp.completion_ids[rows])

    trainer.train_one_step()  # one update, then the sampler holds the updated weights
    assert (trainer.collect(2, PhaseTimer()).policy_version == 1).all()

"""Disaggregated rollout (``gen_workers``): the config's rules and errors, the layout arithmetic of the two
sides, the rollout rows' wire format, (msrun) one generator + one trainer at max_staleness 0 giving the colocated
one-process run's metrics and weights, and at max_staleness 1 (one step off) the rows' staleness and the two sides'
busy intervals overlapping in wall-clock time."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from grpo_runs import BYHAND
from grpo_runs import grpo_args as _args
from grpo_runs import is_timing as _timing
from grpo_runs import msrun as _msrun
from grpo_runs import read_rows as _metrics
from grpo_runs import run_inprocess as _run_inprocess
from mindrlhf.configs import PPOConfig, parse_args
from mindrlhf.errors import MindRLHFError
from mindrlhf.generation import Completion
from mindrlhf.parallel.groups import RunLayout, data_parallel_groups, disaggregated_layouts
from mindrlhf.parallel.layout import ParallelLayout
from mindrlhf.trainer.disaggregated import pack_completions, unpack_completions


def _error(argv) -> str:
    with pytest.raises(MindRLHFError) as err:
        parse_args(argv)
    text = str(err.value)
    assert "\n" not in text
    return text


# -- config ---------------------------------------------------------------------------------------------
def test_gen_workers_sets_the_generator_layout_and_the_world():
    cfg = parse_args(["--use_parallel", "true", "--gen_workers", "2", "--chunk_size", "4", "--train_dp", "2",
                      "--eval_steps", "2", "--replay_data_file", "r.npz"])  # the trainers evaluate, or replay
    p = cfg.parallel
    assert (p.gen_workers, p.infer_dp, p.max_staleness) == (2, 2, 0)
    # One step off, and a larger bound, are accepted with generator ranks.
    for bound in (1, 4):
        argv = ["--use_parallel", "true", "--gen_workers", "1", "--max_staleness", str(bound)]
        assert parse_args(argv).parallel.max_staleness == bound
        assert parse_args(argv + ["--dynamic_sampling", "true"]).algorithm.dynamic_sampling  # rounds one step off
    assert cfg.world_size == 4  # two trainers + two generators
    colocated = parse_args([])
    assert (colocated.parallel.gen_workers, colocated.world_size) == (0, 1)


@pytest.mark.parametrize("argv, words", [
    (["--use_parallel", "true", "--max_staleness", "1"],
     "max_staleness 1 with gen_workers 0: a colocated run has no generation to overlap with training"),
    (["--use_parallel", "true", "--gen_workers", "1", "--loss_type", "decoupled",
      "--importance_sampling_correction", "true"],
     "loss_type = 'decoupled' with importance_sampling_correction = true"),
    (["--use_parallel", "true", "--gen_workers", "2", "--infer_dp", "1"],
     "gen_workers = 2 generator ranks but infer_dp*infer_tp = 1*1 = 1"),
    # infer_tp must divide the generator ranks (infer_dp then defaults to their quotient).
    (["--use_parallel", "true", "--gen_workers", "3", "--infer_tp", "2"],
     "gen_workers = 3 generator ranks but infer_dp*infer_tp = 1*2 = 2; the generators' layout must fill them"),
    (["--use_parallel", "true", "--gen_workers", "2", "--train_tp", "2", "--infer_tp", "2", "--infer_dp", "2"],
     "gen_workers = 2 generator ranks but infer_dp*infer_tp = 2*2 = 4"),
    # The trainers evaluate on their policy, which a pipeline stage cannot sample with.
    (["--use_parallel", "true", "--gen_workers", "1", "--train_pp", "2", "--eval_steps", "2"],
     "eval_steps = 2 with gen_workers = 1 and train_pp = 2: the trainers evaluate with their policy"),
    # LoRA samples with the trained policy itself, so it stays colocated.
    (["--use_parallel", "true", "--gen_workers", "1", "--lora_rank", "4"],
     "LoRA samples with the trained policy itself"),
    (["--gen_workers", "1"], "gen_workers = 1 needs use_parallel true"),
    (["--use_parallel", "true", "--gen_workers", "2", "--chunk_size", "3"],
     "chunk_size = 3 is not divisible by infer_dp = 2"),
    # Colocated, the old rule stands: the same processes train and generate.
    (["--use_parallel", "true", "--train_dp", "2"], "train world size train_dp*train_tp*train_pp = 2*1*1 = 2 != infer"),
])
def test_impossible_settings_are_one_line_errors(argv, words):
    assert words in _error(argv)


@pytest.mark.parametrize("parse", [parse_args, PPOConfig.parse_args], ids=["grpo", "ppo"])
def test_a_negative_gen_workers_is_the_one_field_named(parse):
    """infer_dp follows gen_workers only when gen_workers is valid: the error names the field given, not a derived
    infer_dp the user never set."""
    with pytest.raises(MindRLHFError) as err:
        parse(["--use_parallel", "true", "--gen_workers", "-1"])
    assert str(err.value) == "invalid config (command line): gen_workers = -1 must be >= 0"


def test_tensor_and_pipeline_layouts_are_accepted_on_both_sides():
    """Trainers in train_tp x train_pp and generators in infer_dp x infer_tp (infer_dp defaults to
    gen_workers / infer_tp); the world is both sides."""
    cfg = parse_args(["--use_parallel", "true", "--gen_workers", "2", "--train_tp", "2", "--infer_tp", "2"])
    p = cfg.parallel
    assert (p.train_dp, p.train_tp, p.infer_dp, p.infer_tp, cfg.world_size) == (1, 2, 1, 2, 4)
    cfg = parse_args(["--use_parallel", "true", "--gen_workers", "4", "--train_tp", "2", "--train_pp", "2",
                      "--train_micro_batches", "2", "--infer_tp", "2", "--max_staleness", "1"])
    p = cfg.parallel
    assert (p.train_pp, p.infer_dp, p.infer_tp, p.max_staleness, cfg.world_size) == (2, 2, 2, 1, 8)
    # A pipeline without eval_steps, and tensor-parallel trainers that evaluate, are accepted.
    assert parse_args(["--use_parallel", "true", "--gen_workers", "1", "--train_tp", "2",
                       "--eval_steps", "2"]).train.eval_steps == 2
    ppo = PPOConfig.parse_args(["--use_parallel", "true", "--gen_workers", "2", "--train_tp", "2", "--infer_tp", "2"])
    assert (ppo.parallel.infer_dp, ppo.world_size) == (1, 4)


def test_ppo_takes_gen_workers_with_grpos_rules():
    """PPO disaggregates as GRPO does: the generators' layout follows gen_workers, the config's
    one-line errors are the same (what is not built yet, named)."""
    cfg = PPOConfig.parse_args(["--use_parallel", "true", "--gen_workers", "2", "--max_staleness", "1"])
    assert (cfg.parallel.gen_workers, cfg.parallel.infer_dp, cfg.parallel.max_staleness, cfg.world_size) == (2, 2, 1, 3)
    # The trainers evaluate (eval_steps), as a colocated run does.
    evaluating = PPOConfig.parse_args(["--use_parallel", "true", "--gen_workers", "1", "--eval_steps", "2"])
    assert evaluating.train.eval_steps == 2
    with pytest.raises(MindRLHFError, match="batch_size = 3 is not divisible by infer_dp = 2"):
        PPOConfig.parse_args(["--use_parallel", "true", "--gen_workers", "2", "--batch_size", "3"])


# -- layouts --------------------------------------------------------------------------------------------
def test_layouts_follow_the_world_and_gen_workers():
    one = ParallelLayout()
    train, infer = disaggregated_layouts(2, 1, one, one)
    assert (train.dp, infer.dp) == (1, 1)
    # train_dp not given: the trainers are what the generators leave
    train, infer = disaggregated_layouts(6, 2, one, ParallelLayout(dp=2), train_dp_given=False)
    assert (train.dp, train.world_size, infer.dp) == (4, 4, 2)
    with pytest.raises(MindRLHFError, match=r"gen_workers = 2 of a world of 2 workers leaves 0 to train"):
        disaggregated_layouts(2, 2, one, ParallelLayout(dp=2))
    with pytest.raises(MindRLHFError, match=r"train_dp\*train_tp\*train_pp = 1\*1\*1 = 1 but world 4 - gen_workers 1 "
                                            r"leaves 3 trainer ranks; set train_dp 3"):
        disaggregated_layouts(4, 1, one, one)
    with pytest.raises(MindRLHFError, match=r"3 trainer ranks \(world 4 - gen_workers 1\) are not a multiple of "
                                            r"train_tp\*train_pp = 2\*1"):
        disaggregated_layouts(4, 1, ParallelLayout(tp=2), one, train_dp_given=False)
    with pytest.raises(MindRLHFError, match=r"infer_dp\*infer_tp = 1\*1 = 1 does not fill the gen_workers = 2"):
        disaggregated_layouts(4, 2, ParallelLayout(dp=2), one)
    # Tensor / pipeline parallel trainers: train_dp is what the trainers leave per tp x pp replica.
    train, infer = disaggregated_layouts(6, 2, ParallelLayout(tp=2, pp=2, micro_batches=2), ParallelLayout(tp=2),
                                         train_dp_given=False)
    assert (train.dp, train.tp, train.pp, infer.dp, infer.tp) == (1, 2, 2, 1, 2)


def test_a_generator_replica_speaks_through_its_tp_rank_0():
    """With infer_tp > 1 the tp ranks of a generator replica sample the same rows: the trainers take one block per
    replica (its tp rank 0's), in replica order, from the job-wide gather (trainers' zero blocks first)."""
    from mindrlhf.trainer.disaggregated import RolloutLink

    infer = ParallelLayout(dp=2, tp=2)
    layout = RunLayout(ParallelLayout(tp=2), infer, data_parallel_groups(0, 2), None, rank=0, gen_workers=4)
    link = RolloutLink(layout, rows_per_generator=1, width=1)
    gathered = np.arange(6, dtype=np.float32)[:, None]  # ranks 0-1 train, 2-5 generate (replica 0: 2, 3; 1: 4, 5)
    assert link._representatives(gathered).ravel().tolist() == [2.0, 4.0]


def test_a_trainer_reads_whole_batches_and_a_generator_its_share():
    train, infer = ParallelLayout(dp=2), ParallelLayout(dp=3)
    trainer = RunLayout(train, infer, data_parallel_groups(1, 2), None, rank=1, gen_workers=3)
    generator = RunLayout(train, infer, data_parallel_groups(2, 3), None, rank=2, gen_workers=3, generator=True)
    colocated = RunLayout(infer, infer, data_parallel_groups(2, 3), None, rank=2)
    assert (trainer.data_shard, generator.data_shard, colocated.data_shard) == ((0, 1), (2, 3), (2, 3))
    assert trainer.disaggregated and not colocated.disaggregated


# -- the rollout rows on the wire -----------------------------------------------------------------------
def test_completions_cross_exactly():
    rng = np.random.default_rng(0)
    sent = [Completion(prompt_index=i, token_ids=rng.integers(0, 151_936, n).tolist(),
                       logprobs=rng.normal(size=n).astype(np.float32).tolist(), finish_reason=reason,
                       entropies=rng.random(n).astype(np.float32).tolist())
            for i, (n, reason) in enumerate([(5, "length"), (0, "stop"), (3, "stop")])]
    block = pack_completions(sent, [7, 7, 7], rows=3, width=5)
    got, versions = unpack_completions(block, width=5)
    assert versions.tolist() == [7, 7, 7]
    for a, b in zip(sent, got):
        assert (a.token_ids, a.logprobs, a.finish_reason, a.entropies) == \
            (b.token_ids, b.logprobs, b.finish_reason, b.entropies)
    with pytest.raises(MindRLHFError, match="sampled 3 completions where the step needs 4"):
        pack_completions(sent, [0, 0, 0], rows=4, width=5)
    # A sampler without entropies (vLLM): none arrive, not zeros that the entropy metric would average.
    plain = [Completion(prompt_index=0, token_ids=[3, 4], logprobs=[-0.5, -1.0], finish_reason="stop"),
             Completion(prompt_index=1, token_ids=[], logprobs=[], finish_reason="stop")]
    got, _ = unpack_completions(pack_completions(plain, [1, 1], rows=2, width=5), width=5)
    assert [c.entropies for c in got] == [[], []] and [c.token_ids for c in got] == [[3, 4], []]
    # One-turn completions (no tools): no tool mask, no calls, one turn, as the sampler made them.
    assert [(c.tool_mask, c.tool_calls, c.tool_failures, c.turns) for c in got] == [([], 0, 0, 1)] * 2


def test_tool_using_completions_cross_exactly():
    """The generators run the tools: each row's tool mask (policy 1, tool 0), its calls, failed calls and turns
    arrive as sampled, beside rows without a mask (no call: the loop returns the sampler's completions)."""
    rng = np.random.default_rng(1)
    masks = [[1, 1, 0, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [], [1] * 8]
    counts = [(1, 0, 2), (3, 2, 2), (0, 0, 1), (12, 12, 6)]
    sent = [Completion(prompt_index=i, token_ids=rng.integers(0, 151_936, len(m) or 4).tolist(),
                       logprobs=[0.0 if not t else float(np.float32(x)) for t, x in zip(m or [1] * 4,
                                                                                    rng.normal(size=8))],
                       finish_reason="length" if i == 3 else "stop", tool_mask=m, tool_calls=calls,
                       tool_failures=failures, turns=turns)
            for i, (m, (calls, failures, turns)) in enumerate(zip(masks, counts))]
    got, versions = unpack_completions(pack_completions(sent, [3, 3, 3, 3], rows=4, width=8), width=8)
    assert versions.tolist() == [3, 3, 3, 3]
    for a, b in zip(sent, got):
        assert (a.token_ids, a.logprobs, a.finish_reason, a.entropies, a.tool_mask, a.tool_calls, a.tool_failures,
                a.turns) == (b.token_ids, b.logprobs, b.finish_reason, b.entropies, b.tool_mask, b.tool_calls,
                             b.tool_failures, b.turns)



def test_a_trainer_logs_the_tool_counts_it_received_once():
    """Every trainer of a disaggregated job received and counted every generator's completions, so its counts are
    the totals, not a share to sum over the trainers; trainer rank 1 of 2 beside one generator has no place in the
    infer layout, so no infer representative is asked for. A step with no rows counted (replayed) logs none."""
    from types import SimpleNamespace

    from mindrlhf.trainer.rollout import RolloutTrainer

    layout = RunLayout(ParallelLayout(dp=2), ParallelLayout(dp=1), data_parallel_groups(1, 2), None, rank=1,
                       gen_workers=1)
    trainer = SimpleNamespace(link=object(), layout=layout, _tool_counts=np.array([6.0, 3.0, 20.0, 16.0]))
    assert RolloutTrainer._tool_metrics(trainer) == {"tools/call_frequency": 6 / 16, "tools/failure_frequency": 0.5,
                                                     "tools/turns/mean": 20 / 16}
    assert not trainer._tool_counts.any()  # reset for the next step
    assert RolloutTrainer._tool_metrics(trainer) == {}


# -- the job ------------------------------------------------------------------------------------------------
#: The synchronous GRPO job the 1 + 1 equality test runs colocated (one process) and with one generator: two prompt
#: batches per step, the KL term, two updates per step, DAPO's dynamic sampling (a flat group for every even-length
#: question, so steps sample more rounds), the calculator tool (run by the generator: the random model calls it
#: rarely if ever, so the rows are one-turn ones; ``test_tool_using_completions_cross_exactly`` covers the tool
#: fields), the evaluation at the last step and the rollouts recorded.
SYNCHRONOUS = dict(max_steps=2, num_rollouts=2, beta=0.04, mini_batch_size=8, lr=1e-3, tensorboard="false",
                   dynamic_sampling="true", max_sampling_rounds=3, eval_steps=2, eval_limit=4,
                   reward_funcs=["accuracy", "e2e_rewards:flat_for_even_questions"], tools=["calculator"])


@pytest.fixture(scope="module")
def synchronous(grpo_assets, tmp_path_factory):
    """``SYNCHRONOUS`` colocated in one process (``colocated/``) and under msrun world 2 with gen_workers 1 at
    max_staleness 0 (``disaggregated/``), each recording its rollouts (``<run>.npz``: ``.step<N>.npz`` files)."""
    root = tmp_path_factory.mktemp("synchronous")
    one, two = root / "colocated", root / "disaggregated"
    assert _run_inprocess(_args(grpo_assets, one, save_data_file=root / "colocated.npz", **SYNCHRONOUS)) == 0
    _msrun(2, _args(grpo_assets, two, use_parallel="true", gen_workers=1, save_data_file=root / "disaggregated.npz",
                    **SYNCHRONOUS), root / "log", 8161)
    return root


@pytest.mark.slow
@pytest.mark.msrun
def test_one_generator_one_trainer_equals_the_colocated_run(synchronous):
    """msrun world 2 with gen_workers 1 (rank 1 samples, rank 0 scores, runs the reference, trains and evaluates) at
    max_staleness 0: every metric (the eval/* rows and tools/* included) and the final weights equal the colocated
    one-process run's (float32, 1e-6), with two prompt batches per step, the KL term and two updates per step (old
    log-probs), the calculator tool (the generator runs it), and DAPO's dynamic sampling (a flat group for every
    even-length question, so a step samples further rounds: the trainer tells the generator after each round); every
    row was sampled by the policy of the step before
    (staleness 0); the trainer's --save_data_file dumps are the colocated run's."""
    import mindspore as ms

    from grpo_runs import EVAL_KEYS
    from mindrlhf.trainer.experience import step_file

    one, two = synchronous / "colocated", synchronous / "disaggregated"
    m1, m2 = _metrics(one), _metrics(two)
    assert [r["step"] for r in m2] == [1, 2]
    assert all(r["grad_norm"] > 1e-3 and r["reward_std"] > 0 for r in m1)  # not a vacuous comparison
    assert any(r["sampling/rounds"] > 1 for r in m2), [r["sampling/rounds"] for r in m2]  # rounds drawn remotely
    # The evaluation ran at step 2 (on the trainer: the generator has neither the rewards nor, one step off, the
    # step's weights); its rows are compared below with every other metric.
    assert set(EVAL_KEYS) <= set(m2[1]) and m2[1]["eval/mean_length"] > 0 and not set(EVAL_KEYS) & set(m2[0])
    # The generator ran the tool loop and the trainer logged its counts once (they equal colocated's below).
    for r in m2:
        assert r["tools/turns/mean"] >= 1.0 and 0.0 <= r["tools/failure_frequency"] <= 1.0, r
        assert r["tools/call_frequency"] > 0.0 or r["tools/turns/mean"] == 1.0, r  # no call, no second turn
    for a, b in zip(m1, m2):
        assert {k for k in set(b) - set(a) if not _timing(k)} == {"staleness/mean", "staleness/max"}
        assert {"time/generator_busy", "time/generator_idle", "time/trainer_busy", "time/trainer_idle"} <= set(b)
        assert b["staleness/mean"] == b["staleness/max"] == 0.0
        for key, value in a.items():
            if not _timing(key) and not (isinstance(value, float) and math.isnan(value)):
                assert b[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (a["step"], key, b[key], value)
    w1 = ms.load_checkpoint(str(one / "checkpoints" / "step_00000002" / "policy.ckpt"))
    w2 = ms.load_checkpoint(str(two / "checkpoints" / "step_00000002" / "policy.ckpt"))
    assert set(w1) == set(w2)
    for name in w1:
        np.testing.assert_allclose(w2[name].asnumpy(), w1[name].asnumpy(), rtol=1e-6, atol=1e-9, err_msg=name)
    # The generator rank wrote nothing: rank 0 alone logs, dumps and checkpoints.
    assert sorted(p.name for p in two.glob("completions_step_*.jsonl")) == ["completions_step_1.jsonl",
                                                                         "completions_step_2.jsonl"]
    assert (one / "completions_step_2.jsonl").read_text() == (two / "completions_step_2.jsonl").read_text()
    for step in (1, 2):  # --save_data_file: the rows dynamic sampling kept, as colocated
        want = np.load(step_file(str(synchronous / "colocated.npz"), step))
        got = np.load(step_file(str(synchronous / "disaggregated.npz"), step))
        assert set(want.files) == set(got.files)
        for name in want.files:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-9, err_msg=(step, name))


@pytest.mark.slow
@pytest.mark.msrun
def test_a_replay_with_generator_ranks_trains_as_the_recorded_run(grpo_assets, synchronous, tmp_path):
    """--replay_data_file with gen_workers 1 (the recorded run's own command line): the generator rank is told there
    is nothing to sample and stops at the start; the trainer trains on the recorded rows as the recorded run did
    (every metric the replay logs, and the final weights, equal the recording run's to 1e-6)."""
    import mindspore as ms

    out, logs = tmp_path / "replay", tmp_path / "log"
    argv = _args(grpo_assets, out, use_parallel="true", gen_workers=1,
                 replay_data_file=synchronous / "disaggregated.npz", **dict(SYNCHRONOUS, eval_steps=0))
    _msrun(2, argv, logs, 8165)
    recorded, replayed = _metrics(synchronous / "disaggregated"), _metrics(out)
    assert [r["step"] for r in replayed] == [1, 2]
    assert "nothing to sample, this generator rank stops" in (logs / "worker_1.log").read_text(errors="replace")
    for a, b in zip(recorded, replayed):
        assert not {k for k in b if k.startswith("staleness/") or k.startswith("time/generator")}, b  # no sampling
        # frac_reward_zero_std: the recording logged dynamic sampling's, over every group it drew (the dump holds
        # the kept ones).
        compared = [k for k, v in b.items() if not _timing(k) and not (isinstance(v, float) and math.isnan(v))
                    and k != "frac_reward_zero_std"]
        assert {"loss", "grad_norm", "kl", "reward"} <= set(compared)
        for key in compared:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key, b[key], a[key])
    w1 = ms.load_checkpoint(str(synchronous / "disaggregated" / "checkpoints" / "step_00000002" / "policy.ckpt"))
    w2 = ms.load_checkpoint(str(out / "checkpoints" / "step_00000002" / "policy.ckpt"))
    assert set(w1) == set(w2)
    for name in w1:
        np.testing.assert_allclose(w2[name].asnumpy(), w1[name].asnumpy(), rtol=1e-6, atol=1e-9, err_msg=name)


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.byhand
@pytest.mark.skipif(not BYHAND, reason="one more launch than CI's time holds: MINDRLHF_BYHAND=1")
def test_float16_with_one_generator_equals_the_colocated_float16_run(grpo_assets, tmp_path):
    """Mixed precision with a generator rank: float16 compute with float32 masters on the trainer (dynamic loss
    scale), the generator sampling with the pushed weights in float16: the colocated one-process float16 run's
    metrics and final weights (the synchronous job of the 1 + 1 test, without its evaluation)."""
    from grpo_runs import assert_same_disaggregated_run

    job = dict(SYNCHRONOUS, dtype="float16", eval_steps=0)
    assert _run_inprocess(_args(grpo_assets, tmp_path / "colocated", **job)) == 0
    _msrun(2, _args(grpo_assets, tmp_path / "one_one", use_parallel="true", gen_workers=1, **job),
           tmp_path / "log", 8199)
    assert_same_disaggregated_run(tmp_path / "colocated", tmp_path / "one_one")


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.byhand
@pytest.mark.skipif(not BYHAND, reason="two more 2- and 4-worker launches than CI's time holds: MINDRLHF_BYHAND=1")
def test_two_generators_two_trainers_equal_the_colocated_dp2_run(grpo_assets, tmp_path):
    """msrun world 4 with gen_workers 2 (ranks 2 and 3 sample, infer_dp 2; ranks 0 and 1 train, train_dp 2) at
    max_staleness 0 gives the colocated dp2 run's metrics and final weights (msrun world 2), the synchronous job of
    the 1 + 1 test (dynamic sampling rounds, the KL term, two updates per step, the evaluation)."""
    from grpo_runs import assert_same_disaggregated_run

    job = dict(SYNCHRONOUS, use_parallel="true", infer_dp=2)
    _msrun(2, _args(grpo_assets, tmp_path / "colocated", train_dp=2, **job), tmp_path / "log_colocated", 8191)
    _msrun(4, _args(grpo_assets, tmp_path / "two_two", gen_workers=2, **job), tmp_path / "log_two_two", 8193)
    assert any(r["sampling/rounds"] > 1 for r in _metrics(tmp_path / "two_two"))
    assert_same_disaggregated_run(tmp_path / "colocated", tmp_path / "two_two")


#: The GRPO job of the tensor/pipeline-parallel checks below (and of test_grpo_e2e's 2 + 2 tp launch, which runs in
#: CI): a reward with a spread in every group, the KL term, the layer graphs.
TP_JOB = dict(mini_batch_size=4, micro_batch_size=2, beta=0.04, max_steps=2, lr=1e-4, tensorboard="false",
              reward_funcs=["accuracy", "e2e_rewards:length_reward"], recompute="full")


def _same_training(reference, run, noise=None) -> None:
    """``run`` trained as ``reference`` did in another layout (float sums in another order): every metric to 1e-5
    but the wall-clock ones and ``noise`` (key prefix -> absolute tolerance: keys that carry the sampler's log-prob
    noise), and the final weights (``assert_same_updated_weights``)."""
    import mindspore as ms

    from grpo_runs import assert_same_updated_weights

    noise = noise or {}
    m1, m2 = _metrics(reference), _metrics(run)
    assert [r["step"] for r in m2] == [r["step"] for r in m1] == [1, 2]
    for a, b in zip(m1, m2):
        for key, value in a.items():
            if not _timing(key) and not (isinstance(value, float) and math.isnan(value)):
                tol = next((t for prefix, t in noise.items() if key.startswith(prefix)), 1e-7)
                assert b[key] == pytest.approx(value, rel=1e-5, abs=tol), (a["step"], key, b[key], value)
    w1, w2 = (ms.load_checkpoint(str(r / "checkpoints" / "step_00000002" / "policy.ckpt")) for r in (reference, run))
    assert_same_updated_weights(w1, w2, lr=1e-4)


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.byhand
@pytest.mark.skipif(not BYHAND, reason="two more launches than CI's time holds: MINDRLHF_BYHAND=1")
def test_pipeline_trainers_and_one_step_off_tp_equal_their_references(grpo_assets, tmp_path):
    """Tensor/pipeline parallel sides (test_grpo_e2e's 2 + 2 tp launch covers max_staleness 0 in CI): 2 trainers in
    train_pp 2 (2 pipeline micro-batches) + 1 generator give the one-process run's metrics and weights; one step off
    (decoupled loss), 2 trainers in train_tp 2 + 2 generators in infer_tp 2 give the 1 + 1 run's (staleness 0 then 1),
    its final weights and the weights in flight of its last checkpoint (rank 0 holds them whole)."""
    import mindspore as ms

    from grpo_runs import assert_same_updated_weights

    one = tmp_path / "one"
    assert _run_inprocess(_args(grpo_assets, one, **TP_JOB)) == 0
    pp = tmp_path / "pp"
    _msrun(3, _args(grpo_assets, pp, use_parallel="true", gen_workers=1, train_pp=2, train_micro_batches=2, **TP_JOB),
           tmp_path / "log_pp", 8211)
    _same_training(one, pp)

    off = dict(TP_JOB, use_parallel="true", max_staleness=1, loss_type="decoupled")
    one_one, tp = tmp_path / "one_one", tmp_path / "tp"
    _msrun(2, _args(grpo_assets, one_one, gen_workers=1, **off), tmp_path / "log_one_one", 8213)
    _msrun(4, _args(grpo_assets, tp, gen_workers=2, train_tp=2, infer_tp=2, **off), tmp_path / "log_tp", 8215)
    assert [(r["staleness/mean"], r["staleness/max"]) for r in _metrics(tp)] == [(0.0, 0.0), (1.0, 1.0)]
    # The decoupled loss (~1e-4) and the sampler/trainer log-prob gap carry the tp sampler's log-prob noise (~1e-6).
    _same_training(one_one, tp, noise={"loss": 5e-7, "sampling/sampling_logp_difference/": 1e-4,
                                       "sampling/importance_sampling_ratio/": 1e-4})
    w1, w2 = (ms.load_checkpoint(str(r / "checkpoints" / "step_00000002" / "in_flight.ckpt")) for r in (one_one, tp))
    assert_same_updated_weights(w1, w2, lr=1e-4)


#: The one-step-off run (GRPO, 1 generator + 1 trainer, decoupled loss, 3 steps, DAPO's dynamic sampling with a flat
#: group for every even-length question) that the async test and the kill tests share: a killed and resumed run must
#: end with its metrics.
ONE_STEP_OFF = dict(gen_workers=1, max_staleness=1, loss_type="decoupled", max_steps=3, lr=1e-3, tensorboard="false",
                    dynamic_sampling="true", max_sampling_rounds=3,
                    reward_funcs=["accuracy", "e2e_rewards:flat_for_even_questions"])


#: The uninterrupted run evaluates too (steps 2 and 3); the killed runs do not, so their comparison with it
#: (``_assert_same_training``) also shows that the evaluation leaves the training as it is.
EVAL_ONE_STEP_OFF = dict(eval_steps=2, eval_limit=4)


@pytest.fixture(scope="module")
def one_step_off(grpo_assets, tmp_path_factory):
    """The uninterrupted one-step-off run's output folder (one msrun launch for the module)."""
    root = tmp_path_factory.mktemp("one_step_off")
    _msrun(2, _args(grpo_assets, root / "async", use_parallel="true", **ONE_STEP_OFF, **EVAL_ONE_STEP_OFF),
           root / "log", 8163)
    return root / "async"


def _assert_same_training(reference: list, resumed: list) -> None:
    """A killed and resumed one-step-off run ends with the uninterrupted run's metrics: every one but the
    wall-clock ones, the NaN ones and the evaluation (which the killed runs do not make)."""
    assert [r["step"] for r in resumed] == [r["step"] for r in reference] == [1, 2, 3]
    for want, got in zip(reference, resumed):
        for key, value in want.items():
            nan = isinstance(value, float) and math.isnan(value)
            if not (_timing(key) or key.startswith("eval/") or nan):
                assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (want["step"], key, got[key], value)


@pytest.mark.slow
@pytest.mark.msrun
def test_one_step_off_trains_rows_one_update_old_while_the_generator_samples(one_step_off):
    """msrun world 2, gen_workers 1, max_staleness 1, loss_type decoupled, 3 steps: step 1's rows are fresh and every
    later row was sampled one update before the policy that trains it, the further rounds of dynamic sampling
    included; the generator samples step s + 1 while the
    trainer trains step s (their busy intervals, measured on one clock, overlap); the sampler/trainer log-prob gap
    shows the lag; each checkpoint keeps the weights the next step's rows are being sampled with."""
    out = one_step_off
    m = _metrics(out)
    assert [r["step"] for r in m] == [1, 2, 3]
    assert [(r["staleness/mean"], r["staleness/max"]) for r in m] == [(0.0, 0.0), (1.0, 1.0), (1.0, 1.0)]
    # DAPO's dynamic sampling one step off: the trainer asks for another round of the next step's rows (sampled with
    # the same stale weights, so every round's rows count as one update old above) before it pushes its update.
    assert any(r["sampling/rounds"] > 1 for r in m[1:]), [r["sampling/rounds"] for r in m]
    for r in m:
        assert r["time/generator_busy"] > 0 and r["time/trainer_busy"] > 0, r
        assert r["time/generator_idle"] >= 0 and r["time/trainer_idle"] >= 0, r
        assert r["grad_norm"] > 1e-3
    # The weights go out inside step s's receive from step 2 on: timed as the step's time/sync (the bench's weight
    # sync phase), not hidden in time/generate; step 1 pushes nothing.
    assert m[0]["time/sync"] < 1e-3 and all(r["time/sync"] > 1e-3 for r in m[1:]), [r["time/sync"] for r in m]
    for now, after in zip(m, m[1:]):
        # Step s's training and step s + 1's sampling, in seconds since the job started (one clock).
        train = (now["time/trainer_busy_start"], now["time/trainer_busy_end"])
        sample = (after["time/generator_busy_start"], after["time/generator_busy_end"])
        overlap = min(train[1], sample[1]) - max(train[0], sample[0])
        assert overlap > 0, (now["step"], train, sample)
    # Stale rows: the trainer's log-probs before the update differ from the sampler's by the lag's update (the
    # fresh step 1 only by float noise).
    gap = [r["sampling/sampling_logp_difference/mean"] for r in m]
    assert gap[0] < 1e-4 and min(gap[1:]) > 10 * gap[0], gap
    ckpt = out / "checkpoints"
    for step, version in ((1, 0), (2, 1)):
        folder = ckpt / f"step_{step:08d}"
        assert json.loads((folder / "state.json").read_text())["in_flight_version"] == version
        assert (folder / "in_flight.ckpt").is_file()


@pytest.mark.slow
@pytest.mark.msrun
def test_one_step_off_evaluates_the_weights_of_the_step_it_logs(one_step_off):
    """One step off, the eval at step N uses the weights of update N, as colocated (the trainer evaluates its
    policy): its rows equal mindrlhf-eval of checkpoint N, not of checkpoint N - 1 (the weights the generator holds
    then, sampling step N + 1)."""
    from grpo_runs import eval_row, mindrlhf_eval

    rows = [r for r in _metrics(one_step_off) if "eval/accuracy" in r]
    assert [r["step"] for r in rows] == [2, 3]  # every eval_steps 2 and at the last
    funcs, limit = ONE_STEP_OFF["reward_funcs"], EVAL_ONE_STEP_OFF["eval_limit"]
    ckpt = one_step_off / "checkpoints"
    logged = {k: v for k, v in rows[0].items() if k.startswith("eval/")}
    want, generators = (eval_row(mindrlhf_eval(ckpt / f"step_{n:08d}", limit, 12, funcs)) for n in (2, 1))
    assert logged == want
    assert logged != generators  # the evaluation tells the two weights apart


@pytest.mark.slow
@pytest.mark.msrun
def test_a_one_step_off_checkpoint_resumed_as_one_process_warns_that_its_rows_in_flight_are_dropped(
        grpo_assets, one_step_off, tmp_path, caplog):
    """The one-step-off run's step-2 checkpoint (its in_flight.ckpt holds update 1, which step 3's rows were being
    sampled with) resumed colocated in this process: it trains to the end (rc 0), and one warning line names the
    change and that step 3 samples afresh, so the resumed steps differ from the uninterrupted run. The other
    direction (a synchronous checkpoint resumed one step off) has its own warning."""
    import logging
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(one_step_off, out)  # the module's run stays as it is for the other tests
    step2 = out / "checkpoints" / "step_00000002"
    argv = _args(grpo_assets, out, **dict(ONE_STEP_OFF, gen_workers=0, max_staleness=0))
    with caplog.at_level(logging.WARNING, logger="mindrlhf"):
        assert _run_inprocess(argv + ["--resume", str(step2)]) == 0
    said = [r.getMessage() for r in caplog.records if "in-flight" in r.getMessage()]
    assert said == [f"--resume {step2}: gen_workers 1 -> 0, max_staleness 1 -> 0: the checkpoint's in-flight "
                    "rollout (step 3's rows, sampled by the weights of step 1) is dropped; step 3 samples afresh, so "
                    "the resumed steps differ from the uninterrupted run (resume with --gen_workers 1 "
                    "--max_staleness 1 to continue it exactly)"], said
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.msrun
def test_a_killed_generator_stops_the_trainers_and_resume_finishes_the_run(grpo_assets, one_step_off, tmp_path):
    """The dead-worker rule with generator ranks: the one-step-off job on two nodes (the trainer on node 0,
    the generator on node 1), the generator SIGKILLed while it samples step 3 (the trainer is training step 2):
    the trainer stops within collective_timeout with the one-line error (exit code 3) naming the newest checkpoint
    (step 2, which keeps the weights step 3 was being sampled with), and --resume finishes the run with the
    uninterrupted run's metrics (step 3 sampled again by the same weights, one update old)."""
    from grpo_runs import assert_survivor_stopped, node_timeout_after, two_nodes

    # Long enough for the generator's wait while the trainer compiles and trains step 1 (about 11 s on a loaded CI
    # box, twice that beside another launch: scripts/test.sh runs two test files at a time); the scheduler keeps the
    # dead node 5 s longer (node_timeout_after).
    timeout = 40
    out, logs = tmp_path / "killed", tmp_path / "log"
    argv = _args(grpo_assets, out, collective_timeout=timeout, **ONE_STEP_OFF)
    results = two_nodes(argv, logs, 8183, env_extra={"MINDRLHF_KILL_AT": "1:3:generate", **node_timeout_after(timeout)},
                        check=False, workers_per_node=1)
    late = assert_survivor_stopped(results, logs, 1, r"step 3 \(generate\)", timeout, checkpoint=2)
    before = _metrics(out)
    assert [r["step"] for r in before] == [1, 2]
    # The trainer finishes step 2 (and its checkpoint), then waits at most collective_timeout for step 3's rows.
    assert 0 <= late <= before[1]["step_time"] + timeout + 10, (late, before[1]["step_time"])

    _msrun(2, argv + ["--use_parallel", "true", "--resume"], tmp_path / "log_resume", 8185)
    resumed = _metrics(out)
    assert (resumed[2]["staleness/mean"], resumed[2]["staleness/max"]) == (1.0, 1.0)
    _assert_same_training(_metrics(one_step_off), resumed)


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.byhand
@pytest.mark.skipif(not BYHAND, reason="two more two-node launches than CI's time holds (the generator-kill test "
                    "covers the rule in CI): MINDRLHF_BYHAND=1")
def test_a_killed_trainer_stops_the_generator_and_resume_finishes_the_run(grpo_assets, one_step_off, tmp_path):
    """The dead-worker rule the other way round: the one-step-off job on two nodes (the trainer on node 0,
    the generator on node 1), the trainer SIGKILLed in step 2's update (it has pushed update 1; the generator samples
    step 3 with it and then waits to send the rows): the generator stops within collective_timeout with the
    one-line error (exit code 3) naming the newest checkpoint (step 1, which keeps the weights step 2 was sampled
    with), and --resume finishes the run with the uninterrupted run's metrics."""
    from grpo_runs import assert_survivor_stopped, node_timeout_after, two_nodes

    timeout = 40  # as the generator-kill test's: the generator's waits while the trainer compiles stay below it
    out, logs = tmp_path / "killed", tmp_path / "log"
    argv = _args(grpo_assets, out, collective_timeout=timeout, **ONE_STEP_OFF)
    results = two_nodes(argv, logs, 8187, env_extra={"MINDRLHF_KILL_AT": "0:2:grad_allreduce",
                                                     **node_timeout_after(timeout)}, check=False, workers_per_node=1)
    late = assert_survivor_stopped(results, logs, 0, "step 2", timeout, checkpoint=1)
    # The generator samples step 3 (under a second of the tiny model), then waits at most collective_timeout.
    assert 0 <= late <= timeout + 10, late
    assert [r["step"] for r in _metrics(out)] == [1]

    _msrun(2, argv + ["--use_parallel", "true", "--resume"], tmp_path / "log_resume", 8189)
    resumed = _metrics(out)
    assert [r["staleness/max"] for r in resumed] == [0.0, 1.0, 1.0]
    _assert_same_training(_metrics(one_step_off), resumed)

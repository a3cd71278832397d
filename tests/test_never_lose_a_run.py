"""End to end on the tiny Qwen2: the output-dir, checkpoint and metrics holes that fault
probes found, each reproduced as the user met it (these failed before the fix) and shown to lose
nothing now. The directory rules themselves are unit-tested in test_run_dir.py and
test_checkpoint_manager.py; here the whole command is run."""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest

from grpo_runs import grpo_args as _args
from grpo_runs import read_rows as _metrics
from grpo_runs import run_inprocess as _run
from grpo_runs import small_filesystem
from mindrlhf.checkpoint.manager import CheckpointManager
from tb_events import scalar_steps

SHORT = dict(max_completion_length=4, reward_funcs=["e2e_rewards:length_reward"])


def _snapshot(folder: Path) -> dict:
    """relative path -> md5 of every file under ``folder``."""
    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _tb_rewards(out: Path) -> list:
    return [(step, round(value, 5)) for step, value in scalar_steps(out / "tensorboard")["reward"]]


def _metric_rewards(out: Path) -> list:
    return [(r["step"], round(r["reward"], 5)) for r in _metrics(out)]


@pytest.mark.slow
def test_overwrite_typo_torn_metrics_redone_steps_and_a_resume_without_checkpoints(grpo_assets, tmp_path, capsys,
                                                                                   caplog):
    out = tmp_path / "run"
    assert _run(_args(grpo_assets, out, max_steps=2, **SHORT)) == 0
    before = _snapshot(out)

    # 1. A typo with --overwrite_output_dir: refused before the previous run is touched (it used to be
    #    deleted first, then the typo reported).
    typo = tmp_path / "modle"
    capsys.readouterr()
    assert _run(_args(grpo_assets, out, max_steps=2, overwrite_output_dir="true", sft_path_train=typo, **SHORT)) == 2
    assert f"error: model path {typo} does not exist" in capsys.readouterr().err
    assert _snapshot(out) == before

    # 7. Overwriting removes the old run's events and completion dumps too (curves used to mix two runs).
    with caplog.at_level(logging.WARNING, logger="mindrlhf.checkpoint.run_dir"):
        assert _run(_args(grpo_assets, out, max_steps=2, seed=7, overwrite_output_dir="true",
                          log_completions_steps=2, **SHORT)) == 0
    assert _tb_rewards(out) == _metric_rewards(out) and [s for s, _ in _tb_rewards(out)] == [1, 2]
    assert not (out / "completions_step_1.jsonl").exists() and (out / "completions_step_2.jsonl").is_file()
    said = [r.getMessage() for r in caplog.records if "removed the previous run" in r.getMessage()]
    assert len(said) == 1 and "completions_step_1.jsonl" in said[0] and "tensorboard" in said[0]

    # 5. A torn last metrics line (a crash mid-write) no longer blocks --resume; 7. the step redone by
    #    the resume is in TensorBoard once (it used to be appended a second time).
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward": 0.1')
    step1 = out / "checkpoints" / "step_00000001"
    assert json.loads((step1 / "state.json").read_text())["recompute"] == {"policy": "full"}
    caplog.clear()
    # ... resumed with another recompute mode (what auto may decide on a machine with more memory): said once.
    assert _run(_args(grpo_assets, out, max_steps=2, seed=7, log_completions_steps=2, resume=step1,
                      recompute="none", **SHORT)) == 0
    assert any("dropping a torn last line" in r.getMessage() for r in caplog.records)
    said = [r.getMessage() for r in caplog.records if "recompute differs" in r.getMessage()]
    assert len(said) == 1 and "(policy full -> none)" in said[0]
    assert [r["step"] for r in _metrics(out)] == [1, 2]
    assert _tb_rewards(out) == _metric_rewards(out) and [s for s, _ in _tb_rewards(out)] == [1, 2]

    # 3. --resume that finds no checkpoint where a history is: refused, the history kept (it used to be
    #    replaced by a fresh run after one warning).
    shutil.rmtree(out / "checkpoints")
    kept = _snapshot(out)
    capsys.readouterr()
    assert _run(_args(grpo_assets, out, max_steps=2, seed=7, log_completions_steps=2, resume="latest", **SHORT)) == 2
    assert (f"error: --resume: no checkpoint in {out / 'checkpoints'}, but {out / 'metrics.jsonl'} holds 2 steps"
            in capsys.readouterr().err)
    assert _snapshot(out) == kept


@pytest.mark.slow
def test_a_resume_into_another_runs_checkpoint_dir_is_refused(grpo_assets, tmp_path, capsys):
    # 2. Run B resumed run R's checkpoint with --save_ckpt_dir shared_ck, where run A's checkpoints are:
    #    it exited 0 after replacing A's step 2 and deleting A's step 1 (keep_last 1).
    shared = tmp_path / "shared_ck"
    assert _run(_args(grpo_assets, tmp_path / "oA", max_steps=2, save_ckpt_dir=shared, **SHORT)) == 0
    a_before = _snapshot(shared)
    assert _run(_args(grpo_assets, tmp_path / "oR", max_steps=1, **SHORT)) == 0
    r_step = tmp_path / "oR" / "checkpoints" / "step_00000001"
    capsys.readouterr()
    assert _run(_args(grpo_assets, tmp_path / "oB", max_steps=2, save_ckpt_dir=shared, resume=r_step,
                      keep_last=1, **SHORT)) == 2
    run_a = CheckpointManager.run_of(shared / "step_00000001")
    err = capsys.readouterr().err
    assert (f"error: --save_ckpt_dir {shared} holds another run's checkpoints (run {run_a}: steps 1, 2); resuming "
            f"{r_step} (run {CheckpointManager.run_of(r_step)}) there would mix the two runs") in err
    assert _snapshot(shared) == a_before


@pytest.mark.slow
def test_a_full_disk_is_one_error_and_resume_works_once_space_is_freed(grpo_assets, tmp_path, capsys):
    # 6. Disk full during a checkpoint save: a 36-line traceback, the temp folder and a 0-byte
    #    .config.yaml.tmp left behind, and --resume failed in save_yaml with another traceback.
    probe = tmp_path / "probe"
    assert _run(_args(grpo_assets, probe, max_steps=1, tensorboard="false", **SHORT)) == 0
    one_step = sum(s for s in (p.stat().st_size for p in probe.rglob("*") if p.is_file()))
    out = tmp_path / "disk" / "run"
    argv = _args(grpo_assets, out, max_steps=2, tensorboard="false", **SHORT)
    with small_filesystem(tmp_path / "disk", 1.5 * one_step) as resize:  # room for one checkpoint, not two
        capsys.readouterr()
        assert _run(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"error: writing checkpoint step 2 to {out / 'checkpoints' / 'step_00000002'} failed: "
                               f"No space left on device (") and last.endswith(
            "step 1's checkpoint is intact: free space or choose another --save_ckpt_dir, then rerun with --resume to "
            "continue from it"), last
        leftovers = [p.name for p in (tmp_path / "disk").rglob(".*")]
        assert leftovers == [], leftovers
        ckpts = CheckpointManager(str(out / "checkpoints"))
        assert ckpts.list_steps() == [1] and ckpts.verify(ckpts.step_dir(1)) is None
        # Still full: --resume fails the same way, in one line.
        assert _run(argv + ["--resume"]) == 2
        assert "Traceback" not in capsys.readouterr().err
        resize(4 * one_step)
        assert _run(argv + ["--resume"]) == 0
        assert [r["step"] for r in _metrics(out)] == [1, 2]
        assert ckpts.list_steps() == [1, 2] and ckpts.verify(ckpts.step_dir(2)) is None
    # Full on the run's first checkpoint, the advice was --resume, which then fails (no checkpoint, but
    # metrics). It now says what works, and that works once space is freed.
    first = tmp_path / "disk1" / "run"
    argv = _args(grpo_assets, first, max_steps=1, tensorboard="false", **SHORT)
    with small_filesystem(tmp_path / "disk1", 0.5 * one_step) as resize:
        assert _run(argv) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.endswith("no checkpoint of this run was saved yet: free space or choose another --output_dir, "
                             "then rerun (with --overwrite_output_dir true to replace the steps logged so far)"), last
        resize(4 * one_step)
        assert _run(argv + ["--overwrite_output_dir", "true"]) == 0
        assert [r["step"] for r in _metrics(first)] == [1]


@pytest.mark.slow
def test_an_infinite_reward_stops_the_run_or_is_skipped_and_a_step_with_no_signal_is_named(grpo_assets, tmp_path,
                                                                                          capsys, caplog):
    # 8. A reward of inf made its group's std NaN and every advantage 0: loss 0, grad_norm 0, exit 0.
    inf = dict(max_steps=1, max_completion_length=4, reward_funcs=["e2e_rewards:one_infinite_reward"])
    capsys.readouterr()
    assert _run(_args(grpo_assets, tmp_path / "raise", **inf)) == 2
    assert ("error: reward function 'e2e_rewards:one_infinite_reward' returned inf for completion 0 (1 of 8 "
            "non-finite)") in capsys.readouterr().err
    skip = tmp_path / "skip"
    assert _run(_args(grpo_assets, skip, reward_errors="skip", **inf)) == 0
    (row,) = _metrics(skip)
    assert row["rewards/one_infinite_reward/failures"] == 1.0 and row["grad_norm"] > 0
    # All-None rewards: a warning line per step says nothing was trained.
    with caplog.at_level(logging.WARNING, logger="mindrlhf"):
        assert _run(_args(grpo_assets, tmp_path / "none", max_steps=2, max_completion_length=4,
                          reward_funcs=["e2e_rewards:no_score"])) == 0
    said = [r.getMessage() for r in caplog.records if "trained nothing" in r.getMessage()]
    assert [m.split(":")[0] for m in said] == ["step 1", "step 2"]
    assert "no completion got a reward" in said[0]


def test_a_checkpoint_refused_for_lack_of_free_memory_is_not_called_broken(tmp_path):
    """MindSpore reads a .ckpt as one protobuf message and refuses it while less memory is free than its size (a
    PPO walkthrough hit this beside a test run): the one-line error says the file is intact and to free memory,
    not to re-convert it; a genuinely unreadable file keeps the re-convert advice."""
    from mindrlhf.checkpoint.hf_io import load_error

    path = tmp_path / "policy.ckpt"
    refused = RuntimeError("For 'load_checkpoint', the checkpoint protobuf content size 538080531 bytes exceeds "
                           "current available memory 244862976 bytes: policy.ckpt.\nThe ckpt format stores ...")
    err = str(load_error(path, refused, "re-convert it"))
    assert "free memory" in err and "re-convert" not in err and "538080531 bytes" in err and "\n" not in err
    err = str(load_error(path, ValueError("Failed to read the checkpoint file"), "re-convert it"))
    assert err.endswith("; re-convert it") and str(path) in err

"""check_run_dirs / clear_previous_run: what a fresh start, an overwrite and a resume may do in a
run's output and checkpoint directories (fast: checkpoints of one small tensor, no training)."""
from __future__ import annotations

import json
import logging
import os
import socket

import mindspore as ms
import numpy as np
import pytest

from mindrlhf.checkpoint.manager import CheckpointManager
from mindrlhf.checkpoint.run_dir import check_run_dirs, clear_previous_run
from mindrlhf.checkpoint.run_record import read_run_id, write_run_id
from mindrlhf.errors import MindRLHFError


def decide(*args, **kwargs):
    """``check_run_dirs``' decision, its folders' locks released at once (as the run's end releases them)."""
    start = check_run_dirs(*args, **kwargs)
    start.release()
    return start


def _save(ckpt_dir, run_id, *steps):
    manager = CheckpointManager(str(ckpt_dir), keep_last=0, run_id=run_id)
    params = {"policy": {"w": ms.Parameter(ms.Tensor(np.zeros(3, np.float32)), name="w")}}
    return [manager.save(s, params, {"step": s}, "a: 1\n") for s in steps]


def _metrics(out, steps):
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in steps))


def test_a_fresh_start_where_a_run_is_needs_overwrite(tmp_path):
    out = tmp_path / "out"
    _save(out / "checkpoints", "A", 1, 2)
    with pytest.raises(MindRLHFError, match=r"already holds a run \(checkpoints of steps 1, 2 in "):
        decide(out, out / "checkpoints", resume="", overwrite=False)
    start = decide(out, out / "checkpoints", resume="", overwrite=True)
    assert start.checkpoint is None and CheckpointManager(str(out / "checkpoints")).list_steps() == [1, 2]


def test_resume_into_a_checkpoint_dir_holding_another_run_is_refused(tmp_path):
    # Run B resumes run R's checkpoint into run A's save_ckpt_dir: it used to overwrite
    # A's step 3 and delete A's step 2 (keep_last 1), exit 0.
    shared, other = tmp_path / "shared_ck", tmp_path / "R" / "checkpoints"
    _save(shared, "runA", 1, 2, 3)
    (r_step,) = _save(other, "runR", 1)
    with pytest.raises(MindRLHFError, match=rf"--save_ckpt_dir {shared} holds another run's checkpoints \(run runA: "
                                            rf"steps 1, 2, 3\); resuming {r_step} \(run runR\) there would mix"):
        decide(tmp_path / "oB", shared, resume=str(r_step), overwrite=False)
    # Naming a checkpoint of that directory is the user's explicit choice: allowed.
    start = decide(tmp_path / "oA", shared, resume=str(shared / "step_00000002"), overwrite=False)
    assert (start.checkpoint.name, start.run_id) == ("step_00000002", "runA")
    # "latest" in a directory of two runs is ambiguous.
    _save(shared, "runC", 7)
    with pytest.raises(MindRLHFError, match=r"--resume latest: .* holds checkpoints of 2 runs \(run runA: steps 1, 2, "
                                            r"3; run runC: steps 7\); pass the step folder"):
        decide(tmp_path / "oA", shared, resume="latest", overwrite=False)


def test_resume_with_no_checkpoint_keeps_the_history(tmp_path):
    # The history was replaced by a fresh run after one warning.
    out = tmp_path / "out"
    _metrics(out, [1, 2, 3])
    with pytest.raises(MindRLHFError, match=rf"--resume: no checkpoint in {out / 'checkpoints'}, but "
                                            rf"{out / 'metrics.jsonl'} holds 3 steps of a run"):
        decide(out, out / "checkpoints", resume="latest", overwrite=False)
    # No history at all: a job script that always passes --resume starts fresh.
    start = decide(tmp_path / "new", tmp_path / "new" / "checkpoints", resume="latest", overwrite=False)
    assert start.checkpoint is None


def test_resume_into_an_output_dir_of_another_run_is_refused(tmp_path):
    out = tmp_path / "out"
    (step,) = _save(tmp_path / "elsewhere", "runX", 4)
    _metrics(out, [1, 2])
    write_run_id(out, "runY")
    with pytest.raises(MindRLHFError, match=r"holds the metrics of run runY, not of run runX"):
        decide(out, tmp_path / "ck", resume=str(step), overwrite=False)
    write_run_id(out, "runX")
    assert decide(out, tmp_path / "ck", resume=str(step), overwrite=False).run_id == "runX"
    assert read_run_id(out) == "runX"


def test_an_output_dir_that_cannot_be_written_fails_before_anything_loads(tmp_path):
    # --output_dir /proc/x used to fail with a traceback after the model loaded.
    with pytest.raises(MindRLHFError, match=r"--output_dir /proc/x cannot be written \(No such file or directory\); "
                                            r"choose a directory you can write to"):
        decide("/proc/x", "/proc/x/checkpoints", resume="", overwrite=False)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(MindRLHFError, match="is a file, not a directory"):
        decide(tmp_path / "afile", tmp_path / "ck", resume="", overwrite=False)


def test_overwrite_removes_the_whole_previous_run_and_says_so(tmp_path, caplog):
    out = tmp_path / "out"
    _save(out / "checkpoints", "old", 1, 2)
    _metrics(out, [1, 2])
    for name in ("config.yaml", "completions_step_1.jsonl", "reward.png", "accuracy.png", "run.json"):
        (out / name).write_text("old")
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1.x").write_bytes(b"old")
    (out / "data").mkdir()
    (out / "data" / "gsm8k_train_sample.mindrecord").write_bytes(b"a cache of an input")
    with caplog.at_level(logging.WARNING, logger="mindrlhf.checkpoint.run_dir"):
        clear_previous_run(out, out / "checkpoints")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "data"]
    assert list((out / "checkpoints").iterdir()) == []
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith(f"--overwrite_output_dir: removed the previous run from {out}: ")
    for name in ("checkpoints/step_00000001", "metrics.jsonl", "tensorboard", "completions_step_1.jsonl"):
        assert name in said


def test_a_checkpoint_folder_without_a_manifest_is_unusable_not_another_run(tmp_path, caplog):
    """A step folder without manifest.json (a copy or write that did not finish) was counted as a
    second run, and the suggested `--resume <that folder>` was then refused. It is skipped with a warning and
    --resume latest takes the newest intact checkpoint; a fresh start still sees it and is refused."""
    ck = tmp_path / "out" / "checkpoints"
    _, step2 = _save(ck, "A", 1, 2)
    (step2 / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING):
        start = decide(tmp_path / "out", ck, resume="latest", overwrite=False)
    assert (start.checkpoint.name, start.run_id) == ("step_00000001", "A")
    assert any(f"checkpoint {step2} is unusable (no manifest.json" in r.getMessage() for r in caplog.records)
    # With two real runs beside it, the suggestion names an intact checkpoint, never the unusable folder.
    _save(ck, "B", 3)
    (ck / "step_00000004").mkdir()
    with pytest.raises(MindRLHFError, match=rf"holds checkpoints of 2 runs \(run A: steps 1; run B: steps 3\); pass "
                                            rf"the step folder to resume, e.g. --resume {ck / 'step_00000003'}$"):
        decide(tmp_path / "out", ck, resume="latest", overwrite=False)


def test_resume_of_a_missing_step_names_one_that_exists(tmp_path):
    """`--resume <missing step>` suggested step_00000010, a folder that does not exist."""
    ck = tmp_path / "out" / "checkpoints"
    _save(ck, "A", 1, 2)
    with pytest.raises(MindRLHFError, match=rf"^--resume {ck / 'step_00000009'}: no such checkpoint folder \(the "
                                            rf"newest intact checkpoint in {ck} is {ck / 'step_00000002'}\); pass "
                                            rf"--resume latest or an existing step folder$"):
        decide(tmp_path / "out", ck, resume=str(ck / "step_00000009"), overwrite=False)
    with pytest.raises(MindRLHFError, match=rf"no such checkpoint folder \({tmp_path / 'o2' / 'ck'} holds no intact "
                                            rf"checkpoint\)"):
        decide(tmp_path / "o2", tmp_path / "o2" / "ck", resume=str(tmp_path / "nope"), overwrite=False)


def test_a_model_is_the_same_by_content_wherever_it_is(tmp_path):
    """The identity a checkpoint records of an input model: unchanged files are not hashed again; a moved copy is
    the same model; one changed byte is another."""
    import shutil

    from mindrlhf.checkpoint.manifest import model_identity, same_model

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"0123456789")
    files = lambda d: [d / "config.json", d / "model.safetensors"]  # noqa: E731
    recorded = model_identity(str(model), files(model))
    assert same_model(recorded, str(model), files(model)) == (True, recorded)
    shutil.copytree(model, tmp_path / "moved")
    same, found = same_model(recorded, str(tmp_path / "moved"), files(tmp_path / "moved"))
    assert same and found["sha256"] == recorded["sha256"] and found["path"] == str(tmp_path / "moved")
    (model / "model.safetensors").write_bytes(b"0123456780")
    same, found = same_model(recorded, str(model), files(model))
    assert not same and found["sha256"] != recorded["sha256"]
    assert same_model({"path": ""}, "", []) == (True, {"path": ""})
    assert not same_model({"path": ""}, str(model), files(model))[0]


def test_a_run_folder_given_as_a_model_is_its_newest_intact_checkpoint(tmp_path, caplog):
    """The walkthrough hard-coded checkpoints/step_00000100 in every command after SFT, so shortening SFT
    broke them all. A run's output folder given as a model stands for that run's newest intact checkpoint (said once
    in the log); any other path is itself."""
    from mindrlhf.checkpoint.run_record import model_of_run

    run = tmp_path / "sft"
    step1, step2, step3 = _save(run / "checkpoints", "A", 1, 2, 3)
    (step3 / "manifest.json").unlink()  # a newest folder that is not intact is passed over
    write_run_id(run, "A", "sft")
    with caplog.at_level(logging.INFO):
        assert model_of_run(run) == step2 == model_of_run(str(run))
    said = [r.getMessage() for r in caplog.records if "is a training run" in r.getMessage()]
    assert said == [f"{run} is a training run: using its newest intact checkpoint {step2} (step 2)"]
    assert model_of_run(step1) == step1 and model_of_run(tmp_path / "hf_model") == tmp_path / "hf_model"
    empty = tmp_path / "empty"
    write_run_id(empty, "B", "sft")
    with pytest.raises(MindRLHFError, match=rf"^{empty} is a training run's folder with no intact checkpoint "
                                            rf"\(in {empty / 'checkpoints'}\); let the run save one, or pass a "
                                            r"model folder$"):
        model_of_run(empty)


def test_a_folder_in_use_is_refused_and_free_again_after_release(tmp_path):
    """The run lock: a second start on a folder whose lock is held is refused naming the holder; the check's
    refusal releases what it took; ``release`` removes the lock file; a lock file left by a dead holder (no lock on
    it) does not block."""
    from mindrlhf.checkpoint.run_dir import LOCK_FILE

    out = tmp_path / "out"
    first = check_run_dirs(out, out / "checkpoints", resume="", overwrite=False)
    holder = json.loads((out / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    in_use = rf"^--output_dir {out} is in use by another run \(pid {os.getpid()} on host .* since .*\); "
    with pytest.raises(MindRLHFError, match=in_use + r"wait for it to end, or choose another --output_dir$"):
        check_run_dirs(out, out / "checkpoints", resume="", overwrite=False)
    first.release()
    assert not (out / LOCK_FILE).exists()
    # A checkpoint directory outside output_dir is locked too, and named by its flag.
    elsewhere = tmp_path / "ck"
    held = check_run_dirs(tmp_path / "a", elsewhere, resume="", overwrite=False)
    with pytest.raises(MindRLHFError, match=rf"^--save_ckpt_dir {elsewhere} is in use by another run"):
        check_run_dirs(tmp_path / "b", elsewhere, resume="", overwrite=False)
    assert not (tmp_path / "b").exists()  # the refused start removed the folder it made
    held.release()
    (out / LOCK_FILE).write_text(json.dumps({"pid": 999999999, "host": "gone"}) + "\n")  # its holder died
    check_run_dirs(out, out / "checkpoints", resume="", overwrite=False).release()


@pytest.mark.parametrize("env,locks", [({}, True), ({"MS_ROLE": "MS_WORKER", "RANK_ID": "0"}, True),
                                       ({"MS_ROLE": "MS_WORKER", "RANK_ID": "1"}, False),
                                       ({"MS_ROLE": "MS_SCHED"}, False)])
def test_only_the_jobs_first_worker_takes_the_run_lock(monkeypatch, env, locks):
    """Under msrun the scheduler process runs the same script with no RANK_ID: it took the lock as if it were rank
    0, and the real rank 0 (or the scheduler) was refused, so every msrun launch failed its cluster setup."""
    from mindrlhf.checkpoint.run_dir import takes_run_locks

    for name in ("MS_ROLE", "RANK_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert takes_run_locks() is locks

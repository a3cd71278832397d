"""CheckpointManager: leftovers of saves that died mid-write are cleaned up; another run's checkpoints
are never replaced or deleted; a full disk is one error line."""
import logging
import os
import subprocess
import sys
import time

import mindspore as ms
import numpy as np
import pytest

from mindrlhf.checkpoint.manager import CheckpointManager
from mindrlhf.errors import MindRLHFError


def _params():
    return {"policy": {"w": ms.Parameter(ms.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)), name="w")}}


def test_a_dead_saves_temp_folder_is_removed_on_the_next_save(tmp_path):
    manager = CheckpointManager(str(tmp_path / "ckpt"), keep_last=2)
    manager.save(1, _params(), {"step": 1}, "a: 1\n")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / "ckpt" / f".step_00000002.tmp-{int(dead.stdout)}"  # its process has exited
    stale.mkdir()
    (stale / "policy.ckpt").write_bytes(b"x" * 4096)
    alive = tmp_path / "ckpt" / f".step_00000002.tmp-{os.getppid()}"  # a running process may still write it
    alive.mkdir()
    manager.save(2, _params(), {"step": 2}, "a: 1\n")
    assert not stale.exists() and alive.is_dir()
    assert manager.list_steps() == [1, 2] and manager.verify(manager.step_dir(2)) is None


def test_retention_deletes_only_this_runs_checkpoints(tmp_path):
    other = CheckpointManager(str(tmp_path / "shared"), keep_last=1, run_id="other")
    other.save(1, _params(), {"step": 1}, "a: 1\n")
    ours = CheckpointManager(str(tmp_path / "shared"), keep_last=1, run_id="ours")
    for step in (5, 6, 7):
        ours.save(step, _params(), {"step": step}, "a: 1\n")
    # keep_last=1 of our own; the other run's step 1 is not ours to delete
    assert ours.list_steps() == [1, 7]
    assert [CheckpointManager.run_of(ours.step_dir(s)) for s in (1, 7)] == ["other", "ours"]


def _md5s(folder):
    import hashlib

    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_a_save_never_replaces_another_runs_checkpoint(tmp_path):
    other = CheckpointManager(str(tmp_path / "shared"), keep_last=3, run_id="runA")
    for step in (1, 2, 3):
        other.save(step, _params(), {"step": step}, "a: 1\n")
    before = {s: _md5s(other.step_dir(s)) for s in (1, 2, 3)}
    ours = CheckpointManager(str(tmp_path / "shared"), keep_last=1, run_id="runB")
    with pytest.raises(MindRLHFError, match=r"step_00000002 holds a checkpoint of another run \(runA\); this run "
                                            r"\(runB\) will not replace it"):
        ours.save(2, _params(), {"step": 2}, "a: 1\n")
    assert {s: _md5s(other.step_dir(s)) for s in (1, 2, 3)} == before
    assert not list((tmp_path / "shared").glob(".step_*"))  # nothing half-written left
    # "latest" of a run is that run's newest, whatever else the directory holds.
    ours.save(5, _params(), {"step": 5}, "a: 1\n")
    assert ours.latest_complete("runA")[0] == 3 and ours.latest_complete("runB")[0] == 5
    # A step redone by the same run (after a resume) replaces its own copy.
    ours.save(5, _params(), {"step": 55}, "a: 1\n")
    assert CheckpointManager.read_state(ours.step_dir(5)) == {"step": 55}


def test_retention_never_counts_a_folder_without_a_manifest_as_this_runs(tmp_path):
    manager = CheckpointManager(str(tmp_path / "ck"), keep_last=1, run_id="ours")
    foreign = manager.step_dir(1)
    foreign.mkdir(parents=True)
    (foreign / "policy.ckpt").write_bytes(b"someone's weights")  # no manifest: whose it is is unknown
    for step in (2, 3):
        manager.save(step, _params(), {"step": step}, "a: 1\n")
    assert manager.list_steps() == [1, 3]


def test_a_temp_folder_of_a_reused_pid_is_removed_and_a_live_writers_is_kept_with_a_warning(tmp_path, caplog):
    manager = CheckpointManager(str(tmp_path / "ck"), keep_last=2)
    manager.save(1, _params(), {"step": 1}, "a: 1\n")
    # The parent process runs and started before this folder was written: it may be the writer.
    live = tmp_path / "ck" / f".step_00000002.tmp-{os.getppid()}"
    live.mkdir()
    # A process started after the folder was last written cannot be the save that wrote it: its PID
    # was reused, and the folder would otherwise be kept forever.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        reused = tmp_path / "ck" / f".step_00000002.tmp-{child.pid}"
        reused.mkdir()
        (reused / "policy.ckpt").write_bytes(b"x" * 4096)
        old = time.time() - 3600
        os.utime(reused, (old, old))
        with caplog.at_level(logging.WARNING, logger="mindrlhf.checkpoint.manager"):
            manager.save(2, _params(), {"step": 2}, "a: 1\n")
    finally:
        child.kill()
        child.wait()
    assert not reused.exists() and live.is_dir()
    said = [r.getMessage() for r in caplog.records]
    assert any(f"keeping {live}" in m and f"process {os.getppid()}" in m for m in said), said
    assert any(f"removing {reused}" in m for m in said), said


def test_a_full_disk_during_a_save_is_one_error_and_leaves_the_previous_checkpoint(tmp_path):
    from grpo_runs import small_filesystem

    big = {"policy": {"w": ms.Parameter(ms.Tensor(np.ones((256, 1024), np.float32)), name="w")}}  # 1 MiB
    with small_filesystem(tmp_path / "disk", 1.5 * 2 ** 20) as resize:
        manager = CheckpointManager(str(tmp_path / "disk" / "ck"), keep_last=3, run_id="r")
        manager.save(1, big, {"step": 1}, "a: 1\n")
        with pytest.raises(MindRLHFError) as err:
            manager.save(2, big, {"step": 2}, "a: 1\n")
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith(f"writing checkpoint step 2 to {manager.step_dir(2)} failed: No space left on "
                                  f"device (") and " MB free there)" in message
        assert message.endswith("step 1's checkpoint is intact: free space or choose another --save_ckpt_dir, then "
                                "rerun with --resume to continue from it")
        assert os.listdir(tmp_path / "disk" / "ck") == ["step_00000001"]  # the temp folder is gone
        assert manager.verify(manager.step_dir(1)) is None
        resize(4 * 2 ** 20)  # space freed: the same save goes through
        manager.save(2, big, {"step": 2}, "a: 1\n")
        assert manager.latest_complete("r")[0] == 2


def test_a_full_disk_on_the_first_save_advises_what_works(tmp_path):
    """With no checkpoint of the run saved yet, the advice used to be --resume, which then fails
    (no checkpoint, but metrics): it now says to rerun, replacing the steps logged so far."""
    from grpo_runs import small_filesystem

    big = {"policy": {"w": ms.Parameter(ms.Tensor(np.ones((512, 1024), np.float32)), name="w")}}  # 2 MiB
    with small_filesystem(tmp_path / "disk", 1.5 * 2 ** 20):
        manager = CheckpointManager(str(tmp_path / "disk" / "ck"), keep_last=3, run_id="r")
        with pytest.raises(MindRLHFError) as err:
            manager.save(1, big, {"step": 1}, "a: 1\n")
    message = str(err.value)
    assert "--resume" not in message and message.endswith(
        "no checkpoint of this run was saved yet: free space or choose another --output_dir, then rerun (with "
        "--overwrite_output_dir true to replace the steps logged so far)")

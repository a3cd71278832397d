"""CheckpointManager: leftovers of saves that died mid-write are cleaned up."""
import os
import subprocess
import sys

import mindspore as ms
import numpy as np

from mindrlhf.checkpoint.manager import CheckpointManager


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

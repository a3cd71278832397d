"""Training checkpoints: atomic, checksummed, retained, and resumable exactly.

Layout: ``<dir>/step_<NNNNNNNN>/`` with ``policy.ckpt``, ``optimizer.ckpt``, ``ref.ckpt`` (only when
the reference was re-synced), ``state.json`` (step, data position, counters), ``config.yaml``, the
policy's ``config.json`` and tokenizer files (so the folder loads as a model: ``mindrlhf-eval --model
<dir>/step_N``, ``convert_weight.py --reverse --input_path <dir>/step_N/policy.ckpt``) and, written
last, ``manifest.json`` (size and SHA-256 of every file). A step is written into a
temporary folder and renamed into place, so a crash never leaves a half-written ``step_*``; a
folder whose manifest is missing or whose checksums differ is reported and skipped.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple, Union

import mindspore as ms

from mindrlhf.checkpoint.manifest import MANIFEST, read_manifest, sha256_file, verify_folder
from mindrlhf.errors import MindRLHFError
from mindrlhf.utils.fs import free_space

log = logging.getLogger(__name__)
PREFIX = "step_"


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine."""
    try:
        os.kill(pid, 0)  # signal 0: an existence check, nothing is sent
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _process_start(pid: int) -> Optional[float]:
    """When process ``pid`` started (seconds since the epoch), from /proc; None where that is unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start time in ticks
    except (OSError, IndexError, ValueError, StopIteration):
        return None


def save_parameters(params: Mapping[str, ms.Parameter], path: Path) -> None:
    """Write named parameters/tensors to a MindSpore .ckpt (protobuf, no pickle)."""
    ms.save_checkpoint([{"name": n, "data": p} for n, p in params.items()], str(path))


def load_parameters_into(params: Mapping[str, ms.Parameter], path: Path) -> None:
    """Load a .ckpt written by ``save_parameters`` into existing parameters (same names/shapes)."""
    loaded = ms.load_checkpoint(str(path))
    missing = [n for n in params if n not in loaded]
    if missing:
        raise MindRLHFError(f"{path}: {len(missing)} tensors missing (e.g. {missing[0]!r}); "
                            f"the checkpoint is for another model or optimizer")
    for name, param in params.items():
        value = loaded[name]
        if tuple(value.shape) != tuple(param.shape):
            raise MindRLHFError(f"{path}: tensor {name!r} has shape {tuple(value.shape)}, expected "
                                f"{tuple(param.shape)}; the checkpoint is for another model")
        param.copy_(value.astype(param.dtype))  # in place: compiled graphs keep seeing it


class CheckpointManager:
    """Saves and finds training checkpoints under one directory."""

    def __init__(self, directory: str, keep_last: int = 3, run_id: str = "", stage: str = ""):
        """``run_id`` and ``stage`` (the command that trains: sft, rm, dpo, ppo, grpo): written into every
        manifest; retention deletes only this run's folders, never another run's sharing the directory."""
        self.dir = Path(directory)
        self.keep_last = keep_last
        self.run_id = run_id
        self.stage = stage

    def step_dir(self, step: int) -> Path:
        return self.dir / f"{PREFIX}{step:08d}"

    def save(self, step: int, tensors: Mapping[str, Mapping[str, ms.Parameter]], state: dict,
             config_yaml: str, files: Optional[Mapping[str, Union[bytes, Path]]] = None) -> Path:
        """Write checkpoint ``step``: ``tensors`` maps file stem (policy, optimizer, ref) → params;
        ``files`` maps further file names to their content or to a file to copy (all in the manifest).

        Replaces an existing ``step_N`` only when it is this run's (a step redone after a resume); a
        failed write (a full disk) removes its temporary folder, leaves the previous checkpoints as
        they were and raises one line naming the path and the free space."""
        final = self.step_dir(step)
        owner = self.run_of(final) if final.exists() else self.run_id
        if owner != self.run_id:
            raise MindRLHFError(f"{final} holds a checkpoint of another run ({owner or 'no run id'}); this run "
                                f"({self.run_id}) will not replace it: choose another --save_ckpt_dir")
        tmp = self.dir / f".{final.name}.tmp-{os.getpid()}"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._remove_stale_temps()
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            self._write(tmp, step, tensors, state, config_yaml, files or {})
        except OSError as err:  # MindSpore's save_checkpoint too raises the filesystem's OSError
            shutil.rmtree(tmp, ignore_errors=True)
            previous = [s for s in self.list_steps() if s != step and self.run_of(self.step_dir(s)) == self.run_id]
            # The advice must work: --resume needs a checkpoint of this run, and with none a rerun must replace
            # the metrics this run wrote so far.
            advice = (f"step {previous[-1]}'s checkpoint is intact: free space or choose another --save_ckpt_dir, "
                      f"then rerun with --resume to continue from it" if previous else
                      "no checkpoint of this run was saved yet: free space or choose another --output_dir, then "
                      "rerun (with --overwrite_output_dir true to replace the steps logged so far)")
            raise MindRLHFError(f"writing checkpoint step {step} to {final} failed: {err.strerror or err} "
                                f"({free_space(final)} there); {advice}") from None
        if final.exists():  # a re-run of the same step (after a resume) replaces this run's old copy
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._retain()
        return final

    def _write(self, tmp: Path, step: int, tensors: Mapping[str, Mapping[str, ms.Parameter]], state: dict,
               config_yaml: str, files: Mapping[str, Union[bytes, Path]]) -> None:
        for stem, params in tensors.items():
            save_parameters(params, tmp / f"{stem}.ckpt")
        (tmp / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True), encoding="utf-8")
        (tmp / "config.yaml").write_text(config_yaml, encoding="utf-8")
        for name, content in files.items():
            if isinstance(content, bytes):
                (tmp / name).write_bytes(content)
            else:
                shutil.copyfile(content, tmp / name)
        written = sorted(p.name for p in tmp.iterdir())
        listed = {n: {"bytes": (tmp / n).stat().st_size, "sha256": sha256_file(tmp / n)} for n in written}
        manifest = {"step": step, "run_id": self.run_id, "stage": self.stage, "files": listed}
        with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
            f.write(json.dumps(manifest, indent=2))
            f.flush()
            os.fsync(f.fileno())  # the manifest marks the folder complete: on disk before the rename

    def _remove_stale_temps(self) -> None:
        """Delete the temporary folders of saves that died mid-write (a whole checkpoint's size each):
        those of processes no longer running (or whose PID a later process took), and earlier ones of
        this process. One of a live process is kept, with a warning naming it."""
        for tmp in self.dir.glob(f".{PREFIX}*.tmp-*"):
            pid = tmp.name.rsplit("-", 1)[-1]
            if not (tmp.is_dir() and pid.isdigit()):
                continue
            size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()) / 2 ** 20
            if int(pid) != os.getpid() and _running(int(pid)):
                started = _process_start(int(pid))
                if started is None or started <= tmp.stat().st_mtime:
                    log.warning("keeping %s (%.1f MB): process %s, which may be writing it, is still running; "
                                "delete it by hand if that process is not a mindrlhf save", tmp, size, pid)
                    continue
            log.warning("removing %s (%.1f MB): a checkpoint save that did not finish", tmp, size)
            shutil.rmtree(tmp, ignore_errors=True)

    def _retain(self) -> None:
        """Delete this run's checkpoints older than the newest ``keep_last``; never a folder that does not
        name this run in its manifest (another run's, one from before run ids, or one without a manifest)."""
        if self.keep_last <= 0 or not self.run_id:
            return
        ours = [s for s in self.list_steps() if self.run_of(self.step_dir(s)) == self.run_id]
        for old in ours[:-self.keep_last]:
            shutil.rmtree(self.step_dir(old), ignore_errors=True)

    @staticmethod
    def run_of(path: Path) -> str:
        """The run id in a checkpoint's manifest ('' when it has none or no readable manifest)."""
        return str((read_manifest(path) or {}).get("run_id", ""))

    @staticmethod
    def stage_of(path: Path) -> str:
        """The stage that wrote a checkpoint, from its manifest ('' for checkpoints from before stages were
        recorded; state.json names it too, written with the same save)."""
        return str((read_manifest(path) or {}).get("stage") or "")

    def list_steps(self) -> List[int]:
        """Steps that have a checkpoint folder (complete or not), ascending."""
        if not self.dir.is_dir():
            return []
        steps = []
        for p in self.dir.iterdir():
            if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit():
                steps.append(int(p.name[len(PREFIX):]))
        return sorted(steps)

    @staticmethod
    def verify(path: Path) -> Optional[str]:
        """None if the checkpoint at ``path`` is complete and intact, else the reason it is not."""
        return verify_folder(path)

    def latest_complete(self, run_id: Optional[str] = None) -> Optional[Tuple[int, Path]]:
        """The newest intact checkpoint (of run ``run_id`` when given); corrupt or partial newer ones are
        reported and skipped."""
        for step in reversed(self.list_steps()):
            path = self.step_dir(step)
            if run_id is not None and self.run_of(path) != run_id:
                continue
            problem = self.verify(path)
            if problem is None:
                return step, path
            log.warning("checkpoint %s is unusable (%s); falling back to the previous one", path, problem)
        return None

    @staticmethod
    def read_state(path: Path) -> Dict:
        return json.loads((path / "state.json").read_text(encoding="utf-8"))

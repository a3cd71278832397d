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

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple, Union

import mindspore as ms

from mindrlhf.errors import MindRLHFError

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
PREFIX = "step_"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine."""
    try:
        os.kill(pid, 0)  # signal 0: an existence check, nothing is sent
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


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

    def __init__(self, directory: str, keep_last: int = 3, run_id: str = ""):
        """``run_id``: written into every manifest; retention deletes only this run's folders (and
        folders without one, from before run ids), never another run's sharing the directory."""
        self.dir = Path(directory)
        self.keep_last = keep_last
        self.run_id = run_id

    def step_dir(self, step: int) -> Path:
        return self.dir / f"{PREFIX}{step:08d}"

    def save(self, step: int, tensors: Mapping[str, Mapping[str, ms.Parameter]], state: dict,
             config_yaml: str, files: Optional[Mapping[str, Union[bytes, Path]]] = None) -> Path:
        """Write checkpoint ``step``: ``tensors`` maps file stem (policy, optimizer, ref) → params;
        ``files`` maps further file names to their content or to a file to copy (all in the manifest)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temps()
        final = self.step_dir(step)
        tmp = self.dir / f".{final.name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        for stem, params in tensors.items():
            save_parameters(params, tmp / f"{stem}.ckpt")
        (tmp / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True), encoding="utf-8")
        (tmp / "config.yaml").write_text(config_yaml, encoding="utf-8")
        for name, content in (files or {}).items():
            if isinstance(content, bytes):
                (tmp / name).write_bytes(content)
            else:
                shutil.copyfile(content, tmp / name)
        written = sorted(p.name for p in tmp.iterdir())
        files = {n: {"bytes": (tmp / n).stat().st_size, "sha256": _sha256(tmp / n)} for n in written}
        manifest = {"step": step, "run_id": self.run_id, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
        if final.exists():  # a re-run of the same step replaces the old copy
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._retain()
        return final

    def _remove_stale_temps(self) -> None:
        """Delete the temporary folders of saves that died mid-write (a whole checkpoint's size each):
        those of processes no longer running, and earlier ones of this process."""
        for tmp in self.dir.glob(f".{PREFIX}*.tmp-*"):
            pid = tmp.name.rsplit("-", 1)[-1]
            if not (tmp.is_dir() and pid.isdigit()) or (int(pid) != os.getpid() and _running(int(pid))):
                continue  # another live process may be writing it
            size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
            log.warning("removing %s (%.1f MB): a checkpoint save that did not finish", tmp, size / 2 ** 20)
            shutil.rmtree(tmp, ignore_errors=True)

    def _retain(self) -> None:
        if self.keep_last <= 0:
            return
        ours = [s for s in self.list_steps() if self.run_of(self.step_dir(s)) in ("", self.run_id)]
        for old in ours[:-self.keep_last]:
            shutil.rmtree(self.step_dir(old), ignore_errors=True)

    @staticmethod
    def run_of(path: Path) -> str:
        """The run id in a checkpoint's manifest ('' when it has none or no readable manifest)."""
        try:
            return str(json.loads((path / MANIFEST).read_text(encoding="utf-8")).get("run_id", ""))
        except (OSError, json.JSONDecodeError):
            return ""

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
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            return "no manifest.json (partial write)"
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            return "manifest.json is not valid JSON"
        for name, meta in manifest.get("files", {}).items():
            f = path / name
            if not f.is_file():
                return f"{name} is missing"
            if f.stat().st_size != meta["bytes"]:
                return f"{name} has {f.stat().st_size} bytes, manifest says {meta['bytes']}"
            if _sha256(f) != meta["sha256"]:
                return f"{name} checksum mismatch"
        return None

    def latest_complete(self) -> Optional[Tuple[int, Path]]:
        """The newest intact checkpoint; corrupt or partial newer ones are reported and skipped."""
        for step in reversed(self.list_steps()):
            path = self.step_dir(step)
            problem = self.verify(path)
            if problem is None:
                return step, path
            log.warning("checkpoint %s is unusable (%s); falling back to the previous one", path, problem)
        return None

    @staticmethod
    def read_state(path: Path) -> Dict:
        return json.loads((path / "state.json").read_text(encoding="utf-8"))


def check_output_dirs(output_dir: Union[str, Path], ckpt_dir: Union[str, Path], *, resume: str,
                      overwrite: bool) -> None:
    """Refuse to start a fresh run where another run's results are (its checkpoints, its metrics),
    unless it resumes that run or ``overwrite`` says to replace it. Read-only: safe on every rank."""
    output_dir, ckpt_dir = Path(output_dir), Path(ckpt_dir)
    for name, path in (("--output_dir", output_dir), ("--save_ckpt_dir", ckpt_dir)):
        if path.exists() and not path.is_dir():
            raise MindRLHFError(f"{name} {path} is a file, not a directory; choose a directory path")
    if resume and resume not in ("latest", "auto") and not Path(resume).is_dir():
        raise MindRLHFError(f"--resume {resume}: no such checkpoint folder; pass --resume latest, or a step folder "
                            f"such as {ckpt_dir / 'step_00000010'}")
    if resume or overwrite:
        return
    found = []
    steps = CheckpointManager(str(ckpt_dir)).list_steps()
    if steps:
        found.append(f"checkpoints of steps {', '.join(map(str, steps))} in {ckpt_dir}")
    if (output_dir / "metrics.jsonl").is_file():
        found.append(str(output_dir / "metrics.jsonl"))
    if found:
        raise MindRLHFError(f"--output_dir {output_dir} already holds a run ({'; '.join(found)}); pass --resume to "
                            f"continue it, --overwrite_output_dir true to replace it, or choose another --output_dir")


def clear_previous_run(output_dir: Union[str, Path], ckpt_dir: Union[str, Path]) -> None:
    """``--overwrite_output_dir``: delete the old run's checkpoints and metrics, so that nothing of it
    can be resumed or appended to by mistake later."""
    manager = CheckpointManager(str(ckpt_dir))
    for step in manager.list_steps():
        log.warning("--overwrite_output_dir: deleting the previous run's checkpoint %s", manager.step_dir(step))
        shutil.rmtree(manager.step_dir(step), ignore_errors=True)
    metrics = Path(output_dir) / "metrics.jsonl"
    if metrics.is_file():
        log.warning("--overwrite_output_dir: deleting the previous run's %s", metrics)
        metrics.unlink()

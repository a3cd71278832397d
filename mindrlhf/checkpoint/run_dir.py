"""A run's directories: who owns them, and what a fresh start, an overwrite or a resume may do there.

A training run writes into its ``output_dir`` (``metrics.jsonl``, ``run.json``, ``config.yaml``,
TensorBoard events, completion dumps, plots) and its checkpoint directory (``step_N/`` folders,
each naming its run id in its manifest). The rules every stage follows:

- ``check_run_dirs`` runs first, on every worker, and writes nothing but the (empty) directories,
  which ``RunStart.undo`` removes again when the start fails, and the job's main process takes each directory's
  ``RunLock`` before it reads what is there, so a second launch into a folder in use is refused before it writes
  anything (the lock goes with its holder, also when it is killed): output and checkpoint directories inside
  an input model are refused; a fresh start where another run's history is is refused (unless
  ``overwrite``); a ``--resume`` is resolved to one checkpoint of one run of this stage, read with the
  same models (refused when it would mix two runs or two stages, when a model changed, or when it finds
  no checkpoint but the output directory has a history).
- ``clear_previous_run`` (``--overwrite_output_dir``) runs only after everything else was
  validated and the models loaded, and says what it removed.
- Writes that fail (a full disk) raise one ``MindRLHFError`` line naming the path and the free space.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Union

from mindrlhf.checkpoint.hf_io import model_files
from mindrlhf.checkpoint.manager import CheckpointManager
from mindrlhf.checkpoint.manifest import DEFAULT_MODEL, describe, model_identity, read_manifest, same_model
from mindrlhf.checkpoint.run_record import RUN_FILE, read_run
from mindrlhf.errors import MindRLHFError
from mindrlhf.utils.fs import is_inside

log = logging.getLogger(__name__)
PathLike = Union[str, Path]
METRICS_FILE = "metrics.jsonl"
# What a run writes into its output_dir (besides the checkpoints); --overwrite_output_dir removes these.
# The default data's mindrecord (data/) and the compile cache are caches of inputs, not history: kept.
#: The folders a LoRA run ends with in its output_dir: the policy's PEFT adapter, and PPO's critic's beside it.
ADAPTER_DIR, CRITIC_ADAPTER_DIR = "adapter", "critic_adapter"
ADAPTER_DIRS = (ADAPTER_DIR, CRITIC_ADAPTER_DIR)
RUN_OUTPUTS = (METRICS_FILE, RUN_FILE, "config.yaml", "tensorboard", "completions_step_*.jsonl", "*.png",
               "skipped_rows.jsonl", *ADAPTER_DIRS)
#: The lock file of a run folder in use (``RunLock``); it exists only while its holder runs, or after it was killed.
LOCK_FILE = ".mindrlhf.lock"


class RunLock:
    """An exclusive lock on one run folder: ``fcntl.flock`` on ``LOCK_FILE`` inside it, which the kernel releases
    when the holder exits however it ends (a SIGKILLed holder leaves the file, never the lock). The holder writes its
    PID, host and command line into the file, so a refused launch can name it; ``release`` removes the file.

    ``flock`` is advisory and local to one machine's kernel (on NFS it may lock nothing across hosts): it keeps two
    launches on one machine, or on a filesystem that forwards flock, out of each other's folder."""

    def __init__(self, folder: PathLike, flag: str = "--output_dir"):
        self.folder, self.flag = Path(folder), flag
        self.path = self.folder / LOCK_FILE
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        """Take the lock, or raise one line naming the process that holds it."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    raise MindRLHFError(f"{self.flag} {self.folder}: cannot lock {self.path} ({err.strerror}); "
                                        f"choose a directory on a filesystem that supports file locks") from None
                raise MindRLHFError(f"{self.flag} {self.folder} is in use by another run ({self.holder()}); wait "
                                    f"for it to end, or choose another {self.flag}") from None
            # The previous holder may have removed the file between our open and our lock: then we hold a lock on
            # a file nobody else can find, and must lock the one at the path instead.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started,
                                 "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}).encode("utf-8") + b"\n")
        self._fd = fd

    def holder(self) -> str:
        """``pid 123 on host h since 2026-12-02 10:00:00: mindrlhf-sft ...``, from the lock file ('' fields unknown)."""
        try:
            found = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return "its holder did not say who it is yet"
        command = str(found.get("command", ""))
        command = command if len(command) <= 120 else command[:117] + "..."
        return f"pid {found.get('pid')} on host {found.get('host')} since {found.get('started')}: {command}"

    def release(self) -> None:
        """Remove the lock file and release the lock (removed first, so no launch can lock the file we leave)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass  # a folder that became read-only: the lock still goes with the descriptor
        os.close(self._fd)
        self._fd = None


def takes_run_locks() -> bool:
    """Whether this process locks the run's folders: the job's first worker (msrun's ``RANK_ID`` 0, read before
    the cluster is set up) or the only process. The other workers write nothing of the run's history, and msrun's
    scheduler process (``MS_ROLE`` ``MS_SCHED``, which runs the same script without a ``RANK_ID``) neither."""
    if os.environ.get("MS_ROLE", "MS_WORKER") != "MS_WORKER":
        return False
    return os.environ.get("RANK_ID", "0") == "0"


def _history(output_dir: Path) -> int:
    """How many lines ``metrics.jsonl`` has (0 when there is none)."""
    try:
        return sum(1 for line in (output_dir / METRICS_FILE).read_text(encoding="utf-8").splitlines() if line.strip())
    except OSError:
        return 0


def _steps_text(steps: List[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}-{steps[-1]} ({len(steps)} in all)"


def _runs_text(runs: Dict[str, List[int]]) -> str:
    return "; ".join(f"run {rid or '(no run id)'}: steps {_steps_text(steps)}" for rid, steps in sorted(runs.items()))


def _ensure_writable(name: str, path: Path) -> List[Path]:
    """Create ``path`` and prove a file can be written in it; returns the directories it created (outermost
    first), for ``RunStart.undo``."""
    created = [d for d in (path, *path.parents) if not d.exists()][::-1]
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise MindRLHFError(f"{name} {path} cannot be written ({err.strerror or err}); choose a directory you "
                            f"can write to") from None
    return created


@dataclass
class RunStart:
    """What ``check_run_dirs`` decided: a fresh start, or a resume from ``checkpoint`` (of ``run_id``).
    ``models``: on a resume, the identity of each input model (``checkpoint.manifest.model_identity``), found
    equal to the checkpoint's; ``created``: the directories the check created; ``locks``: the folders' ``RunLock``s
    this process holds until ``release``."""

    checkpoint: Optional[Path] = None
    run_id: str = ""
    models: Optional[Dict[str, Dict[str, object]]] = None
    created: List[Path] = field(default_factory=list)
    locks: List[RunLock] = field(default_factory=list)

    def release(self) -> None:
        """The run ended (or failed): release its folders' locks."""
        for lock in reversed(self.locks):
            lock.release()
        self.locks = []

    def undo(self) -> None:
        """A start that failed (a bad data file, a missing model) leaves no empty directory behind: release the
        locks, then remove the directories the check created, innermost first, where they are still empty."""
        self.release()
        for path in reversed(self.created):
            try:
                path.rmdir()
            except OSError:
                pass  # not empty (or gone): something else put files there


def _check_not_inside_inputs(dirs: Mapping[str, Path], models: Mapping[str, str]) -> None:
    """A run never writes into an input model's folder (its output could replace or mix with the model's files)."""
    for flag, model in models.items():
        if not model or not Path(model).exists():
            continue  # the default, or a path the loader reports as missing
        # A checkpoint file's folder holds its config.json too: the model is that folder.
        folder = Path(model) if Path(model).is_dir() else Path(model).parent
        for name, path in dirs.items():
            if is_inside(path, folder):
                raise MindRLHFError(f"{name} {path} is inside the input model folder {folder} ({flag} {model}); a "
                                    f"run never writes into its inputs: choose a {name} outside it")


def check_run_dirs(output_dir: PathLike, ckpt_dir: PathLike, *, resume: str, overwrite: bool, stage: str = "",
                   models: Optional[Mapping[str, str]] = None) -> RunStart:
    """Before anything of a run is written, on every worker: refuse what could lose or mix a run's
    history, and resolve ``resume`` ('' fresh, 'latest', or a step folder) to one checkpoint.

    ``stage`` names the command (sft, rm, dpo, ppo, grpo); ``models`` maps each input model's flag to the
    path it was given ('' = that role's default).

    - Output and checkpoint directories inside an input model's folder are refused.
    - A resume of another stage's checkpoint, or into an output_dir holding another stage's history, is
      refused; so is a resume whose models differ from the checkpoint's (by content: a model that was only
      moved is the same).

    - A fresh start where checkpoints or metrics already are is refused unless ``overwrite``.
    - ``resume`` 'latest' takes the newest intact checkpoint in ``ckpt_dir``; it is refused when
      ``ckpt_dir`` holds several runs (name the step folder), and when there is no checkpoint but
      ``output_dir`` has metrics (a fresh start would replace them). With no history at all it
      starts fresh (a first launch of a job script that always passes --resume).
    - A resumed run may not write into a checkpoint directory holding another run's checkpoints
      unless the checkpoint it resumes is in that directory, nor into an output_dir whose history
      belongs to another run.
    """
    output_dir, ckpt_dir = Path(output_dir), Path(ckpt_dir)
    dirs = {"--output_dir": output_dir, "--save_ckpt_dir": ckpt_dir}
    for name, path in dirs.items():
        if path.exists() and not path.is_dir():
            raise MindRLHFError(f"{name} {path} is a file, not a directory; choose a directory path")
    models = dict(models or {})
    _check_not_inside_inputs(dirs, models)
    created: List[Path] = []
    locks: List[RunLock] = []
    try:
        for name, path in dirs.items():
            created += _ensure_writable(name, path)
        if takes_run_locks():
            # The checkpoint directory is its own folder to lock only when it is not inside output_dir.
            for name, path in dirs.items():
                if name == "--output_dir" or not is_inside(path, output_dir):
                    locks.append(RunLock(path, name))
                    locks[-1].acquire()
        start = _resolve_start(output_dir, ckpt_dir, resume, overwrite, stage, next(iter(models), "--model"))
        if start.checkpoint is not None:
            start.models = _same_models(start.checkpoint, models)
    except BaseException:
        RunStart(created=created, locks=locks).undo()
        raise
    start.created, start.locks = created, locks
    return start


def _loaded_files(path: str) -> List[Path]:
    """The files the loader reads for a model path (none for a role's default, '')."""
    return model_files(path) if path != DEFAULT_MODEL else []


def identify_models(models: Mapping[str, str]) -> Dict[str, Dict[str, object]]:
    """Each input model's identity (``manifest.model_identity``: path, and size and SHA-256 of the files its loader
    reads), for the checkpoints; a path given for several roles is hashed once."""
    found: Dict[str, Dict[str, object]] = {}
    for path in set(models.values()):
        found[path] = model_identity(path, _loaded_files(path))
    return {flag: found[path] for flag, path in models.items()}


def _same_models(checkpoint: Path, models: Mapping[str, str]) -> Optional[Dict[str, Dict[str, object]]]:
    """Each input model's identity, refusing a resume whose models differ from those ``checkpoint`` recorded
    (None for a checkpoint from before models were recorded)."""
    recorded = CheckpointManager.read_state(checkpoint).get("models")
    if not isinstance(recorded, dict):
        return None
    found: Dict[str, Dict[str, object]] = {}
    for flag, path in models.items():
        old = recorded.get(flag)
        if old is None:  # a role this stage did not record then
            continue
        same, found[flag] = same_model(old, path, _loaded_files(path))
        if not same:
            was = f"pass {flag} {old['path']}" if old.get("path") else f"leave {flag} out"
            raise MindRLHFError(f"--resume {checkpoint}: {flag} differs from the run's: it trained with "
                                f"{describe(old)}, now {describe(found[flag])}; a resumed run reads the same "
                                f"models: {was}, or start a new run in another --output_dir")
    return found


def _resolve_start(output_dir: Path, ckpt_dir: Path, resume: str, overwrite: bool, stage: str,
                   model_flag: str) -> RunStart:
    """``check_run_dirs``' decision (read-only): a fresh start, or the one checkpoint to resume."""
    manager = CheckpointManager(str(ckpt_dir))
    steps = manager.list_steps()
    if not resume:
        found = []
        if steps:
            found.append(f"checkpoints of steps {_steps_text(steps)} in {ckpt_dir}")
        if (output_dir / METRICS_FILE).is_file():
            found.append(str(output_dir / METRICS_FILE))
        if found and not overwrite:
            raise MindRLHFError(f"--output_dir {output_dir} already holds a run ({'; '.join(found)}); pass --resume "
                                f"to continue it, --overwrite_output_dir true to replace it, or choose another "
                                f"--output_dir")
        return RunStart()

    owner = read_run(output_dir)
    other = owner.get("stage", "")
    if stage and other and other != stage and _history(output_dir):
        raise MindRLHFError(f"--resume: --output_dir {output_dir} holds a {other} run (mindrlhf-{other}); "
                            f"mindrlhf-{stage} cannot continue it: choose another --output_dir")
    # Folders without a manifest are unusable (a copy or write that did not finish), not runs of their own.
    runs: Dict[str, List[int]] = defaultdict(list)
    for step in steps:
        if read_manifest(manager.step_dir(step)) is not None:
            runs[manager.run_of(manager.step_dir(step))].append(step)
    if resume in ("latest", "auto"):
        found = manager.latest_complete()
        if len(runs) > 1:
            example = found[1] if found else manager.step_dir(max(s for r in runs.values() for s in r))
            raise MindRLHFError(f"--resume latest: {ckpt_dir} holds checkpoints of {len(runs)} runs "
                                f"({_runs_text(runs)}); pass the step folder to resume, e.g. --resume {example}")
        if found is None:
            if steps:
                raise MindRLHFError(f"--resume: no intact checkpoint in {ckpt_dir} (steps {_steps_text(steps)} are all "
                                    f"partial or corrupt); restore one, or start without --resume")
            history = _history(output_dir)
            if history:
                raise MindRLHFError(f"--resume: no checkpoint in {ckpt_dir}, but {output_dir / METRICS_FILE} holds "
                                    f"{history} steps of a run; pass the step folder to resume (--resume PATH), or "
                                    f"--overwrite_output_dir true without --resume to replace that run")
            log.warning("--resume: no checkpoint in %s and no metrics in %s yet; starting from step 0",
                        ckpt_dir, output_dir)
            return RunStart()
        checkpoint = found[1]
    else:
        checkpoint = Path(resume)
        if not checkpoint.is_dir():
            found = manager.latest_complete()
            hint = (f"the newest intact checkpoint in {ckpt_dir} is {found[1]}" if found else
                    f"{ckpt_dir} holds no intact checkpoint")
            raise MindRLHFError(f"--resume {resume}: no such checkpoint folder ({hint}); pass --resume latest or an "
                                f"existing step folder")
        problem = CheckpointManager.verify(checkpoint)
        if problem:
            raise MindRLHFError(f"--resume {checkpoint}: the checkpoint is unusable ({problem}); pass another one or "
                                f"--resume latest")
    written_by = CheckpointManager.stage_of(checkpoint)
    if stage and written_by and written_by != stage:
        raise MindRLHFError(f"--resume {checkpoint}: a checkpoint of a {written_by} run (mindrlhf-{written_by}); "
                            f"mindrlhf-{stage} cannot continue it: to start {stage} from its weights pass "
                            f"{model_flag} {checkpoint} without --resume, with another --output_dir")
    run_id = CheckpointManager.run_of(checkpoint)
    named_here = checkpoint.resolve().parent == ckpt_dir.resolve()
    others = {rid: s for rid, s in runs.items() if rid != run_id}
    if others and not named_here:
        raise MindRLHFError(f"--save_ckpt_dir {ckpt_dir} holds another run's checkpoints ({_runs_text(others)}); "
                            f"resuming {checkpoint} (run {run_id or '(no run id)'}) there would mix the two runs; "
                            f"choose another --save_ckpt_dir")
    owner_id = owner.get("run_id", "")
    if owner_id and run_id and owner_id != run_id and _history(output_dir):
        raise MindRLHFError(f"--output_dir {output_dir} holds the metrics of run {owner_id}, not of run {run_id} that "
                            f"{checkpoint} belongs to; choose another --output_dir for the resumed run")
    return RunStart(checkpoint, run_id)


def clear_previous_run(output_dir: PathLike, ckpt_dir: PathLike) -> List[Path]:
    """``--overwrite_output_dir``: delete the previous run (its checkpoints and everything it wrote
    into ``output_dir``), so nothing of it can be resumed or mixed into the new run's curves. Called
    only once the new run is validated; logs one line naming what went. Returns the removed paths."""
    output_dir = Path(output_dir)
    manager = CheckpointManager(str(ckpt_dir))
    removed = [manager.step_dir(s) for s in manager.list_steps()]
    removed += [p for p in Path(ckpt_dir).glob(".step_*.tmp-*")] if Path(ckpt_dir).is_dir() else []
    if output_dir.is_dir():
        removed += sorted({p for pattern in RUN_OUTPUTS for p in output_dir.glob(pattern)})
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if removed:
        names = [str(p.relative_to(output_dir)) if p.is_relative_to(output_dir) else str(p) for p in removed]
        log.warning("--overwrite_output_dir: removed the previous run from %s: %s", output_dir, ", ".join(names))
    return removed

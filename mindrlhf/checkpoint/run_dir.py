"""A run's directories: who owns them, and what a fresh start, an overwrite or a resume may do there.

A training run writes into its ``output_dir`` (``metrics.jsonl``, ``run.json``, ``config.yaml``,
TensorBoard events, completion dumps, plots) and its checkpoint directory (``step_N/`` folders,
each naming its run id in its manifest). The rules every stage follows:

- ``check_run_dirs`` runs first, on every worker, and writes nothing but the (empty) directories:
  a fresh start where another run's history is is refused (unless ``overwrite``), a ``--resume``
  is resolved to one checkpoint of one run (refused when that would mix two runs, or when it
  finds no checkpoint but the output directory has a history).
- ``clear_previous_run`` (``--overwrite_output_dir``) runs only after everything else was
  validated and the models loaded, and says what it removed.
- Writes that fail (a full disk) raise one ``MindRLHFError`` line naming the path and the free space.
"""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Union

from mindrlhf.checkpoint.manager import CheckpointManager
from mindrlhf.errors import MindRLHFError
from mindrlhf.utils.fs import write_text_atomic

log = logging.getLogger(__name__)
PathLike = Union[str, Path]
RUN_FILE = "run.json"  # {"run_id": ...}: which run the output directory's history belongs to
METRICS_FILE = "metrics.jsonl"
# What a run writes into its output_dir (besides the checkpoints); --overwrite_output_dir removes these.
# The default data's mindrecord (data/) and the compile cache are caches of inputs, not history: kept.
RUN_OUTPUTS = (METRICS_FILE, RUN_FILE, "config.yaml", "tensorboard", "completions_step_*.jsonl", "*.png",
               "skipped_rows.jsonl")


def read_run_id(output_dir: PathLike) -> str:
    """The run id recorded in ``output_dir/run.json`` ('' when there is none)."""
    try:
        return str(json.loads((Path(output_dir) / RUN_FILE).read_text(encoding="utf-8")).get("run_id", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def write_run_id(output_dir: PathLike, run_id: str) -> None:
    """Record that ``output_dir``'s history belongs to run ``run_id``."""
    write_text_atomic(Path(output_dir) / RUN_FILE, json.dumps({"run_id": run_id}) + "\n", "the run file")


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


def _ensure_writable(name: str, path: Path) -> None:
    """Create ``path`` (an empty directory is harmless) and prove a file can be written in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise MindRLHFError(f"{name} {path} cannot be written ({err.strerror or err}); choose a directory you "
                            f"can write to") from None


@dataclass
class RunStart:
    """What ``check_run_dirs`` decided: a fresh start, or a resume from ``checkpoint`` (of ``run_id``)."""

    checkpoint: Optional[Path] = None
    run_id: str = ""


def check_run_dirs(output_dir: PathLike, ckpt_dir: PathLike, *, resume: str, overwrite: bool) -> RunStart:
    """Before anything of a run is written, on every worker: refuse what could lose or mix a run's
    history, and resolve ``resume`` ('' fresh, 'latest', or a step folder) to one checkpoint.

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
    for name, path in (("--output_dir", output_dir), ("--save_ckpt_dir", ckpt_dir)):
        if path.exists() and not path.is_dir():
            raise MindRLHFError(f"{name} {path} is a file, not a directory; choose a directory path")
    start = _resolve_start(output_dir, ckpt_dir, resume, overwrite)
    _ensure_writable("--output_dir", output_dir)
    _ensure_writable("--save_ckpt_dir", ckpt_dir)
    return start


def _resolve_start(output_dir: Path, ckpt_dir: Path, resume: str, overwrite: bool) -> RunStart:
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

    runs: Dict[str, List[int]] = defaultdict(list)
    for step in steps:
        runs[manager.run_of(manager.step_dir(step))].append(step)
    if resume in ("latest", "auto"):
        if len(runs) > 1:
            raise MindRLHFError(f"--resume latest: {ckpt_dir} holds checkpoints of {len(runs)} runs "
                                f"({_runs_text(runs)}); pass the step folder to resume, e.g. "
                                f"--resume {manager.step_dir(steps[-1])}")
        found = manager.latest_complete()
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
            raise MindRLHFError(f"--resume {resume}: no such checkpoint folder; pass --resume latest, or a step folder "
                                f"such as {ckpt_dir / 'step_00000010'}")
        problem = CheckpointManager.verify(checkpoint)
        if problem:
            raise MindRLHFError(f"--resume {checkpoint}: the checkpoint is unusable ({problem}); pass another one or "
                                f"--resume latest")
    run_id = CheckpointManager.run_of(checkpoint)
    named_here = checkpoint.resolve().parent == ckpt_dir.resolve()
    others = {rid: s for rid, s in runs.items() if rid != run_id}
    if others and not named_here:
        raise MindRLHFError(f"--save_ckpt_dir {ckpt_dir} holds another run's checkpoints ({_runs_text(others)}); "
                            f"resuming {checkpoint} (run {run_id or '(no run id)'}) there would mix the two runs; "
                            f"choose another --save_ckpt_dir")
    owner = read_run_id(output_dir)
    if owner and run_id and owner != run_id and _history(output_dir):
        raise MindRLHFError(f"--output_dir {output_dir} holds the metrics of run {owner}, not of run {run_id} that "
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

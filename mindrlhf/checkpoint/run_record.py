"""A run's record in its output folder (``run.json``), and what a run's folder stands for as a model path.

Below both ``run_dir`` (the directory rules) and ``hf_io`` (which opens a run's folder as its newest intact
checkpoint), so both read one definition of what ``run.json`` says.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Dict, Union

import yaml

from mindrlhf.checkpoint.manager import CheckpointManager
from mindrlhf.errors import MindRLHFError
from mindrlhf.utils.fs import write_text_atomic

log = logging.getLogger(__name__)
PathLike = Union[str, Path]
RUN_FILE = "run.json"  # {"run_id": ..., "stage": ...}: which run the output directory's history belongs to


def read_run(output_dir: PathLike) -> Dict[str, str]:
    """``output_dir/run.json``: the run id and stage its history belongs to ({} when there is none)."""
    try:
        found = json.loads((Path(output_dir) / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def read_run_id(output_dir: PathLike) -> str:
    """The run id recorded in ``output_dir/run.json`` ('' when there is none)."""
    return read_run(output_dir).get("run_id", "")


def write_run_id(output_dir: PathLike, run_id: str, stage: str = "") -> None:
    """Record that ``output_dir``'s history belongs to run ``run_id`` of ``stage``."""
    write_text_atomic(Path(output_dir) / RUN_FILE, json.dumps({"run_id": run_id, "stage": stage}) + "\n",
                      "the run file")


_SAID: set = set()  # run folders whose resolution was logged (a model path is opened several times per load)


def model_of_run(path: PathLike) -> Path:
    """A model path as given, or, for a training run's output folder (``run.json`` beside ``checkpoints/``), that
    run's newest intact checkpoint folder: ``--model output/sft`` follows the SFT run, however many steps it ran
    (the choice is logged once). Other paths are returned as they are."""
    folder = Path(path)
    if not ((folder / RUN_FILE).is_file() and folder.is_dir()):
        return folder
    ckpt_dir = folder / "checkpoints"
    try:  # the run may have saved elsewhere (--save_ckpt_dir): its config.yaml says where
        saved = (yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8")) or {}).get("train", {})
        ckpt_dir = Path(saved.get("save_ckpt_dir") or ckpt_dir)
    except (OSError, ValueError, AttributeError):
        pass
    run_id = read_run_id(folder) or None
    found = CheckpointManager(str(ckpt_dir)).latest_complete(run_id)
    if found is None:
        raise MindRLHFError(f"{folder} is a training run's folder with no intact checkpoint (in {ckpt_dir}); let the "
                            f"run save one, or pass a model folder")
    if folder.resolve() not in _SAID:
        _SAID.add(folder.resolve())
        log.info("%s is a training run: using its newest intact checkpoint %s (step %d)", folder, found[1], found[0])
    return found[1]

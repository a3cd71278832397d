"""Filesystem writes that fail with one line: a full disk names the path and the free space."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Union

from mindrlhf.errors import MindRLHFError

PathLike = Union[str, Path]


def is_inside(path: PathLike, directory: PathLike) -> bool:
    """Whether ``path`` is ``directory`` or below it (symbolic links resolved): a write there is a write into it."""
    path, directory = Path(path).resolve(), Path(directory).resolve()
    return path == directory or directory in path.parents


def free_space(path: PathLike) -> str:
    """``'1.2 GB free'`` on the filesystem of ``path`` (or of its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return "free space unknown"
    return f"{free / 1e9:.1f} GB free" if free >= 1e9 else f"{free / 2 ** 20:.1f} MB free"


def write_failed(what: str, path: PathLike, err: OSError) -> MindRLHFError:
    """The one-line error of a write that the filesystem refused (disk full, read-only, ...)."""
    return MindRLHFError(f"writing {what} {path} failed: {err.strerror or err} ({free_space(path)} there); "
                         f"free space or choose another directory, then rerun (with --resume if a checkpoint was "
                         f"saved, else with --overwrite_output_dir true)")


def write_text_atomic(path: PathLike, text: str, what: str = "file") -> None:
    """Write ``text`` to ``path`` via a temporary file and a rename: a failed write leaves the old file
    as it was and no temporary file behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise write_failed(what, path, err) from None

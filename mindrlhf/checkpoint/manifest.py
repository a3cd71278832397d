"""What a checkpoint folder's ``manifest.json`` promises, checked wherever a checkpoint is read, and the
identity of the models a run reads (so a resume can tell that a model changed).

The manifest (written last by ``checkpoint.manager``) lists the size and SHA-256 of every file of a
``step_N/`` folder and names the run and the stage that wrote it. ``verify_folder`` checks a whole folder
(``--resume``); ``verify_files`` checks the files a loader is about to read when their folder has a
manifest (``--model <step_N>``, ``mindrlhf-eval``, ``convert_weight --reverse``, ``transform_checkpoint``),
so a damaged checkpoint is never trained from, evaluated or converted in silence. No MindSpore here.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Tuple, Union

from mindrlhf.errors import MindRLHFError

PathLike = Union[str, Path]
MANIFEST = "manifest.json"
STATE = "state.json"  # a checkpoint's counters and the identity of its input models (checkpoint.manager writes it)
log = logging.getLogger(__name__)

# Files already checked in this process, by (path, size, mtime): a model is opened more than once per load
# (its config, then its weights), and a file that did not change need not be hashed twice.
_VERIFIED: set = set()


def sha256_file(path: PathLike) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(folder: PathLike) -> Optional[dict]:
    """The manifest of ``folder`` (a dict with ``files``), or None when it has none (or not one of ours)."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def _mismatch(path: Path, meta: Mapping) -> Optional[str]:
    """Why ``path`` differs from its manifest entry ``meta`` (None when it matches)."""
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size != meta.get("bytes"):
        return f"{path.name} has {size} bytes, manifest says {meta.get('bytes')}"
    if sha256_file(path) != meta.get("sha256"):
        return f"{path.name} checksum mismatch"
    return None


def verify_folder(folder: PathLike) -> Optional[str]:
    """None if the checkpoint folder is complete and intact, else the reason it is not."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        return f"no {MANIFEST} (partial write, or not a mindrlhf checkpoint)"
    manifest = read_manifest(folder)
    if manifest is None:
        return f"{MANIFEST} is not valid"
    for name, meta in manifest["files"].items():
        problem = _mismatch(folder / name, meta)
        if problem:
            return problem
    return None


def verify_files(paths: Iterable[PathLike]) -> None:
    """Raise one line when a file about to be read belongs to a checkpoint folder (its folder has a manifest
    listing it) and differs from what the manifest recorded. Files of folders without a manifest (HF exports,
    ``convert_weight`` output) are not checked."""
    for path in map(Path, paths):
        try:
            st = path.stat()
        except OSError:
            continue  # the loader names a missing file itself
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if key in _VERIFIED:
            continue
        manifest = read_manifest(path.parent)
        meta = manifest["files"].get(path.name) if manifest else None
        if meta is not None:
            problem = _mismatch(path, meta)
            if problem:
                raise MindRLHFError(f"{path}: the checkpoint is damaged ({problem} against {path.parent / MANIFEST}); "
                                    f"use another checkpoint (an earlier step_N folder) or restore it from a copy")
        _VERIFIED.add(key)


# ---------------------------------------------------------------------------------------------
# The identity of a run's input models
# ---------------------------------------------------------------------------------------------
#: A role's path when none was given: the stage's default for it (the packaged model, the initial policy, ...).
DEFAULT_MODEL = ""


def _name(f: Path, path: str) -> str:
    """A model file's name in the record: relative to the model's folder (the model directory, or a file's
    folder), else its full path (a run's checkpoints saved elsewhere)."""
    root = Path(path) if Path(path).is_dir() else Path(path).parent
    return str(f.relative_to(root)) if f.is_relative_to(root) else str(f)


def _stat(f: Path) -> Dict[str, int]:
    st = f.stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def model_identity(path: str, files: List[Path]) -> Dict[str, object]:
    """What a run records of an input model: its path, and size, modification time and SHA-256 of each of
    ``files`` (the files its loader reads: ``checkpoint.hf_io.model_files``), plus one digest over them all.
    The packaged default model (``path`` '') is recorded as such."""
    if path == DEFAULT_MODEL:
        return {"path": DEFAULT_MODEL}
    listed = {_name(f, path): {**_stat(f), "sha256": sha256_file(f)} for f in files}
    return {"path": str(Path(path).resolve()), "files": listed, "sha256": _digest(listed)}


def _digest(listed: Mapping[str, Mapping]) -> str:
    """One SHA-256 over the files' names and digests (a model as one short string in a message)."""
    return hashlib.sha256(json.dumps({n: m["sha256"] for n, m in sorted(listed.items())}).encode()).hexdigest()


def same_model(recorded: Mapping, path: str, files: List[Path]) -> Tuple[bool, Dict[str, object]]:
    """Whether the model at ``path`` (its loader's ``files``) is the one ``recorded``; returns ``(same, its
    identity)``. When path, sizes and modification times equal the record's nothing is hashed again (the
    common resume); otherwise the content decides, so a model that was only moved is still the same."""
    if DEFAULT_MODEL in (recorded.get("path"), path):
        return recorded.get("path") == path, model_identity(path, files)
    old = recorded.get("files") or {}
    if str(Path(path).resolve()) == recorded.get("path") and len(old) == len(files) and all(
            {k: (old.get(_name(f, path)) or {}).get(k) for k in ("bytes", "mtime_ns")} == _stat(f) for f in files):
        return True, dict(recorded)
    identity = model_identity(path, files)
    return identity["sha256"] == recorded.get("sha256"), identity


def describe(identity: Mapping) -> str:
    """``/path (sha256 1a2b3c4d5e6f)``, or the role's default."""
    if identity.get("path") == DEFAULT_MODEL:
        return "its default (no path)"
    return f"{identity['path']} (sha256 {str(identity.get('sha256', ''))[:12]})"


def trained_base(adapter_dir: PathLike) -> Optional[Dict[str, object]]:
    """The identity of the base model a LoRA checkpoint's adapters were trained on (its ``state.json``'s first input
    model, the trained one), or None: a PEFT folder that is no training checkpoint, or a base recorded without a
    checksum (the packaged default)."""
    try:
        models = json.loads((Path(adapter_dir) / STATE).read_text(encoding="utf-8")).get("models")
    except (OSError, ValueError, AttributeError):
        return None
    base = next(iter(models.values()), None) if isinstance(models, dict) and models else None
    return base if isinstance(base, dict) and base.get("sha256") else None


def check_adapter_base(adapter_dir: PathLike, base: str, files: List[Path], *, flag: str, explicit: bool) -> None:
    """Adapters go on the base they were trained on: when ``adapter_dir`` (a LoRA training checkpoint) recorded its
    base and ``base`` (read from ``files``) is another model, raise one line, or only warn when the user named that
    base with ``flag`` (``explicit``: the same weights in another dtype or format are other files, and may be meant);
    the line for a recorded base that changed names ``flag`` as the way to insist."""
    recorded = trained_base(adapter_dir)
    if recorded is None:
        return
    same, found = same_model(recorded, base, files)
    if same:
        return
    trained = f"the adapters in {adapter_dir} were trained on {describe(recorded)}"
    if explicit:
        log.warning("%s, and %s %s is another model (%s); applying them to it as asked", trained, flag, base,
                    describe(found))
        return
    raise MindRLHFError(f"{trained}, and {base} now holds another model ({describe(found)}); restore the base they "
                        f"were trained on, or pass {flag} to apply them to another model")

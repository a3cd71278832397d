"""The one table of dtype names: every ``dtype`` option, CLI flag and config field resolves through it.

Pure Python (no MindSpore), so configs, converters and the checkpoint writers can use it.
"""
from __future__ import annotations

from mindrlhf.errors import MindRLHFError

#: Canonical dtype names, in the order they are listed to users.
DTYPES = ("float32", "bfloat16", "float16")
#: Every accepted spelling (lower case) -> canonical name.
DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
#: How the table is shown in error messages and help.
VALID_DTYPES = ("fp32/float32", "bf16/bfloat16", "fp16/float16")


def normalize_dtype(dtype: str, *, where: str = "--dtype") -> str:
    """The canonical name (``float32``/``bfloat16``/``float16``) of a dtype alias (case-insensitive)."""
    key = str(dtype).strip().lower()
    if key not in DTYPE_ALIASES:
        raise MindRLHFError(f"{where}: dtype {dtype!r} is not supported; use one of {', '.join(VALID_DTYPES)}")
    return DTYPE_ALIASES[key]

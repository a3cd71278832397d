"""Small helpers shared by the command-line entry points."""
from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

from mindrlhf.errors import MindRLHFError


def run_cli(main: Callable[[Optional[Sequence[str]]], int], argv: Optional[Sequence[str]] = None) -> int:
    """Run ``main(argv)``; turn a ``MindRLHFError`` into a one-line message and its exit code (2, or
    3 for a lost worker)."""
    try:
        return int(main(argv) or 0)
    except MindRLHFError as err:
        print(f"error: {err}", file=sys.stderr)
        return getattr(err, "exit_code", 2)

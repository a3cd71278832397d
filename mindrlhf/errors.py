"""User-facing error type.

Anything the user can fix (a bad path, a bad config value, a mismatched checkpoint) raises
``MindRLHFError`` with one line that names the bad input and the fix. Command-line entry points
catch it and print ``error: <message>`` with exit code 2 instead of a traceback.
"""
from __future__ import annotations


class MindRLHFError(ValueError):
    """An error caused by user input; the message names the input and the fix."""


class WorkerLostError(MindRLHFError):
    """Another worker of a distributed job died or hangs: a collective got no answer in time.

    Not the user's input, but the same one-line report; its own exit code (3) lets a scheduler tell
    "resume me" from "fix the command" (2).
    """

    exit_code = 3

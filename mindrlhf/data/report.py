"""What a data reader or converter read, kept and skipped: one report type for every data path.

``rlhf_data`` (prompt mindrecords) and ``text_rows`` (SFT / pair rows) skip a bad input line with
its line number and a reason key of ``REASONS``, and sum up in one line. A training run names the
first skipped rows in its log (``ConversionReport.named``) and lists all of them in its output_dir
(``write_skipped_rows``, ``SKIPPED_ROWS_FILE``). No MindSpore here.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from mindrlhf.errors import MindRLHFError
from mindrlhf.utils.fs import write_text_atomic

#: A training run's list of every row its data readers skipped, in its output_dir: one JSON object a line,
#: ``{"path", "line", "reason", "detail"}`` (``reason`` a key of ``REASONS``), in the order the files were read.
SKIPPED_ROWS_FILE = "skipped_rows.jsonl"
#: Skipped rows named in the log per data file; the rest are counted there, and all are in SKIPPED_ROWS_FILE.
SKIPPED_ROWS_LOGGED = 10

log = logging.getLogger(__name__)

# Reason key -> the words a report prints. One table, so a summary lists reasons in one fixed order.
REASONS: Dict[str, str] = {
    "malformed_json": "malformed JSON",
    "not_an_object": "not a JSON object",
    "missing_field": "missing field",
    "wrong_type": "wrongly typed field",
    "unknown_role": "unknown message role",
    "mixed_format": "another format than the file's",
    "no_chat_template": "conversational row, tokenizer has no chat template",
    "chat_template_error": "chat template failed",
    "unpaired_answers": "pos_answers and neg_answers differ in length",
    "no_pairs": "no answer pairs",
    "no_shared_prompt": "chosen and rejected share no prompt",
    "identical_pair": "chosen equals rejected",
    "empty_completion": "empty completion",
    "no_final_answer": "no final answer",
    "bad_annotation": "unreadable calculator annotation",
    "calculator_refused": "calculator refused an annotation",
    "calculator_disagrees": "calculator disagrees with an annotation",
    "prompt_too_long": "prompt too long",
    "nothing_trainable": "nothing trainable within max_length",
    "too_long": "longer than max_length",
}


@dataclass
class SkippedRow:
    """One input line that was not used; ``path`` is set by readers of several files."""

    line: int
    reason: str  # a key of REASONS
    detail: str
    path: Optional[str] = None

    @property
    def where(self) -> str:
        """``path:line`` (a reader of several files), else ``line N``."""
        return f"{self.path}:{self.line}" if self.path else f"line {self.line}"

    def __str__(self) -> str:
        return f"{self.where}: skipped ({REASONS[self.reason]}): {self.detail}"

    def to_json(self) -> str:
        """The row as one line of ``SKIPPED_ROWS_FILE``."""
        return json.dumps({"path": self.path, "line": self.line, "reason": self.reason, "detail": self.detail},
                          ensure_ascii=False)


@dataclass
class ConversionReport:
    """What a conversion (or a reader) read, wrote (or kept) and skipped.

    A converter writes ``output_path``; a reader returns its rows instead (``kept_word="kept"``,
    no output path). ``examples`` says what the kept rows hold when that is not one example per row
    (``"12 pairs"``); ``warnings`` counts the rows each warning applied to.
    """

    input_path: str
    output_path: Optional[str]
    rows_read: int = 0
    rows_written: int = 0
    skipped: List[SkippedRow] = field(default_factory=list)
    kept_word: str = "written"
    examples: str = ""
    warnings: Dict[str, int] = field(default_factory=dict)

    def skipped_by_reason(self) -> Dict[str, int]:
        """Number of skipped rows per reason key."""
        return dict(Counter(row.reason for row in self.skipped))

    def named(self, limit: int, where: str = "") -> List[str]:
        """The first ``limit`` skipped rows as ``path:line: skipped (reason): detail``, then
        ``... and K more`` (with ``where``, e.g. `` (all in out/skipped_rows.jsonl)``) when there are more."""
        lines = [str(row) for row in self.skipped[:limit]]
        if len(self.skipped) > limit:
            lines.append(f"... and {len(self.skipped) - limit} more{where}")
        return lines

    def no_usable_rows(self, source: Union[str, Path], fix: str) -> MindRLHFError:
        """The one-line error of a file none of whose rows is usable: its summary, its first skipped row by line and
        reason (the counts alone do not say which row to look at), and ``fix``."""
        first = ""
        if self.skipped:
            row = self.skipped[0]
            where = f"line {row.line}" if row.path in (None, str(source)) else row.where  # the file is named already
            # A detail can quote the row; the error stays one line.
            first = f"; the first skipped: {where} ({REASONS[row.reason]}): {' '.join(row.detail.split())}"
        return MindRLHFError(f"no usable rows in {source} ({self.summary()}){first}; {fix}")

    def summary(self) -> str:
        """One line: rows read, written (kept) and skipped by reason, and the counted warnings."""
        counts = self.skipped_by_reason()
        reasons = ", ".join(f"{REASONS[key]}: {counts[key]}" for key in REASONS if key in counts)
        skipped = f"{len(self.skipped)} skipped" + (f" ({reasons})" if reasons else "")
        kept = f"{self.rows_written} {self.kept_word}" + (f" ({self.examples})" if self.examples else "")
        line = f"{self.input_path}: {self.rows_read} rows read, {kept}, {skipped}"
        if self.kept_word == "written":
            line += f" -> {self.output_path or 'nothing written'}"
        for warning, rows in self.warnings.items():
            line += f"; {rows} rows: {warning}"
        return line


def converter_report(source: Union[str, Path], rows_read: int, skipped: Sequence[SkippedRow], kept: int, *,
                     strict: bool, fix: str) -> Tuple[ConversionReport, bool]:
    """A converter's report of what it read and skipped, and whether it goes on to write: not under ``strict``
    when any row was skipped (it returns the report, which names them). Nothing usable at all is a one-line error
    naming the file, the counts, the first skipped row and ``fix`` (``ConversionReport.no_usable_rows``)."""
    report = ConversionReport(str(source), None, rows_read=rows_read, skipped=list(skipped))
    if strict and skipped:
        return report, False
    if not kept:
        raise report.no_usable_rows(source, fix)
    return report, True


def write_skipped_rows(path: Union[str, Path], reports: Iterable[ConversionReport]) -> int:
    """Write every skipped row of ``reports`` to ``path`` (``SKIPPED_ROWS_FILE``'s format; an empty file when none
    was skipped, so a resumed run's file never lists rows of an older read). Returns the number of rows."""
    rows = [row for report in reports for row in report.skipped]
    write_text_atomic(path, "".join(row.to_json() + "\n" for row in rows), "skipped rows")
    return len(rows)


def log_report(report: ConversionReport, what: str, output_dir: Union[str, Path]) -> ConversionReport:
    """Log a data reader's ``report`` of the file given as ``what`` (``train_file``): its summary line, then its
    first ``SKIPPED_ROWS_LOGGED`` skipped rows by name (``path:line: skipped (reason): detail``), then how many
    more there are and that ``output_dir/SKIPPED_ROWS_FILE`` lists them all. Returns ``report``."""
    log.info("%s: %s", what, report.summary())
    where = f" (all in {Path(output_dir) / SKIPPED_ROWS_FILE})"
    for line in report.named(SKIPPED_ROWS_LOGGED, where):
        log.warning("%s", line)
    return report

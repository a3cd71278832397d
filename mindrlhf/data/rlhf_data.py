"""Convert a JSONL question/answer file (GSM8K, OpenR1-Math, generic) into a prompt mindrecord, and GSM8K's
question/answer rows into conversational SFT rows (``write_sft_rows``, ``mindrlhf-data --sft``).

    python -m mindrlhf.data.rlhf_data --vocab_path VOCAB --merges_file_path MERGES \\
        --file_path gsm8k/train.jsonl --output_path gsm8k_train.mindrecord

Each written row: ``prompt_ids`` (int32, padded with the pad id to ``max_prompt_length``),
``prompt_length`` (int32), ``solution`` (the final answer, string) and ``question`` (string).
Bad rows are skipped and reported with their 1-based line number and reason; a prompt that does
not fit ``max_prompt_length`` is skipped, never truncated. Blank lines are ignored. The output
depends only on the input, the tokenizer and the options: the same output file name gives a
byte-identical ``.mindrecord`` and ``.mindrecord.db`` (MindRecord stores the file name, not a time).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from tqdm import tqdm

from mindrlhf.data.gsm8k import (
    DEFAULT_PROMPT_STYLE,
    DEFAULT_SYSTEM_PROMPT,
    PROMPT_STYLES,
    build_prompt,
    final_answer,
    question_answer_row,
    sft_row,
    style_system_prompt,
)
from mindrlhf.data.report import ConversionReport, SkippedRow, converter_report
from mindrlhf.errors import MindRLHFError
from mindrlhf.resources import GSM8K_TRAIN_SAMPLE
from mindrlhf.tokenizer import Tokenizer, resolve_tokenizer
from mindrlhf.utils.cli import run_cli
from mindrlhf.utils.fs import write_text_atomic

# (question field, answer field) per dataset type; --question_field / --answer_field override them.
DATASET_FIELDS: Dict[str, Tuple[str, str]] = {
    "gsm8k": ("question", "answer"),
    "openr1math": ("problem", "answer"),
    "generic": ("question", "answer"),
}
# MindRecord's defaults (16 MB header, 32 MB pages) preallocate far more than a prompt file needs.
_HEADER_SIZE = 1 << 18
_PAGE_SIZE = 1 << 20
_CHUNK = 256  # rows per tokenizer batch (and per progress-bar update)


def read_rows(
    path: Path, dataset_type: str, question_field: str, answer_field: str
) -> Tuple[List[Tuple[int, str, str]], List[SkippedRow], int]:
    """Parse a question/answer file (``read_records``) into ``(line, question, solution)`` rows, skipped rows and
    the count of rows read."""
    records, skipped, read = read_records(path, dataset_type, question_field, answer_field)
    return [(line, record[question_field], solution) for line, record, solution in records], skipped, read


def read_records(
    path: Path, dataset_type: str, question_field: str, answer_field: str
) -> Tuple[List[Tuple[int, dict, str]], List[SkippedRow], int]:
    """Parse a question/answer file (JSONL, parquet or a datasets save_to_disk folder: ``data.row_files``; verl's
    GSM8K layout read as ``data.gsm8k.question_answer_row`` maps it) into ``(line, record, solution)`` rows
    (``record`` the row's object), skipped rows (line and reason: malformed JSON or not UTF-8, a missing question
    or answer, no final answer) and the count of rows read. Blank lines are ignored."""
    from mindrlhf.data.row_files import open_rows

    rows: List[Tuple[int, dict, str]] = []
    skipped: List[SkippedRow] = []
    read = 0
    for line_no, record, error, _ in open_rows(path, "question").rows():
        read += 1
        if error is not None:
            skipped.append(SkippedRow(line_no, "malformed_json", error))
            continue
        if not isinstance(record, dict):
            skipped.append(SkippedRow(line_no, "malformed_json", f"a JSON {type(record).__name__}, not an object"))
            continue
        record = question_answer_row(record)
        question = record.get(question_field)
        if not isinstance(question, str) or not question.strip():
            skipped.append(SkippedRow(line_no, "missing_field", f"no non-empty string field '{question_field}'"))
            continue
        if record.get(answer_field) is None:
            skipped.append(SkippedRow(line_no, "missing_field", f"no field '{answer_field}'"))
            continue
        solution, why = final_answer(record[answer_field], dataset_type)
        if solution is None:
            skipped.append(SkippedRow(line_no, "no_final_answer", why))
            continue
        rows.append((line_no, record, solution))
    return rows, skipped, read


def _write_mindrecord(output: Path, prompt_ids: np.ndarray, lengths: List[int], solutions: List[str],
                      questions: List[str], overwrite: bool) -> None:
    from mindspore.mindrecord import FileWriter  # lazy: importing mindspore takes seconds

    writer = FileWriter(str(output), shard_num=1, overwrite=overwrite)
    writer.set_header_size(_HEADER_SIZE)
    writer.set_page_size(_PAGE_SIZE)
    schema = {
        "prompt_ids": {"type": "int32", "shape": [prompt_ids.shape[1]]},
        "prompt_length": {"type": "int32"},
        "solution": {"type": "string"},
        "question": {"type": "string"},
    }
    writer.add_schema(schema, "mindrlhf prompts")
    for start in range(0, len(lengths), 1000):
        writer.write_raw_data([
            {"prompt_ids": prompt_ids[i], "prompt_length": np.int32(lengths[i]),
             "solution": solutions[i], "question": questions[i]}
            for i in range(start, min(start + 1000, len(lengths)))
        ])
    writer.commit()


def convert_to_mindrecord(
    file_path: str,
    output_path: str,
    tokenizer: Tokenizer,
    max_prompt_length: int = 320,
    dataset_type: str = "gsm8k",
    question_field: Optional[str] = None,
    answer_field: Optional[str] = None,
    system_prompt: Optional[str] = DEFAULT_SYSTEM_PROMPT,
    use_chat_template: bool = True,
    strict: bool = False,
    overwrite: bool = False,
    show_progress: bool = True,
    tools: Optional[Sequence[Dict[str, Any]]] = None,
) -> ConversionReport:
    """Convert ``file_path`` (question/answer rows: ``read_records``) into the prompt mindrecord ``output_path``;
    return the report. ``tools``: JSON schemas the chat template renders into every prompt (a GRPO run with
    ``tools`` trains on prompts that show them; ``rollout_tools.ToolBox(...).schemas``).

    With ``strict``, nothing is written when any row is skipped (``report.output_path`` is None).
    Only ``output_path`` and ``output_path + ".db"`` are ever written.
    """
    source, output = Path(file_path), Path(output_path)
    if dataset_type not in DATASET_FIELDS:
        raise MindRLHFError(f"--dataset_type {dataset_type!r} is unknown; use one of {', '.join(DATASET_FIELDS)}")
    if not source.exists():
        raise MindRLHFError(f"input file not found: {source}; pass a JSONL file, a .parquet file or a datasets "
                            "save_to_disk folder with --file_path")
    if max_prompt_length < 1:
        raise MindRLHFError(f"--max_prompt_length {max_prompt_length} must be >= 1")
    if output.resolve() == source.resolve():
        raise MindRLHFError(f"--output_path {output} is the input file; choose another output path")
    db_path = Path(str(output) + ".db")
    if (output.exists() or db_path.exists()) and not overwrite:
        raise MindRLHFError(f"output {output} already exists; pass --overwrite or choose another --output_path")
    if output.is_dir():
        raise MindRLHFError(f"--output_path {output} is a directory; "
                            f"pass a file name such as {output}/prompts.mindrecord")
    if use_chat_template and not tokenizer.has_chat_template:
        raise MindRLHFError(
            f"the tokenizer from {tokenizer.source} has no chat_template; pass --tokenizer_config with the model's "
            "tokenizer_config.json, or --no_chat_template for raw questions"
        )
    if tools:
        from mindrlhf.rollout_tools import check_template_renders_tools

        check_template_renders_tools(tokenizer, tools)
    default_q, default_a = DATASET_FIELDS[dataset_type]
    rows, skipped, read = read_rows(source, dataset_type, question_field or default_q, answer_field or default_a)

    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        raise MindRLHFError(f"the tokenizer from {tokenizer.source} has neither pad_token nor eos_token; "
                            "fix tokenizer_config.json")
    kept_ids: List[List[int]] = []
    kept: List[Tuple[int, str, str]] = []
    with tqdm(total=len(rows), desc="tokenizing", unit="row", disable=not show_progress, file=sys.stderr) as bar:
        for start in range(0, len(rows), _CHUNK):
            chunk = rows[start:start + _CHUNK]
            prompts = [build_prompt(q, tokenizer, system_prompt, use_chat_template, tools) for _, q, _ in chunk]
            for row, ids in zip(chunk, tokenizer.encode_batch(prompts)):
                if len(ids) > max_prompt_length:
                    skipped.append(SkippedRow(row[0], "prompt_too_long",
                                              f"{len(ids)} tokens > --max_prompt_length {max_prompt_length}"))
                else:
                    kept_ids.append(ids)
                    kept.append(row)
            bar.update(len(chunk))
    skipped.sort(key=lambda row: row.line)
    report, write = converter_report(source, read, skipped, len(kept), strict=strict,
                                     fix="check --dataset_type and the field names")
    if not write:
        return report

    prompt_ids = np.full((len(kept), max_prompt_length), pad_id, dtype=np.int32)
    for i, ids in enumerate(kept_ids):
        prompt_ids[i, :len(ids)] = ids
    if not output.parent.exists():
        output.parent.mkdir(parents=True)
    _write_mindrecord(output, prompt_ids, [len(ids) for ids in kept_ids], [r[2] for r in kept], [r[1] for r in kept],
                      overwrite)
    report.output_path = str(output)
    report.rows_written = len(kept)
    return report


def write_sft_rows(gsm8k_jsonl, out, *, limit: int = 0, offset: int = 0, style: str = DEFAULT_PROMPT_STYLE,
                   strict: bool = False, tools: Sequence[str] = ()) -> ConversionReport:
    """Write GSM8K's ``{"question", "answer"}`` rows (``read_records``: JSONL, parquet, a datasets folder)
    as conversational SFT rows (``sft_row``), atomically:
    the usable rows after the first ``offset``, at most ``limit`` (0 = all); returns the report.

    With ``tools`` (``("calculator",)``) each answer's ``<<48/2=24>>`` annotations become calculator calls and the
    calculator's results (``data.gsm8k_tools.tool_sft_row``: the completion a list of assistant and tool messages,
    the schemas as a ``tools`` column); an answer without annotations is kept as the plain row with the ``tools``
    column (counted in the summary).

    Bad rows (malformed JSON or not UTF-8, no question or answer, no numeric final answer after ``####``; with
    ``tools``, an annotation the calculator refuses or does not confirm) are skipped with their line and reason, as
    the mindrecord conversion skips them; with ``strict`` nothing is written when any is (``report.output_path`` is
    None)."""
    source = Path(gsm8k_jsonl)
    if not source.exists():
        raise MindRLHFError(f"input file not found: {source}; pass GSM8K question/answer rows (JSONL, parquet or a "
                            "datasets save_to_disk folder) with --data_path")
    if tools:
        from mindrlhf.data.gsm8k_tools import AnnotationError, calculator_box, tool_sft_row

        box = calculator_box(tools)
    records, skipped, read = read_records(source, "gsm8k", "question", "answer")
    if tools:
        converted: List[Tuple[int, dict, str]] = []
        for line, record, solution in records:
            if not isinstance(record["answer"], str):  # final_answer read a number: no annotation to turn
                record = {**record, "answer": str(record["answer"])}
            try:
                converted.append((line, tool_sft_row(record["question"], record["answer"], box, style), solution))
            except AnnotationError as bad:
                skipped.append(SkippedRow(line, bad.reason, bad.detail))
        records = converted
        skipped.sort(key=lambda row: row.line)
    else:
        records = [(line, sft_row(r["question"], r["answer"], style), solution) for line, r, solution in records]
    report, write = converter_report(source, read, skipped, len(records), strict=strict,
                                     fix="pass a GSM8K jsonl with question and answer ('... #### N') fields")
    if not write:
        return report
    rows = records[offset:offset + limit] if limit else records[offset:]
    if not rows:
        raise MindRLHFError(f"{source} has no rows after offset {offset} ({len(records)} usable rows); "
                            "lower --offset")
    lines = [json.dumps(row, ensure_ascii=False) for _, row, _ in rows]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(Path(out), "\n".join(lines) + "\n")
    report.output_path, report.rows_written = str(out), len(lines)
    if tools:
        kept_plain = sum(not row["completion"][0].get("tool_calls") for _, row, _ in rows)
        if kept_plain:
            from mindrlhf.data.gsm8k_tools import NO_ANNOTATION_WARNING

            report.warnings[NO_ANNOTATION_WARNING] = kept_plain
    return report


def sft_rows_main(argv=None) -> int:
    """``mindrlhf-data --sft``: GSM8K (question/answer jsonl) → conversational SFT rows for ``mindrlhf-sft`` (with
    ``--tools calculator``: tool-using ones, ``data.gsm8k_tools``)."""
    def run(args) -> int:
        p = argparse.ArgumentParser(prog="mindrlhf-data --sft", description=sft_rows_main.__doc__)
        p.add_argument("--output", required=True, help="the SFT jsonl to write (prompt/completion message lists)")
        p.add_argument("--data_path", default=None, help="GSM8K question/answer rows: a JSONL file, a .parquet "
                       "file or a datasets save_to_disk folder, verl's GSM8K layout included (default: the packaged "
                       "training sample)")
        p.add_argument("--limit", type=int, default=0, help="rows to write (0 = all)")
        p.add_argument("--offset", type=int, default=0, help="skip this many rows first")
        p.add_argument("--prompt_style", default=DEFAULT_PROMPT_STYLE, choices=sorted(PROMPT_STYLES),
                       help="system prompt style (as GRPO's prompt_style)")
        p.add_argument("--tools", choices=["calculator"], default=None,
                       help="write each answer's <<48/2=24>> calculator annotations as Hermes calls of the built-in "
                       "calculator and its results (assistant, tool, assistant ... messages, the tool's schema in a "
                       "'tools' column; mindrlhf-sft trains only the assistant turns), to teach the call format "
                       "before GRPO with tools: [calculator]; a row whose annotation the calculator refuses or "
                       "disagrees with is skipped and named; a row without annotations is kept without a call")
        p.add_argument("--strict", action="store_true", help="exit 1 without writing when any row is skipped")
        p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
        a = p.parse_args(args)
        if a.limit < 0 or a.offset < 0:
            raise MindRLHFError(f"--limit {a.limit} / --offset {a.offset} must be >= 0")
        if a.data_path and Path(a.output).resolve() == Path(a.data_path).resolve():  # --overwrite included
            raise MindRLHFError(f"--output {a.output} is the --data_path input; choose another --output")
        if Path(a.output).exists() and not a.overwrite:
            raise MindRLHFError(f"{a.output} exists; pass --overwrite to replace it, or choose another --output")
        source = a.data_path or GSM8K_TRAIN_SAMPLE
        report = write_sft_rows(source, a.output, limit=a.limit, offset=a.offset, style=a.prompt_style,
                                strict=a.strict, tools=[a.tools] if a.tools else [])
        # Each skipped row and the summary on stderr: stdout stays the one JSON line scripts read.
        for row in report.skipped:
            print(row, file=sys.stderr)
        print(report.summary(), file=sys.stderr)
        if a.strict and report.skipped:
            print(f"error: --strict: {len(report.skipped)} rows skipped; nothing written", file=sys.stderr)
            return 1
        print(json.dumps({"output": str(a.output), "rows": report.rows_written, "skipped": len(report.skipped),
                          "source": str(source)}))
        return 0

    return run_cli(run, argv)


def load_tokenizer(vocab_path: Optional[str], merges_file_path: Optional[str], tokenizer_config: Optional[str],
                   tokenizer_dir: Optional[str]) -> Tokenizer:
    """The tokenizer from a folder, or from vocab + merges (config: given, else the one next to the vocab)."""
    return resolve_tokenizer(None, tokenizer_dir, vocab_path, merges_file_path, tokenizer_config)


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of the converter."""
    parser = argparse.ArgumentParser(description="Convert a JSONL math dataset into a prompt mindrecord for GRPO.")
    parser.add_argument("--vocab_path", help="tokenizer vocab.json")
    parser.add_argument("--merges_file_path", help="tokenizer merges.txt")
    parser.add_argument("--tokenizer_config", default=None,
                        help="tokenizer_config.json with the chat template (default: the one next to --vocab_path)")
    parser.add_argument("--tokenizer_dir", default=None,
                        help="Hugging Face tokenizer folder, instead of --vocab_path/--merges_file_path")
    parser.add_argument("--file_path", required=True,
                        help="input rows: a JSONL file (one JSON object per line), a .parquet file or a datasets "
                             "save_to_disk folder; verl's GSM8K layout (prompt messages, reward_model.ground_truth, "
                             "extra_info) is read too")
    parser.add_argument("--output_path", required=True,
                        help="output .mindrecord file (a .db index is written beside it)")
    parser.add_argument("--max_prompt_length", type=int, default=320,
                        help="prompt ids are padded to this length; longer prompts are skipped (default: 320)")
    parser.add_argument("--dataset_type", choices=sorted(DATASET_FIELDS), default="gsm8k",
                        help="gsm8k: question/answer with '#### N'; openr1math: problem/answer (the final answer); "
                             "generic: --question_field/--answer_field, the answer taken as is")
    parser.add_argument("--question_field", default=None, help="JSON field holding the question (overrides the type's)")
    parser.add_argument("--answer_field", default=None, help="JSON field holding the answer (overrides the type's)")
    parser.add_argument("--prompt_style", choices=sorted(PROMPT_STYLES), default=DEFAULT_PROMPT_STYLE,
                        help="answer format the system prompt asks for: gsm8k (a last line '#### N'; reward "
                             "gsm8k_format) or tags (<think>…</think><answer>N</answer>; reward format) "
                             f"(default: {DEFAULT_PROMPT_STYLE})")
    parser.add_argument("--system_prompt", default=None,
                        help="system message of the chat prompt, replacing the --prompt_style one; '' for none")
    parser.add_argument("--no_chat_template", action="store_true", help="use the raw question as the prompt")
    parser.add_argument("--tools", nargs="+", default=[], metavar="TOOL",
                        help="show these tools in every prompt (the chat template renders their schemas), for a "
                             "GRPO run with the same --tools: built-ins by name (calculator) or "
                             "'package.module:function'")
    parser.add_argument("--strict", action="store_true", help="exit 1 without writing when any row is skipped")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    parser.add_argument("--no_progress", action="store_true", help="hide the progress bar")
    return parser


def _main(argv: Optional[Sequence[str]]) -> int:
    args = build_parser().parse_args(argv)
    schemas = None
    if args.tools:
        from mindrlhf.rollout_tools import ToolBox

        schemas = ToolBox(args.tools).schemas
    tokenizer = load_tokenizer(args.vocab_path, args.merges_file_path, args.tokenizer_config, args.tokenizer_dir)
    report = convert_to_mindrecord(
        args.file_path, args.output_path, tokenizer,
        max_prompt_length=args.max_prompt_length, dataset_type=args.dataset_type,
        question_field=args.question_field, answer_field=args.answer_field,
        system_prompt=(args.system_prompt if args.system_prompt is not None
                       else style_system_prompt(args.prompt_style)), use_chat_template=not args.no_chat_template,
        strict=args.strict, overwrite=args.overwrite, show_progress=not args.no_progress, tools=schemas,
    )
    for row in report.skipped:
        print(row, file=sys.stderr)
    print(report.summary())
    if args.strict and report.skipped:
        print(f"error: --strict: {len(report.skipped)} rows skipped; nothing written", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: run the converter; user errors print ``error: ...`` and return 2."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

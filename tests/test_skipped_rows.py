"""Issue 39, item 5: ``mindrlhf-sft``, ``-rm`` and ``-dpo`` name every row they skip. The readers kept each bad
row's file, line and reason, but the commands logged only the summary. Now the log names the first
``SKIPPED_ROWS_LOGGED`` rows of each file (``path:line: skipped (reason): detail``) and counts the rest, and
``output_dir/skipped_rows.jsonl`` lists all of them; training goes on with the good rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_runs import SUITE_RECOMPUTE
from mindrlhf.checkpoint.run_dir import RUN_OUTPUTS, clear_previous_run
from mindrlhf.data.report import REASONS, SKIPPED_ROWS_FILE
from mindrlhf.trainer.offline import SKIPPED_ROWS_LOGGED

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO / "mindrlhf" / "resources" / "gsm8k_train_sample.jsonl"
FILLER = 9  # bad rows after the named ones: more than SKIPPED_ROWS_LOGGED in all, so the log counts the rest


def _message(role: str, content: str) -> list:
    return [{"role": role, "content": content}]


def _data(stage: str, rows: list) -> tuple:
    """(train lines, valid lines, {train line: reason} of the named bad rows, {valid line: reason}) of ``stage``:
    conversational rows from the packaged GSM8K sample, 8 good train rows and 2 good valid rows, with bad ones
    between them."""
    if stage == "sft":
        good = [{"messages": _message("user", r["question"]) + _message("assistant", r["answer"])} for r in rows]
        bad = {"malformed_json": '{"messages": [{"role": "user", "content": "unterminated"',
               "missing_field": json.dumps({"prompt": "a prompt, and no messages"}),
               "unknown_role": json.dumps({"messages": _message("wizard", "abracadabra")
                                           + _message("assistant", "poof")})}
    else:
        good = [{"prompt": _message("user", r["question"]), "chosen": _message("assistant", r["answer"]),
                 "rejected": _message("assistant", r["answer"].replace("####", "#### 1"))} for r in rows]
        same = _message("assistant", rows[0]["answer"])
        bad = {"malformed_json": '{"prompt": [{"role": "user", "content": "unterminated"',
               "missing_field": json.dumps({"prompt": _message("user", "q"), "chosen": _message("assistant", "a")}),
               "unknown_role": json.dumps({"prompt": _message("wizard", "q"), "chosen": _message("assistant", "a"),
                                           "rejected": _message("assistant", "b")}),
               "identical_pair": json.dumps({"prompt": _message("user", "q"), "chosen": same, "rejected": same})}
    lines, named = [json.dumps(good[0]), json.dumps(good[1])], {}
    for reason, line in bad.items():
        lines.append(line)
        named[len(lines)] = reason
    lines += ["not json at all"] * FILLER + [json.dumps(g) for g in good[2:8]]
    valid = [json.dumps(good[8]), bad["unknown_role"], json.dumps(good[9])]
    return lines, valid, named, {2: "unknown_role"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, qwen_tokenizer_dir) -> Path:
    from mindrlhf.testing import add_tokenizer, make_tiny_qwen2

    return add_tokenizer(make_tiny_qwen2(tmp_path_factory.mktemp("skipped") / "model", seed=5), qwen_tokenizer_dir)


def _run(stage: str, argv: list) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", f"mindrlhf.{stage}", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "rm", "dpo"])
def test_every_skipped_row_is_named_in_the_log_and_listed_in_output_dir(stage, model_dir, tmp_path):
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:10]]
    train_lines, valid_lines, named, valid_named = _data(stage, rows)
    train, valid = tmp_path / "train.jsonl", tmp_path / "valid.jsonl"
    train.write_text("\n".join(train_lines) + "\n", encoding="utf-8")
    valid.write_text("\n".join(valid_lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    args = {"model": model_dir, "train_file": train, "valid_file": valid, "output_dir": out, "max_steps": 1,
            "batch_size": 4, "micro_batch_size": 2, "max_length": 512, "save_steps": 1, "seed": 3,
            "progress_bar": "false", **SUITE_RECOMPUTE}
    proc = _run(stage, [x for k, v in args.items() for x in (f"--{k}", str(v))])
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stderr

    # The log: each named bad row by file:line and reason, in file order, then a count of the rest.
    bad_lines = sorted(named) + list(range(len(named) + 3, len(named) + 3 + FILLER))
    for line, reason in named.items():
        assert f"{train}:{line}: skipped ({REASONS[reason]}): " in log, (line, reason, log[-3000:])
    shown = [n for n in bad_lines if f"{train}:{n}: skipped (" in log]
    assert shown == bad_lines[:SKIPPED_ROWS_LOGGED]
    listing = out / SKIPPED_ROWS_FILE
    more = len(bad_lines) - SKIPPED_ROWS_LOGGED
    assert f"... and {more} more (all in {listing})" in log
    key = "messages" if stage == "sft" else "prompt"
    assert f"{valid}:2: skipped ({REASONS['unknown_role']}): '{key}'[0] has role 'wizard'" in log
    if stage != "sft":
        assert "chosen and rejected are the same" in log
    kept = "8 kept (8 pairs)" if stage != "sft" else "8 kept"
    assert f"train_file: {train}: {len(train_lines)} rows read, {kept}, {len(bad_lines)} skipped" in log

    # The file: every skipped row of both files, as JSON objects, in the order they were read.
    listed = [json.loads(line) for line in listing.read_text(encoding="utf-8").splitlines()]
    assert [(r["path"], r["line"]) for r in listed] == [(str(train), n) for n in bad_lines] + [(str(valid), 2)]
    assert {r["line"]: r["reason"] for r in listed if r["path"] == str(train) and r["line"] in named} == named
    assert all(r["reason"] == "malformed_json" for r in listed[len(named):-1])
    assert listed[-1]["reason"] == valid_named[2] and "'wizard'" in listed[-1]["detail"]
    assert all(set(r) == {"path", "line", "reason", "detail"} and r["detail"] for r in listed)

    # Training went on with the good rows (and evaluated on the valid file's two good rows).
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1] and any(k.startswith("eval/") for k in metrics[-1])

    if stage == "sft":  # (once: the rule is OfflineTrainer's) a replacing run removes the listing, then writes its own
        train.write_text("\n".join(line for n, line in enumerate(train_lines, 1) if n not in bad_lines) + "\n",
                         encoding="utf-8")
        proc = _run(stage, [x for k, v in dict(args, overwrite_output_dir="true").items() for x in (f"--{k}", str(v))])
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert SKIPPED_ROWS_FILE in proc.stderr.split("removed the previous run from")[1].splitlines()[0]
        assert [json.loads(line)["path"] for line in listing.read_text().splitlines()] == [str(valid)]


def test_the_listing_is_a_run_output_that_overwrite_removes(tmp_path):
    """skipped_rows.jsonl belongs to the run: --overwrite_output_dir removes it with the run's other outputs
    (the new run then writes its own when training starts)."""
    assert SKIPPED_ROWS_FILE in RUN_OUTPUTS
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / SKIPPED_ROWS_FILE).write_text('{"path": "old.jsonl", "line": 3}\n')
    removed = clear_previous_run(out, out / "checkpoints")
    assert out / SKIPPED_ROWS_FILE in removed and not (out / SKIPPED_ROWS_FILE).exists()

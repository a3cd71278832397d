"""Metrics outputs: TensorBoard event records read back (TFRecord framing with masked CRC32C, Event
protobufs), the console line, trailing means and the curve PNGs."""
from __future__ import annotations

import json
import logging
import math

import pytest

from mindrlhf.errors import MindRLHFError
from mindrlhf.grpo import GRPO_CURVES
from mindrlhf.trainer.metrics import (
    MetricsLogger,
    TensorBoardWriter,
    console_line,
    read_metrics,
    rolling_mean,
    write_curves,
)
from tb_events import crc32c, read_events, scalar_steps


def test_event_file_round_trip(tmp_path):
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value: the reader below is right
    w = TensorBoardWriter(tmp_path / "tb")
    w.add_scalars(7, {"reward": 0.25, "loss": -1.5, "skip_me": "text", "flag": True})
    w.add_scalars(8, {"reward": 0.5})
    w.close()
    (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    events = read_events(path)
    assert events[0].file_version == "brain.Event:2"
    scalars = [(e.step, v.tag, v.simple_value) for e in events[1:] for v in e.summary.value]
    assert scalars == [(7, "reward", 0.25), (7, "loss", -1.5), (8, "reward", 0.5)]


def _write_rows(path, steps):
    path.write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in steps))


def test_a_torn_last_metrics_line_is_dropped_and_a_bad_middle_line_is_an_error(tmp_path, caplog):
    # A crash mid-write (a full disk) leaves half a line: resume must not be blocked by it (it was:
    # "metrics.jsonl:4: not JSON", and a fresh start was refused too).
    path = tmp_path / "metrics.jsonl"
    _write_rows(path, [1, 2, 3])
    with open(path, "a") as f:
        f.write('{"step": 4, "rew')
    with caplog.at_level(logging.WARNING, logger="mindrlhf.trainer.metrics"):
        assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert any("metrics.jsonl:4: dropping a torn last line" in r.getMessage() for r in caplog.records)
    # Resuming at step 3: the file is rewritten without the torn line, and later appends stay readable.
    logger = MetricsLogger(tmp_path, True, False, resume_step=3)
    logger.log(4, {"reward": 0.4})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]
    # Damage before the last line is not a torn write: an error naming the line.
    path.write_text(path.read_text().replace('{"step": 2', '{"step": 2,,', 1))
    with pytest.raises(MindRLHFError, match=r"metrics.jsonl:2: not JSON .*only a torn last line is dropped"):
        read_metrics(path)


def test_resume_rewrites_tensorboard_from_the_kept_metrics(tmp_path):
    # A resume that redoes steps used to append them to the events a second time (and an overwritten
    # run's events stayed): the events now always equal metrics.jsonl.
    _write_rows(tmp_path / "metrics.jsonl", [1, 2, 3])
    first = MetricsLogger(tmp_path, True, True, resume_step=0)  # a fresh start: nothing kept
    first.log(1, {"reward": 0.1})
    first.log(2, {"reward": 0.2})
    first.log(3, {"reward": 0.3})
    first.close()
    resumed = MetricsLogger(tmp_path, True, True, resume_step=2)  # steps 3.. are redone
    resumed.log(3, {"reward": 0.35})
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert scalar_steps(tmp_path / "tensorboard")["reward"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)),
                                                                 (3, pytest.approx(0.35))]


def test_console_line_shows_headline_metrics():
    line = console_line(3, {"reward": 0.5, "loss": 0.125, "step_time": 2.0, "other": 1.0})
    assert line == "step 3 | reward 0.5 | loss 0.125 | s 2"


def test_rolling_mean_and_curves(tmp_path):
    from matplotlib.image import imread

    assert rolling_mean([1.0, 3.0, float("nan"), 5.0], 2) == [1.0, 2.0, 3.0, 5.0]
    assert math.isnan(rolling_mean([float("nan")], 3)[0])
    rows = [{"step": i, "reward": 0.1 * i, "rewards/accuracy/mean": 0.05 * i} for i in range(1, 8)]
    rows.append({"step": 8, "reward": "nan"})  # non-finite values are logged as strings; plotted as gaps
    written = write_curves(rows, tmp_path, GRPO_CURVES)
    assert [p.name for p in written] == ["reward.png", "accuracy.png"]
    for p in written:
        img = imread(p)
        assert img.shape[:2] == (400, 640) and (img[..., :3] < 0.9).any()
    # No accuracy column: only the reward curve.
    assert [p.name for p in write_curves([{"step": 1, "reward": 0.5}], tmp_path / "b", GRPO_CURVES)] == ["reward.png"]
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporary files

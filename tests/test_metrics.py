"""Metrics outputs: TensorBoard event records read back (TFRecord framing with masked CRC32C, Event
protobufs), the console line, trailing means and the curve PNGs."""
from __future__ import annotations

import math
import struct


from mindrlhf.trainer.metrics import TensorBoardWriter, console_line, rolling_mean, write_curves


def _crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), bit by bit: the checksum TFRecord framing uses."""
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def test_event_file_round_trip(tmp_path):
    from tensorboardX.proto.event_pb2 import Event

    assert _crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value: the reader below is right
    w = TensorBoardWriter(tmp_path / "tb")
    w.add_scalars(7, {"reward": 0.25, "loss": -1.5, "skip_me": "text", "flag": True})
    w.add_scalars(8, {"reward": 0.5})
    w.close()
    (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    data, i, events = path.read_bytes(), 0, []
    while i < len(data):
        header = data[i:i + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[i + 8:i + 12])[0] == _masked(header)
        body = data[i + 12:i + 12 + length]
        assert struct.unpack("<I", data[i + 12 + length:i + 16 + length])[0] == _masked(body)
        events.append(Event.FromString(body))
        i += 16 + length
    assert events[0].file_version == "brain.Event:2"
    scalars = [(e.step, v.tag, v.simple_value) for e in events[1:] for v in e.summary.value]
    assert scalars == [(7, "reward", 0.25), (7, "loss", -1.5), (8, "reward", 0.5)]


def test_console_line_shows_headline_metrics():
    line = console_line(3, {"reward": 0.5, "loss": 0.125, "step_time": 2.0, "other": 1.0})
    assert line == "step 3 | reward 0.5 | loss 0.125 | s 2"


def test_rolling_mean_and_curves(tmp_path):
    from matplotlib.image import imread

    assert rolling_mean([1.0, 3.0, float("nan"), 5.0], 2) == [1.0, 2.0, 3.0, 5.0]
    assert math.isnan(rolling_mean([float("nan")], 3)[0])
    rows = [{"step": i, "reward": 0.1 * i, "rewards/accuracy/mean": 0.05 * i} for i in range(1, 8)]
    rows.append({"step": 8, "reward": "nan"})  # non-finite values are logged as strings; plotted as gaps
    written = write_curves(rows, tmp_path)
    assert [p.name for p in written] == ["reward.png", "accuracy.png"]
    for p in written:
        img = imread(p)
        assert img.shape[:2] == (400, 640) and (img[..., :3] < 0.9).any()
    # No accuracy column: only the reward curve.
    assert [p.name for p in write_curves([{"step": 1, "reward": 0.5}], tmp_path / "b")] == ["reward.png"]
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporary files

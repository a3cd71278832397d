"""The hand-rolled TensorBoard writer: CRC32C against the standard check value, TFRecord framing,
and the scalar Event protobuf decoded back field by field."""
from __future__ import annotations

import struct

from mindrlhf.trainer.metrics import TensorBoardWriter, _masked_crc, console_line, crc32c


def _varint(buf: bytes, i: int):
    shift = value = 0
    while True:
        b = buf[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes) -> dict:
    """Decode one protobuf message into {field number: [values]} (wire types 0, 1, 2, 5)."""
    out, i = {}, 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _varint(buf, i)
        elif wire == 1:
            v, i = struct.unpack("<d", buf[i:i + 8])[0], i + 8
        elif wire == 5:
            v, i = struct.unpack("<f", buf[i:i + 4])[0], i + 4
        else:
            n, i = _varint(buf, i)
            v, i = buf[i:i + n], i + n
        out.setdefault(num, []).append(v)
    return out


def test_crc32c_check_value():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C (Castagnoli) check value


def test_event_file_round_trip(tmp_path):
    w = TensorBoardWriter(tmp_path)
    w.add_scalars(7, {"reward": 0.25, "loss": -1.5, "skip_me": "text"})
    w.close()
    data = w.path.read_bytes()
    records, i = [], 0
    while i < len(data):
        header = data[i:i + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[i + 8:i + 12])[0] == _masked_crc(header)
        body = data[i + 12:i + 12 + length]
        assert struct.unpack("<I", data[i + 12 + length:i + 16 + length])[0] == _masked_crc(body)
        records.append(_fields(body))
        i += 16 + length
    assert records[0][3] == [b"brain.Event:2"]  # file_version event first
    scalars = {}
    for ev in records[1:]:
        assert ev[2] == [7]
        value = _fields(_fields(ev[5][0])[1][0])
        scalars[value[1][0].decode()] = value[2][0]
    assert scalars == {"reward": 0.25, "loss": -1.5}


def test_console_line_shows_headline_metrics():
    line = console_line(3, {"reward": 0.5, "loss": 0.125, "step_time": 2.0, "other": 1.0})
    assert line == "step 3 | reward 0.5 | loss 0.125 | s 2"


def test_rolling_mean_and_curves(tmp_path):
    import math

    from mindrlhf.trainer.metrics import rolling_mean, write_curves
    from mindrlhf.utils.plot import read_png

    assert rolling_mean([1.0, 3.0, float("nan"), 5.0], 2) == [1.0, 2.0, 3.0, 5.0]
    assert math.isnan(rolling_mean([float("nan")], 3)[0])
    rows = [{"step": i, "reward": 0.1 * i, "rewards/accuracy/mean": 0.05 * i} for i in range(1, 8)]
    rows.append({"step": 8, "reward": "nan"})  # non-finite values are logged as strings; plotted as gaps
    written = write_curves(rows, tmp_path)
    assert [p.name for p in written] == ["reward.png", "accuracy.png"]
    for p in written:
        img = read_png(p)
        assert img.ndim == 3 and img.shape[2] == 3 and (img != 255).any()
    # No accuracy column: only the reward curve.
    assert [p.name for p in write_curves([{"step": 1, "reward": 0.5}], tmp_path / "b")] == ["reward.png"]

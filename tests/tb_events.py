"""Reading TensorBoard event files back in tests: TFRecord framing (masked CRC-32C checked) and
tensorboardX's Event protobufs. No TensorBoard install needed."""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Dict, List, Tuple


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), bit by bit: the checksum TFRecord framing uses."""
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(path: Path) -> list:
    """The Event records of one event file, each record's framing checksums verified."""
    from tensorboardX.proto.event_pb2 import Event

    data, i, events = Path(path).read_bytes(), 0, []
    while i < len(data):
        header = data[i:i + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[i + 8:i + 12])[0] == _masked(header)
        body = data[i + 12:i + 12 + length]
        assert struct.unpack("<I", data[i + 12 + length:i + 16 + length])[0] == _masked(body)
        events.append(Event.FromString(body))
        i += 16 + length
    return events


def scalar_steps(logdir: Path) -> Dict[str, List[Tuple[int, float]]]:
    """tag -> [(step, value), ...] over every event file under ``logdir``, in file then record order."""
    out: Dict[str, List[Tuple[int, float]]] = {}
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        for event in read_events(path):
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out

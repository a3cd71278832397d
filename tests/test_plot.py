"""The dependency-free PNG line-chart writer: PNG structure, pixel geometry, validation."""
from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import pytest

from mindrlhf.utils.plot import FRAME, PALETTE, PNG_SIGNATURE, encode_png, line_chart_png, read_png

WIDTH, HEIGHT = 480, 300


def _chunks(data: bytes):
    """Split a PNG into (tag, body, stored_crc) without the module's own parser."""
    assert data[:8] == PNG_SIGNATURE == b"\x89PNG\r\n\x1a\n"
    pos, out = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        out.append((tag, body, crc))
        pos += 12 + length
    return out


def _plot_area(img: np.ndarray):
    """Locate the frame: the rows/columns mostly painted in the frame colour."""
    is_frame = np.all(img == FRAME, axis=2)
    rows = np.flatnonzero(is_frame.sum(axis=1) > img.shape[1] // 2)
    cols = np.flatnonzero(is_frame.sum(axis=0) > img.shape[0] // 3)
    assert len(rows) == 2 and len(cols) == 2, (rows, cols)
    return rows[0], rows[1], cols[0], cols[1]


def _colour_pixels(img: np.ndarray, colour, area):
    top, bottom, left, right = area
    ys, xs = np.nonzero(np.all(img[top:bottom + 1, left:right + 1] == colour, axis=2))
    return ys + top, xs + left


def test_two_series_png_structure(tmp_path):
    path = tmp_path / "nested" / "dir" / "reward.png"  # parent directories are created
    steps = list(range(1, 41))
    rewards = [0.3 + 0.01 * s + 0.05 * math.sin(s) for s in steps]
    smooth = [float(np.mean(rewards[max(0, i - 4):i + 1])) for i in range(len(rewards))]
    line_chart_png(path, {"reward": (steps, rewards), "reward (5-step mean)": (steps, smooth)},
                   title="Reward", xlabel="step", ylabel="reward", width=WIDTH, height=HEIGHT,
                   band={"reward (5-step mean)": (steps, [v - 0.02 for v in smooth], [v + 0.02 for v in smooth])})
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    chunks = _chunks(data)
    assert [c[0] for c in chunks][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    for tag, body, crc in chunks:
        assert zlib.crc32(tag + body) & 0xFFFFFFFF == crc, tag
    w, h, depth, colour_type, compression, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (w, h, depth, colour_type, compression, filt, interlace) == (WIDTH, HEIGHT, 8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(body for tag, body, _ in chunks if tag == b"IDAT"))
    assert len(raw) == HEIGHT * (1 + 3 * WIDTH)
    assert all(raw[y * (1 + 3 * WIDTH)] == 0 for y in range(HEIGHT))  # filter byte 0 on every scanline

    img = read_png(path)
    assert img.shape == (HEIGHT, WIDTH, 3) and img.dtype == np.uint8
    area = _plot_area(img)
    for colour in PALETTE[:2]:
        assert len(_colour_pixels(img, colour, area)[0]) > 100
    assert not list(tmp_path.glob("nested/dir/*.tmp"))  # the atomic-write temp file is gone


def test_horizontal_line_is_a_thin_band_in_the_middle(tmp_path):
    xs = list(range(11))
    # Two isolated points pin the y range to exactly [0, 1] without drawing a line across it.
    bounds = [0.0] + [None] * 9 + [1.0]
    line_chart_png(tmp_path / "flat.png", {"flat": (xs, [0.5] * 11), "bounds": (xs, bounds)},
                   width=WIDTH, height=HEIGHT)
    img = read_png(tmp_path / "flat.png")
    top, bottom, left, right = area = _plot_area(img)
    ys, xs_px = _colour_pixels(img, PALETTE[0], area)
    assert len(ys) > 0.8 * (right - left)  # spans (nearly) the whole width
    assert ys.max() - ys.min() <= 1  # at most 2 px thick
    assert abs(ys.mean() - (top + bottom) / 2) <= 2  # y = 0.5 sits halfway up a [0, 1] axis
    assert xs_px.min() - left <= 6 and right - xs_px.max() <= 6  # data is inset a few px from the frame


def test_rising_series_goes_up(tmp_path):
    xs = np.linspace(0, 10, 50)
    line_chart_png(tmp_path / "rise.png", {"rise": (xs, 2 * xs + 1)}, title="rising", width=WIDTH, height=HEIGHT)
    img = read_png(tmp_path / "rise.png")
    top, bottom, left, right = area = _plot_area(img)
    ys, xs_px = _colour_pixels(img, PALETTE[0], area)
    mid = (left + right) / 2
    left_rows, right_rows = ys[xs_px < mid], ys[xs_px >= mid]
    assert len(left_rows) and len(right_rows)
    assert left_rows.mean() > right_rows.mean() + (bottom - top) / 4  # image rows grow downwards


@pytest.mark.parametrize("shape", [(1, 1, 3), (7, 13, 3), (64, 33, 3)])
def test_png_round_trip(tmp_path, shape):
    image = np.random.default_rng(sum(shape)).integers(0, 256, size=shape, dtype=np.uint8)
    path = tmp_path / "rt.png"
    path.write_bytes(encode_png(image))
    np.testing.assert_array_equal(read_png(path), image)


def _filter_line(kind: int, line: bytes, prev: bytes) -> bytes:
    """Reference PNG filters (spec section 9) to check read_png decodes all five."""
    out = bytearray()
    for i, x in enumerate(line):
        a, b, c = (line[i - 3], prev[i], prev[i - 3]) if i >= 3 else (0, prev[i], 0)
        p = a + b - c
        paeth = min((abs(p - a), 0, a), (abs(p - b), 1, b), (abs(p - c), 2, c))[2]
        out.append((x - (0, a, b, (a + b) // 2, paeth)[kind]) & 0xFF)
    return bytes(out)


def test_read_png_handles_all_filter_types(tmp_path):
    h, w = 10, 6
    image = np.random.default_rng(7).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    raw, prev = bytearray(), bytes(3 * w)
    for y in range(h):
        line = image[y].tobytes()
        kind = y % 5
        raw += bytes([kind]) + _filter_line(kind, line, prev)
        prev = line

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    png = (PNG_SIGNATURE + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(bytes(raw))) + chunk(b"IEND", b""))
    (tmp_path / "f.png").write_bytes(png)
    np.testing.assert_array_equal(read_png(tmp_path / "f.png"), image)

    corrupt = bytearray(png)
    corrupt[-20] ^= 0xFF  # inside the IDAT data: its CRC no longer matches
    (tmp_path / "bad.png").write_bytes(bytes(corrupt))
    with pytest.raises(ValueError, match="CRC"):
        read_png(tmp_path / "bad.png")


def test_mismatched_lengths_name_the_series(tmp_path):
    with pytest.raises(ValueError, match=r"'policy loss'.*3.*2"):
        line_chart_png(tmp_path / "x.png", {"ok": ([1, 2], [1, 2]), "policy loss": ([1, 2, 3], [1, 2])})
    with pytest.raises(ValueError, match="'kl band'"):
        line_chart_png(tmp_path / "x.png", {"kl": ([1, 2], [1, 2])}, band={"kl band": ([1, 2], [0, 1], [2])})
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("size", [(199, 300), (300, 149)])
def test_too_small_canvas(tmp_path, size):
    with pytest.raises(ValueError, match="200x150"):
        line_chart_png(tmp_path / "x.png", {"a": ([0, 1], [0, 1])}, width=size[0], height=size[1])


@pytest.mark.parametrize(
    "series",
    [
        {"gappy": ([0, 1, 2, 3, 4, 5], [1.0, float("nan"), None, 2.0, 3.0, float("nan")])},
        {"empty": ([], [])},
        {"all nan": ([1, 2, 3], [float("nan")] * 3)},
        {"single": ([5], [0.25])},
        {"flat": ([1, 2, 3], [7, 7, 7]), "big": ([1e6, 2e6], [1e-5, 3e-5])},
        {},
    ],
    ids=["gaps", "empty", "all-nan", "single", "odd-ranges", "no-series"],
)
def test_degenerate_inputs_still_write_a_chart(tmp_path, series):
    line_chart_png(tmp_path / "c.png", series, title="Odd ±{~} data", xlabel="x", ylabel="y")
    img = read_png(tmp_path / "c.png")
    assert img.shape == (400, 640, 3)
    area = _plot_area(img)  # axes and frame are drawn regardless
    if "single" in series:
        ys, _ = _colour_pixels(img, PALETTE[0], area)
        assert len(ys) >= 9  # a visible marker, not a lone pixel
    if "gappy" in series:
        ys, xs = _colour_pixels(img, PALETTE[0], area)
        top, bottom, left, right = area
        # x = 1..3 is a gap in the data: no line crosses the middle of it.
        assert not np.any(np.abs(xs - (left + 2 * (right - left) / 5)) <= 2)

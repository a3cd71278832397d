"""Dependency-free PNG line charts (stdlib + numpy) for training curves.

Kept free of matplotlib/PIL so minimal installs and headless CI can still write
reward/loss plots next to their metrics files.
"""
from __future__ import annotations

import contextlib
import math
import os
import struct
import tempfile
import zlib
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

PALETTE = ((31, 119, 180), (230, 110, 0), (44, 160, 44), (214, 39, 40))
FRAME = (90, 90, 90)
TEXT = (30, 30, 30)
GRID = (228, 228, 228)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_BAND_ALPHA = 0.28  # light enough that lines and grid stay readable through a band

# 5x7 glyphs: the character, then its 7 rows as two hex digits each (0x10 = leftmost pixel).
_FONT_SRC = """
00E11131519110E 1040C040404040E 20E11010204081F 31F02040201110E 402060A121F0202
51F101E0101110E 60608101E11110E 71F010204080808 80E11110E11110E 90E11110F01020C
A0E11111F111111 B1E11111E11111E C0E11101010110E D1C12111111121C E1F10101E10101F
F1F10101E101010 G0E11101711110F H1111111F111111 I0E04040404040E J0702020202120C
K11121418141211 L1010101010101F M111B1515111111 N11111915131111 O0E11111111110E
P1E11111E101010 Q0E11111115120D R1E11111E141211 S0F10100E01011E T1F040404040404
U1111111111110E V11111111110A04 W1111111515150A X11110A040A1111 Y11110A04040404
Z1F01020408101F a00000E010F110F b1010161911111E c00000E1010110E d01010D1311110F
e00000E111F100E f0609081C080808 g00000F110F010E h10101619111111 i04000C0404040E
j0200060202120C k10101214181412 l0C04040404040E m00001A15151111 n00001619111111
o00000E1111110E p00001E111E1010 q00000D130F0101 r00001619101010 s00000E100E011E
t08081C08080906 u0000111111130D v00001111110A04 w0000111115150A x0000110A040A11
y000011110F010E z00001F0204081F .00000000000C0C ,000000000C0408 -0000001F000000
+0004041F040400 /00010204081000 (02040808080402 )08040202020408 :000C0C000C0C00
_0000000000001F %18190204081303 =00001F001F0000 ±04041F0404001F !04040404040004
?0E110102040004 '04040800000000 [0E08080808080E ]0E02020202020E *0004150E150400
<02040810080402 >08040201020408 |04040404040404
"""


def _bits(rows: bytes) -> np.ndarray:
    return ((np.frombuffer(rows, np.uint8)[:, None] >> np.arange(4, -1, -1)) & 1).astype(bool)


_FONT = {tok[0]: _bits(bytes.fromhex(tok[1:])) for tok in _FONT_SRC.split()}
_FONT[" "] = np.zeros((7, 5), bool)
_BOX = _bits(bytes.fromhex("001F1111111F00"))  # stand-in for characters the font lacks

PathLike = Union[str, os.PathLike]
Rect = Tuple[int, int, int, int]  # x0, y0, x1, y1 inclusive


def text_width(text: str, scale: int = 1) -> int:
    """Pixel width of ``text`` in the built-in 5x7 font (6 px advance per glyph)."""
    return max(0, len(text) * 6 * scale - scale)


def _draw_text(img: np.ndarray, x: int, y: int, text: str, colour=TEXT, scale: int = 1) -> None:
    for i, ch in enumerate(text):
        mask = _FONT.get(ch, _BOX)
        if scale > 1:
            mask = np.kron(mask, np.ones((scale, scale), bool))
        _blit(img, x + i * 6 * scale, y, mask, colour)


def _blit(img: np.ndarray, x: int, y: int, mask: np.ndarray, colour) -> None:
    # Clip instead of raising: a label hanging over the canvas edge should just be cut.
    x0, y0 = max(x, 0), max(y, 0)
    x1, y1 = min(x + mask.shape[1], img.shape[1]), min(y + mask.shape[0], img.shape[0])
    if x0 < x1 and y0 < y1:
        img[y0:y1, x0:x1][mask[y0 - y:y1 - y, x0 - x:x1 - x]] = colour


def _fill(img: np.ndarray, x0: int, y0: int, x1: int, y1: int, colour) -> None:
    img[max(y0, 0):max(y1 + 1, 0), max(x0, 0):max(x1 + 1, 0)] = colour


def _nice_ticks(lo: float, hi: float, target: int = 5) -> Tuple[List[float], float]:
    """Ticks on a 1/2/5 x 10^k grid whose ends enclose [lo, hi]; also returns the step."""
    if hi - lo <= 1e-12 * max(1.0, abs(lo)):  # a flat series still needs a non-empty axis
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / target
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw * (1 - 1e-9))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [i * step for i in range(first, last + 1)], step


def _axis(lo: float, hi: float, target: int) -> Tuple[List[float], List[str]]:
    ticks, step = _nice_ticks(lo, hi, target)
    return ticks, [_fmt(v, step) for v in ticks]


def _fmt(value: float, step: float) -> str:
    if abs(value) < step * 1e-6:
        return "0"  # avoids "-0.0" and 1e-17 rounding residue
    if step >= 1e-4 and abs(value) < 1e7:
        return f"{value:.{max(0, -math.floor(math.log10(step) + 1e-9))}f}"
    return f"{value:.3g}"


def _arrays(label: str, **columns: Sequence[Optional[float]]) -> List[np.ndarray]:
    """Convert equally long 1-D columns to float arrays (None -> NaN), naming ``label`` on error."""
    arrays = {name: np.asarray(list(col), dtype=float) for name, col in columns.items()}
    if any(a.ndim != 1 for a in arrays.values()) or len({len(a) for a in arrays.values()}) > 1:
        shapes = ", ".join(f"len({k})={a.shape[0] if a.ndim == 1 else a.shape}" for k, a in arrays.items())
        raise ValueError(f"series {label!r}: expected 1-D sequences of equal length, got {shapes}")
    return list(arrays.values())


def _stamp(img: np.ndarray, xs: np.ndarray, ys: np.ndarray, colour, clip: Rect, size: int = 2) -> None:
    """Paint a size x size square at each pixel, keeping only what falls inside ``clip``."""
    x0, y0, x1, y1 = clip
    for dx in range(size):
        for dy in range(size):
            px, py = xs + dx, ys + dy
            ok = (px >= x0) & (px <= x1) & (py >= y0) & (py <= y1)
            img[py[ok], px[ok]] = colour


def _polyline(img: np.ndarray, px: np.ndarray, py: np.ndarray, ok: np.ndarray, colour, clip: Rect) -> None:
    idx = np.flatnonzero(ok)
    # Split at invalid points so gaps stay gaps instead of being bridged.
    for run in np.split(idx, np.flatnonzero(np.diff(idx) > 1) + 1):
        if len(run) == 1:  # nothing to connect: a 5x5 marker keeps the point visible
            _stamp(img, px[run] - 2, py[run] - 2, colour, clip, size=5)
        for a, b in zip(run[:-1], run[1:]):
            n = max(abs(px[b] - px[a]), abs(py[b] - py[a])) + 1
            xs = np.rint(np.linspace(px[a], px[b], n)).astype(int)
            ys = np.rint(np.linspace(py[a], py[b], n)).astype(int)
            _stamp(img, xs, ys, colour, clip)


def _fill_band(
    img: np.ndarray, px: np.ndarray, lo: np.ndarray, hi: np.ndarray, ok: np.ndarray, colour, clip: Rect
) -> None:
    mask = np.zeros(img.shape[:2], bool)
    rows = np.arange(img.shape[0])[:, None]
    for i in np.flatnonzero(ok):
        j = i + 1 if i + 1 < len(ok) and ok[i + 1] else i  # isolated points become one column
        cols = np.arange(min(px[i], px[j]), max(px[i], px[j]) + 1)
        t = (cols - px[i]) / (px[j] - px[i]) if px[j] != px[i] else np.zeros(len(cols))
        r_lo, r_hi = lo[i] + t * (lo[j] - lo[i]), hi[i] + t * (hi[j] - hi[i])
        top, bot = np.rint(np.minimum(r_lo, r_hi)), np.rint(np.maximum(r_lo, r_hi))
        mask[:, cols] |= (rows >= top) & (rows <= bot)
    x0, y0, x1, y1 = clip
    view, mask = img[y0:y1 + 1, x0:x1 + 1], mask[y0:y1 + 1, x0:x1 + 1]
    # Blend once per pixel so overlapping segments do not darken; the grid shows through.
    view[mask] = _tint(view[mask], colour)


def _tint(under: np.ndarray, colour) -> np.ndarray:
    return (under * (1 - _BAND_ALPHA) + np.array(colour) * _BAND_ALPHA).astype(np.uint8)


def _legend_rows(entries: List[Tuple[str, tuple, bool]], max_w: int) -> Tuple[List[list], int]:
    """Wrap (label, colour, is_band) entries into rows at most ``max_w`` wide; return rows and box width."""
    rows: List[list] = []
    widths: List[int] = []
    for label, colour, is_band in entries:
        if 20 + text_width(label) > max_w:  # shorten rather than push the box off the canvas
            label = label[:max(1, (max_w - 20) // 6 - 2)] + ".."
        entry, w = (label, colour, is_band), 20 + text_width(label)  # swatch, gap, text
        if rows and widths[-1] + 12 + w <= max_w:
            rows[-1].append(entry)
            widths[-1] += 12 + w
        else:
            rows.append([entry])
            widths.append(w)
    return rows, max(widths, default=0) + 10


def _draw_legend(img: np.ndarray, rows: List[list], lx: int, ly: int, right: int) -> None:
    _fill(img, lx, ly, right, ly + len(rows) * 11 + 6, FRAME)
    _fill(img, lx + 1, ly + 1, right - 1, ly + len(rows) * 11 + 5, (255, 255, 255))
    for r, row in enumerate(rows):
        x, y = lx + 6, ly + 4 + 11 * r
        for label, colour, is_band in row:
            if is_band:
                _fill(img, x, y, x + 14, y + 6, tuple(int(v) for v in _tint(np.full(3, 255.0), colour)))
            else:
                _fill(img, x, y + 2, x + 14, y + 4, colour)
            _draw_text(img, x + 20, y, label)
            x += 32 + text_width(label)


def line_chart_png(
    path: PathLike,
    series: Mapping[str, Tuple[Sequence[float], Sequence[Optional[float]]]],
    *,
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
    width: int = 640,
    height: int = 400,
    band: Optional[Mapping[str, Tuple[Sequence[float], Sequence[float], Sequence[float]]]] = None,
) -> None:
    """Write a line chart of ``series`` (label -> (xs, ys)) to ``path`` as a PNG.

    NaN/None values leave gaps; ``band`` (label -> (xs, lo, hi)) adds shaded ranges,
    coloured like the series of the same label when there is one.
    """
    if width < 200 or height < 150:
        raise ValueError(f"chart must be at least 200x150 pixels, got {width}x{height}")
    if len(series) > len(PALETTE):
        raise ValueError(f"at most {len(PALETTE)} series are supported, got {len(series)}")
    lines = []
    for label, (xs, ys) in series.items():
        x, y = _arrays(label, xs=xs, ys=ys)
        lines.append((label, PALETTE[len(lines)], x, y))
    colours = {label: colour for label, colour, _, _ in lines}
    bands = []
    for k, (label, (xs, lo, hi)) in enumerate((band or {}).items()):
        x, low, high = _arrays(label, xs=xs, lo=lo, hi=hi)
        bands.append((label, colours.get(label, PALETTE[(len(lines) + k) % len(PALETTE)]), x, low, high))

    all_x = np.concatenate([np.zeros(0)] + [ln[2] for ln in lines] + [b[2] for b in bands])
    all_y = np.concatenate([np.zeros(0)] + [ln[3] for ln in lines] + [b[3] for b in bands] + [b[4] for b in bands])
    fx, fy = all_x[np.isfinite(all_x)], all_y[np.isfinite(all_y)]
    x_range = (fx.min(), fx.max()) if fx.size else (0.0, 1.0)
    y_range = (fy.min(), fy.max()) if fy.size else (0.0, 1.0)

    # Layout, top to bottom: title, legend box (ylabel beside it when it fits), plot, ticks, xlabel.
    pad, inset = 8, 4  # the inset keeps data at the axis limits off the frame line
    yticks, ylabels = _axis(*y_range, 5)  # provisional: may be thinned once the plot height is known
    left = pad + max(text_width(s) for s in ylabels) + 8
    for target in (5, 4, 3, 2):  # fewer x ticks until their labels stop colliding
        xticks, xlabels = _axis(*x_range, target)
        right = width - 1 - max(pad + 4, text_width(xlabels[-1]) // 2 + pad)
        plot_w = right - left
        if (plot_w - 2 * inset) / (len(xticks) - 1) >= max(map(text_width, xlabels)) + 6:
            break
    entries = [(lb, c, False) for lb, c, _, _ in lines] + [(b[0], b[1], True) for b in bands if b[0] not in colours]
    rows, legend_w = _legend_rows(entries, plot_w - 10)
    legend_h = len(rows) * 11 + 6 if rows else 0
    title_scale = 2 if text_width(title, 2) <= width - 2 * pad else 1
    top = pad + (7 * title_scale + 6 if title else 0)
    ylabel_h = 12 if ylabel else 0
    side_by_side = bool(rows and ylabel) and text_width(ylabel) + 12 + legend_w <= plot_w
    top += max(legend_h + 4, ylabel_h) if side_by_side else (legend_h + 4 if rows else 0) + ylabel_h
    top = max(top, pad + 4)
    bottom = height - 1 - pad - (13 if xlabel else 0) - 15
    if bottom - top < 20 + 2 * inset:
        raise ValueError(f"a {width}x{height} chart has no room left for the plot after its title and legend")
    for target in (5, 4, 3, 2):  # fewer y ticks while labels (7 px tall) would touch
        yticks, ylabels = _axis(*y_range, target)
        if (bottom - top - 2 * inset) / (len(yticks) - 1) >= 13:
            break
    clip = (left + 1, top + 1, right - 1, bottom - 1)  # series never overwrite the frame

    img = np.full((height, width, 3), 255, np.uint8)

    def to_px(x: np.ndarray) -> np.ndarray:
        span = plot_w - 2 * inset
        return np.rint(left + inset + (x - xticks[0]) / (xticks[-1] - xticks[0]) * span).astype(int)

    def to_py(y: np.ndarray) -> np.ndarray:
        span = bottom - top - 2 * inset
        return np.rint(bottom - inset - (y - yticks[0]) / (yticks[-1] - yticks[0]) * span).astype(int)

    for x, s in zip(to_px(np.array(xticks)), xlabels):
        _fill(img, x, top + 1, x, bottom - 1, GRID)
        _fill(img, x, bottom + 1, x, bottom + 4, FRAME)
        _draw_text(img, x - text_width(s) // 2, bottom + 8, s)
    for y, s in zip(to_py(np.array(yticks)), ylabels):
        _fill(img, left + 1, y, right - 1, y, GRID)
        _fill(img, left - 4, y, left - 1, y, FRAME)
        _draw_text(img, left - 7 - text_width(s), y - 3, s)
    for _, colour, x, lo, hi in bands:
        ok = np.isfinite(x) & np.isfinite(lo) & np.isfinite(hi)
        px, py_lo, py_hi = to_px(np.where(ok, x, 0)), to_py(np.where(ok, lo, 0)), to_py(np.where(ok, hi, 0))
        _fill_band(img, px, py_lo, py_hi, ok, colour, clip)
    for x0, y0, x1, y1 in ((left, top, right, top), (left, bottom, right, bottom),
                           (left, top, left, bottom), (right, top, right, bottom)):
        _fill(img, x0, y0, x1, y1, FRAME)
    for _, colour, x, y in lines:
        ok = np.isfinite(x) & np.isfinite(y)  # masked values are mapped as 0 but never drawn
        _polyline(img, to_px(np.where(ok, x, 0)), to_py(np.where(ok, y, 0)), ok, colour, clip)

    if rows:
        _draw_legend(img, rows, right - legend_w, top - 4 - ylabel_h * (not side_by_side) - legend_h, right)
    if title:
        _draw_text(img, (width - text_width(title, title_scale)) // 2, pad, title, scale=title_scale)
    if ylabel:
        _draw_text(img, left, top - 11, ylabel)
    if xlabel:
        _draw_text(img, left + (plot_w - text_width(xlabel)) // 2, bottom + 20, xlabel)
    _write_atomic(Path(path), encode_png(img))


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def encode_png(image: np.ndarray) -> bytes:
    """Encode an (H, W, 3) uint8 array as an 8-bit RGB PNG (filter 0 on every scanline)."""
    img = np.ascontiguousarray(image)
    if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3 or 0 in img.shape:
        raise ValueError(f"expected a non-empty (H, W, 3) uint8 array, got {img.dtype} {img.shape}")
    h, w = img.shape[:2]
    raw = np.concatenate([np.zeros((h, 1), np.uint8), img.reshape(h, w * 3)], axis=1).tobytes()
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 6)) + _chunk(b"IEND", b"")


def _unfilter(kind: int, line: np.ndarray, prev: np.ndarray) -> np.ndarray:
    if kind == 0:
        return line
    if kind == 1:  # Sub is a running sum per channel
        return (np.cumsum(line.reshape(-1, 3), axis=0, dtype=np.int64) % 256).astype(np.uint8).ravel()
    if kind == 2:
        return line + prev  # uint8 arithmetic wraps mod 256 as the spec requires
    if kind not in (3, 4):
        raise ValueError(f"unknown PNG filter type {kind}")
    cur, up = bytearray(line.tobytes()), prev.tobytes()
    for i in range(len(cur)):  # Average/Paeth depend on the byte just decoded: no vector form
        a, b, c = (cur[i - 3], up[i], up[i - 3]) if i >= 3 else (0, up[i], 0)
        if kind == 3:
            pred = (a + b) // 2
        else:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
        cur[i] = (cur[i] + pred) & 0xFF
    return np.frombuffer(bytes(cur), np.uint8)


def read_png(path: PathLike) -> np.ndarray:
    """Decode an 8-bit RGB, non-interlaced PNG (any standard filter) to an (H, W, 3) uint8 array."""
    data = Path(path).read_bytes()
    if not data.startswith(PNG_SIGNATURE):
        raise ValueError(f"{path}: not a PNG file")
    pos, header, idat = len(PNG_SIGNATURE), None, []
    while pos + 12 <= len(data):
        length, tag = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length].rjust(4, b"\0"))
        if len(body) != length or zlib.crc32(tag + body) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: corrupt {tag!r} chunk (bad length or CRC)")
        if tag == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif tag == b"IDAT":
            idat.append(body)
        elif tag == b"IEND":
            break
        pos += 12 + length
    if header is None or not idat:
        raise ValueError(f"{path}: missing IHDR or IDAT chunk")
    w, h, depth, colour_type, _, _, interlace = header
    if (depth, colour_type, interlace) != (8, 2, 0):
        raise ValueError(f"{path}: only 8-bit RGB non-interlaced PNGs are supported")
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8)
    if raw.size != h * (3 * w + 1):
        raise ValueError(f"{path}: image data has {raw.size} bytes, expected {h * (3 * w + 1)}")
    lines = raw.reshape(h, 3 * w + 1)
    out = np.zeros((h, 3 * w), np.uint8)
    prev = np.zeros(3 * w, np.uint8)
    for y in range(h):
        out[y] = _unfilter(int(lines[y, 0]), lines[y, 1:], prev)
        prev = out[y]
    return out.reshape(h, w, 3)


def _write_atomic(path: Path, data: bytes) -> None:
    # A temp file in the same directory makes os.replace atomic, so readers never see half a PNG.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a chart is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise

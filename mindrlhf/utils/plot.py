"""Training-curve charts as PNG files, drawn with matplotlib's non-interactive Agg backend."""
from __future__ import annotations

import contextlib
import math
import os
import tempfile
from pathlib import Path
from typing import Mapping, Optional, Sequence, Tuple, Union

PathLike = Union[str, os.PathLike]


def line_chart_png(path: PathLike, series: Mapping[str, Tuple[Sequence[float], Sequence[Optional[float]]]], *,
                   title: str = "", xlabel: str = "", ylabel: str = "", width: int = 640, height: int = 400) -> None:
    """Write a line chart of ``series`` (label -> (xs, ys)) to ``path`` as a ``width`` x ``height`` PNG.

    Non-finite or missing values leave gaps. The file is replaced atomically, so a reader (a
    dashboard, a user refreshing the image) never sees half a chart.
    """
    # The object-oriented API with an explicit Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    dpi = 100
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, (xs, ys) in series.items():
        if len(xs) != len(ys):
            raise ValueError(f"series {label!r}: {len(xs)} x values but {len(ys)} y values")
        ax.plot(list(xs), [_number(y) for y in ys], label=label, linewidth=1.6)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=dpi)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a chart is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _number(v) -> float:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else math.nan

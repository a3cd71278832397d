"""Curve PNGs (matplotlib): size, the two series drawn in distinct colours, gaps, bad input."""
from __future__ import annotations

import math

import numpy as np
import pytest

from mindrlhf.utils.plot import line_chart_png


def _ink(img: np.ndarray, rgb) -> int:
    """Pixels within a small distance of colour ``rgb`` (0-1 floats)."""
    return int((np.abs(img[..., :3] - np.asarray(rgb)).max(axis=2) < 0.08).sum())


def test_two_series_size_colours_and_gaps(tmp_path):
    from matplotlib import colors
    from matplotlib.image import imread

    path = tmp_path / "nested" / "reward.png"  # parent directories are created
    steps = list(range(1, 41))
    rewards = [0.3 + 0.01 * s + 0.05 * math.sin(s) for s in steps]
    rewards[20] = float("nan")  # a gap, not an error
    line_chart_png(path, {"reward": (steps, rewards), "mean": (steps, [0.5] * 40)}, title="Reward",
                   xlabel="step", ylabel="reward", width=480, height=300)
    img = imread(path)
    assert img.shape[:2] == (300, 480)
    first, second = (colors.to_rgb(f"C{k}") for k in (0, 1))  # the default cycle's first two colours
    assert _ink(img, first) > 200 and _ink(img, second) > 200
    # Only the single series: the second colour is gone (legend and line).
    line_chart_png(path, {"reward": (steps, rewards)})
    img = imread(path)
    assert img.shape[:2] == (400, 640) and _ink(img, second) == 0 and _ink(img, first) > 200


def test_mismatched_series_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="'reward': 3 x values but 2 y values"):
        line_chart_png(tmp_path / "x.png", {"reward": ([1, 2, 3], [0.1, 0.2])})
    assert not list(tmp_path.iterdir())

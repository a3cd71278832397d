"""mindrlhf-reward-trend: first-N vs last-N means with standard errors, checked by hand."""
from __future__ import annotations

import json
import math

import pytest

from mindrlhf.errors import MindRLHFError
from mindrlhf.tools.reward_trend import main, mean_and_stderr, read_metric, reward_trend


def test_mean_and_stderr_by_hand():
    # mean 0.5; sample variance ((.5²)·4)/3 = 1/3; s.e. sqrt(1/3 / 4) = sqrt(1/12)
    mean, se = mean_and_stderr([0.0, 1.0, 0.0, 1.0])
    assert mean == 0.5 and se == pytest.approx(math.sqrt(1 / 12), rel=1e-12)
    assert math.isnan(mean_and_stderr([3.0])[1])


def test_trend_compares_the_first_and_last_windows():
    t = reward_trend([0.0, 1.0, 0.0, 1.0, 0.25, 1.0, 1.0, 1.0, 1.0], window=4)
    assert t["first_mean"] == 0.5 and t["last_mean"] == 1.0 and t["last_se"] == 0.0
    assert t["diff"] == 0.5 and t["diff_se"] == pytest.approx(math.sqrt(1 / 12)) and t["steps"] == 9
    with pytest.raises(MindRLHFError, match="fewer than --window 10"):
        reward_trend([0.1] * 5, window=10)


def test_cli_reads_metrics_jsonl_last_row_of_a_step_wins(tmp_path, capsys):
    rows = [{"step": s, "reward": r} for s, r in ((1, 0.0), (2, 0.5), (2, 1.0), (3, 0.25), (4, 0.75))]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_metric(path, "reward") == [0.0, 1.0, 0.25, 0.75]  # step 2 was re-run after a resume
    assert main([str(path), "--window", "2"]) == 0
    out = capsys.readouterr().out
    assert "first 2 0.500 ± 0.500, last 2 0.500 ± 0.250, change +0.000 ± 0.559" in out
    assert main([str(path), "--key", "kl"]) == 2
    assert "has no metric 'kl'" in capsys.readouterr().err


def test_a_broken_metrics_line_is_named(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    # A bad line before the last is named; a torn last line (a crash mid-write) is only dropped.
    path.write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew\n{"step": 3, "reward": 0.7}\n')
    assert main([str(path), "--window", "2"]) == 2
    assert f"{path}:2: not JSON" in capsys.readouterr().err

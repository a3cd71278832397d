"""``mindrlhf-reward-trend``: did the training reward rise? First-N vs last-N steps of a run.

Reads a run's ``metrics.jsonl`` and prints, for one metric (default ``reward``), the mean over the
first ``--window`` steps and over the last ``--window`` steps, each with its standard error
(sample standard deviation / sqrt(n)), and their difference with the standard error of a
difference of independent means, sqrt(se1² + se2²).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from mindrlhf.errors import MindRLHFError
from mindrlhf.trainer.metrics import read_metrics
from mindrlhf.utils.cli import run_cli


def mean_and_stderr(values: Sequence[float]) -> tuple:
    """(mean, standard error of the mean); the error is NaN for fewer than two values."""
    n = len(values)
    if n == 0:
        raise MindRLHFError("mean_and_stderr: no values")
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def reward_trend(values: Sequence[float], window: int) -> Dict[str, float]:
    """First-``window`` vs last-``window`` means of a per-step series, with standard errors."""
    if window < 2:
        raise MindRLHFError(f"--window {window}: use at least 2 steps per window")
    if len(values) < window:
        raise MindRLHFError(f"the run has {len(values)} steps, fewer than --window {window}; lower --window")
    first, first_se = mean_and_stderr(values[:window])
    last, last_se = mean_and_stderr(values[-window:])
    return {"first_mean": first, "first_se": first_se, "last_mean": last, "last_se": last_se,
            "diff": last - first, "diff_se": math.hypot(first_se, last_se), "steps": len(values)}


def read_metric(path: Path, key: str) -> List[float]:
    """One metric per step from a metrics.jsonl (the last row of a step wins, as after a resume)."""
    if not path.is_file():
        raise MindRLHFError(f"{path} not found; pass a run's metrics.jsonl (in its output_dir)")
    by_step = {int(row["step"]): float(row[key]) for row in read_metrics(path) if key in row}
    if not by_step:
        raise MindRLHFError(f"{path} has no metric {key!r}; pick one of its keys with --key")
    return [by_step[s] for s in sorted(by_step)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mindrlhf-reward-trend", description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", help="a run's metrics.jsonl")
    p.add_argument("--window", type=int, default=10, help="steps in each of the two windows (default 10)")
    p.add_argument("--key", default="reward", help="metric to compare (default: reward, the mean total reward)")
    return p


def _main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    t = reward_trend(read_metric(Path(args.metrics), args.key), args.window)
    w = args.window
    print(f"{args.key} over {t['steps']} steps: first {w} {t['first_mean']:.3f} ± {t['first_se']:.3f}, "
          f"last {w} {t['last_mean']:.3f} ± {t['last_se']:.3f}, "
          f"change {t['diff']:+.3f} ± {t['diff_se']:.3f} (mean ± standard error)")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``mindrlhf-reward-trend``)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""Where per-step metrics go: a jsonl file, TensorBoard event files (tensorboardX), and a one-line
console summary."""
from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from mindrlhf.errors import MindRLHFError
from mindrlhf.utils.fs import write_failed, write_text_atomic

log = logging.getLogger(__name__)


class TensorBoardWriter:
    """Scalar summaries in ``<logdir>/events.out.tfevents.*`` (tensorboardX's ``SummaryWriter``)."""

    def __init__(self, logdir: Path):
        from tensorboardX import SummaryWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(logdir=str(logdir))

    def add_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """One scalar per numeric entry (strings and bools, e.g. a logged ``"nan"``, are skipped)."""
        for tag, value in scalars.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(tag, float(value), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


CONSOLE_KEYS = (("reward", "reward"), ("reward_std", "std"), ("kl", "kl"), ("loss", "loss"),
                ("grad_norm", "gnorm"), ("completions/mean_length", "len"), ("step_time", "s"))


def console_line(step: int, metrics: Mapping[str, float]) -> str:
    """``step 3 | reward 0.250 | std 0.433 | …`` with the headline metrics."""
    parts = [f"step {step}"]
    for key, short in CONSOLE_KEYS:
        if key in metrics:
            v = metrics[key]
            parts.append(f"{short} {v:.4g}" if isinstance(v, float) and math.isfinite(v) else f"{short} {v}")
    return " | ".join(parts)


#: A plot: (metric key, file name, title, y label).
Curve = Tuple[str, str, str, str]
#: Held-out accuracy of the policy stages' evaluation while training (skipped when the run logged none).
EVAL_CURVE: Curve = ("eval/accuracy", "eval_accuracy.png", "held-out GSM8K accuracy (evaluation while training)",
                     "accuracy")


class MetricsLogger:
    """Writes metrics on the main rank only; other ranks get a no-op logger.

    ``metrics.jsonl`` is the record: on a resume it keeps the rows up to ``resume_step`` (later ones
    are redone), and the TensorBoard events are rewritten from those rows, so a redone step is never
    logged twice and a new run's curves never mix with an old run's events.
    """

    def __init__(self, output_dir: Path, enabled: bool, tensorboard: bool, resume_step: int = 0):
        self.enabled = enabled
        self.jsonl_path = output_dir / "metrics.jsonl"
        self.tb: Optional[TensorBoardWriter] = None
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.jsonl_path.exists():
            kept = [row for row in read_metrics(self.jsonl_path) if row.get("step", 0) <= resume_step]
            write_text_atomic(self.jsonl_path, "".join(json.dumps(row) + "\n" for row in kept), "the metrics")
        if tensorboard:
            shutil.rmtree(output_dir / "tensorboard", ignore_errors=True)
            self.tb = TensorBoardWriter(output_dir / "tensorboard")
            for row in kept:
                self.tb.add_scalars(int(row["step"]), {k: v for k, v in row.items() if k != "step"})

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                                for k, v in metrics.items()}}
        try:  # one write of one whole line: a crash can tear only the last line, which read_metrics drops
            with open(self.jsonl_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as err:
            raise write_failed(f"step {step}'s metrics to", self.jsonl_path, err) from None
        if self.tb is not None:
            self.tb.add_scalars(step, metrics)

    def write_curves(self, curves: Sequence[Curve], window: int = 5) -> None:
        """The stage's plots (``curves``, its ``Trainer.curves``) beside metrics.jsonl, from every logged step."""
        if not self.enabled or not self.jsonl_path.exists():
            return
        write_curves(read_metrics(self.jsonl_path), self.jsonl_path.parent, curves, window)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: Path) -> List[Dict]:
    """The rows of a metrics.jsonl, in file order (blank lines skipped).

    A last line that is not JSON is a write torn by a crash (a full disk, a kill): it is dropped with
    a warning. A bad line before the last is an error: the file was edited or is not a metrics file.
    """
    lines = [(i, line) for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1)
             if line.strip()]
    rows = []
    for i, line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i == lines[-1][0]:
                log.warning("%s:%d: dropping a torn last line (%d characters, not JSON: a write cut short by a "
                            "crash)", path, i, len(line))
                break
            raise MindRLHFError(f"{path}:{i}: not JSON ({err}); only a torn last line is dropped, so fix or "
                                f"remove this line") from None
    return rows


def rolling_mean(values: Sequence[float], window: int) -> List[float]:
    """Trailing mean over up to ``window`` values (NaNs skipped)."""
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1):i + 1] if isinstance(v, (int, float)) and math.isfinite(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def write_curves(rows: Sequence[Mapping], out_dir: Path, curves: Sequence[Curve], window: int = 5) -> List[Path]:
    """Plot each of ``curves`` (metric key, file name, title, label: a stage's ``Trainer.curves``) per step with
    its ``window``-step trailing mean; returns the files written. A metric no row has is skipped."""
    from mindrlhf.utils.plot import line_chart_png

    steps = [int(r["step"]) for r in rows]
    written = []
    for key, name, title, label in curves:
        if not any(key in r for r in rows):
            continue
        ys = [r.get(key) for r in rows]  # the chart and rolling_mean both skip non-numbers
        line_chart_png(out_dir / name, {label: (steps, ys), f"{window}-step mean": (steps, rolling_mean(ys, window))},
                       title=title, xlabel="training step", ylabel=label)
        written.append(out_dir / name)
    return written

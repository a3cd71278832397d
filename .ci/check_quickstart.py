"""Checks what README command 1 (``bash scripts/quickstart.sh``, shortened by flags) left behind.

    python .ci/check_quickstart.py OUTPUT_DIR STEPS

metrics.jsonl has one row per step with finite numbers, the last step's checkpoint folder loads as
a model with its tokenizer and gives finite logits, the curves are PNGs, TensorBoard has events, the
last step's completions are dumped.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np


def main(out: Path, steps: int) -> None:
    import mindspore as ms
    from matplotlib.image import imread

    from mindrlhf.models import load_model
    from mindrlhf.tokenizer import resolve_tokenizer
    from mindrlhf.trainer.metrics import read_metrics

    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), [r.get("step") for r in rows]
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"non-finite metrics in step {row['step']}: {bad}"
        assert 0.0 <= row["reward"] <= 2.0 and row["step_time"] > 0, row
    ckpt = out / "checkpoints" / f"step_{steps:08d}"
    ms.set_device("CPU")
    model = load_model(ckpt)
    tokenizer = resolve_tokenizer(ckpt)
    ids = np.array([tokenizer.encode("Natalia sold clips to 48 of her friends.")], np.int32)
    logits = model(ms.Tensor(ids)).asnumpy()
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and np.isfinite(logits).all()
    for name in ("reward.png", "accuracy.png"):
        image = imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, (name, image.shape)
    assert any((out / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard events"
    dumped = out / f"completions_step_{steps}.jsonl"  # the last step's completions, whatever log_completions_steps
    assert dumped.is_file() and dumped.read_text(encoding="utf-8").strip(), f"no {dumped.name}"
    print(f"quickstart output OK: {len(rows)} metrics rows (reward {rows[-1]['reward']:.3f}), "
          f"{ckpt.name} loads ({sum(p.size for p in model.get_parameters()) / 1e6:.1f}M parameters), curves, events")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))

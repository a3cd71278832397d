"""Draw the data flow of one RL step, colocated and disaggregated, into docs/images/step_flow.png.

Run from the repository root: ``python docs/figures/step_flow.py [OUTPUT.png]``. The picture is text and arrows
only, so it is redrawn whenever the flow changes (tests/test_repo_docs.py runs it)."""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

#: The phases of a step, in order, and the module that owns each.
PHASES = [("rollout", "generation/"), ("reward", "rewards/"), ("advantage", "algorithms/"),
          ("loss", "algorithms/"), ("update", "trainer/update.py"), ("weight sync", "parallel/")]
GEN, TRAIN = "#dbeafe", "#fde68a"


def _box(ax, x, y, w, h, title, sub, color):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec="#334155"))
    ax.text(x + w / 2, y + h * 0.62, title, ha="center", va="center", fontsize=11, weight="bold")
    ax.text(x + w / 2, y + h * 0.28, sub, ha="center", va="center", fontsize=8, color="#334155", family="monospace")


def _arrow(ax, start, end, text="", rad=0.0, style="-|>", color="#334155"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=14, color=color, lw=1.4,
                                 connectionstyle=f"arc3,rad={rad}"))
    if text:
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.18, text, ha="center", fontsize=8, color=color)


def draw(output: Path) -> Path:
    fig, ax = plt.subplots(figsize=(12, 6.4))
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 6.4)
    ax.axis("off")
    w, h, gap = 1.55, 0.8, 0.42
    xs = [0.3 + i * (w + gap) for i in range(len(PHASES))]

    ax.text(0.3, 6.05, "Colocated (default): every rank samples, then trains; the same processes, two layouts",
            fontsize=12, weight="bold")
    y = 4.7
    for i, (x, (title, sub)) in enumerate(zip(xs, PHASES)):
        _box(ax, x, y, w, h, title, sub, GEN if i == 0 else TRAIN)
        if i:
            _arrow(ax, (xs[i - 1] + w, y + h / 2), (x, y + h / 2))
    _arrow(ax, (xs[-1] + w / 2, y), (xs[0] + w / 2, y), rad=-0.1)
    ax.text(6, 3.95, "weight sync: train shards → infer shards, in memory, after every update", ha="center",
            fontsize=9, color="#334155")
    ax.text(6, 3.6, "(sampling as infer_dp × infer_tp, training as train_dp × train_tp × train_pp)", ha="center",
            fontsize=9, color="#334155")

    ax.text(0.3, 3.05, "Disaggregated (--gen_workers K): generator ranks only sample; trainer ranks score and train",
            fontsize=12, weight="bold")
    gy, ty = 1.85, 0.3
    _box(ax, xs[0], gy, w, h, "rollout", "GenerationWorker", GEN)
    for i, (title, sub) in enumerate(PHASES[1:], 1):
        _box(ax, xs[i], ty, w, h, title, sub, TRAIN)
        if i > 1:
            _arrow(ax, (xs[i - 1] + w, ty + h / 2), (xs[i], ty + h / 2))
    _arrow(ax, (xs[0] + w / 2, gy), (xs[1], ty + h / 2), rad=0.25)
    ax.text(0.35, 1.0, "rows\n(AllGather)", fontsize=8, color="#334155")
    sx = xs[-1] + w / 2
    ax.plot([sx, sx], [ty + h, gy + h / 2], color="#b45309", lw=1.4)
    _arrow(ax, (sx, gy + h / 2), (xs[0] + w, gy + h / 2), color="#b45309")
    ax.text(6.4, gy + h / 2 + 0.12, "weights (Broadcast) after each update", ha="center", fontsize=9, color="#b45309")
    ax.text(6.4, gy + h / 2 - 0.32, "--max_staleness 1: generators sample step s + 1 while trainers train step s",
            ha="center", fontsize=9, color="#b45309")
    ax.text(6.4, gy + h + 0.12, "generator ranks [N, W): sampler and infer shard only; trainer ranks [0, N) below",
            ha="center", fontsize=9, color="#334155")
    fig.savefig(output, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return output


if __name__ == "__main__":
    default = Path(__file__).resolve().parents[1] / "images" / "step_flow.png"
    print(draw(Path(sys.argv[1]) if len(sys.argv) > 1 else default))

"""Learning-rate schedules: linear warmup, then cosine / linear decay to ``min_lr`` or constant."""
from __future__ import annotations

import math

from mindrlhf.errors import MindRLHFError


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return lr + (min_lr - lr) * progress
    raise ValueError(f"unknown lr_schedule {schedule!r}; use cosine, linear or constant")


def run_steps(cfg, batches_per_epoch: int) -> int:
    """Training steps of the run: ``max_steps``, or ``grpo_epochs`` passes over a dataset of
    ``batches_per_epoch`` chunk_size-prompt batches (``num_rollouts`` batches per step), whichever
    ends first; ``grpo_epochs`` alone when ``max_steps`` was not given. A pure function of the config
    and the data, so a resumed run gets the same length (and learning-rate schedule) as the original.
    """
    t, o = cfg.train, cfg.optimizer
    if not t.grpo_epochs:
        return t.max_steps
    per_epoch = batches_per_epoch // cfg.algorithm.num_rollouts
    if per_epoch < 1:
        raise MindRLHFError(f"grpo_epochs = {t.grpo_epochs}: the dataset has {batches_per_epoch} batches of chunk_size "
                            f"= {cfg.algorithm.chunk_size} prompts per epoch, fewer than num_rollouts = "
                            f"{cfg.algorithm.num_rollouts} per step; lower num_rollouts or chunk_size")
    steps = t.grpo_epochs * per_epoch
    if "max_steps" in cfg.explicitly_set():
        steps = min(steps, t.max_steps)
    if o.warmup_steps > steps:
        raise MindRLHFError(f"warmup_steps = {o.warmup_steps} > the run's {steps} steps (grpo_epochs = "
                            f"{t.grpo_epochs} x {per_epoch} steps per epoch); lower warmup_steps")
    return steps

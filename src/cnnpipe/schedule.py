"""Learning-rate schedules as pure functions of the optimizer step."""

from __future__ import annotations

import math


def lr_at(step: int, *, total_steps: int, peak_lr: float, warmup_steps: int = 0,
          kind: str = "cosine", min_lr_ratio: float = 0.0) -> float:
    """LR for optimizer step `step` (0-based): linear warmup, then constant or cosine to a floor."""
    if kind == "constant":
        return peak_lr
    if warmup_steps > 0 and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    floor = peak_lr * min_lr_ratio
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return floor + 0.5 * (peak_lr - floor) * (1.0 + math.cos(math.pi * progress))


def scaled_lr(base_lr: float, global_batch: int, reference_batch: int = 256) -> float:
    """Linear scaling rule: `base_lr` is quoted for a global batch of `reference_batch`."""
    return base_lr * global_batch / reference_batch


def warmup_steps(warmup_epochs: float, train_images: int, global_batch: int, total_steps: int) -> int:
    """Warmup length in optimizer steps: `warmup_epochs` passes over the whole training split.

    Counted in images seen, not in (possibly budget-shortened) epochs: what warmup protects, the
    first updates of a randomly initialised network at full LR, takes a number of steps that does
    not shrink when an epoch draws fewer images. Never more than half the run.
    """
    return min(int(round(warmup_epochs * train_images / global_batch)), total_steps // 2)

"""Learning-rate schedules as pure functions of the optimizer step, and when a run ends (its batch
for `train.min_steps`, early stop on validation)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from cnnpipe.config import TrainConfig


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


@dataclass(frozen=True)
class LrSchedule:
    """The LR of every optimizer step of one run, built from the `train:` params in one place:
    `train.lr` scaled to the real global batch, warmup in passes over the whole split, then decay."""

    peak_lr: float
    total_steps: int
    warmup_steps: int
    kind: str
    min_lr_ratio: float

    @classmethod
    def for_run(cls, t: TrainConfig, train_images: int, global_batch: int, total_steps: int) -> LrSchedule:
        """The schedule of a run of `total_steps` optimizer steps at `global_batch` images each."""
        warmup = warmup_steps(t.warmup_epochs, train_images, global_batch, total_steps) if t.schedule == "cosine" else 0
        return cls(scaled_lr(t.lr, global_batch), total_steps, warmup, t.schedule, t.min_lr_ratio)

    def __call__(self, step: int) -> float:
        return lr_at(step, total_steps=self.total_steps, peak_lr=self.peak_lr, warmup_steps=self.warmup_steps,
                     kind=self.kind, min_lr_ratio=self.min_lr_ratio)


START_OF_INIT = {"random": "scratch", "file": "pretrained", "hub-cache": "pretrained", "torch-hub-cache": "pretrained",
                 "hub": "pretrained", "champion": "champion"}
"""The start a run's init record (`models.InitInfo.source`) makes it."""


def backbone_lr_scale(t: TrainConfig, init_source: str) -> float:
    """The LR rule of a fine-tune: the backbone trains at this fraction of the schedule's LR, the
    classifier at the full LR, by where the weights start.

    A head/backbone split, the rule of every fine-tuning recipe since ULMFiT's discriminative rates
    (timm's `layer_decay` is its per-layer form), rather than one scale for the whole model: the
    classifier is new (from ImageNet weights) or has new rows (the champion's, when classes change)
    and must move as fast as training from scratch does, while the backbone's features are already
    good and a scratch LR (tuned to move random weights far) wrecks them in the first epoch. From
    random init (scale 1) the optimizer is built exactly as before, so the default run is unchanged.
    The warm-up stays the recipe's: it protects the fresh classifier's first updates at full LR, in
    every start. The scales are `train.pretrained_lr_scale` and `train.champion_lr_scale`;
    docs/results.md measures 0.1 against 1.0 (the scratch LR) from EfficientNet-Lite0's ImageNet weights.
    """
    start = START_OF_INIT.get(init_source, "scratch")
    return {"scratch": 1.0, "pretrained": t.pretrained_lr_scale, "champion": t.champion_lr_scale}[start]


MIN_BATCH = 64
"""The smallest per-process batch `batch_for_steps` halves to. Below it ResNet-50 loses on both
counts on a CPU (measured at 3/32 of Fashion-MNIST per epoch, 4 epochs: batch 32 reached 78.4%
val top-1 at 148 img/s, batch 64 79.6% at 203 img/s)."""


def steps_per_run(images_per_epoch: int, epochs: int, batch_size: int, world_size: int = 1,
                  accum_steps: int = 1) -> int:
    """Optimizer steps of a run, as the training loader counts them (every rank drops the ragged end)."""
    return epochs * ((images_per_epoch // world_size) // batch_size // accum_steps)


def halved_batches(batch_size: int) -> list[int]:
    """The smaller batches `train.min_steps` may pick, largest first: `batch_size` halved while it
    stays >= `MIN_BATCH` (none when `batch_size` is already below twice the floor)."""
    out, batch = [], batch_size // 2
    while batch >= MIN_BATCH:
        out.append(batch)
        batch //= 2
    return out


SMALLEST_BATCH = 8
"""The smallest batch `batch_for_split` halves to, for a training split smaller than one batch."""


def batch_for_split(batch_size: int, images_per_epoch: int, world_size: int = 1, accum_steps: int = 1) -> int:
    """`batch_size`, or where an epoch gives each process fewer images than one optimizer step takes,
    the largest halving of it that fills one (a small folder of photos), never below `SMALLEST_BATCH`.

    Under `MIN_BATCH` only as far as one full step per epoch needs: more steps at a smaller batch is
    `train.min_steps`'s rule, and it stops at the floor. Below `SMALLEST_BATCH` images per process
    the loader's error names the batch that does not fit.
    """
    per_process = images_per_epoch // world_size
    batch = batch_size
    while batch * accum_steps > per_process and batch // 2 >= SMALLEST_BATCH:
        batch //= 2
    return batch


def batch_for_steps(batch_size: int, min_steps: int | None, images_per_epoch: int, epochs: int,
                    world_size: int = 1, accum_steps: int = 1) -> int:
    """The per-process batch that gives the run at least `min_steps` optimizer steps.

    `batch_size` is halved until the run has them, never below `MIN_BATCH` (nor above `batch_size`)
    unless an epoch holds less than one batch there (`batch_for_split`, also without `min_steps`);
    the LR follows through the linear scaling rule. Early in training from scratch the batch that
    still learns as much per image is small, so a run of few steps at a large batch learns less:
    measured at 1/8 of Fashion-MNIST per epoch, 4 epochs, validation top-1 was 75.4% at batch 256
    (104 steps), 80.5% at 128, 81.6% at 64 (`bench/short_runs.py`). What counts is the steps, not
    why they are few: a budget that shortens the epochs, or many processes sharing whole ones
    (eight GPUs at batch 256 take 26 steps per epoch of Fashion-MNIST, and a warm-up of 8).
    """
    if min_steps is None:
        return batch_for_split(batch_size, images_per_epoch, world_size, accum_steps)
    for batch in (batch_size, *halved_batches(batch_size)):
        if steps_per_run(images_per_epoch, epochs, batch, world_size, accum_steps) >= min_steps:
            return batch
    return batch_for_split(batch, images_per_epoch, world_size, accum_steps)


def choose_batch(batch_size: int, min_steps: int | None, images_per_epoch: int, epochs: int,
                 world_size: int = 1, accum_steps: int = 1) -> tuple[int, str]:
    """`batch_for_steps`'s batch and why it is not `batch_size` ('' when it is), for the log and train.json.

    The small epoch is named when it alone halves the batch that far (`batch_for_split`): it would
    without `train.min_steps` too; a batch halved further is `train.min_steps`'s doing."""
    batch = batch_for_steps(batch_size, min_steps, images_per_epoch, epochs, world_size, accum_steps)
    if batch == batch_size:
        return batch, ""
    if batch == batch_for_split(batch_size, images_per_epoch, world_size, accum_steps):
        return batch, f"train.batch_size {batch_size} halved to {batch}: an epoch holds fewer images than one batch"
    return batch, f"train.batch_size {batch_size} halved to reach train.min_steps={min_steps}"


def early_stop(history: Sequence[dict[str, Any]], patience: int | None) -> dict[str, Any] | None:
    """Why training should stop after the last epoch of `history`, or None to go on.

    Keras' and Lightning's rule on validation top-1: stop once `patience` epochs in a row brought no
    better value than the best so far (ties do not count as better). The best epoch's weights are
    already in best.pt, which is what evaluation, export and the gate read.
    """
    if patience is None or not history:
        return None
    scores = [h["val_top1"] for h in history]
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))  # the first epoch that reached the best
    waited = len(scores) - 1 - best
    if waited < patience:
        return None
    return {"after_epoch": len(scores), "best_epoch": best + 1, "best_val_top1": scores[best],
            "reason": f"validation top-1 did not improve on epoch {best + 1}'s {scores[best]:.4f} for {waited} "
                      f"epochs (train.patience={patience})"}

"""One training epoch, one evaluation pass and the model's inference speed, timed honestly."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable, Iterator

import torch
import torch.nn.functional as F
from timm.loss import SoftTargetCrossEntropy

from cnnpipe.train.distributed import DistInfo, all_reduce_sum, unwrap
from cnnpipe.train.precision import autocast


class NonFiniteLoss(FloatingPointError):
    """The loss became NaN or infinite."""


@dataclass
class EpochStats:
    """What one epoch of training measured on this rank."""

    loss: float = 0.0
    images: int = 0
    steps: int = 0
    time_s: float = 0.0
    data_wait_s: float = 0.0
    lr_last: float = 0.0
    step_times: list[float] = field(default_factory=list)

    @property
    def data_wait_frac(self) -> float:
        return self.data_wait_s / self.time_s if self.time_s else 0.0


@dataclass
class StepContext:
    """Everything a training step needs besides the batch."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    amp: str
    label_smoothing: float = 0.0
    scaler: torch.amp.GradScaler | None = None
    grad_clip: float | None = None
    lr_for_step: Callable[[int], float] = lambda step: 0.0
    ema: torch.nn.Module | None = None
    mixup: Callable | None = None
    """timm Mixup: (x, labels) → (mixed x, soft targets); None disables it."""
    accum_steps: int = 1
    """Micro-batches per optimizer step."""


Region = Callable[[str], ContextManager[None]]
"""Wraps one phase of a step (copy, augment, forward, sync, backward, optimizer); the profiler times it."""


def topk_hits(logits: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """How many rows have their label among the `k` highest logits, as a tensor on their device (no read)."""
    if len(labels) == 0:
        return torch.zeros((), dtype=torch.long, device=logits.device)
    top = logits.topk(min(k, logits.shape[1]), dim=1).indices
    return (top == labels[:, None]).any(dim=1).sum()


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, k: int) -> int:
    """How many rows have their label among the `k` highest logits."""
    return int(topk_hits(logits, labels, k))


NAN_CHECK_EVERY = 50
"""Optimizer steps between two reads of the loss. A read stalls the host until the GPU has drained its
queue; one every 50 steps costs nothing measurable, and a NaN shows within 50 steps (and at the
epoch's end, where the mean loss is read anyway)."""


def checks_loss(step: int, last: bool) -> bool:
    """Whether this micro-batch reads its loss for the NaN guard: the last micro-batch of every
    `NAN_CHECK_EVERY`-th optimizer step, on every device, so a CPU test counts what a GPU run does."""
    return last and step % NAN_CHECK_EVERY == 0


def no_region(name: str) -> ContextManager[None]:
    """The training loop's region: no timing, no profiler label."""
    return contextlib.nullcontext()


def micro_step(ctx: StepContext, images: torch.Tensor, labels: torch.Tensor, device_transform: Callable,
               step: int, first: bool, last: bool, region: Region = no_region) -> torch.Tensor:
    """One micro-batch of optimizer step `step`: copy, augment, forward, NaN guard and backward; the
    window's first micro-batch sets the LR and clears gradients, its last one steps the optimizer.

    `fit` and the profiler both run this function, so the profile measures the step that trains.
    Returns the detached loss. Makes no host sync except the NaN guard's read on the steps
    `checks_loss` picks (tests/test_host_syncs.py counts them), so on CUDA the host queues ahead.
    """
    with region("copy"):
        images = images.to(ctx.device, non_blocking=True)
        labels = labels.to(ctx.device, non_blocking=True)
    with region("augment"):
        x = device_transform(images)
        targets = None
        if ctx.mixup is not None:  # soft targets, with label smoothing folded into them
            x, targets = ctx.mixup(x, labels)
    if first:
        with region("optimizer"):
            for group in ctx.optimizer.param_groups:  # a fine-tune's backbone: a fraction (parts.split_head_lr)
                group["lr"] = ctx.lr_for_step(step) * group.get("lr_scale", 1.0)
            ctx.optimizer.zero_grad(set_to_none=True)
    # DDP: a micro-batch that does not end the window skips the gradient all-reduce. The forward pass
    # must be inside no_sync too: DDP's forward arms the reducer that the backward then fires.
    no_sync = getattr(ctx.model, "no_sync", None)
    with no_sync() if (no_sync is not None and not last) else contextlib.nullcontext():
        loss = _forward_backward(ctx, x, labels, targets, step, last, region)
    if last:
        with region("optimizer"):
            _optimizer_step(ctx)
            if ctx.ema is not None:
                ctx.ema.update(unwrap(ctx.model), step=step)
    return loss.detach()


def _forward_backward(ctx: StepContext, x: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor | None,
                      step: int, last: bool, region: Region) -> torch.Tensor:
    """Forward, NaN guard and backward of one micro-batch (the loss scaled by 1/accum_steps)."""
    with region("forward"):
        with autocast(ctx.amp, ctx.device):
            if targets is None:
                loss = F.cross_entropy(ctx.model(x), labels, label_smoothing=ctx.label_smoothing)
            else:
                loss = _soft_target_ce(ctx.model(x).float(), targets)
    with region("sync"):
        if checks_loss(step, last):
            value = loss.item()  # the step's one host sync, on the checked steps only
            if not math.isfinite(value):
                raise NonFiniteLoss(f"loss is {value} at optimizer step {step} (lr={ctx.lr_for_step(step):.4g})")
    with region("backward"):
        scaled = loss / max(1, ctx.accum_steps)
        (ctx.scaler.scale(scaled) if ctx.scaler is not None else scaled).backward()
    return loss


def train_one_epoch(ctx: StepContext, loader: Iterable, device_transform: Callable, start_step: int) -> EpochStats:
    """Train over `loader` once; `start_step` is the global optimizer step the epoch begins at.

    The loss is summed on the device and read once, at the end (with the step times): the epoch's
    only host syncs besides the NaN guard's.
    """
    ctx.model.train()
    stats = EpochStats()
    running = torch.zeros((), device=ctx.device)
    step = start_step
    t_epoch = time.perf_counter()
    t_wait = time.perf_counter()
    steps = Spans(ctx.device)  # on CUDA: events on the stream, so timing adds no wait per step
    accum = max(1, ctx.accum_steps)
    usable = (len(loader) // accum) * accum if hasattr(loader, "__len__") else None
    for micro, (images, labels) in enumerate(loader):
        if usable is not None and micro >= usable:
            break  # a trailing partial accumulation window would step with fewer samples
        stats.data_wait_s += time.perf_counter() - t_wait  # time blocked on the loader
        first, last = micro % accum == 0, (micro + 1) % accum == 0
        if first:
            stats.lr_last = ctx.lr_for_step(step)
        with steps.span():
            loss = micro_step(ctx, images, labels, device_transform, step, first, last)
        if last:
            step += 1
            stats.steps += 1
        running += loss * labels.shape[0]
        stats.images += labels.shape[0]
        t_wait = time.perf_counter()
    stats.step_times = steps.durations()  # (waits for the device on CUDA)
    stats.time_s = time.perf_counter() - t_epoch
    stats.loss = running.item() / max(1, stats.images)
    if not math.isfinite(stats.loss):
        raise NonFiniteLoss(f"mean epoch loss is {stats.loss}")
    return stats


_soft_target_ce = SoftTargetCrossEntropy()


def _optimizer_step(ctx: StepContext) -> None:
    """Unscale (fp16), clip, step and update the scaler.

    None of it reads the device: clip_grad_norm_ scales by a device tensor, and GradScaler hands a
    fused optimizer (`fused=True`) its found-inf flag to skip the step in the kernel. With any other
    optimizer GradScaler reads that flag on the host, one sync per step.
    """
    if ctx.scaler is not None:
        if ctx.grad_clip:
            ctx.scaler.unscale_(ctx.optimizer)
            torch.nn.utils.clip_grad_norm_(ctx.model.parameters(), ctx.grad_clip)
        ctx.scaler.step(ctx.optimizer)
        ctx.scaler.update()
    else:
        if ctx.grad_clip:
            torch.nn.utils.clip_grad_norm_(ctx.model.parameters(), ctx.grad_clip)
        ctx.optimizer.step()


@torch.no_grad()
def forward_times(model: torch.nn.Module, in_chans: int, image_size: int, channels_last: bool, amp: str,
                  device: torch.device, batch: int = 256, calls: int = 5) -> list[float]:
    """Seconds per forward pass of the model alone on `batch` random images, in eval mode without
    autograd, at the recipe's precision and layout: what evaluation and export run at.

    Random, not zero, inputs: recent GPUs run matrix products on zeros measurably faster (less
    switching power). `calls` timed calls after one untimed one, which pays for allocation and
    kernel selection; the model's train/eval mode is restored.
    """
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, in_chans, image_size, image_size, generator=generator).to(device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    was_training = model.training
    model.eval()
    times = []
    try:
        for i in range(calls + 1):
            sync_device(device)
            t0 = time.perf_counter()
            with autocast(amp, device):
                model(x)
            sync_device(device)
            if i:
                times.append(time.perf_counter() - t0)
    finally:
        model.train(was_training)
    return times


class Spans:
    """Durations of timed spans: wall time on the CPU; on CUDA, the time on the device's stream
    between two events, read after one wait at the end. A wait per span would stop the host queueing
    the next step while the GPU runs this one, so the timing would slow what it measures."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._spans: list[tuple] = []

    def _now(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        start = self._now()
        yield
        self._spans.append((start, self._now()))

    def durations(self) -> list[float]:
        """Seconds of each span so far, in order; the spans are then forgotten."""
        if self.device.type == "cuda":
            sync_device(self.device)
            out = [a.elapsed_time(b) / 1000 for a, b in self._spans]
        else:
            out = [b - a for a, b in self._spans]
        self._spans.clear()
        return out


def sync_device(device: torch.device) -> None:
    """Wait for queued GPU work (a no-op on the CPU), so that a wall-clock reading covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eval_logits(model: torch.nn.Module, loader: Iterable, transform: Callable, device: torch.device,
                amp: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(float32 logits on the device, labels as the loader gives them) for each batch of `loader`:
    the model in eval mode without autograd, each batch through `transform` at the recipe's precision.

    What `predict` and `evaluate_top1` both walk. Nothing here reads the device: what a caller keeps
    or sums of the logits decides when the host waits.
    """
    model.eval()
    for images, labels in loader:
        x = transform(images.to(device, non_blocking=True))
        with torch.no_grad(), autocast(amp, device):
            logits = model(x)
        yield logits.float(), labels


@torch.no_grad()
def predict(model: torch.nn.Module, loader: Iterable, transform: Callable, device: torch.device,
            amp: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 logits, labels) on the CPU for every batch of `loader` on this rank.

    The logits stay on the device until the last batch and come back in one copy: a copy per batch
    would stall the host once per batch. They take N x classes x 4 bytes of device memory meanwhile
    (200 MB for 50,000 images of 1,000 classes).
    """
    all_logits, all_labels = [], []
    for logits, labels in eval_logits(model, loader, transform, device, amp):
        all_logits.append(logits)
        all_labels.append(labels)
    if not all_logits:
        return torch.zeros(0, 0), torch.zeros(0, dtype=torch.long)
    return torch.cat(all_logits).cpu(), torch.cat(all_labels)


@torch.no_grad()
def evaluate_top1(model: torch.nn.Module, loader: Iterable, transform: Callable, info: DistInfo,
                  amp: str) -> dict[str, float]:
    """Top-1, top-5 and loss over all ranks' shards.

    Counted on the device batch by batch and read once at the end: no host sync per batch, and no
    logits kept.
    """
    device = info.device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # top-1 hits, top-5 hits, loss sum
    n = 0
    for logits, labels in eval_logits(model, loader, transform, device, amp):
        labels = labels.to(device, non_blocking=True)
        sums += torch.stack([topk_hits(logits, labels, 1).double(), topk_hits(logits, labels, 5).double(),
                             F.cross_entropy(logits, labels, reduction="sum").double()])
        n += len(labels)
    c1, c5, ls, total = all_reduce_sum([*sums.tolist(), n], info)
    total = max(total, 1)
    return {"top1": c1 / total, "top5": c5 / total, "loss": ls / total}

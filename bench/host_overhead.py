"""Benchmark: host microseconds per training step spent outside the model, old code against new.

On a GPU the host must queue a step faster than the GPU runs it, or the GPU waits. This times, on
the CPU path and one thread, the pieces a step runs besides the model: the crop's random draws and
resampling matrices (five draws and two matrix builds before, one and one now), the EMA update
(timm's ModelEmaV3, which rebuilds two state dicts per step, against one foreach lerp), the
optimizer step with an fp16 GradScaler (foreach, whose scaler reads found_inf on the host, against
fused), and the NaN guard's policy (host syncs per 100 steps, counted by the seam). For tiny models
the time is nearly all host overhead; for resnet50 the CPU also does the arithmetic a GPU would.
Medians (and p25-p75) over `--reps` timed calls after warm-up; "k." counts the ops that compute,
one kernel launch each on a GPU.

    python bench/host_overhead.py
    python bench/host_overhead.py --reps 500 --batches 16 256
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Callable

import timm
import torch
from timm.utils import ModelEmaV3
from torch.utils._python_dispatch import TorchDispatchMode

from cnnpipe.data.loaders.transforms import AugmentConfig, FastTransform, _interp_matrix, crop_params
from cnnpipe.train.ema import ModelEma
from cnnpipe.train.engine import checks_loss
from cnnpipe.train.syncs import HostSyncCounter


def five_draws(n: int, aug: AugmentConfig, height: int, width: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """The crop's draws as they were: one generator call per quantity."""
    area = torch.empty(n).uniform_(*aug.scale, generator=g)
    ratio = torch.exp(torch.empty(n).uniform_(math.log(aug.ratio[0]), math.log(aug.ratio[1]), generator=g))
    w = torch.sqrt(area * ratio).clamp(max=1.0) * width
    h = torch.sqrt(area / ratio).clamp(max=1.0) * height
    x0 = torch.rand(n, generator=g) * (width - w)
    y0 = torch.rand(n, generator=g) * (height - h)
    return x0, y0, w, h, torch.rand(n, generator=g) < 0.5


def old_matrices(n: int, aug: AugmentConfig, size: int, g: torch.Generator) -> None:
    x0, y0, w, h, _ = five_draws(n, aug, size, size, g)
    _interp_matrix(y0, h, aug.image_size, size), _interp_matrix(x0, w, aug.image_size, size)


def new_matrices(n: int, aug: AugmentConfig, size: int, g: torch.Generator) -> None:
    x0, y0, w, h, _ = crop_params(n, aug, size, size, g)
    _interp_matrix(torch.cat([y0, x0]), torch.cat([h, w]), aug.image_size, size).chunk(2)


def timed(fn: Callable[[], object], reps: int, warmup: int = 20) -> tuple[float, float, float]:
    """(median, p25, p75) microseconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    q = statistics.quantiles(times, n=4)
    return statistics.median(times), q[0], q[2]


class _KernelCount(TorchDispatchMode):
    """Counts the aten ops that compute (views launch nothing): on a GPU, one kernel launch each."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.kernels += not func.is_view
        return func(*args, **(kwargs or {}))


def measure(piece: str, variant: str, fn: Callable[[], object], reps: int) -> None:
    """One table row: kernels and host syncs of one call, then its timing."""
    with _KernelCount() as count, HostSyncCounter() as syncs:
        fn()
    median, p25, p75 = timed(fn, reps)
    print(f"| {piece:46s} | {variant:32s} | {count.kernels:7d} | {len(syncs.syncs):5d} | {median:10.1f} | "
          f"{p25:8.1f}-{p75:<8.1f} |")


def trained_copy(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """A model with gradients, and a foreach and a fused SGD over it."""
    model = timm.create_model(name, num_classes=10)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    foreach = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9, foreach=True)
    fused = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9, fused=True)
    return model, foreach, fused


def scaled_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    scaler.step(optimizer)
    scaler.update()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 256],
                        help="images per batch for the crop: small shows a GPU step's host cost, large the CPU's")
    parser.add_argument("--size", type=int, default=28, help="stored image side (cropped to 24)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # host overhead, not parallel arithmetic
    print(f"torch {torch.__version__}, CPU, 1 thread, {args.reps} reps; microseconds per call; kernels: ops "
          f"that compute (one launch each on a GPU); syncs: host syncs on CUDA (counted by cnnpipe.train.syncs)\n")
    print(f"| {'piece':46s} | {'variant':32s} | kernels | syncs | {'median µs':>10s} | {'p25-p75':17s} |")
    print(f"|{'-' * 48}|{'-' * 34}|{'-' * 9}|{'-' * 7}|{'-' * 12}|{'-' * 19}|")

    aug, g = AugmentConfig(args.size - 4, scale=(0.35, 1.0)), torch.Generator().manual_seed(0)
    for n in args.batches:
        measure(f"crop draws, {n} images", "old: 5 generator calls",
                lambda: five_draws(n, aug, args.size, args.size, g), args.reps)
        measure(f"crop draws, {n} images", "new: 1 call (n, 5)",
                lambda: crop_params(n, aug, args.size, args.size, g), args.reps)
        measure(f"crop draws + resampling matrices, {n} images", "old: 5 draws, 2 matrix builds",
                lambda: old_matrices(n, aug, args.size, g), args.reps)
        measure(f"crop draws + resampling matrices, {n} images", "new: 1 draw, 1 matrix build",
                lambda: new_matrices(n, aug, args.size, g), args.reps)
    n = args.batches[-1]
    transform = FastTransform(aug, (0.5,) * 3, (0.25,) * 3, train=True, channels_last=True, seed=0)
    images = torch.randint(0, 256, (n, args.size, args.size, 3), dtype=torch.uint8)
    measure(f"whole train transform, {n} images (context)", "new: crop, matmuls, normalise",
            lambda: transform(images), args.reps // 3)

    for name, reps in (("test_efficientnet", args.reps), ("resnet50", max(20, args.reps // 10))):
        model, foreach, fused = trained_copy(name)
        tensors = len(model.state_dict())
        old_ema, new_ema = ModelEmaV3(model, decay=0.999), ModelEma(model, decay=0.999)
        measure(f"EMA update, {name} ({tensors} tensors)", "old: timm ModelEmaV3",
                lambda: old_ema.update(model, step=10), reps)
        measure(f"EMA update, {name} ({tensors} tensors)", "new: foreach lerp + copy",
                lambda: new_ema.update(model, step=10), reps)
        for label, opt in (("old: foreach (host reads inf)", foreach), ("new: fused (inf in the kernel)", fused)):
            scaler = torch.amp.GradScaler("cpu", init_scale=1.0)  # scale 1: the grads stay as they are
            scaler.scale(torch.ones(()))  # the scaler's lazy state, as a step's scaled loss would make it
            measure(f"SGD step + GradScaler, {name}", label, lambda: scaled_step(scaler, opt), reps)

    loss = torch.tensor(1.0)
    measure("one loss read (.item())", "CPU: no queue to drain", lambda: math.isfinite(loss.item()), args.reps)
    accum = 4
    old_cpu = 100 * accum  # every micro-batch of every step
    old_cuda = sum(accum for step in range(100) if step % 50 == 0)  # every micro-batch of a checked step
    new = sum(checks_loss(step, last=True) for step in range(100))
    print(f"\nNaN-guard host syncs per 100 optimizer steps of {accum} micro-batches: old {old_cpu} on the CPU, "
          f"{old_cuda} on CUDA; new {new} on both (tests/test_host_syncs.py counts them).")


if __name__ == "__main__":
    main()

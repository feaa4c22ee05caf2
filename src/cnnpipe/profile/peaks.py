"""The roofline's measurements: this machine's peaks, and one step's FLOPs and bytes per op.

Both run outside the profile's timed windows (the base steps and the trace) and inside its time
box, each sized to a share of it. The peaks follow airbench's habit: warm up, synchronize before
reading the clock, time each call alone, take the median. The FLOPs are torch's own count
(`torch.utils.flop_counter.FlopCounterMode`: convolutions and matrix products, forward and
backward); the bytes come from a dispatch mode of ours beside it, since torch has no byte counter.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from cnnpipe.profile.measure import Setup
from cnnpipe.profile.roofline import Peaks
from cnnpipe.train.distributed import unwrap
from cnnpipe.train.engine import sync_device
from cnnpipe.train.precision import autocast

MATMUL_N = {"cpu": 2048, "cuda": 8192}
"""Square matrix products large enough to reach the math units' rate (a GPU needs far larger ones to fill it)."""
COPY_MIB = {"cpu": 256, "cuda": 1024}
"""Copies larger than any cache, so the copy measures memory."""
PEAK_S = 1.5
"""Seconds each of the three peaks gets without a time box."""
MIN_CALLS, MAX_CALLS = 3, 7
"""Timed calls per peak: at least three for a median, at most seven (the rest of its share unused)."""
MIN_N = 256
MIN_COUNT_BATCH = 2
"""BatchNorm in training mode needs two values per channel (a 1x1 map at the end of a 32 px ResNet)."""


def timed_calls(fn: Callable[[], Any], device: torch.device, seconds: float) -> list[float]:
    """Seconds of each timed call of `fn` after one untimed one: at least `MIN_CALLS`, then more
    while `seconds` last (at most `MAX_CALLS`); each call alone between two device syncs."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < MIN_CALLS or (len(times) < MAX_CALLS and time.perf_counter() - start < seconds):
        sync_device(device)
        t0 = time.perf_counter()
        fn()
        sync_device(device)
        times.append(time.perf_counter() - t0)
    return times


def matmul_gflops(device: torch.device, dtype: torch.dtype, seconds: float) -> tuple[float, int]:
    """(GFLOP/s, n) of an n x n `torch.matmul` in `dtype`: n from `MATMUL_N`, halved while the untimed
    first call says `MIN_CALLS` would not fit `seconds` (bf16 on a CPU without bf16 units is ~10x slower)."""
    n = MATMUL_N.get(device.type, MATMUL_N["cuda"])
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        sync_device(device)
        t0 = time.perf_counter()
        torch.matmul(a, b)  # untimed: allocation, kernel choice, a cold cache
        sync_device(device)
        if n <= MIN_N or MIN_CALLS * (time.perf_counter() - t0) <= seconds:
            break
        n //= 2
    times = timed_calls(lambda: torch.matmul(a, b), device, seconds)
    return 2 * n**3 / statistics.median(times) / 1e9, n


def copy_gbs(device: torch.device, seconds: float) -> tuple[float, int]:
    """(GB/s, MiB): bytes read plus written per second by `dst.copy_(src)` of a tensor past the caches."""
    mib = COPY_MIB.get(device.type, COPY_MIB["cuda"])
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # untimed: first touch of every page
    times = timed_calls(lambda: dst.copy_(src), device, seconds)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9, mib


def measure_peaks(device: torch.device, share_s: float | None) -> Peaks:
    """bf16 and fp32 matmul GFLOP/s and copy GB/s in this process, at its thread count, each in a
    third of `share_s` (`PEAK_S` each without a box)."""
    each = PEAK_S if share_s is None else min(PEAK_S, share_s / 3)
    t0 = time.perf_counter()
    bf16, bf16_n = matmul_gflops(device, torch.bfloat16, each)
    fp32, fp32_n = matmul_gflops(device, torch.float32, each)
    gbs, mib = copy_gbs(device, each)
    return Peaks(bf16, fp32, gbs, bf16_n, fp32_n, mib, time.perf_counter() - t0)


class OperandBytes(TorchDispatchMode):
    """Bytes of each aten op's tensor operands, inputs and outputs (a tensor the op writes in place
    once): what the op must at least read and write. Views move nothing and are skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            seen, total = set(), 0
            for t in tree_flatten((args, kwargs, out))[0]:
                if isinstance(t, torch.Tensor) and (t.data_ptr(), t.numel()) not in seen:
                    seen.add((t.data_ptr(), t.numel()))
                    total += t.numel() * t.element_size()
            name = func._schema.name
            self.bytes[name] = self.bytes.get(name, 0.0) + total
        return out


def count_ops(run: Callable[[], Any]) -> tuple[dict[str, float], dict[str, float]]:
    """(FLOPs, operand bytes) per aten op (`aten::mm`, ...) of what `run` computes, forward and backward."""
    with FlopCounterMode(display=False) as flop_counter, OperandBytes() as byte_counter:
        run()
    flops = {packet._qualified_op_name: float(n) for packet, n in flop_counter.get_flop_counts()["Global"].items()}
    return flops, byte_counter.bytes


@dataclass(frozen=True)
class StepCount:
    """FLOPs and operand bytes per aten op (`aten::convolution`, ...) for one optimizer step."""

    flops: dict[str, float]
    bytes: dict[str, float]
    basis: str

    @property
    def ops(self) -> set[str]:
        """Every op the counter saw: the trace charges time to these."""
        return set(self.flops) | set(self.bytes)


def count_batch(batch: int, per_image_s: float, share_s: float | None) -> int:
    """The batch to count at: `batch`, halved while a step there (`per_image_s` an image) would take
    more than `share_s`, never under `MIN_COUNT_BATCH`."""
    while share_s is not None and batch > MIN_COUNT_BATCH and batch * per_image_s > share_s:
        batch = max(MIN_COUNT_BATCH, batch // 2)
    return batch


def count_step(s: Setup, per_image_s: float, share_s: float | None) -> StepCount:
    """FLOPs and bytes of one forward and backward of a copy of the setup's model (its batch, image
    size, layout and autocast; the copy keeps the profile's own BatchNorm statistics and gradients
    untouched), scaled to an optimizer step (x accum_steps). Where a step at the batch would not fit
    `share_s`, counted at a halved one and scaled by the batch: exact for the FLOPs (a convolution's
    grow with its images), while the bytes then also scale the weights, an overstatement."""
    batch = s.cfg.train.batch_size
    counted = count_batch(batch, per_image_s, share_s)
    model = copy.deepcopy(unwrap(s.ctx.model)).train()
    for p in model.parameters():
        p.grad = None  # as the engine's zero_grad leaves them: the first backward writes, not adds
    size = s.cfg.data.image_size
    x = torch.randn(counted, s.in_chans, size, size, device=s.device)
    if s.cfg.train.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)

    def forward_backward() -> None:
        with autocast(s.ctx.amp, s.device):
            out = model(x)
        labels = torch.zeros(counted, dtype=torch.long, device=s.device)
        torch.nn.functional.cross_entropy(out.float(), labels).backward()

    flops, bytes_ = count_ops(forward_backward)
    scale = batch / counted * s.cfg.train.accum_steps
    basis = (f"FlopCounterMode and operand bytes of one forward and backward at batch {counted}"
             + (f", x {batch / counted:g} for batch {batch}" if counted != batch else "")
             + (f", x {s.cfg.train.accum_steps} micro-batches" if s.cfg.train.accum_steps > 1 else ""))
    return StepCount({k: v * scale for k, v in flops.items()}, {k: v * scale for k, v in bytes_.items()}, basis)

"""Timing a training setup: region timers, timed steps, and the torch.profiler trace.

Figures come from an un-profiled timed run (region timers only) so that the profiler's own
overhead stays out of them. On CUDA the regions and step boundaries are events on the stream, read
after one wait at the end: a wait per region would serialise host and GPU, slowing the very step
being measured and overstating the data wait; the `torch.profiler` window exists to produce the trace
for TensorBoard/Perfetto (and to count host syncs). Every step here is the engine's own
`micro_step`, so what is measured is what trains.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import os
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

from cnnpipe.config import VariantConfig
from cnnpipe.data.loaders.host import TrainLoader
from cnnpipe.data.store.shards import PreparedSplit
from cnnpipe.malloc import KernelTime, keep_for_inference, usage, use_malloc
from cnnpipe.profile.box import TraceSteps
from cnnpipe.profile.format import REGIONS
from cnnpipe.profile.kernels import busy_fraction, tensor_core_share
from cnnpipe.profile.roofline import OpEvent
from cnnpipe.train import checkpoint as ckpt
from cnnpipe.train.budget import EVAL_BATCH
from cnnpipe.train.distributed import DistInfo, unwrap
from cnnpipe.train.engine import Spans, StepContext, forward_times, micro_step, no_region, sync_device
from cnnpipe.train.parts import build_training, step_context
from cnnpipe.train.tuning import resolve_auto


SYNC_EVENTS = {
    # every `.item()`, `.tolist()` or `if tensor:` reads a scalar back to Python through this op
    "cpu": ("aten::_local_scalar_dense",),
    # on CUDA only the runtime's blocking calls are syncs (a scalar read of a CPU tensor is not)
    "cuda": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
}


class RegionTimer:
    """Time per named region (`Spans`: on CUDA, events on the stream, so nothing waits: the GPU time
    a region queued lands in it, and a data wait counts only where the GPU ran dry waiting for the
    batch); each region is also a profiler label."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device = device
        self.enabled = enabled  # False: labels only (warm-up steps, and the trace, where events would show)
        self._spans = {r: Spans(device) for r in REGIONS}
        self._totals: dict[str, float] = {r: 0.0 for r in REGIONS}

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        with record_function(name):
            if self.enabled:
                with self._spans[name].span():
                    yield
            else:
                yield

    @property
    def totals(self) -> dict[str, float]:
        """Seconds per region so far."""
        for name, spans in self._spans.items():
            self._totals[name] += sum(spans.durations())
        return self._totals


def memory_frac(device: torch.device) -> float | None:
    """Peak reserved memory (what the caching allocator holds, and what runs out first) as a fraction
    of the GPU's, since the last `reset_peak_memory_stats`; None on the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_reserved(device) / torch.cuda.get_device_properties(device).total_memory


class Feed:
    """A loader's batches, epoch after epoch: one per model, shared by every view of its setup."""

    def __init__(self, loader: TrainLoader) -> None:
        self.loader = loader
        self.epoch = 0
        self._iter: Iterator | None = None

    def next(self):
        if self._iter is None:
            self._iter = iter(self.loader)
        try:
            return next(self._iter)
        except StopIteration:
            self.epoch += 1
            self.loader.set_epoch(self.epoch)
            self._iter = iter(self.loader)
            return next(self._iter)


@dataclass
class Setup:
    """A ready-to-step training configuration (engine context and loader) for one variant."""

    cfg: VariantConfig
    ctx: StepContext
    loader: TrainLoader
    images_per_step: int
    steps_per_epoch: int
    split: PreparedSplit
    """The training split its loader reads, opened once for every setup of a profile."""
    step: int = 0
    feed: Feed | None = None
    """Its loader's batches (None: a feed of its own); a view (`under`) shares its setup's."""

    def __post_init__(self) -> None:
        if self.feed is None:
            self.feed = Feed(self.loader)

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def in_chans(self) -> int:
        return self.split.channels

    @property
    def encoding(self) -> str:
        """The store's (`raw` or `jpeg`): whether there is a decode to place."""
        return self.split.encoding

    def next_batch(self):
        return self.feed.next()

    def under(self, **process: Any) -> Setup:
        """This very setup (model, optimizer, loader and its place in the epoch) stepped under other
        process-wide settings (`PROCESS_KNOBS`): a trial's candidate with no second model in memory
        and nothing to build, at whatever batch this one runs. Each view counts its own steps (the
        LR schedule's index): a trial's few steps move neither far from the other."""
        if not set(process) <= set(PROCESS_KNOBS):
            raise ValueError(f"only {PROCESS_KNOBS} change a setup in place, not {sorted(set(process))}")
        return replace(self, cfg=self.cfg.with_train(**process))  # (the same feed: the views share the epoch)


PROCESS_KNOBS = ("malloc",)
"""Knobs that change the process, not the model or its loader: a trial steps the current setup
itself under the candidate (`Setup.under`)."""


def build_setup(cfg: VariantConfig, info: DistInfo, split: PreparedSplit) -> Setup:
    """Model, optimizer, LR schedule and loader built by the same code as `fit`: what is timed is what
    trains. `split`: the training split, opened once per profile (what its store weighs is read once)."""
    cfg = resolve_auto(cfg, info.device)
    torch.manual_seed(cfg.seed)
    parts = build_training(cfg, info, split)
    ctx, _ = step_context(cfg, parts, info, parts.schedule)
    ctx.model.train()
    return Setup(cfg, ctx, parts.loader, parts.global_batch, parts.steps_per_epoch, split)


def train_step(s: Setup, timer: RegionTimer | None = None, limit: int | None = None) -> None:
    """One optimizer step (all its micro-batches), each phase in its own region when `timer` is given;
    `limit`: only the first `limit` images of each batch (the probe). The process's allocator is set
    to the setup's first (`train.malloc`): a trial's blocks alternate between two settings of it."""
    use_malloc(s.cfg.train.malloc)
    region = timer.region if timer is not None else no_region
    accum = s.cfg.train.accum_steps
    for micro in range(accum):
        with region("data_wait"):
            images, labels = s.next_batch()
        if limit is not None:
            images, labels = images[:limit], labels[:limit]
        micro_step(s.ctx, images, labels, s.loader.device_transform, s.step, micro == 0, micro == accum - 1, region)
    s.step += 1


def probe_per_image(s: Setup, images: int) -> float:
    """Seconds per image of one training step on the first `images` images of each micro-batch,
    after one untimed such step (allocation, kernel selection): what sizes the rest of the profile."""
    images = min(images, s.cfg.train.batch_size)
    train_step(s, limit=images)
    sync_device(s.device)
    t0 = time.perf_counter()
    train_step(s, limit=images)
    sync_device(s.device)
    return (time.perf_counter() - t0) / (images * s.cfg.train.accum_steps)


def first_step_s(s: Setup) -> float:
    """Seconds of one step at a shape the setup has not stepped at yet (oneDNN/cuDNN pick and build
    their kernels, the allocator grows): what a training run pays once on top of its steady steps."""
    sync_device(s.device)
    t0 = time.perf_counter()
    train_step(s)
    sync_device(s.device)
    return time.perf_counter() - t0


def checkpoint_write_s(s: Setup, folder: Path) -> float:
    """Seconds to write one last.pt-sized checkpoint (the model and optimizer state, by the
    checkpoint module's own fsynced write) into `folder`, removed after: what training pays per
    checkpoint on this machine's disk."""
    state = {"model": unwrap(s.ctx.model).state_dict(), "optimizer": s.ctx.optimizer.state_dict()}
    path = Path(folder) / ".checkpoint_probe.pt"
    t0 = time.perf_counter()
    try:
        ckpt.save_atomic(state, path)
        return time.perf_counter() - t0
    finally:
        path.unlink(missing_ok=True)


def timed_steps(s: Setup, warmup: int, steps: int) -> tuple[list[float], dict[str, float], float, KernelTime]:
    """(step times, region totals, CPU utilisation, page faults and kernel time) over `steps` steps
    after `warmup`."""
    timer = RegionTimer(s.device, enabled=False)
    for _ in range(warmup):
        train_step(s, timer)
    timer.enabled = True
    sync_device(s.device)
    start, wall0 = usage(), time.perf_counter()
    spans = Spans(s.device)
    for _ in range(steps):
        with spans.span():
            train_step(s, timer)
    times = spans.durations()  # (waits for the device on CUDA)
    kernel = KernelTime.since(start)
    cpu_util = kernel.cpu_s / (time.perf_counter() - wall0) / max(1, torch.get_num_threads())
    return times, timer.totals, cpu_util, kernel


def inference_times(s: Setup, batch: int = EVAL_BATCH, calls: int = 3) -> list[float]:
    """Seconds per forward pass of `batch` images through this setup's model (eval mode, no
    autograd, its precision and layout): the speed validation and `evaluate` run at, for the plan.
    Measured, because a training step's forward share overstates it by up to 2x. Under the allocator
    evaluate runs with (`malloc.keep_for_inference`), whatever the setup trains with: the profile
    times it after its trials, whose blocks this would move off glibc's own thresholds."""
    keep_for_inference()
    return forward_times(unwrap(s.ctx.model), s.in_chans, s.cfg.data.image_size, s.cfg.train.channels_last,
                         s.ctx.amp, s.device, batch=batch, calls=calls)


@dataclass(frozen=True)
class Fp32Timing:
    """How export's fp32 speed is timed (`cpu_fp32_timing`): the model in fp32 on the CPU, a batch,
    timed calls, and the seconds they are expected to take (0: not sized, no box)."""

    model: torch.nn.Module
    """The setup's model copied once, in fp32 on the CPU (host memory, whatever the training device):
    a forward pass's time does not depend on what the trials' steps did to the weights."""
    batch: int
    calls: int
    seconds: float


def cpu_fp32_timing(s: Setup, share_s: float | None = None, calls: int = 2) -> Fp32Timing:
    """How to time this setup's model in fp32 on the CPU, contiguous layout (what export checks) within
    `share_s` seconds: at the eval batch, unless `calls` timed calls and one untimed one do not fit
    there, then at the largest halved batch that does, sized by one call at batch 8 (the CPU's speed
    has nothing to do with a GPU's, so nothing measured before can size it). Under the process's
    allocator as it is: it sizes, it does not time."""
    model = copy.deepcopy(unwrap(s.ctx.model)).float().cpu().to(memory_format=torch.contiguous_format)
    if share_s is None:
        return Fp32Timing(model, EVAL_BATCH, calls, 0.0)
    per_image = forward_times(model, s.in_chans, s.cfg.data.image_size, False, "off", torch.device("cpu"),
                              batch=8, calls=1)[0] / 8
    batch = EVAL_BATCH
    while batch > 8 and (calls + 1) * batch * per_image > share_s:
        batch //= 2
    return Fp32Timing(model, batch, calls, (calls + 1) * batch * per_image)


def cpu_fp32_inference(s: Setup, timing: Fp32Timing) -> float:
    """Images/s of `timing`'s fp32 copy of this setup's model on the CPU, as `timing` says: where and
    how export checks its files (ONNX Runtime runs on the CPU), whatever the training device."""
    keep_for_inference()  # as export runs
    times = forward_times(timing.model, s.in_chans, s.cfg.data.image_size, False, "off", torch.device("cpu"),
                          batch=timing.batch, calls=timing.calls)
    return timing.batch / statistics.median(times)


def trace_window(s: Setup, trace_dir: Path, worker: str, steps: TraceSteps, step_s: float,
                 on_trace_ready: Callable | None = None) -> dict[str, Any]:
    """Run the torch.profiler schedule `steps` and write one TensorBoard trace.

    Returns what only the trace can tell, read from the recorded steps' own spans (`ProfilerStep#N`),
    so nothing outside a step counts: not the trace's export in the last `prof.step()`, not the waits
    that start and end the window. Host syncs per step (on the CPU: scalar reads to Python, which
    cost about a microsecond there) are the sync events inside the step spans. On CUDA, the GPU busy
    share is kernel time per recorded step over `step_s`, the un-profiled step time: kernel
    durations are the GPU's own clock, which the profiler's host-side extras (shapes, memory) do not
    stretch, while a profiled step's wall time is; and the Tensor Core share of matrix-kernel time.
    `trace_step_s` is the median profiled step, for comparison with `step_s`. `op_events`: the
    trace's host events with their self time (kernel time on CUDA), for the roofline's op table
    (`roofline.attribute_self_time`, once the ops are counted); `recorded_steps`: how many steps they span.
    """
    trace_dir.mkdir(parents=True, exist_ok=True)
    for stale in trace_dir.glob("*.pt.trace.json*"):
        stale.unlink()  # one trace per worker: no stray files from earlier runs
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device.type == "cuda" else [])
    if s.device.type == "cpu":
        # A CUDA build of torch on a machine without a GPU makes kineto log an ERROR line (its GPU
        # probe) and trace markers on every start; on a CPU-only trace nothing it logs is ours to act on.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    handler = on_trace_ready or tensorboard_trace_handler(str(trace_dir), worker_name=worker)
    timer = RegionTimer(s.device, enabled=False)  # labels only: events would show up in the trace
    with profile(activities=activities, schedule=schedule(wait=steps.wait, warmup=steps.warmup,
                                                          active=steps.active, repeat=1),
                 on_trace_ready=handler, record_shapes=True, profile_memory=True) as prof:
        for _ in range(steps.total):
            train_step(s, timer)
            prof.step()
    events = list(prof.events())
    # (kineto also marks each step on the GPU's timeline: the host's marks are the step spans)
    spans = [(e.time_range.start, e.time_range.end) for e in events
             if e.name.startswith("ProfilerStep") and e.device_type == DeviceType.CPU]
    recorded = len(spans) or steps.active
    kernels = [(e.key, e.self_device_time_total) for e in prof.key_averages()
               if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    sync_events = SYNC_EVENTS["cuda" if s.device.type == "cuda" else "cpu"]
    syncs = count_inside([e.time_range.start for e in events if e.name in sync_events], spans)
    cuda = s.device.type == "cuda"
    return {"host_syncs_per_step": syncs / recorded,
            "trace_step_s": statistics.median(b - a for a, b in spans) / 1e6 if spans else None,
            "gpu_busy_frac": busy_fraction(kernels, recorded * step_s * 1e6) if cuda else None,
            "gpu_busy_basis": "kernel time per recorded step / un-profiled step time" if cuda else None,
            "tensor_core_frac": tensor_core_share(kernels) if cuda else None,
            "recorded_steps": recorded, "op_events": op_events(events, cuda)}


def op_events(events: list, cuda: bool) -> list[OpEvent]:
    """The trace's host events as `OpEvent`s (parents by index), each with its self time: the host's
    on the CPU, the kernels' it launched on CUDA (where the host only queues work)."""
    host = [e for e in events if e.device_type == DeviceType.CPU]
    index = {id(e): i for i, e in enumerate(host)}
    return [OpEvent(e.name, index.get(id(e.cpu_parent)) if e.cpu_parent is not None else None,
                    e.self_device_time_total if cuda else e.self_cpu_time_total, bool(e.is_user_annotation)
                    or e.name.startswith("ProfilerStep"))
            for e in host]


def count_inside(times: list[float], spans: list[tuple[float, float]]) -> int:
    """How many of `times` fall inside any of `spans` (ends included): each time looked up by bisection
    in the spans' sorted union, so a long trace's thousands of events cost no more than a sort."""
    starts: list[float] = []
    ends: list[float] = []
    for a, b in sorted(spans):
        if starts and a <= ends[-1]:  # overlapping or touching: one interval
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    hits = 0
    for t in times:
        i = bisect.bisect_right(starts, t) - 1
        hits += i >= 0 and t <= ends[i]
    return hits


def fractions(totals: dict[str, float]) -> dict[str, float]:
    """Region totals → fractions of their sum (so they add up to 1)."""
    total = sum(totals.values()) or 1.0
    return {k: v / total for k, v in totals.items()}


def iqr(values: list[float]) -> float:
    if len(values) < 4:
        return max(values) - min(values)
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]

"""The profile stage: step-time breakdown, a TensorBoard trace, a diagnosis and measured trials.

Figures come from an un-profiled timed run (region timers only, synchronised on CUDA) so that the
profiler's own overhead stays out of them; the `torch.profiler` window that follows exists to
produce the trace for TensorBoard/Perfetto.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

from .config import RunConfig
from .data.loaders import TrainLoader
from .diagnosis import Facts, diagnose
from .distributed import DistInfo
from .monitor import peak_mem_mb
from .precision import autocast
from .schedule import scaled_lr
from .trainer import build_training
from .tuning import auto_knobs, resolve_auto

REGIONS = ("data_wait", "copy", "augment", "forward", "backward", "optimizer", "sync")


class RegionTimer:
    """Accumulates wall time per named region; each region is also a profiler label."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.totals: dict[str, float] = {r: 0.0 for r in REGIONS}
        self.enabled = True

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        with record_function(name):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # attribute GPU work to the region that queued it
            t0 = time.perf_counter()
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if self.enabled:
                self.totals[name] += time.perf_counter() - t0


@dataclass
class Setup:
    """A ready-to-step training configuration (model, optimizer, loader) for one variant."""

    cfg: RunConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loader: TrainLoader
    amp: str
    scaler: Any
    device: torch.device
    _iter: Iterator | None = None
    _epoch: int = 0

    def next_batch(self):
        if self._iter is None:
            self._iter = iter(self.loader)
        try:
            return next(self._iter)
        except StopIteration:
            self._epoch += 1
            self.loader.set_epoch(self._epoch)
            self._iter = iter(self.loader)
            return next(self._iter)


def build_setup(cfg: RunConfig, info: DistInfo, prepared_dir: Path) -> Setup:
    """Model, optimizer and loader built by the same code as `fit`."""
    cfg = resolve_auto(cfg, info.device)
    torch.manual_seed(cfg.seed)
    parts = build_training(cfg, info, prepared_dir)
    peak_lr = scaled_lr(cfg.train.lr, cfg.train.batch_size * info.world_size)
    for group in parts.optimizer.param_groups:
        group["lr"] = peak_lr * 0.1  # a small constant LR: the profile measures speed, not learning
    return Setup(cfg, parts.model, parts.optimizer, parts.loader, parts.amp, parts.scaler, info.device)


def train_step(s: Setup, timer: RegionTimer) -> None:
    """One training step with every phase in its own timed, labelled region."""
    s.model.train()
    with timer.region("data_wait"):
        images, labels = s.next_batch()
    with timer.region("copy"):
        images = images.to(s.device, non_blocking=True)
        labels = labels.to(s.device, non_blocking=True)
    with timer.region("augment"):
        x = s.loader.device_transform(images)
    with timer.region("forward"):
        with autocast(s.amp, s.device):
            loss = F.cross_entropy(s.model(x), labels, label_smoothing=s.cfg.train.label_smoothing)
    with timer.region("backward"):
        (s.scaler.scale(loss) if s.scaler is not None else loss).backward()
    with timer.region("optimizer"):
        if s.scaler is not None:
            s.scaler.step(s.optimizer)
            s.scaler.update()
        else:
            s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
    with timer.region("sync"):
        loss.item()  # the trainer's NaN guard reads the loss; on CUDA this is the step's sync point


def timed_steps(s: Setup, warmup: int, steps: int) -> tuple[list[float], dict[str, float], float]:
    """(step times, region totals, CPU utilisation) over `steps` steps after `warmup`."""
    timer = RegionTimer(s.device)
    timer.enabled = False
    for _ in range(warmup):
        train_step(s, timer)
    timer.enabled = True
    times = []
    cpu0, wall0 = _cpu_seconds(), time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        train_step(s, timer)
        times.append(time.perf_counter() - t0)
    cpu_util = (_cpu_seconds() - cpu0) / (time.perf_counter() - wall0) / max(1, torch.get_num_threads())
    return times, timer.totals, cpu_util


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def trace_window(s: Setup, cfg: RunConfig, trace_dir: Path, worker: str) -> None:
    """Run the torch.profiler schedule (wait, warmup, active) and write one TensorBoard trace."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    for stale in trace_dir.glob("*.pt.trace.json*"):
        stale.unlink()  # one trace per worker: no stray files from earlier runs
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device.type == "cuda" else [])
    p = cfg.profile
    timer = RegionTimer(s.device)
    with profile(activities=activities, schedule=schedule(wait=p.wait, warmup=p.warmup, active=p.active, repeat=1),
                 on_trace_ready=tensorboard_trace_handler(str(trace_dir), worker_name=worker),
                 record_shapes=True, profile_memory=True) as prof:
        for _ in range(p.wait + p.warmup + p.active):
            train_step(s, timer)
            prof.step()


def fractions(totals: dict[str, float]) -> dict[str, float]:
    """Region totals → fractions of their sum (so they add up to 1)."""
    total = sum(totals.values()) or 1.0
    return {k: v / total for k, v in totals.items()}


def measure(cfg: RunConfig, info: DistInfo, prepared_dir: Path, steps: int) -> dict[str, Any]:
    """Median step time, throughput and breakdown of `cfg` over `steps` un-profiled steps."""
    s = build_setup(cfg, info, prepared_dir)
    times, totals, cpu_util = timed_steps(s, warmup=1, steps=steps)
    med = statistics.median(times)
    return {"step_time_median_s": med, "step_time_iqr_s": _iqr(times), "steps": len(times),
            "throughput_img_s": cfg.train.batch_size * info.world_size / med,
            "fractions": fractions(totals), "cpu_util": cpu_util, "setup": s}


def _iqr(values: list[float]) -> float:
    if len(values) < 4:
        return max(values) - min(values)
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


def trials(cfg: RunConfig, info: DistInfo, prepared_dir: Path, base: dict[str, Any],
           tune_workers: bool = False) -> list[dict[str, Any]]:
    """Flip each knob of `cfg` in turn and measure it against `base` (same steps, same data)."""
    t = cfg.train
    knobs: list[tuple[str, dict[str, Any]]] = [
        ("amp", {"amp": "off" if t.amp != "off" else "bf16"}),
        ("channels_last", {"channels_last": not t.channels_last}),
        ("batch_size", {"batch_size": t.batch_size * 2}),
        ("loader", {"loader": "fast" if t.loader == "baseline" else "baseline"}),
    ]
    if tune_workers:
        cores = os.cpu_count() or 1
        knobs.append(("num_workers", {"num_workers": 0 if t.num_workers else min(2, cores)}))
    results = []
    for knob, change in knobs:
        trial_cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, **change))
        m = measure(trial_cfg, info, prepared_dir, cfg.profile.trial_steps)
        m.pop("setup")
        results.append({"knob": knob, "change": {k: str(v) for k, v in change.items()},
                        "throughput_img_s": m["throughput_img_s"], "step_time_median_s": m["step_time_median_s"],
                        "speedup_vs_current": m["throughput_img_s"] / base["throughput_img_s"],
                        "data_wait_frac": m["fractions"]["data_wait"]})
    return results


def tuned_settings(requested: RunConfig, current: RunConfig, trial_results: list[dict[str, Any]]) -> dict[str, Any]:
    """A value for each knob `requested` leaves at `auto`: the trial's when it beat the default by 3%."""
    tuned: dict[str, Any] = {}
    for knob in auto_knobs(requested):
        value = getattr(current.train, knob)
        trial = next((r for r in trial_results if r["knob"] == knob), None)
        if trial is not None and trial["speedup_vs_current"] > 1.03:
            value = trial["change"][knob]
            value = {"True": True, "False": False}.get(value, value)
            value = int(value) if knob == "num_workers" else value
        tuned[knob] = value
    return tuned


def profile_variant(requested: RunConfig, info: DistInfo, prepared_dir: Path, trace_dir: Path,
                    run_trials: bool) -> dict[str, Any]:
    """Everything metrics/profile/<variant>.json holds (`tuned`: values for the `auto` knobs)."""
    cfg = resolve_auto(requested, info.device)  # profile the defaults; the trials test the alternatives
    base = measure(cfg, info, prepared_dir, max(cfg.profile.active, cfg.profile.trial_steps))
    setup = base.pop("setup")
    trace_window(setup, cfg, trace_dir, worker=f"{cfg.variant}_rank{info.rank}")
    batch_gain = None
    trial_results: list[dict[str, Any]] = []
    if run_trials:
        trial_results = trials(cfg, info, prepared_dir, base, tune_workers="num_workers" in auto_knobs(requested))
        batch_gain = next(r["speedup_vs_current"] for r in trial_results if r["knob"] == "batch_size")
    util = base["cpu_util"] if info.device.type == "cpu" else None
    mem_frac = None
    if info.device.type == "cuda":
        mem_frac = torch.cuda.max_memory_allocated(info.device) / torch.cuda.get_device_properties(info.device).total_memory
    t = cfg.train
    facts = Facts(fractions=base["fractions"], device=info.device.type, amp=setup.amp,
                  channels_last=t.channels_last, loader=t.loader, num_workers=t.num_workers,
                  batch_size=t.batch_size, utilization=util, memory_frac=mem_frac, batch_gain=batch_gain)
    label, recs = diagnose(facts)
    rec_dicts = []
    for rec in recs:
        entry = rec.to_dict()
        trial = next((r for r in trial_results if r["knob"] == rec.knob), None)
        if trial is not None:  # the recommendation's knob was measured: before/after numbers
            entry["measured"] = {"before_img_s": base["throughput_img_s"], "after_img_s": trial["throughput_img_s"],
                                 "speedup": trial["speedup_vs_current"], "change": trial["change"]}
        rec_dicts.append(entry)
    return {
        "variant": cfg.variant,
        "device": info.device.type,
        "threads": torch.get_num_threads(),
        "amp": setup.amp,
        "batch_size": t.batch_size,
        "step_time_median_s": base["step_time_median_s"],
        "step_time_iqr_s": base["step_time_iqr_s"],
        "steps_timed": base["steps"],
        "throughput_img_s": base["throughput_img_s"],
        "fractions": base["fractions"],
        "cpu_util": base["cpu_util"],
        "peak_mem_mb": peak_mem_mb(info.device),
        "memory_frac": mem_frac,
        "bottleneck": label,
        "recommendations": rec_dicts,
        "trials": trial_results,
        "tuned": tuned_settings(requested, cfg, trial_results),
        "trace_dir": str(trace_dir),
    }

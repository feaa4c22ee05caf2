"""The profile stage: step-time breakdown, a TensorBoard trace, a diagnosis and measured trials.

Figures come from an un-profiled timed run (region timers only, synchronised on CUDA) so that the
profiler's own overhead stays out of them; the `torch.profiler` window that follows exists to
produce the trace for TensorBoard/Perfetto (and to count host syncs). Every step here is the
engine's own `micro_step`, so what is profiled is what trains.
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
import yaml
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

from .config import VariantConfig
from .data.loaders import TrainLoader
from .diagnosis import MEMORY_FRAC, Facts, Recommendation, diagnose
from .distributed import DistInfo
from .engine import StepContext, micro_step, no_region
from .files import write_json, write_text
from .kernels import busy_fraction, tensor_core_share
from .monitor import peak_mem_mb
from .profile_format import REGIONS, all_trials
from .schedule import MIN_BATCH, scaled_lr
from .trainer import build_training, step_context
from .tuning import auto_knobs, resolve_auto

SYNC_EVENTS = {
    # every `.item()`, `.tolist()` or `if tensor:` reads a scalar back to Python through this op
    "cpu": ("aten::_local_scalar_dense",),
    # on CUDA only the runtime's blocking calls are syncs (a scalar read of a CPU tensor is not)
    "cuda": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
}


class RegionTimer:
    """Accumulates wall time per named region; each region is also a profiler label."""

    def __init__(self, device: torch.device, sync: bool = True) -> None:
        self.device = device
        self.sync = sync  # False: labels only (the trace), so the device keeps its real overlap
        self.totals: dict[str, float] = {r: 0.0 for r in REGIONS}
        self.enabled = True

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        with record_function(name):
            if self.sync:
                _sync(self.device)  # attribute GPU work to the region that queued it
            t0 = time.perf_counter()
            yield
            if self.sync:
                _sync(self.device)
            if self.enabled:
                self.totals[name] += time.perf_counter() - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _memory_frac(device: torch.device) -> float | None:
    """Peak allocated memory as a fraction of the GPU's; None on the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / torch.cuda.get_device_properties(device).total_memory


@dataclass
class Setup:
    """A ready-to-step training configuration (engine context and loader) for one variant."""

    cfg: VariantConfig
    ctx: StepContext
    loader: TrainLoader
    images_per_step: int
    steps_per_epoch: int
    step: int = 0
    _iter: Iterator | None = None
    _epoch: int = 0

    @property
    def device(self) -> torch.device:
        return self.ctx.device

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


def build_setup(cfg: VariantConfig, info: DistInfo, prepared_dir: Path) -> Setup:
    """Model, optimizer and loader built by the same code as `fit`, at a small constant LR."""
    cfg = resolve_auto(cfg, info.device)
    torch.manual_seed(cfg.seed)
    t = cfg.train
    parts = build_training(cfg, info, prepared_dir)
    lr = scaled_lr(t.lr, t.batch_size * info.world_size * t.accum_steps) * 0.1  # speed, not learning
    ctx, _ = step_context(cfg, parts, info, lambda step: lr)
    ctx.model.train()
    return Setup(cfg, ctx, parts.loader, t.batch_size * info.world_size * t.accum_steps,
                 max(1, len(parts.loader) // t.accum_steps))


def train_step(s: Setup, timer: RegionTimer | None = None) -> None:
    """One optimizer step (all its micro-batches), each phase in its own region when `timer` is given."""
    region = timer.region if timer is not None else no_region
    accum = s.cfg.train.accum_steps
    for micro in range(accum):
        with region("data_wait"):
            images, labels = s.next_batch()
        micro_step(s.ctx, images, labels, s.loader.device_transform, s.step, micro == 0, micro == accum - 1, region)
    s.step += 1


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


def trace_window(s: Setup, trace_dir: Path, worker: str) -> dict[str, float | None]:
    """Run the torch.profiler schedule (wait, warmup, active) and write one TensorBoard trace.

    Returns what only the trace can tell: host syncs per step (on the CPU: scalar reads to Python,
    which cost about a microsecond there) and, on CUDA, the GPU busy fraction
    and the Tensor Core share of matrix-kernel time (both taken over the active steps, under the
    profiler, so the busy fraction is a slight underestimate).
    """
    trace_dir.mkdir(parents=True, exist_ok=True)
    for stale in trace_dir.glob("*.pt.trace.json*"):
        stale.unlink()  # one trace per worker: no stray files from earlier runs
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device.type == "cuda" else [])
    p = s.cfg.profile
    timer = RegionTimer(s.device, sync=False)  # the trace shows the real overlap; syncs would be counted
    with profile(activities=activities, schedule=schedule(wait=p.wait, warmup=p.warmup, active=p.active, repeat=1),
                 on_trace_ready=tensorboard_trace_handler(str(trace_dir), worker_name=worker),
                 record_shapes=True, profile_memory=True) as prof:
        for i in range(p.wait + p.warmup + p.active):
            if i == p.wait + p.warmup:
                _sync(s.device)
                t_active = time.perf_counter()
            train_step(s, timer)
            prof.step()
        _sync(s.device)
        wall_us = (time.perf_counter() - t_active) * 1e6
    events = prof.key_averages()
    kernels = [(e.key, e.self_device_time_total) for e in events if e.device_type == DeviceType.CUDA]
    sync_events = SYNC_EVENTS["cuda" if s.device.type == "cuda" else "cpu"]
    return {"host_syncs_per_step": sum(e.count for e in events if e.key in sync_events) / p.active,
            "gpu_busy_frac": busy_fraction(kernels, wall_us) if s.device.type == "cuda" else None,
            "tensor_core_frac": tensor_core_share(kernels) if s.device.type == "cuda" else None}


def fractions(totals: dict[str, float]) -> dict[str, float]:
    """Region totals → fractions of their sum (so they add up to 1)."""
    total = sum(totals.values()) or 1.0
    return {k: v / total for k, v in totals.items()}


def _iqr(values: list[float]) -> float:
    if len(values) < 4:
        return max(values) - min(values)
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


# ---- measured tuning -------------------------------------------------------------------------

@dataclass
class Trial:
    """One candidate setting measured against the current one, interleaved in the same run."""

    knob: str
    change: dict[str, Any]
    speedup: float = 0.0
    """Median over rounds of candidate/current throughput."""
    speedup_range: tuple[float, float] = (0.0, 0.0)
    before_img_s: float = 0.0
    after_img_s: float = 0.0
    win: bool = False
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"knob": self.knob, "change": self.change, "speedup": self.speedup,
                "speedup_range": list(self.speedup_range), "before_img_s": self.before_img_s,
                "after_img_s": self.after_img_s, "win": self.win, "note": self.note}


CLEAR_LOSS = 0.5
"""A candidate below this speed ratio in a round is a clear loser: its trial stops at once."""


def _block(s: Setup, steps: int) -> list[float]:
    """`steps` timed steps after one untimed step that re-warms caches and the loader after a switch."""
    train_step(s)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        train_step(s)
        _sync(s.device)
        times.append(time.perf_counter() - t0)
    return times


def paired_trial(knob: str, change: dict[str, Any], current: Setup, candidate: Setup, rounds: int, steps: int,
                 min_gain: float) -> Trial:
    """Interleave blocks of `current` and `candidate` (ABBA order, so drift hits both alike).

    This VM's speed drifts by tens of percent over minutes; a ratio per round of neighbouring
    blocks cancels that, and a win must beat `min_gain` at the median and hold in every round.
    A candidate slower in any of the first two rounds can no longer win, so it stops there; one
    under half the speed stops after the first round (no drift explains a 2x gap, and on a CPU
    without native bf16 a bf16 step is ~10x slower: a second round would cost minutes).
    """
    ratios, before, after = [], [], []
    for r in range(rounds):
        pair = (current, candidate) if r % 2 == 0 else (candidate, current)
        times = {id(s): _block(s, steps) for s in pair}
        a, b = statistics.median(times[id(current)]), statistics.median(times[id(candidate)])
        before.append(current.images_per_step / a)
        after.append(candidate.images_per_step / b)
        ratios.append(after[-1] / before[-1])
        clear_loss = len(ratios) == 1 and ratios[0] < CLEAR_LOSS  # later rounds: the rule below covers it
        if clear_loss or (len(ratios) >= 2 and min(ratios) <= 1.0):
            break
    speedup = statistics.median(ratios)
    note = ""
    if len(ratios) < rounds:
        note = (f"stopped after 1 round: under {CLEAR_LOSS:.0%} of the speed" if len(ratios) == 1
                else f"stopped after {len(ratios)} rounds: slower in one")
    return Trial(knob, change, speedup, (min(ratios), max(ratios)), statistics.median(before),
                 statistics.median(after), win=speedup >= 1 + min_gain and min(ratios) > 1.0, note=note)


def candidates(cfg: VariantConfig, requested: VariantConfig, device: torch.device,
               recommended: set[str]) -> list[tuple[str, dict[str, Any]]]:
    """(knob, change) pairs to measure: every `auto` knob, plus the knobs the diagnosis points at.

    amp, channels_last and the loader are always measured (cheap, and the report shows each one's
    gain over its hand setting); workers, pin_memory and compile only when asked for.
    """
    t, auto = cfg.train, set(auto_knobs(requested))
    out: list[tuple[str, dict[str, Any]]] = []
    amps = ["off", "bf16"] + (["fp16"] if device.type == "cuda" else [])
    out += [("amp", {"amp": a}) for a in amps if a != t.amp]
    out.append(("channels_last", {"channels_last": not t.channels_last}))
    out.append(("loader", {"loader": "fast" if t.loader == "baseline" else "baseline"}))
    if "num_workers" in auto or recommended & {"num_workers", "loader"}:  # workers also hide a slow loader
        cores = len(os.sched_getaffinity(0))
        options = sorted({n for n in (1, 2, 4, 8, cores) if n <= cores} | {0})
        out += [("num_workers", {"num_workers": n}) for n in options if n != t.num_workers]
    if device.type == "cuda" and ("pin_memory" in auto or "num_workers" in recommended):
        out.append(("pin_memory", {"pin_memory": not t.pin_memory}))
    if "compile" in auto and t.compile == "off":
        out.append(("compile", {"compile": "default"}))
    return out


def run_trials(cfg: VariantConfig, requested: VariantConfig, info: DistInfo, prepared_dir: Path, current: Setup,
               recommended: set[str]) -> list[Trial]:
    """Measure each candidate against `current`, then grow the batch while it pays."""
    p = cfg.profile
    results = []
    for knob, change in candidates(cfg, requested, info.device, recommended):
        if knob == "compile":
            results.append(compile_trial(cfg, info, prepared_dir, current))
            continue
        candidate = build_setup(cfg.with_train(**change), info, prepared_dir)
        results.append(paired_trial(knob, change, current, candidate, p.trial_rounds, p.trial_steps, p.min_gain))
        del candidate
    results += batch_trials(cfg, info, prepared_dir, current)
    return results


def batch_trials(cfg: VariantConfig, info: DistInfo, prepared_dir: Path, current: Setup,
                 max_doublings: int = 2) -> list[Trial]:
    """Double the batch while each doubling adds `min_gain`, memory stays under the memory rule's
    threshold and nothing OOMs."""
    p, results, previous = cfg.profile, [], None
    for k in range(1, max_doublings + 1):
        change = {"batch_size": cfg.train.batch_size * 2 ** k}
        if info.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(info.device)  # the peak below is this candidate's
        try:
            candidate = build_setup(cfg.with_train(**change), info, prepared_dir)
            trial = paired_trial("batch_size", change, current, candidate, p.trial_rounds, p.trial_steps, p.min_gain)
            del candidate
        except torch.OutOfMemoryError:
            results.append(Trial("batch_size", change, note="out of memory"))
            break
        finally:
            if info.device.type == "cuda":
                torch.cuda.empty_cache()
        used = _memory_frac(info.device)
        if used is not None and used > MEMORY_FRAC:
            trial.win, trial.note = False, f"peak memory {used:.0%} of the device"
        if previous is not None and trial.win and trial.speedup < previous.speedup * (1 + p.min_gain):
            trial.win = False
            trial.note = f"under {p.min_gain:.0%} more than batch {previous.change['batch_size']}"
        results.append(trial)
        if not trial.win:
            break
        previous = trial
    return results


BATCH_SENSITIVE = ("channels_last",)
"""Knobs re-measured at each smaller batch: oneDNN's NHWC convolutions win at batch 256 and lose
at 64 in fp32 on a one-core CPU (0.94x and 1.09x for NCHW, measured), so a layout tuned at the
profiled batch can be the wrong one for a short run's batch."""


def smaller_batch_trials(requested: VariantConfig, cfg: VariantConfig, info: DistInfo, prepared_dir: Path,
                         current: Setup, tuned: dict[str, Any], tuned_gain: float) -> list[dict[str, Any]]:
    """Speed of each batch `train.min_steps` may halve to, and the batch-sensitive `auto` knobs
    re-tuned there.

    The batch itself is never tuned for speed (it changes the optimisation); the plan multiplies
    the recipe's speed by `speed_vs_tuned`, and training takes `at_batch` values at that batch.
    """
    if cfg.train.min_steps is None:
        return []
    p, out, batch = cfg.profile, [], cfg.train.batch_size // 2
    recipe = cfg.with_train(**tuned)
    while batch >= MIN_BATCH:
        at_batch = build_setup(recipe.with_train(batch_size=batch), info, prepared_dir)
        trial = paired_trial("smaller_batch", {"batch_size": batch}, current, at_batch, p.trial_rounds,
                             p.trial_steps, 1.0)
        trial.win = False
        entry, gain = trial.to_dict(), 1.0
        entry["at_batch"], entry["knob_trials"] = {}, []
        for knob in (k for k in BATCH_SENSITIVE if k in auto_knobs(requested)):
            flip = {knob: not getattr(recipe.train, knob), "batch_size": batch}
            other = build_setup(recipe.with_train(**flip), info, prepared_dir)
            knob_trial = paired_trial(knob, flip, at_batch, other, p.trial_rounds, p.trial_steps, p.min_gain)
            entry["knob_trials"].append(knob_trial.to_dict())
            if knob_trial.win:
                entry["at_batch"][knob], gain = flip[knob], gain * knob_trial.speedup
            del other
        entry["speed_vs_tuned"] = trial.speedup * gain / tuned_gain
        out.append(entry)
        del at_batch
        batch //= 2
    return out


def compile_trial(cfg: VariantConfig, info: DistInfo, prepared_dir: Path, current: Setup) -> Trial:
    """torch.compile, judged over the whole run: the per-step gain must repay the compile time."""
    p, change = cfg.profile, {"compile": "default"}
    try:
        candidate = build_setup(cfg.with_train(**change), info, prepared_dir)
        t0 = time.perf_counter()
        train_step(candidate)  # compiles forward and backward
        _sync(info.device)
        first_step_s = time.perf_counter() - t0
        trial = paired_trial("compile", change, current, candidate, p.trial_rounds, p.trial_steps, p.min_gain)
    except Exception as exc:  # inductor needs a C++ compiler (CPU) or Triton (CUDA); report, do not fail
        return Trial("compile", change, note=f"compile failed: {type(exc).__name__}: {str(exc)[:200]}")
    step_eager = current.images_per_step / trial.before_img_s
    step_compiled = candidate.images_per_step / trial.after_img_s
    compile_s = max(0.0, first_step_s - step_compiled)
    total_steps = cfg.train.epochs * current.steps_per_epoch
    run_gain = (step_eager * total_steps) / (step_compiled * total_steps + compile_s)
    trial.note = (f"compile took {compile_s:.0f} s; {run_gain:.2f}x over the run's {total_steps} steps "
                  f"(per step {trial.speedup:.2f}x)")
    trial.win = trial.win and run_gain >= 1 + p.min_gain
    return trial


def tuned_settings(requested: VariantConfig, current: VariantConfig, results: list[Trial]) -> dict[str, Any]:
    """A value for each knob `requested` leaves at `auto`: the best winning trial's, else the default."""
    tuned = {knob: getattr(current.train, knob) for knob in auto_knobs(requested)}
    for knob in tuned:
        wins = [t for t in results if t.knob == knob and t.win]
        if wins:
            tuned[knob] = max(wins, key=lambda t: t.speedup).change[knob]
    return tuned


def confirm_combined(requested: VariantConfig, current: VariantConfig, info: DistInfo, prepared_dir: Path,
                     base: Setup, results: list[Trial], tuned: dict[str, Any]) -> tuple[dict[str, Any], Trial | None]:
    """Knobs that each won alone are measured together; when the mix does not win, only the best
    single change is kept (so the recipe never ships an unmeasured combination)."""
    changed = {k: v for k, v in tuned.items() if v != getattr(current.train, k)}
    if len(changed) < 2:
        return tuned, None
    p = current.profile
    candidate = build_setup(current.with_train(**changed), info, prepared_dir)
    combined = paired_trial("combined", changed, base, candidate, p.trial_rounds, p.trial_steps, p.min_gain)
    if combined.win:
        return tuned, combined
    best = max((t for t in results if t.win and t.knob in changed), key=lambda t: t.speedup)
    combined.note = f"the mix did not win; kept only {best.knob}={best.change[best.knob]}"
    kept = {k: (best.change[k] if k == best.knob else getattr(current.train, k)) for k in tuned}
    return kept, combined


def recommended_together(cfg: VariantConfig, info: DistInfo, prepared_dir: Path, base: Setup, results: list[Trial],
                         knobs: list[str]) -> Trial | None:
    """The recommended knobs applied at once: they interact (bf16 convolutions want NHWC in oneDNN
    and cuDNN), so the sum of one-at-a-time gains understates what following the advice buys."""
    together = {}
    for knob in knobs:
        measured = [t for t in results if t.knob == knob and t.speedup]
        if measured and knob not in together:
            together.update(max(measured, key=lambda t: t.speedup).change)
    if len(together) < 2:
        return None
    p = cfg.profile
    candidate = build_setup(cfg.with_train(**together), info, prepared_dir)
    return paired_trial("recommended", together, base, candidate, p.trial_rounds, p.trial_steps, p.min_gain)


# ---- the stage -------------------------------------------------------------------------------

def tuned_speedup(current: VariantConfig, tuned: dict[str, Any], results: list[Trial],
                  combined: Trial | None) -> float:
    """Measured speed-up of the tuned values over the profiled (current) ones; 1.0 when unchanged.

    The plan multiplies the profiled throughput by this to predict the recipe training will run.
    """
    changed = {k: v for k, v in tuned.items() if v != getattr(current.train, k)}
    if not changed:
        return 1.0
    if combined is not None and combined.win and combined.change == changed:
        return combined.speedup
    single = [t for t in results if t.win and t.change == changed]
    return max(t.speedup for t in single) if single else 1.0


def _best_batch(results: list[Trial]) -> Trial | None:
    """The largest batch whose doubling still won, else the first (losing) doubling, else None."""
    batch = [r for r in results if r.knob == "batch_size" and r.speedup]
    wins = [r for r in batch if r.win]
    return wins[-1] if wins else (batch[0] if batch else None)


def _with_measurement(rec: Recommendation, results: list[Trial]) -> dict[str, Any]:
    """The recommendation, plus before/after numbers from the same run when a trial measured its knob."""
    entry = rec.to_dict()
    measured = [r for r in results if r.knob == rec.knob and r.speedup]
    if measured:
        best = max(measured, key=lambda r: r.speedup)
        entry["measured"] = {"before_img_s": best.before_img_s, "after_img_s": best.after_img_s,
                             "speedup": best.speedup, "change": best.change, "win": best.win}
    return entry


def profile_variant(requested: VariantConfig, info: DistInfo, prepared_dir: Path, trace_dir: Path,
                    with_trials: bool) -> dict[str, Any]:
    """Everything metrics/profile/<variant>.json holds (`tuned`: values for the `auto` knobs)."""
    cfg = resolve_auto(requested, info.device)  # profile the defaults; the trials test the alternatives
    p, t = cfg.profile, cfg.train
    base = build_setup(cfg, info, prepared_dir)
    times, totals, cpu_util = timed_steps(base, warmup=1, steps=max(p.active, p.trial_steps * p.trial_rounds))
    step_s = statistics.median(times)
    traced = trace_window(base, trace_dir, worker=f"{cfg.variant}_rank{info.rank}")
    mem_frac = _memory_frac(info.device)
    facts = Facts(fractions=fractions(totals), device=info.device.type, amp=base.ctx.amp,
                  channels_last=t.channels_last, loader=t.loader, num_workers=t.num_workers, batch_size=t.batch_size,
                  utilization=cpu_util if info.device.type == "cpu" else traced["gpu_busy_frac"],
                  memory_frac=mem_frac, host_syncs_per_step=traced["host_syncs_per_step"],
                  tensor_core_frac=traced["tensor_core_frac"])
    results: list[Trial] = []
    tuned = {k: getattr(t, k) for k in auto_knobs(requested)}
    combined, smaller = None, []
    if with_trials:
        recommended = {r.knob for r in diagnose(facts)[1] if r.knob}
        results = run_trials(cfg, requested, info, prepared_dir, base, recommended)
        best = _best_batch(results)
        facts = dataclasses.replace(facts, batch_gain=best.speedup if best else None,
                                    best_batch=best.change["batch_size"] if best else None)
        tuned, combined = confirm_combined(requested, cfg, info, prepared_dir, base, results,
                                           tuned_settings(requested, cfg, results))
        smaller = smaller_batch_trials(requested, cfg, info, prepared_dir, base, tuned,
                                       tuned_speedup(cfg, tuned, results, combined))
    at_batch = {e["change"]["batch_size"]: e["at_batch"] for e in smaller if e["at_batch"]}
    label, recs = diagnose(facts)
    if with_trials and combined is None:
        combined = recommended_together(cfg, info, prepared_dir, base, results,
                                        [r.knob for r in recs if r.knob and r.knob != "batch_size"])
    return {
        "variant": cfg.variant,
        "device": info.device.type,
        "threads": torch.get_num_threads(),
        "amp": base.ctx.amp,
        "batch_size": t.batch_size,
        "step_time_median_s": step_s,
        "step_time_iqr_s": _iqr(times),
        "steps_timed": len(times),
        "throughput_img_s": base.images_per_step / step_s,
        "fractions": facts.fractions,
        "cpu_util": cpu_util,
        **traced,
        "peak_mem_mb": peak_mem_mb(info.device),
        "memory_frac": mem_frac,
        "bottleneck": label,
        "recommendations": [_with_measurement(rec, results) for rec in recs],
        "trials": [r.to_dict() for r in results],
        "combined_trial": combined.to_dict() if combined else None,
        "min_gain": p.min_gain,
        "trial_rounds": p.trial_rounds,
        # `at_batch`: values that differ at a batch `train.min_steps` may pick (training applies them there).
        "tuned": {**tuned, "at_batch": at_batch} if at_batch else tuned,
        "tuned_speedup": tuned_speedup(cfg, tuned, results, combined),
        "smaller_batches": smaller,
        "trace_dir": str(trace_dir),
    }


# ---- outputs ---------------------------------------------------------------------------------

def save_profile(result: dict[str, Any], out_dir: Path) -> None:
    """`<variant>.json` and `<variant>_tuned.yaml` (only the `auto` knobs, so explicit recipes get
    an empty, stable file that training can depend on)."""
    variant = result["variant"]
    write_json(Path(out_dir) / f"{variant}.json", result)
    write_text(Path(out_dir) / f"{variant}_tuned.yaml", yaml.safe_dump(result["tuned"], sort_keys=True))


def summary(result: dict[str, Any]) -> str:
    """The lines the stage prints: breakdown, bottleneck, advice, trials and tuned values."""
    shares = ", ".join(f"{k} {v:.0%}" for k, v in result["fractions"].items() if v >= 0.01)
    lines = [f"profile[{result['variant']}]: {result['step_time_median_s'] * 1000:.0f} ms/step, "
             f"{result['throughput_img_s']:.0f} img/s; {shares}; bottleneck: {result['bottleneck']}"]
    lines += [f"  - {rec['action']}  (evidence: {rec['evidence']})" for rec in result["recommendations"]]
    for trial in all_trials(result):
        low, high = trial["speedup_range"]
        lines.append(f"  trial {trial['change']}: {trial['speedup']:.2f}x ({low:.2f}-{high:.2f})"
                     f"{' WIN' if trial['win'] else ''} {trial['note']}".rstrip())
    for entry in result.get("smaller_batches", []):
        retuned = "".join(f"; {t['knob']}={t['change'][t['knob']]} there ({t['speedup']:.2f}x)"
                          for t in entry["knob_trials"] if t["win"])
        lines.append(f"  batch {entry['change']['batch_size']} (for train.min_steps): {entry['speedup']:.2f}x "
                     f"the speed of batch {result['batch_size']}{retuned}")
    if result["tuned"]:
        lines.append(f"  tuned (for the `auto` params): {result['tuned']}")
    return "\n".join(lines)

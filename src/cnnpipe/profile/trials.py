"""Measured A/B trials: each candidate setting against the current one, interleaved in one run."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from cnnpipe import malloc
from cnnpipe.config import VariantConfig
from cnnpipe.data.store.shards import PreparedSplit
from cnnpipe.hardware import cpu_has_fast_bf16
from cnnpipe.profile.clock import COMPILE_S, OUT_OF_TIME, TrialClock, block_steps, round_seconds
from cnnpipe.profile.diagnosis import MEMORY_FRAC
from cnnpipe.profile.measure import PROCESS_KNOBS, Setup, build_setup, memory_frac, train_step
from cnnpipe.train.distributed import DistInfo
from cnnpipe.train.engine import Spans, sync_device
from cnnpipe.train.tuning import auto_knobs


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

    def add_note(self, text: str) -> None:
        """`text` after what the note already says."""
        self.note = f"{self.note}; {text}" if self.note else text

    def to_dict(self) -> dict[str, Any]:
        return {"knob": self.knob, "change": self.change, "speedup": self.speedup,
                "speedup_range": list(self.speedup_range), "before_img_s": self.before_img_s,
                "after_img_s": self.after_img_s, "win": self.win, "note": self.note}


@dataclass
class TrialContext:
    """What every trial needs, said once: the profiled config, the setup it is measured against, the
    params as asked (which knobs are `auto`), where it runs and the clock that times the trials."""

    cfg: VariantConfig
    """The profiled config, resolved, at the batch the profile measures at."""
    requested: VariantConfig
    info: DistInfo
    split: PreparedSplit
    """The training split every candidate reads (opened once by the profile)."""
    base: Setup
    clock: TrialClock
    measured: Setup | None = None
    """The setup at the batch the profile measured, where `base` is one at a smaller trial batch
    (None: `base` is it). The process knobs are tried there (`process_trial`)."""
    measured_step_s: float = 0.0
    """Its median step (seconds; 0: unknown): what sizes a process knob's trial against the clock."""

    @property
    def encoding(self) -> str:
        """The store's encoding: `jpeg` puts a decode among the candidates."""
        return self.split.encoding

    def at(self, base: Setup) -> TrialContext:
        """The same trials measured against `base` instead, at its config (another batch)."""
        return dataclasses.replace(self, cfg=base.cfg, base=base, measured=self.measured or self.base)

    def build(self, **change: Any) -> Setup:
        """A setup of the profiled config with `change` applied."""
        return build_setup(self.cfg.with_train(**change), self.info, self.split)

    def paired(self, knob: str, change: dict[str, Any], candidate: Setup, current: Setup | None = None,
               rounds: int | None = None) -> Trial:
        """`candidate` against `current` (the base), in blocks of the clock's length."""
        p = self.cfg.profile
        return paired_trial(knob, change, current or self.base, candidate, rounds or p.trial_rounds,
                            self.clock.block, p.min_gain)


CLEAR_LOSS = 0.5
"""A candidate below this speed ratio in a round is a clear loser: its trial stops at once."""


def _block(s: Setup, steps: int) -> list[float]:
    """`steps` timed steps after one untimed step that re-warms caches and the loader after a switch.

    On CUDA the steps are timed by events on the stream (`Spans`), with one wait at the end.
    """
    train_step(s)
    spans = Spans(s.device)
    for _ in range(steps):
        with spans.span():
            train_step(s)
    return spans.durations()


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
               recommended: Sequence[str], encoding: str = "raw") -> list[tuple[str, dict[str, Any]]]:
    """(knob, change) pairs to measure: every `auto` knob, plus the knobs the diagnosis points at.

    amp, channels_last and the loader are always measured (cheap, and the report shows each one's
    gain over its hand setting); workers, pin_memory, compile and the allocator (`malloc`, on a CPU
    where glibc is the C library) only when asked for; the decode's place when `auto` on CUDA with a JPEG store
    (`encoding`) and the fast loader, the one case with two places to decode. The knobs in
    `recommended` (the diagnosis's, bottleneck first) come first, in its order; the allocator last of
    all, wherever the diagnosis ranks it (`run_trials`).
    """
    t, auto, asked = cfg.train, set(auto_knobs(requested)), set(recommended)
    out: list[tuple[str, dict[str, Any]]] = []
    amps = ["off", "bf16"] + (["fp16"] if device.type == "cuda" else [])
    out += [("amp", {"amp": a}) for a in amps if a != t.amp]
    out.append(("channels_last", {"channels_last": not t.channels_last}))
    out.append(("loader", {"loader": "fast" if t.loader == "baseline" else "baseline"}))
    if "num_workers" in auto or asked & {"num_workers", "loader"}:  # workers also hide a slow loader
        cores = len(os.sched_getaffinity(0))
        options = sorted({n for n in (1, 2, 4, 8, cores) if n <= cores} | {0})
        out += [("num_workers", {"num_workers": n}) for n in options if n != t.num_workers]
    if device.type == "cuda" and ("pin_memory" in auto or "num_workers" in asked):
        out.append(("pin_memory", {"pin_memory": not t.pin_memory}))
    if "compile" in auto and t.compile == "off":
        # CUDA graphs (reduce-overhead) are what helps a launch-bound GPU step; the CPU has none
        modes = ["default"] + (["reduce-overhead"] if device.type == "cuda" else [])
        out += [("compile", {"compile": m}) for m in modes]
    if "decode" in auto and device.type == "cuda" and encoding == "jpeg" and t.loader == "fast":
        out.append(("decode", {"decode": "cpu" if t.decode == "device" else "device"}))
    if (("malloc" in auto and device.type == "cpu") or "malloc" in asked) and malloc.available():
        out.append(("malloc", {"malloc": "system" if t.malloc == "keep" else "keep"}))
    # the diagnosis's picks first: when the window is short, they are the trials that get measured
    # (the allocator's excepted: it comes after the others, `run_trials`)
    rank = {knob: i for i, knob in enumerate(recommended)}
    return sorted(out, key=lambda kc: (kc[0] in PROCESS_KNOBS, rank.get(kc[0], len(rank))))


def ruled_out(change: dict[str, Any], device: torch.device) -> str:
    """Why this machine's hardware rules the candidate out without a measurement ('' when it does not)."""
    if device.type == "cpu" and change.get("amp") == "bf16" and not cpu_has_fast_bf16():
        return ("not measured: this CPU has no avx512_bf16/amx_bf16, where bf16 runs ~10x slower than fp32 "
                "(profile.trial_ruled_out: true measures it)")
    return ""


def run_trials(ctx: TrialContext, recommended: Sequence[str], grow_batch: bool = True) -> list[Trial]:
    """Measure each candidate against the base, then grow the batch while it pays (`grow_batch`), then
    the process knobs; a candidate whose turn comes when the clock has no room for another trial is
    noted, not timed.

    The allocator comes after the other candidates and the batch's growth: once its blocks set
    `keep`, glibc's own thresholds are gone for the rest of the process, and `system` can only be
    them at their cap (`cnnpipe.malloc`), where a fresh training process moves them itself. (The
    confirmations and the smaller batches' blocks still follow it.) Where the diagnosis picked it,
    the clock keeps its trial's time while the others run: measured last, not dropped.
    """
    offered = candidates(ctx.cfg, ctx.requested, ctx.info.device, recommended, ctx.encoding)
    process = [(knob, change) for knob, change in offered if knob in PROCESS_KNOBS]
    with ctx.clock.holding(sum(process_trial_s(ctx) for knob, _ in process if knob in recommended)):
        results = [measure_candidate(ctx, knob, change) for knob, change in offered if knob not in PROCESS_KNOBS]
        if grow_batch:
            results += batch_trials(ctx)
        else:
            results.append(Trial("batch_size", {"batch_size": ctx.cfg.train.batch_size * 2},
                                 note=LARGER_DO_NOT_FIT))
    return results + [measure_candidate(ctx, knob, change) for knob, change in process]


def measure_candidate(ctx: TrialContext, knob: str, change: dict[str, Any]) -> Trial:
    """One candidate's trial against the base, or a note saying why it was not timed (the clock, or
    hardware that rules it out, unless `profile.trial_ruled_out`)."""
    if not fits(ctx, knob):
        reason = out_of_time_note(ctx, knob)
    else:
        reason = "" if ctx.cfg.profile.trial_ruled_out else ruled_out(change, ctx.info.device)
    if reason:
        return Trial(knob, change, note=reason)
    if knob in PROCESS_KNOBS:  # (nothing built, maybe at a larger batch: not what the next trial takes)
        return process_trial(ctx, knob, change)
    with ctx.clock.timing():
        if knob == "compile":
            return compile_trial(ctx, change)
        return ctx.paired(knob, change, ctx.build(**change))


NOT_AT_TRAINING_BATCH = ("not measured: its gain depends on the size of a step's blocks, and no trial at the "
                         "batch {measured} fits the box (the others ran at batch {trial})")


def process_trial_s(ctx: TrialContext) -> float:
    """Seconds a process knob's trial takes: its blocks at the measured batch, each with its untimed
    step (nothing is built; the clock's usual trial where the step is unknown)."""
    if not ctx.measured_step_s:
        return ctx.clock.trial_s
    step = ctx.measured_step_s
    return ctx.cfg.profile.trial_rounds * round_seconds(process_block(ctx), step, step)


def extra_s(ctx: TrialContext, knob: str) -> float:
    """Seconds `knob`'s trial takes beyond the clock's usual one: the compile; for a process knob, its
    own length less the usual trial."""
    if knob == "compile":
        return COMPILE_S
    if knob in PROCESS_KNOBS:
        return process_trial_s(ctx) - ctx.clock.trial_s
    return 0.0


def fits(ctx: TrialContext, knob: str) -> bool:
    """Whether `knob`'s trial still fits the clock."""
    return not ctx.clock.out_of_time(extra_s(ctx, knob))


def out_of_time_note(ctx: TrialContext, knob: str) -> str:
    """Why `knob` was not measured when its trial does not fit the clock."""
    if knob in PROCESS_KNOBS and at_smaller_batch(ctx):
        return NOT_AT_TRAINING_BATCH.format(measured=ctx.measured.cfg.train.batch_size,
                                            trial=ctx.base.cfg.train.batch_size)
    return OUT_OF_TIME


def at_smaller_batch(ctx: TrialContext) -> bool:
    """Whether the trials run at a smaller batch than the profile measured (`trial_batch`)."""
    return ctx.measured is not None and ctx.measured is not ctx.base


def process_trial(ctx: TrialContext, name: str, change: dict[str, Any]) -> Trial:
    """A process-wide knob (the allocator): the setup the profile measured, at its batch, stepped
    under the current setting and the candidate in turns (`name`: the knob, or "confirm").

    At the measured batch, not the trials' halved one: the allocator's gain depends on the size of
    a step's blocks (glibc maps those over its threshold afresh each step), and ResNet-50 at 128 px
    read 0.95x at batch 16 where batch 64 trains 1.17x faster with `keep` (`bench/malloc.py`).
    """
    measured = ctx.measured or ctx.base
    trial = paired_trial(name, change, measured, measured.under(**change), ctx.cfg.profile.trial_rounds,
                         process_block(ctx), ctx.cfg.profile.min_gain)
    if at_smaller_batch(ctx):
        trial.add_note(f"at batch {measured.cfg.train.batch_size}")
    return trial


def process_block(ctx: TrialContext) -> int:
    """Timed steps per block of a process knob's trial: the clock's block, or at the measured batch,
    where the trials run at a smaller one, the clock's rule applied to the measured step."""
    if not at_smaller_batch(ctx) or not ctx.measured_step_s:  # (an unknown step: the clock's)
        return ctx.clock.block
    return block_steps(ctx.measured_step_s, ctx.cfg.profile.trial_steps)


LARGER_DO_NOT_FIT = "not measured: the profile measured at a smaller batch, a larger one does not fit its time box"


def batch_trials(ctx: TrialContext, max_doublings: int = 2) -> list[Trial]:
    """Double the batch while each doubling adds `min_gain`, memory stays under the memory rule's
    threshold, nothing OOMs and the clock has room."""
    p, info, clock, results, previous = ctx.cfg.profile, ctx.info, ctx.clock, [], None
    for k in range(1, max_doublings + 1):
        change = {"batch_size": ctx.cfg.train.batch_size * 2 ** k}
        per_rank = ctx.base.loader.sampler.n // info.world_size if ctx.base is not None else None
        if per_rank is not None and change["batch_size"] > per_rank:  # the loader refuses a batch over an epoch
            results.append(Trial("batch_size", change, note=f"not measured: over the {per_rank} training "
                                                            "images a process has an epoch"))
            break
        if clock.out_of_time():
            results.append(Trial("batch_size", change, note=OUT_OF_TIME))
            break
        if info.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(info.device)  # the peak below is this candidate's
        try:
            with clock.timing():
                candidate = ctx.build(**change)
                trial = ctx.paired("batch_size", change, candidate)
                del candidate
        except torch.OutOfMemoryError:
            results.append(Trial("batch_size", change, note="out of memory"))
            break
        finally:
            if info.device.type == "cuda":
                torch.cuda.empty_cache()
        used = memory_frac(info.device)
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


def compile_trial(ctx: TrialContext, change: dict[str, Any] | None = None) -> Trial:
    """torch.compile (`change`: its mode), judged over the whole run: the per-step gain must repay
    the compile time."""
    p, change, current = ctx.cfg.profile, change or {"compile": "default"}, ctx.base
    try:
        candidate = ctx.build(**change)
        t0 = time.perf_counter()
        train_step(candidate)  # compiles forward and backward
        sync_device(ctx.info.device)
        first_step_s = time.perf_counter() - t0
        trial = ctx.paired("compile", change, candidate)
    except Exception as exc:  # inductor needs a C++ compiler (CPU) or Triton (CUDA); report, do not fail
        return Trial("compile", change, note=f"compile failed: {type(exc).__name__}: {str(exc)[:200]}")
    step_eager = current.images_per_step / trial.before_img_s
    step_compiled = candidate.images_per_step / trial.after_img_s
    compile_s = max(0.0, first_step_s - step_compiled)
    total_steps = ctx.cfg.train.epoch_count * current.steps_per_epoch
    run_gain = (step_eager * total_steps) / (step_compiled * total_steps + compile_s)
    said = (f"compile took {compile_s:.0f} s; {run_gain:.2f}x over the run's {total_steps} steps "
            f"(per step {trial.speedup:.2f}x)")
    trial.note = f"{said}; {trial.note}" if trial.note else said  # (the compile first: what judges it)
    trial.win = trial.win and run_gain >= 1 + p.min_gain
    return trial


def recommended_together(ctx: TrialContext, results: list[Trial], knobs: list[str]) -> Trial | None:
    """The recommended knobs applied at once: they interact (bf16 convolutions want NHWC in oneDNN
    and cuDNN), so the sum of one-at-a-time gains understates what following the advice buys."""
    together = {}
    for knob in knobs:
        measured = [t for t in results if t.knob == knob and t.speedup]
        if measured and knob not in together:
            together.update(max(measured, key=lambda t: t.speedup).change)
    if len(together) < 2:
        return None
    return ctx.paired("recommended", together, ctx.build(**together))

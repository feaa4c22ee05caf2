"""The profile's time box, split by time: every part of the stage is sized from a measured step.

A profile first times one step on a slice of a batch (the probe). From that per-image cost it
sizes each part to a share of what the box has left, so the stage ends inside its box at any image
size, batch or device:

- the base measurement: `BASE_SHARE`, at the recipe's batch when three steps fit there, else at the
  largest halved batch where they do, never under `MIN_BASE_BATCH` (the smallest batch training
  runs at), even when that overruns the box; a recipe measured at a smaller batch is reported per
  image, by the rule that a step's time grows in proportion to its batch (a rule, not a law: on a
  2-core Xeon batch 256 ran 1.12x faster per image than 128 at 32 px, and 1.43x slower than 64 at
  128 px, which is why the base never goes under the batches training can run at);
- the trace window: `TRACE_SHARE`, fewer active steps when steps are slow;
- the roofline: `ROOFLINE_SHARE`, half for one step's FLOP count (at a halved batch when a step is
  slower than that) and half for the machine's three peaks (`profile/peaks.py`);
- the smaller batches `train.min_steps` may pick: `SMALLER_SHARE`, fewer rounds when slow, and
  predicted by the same proportional rule (and marked so) when not even one round fits;
- the trials: what is left once the smaller batches' planned rounds and the inference timings are
  set aside, less `MARGIN` (`clock.trial_window`); at a halved batch (`trial_batch`) where not
  one full trial fits at the measured one, so that slow steps still get their `auto` knobs measured,
  the diagnosis's picks first;
- the inference timing, sized before the trials and run after them: `TAIL_SHARE`, at a smaller
  batch when slow, and the export's fp32 timing on the CPU another `TAIL_SHARE`, sized by a call of
  its own (`measure.cpu_fp32_timing`). They run at the allocator evaluate and export run with
  (`keep`), which would take every later trial off glibc's own thresholds (`cnnpipe.malloc`).

`BoxPlan` holds that state for one profile: built once after the probe, it sizes each part as the
stage reaches it (reading the box's clock where what is left depends on what came before), the
inference timings before the trials that they follow.
Without a box (no budget) the counts in `profile:` apply unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from cnnpipe.config import ProfileConfig
from cnnpipe.profile.clock import TrialClock, block_steps, round_seconds, trial_window
from cnnpipe.train.schedule import MIN_BATCH

BASE_SHARE = 0.15
TRACE_SHARE = 0.12
ROOFLINE_SHARE = 0.06
SMALLER_SHARE = 0.25
TAIL_SHARE = 0.08
MIN_MEASURE_BATCH = 16
"""The smallest batch the trials run at: below it BatchNorm's statistics and a step's fixed costs
(the optimizer's update of 25M weights) make even a ratio of two settings unrepresentative."""
MIN_BASE_BATCH = MIN_BATCH
"""The smallest batch the base measurement runs at: the smallest `train.min_steps` halves training
to. The plan predicts training from the base's images/s, and per image a step's speed depends on the
batch: on the 2-core AMD EPYC at 128 px the base measured at 16 (fp32) and 32 (bf16) put training at
batch 64 1.18x and 0.77x off its prediction (`python bench/own_images.py --budget 8 --per-class 450`).
A small box is overrun rather than measure a batch training never runs at."""
PROBE_IMAGES = 32
"""Images in the probe step that sizes everything else (a slice of the recipe's first batch). Its
per-image cost carries the step's fixed costs (the optimizer's update of 25M weights) over 32 images,
so it overstates the recipe's: on the side of holding the box."""
MARGIN = 0.10
"""Share of the box kept free for what the estimates miss (a candidate slower than the base, a VM
that slows down for a minute)."""
BASE_STEPS = 3
"""The fewest steps a base measurement takes: one untimed warm-up at the new batch and two timed."""
PROFILED_SLOWDOWN = 1.3
"""How much slower a step runs under torch.profiler with shapes and memory recorded (measured
1.1-1.3x on a CPU); the trace window is sized with it."""
FORWARD_SHARE = 1 / 3
"""A forward pass in eval mode costs about a third of a training step per image (forward, backward
twice its cost): the inference timing is sized with it before it is measured."""


@dataclass
class TimeBox:
    """The stage's deadline on the monotonic clock (None: no box); `now` is injectable for tests."""

    deadline: float | None
    now: Callable[[], float] = time.monotonic

    @classmethod
    def from_process_start(cls, box_s: float | None, process_s: float) -> TimeBox:
        """A box of `box_s` counted from the process start, `process_s` seconds ago (imports included:
        what the stage costs the run)."""
        return cls(None if box_s is None else time.monotonic() - process_s + box_s)

    def left(self) -> float | None:
        """Seconds to the deadline (negative when past it; None without a box)."""
        return None if self.deadline is None else self.deadline - self.now()


def measure_batch(per_image_s: float, batch: int, left_s: float | None) -> int:
    """The batch the base measurement runs at: `batch`, halved while `BASE_STEPS` steps there would
    take more than `BASE_SHARE` of `left_s`, never under `MIN_BASE_BATCH` (nor over `batch`)."""
    if left_s is None:
        return batch
    floor = min(batch, MIN_BASE_BATCH)
    while batch > floor and BASE_STEPS * per_image_s * batch > BASE_SHARE * left_s:
        batch = max(floor, batch // 2)
    return batch


def needed_box_s(per_image_s: float, batch: int, spent_s: float) -> float:
    """The box that would measure the base at `batch` (after `spent_s` already spent): its share."""
    return spent_s + BASE_STEPS * per_image_s * batch / BASE_SHARE


def steps_within(share_s: float | None, step_s: float, wanted: int, least: int) -> int:
    """`wanted` steps, or as many as fit in `share_s` (never under `least`)."""
    if share_s is None:
        return wanted
    return max(least, min(wanted, int(share_s / max(step_s, 1e-9))))


@dataclass(frozen=True)
class TraceSteps:
    """The torch.profiler schedule: untraced, warm-up and recorded steps."""

    wait: int
    warmup: int
    active: int

    @property
    def total(self) -> int:
        return self.wait + self.warmup + self.active


def trace_steps(p: ProfileConfig, step_s: float, share_s: float | None) -> TraceSteps:
    """The `profile:` schedule, shortened to fit `share_s`: the wait goes first, then warm-up beyond
    one step, then active steps beyond one."""
    if share_s is None:
        return TraceSteps(p.wait, p.warmup, p.active)
    fits = max(2, int(share_s / (PROFILED_SLOWDOWN * max(step_s, 1e-9))))
    active = max(1, min(p.active, fits - 1))
    warmup = max(1, min(p.warmup, fits - active))
    wait = max(0, min(p.wait, fits - active - warmup))
    return TraceSteps(wait, warmup, active)


def trial_rounds(share_s: float | None, round_s: float, rounds: int) -> int:
    """Rounds of a paired measurement that fit in `share_s` (0: none fits, predict instead)."""
    if share_s is None:
        return rounds
    return max(0, min(rounds, int(share_s / max(round_s, 1e-9))))


@dataclass(frozen=True)
class Inference:
    """How the inference and export speeds are timed: a batch and timed calls of each."""

    batch: int
    calls: int


def inference_plan(per_image_s: float, share_s: float | None, batch: int = 256, calls: int = 3) -> Inference:
    """`calls` timed forward passes of `batch` (plus one untimed) at the recipe's precision; fewer
    calls, then a halved batch (down to 8), until they fit `share_s`.

    `per_image_s` is the training step's cost per image; a forward pass is `FORWARD_SHARE` of it.
    """
    if share_s is None:
        return Inference(batch, calls)
    while calls > 1 and inference_s(Inference(batch, calls), per_image_s) > share_s:
        calls -= 1
    while batch > 8 and inference_s(Inference(batch, calls), per_image_s) > share_s:
        batch //= 2
    return Inference(batch, calls)


def inference_s(plan: Inference, per_image_s: float) -> float:
    """Seconds the inference timing takes: its timed calls and the untimed one."""
    return (plan.calls + 1) * plan.batch * per_image_s * FORWARD_SHARE


def full_trial_s(step_per_image_s: float, batch: int, setup_s: float, rounds: int, trial_steps: int) -> float:
    """A trial that runs all its rounds at `batch`: a setup built, then each round a block of the
    current and of the candidate setting, each block with its untimed first step."""
    step = step_per_image_s * batch
    return setup_s + rounds * round_seconds(block_steps(step, trial_steps), step, step)


def trial_batch(step_per_image_s: float, batch: int, window_s: float | None, setup_s: float, rounds: int,
                trial_steps: int) -> int:
    """The batch the trials run at: the measured `batch`, or where not one full trial fits the
    window there, the largest halved batch where one does (never under `MIN_MEASURE_BATCH`). Slow
    steps would otherwise leave every `auto` knob unmeasured; the values measured there are taken
    for the recipe's batch (the layout is measured again at each batch `train.min_steps` may pick)."""
    if window_s is None:
        return batch
    floor = min(batch, MIN_MEASURE_BATCH)
    while batch > floor and full_trial_s(step_per_image_s, batch, setup_s, rounds, trial_steps) > window_s:
        batch = max(floor, batch // 2)
    return batch


PREDICTED = ("predicted, not measured: the time box leaves no room for one round here; assumed "
             "the measured batch's images/s (time per step proportional to the batch)")


def smaller_rounds(batches: list[int], measured_batch: int, share_s: float | None, block: int,
                   step_per_image_s: float, setup_s: float, rounds: int) -> tuple[dict[int, int], float]:
    """({batch: rounds} for each smaller batch, and the seconds they will take): each gets an equal
    part of `share_s`, less the `setup_s` its setup takes to build, and as many paired rounds against
    the measured batch as fit there (0: predicted instead). The measured batch itself is the base.

    `step_per_image_s` is a step's time per image of its batch, so a step at batch B takes B times it.
    """
    others = [b for b in batches if b != measured_batch]
    if share_s is None:
        return {b: rounds for b in others}, 0.0
    plan, cost = {}, 0.0
    for b in others:
        one = round_seconds(block, measured_batch * step_per_image_s, b * step_per_image_s)
        plan[b] = trial_rounds(share_s / len(others) - setup_s, one, rounds)
        cost += setup_s + plan[b] * one if plan[b] else 0.0
    return plan, cost



@dataclass(frozen=True)
class TrialPlan:
    """How the trials run: their batch, the measured batch's block length, each smaller batch's
    rounds, and the clock that times them (its block and expected trial length at `batch`)."""

    batch: int
    block: int
    rounds_for: dict[int, int]
    clock: TrialClock


@dataclass(frozen=True)
class BoxPlan:
    """The profile's box, split part by part from the probe (`BoxPlan.after_probe`): the batch the
    base is measured at, then the base's steps, the trace, the trials and the inference timing,
    each a share of `left`, what the box had left when the probe ended (None: no box)."""

    box: TimeBox
    profile: ProfileConfig
    recipe_batch: int
    accum_steps: int
    probe_s: float
    """The probe's seconds per image of the recipe's batch (times `accum_steps`: per optimizer step)."""
    setup_s: float
    """What building a setup took (model, optimizer, loader): each trial pays it again."""
    left: float | None
    batch: int
    """The batch the base is measured at (`measure_batch`)."""

    @classmethod
    def after_probe(cls, box: TimeBox, profile: ProfileConfig, recipe_batch: int, accum_steps: int,
                    probe_s: float, setup_s: float) -> BoxPlan:
        """The plan once the probe has measured `probe_s`: the base's batch, from what the box has left now."""
        left = box.left()
        return cls(box, profile, recipe_batch, accum_steps, probe_s, setup_s, left,
                   measure_batch(probe_s, recipe_batch, left))

    def share(self, fraction: float) -> float | None:
        """`fraction` of what the box had left after the probe (None: no box)."""
        return None if self.left is None else max(0.0, fraction * self.left)

    @property
    def too_small(self) -> bool:
        """Even at the batch chosen, `BASE_STEPS` steps do not fit the base's share."""
        return self.left is not None and BASE_STEPS * self.probe_s * self.batch > BASE_SHARE * self.left

    def base_steps(self) -> int:
        """Timed steps of the base: the `profile:` counts' largest, or as many as fit the base's share
        less what a rebuild at a smaller batch took (read off the box now) and the base's warm-up step."""
        p = self.profile
        step_s = self.probe_s * self.batch
        share = None if self.left is None else self.share(BASE_SHARE) - (self.left - self.box.left()) - step_s
        return steps_within(share, step_s, max(p.active, p.trial_steps * p.trial_rounds), 2)

    def trace(self, step_s: float) -> TraceSteps:
        """The trace window for the base's measured `step_s`."""
        return trace_steps(self.profile, step_s, self.share(TRACE_SHARE))

    def inference(self, per_image_s: float, batch: int) -> Inference:
        """The inference timing from `batch`, sized by the base's `per_image_s`."""
        return inference_plan(per_image_s, self.share(TAIL_SHARE), batch)

    def trials(self, step_s: float, per_image_s: float, batches: list[int], training_s: float,
               tail_s: float) -> TrialPlan:
        """The trials' plan, made when they are next: the smaller batches' rounds are reserved first,
        then `tail_s`, the inference timings that follow them, and `MARGIN`, from what the box has left
        now; the window is at
        most a fifth of `training_s`. Where not one full trial fits at the measured batch, they run at
        a halved one (`trial_batch`), with the clock's block and trial length set for it."""
        p = self.profile
        step_per_image_s = per_image_s * self.accum_steps
        block = block_steps(step_s, p.trial_steps)
        rounds_for, smaller_s = smaller_rounds(batches, self.batch, self.share(SMALLER_SHARE), block,
                                               step_per_image_s, self.setup_s, p.trial_rounds)
        box_left = None if self.left is None else self.box.left() - smaller_s - tail_s - MARGIN * self.left
        clock = TrialClock(trial_window(box_left, training_s), block,
                           self.setup_s + p.trial_rounds * round_seconds(block, step_s, step_s),  # at the base's speed
                           now=self.box.now)  # the box's clock: one clock for the box and its trials
        tried = trial_batch(step_per_image_s, self.batch, clock.window_s, self.setup_s, p.trial_rounds, p.trial_steps)
        if tried != self.batch:
            clock.block = block_steps(per_image_s * tried, p.trial_steps)
            clock.trial_s = full_trial_s(step_per_image_s, tried, self.setup_s, p.trial_rounds, p.trial_steps)
        return TrialPlan(tried, block, rounds_for, clock)

    def needed_s(self, box_s: float | None) -> float | None:
        """The box (of `box_s`) a base at the smallest measured batch would need, when this one is too small."""
        if not self.too_small or box_s is None or self.left is None or not box_s - self.left:
            return None
        return needed_box_s(self.probe_s, min(self.recipe_batch, MIN_BASE_BATCH), box_s - self.left)

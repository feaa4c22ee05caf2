"""When a trial may still start, and how long its timed blocks last.

The trials get a window counted from their start (`box` sized everything before it: the base
measurement, the trace and the roofline), set by two limits: what is left of the stage's time box
once the parts that must follow (the smaller batches' share, the inference timings) are set aside,
and a fifth of the training the profile informs, never under `MIN_WINDOW_S`. A trial starts only when one as
long as the longest so far still fits, so the stage ends inside its box instead of running its last
trial past it.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

SHARE_OF_TRAINING = 0.2
"""Under a budget, trials take at most this share of the training they inform (the whole split's,
predicted from the first timed window)."""
MIN_WINDOW_S = 20.0
"""Even a training of seconds gets this long for trials, the diagnosis's picks first: on an H200 the
default split trains in ~10 s, and a fifth of that would tune nothing."""
MIN_BLOCK_S = 0.4
"""A timed block lasts at least this long: two ResNet-50 steps at 32 px take ~25 ms on an H200,
inside its step-to-step jitter. On the CPU two steps already take longer."""

COMPILE_S = 90.0
"""What a compile trial adds to a trial before its first step: inductor compiling ResNet-50's forward
and backward took 38 s on an H200's host and 74 s on a 2-core Zen 4 VM (`docs/benchmarks.md`). A
compile trial starts only when the window holds this too."""

OUT_OF_TIME = ("not measured: the profile's time box was spent (profile.budget_share of run.budget_minutes, "
               "and at most a fifth of the training it informs)")


def block_steps(step_s: float, trial_steps: int) -> int:
    """Steps per timed block: `profile.trial_steps`, or more where that many last under `MIN_BLOCK_S`."""
    return max(trial_steps, math.ceil(MIN_BLOCK_S / max(step_s, 1e-6)))


def round_seconds(block: int, step_a: float, step_b: float) -> float:
    """One round of a paired trial: a block of each side, each with its untimed first step."""
    return (block + 1) * (step_a + step_b)


def trial_window(box_left_s: float | None, training_s: float) -> float | None:
    """Seconds the trials may take from now: what the budget's box leaves (None: no budget, no
    window), and at most `SHARE_OF_TRAINING` of the training, but never under `MIN_WINDOW_S`."""
    if box_left_s is None:
        return None
    return max(0.0, min(box_left_s, max(SHARE_OF_TRAINING * training_s, MIN_WINDOW_S)))


@dataclass
class TrialClock:
    """The trials' window and block length; `now` is injectable so tests can run on a fake clock."""

    window_s: float | None
    """Seconds from `start` within which trials may run (None: no limit)."""
    block: int = 2
    """Timed steps per block (`block_steps`)."""
    trial_s: float = 0.0
    """How long the next trial is expected to take: an estimate at first, then the longest one seen."""
    reserved_s: float = 0.0
    """Seconds of the window kept for trials that come later (`holding`): no trial may start into them."""
    now: Callable[[], float] = time.monotonic
    start: float = field(default=math.nan)

    def __post_init__(self) -> None:
        if math.isnan(self.start):
            self.start = self.now()

    @classmethod
    def unlimited(cls, trial_steps: int) -> TrialClock:
        """No window (no budget): every trial runs, in blocks of `profile.trial_steps`."""
        return cls(None, trial_steps)

    def elapsed(self) -> float:
        return self.now() - self.start

    def out_of_time(self, extra_s: float = 0.0) -> bool:
        """True when a trial as long as `trial_s` (plus `extra_s`) would end past the window."""
        return (self.window_s is not None
                and self.elapsed() + self.trial_s + extra_s + self.reserved_s > self.window_s)

    @contextlib.contextmanager
    def holding(self, seconds: float) -> Iterator[None]:
        """`seconds` of the window kept while inside, for a trial that comes after."""
        self.reserved_s += seconds
        try:
            yield
        finally:
            self.reserved_s -= seconds

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        """Time one trial; the longest so far is what the next one is expected to take."""
        t0 = self.now()
        yield
        self.trial_s = max(self.trial_s, self.now() - t0)

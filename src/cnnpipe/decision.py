"""From measured trials to tuned values: the winners, checked together, and what they buy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import VariantConfig
from .distributed import DistInfo
from .measure import Setup, build_setup
from .trials import OUT_OF_TIME, Trial, out_of_time, paired_trial
from .tuning import auto_knobs


def tuned_settings(requested: VariantConfig, current: VariantConfig, results: list[Trial]) -> dict[str, Any]:
    """A value for each knob `requested` leaves at `auto`: the best winning trial's, else the default."""
    tuned = {knob: getattr(current.train, knob) for knob in auto_knobs(requested)}
    for knob in tuned:
        wins = [t for t in results if t.knob == knob and t.win]
        if wins:
            tuned[knob] = max(wins, key=lambda t: t.speedup).change[knob]
    return tuned


def confirm_combined(requested: VariantConfig, current: VariantConfig, info: DistInfo, prepared_dir: Path,
                     base: Setup, results: list[Trial], tuned: dict[str, Any],
                     time_box_s: float | None = None) -> tuple[dict[str, Any], Trial | None]:
    """Every change the trials would ship is measured once more, in a trial of its own, before it is kept.

    One winning knob (trial "confirm") is dropped when the second trial does not win: a few rounds of
    short blocks on a drifting VM can crown a knob that trains slower (the PIL loader beat the batched
    one 1.08x in every round once, then trained with 6% data wait). Knobs that each won alone
    (trial "combined") keep only the best single change when the mix does not win, or when the time
    box leaves no room to measure it; a single win past the time box is kept as measured.
    """
    changed = {k: v for k, v in tuned.items() if v != getattr(current.train, k)}
    if not changed or (len(changed) == 1 and out_of_time(time_box_s)):
        return tuned, None
    name = "confirm" if len(changed) == 1 else "combined"
    if out_of_time(time_box_s):
        combined = Trial(name, changed, note=OUT_OF_TIME)
    else:
        p = current.profile
        candidate = build_setup(current.with_train(**changed), info, prepared_dir)
        combined = paired_trial(name, changed, base, candidate, p.trial_rounds, p.trial_steps, p.min_gain)
        if combined.win:
            return tuned, combined
        combined.note = "the mix did not win" if len(changed) > 1 else "the second trial did not win: default kept"
    if len(changed) == 1:
        return {k: getattr(current.train, k) for k in tuned}, combined
    best = max((t for t in results if t.win and t.knob in changed), key=lambda t: t.speedup)
    combined.note += f"; kept only {best.knob}={best.change[best.knob]}"
    kept = {k: (best.change[k] if k == best.knob else getattr(current.train, k)) for k in tuned}
    return kept, combined


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

"""From measured trials to tuned values: the winners, checked together, and what they buy."""

from __future__ import annotations

from typing import Any

from cnnpipe.config import VariantConfig
from cnnpipe.profile.clock import OUT_OF_TIME
from cnnpipe.profile.measure import PROCESS_KNOBS
from cnnpipe.profile.trials import Trial, TrialContext, at_smaller_batch, fits, process_trial
from cnnpipe.train.tuning import auto_knobs, decode_for_loader


def tuned_settings(requested: VariantConfig, current: VariantConfig, results: list[Trial]) -> dict[str, Any]:
    """A value for each knob `requested` leaves at `auto`: the best winning trial's, else the default."""
    tuned = {knob: getattr(current.train, knob) for knob in auto_knobs(requested)}
    for knob in tuned:
        wins = [t for t in results if t.knob == knob and t.win]
        if wins:
            tuned[knob] = max(wins, key=lambda t: t.speedup).change[knob]
    if "decode" in tuned:
        tuned["decode"] = decode_for_loader(tuned["decode"], tuned.get("loader", current.train.loader))
    return tuned


def changed_knobs(current: VariantConfig, tuned: dict[str, Any]) -> dict[str, Any]:
    """The tuned values that differ from the profiled (current) ones."""
    return {k: v for k, v in tuned.items() if v != getattr(current.train, k)}


def confirm_winners(ctx: TrialContext, results: list[Trial], tuned: dict[str, Any]) -> tuple[dict[str, Any], Trial | None]:
    """Every change the trials would ship is measured once more, in a trial of its own, before it is
    kept: one winning knob by `confirm_single`, several by `confirm_mix`. Returns the values to keep
    and that second trial (None when nothing changed, or a single win past the time box)."""
    changed = changed_knobs(ctx.cfg, tuned)
    if not changed:
        return tuned, None
    if len(changed) == 1:
        return confirm_single(ctx, tuned, changed)
    return confirm_mix(ctx, results, tuned, changed)


def _second_trial(ctx: TrialContext, name: str, changed: dict[str, Any]) -> Trial:
    """`changed` measured against the current setting. A process knob alone is measured again where
    its trial ran (`process_trial`: the measured batch, in place); in a mix measured at a smaller
    trial batch it is left out of the mix's setup, its gain being the measured batch's."""
    if set(changed) <= set(PROCESS_KNOBS):
        return process_trial(ctx, name, changed)
    if at_smaller_batch(ctx):
        changed = {k: v for k, v in changed.items() if k not in PROCESS_KNOBS}
    with ctx.clock.timing():
        return ctx.paired(name, changed, ctx.build(**changed))


def confirm_single(ctx: TrialContext, tuned: dict[str, Any], changed: dict[str, Any]) -> tuple[dict[str, Any], Trial | None]:
    """One winning knob (trial "confirm") is dropped unless a second trial wins too.

    Why: a few rounds of short blocks on a drifting VM can crown a knob that trains slower (the PIL
    loader beat the batched one 1.08x in every round once, then trained with 6% data wait). Past the
    time box the one measured win stands, with nothing more timed.
    """
    if not fits(ctx, next(iter(changed))):
        return tuned, None
    trial = _second_trial(ctx, "confirm", changed)
    if trial.win:
        return tuned, trial
    trial.add_note("the second trial did not win: default kept")
    return {k: getattr(ctx.cfg.train, k) for k in tuned}, trial


def confirm_mix(ctx: TrialContext, results: list[Trial], tuned: dict[str, Any],
                changed: dict[str, Any]) -> tuple[dict[str, Any], Trial]:
    """Knobs that each won alone are measured together (trial "combined"); when the mix does not win,
    or the time box leaves no room to measure it, only the best single change is kept."""
    if ctx.clock.out_of_time():
        trial = Trial("combined", changed, note=OUT_OF_TIME)
    else:
        trial = _second_trial(ctx, "combined", changed)
        if trial.win:
            return tuned, trial
        trial.add_note("the mix did not win")
    best = max((t for t in results if t.win and t.knob in changed), key=lambda t: t.speedup)
    trial.add_note(f"kept only {best.knob}={best.change[best.knob]}")
    return {k: (best.change[k] if k == best.knob else getattr(ctx.cfg.train, k)) for k in tuned}, trial


def tuned_speedup(current: VariantConfig, tuned: dict[str, Any], results: list[Trial],
                  combined: Trial | None) -> float:
    """Measured speed-up of the tuned values over the profiled (current) ones; 1.0 when unchanged.

    The plan multiplies the profiled throughput by this to predict the recipe training will run.
    """
    changed = changed_knobs(current, tuned)
    if not changed:
        return 1.0
    if combined is not None and combined.win and combined.change == changed:
        return combined.speedup
    single = [t for t in results if t.win and t.change == changed]
    return max(t.speedup for t in single) if single else 1.0


def best_batch(results: list[Trial]) -> Trial | None:
    """The largest batch whose doubling still won, else the first (losing) doubling, else None."""
    batch = [r for r in results if r.knob == "batch_size" and r.speedup]
    wins = [r for r in batch if r.win]
    return wins[-1] if wins else (batch[0] if batch else None)

"""The batches `train.min_steps` may halve the recipe's batch to: each one's speed against the
measured batch, for the plan, and the batch-sensitive `auto` knobs re-measured there."""

from __future__ import annotations

from typing import Any, Sequence

from cnnpipe.config import VariantConfig
from cnnpipe.profile.box import PREDICTED
from cnnpipe.profile.measure import PROCESS_KNOBS, build_setup
from cnnpipe.profile.trials import Trial, TrialContext, candidates
from cnnpipe.train.schedule import halved_batches
from cnnpipe.train.tuning import auto_knobs


def smaller_batches(cfg: VariantConfig) -> list[int]:
    """The batches `train.min_steps` may halve the recipe's batch to (none without `min_steps`)."""
    return [] if cfg.train.min_steps is None else halved_batches(cfg.train.batch_size)


BATCH_SENSITIVE = ("channels_last", "malloc")
"""Knobs re-measured at each smaller batch: oneDNN's NHWC convolutions win at batch 256 and lose
at 64 in fp32 on a one-core CPU (0.94x and 1.09x for NCHW, measured), so a layout tuned at the
profiled batch can be the wrong one for a short run's batch; the allocator's gain shrinks with a
step's blocks (`process_trial`)."""


def _other(knob: str, value: Any) -> Any:
    """The setting a batch-sensitive knob is re-measured at: the other one of its two."""
    if knob == "malloc":
        return "system" if value == "keep" else "keep"
    return not value


def smaller_batch_trials(ctx: TrialContext, batches: Sequence[int], tuned: dict[str, Any], tuned_gain: float,
                         rounds_for: dict[int, int] | None = None) -> list[dict[str, Any]]:
    """Speed of each batch in `batches` (those `train.min_steps` may halve the recipe's batch to)
    against the measured one, and the batch-sensitive `auto` knobs re-tuned there.

    The batch itself is never tuned for speed (it changes the optimisation); the plan multiplies
    the recipe's speed by `speed_vs_tuned`, and training takes `at_batch` values at that batch.
    `rounds_for` says how many rounds each batch gets (`box.smaller_rounds`; None: `profile.trial_rounds`);
    where it gives none, the speed is predicted (`box.PREDICTED`) and marked `predicted`. The
    measured batch itself is the base (its entry has no speeds of its own: the plan reads the base's).
    Each re-tuning trial runs only while the clock has room.
    """
    p, out = ctx.cfg.profile, []
    recipe = ctx.cfg.with_train(**tuned)
    offered = {k for k, _ in candidates(ctx.cfg, ctx.requested, ctx.info.device, [], ctx.encoding)}
    retune = [k for k in BATCH_SENSITIVE if k in auto_knobs(ctx.requested) and k in offered]
    for batch in batches:
        entry: dict[str, Any] = {"knob": "smaller_batch", "change": {"batch_size": batch}, "at_batch": {},
                                 "knob_trials": [], "predicted": False}
        if batch == ctx.cfg.train.batch_size:  # the profile measured at this very batch
            out.append({**Trial("smaller_batch", {"batch_size": batch}, 1.0, (1.0, 1.0),
                                note="the batch the profile measured at").to_dict(), **entry,
                        "speed_vs_tuned": 1.0})
            continue
        rounds = p.trial_rounds if rounds_for is None else rounds_for.get(batch, p.trial_rounds)
        if rounds == 0:
            out.append({**Trial("smaller_batch", {"batch_size": batch}, 1.0, (1.0, 1.0), note=PREDICTED).to_dict(),
                        **entry, "predicted": True, "speed_vs_tuned": 1.0})
            continue
        at_batch = build_setup(recipe.with_train(batch_size=batch), ctx.info, ctx.split)
        trial = ctx.paired("smaller_batch", {"batch_size": batch}, at_batch, rounds=rounds)
        trial.win = False  # measured for the plan, never tuned: the batch changes the optimisation
        if rounds < p.trial_rounds:
            trial.add_note(f"{rounds} of {p.trial_rounds} rounds: the time box")
        entry, gain = {**trial.to_dict(), **entry}, 1.0
        for knob in retune:  # (the speed itself always: the plan needs it)
            if ctx.clock.out_of_time():
                break
            flip = {knob: _other(knob, getattr(recipe.train, knob)), "batch_size": batch}
            other = (at_batch.under(**{knob: flip[knob]}) if knob in PROCESS_KNOBS
                     else build_setup(recipe.with_train(**flip), ctx.info, ctx.split))
            knob_trial = ctx.paired(knob, flip, other, current=at_batch)
            entry["knob_trials"].append(knob_trial.to_dict())
            if knob_trial.win:
                entry["at_batch"][knob], gain = flip[knob], gain * knob_trial.speedup
            del other
        entry["speed_vs_tuned"] = trial.speedup * gain / tuned_gain
        out.append(entry)
        del at_batch
    return out

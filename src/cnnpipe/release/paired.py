"""Top-1 of two models on the same test images: the week's margin, and the drift from an anchor.

`compare` is the week's comparison with the champion. Which case applies depends on the test set's
size and the champion's accuracy, never on how much the two models disagree: the set either supports
`margin` or it does not at the *planning discordance*, the larger of the two models' error rates
(figures of each model alone; a challenger that disagrees on more images than that has less power
to be shown within the margin, which is its own doing). A rule that asked for more images when the
challenger disagrees more would let a noisier challenger through the "too small to judge" door that
a steadier one, as much worse, cannot reach; here more disagreement only widens the bounds, so at the
same true difference it never raises the chance of a blessing within the budget
(`tests/test_gate_drift.py` measures it over a grid).

- **non-inferior**: the one-sided `confidence` lower bound of challenger - champion is above `-margin`.
- **not-shown**: it is not, on a test set that supports the margin: refused.
- **too-small**: it is not, and the set cannot support the margin. The week's margin is then the one
  the set supports at the drift confidence (at most the drift budget), and the lower bound at that
  confidence must be above it.

`drift` compares the challenger with the anchor, the last model shown within the margin of the
anchor before it and no worse than it on the test set of its week, on today's (growing) test set:
its lower bound must be above `-drift_budget` every week, so a run of small losses, each too small
to judge, is refused once their sum is beyond the budget. The bound is one-sided at
`rules.drift_look_confidence` (1 - drift_error / drift_weeks): the error is spent over the weeks an
anchor is judged at, so a loop that retries each refused week gets no fresh 20% chance a week of
letting a loss beyond the budget through (at 80% a week, 12 weeks of retries shipped more than the
budget in up to 61% of the runs at 200 test images). Each of these is a
non-inferiority bound at a fixed margin, and the chance that such a bound is above its margin falls
as the disagreement grows for every true difference
above the margin (below it, it rises at most to the bound's own error rate).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cnnpipe.release.stats import Paired, images_needed, margin_supported, mcnemar_p, newcombe_interval, paired_counts


def planning_discordance(t: Paired) -> float:
    """The discordance a test set must support: the larger of the two error rates. Each model's own
    accuracy, not how much they disagree: at a given true difference it does not grow with the noise."""
    return max(1.0 - t.champion_top1, 1.0 - t.challenger_top1)


def compare(champion_right: np.ndarray, challenger_right: np.ndarray, rules: Any) -> dict[str, Any]:
    """The paired statistics of top-1 on some test images and their outcome (`non-inferior`,
    `not-shown` or `too-small`, with the week's margin). The same function serves the whole set and
    any slice. `rules` is a `gate.GateRules`."""
    t = paired_counts(champion_right, challenger_right)
    lower, upper = newcombe_interval(t, rules.confidence)
    accuracy = (t.champion_top1 + t.challenger_top1) / 2
    planning = planning_discordance(t)
    needed = images_needed(accuracy, planning, rules.margin, rules.confidence, rules.power)
    week_margin, week_confidence, lower_at_week = rules.margin, rules.confidence, lower
    if t.n == 0:
        outcome = "too-small"
    elif lower > -rules.margin:
        outcome = "non-inferior"
    elif t.n >= needed:
        outcome = "not-shown"
    else:
        outcome = "too-small"
    if outcome == "too-small" and t.n:
        supported = margin_supported(t.n, accuracy, planning, rules.confidence, rules.power)
        week_margin, week_confidence = small_set(supported, rules)
        lower_at_week = newcombe_interval(t, week_confidence)[0]
    return {"images": t.n, "champion_top1": t.champion_top1, "challenger_top1": t.challenger_top1,
            "difference": t.difference, "lower_bound": lower, "upper_bound": upper, "confidence": rules.confidence,
            "method": "Newcombe hybrid score (method 10, continuity-adjusted phi), one-sided bounds",
            "negative_flips": t.negative_flips, "positive_flips": t.positive_flips, "discordance": t.discordance,
            "planning_discordance": planning, "mcnemar_exact_p": mcnemar_p(t),
            "images_needed": needed if t.n else None, "outcome": outcome, "week_margin": week_margin,
            "week_confidence": week_confidence,
            "week_lower_bound": lower_at_week,
            "within_week_margin": bool(t.n and lower_at_week >= -week_margin - 1e-12)}


def small_set(supported: float, rules: Any) -> tuple[float, float]:
    """The margin and confidence a test set that supports `supported` at the gate's confidence is
    judged at: that margin (at least `margin`), at most `drift_budget`; a set too small even for the
    budget is judged at the budget with the lower `drift_confidence`."""
    if supported <= rules.drift_budget:
        return max(rules.margin, supported), rules.confidence
    return rules.drift_budget, rules.drift_confidence


def drift(anchor_right: np.ndarray, challenger_right: np.ndarray, rules: Any, anchor: str,
          look: int | None = None) -> dict[str, Any]:
    """The challenger against the anchor (`anchor` says which model that is): the lower bound at the
    drift confidence, whether it is within the budget, and whether the challenger is shown within the
    margin of the anchor (then, blessed, it becomes the next anchor). `look`: which look at this anchor
    this is (`cnnpipe.release.looks`; None: not counted); past `drift_weeks` the error is `spent`."""
    t = paired_counts(anchor_right, challenger_right)
    decidable = drift_decidable(t.n, t.champion_top1, rules)
    confidence = rules.drift_look_confidence if decidable else rules.drift_confidence
    lower = newcombe_interval(t, confidence)[0]
    accuracy, planning = (t.champion_top1 + t.challenger_top1) / 2, planning_discordance(t)
    # The images an equal challenger needs to pass this bound 95% of the time (the size at which the
    # drift rule can decide): a smaller set refuses equal challengers often, and the verdict says so.
    needed = (images_needed(accuracy, planning, rules.drift_budget, rules.drift_look_confidence, rules.power)
              if t.n else None)
    # A new anchor resets the drift, so the move is itself a look: shown within the margin at the same
    # spent confidence. At the week's 95% a 2-point loss on 200 images moved the anchor by luck in 3 of
    # 60 retrying runs, each then free to lose the budget again.
    lower_margin = newcombe_interval(t, max(rules.confidence, confidence))[0]
    return {"anchor": anchor, "images": t.n, "anchor_top1": t.champion_top1, "challenger_top1": t.challenger_top1,
            "difference": t.difference, "discordance": t.discordance, "lower_bound": lower,
            "confidence": confidence, "budget": rules.drift_budget,
            "within": bool(t.n and lower > -rules.drift_budget), "images_needed": needed, "decidable": decidable,
            "error_spent": {"drift_error": rules.drift_error, "drift_weeks": rules.drift_weeks},
            "look": look, "spent": bool(look is not None and look > rules.drift_weeks),
            "shown_within_margin": bool(lower_margin > -rules.margin),
            "lower_bound_at_margin_confidence": lower_margin}


def drift_decidable(n: int, anchor_top1: float, rules: Any) -> bool:
    """Whether `n` test images can pass the spent drift bound at all: a challenger that answers every
    image as the anchor does (no discordance) has its bound above `-drift_budget`. Decided by the size
    and the anchor's accuracy alone, never by the challenger, so a noisier one cannot choose the door.
    At the release defaults this needs about 90 to 190 images (60% to 100% accuracy); below it no
    challenger could ever be blessed, so `too_small` decides (the week is judged at
    `drift_confidence`, with no promise across retries, or refused)."""
    if n <= 0:
        return False
    right = round(n * anchor_top1)
    return newcombe_interval(Paired(right, 0, 0, n - right), rules.drift_look_confidence)[0] > -rules.drift_budget


def paired_reason(p: dict[str, Any], rules: Any, known: int, excluded: int) -> str:
    """The week's comparison in words."""
    where = (f"the same {p['images']} test images of the {known} classes the champion knows"
             + (f" ({excluded} images of new classes left out)" if excluded else ""))
    head = (f"top-1 {p['challenger_top1']:.2%} against the champion's {p['champion_top1']:.2%} on {where}: "
            f"{p['difference']:+.2%}, at worst {p['lower_bound']:+.2%} and at best {p['upper_bound']:+.2%} "
            f"({rules.confidence:.0%} sure each)")
    tail = (f"; {p['negative_flips']} images it now gets wrong, {p['positive_flips']} it now gets right "
            f"(McNemar p={p['mcnemar_exact_p']:.3g})")
    if p["outcome"] == "too-small":
        within = "within" if p["within_week_margin"] else "NOT within"
        outcome = (f": too few test images to judge the allowed -{rules.margin:.2%}; "
                   f"at worst {p['week_lower_bound']:+.2%} "
                   f"({p['week_confidence']:.0%} sure), {within} the -{p['week_margin']:.2%} this test set supports")
    else:
        outcome = {"non-inferior": f", within the allowed -{rules.margin:.2%}",
                   "not-shown": f": not shown within the allowed -{rules.margin:.2%} on {p['images']} images, "
                                "enough to show it"}[p["outcome"]]
    return head + outcome + tail


def drift_reason(d: dict[str, Any]) -> str:
    """The drift from the anchor in words."""
    within = "within" if d["within"] else "BEYOND"
    spent = d.get("error_spent") or {}
    how = (f"{d['confidence']:.2%} sure: {spent['drift_error']:.0%} spent over {spent['drift_weeks']} looks"
           if spent and d.get("decidable") else f"{d['confidence']:.0%} sure"
           + ("" if d.get("decidable", True) else ": too few images for the spent bound"))
    how += f"; look {d['look']} at this anchor" if d.get("look") else ""
    text = (f"drift from the anchor ({d['anchor']}) on {d['images']} test images: {d['difference']:+.2%}, at worst "
            f"{d['lower_bound']:+.2%} ({how}), {within} the budget of -{d['budget']:.2%}")
    if not d["within"] and d.get("decidable") and d.get("images_needed") and d["images"] < d["images_needed"]:
        text += (f"; about {d['images_needed']:,} test images are needed for an equal challenger to pass this "
                 "bound 95% of the time")
    return text


def too_small_warning(p: dict[str, Any], rules: Any) -> str:
    """gate.md's first warning on a week too small to judge the margin."""
    need = (f"about {p['images_needed']:,} test images of the champion's classes are needed to tell a "
            f"{rules.margin:.0%} loss from none when as many answers change as the worse model gets wrong "
            f"({p['planning_discordance']:.1%}; {p['discordance']:.1%} did)"
            if p["images_needed"] is not None else "no test image of a class the champion knows")
    action = (f"the loop blesses it only within the -{p['week_margin']:.2%} this test set supports and within the "
              f"drift budget (release.too_small: bless)" if rules.too_small == "bless"
              else "the loop refuses it (release.too_small: refuse)")
    return f"TOO SMALL TO JUDGE: {p['images']:,} test images; {need}; {action}"


def drift_too_small_warning(d: dict[str, Any], rules: Any) -> str:
    """gate.md's warning on a test set too small for the drift promise."""
    action = (f"the week is judged at {d['confidence']:.0%} a week instead (release.too_small: bless), which a loop "
              "that retries refused weeks can get past by luck" if rules.too_small == "bless"
              else "the loop refuses it (release.too_small: refuse)")
    return (f"TOO SMALL FOR THE DRIFT PROMISE: on {d['images']:,} test images even a challenger answering every one as "
            f"the anchor does stays below -{d['budget']:.0%} at {rules.drift_look_confidence:.2%} "
            f"({rules.drift_error:.0%} spent over {rules.drift_weeks} weeks); {action}; about "
            f"{d['images_needed']:,} test images are needed for an equal challenger to pass it 95% of the time")


def drift_spent_warning(d: dict[str, Any], rules: Any) -> str:
    """gate.md's warning on a look past the `drift_weeks` looks an anchor's error is spent over."""
    action = ("judged at the same spent confidence, but beyond the promise: each further look adds "
              f"{rules.drift_error / rules.drift_weeks:.2%}, {d['look'] * rules.drift_error / rules.drift_weeks:.0%} "
              "so far (release.too_small: bless)" if rules.too_small == "bless"
              else "the loop refuses it (release.too_small: refuse)")
    return (f"DRIFT ERROR SPENT: this is look {d['look']} at the anchor ({d['anchor']}), retries included; "
            f"release.drift_error ({rules.drift_error:.0%}) is spent over release.drift_weeks ({rules.drift_weeks}) "
            f"looks; {action}. A challenger shown within the margin of the anchor becomes the next one and "
            "restarts the count")

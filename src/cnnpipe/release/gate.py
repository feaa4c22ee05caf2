"""The gate's decision: is the challenger at least as good as the champion it would replace?

The API is one pure function, `judge(labels, champion_pred, challenger_pred, classes,
champion_classes, rules, challenger_pred_known=None, anchor_pred=None, anchor_classes=None)`, on the
answers the models gave on the same test images; it returns a JSON-able dict with `blessed` and
`reasons` (and every number behind them). The gate stage (`verdict.run_gate`) only computes those
answers and writes the dict out.

Like for like. A class the champion never saw cannot be held against it, and must not buy the
challenger anything either: the top-1 comparison runs on the test images whose class the champion
knows (through `release.renamed` when a class was renamed), with the challenger's answer taken among
those classes only (its argmax restricted to them: `challenger_pred_known`). On those images
(`paired.compare`, `paired.drift`):

- **the week's margin** of top-1: non-inferior when the one-sided 95% lower bound of (challenger -
  champion) is above `-margin`; refused when it is not on a test set that supports the margin; on a
  smaller one **too small to judge**, its own verdict with the images needed, where `rules.too_small`
  says whether the loop refuses or judges the week at the margin that test set supports (at most
  `drift_budget`). Which case applies depends on the test set's size and the two accuracies, never
  on how much the models disagree: more disagreement never buys a blessing.
- **the drift budget**: against the anchor (the last model shown within the margin of the anchor
  before it, and no worse than it; the champion when none is recorded), on today's whole test set,
  the lower bound must be above
  `-drift_budget`, so small losses cannot add up week after week. The bound's error is spent over
  weeks: each week's is one-sided at `1 - drift_error / drift_weeks` (Bonferroni over the
  `drift_weeks` looks an anchor is judged at), so a loop that retries a refused week with another
  challenger ships a model beyond the budget with probability at most `drift_error` over those weeks
  (plus what a moved anchor's own loss adds), not `1 - drift_confidence` a week. A set too small
  for that bound to pass even a challenger that answers as the anchor does (`paired.drift_decidable`)
  gets a warning, and `too_small` decides: judged at `drift_confidence` (bless) or refused. The looks
  are counted per anchor (`anchor_look`, retries included): a look past `drift_weeks` is beyond the
  promise, so it gets a warning and `too_small` decides: judged at the same spent confidence (bless),
  never a laxer one, or refused.

What is served. The old classes are also judged on the answer the challenger will serve (its argmax
over all of today's classes), where an old class's image called a new class is wrong. Every rule here
holds at every class size: classes too small to judge alone are judged together, never skipped (a
growing catalog's new classes are small; a drain spread thinly over them is still a drain).

- **served top-1**: `compare` on the old classes' images with the served answers, the same outcome
  rules as like for like (the margin, or the margin a small set supports): a new class that takes
  old classes' images cannot hide behind an unchanged like-for-like top-1.
- **no class left behind**: per class with at least `min_support` images, and once for the classes
  under it pooled, a one-sided exact McNemar test that the challenger lost served recall, corrected
  for the number of tests by Holm's step-down with Tarone's count (`stats.tarone_holm`: a class
  whose answers changed on too few images to ever be significant does not dilute the others); a
  class (or the pool) fails when its test is rejected and it lost more than `max_class_drop` of
  recall, whether its images went to another old class or to new ones. Its recall among the
  champion's classes is reported beside it.
- **drained into new classes**: the share of an old class's images the challenger now calls any new
  class, at most `max_to_new_class`: per class of `min_support` images, for the smaller classes
  pooled, and over all the old classes' images together.

New classes are judged on their own: a one-sided exact test that a class's recall is below
`new_class_min_recall`, Holm-adjusted over the new classes. Removed classes are listed. Floors apply
to the challenger's own metrics (evaluate's eval.json). With no champion, the floors alone decide.

Slices (a subset of the test images: last week's, one supplier's) reuse `compare` on a mask: pass
`slices={name: mask}` and the verdict reports each slice's paired statistics.

Anchors: TFX's Evaluator blesses on value and change thresholds per slice; this gate adds the
statistics (a paired bound, a size check, a multiplicity correction) whose operating
characteristics bench/gate_power.py measures.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from cnnpipe.release.paired import (
    compare,
    drift,
    drift_reason,
    drift_spent_warning,
    drift_too_small_warning,
    paired_reason,
    too_small_warning,
)
from cnnpipe.release.class_rules import (REPORTED_CLASSES, GateRules, class_map, class_rule, new_class_pulls,
                                         new_class_rule, new_class_share)

def floors_reasons(metrics: Mapping[str, Any], floors: Mapping[str, float]) -> tuple[list[str], bool]:
    """The floors on the challenger's own metrics: reasons and whether any failed."""
    reasons, failed = [], False
    for metric, floor in floors.items():
        if not isinstance(metrics.get(metric), (int, float)):
            have = ", ".join(sorted(k for k, v in metrics.items() if isinstance(v, float)))
            raise KeyError(f"release.floors names {metric!r}, which evaluate does not report (have: {have})")
        value = float(metrics[metric])
        failed |= value < floor
        reasons.append(f"{metric} {value:.4f} {'meets' if value >= floor else 'is below'} the floor of {floor:.4f}")
    return reasons, failed


def judge(labels: np.ndarray, champion_pred: np.ndarray | None, challenger_pred: np.ndarray, classes: Sequence[str],
          champion_classes: Sequence[str], rules: GateRules, challenger_pred_known: np.ndarray | None = None, *,
          metrics: Mapping[str, Any] | None = None, slices: Mapping[str, np.ndarray] | None = None,
          anchor_pred: np.ndarray | None = None, anchor_classes: Sequence[str] | None = None,
          anchor_name: str = "the champion: no anchor recorded", anchor_look: int | None = None) -> dict[str, Any]:
    """The gate's verdict on one test set.

    labels: each test image's class, an index into `classes` (today's).
    champion_pred: the champion's answer per image, an index into `champion_classes` (its own);
        None when there is no champion (the floors alone decide).
    challenger_pred: the challenger's answer, an index into `classes`: the answer it will serve.
    challenger_pred_known: its answer among the classes the champion knows (the argmax over those
        logits alone); default `challenger_pred`, where an old-class image called a new class counts
        as wrong.
    metrics: the challenger's eval.json numbers, for `rules.floors` (None: no floors checked).
    slices: name -> boolean mask over the test images; each gets `compare`'s statistics, reported.
    anchor_pred, anchor_classes, anchor_name: the anchor's answers (an index into its own classes),
        for the drift budget; None: the champion is the anchor.
    anchor_look: which look at the anchor this is, retries included (`cnnpipe.release.looks`); past
        `rules.drift_weeks` the drift's error is spent: warned, and refused under `too_small: refuse`.

    Returns `blessed`, `reasons` (every rule's outcome, in words) and `warnings`, with the numbers:
    `paired` (like for like), `served` (the served answers on the same images), `drift`,
    `classes_judged`, `classes_failing`, `worst_classes`, `new_classes`, `removed_classes`, `renamed`,
    `to_new_classes`, `too_small` and `slices`.
    """
    labels = np.asarray(labels, dtype=np.int64)
    challenger_pred = np.asarray(challenger_pred, dtype=np.int64)
    reasons, warnings = [], []
    failed = False
    if metrics is not None:
        reasons, failed = floors_reasons(metrics, rules.floors)
    verdict: dict[str, Any] = {"first_model": champion_pred is None, "too_small": None, "slices": {}}
    if champion_pred is None:
        reasons.insert(0, "first model: no champion in production yet, so it is judged on the floors alone")
        return {**verdict, "blessed": not failed, "reasons": reasons, "warnings": warnings}

    cmap = class_map(classes, champion_classes, rules.renamed)
    known_pred = challenger_pred if challenger_pred_known is None else np.asarray(challenger_pred_known, np.int64)
    old = cmap.known[labels]
    champion_right = cmap.champion_to_today[np.asarray(champion_pred, dtype=np.int64)] == labels
    challenger_right = known_pred == labels
    served_right = challenger_pred == labels  # an old class's image called a new class is wrong here
    paired = compare(champion_right[old], challenger_right[old], rules)
    verdict["paired"] = paired
    verdict["served"] = served = compare(champion_right[old], served_right[old], rules)
    reasons.append(paired_reason(paired, rules, len(classes) - len(cmap.new), int((~old).sum())))
    if paired["outcome"] == "not-shown":
        failed = True
    elif paired["outcome"] == "too-small":
        verdict["too_small"] = {"images": paired["images"], "needed": paired["images_needed"],
                                "action": rules.too_small, "week_margin": paired["week_margin"],
                                "within_week_margin": paired["within_week_margin"]}
        failed |= rules.too_small == "refuse" or not paired["within_week_margin"]
        warnings.append(too_small_warning(paired, rules))

    if anchor_pred is None:
        anchor_right, on = champion_right, old
    else:
        amap = class_map(classes, anchor_classes or [], rules.renamed)
        anchor_right = amap.champion_to_today[np.asarray(anchor_pred, dtype=np.int64)] == labels
        on = old & amap.known[labels]
    verdict["drift"] = drifted = drift(anchor_right[on], challenger_right[on], rules, anchor_name, anchor_look)
    failed |= not drifted["within"]
    reasons.append(drift_reason(drifted))
    if not drifted["decidable"]:
        # No challenger could pass the spent bound on so few images: the loop's too_small policy decides.
        failed |= rules.too_small == "refuse"
        warnings.append(drift_too_small_warning(drifted, rules))
    if drifted["spent"]:  # more looks than the error was spent over: the promise no longer covers this one
        failed |= rules.too_small == "refuse"
        warnings.append(drift_spent_warning(drifted, rules))

    # The served answers' top-1 on the old classes, ruled on like the like-for-like one: the same
    # margin, or the margin a small set supports. Only a new class can make the two differ.
    served_failing = served["outcome"] == "not-shown" or (served["outcome"] == "too-small"
                                                          and not served["within_week_margin"])
    verdict["served_failing"] = served_failing
    failed |= served_failing
    if served["difference"] != paired["difference"]:
        margin = served["week_margin"] if served["outcome"] == "too-small" else rules.margin
        confidence = served["week_confidence"] if served["outcome"] == "too-small" else rules.confidence
        bound = served["week_lower_bound"] if served["outcome"] == "too-small" else served["lower_bound"]
        reasons.append(f"as served (an old class's image called a new class is wrong) top-1 on the old classes "
                       f"{served['champion_top1']:.2%} -> {served['challenger_top1']:.2%} "
                       f"({served['difference']:+.2%}, at worst {bound:+.2%}, {confidence:.0%} sure): "
                       + ("NOT within" if served_failing else "within") + f" the allowed -{margin:.2%}")

    rows = class_rule(labels[old], champion_right[old], served_right[old], classes, rules, challenger_right[old])
    failing = [r for r in rows if r["failing"]]
    failed |= bool(failing)
    judged = sum(r["judged"] for r in rows)
    for r in failing:
        who = f"the {r['class']}," if "pooled" in r else f"class {r['class']!r}"
        reasons.append(f"{who} loses {r['drop']:.1%} of recall as served ({r['champion_recall']:.1%} -> "
                       f"{r['challenger_recall']:.1%} on {r['support']} images, "
                       f"{r['challenger_recall_like_for_like']:.1%} among the champion's classes; "
                       f"{r['negative_flips']} now wrong, "
                       f"{r['positive_flips']} now right; p={r['p_worse']:.2g}, below the {r['level']:.2g} the "
                       f"correction for {judged} tests asks), more than the allowed {rules.max_class_drop:.1%}")
    if not failing:
        reasons.append(f"no class loses recall as served beyond doubt and by more than {rules.max_class_drop:.1%} "
                       f"({judged} tests: the classes of at least {rules.min_support} test images, and the "
                       "smaller ones pooled, "
                       f"{rules.class_alpha:.0%} for them all)")
    verdict.update(classes_judged=judged, classes_failing=[r["class"] for r in failing],
                   worst_classes=failing + [r for r in rows if not r["failing"]][:REPORTED_CLASSES])

    new_rows = new_class_rule(labels, challenger_pred, classes, cmap.new, rules)
    for r in new_rows:
        failed |= r["failing"]
        line = (f"new class {r['class']!r}: recall {r['recall']:.1%} on {r['support']} images "
                f"(the floor is {rules.new_class_min_recall:.0%})")
        if r["failing"]:
            reasons.append(line + ": below it beyond doubt")
        elif r["recall"] < rules.new_class_min_recall:
            warnings.append(line + ": below it, on too few images to tell")
    if cmap.new:
        reasons.append(f"new classes the champion never saw, judged on their own: {', '.join(cmap.new)}")
    pulls = new_class_pulls(labels, challenger_pred, classes, cmap, rules)
    for r in pulls:
        if r["failing"]:
            failed = True
            to = ", ".join(f"{name!r} {count}" for name, count in r["to"].items())
            reasons.append(f"{r['images']} of {r['of']} test images of {r['from']!r} ({r['share']:.1%}) are now "
                           f"called a new class ({to}): more than the allowed {rules.max_to_new_class:.0%}")
    shares = new_class_share(labels, challenger_pred, cmap, rules, classes) if cmap.new else None
    for what, r in (shares or {}).items():
        if r["failing"]:
            failed = True
            of = ("the old classes' test images" if what == "overall" else
                  f"the test images of the {r['classes']} old classes under {rules.min_support} images, pooled")
            reasons.append(f"{r['images']} of {r['of']} of {of} ({r['share']:.1%}) are now called a new class: more "
                           f"than the allowed {rules.max_to_new_class:.0%}")
    if cmap.removed:
        reasons.append(f"classes the champion knew and today's data no longer has: {', '.join(cmap.removed)}")
    unknown = sorted(set(rules.renamed) - set(cmap.renamed))
    if unknown:
        warnings.append(f"release.renamed maps {', '.join(map(repr, unknown))}, which the champion does not know "
                        "or whose new name today's data lacks")
    for name, mask in (slices or {}).items():
        mask = np.asarray(mask, dtype=bool) & old
        verdict["slices"][name] = compare(champion_right[mask], challenger_right[mask], rules)
    # Only a challenger shown within the margin and no worse than the anchor on these images replaces it:
    # one shown within the margin but a little worse would let the anchor follow a slow slide down.
    drifted["new_anchor"] = not failed and drifted["shown_within_margin"] and drifted["difference"] >= 0
    verdict.update(new_classes=new_rows, removed_classes=cmap.removed, renamed=cmap.renamed,
                   to_new_classes=pulls[:REPORTED_CLASSES], to_new_overall=(shares or {}).get("overall"),
                   to_new_pooled=(shares or {}).get("pooled"), blessed=not failed, reasons=reasons, warnings=warnings)
    return verdict

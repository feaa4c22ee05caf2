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
  gets a warning, and `too_small` decides: judged at `drift_confidence` (bless) or refused.

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

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

import numpy as np
from scipy.stats import binom

from cnnpipe.release.paired import (
    compare,
    drift,
    drift_reason,
    drift_too_small_warning,
    paired_reason,
    too_small_warning,
)
from cnnpipe.release.stats import holm, tarone_holm, wilson, worse_p, z_of

REPORTED_CLASSES = 20  # the worst classes listed in the verdict (every failing one is listed too)


@dataclass(frozen=True)
class GateRules:
    """The `release:` params that decide (see config.ReleaseConfig for each)."""

    margin: float = 0.01
    confidence: float = 0.95
    power: float = 0.95
    class_confidence: float = 0.95  # family-wise, over the judged classes
    min_support: int = 20
    max_class_drop: float = 0.05
    too_small: Literal["bless", "refuse"] = "bless"
    new_class_min_recall: float = 0.5
    max_to_new_class: float = 0.25
    drift_budget: float = 0.03
    drift_confidence: float = 0.8
    drift_weeks: int = 12
    drift_error: float = 0.1
    renamed: Mapping[str, str] = field(default_factory=dict)
    floors: Mapping[str, float] = field(default_factory=lambda: {"top1": 0.5})

    @property
    def alpha(self) -> float:
        return 1.0 - self.confidence

    @property
    def class_alpha(self) -> float:
        return 1.0 - self.class_confidence

    @property
    def drift_look_confidence(self) -> float:
        """The one-sided confidence of each week's drift bound: `drift_error` spent evenly over
        `drift_weeks` looks (Bonferroni: any of them passing a challenger beyond the budget is the
        error the drift promise bounds, whatever the looks' correlation on a growing test set)."""
        return 1.0 - self.drift_error / self.drift_weeks

    @classmethod
    def from_config(cls, cfg: Any) -> GateRules:
        """The rules in a `ReleaseConfig`."""
        return cls(margin=cfg.margin, min_support=cfg.min_support, max_class_drop=cfg.max_class_drop,
                   too_small=cfg.too_small, new_class_min_recall=cfg.new_class_min_recall,
                   max_to_new_class=cfg.max_to_new_class, drift_budget=cfg.drift_budget,
                   drift_confidence=cfg.drift_confidence, drift_weeks=cfg.drift_weeks,
                   drift_error=cfg.drift_error, renamed=dict(cfg.renamed), floors=dict(cfg.floors))


@dataclass(frozen=True)
class ClassMap:
    """How the champion's classes meet today's: by name, through `renamed`."""

    champion_to_today: np.ndarray  # per champion class, today's index or -1 (removed)
    known: np.ndarray  # per today's class: does the champion know it?
    new: list[str]
    removed: list[str]
    renamed: dict[str, str]  # the renames that applied


def class_map(classes: Sequence[str], champion_classes: Sequence[str], renamed: Mapping[str, str]) -> ClassMap:
    """Today's index of each champion class (`renamed` maps old names to new ones)."""
    today = {name: i for i, name in enumerate(classes)}
    targets = [renamed.get(name, name) for name in champion_classes]
    doubled = sorted(t for t, n in Counter(targets).items() if n > 1)
    if doubled:
        raise ValueError(f"release.renamed maps two of the champion's classes onto {', '.join(map(repr, doubled))}: "
                         "one name each")
    to_today = np.array([today.get(t, -1) for t in targets], dtype=np.int64)
    known_names = set(champion_classes)
    known = np.zeros(len(classes), dtype=bool)
    known[to_today[to_today >= 0]] = True
    return ClassMap(to_today, known, [c for c, k in zip(classes, known) if not k],
                    [old for old, i in zip(champion_classes, to_today) if i < 0],
                    {old: new for old, new in renamed.items() if old in known_names and new in today})


def class_rule(labels: np.ndarray, champion_right: np.ndarray, challenger_right: np.ndarray, classes: Sequence[str],
               rules: GateRules, like_for_like_right: np.ndarray | None = None) -> list[dict[str, Any]]:
    """Per class present in `labels`: both recalls, the flips, the one-sided exact p that the challenger
    lost recall and the level it was tested at (`tarone_holm` over the judged classes, those with
    `min_support` images or more, and one more test: the classes under it pooled, a row of its own
    with `pooled` naming them), and whether it fails. Failing classes first, then by drop.
    `like_for_like_right` (the challenger's answers among the champion's classes) adds its recall on
    them to each row, reported beside the judged one."""
    k = len(classes)
    present = np.bincount(labels, minlength=k) > 0
    small = present & (np.bincount(labels, minlength=k) < rules.min_support)
    # The classes too small to judge alone are judged together: their images counted once more, in a
    # pool that is the (k+1)-th row of every count below. Skipping them let a drain spread over many
    # small classes through (10 classes x 15 images, 30% called a new class: blessed).
    pool = np.where(small[labels], k, -1)
    pooled_labels = np.concatenate([labels, pool[pool >= 0]])
    twice = lambda right: np.concatenate([right, right[pool >= 0]])  # noqa: E731
    support = np.bincount(pooled_labels, minlength=k + 1)
    hits = lambda right: np.bincount(pooled_labels, weights=twice(right).astype(np.float64),  # noqa: E731
                                     minlength=k + 1)
    champion_hits, challenger_hits = hits(champion_right), hits(challenger_right)
    negative, positive = hits(champion_right & ~challenger_right), hits(~champion_right & challenger_right)
    judged = support >= rules.min_support
    judged[k] = small.any()  # the pool is judged whatever its size: too few images only weaken its test
    p = worse_p(negative, positive)
    rejected, level = np.zeros(k + 1, dtype=bool), np.ones(k + 1)
    # A class can only fail with more changed answers than max_class_drop of its images (b - c <= b + c):
    # below that it can reach no level that matters, and does not count in the correction either.
    changed = negative + positive
    least = np.where(changed > rules.max_class_drop * support, 0.5 ** changed, 1.0)
    rejected[judged], level[judged] = tarone_holm(p[judged], least[judged], rules.class_alpha)
    with np.errstate(invalid="ignore", divide="ignore"):
        before, after = champion_hits / support, challenger_hits / support
    drop = before - after
    failing = rejected & (drop > rules.max_class_drop + 1e-12)
    names = list(classes) + [pool_name(int(small.sum()), rules.min_support)]
    shown = np.flatnonzero(support)
    rows = [{"class": names[i], "support": int(support[i]), "champion_recall": float(before[i]),
             "challenger_recall": float(after[i]), "drop": float(drop[i]), "negative_flips": int(negative[i]),
             "positive_flips": int(positive[i]), "p_worse": float(p[i]), "level": float(level[i]),
             "judged": bool(judged[i]), "failing": bool(failing[i])} for i in shown]
    if small.any():
        rows[-1]["pooled"] = [classes[i] for i in np.flatnonzero(small)]
    if like_for_like_right is not None:
        with np.errstate(invalid="ignore", divide="ignore"):
            like = hits(like_for_like_right) / support
        for row, i in zip(rows, shown):
            row["challenger_recall_like_for_like"] = float(like[i])
    return sorted(rows, key=lambda r: (not r["failing"], -r["drop"], r["class"]))


def pool_name(count: int, min_support: int) -> str:
    """The name the pooled small classes go by in the verdict."""
    return f"{count} class{'es' if count != 1 else ''} under {min_support} test images, pooled"


def new_class_rule(labels: np.ndarray, challenger_pred: np.ndarray, classes: Sequence[str], new: Sequence[str],
                   rules: GateRules) -> list[dict[str, Any]]:
    """Per new class with test images: the challenger's recall, its Wilson bounds, and a one-sided exact
    test that it is below the floor, Holm-adjusted over the new classes."""
    index = {name: i for i, name in enumerate(classes)}
    rows = []
    for name in new:
        mask = labels == index[name]
        n, hits = int(mask.sum()), int(np.sum(challenger_pred[mask] == index[name]))
        if n:
            rows.append({"class": name, "support": n, "recall": hits / n,
                         "bounds": list(wilson(hits, n, z_of(rules.confidence))),
                         "p_below_floor": float(binom.cdf(hits, n, rules.new_class_min_recall))})
    adjusted = holm(np.array([r["p_below_floor"] for r in rows]))
    for row, p in zip(rows, adjusted):
        row.update(p_holm=float(p), failing=bool(p <= rules.alpha))
    return rows


def new_class_pulls(labels: np.ndarray, challenger_pred: np.ndarray, classes: Sequence[str], cmap: ClassMap,
                    rules: GateRules) -> list[dict[str, Any]]:
    """Per old class: its test images the challenger now calls any new class (`to`: how many each),
    and whether their share is over `max_to_new_class` (judged on classes of `min_support`; the smaller
    ones are judged pooled and overall, `new_class_share`)."""
    k = len(classes)
    new_index = np.flatnonzero(~cmap.known)
    if not len(new_index):
        return []
    old = cmap.known[labels]
    support = np.bincount(labels, minlength=k)
    pairs = np.bincount(labels[old] * k + challenger_pred[old], minlength=k * k).reshape(k, k)[:, new_index]
    rows = []
    for i in np.flatnonzero(pairs.sum(1)):
        count, of = int(pairs[i].sum()), int(support[i])
        share = count / of
        to = {classes[new_index[j]]: int(pairs[i, j]) for j in np.flatnonzero(pairs[i])}
        rows.append({"from": classes[i], "to": to,
                     "images": count, "of": of, "share": share,
                     "failing": bool(of >= rules.min_support and share > rules.max_to_new_class + 1e-12)})
    return sorted(rows, key=lambda r: (not r["failing"], -r["share"], r["from"]))


def new_class_share(labels: np.ndarray, challenger_pred: np.ndarray, cmap: ClassMap, rules: GateRules,
                    classes: Sequence[str]) -> dict[str, Any]:
    """The share of the old classes' test images the challenger now calls any new class: over all of
    them (`overall`) and over the classes under `min_support` pooled (`pooled`, judged when the pool has
    `min_support` images), each failing over `max_to_new_class`. A drain spread thinly over many
    classes, each too small to judge alone, is a drain all the same."""
    old = cmap.known[labels]
    to_new = ~cmap.known[challenger_pred] & old
    support = np.bincount(labels, minlength=len(classes))
    small_class = (support < rules.min_support) & cmap.known
    small = small_class[labels]

    def share(mask: np.ndarray, judged: bool) -> dict[str, Any]:
        count, of = int(to_new[mask].sum()), int(mask.sum())
        value = count / of if of else 0.0
        return {"images": count, "of": of, "share": value,
                "failing": bool(judged and of and value > rules.max_to_new_class + 1e-12)}

    return {"overall": share(old, True),
            "pooled": {**share(small, int(small.sum()) >= rules.min_support),
                       "classes": int(small_class[np.unique(labels)].sum())}}


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
          anchor_name: str = "the champion: no anchor recorded") -> dict[str, Any]:
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
    verdict["drift"] = drifted = drift(anchor_right[on], challenger_right[on], rules, anchor_name)
    failed |= not drifted["within"]
    reasons.append(drift_reason(drifted))
    if not drifted["decidable"]:
        # No challenger could pass the spent bound on so few images: the loop's too_small policy decides.
        failed |= rules.too_small == "refuse"
        warnings.append(drift_too_small_warning(drifted, rules))

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

"""The gate's decision: is the challenger at least as good as the champion it would replace?

The API is one pure function, `judge(labels, champion_pred, challenger_pred, classes,
champion_classes, rules, challenger_pred_known=None)`, on the answers both models gave on the same
test images; it returns a JSON-able dict with `blessed` and `reasons` (and every number behind
them). The gate stage (`verdict.run_gate`) only computes those answers and writes the dict out.

Like for like. A class the champion never saw cannot be held against it, and must not buy the
challenger anything either: the comparison runs on the test images whose class the champion knows
(through `release.renamed` when a class was renamed), with the challenger's answer taken among those
classes only (its argmax restricted to them: `challenger_pred_known`). On those images:

- **non-inferiority** of top-1: the one-sided 95% lower bound of (challenger - champion) must be
  above `-margin` (Newcombe's hybrid score interval with the continuity-adjusted correlation,
  `stats.newcombe_interval`). When it is not: with at least the images the margin needs at the
  observed discordance (`stats.images_needed`), refused; with fewer, refused only when the
  challenger is worse beyond doubt (the 99% upper bound below 0), else **too small to judge**, its
  own verdict, with the number of images needed; `rules.too_small` says whether the loop then
  refuses or blesses with a warning.
- **no class left behind**: per class with at least `min_support` images, a one-sided exact
  McNemar test that the challenger lost recall, corrected for the number of classes by Holm's
  step-down with Tarone's count (`stats.tarone_holm`: a class whose answers changed on too few
  images to ever be significant does not dilute the others); a class fails when its test is
  rejected and it lost more than `max_class_drop` of recall.
- **drained into a new class**: the share of an old class's images the challenger (unrestricted)
  now calls one new class, per pair, at most `max_to_new_class`.

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

from cnnpipe.release.stats import (
    holm,
    images_needed,
    mcnemar_p,
    newcombe_interval,
    paired_counts,
    tarone_holm,
    wilson,
    worse_p,
    z_of,
)

REPORTED_CLASSES = 20  # the worst classes listed in the verdict (every failing one is listed too)
WORSE_CONFIDENCE = 0.99  # "worse beyond doubt" on a test set too small for the margin: 1% of equal challengers


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
    renamed: Mapping[str, str] = field(default_factory=dict)
    floors: Mapping[str, float] = field(default_factory=lambda: {"top1": 0.5})

    @property
    def alpha(self) -> float:
        return 1.0 - self.confidence

    @property
    def class_alpha(self) -> float:
        return 1.0 - self.class_confidence

    @classmethod
    def from_config(cls, cfg: Any) -> GateRules:
        """The rules in a `ReleaseConfig`."""
        return cls(margin=cfg.margin, min_support=cfg.min_support, max_class_drop=cfg.max_class_drop,
                   too_small=cfg.too_small, new_class_min_recall=cfg.new_class_min_recall,
                   max_to_new_class=cfg.max_to_new_class, renamed=dict(cfg.renamed), floors=dict(cfg.floors))


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


def compare(champion_right: np.ndarray, challenger_right: np.ndarray, rules: GateRules) -> dict[str, Any]:
    """The paired statistics of top-1 on some test images and their outcome: `non-inferior`, `not-shown`
    (the images the margin needs, and still not within it), `worse` (fewer images, but the 99% upper
    bound is below 0) or `too-small`. The same function serves the whole set and any slice."""
    t = paired_counts(champion_right, challenger_right)
    lower, upper = newcombe_interval(t, rules.confidence)
    needed = images_needed((t.champion_top1 + t.challenger_top1) / 2, t.discordance, rules.margin, rules.confidence,
                           rules.power)
    if t.n == 0:
        outcome = "too-small"
    elif lower > -rules.margin:
        outcome = "non-inferior"
    elif t.n >= needed:
        outcome = "not-shown"
    elif newcombe_interval(t, WORSE_CONFIDENCE)[1] < 0:
        outcome = "worse"
    else:
        outcome = "too-small"
    return {"images": t.n, "champion_top1": t.champion_top1, "challenger_top1": t.challenger_top1,
            "difference": t.difference, "lower_bound": lower, "upper_bound": upper, "confidence": rules.confidence,
            "method": "Newcombe hybrid score (method 10, continuity-adjusted phi), one-sided bounds",
            "negative_flips": t.negative_flips, "positive_flips": t.positive_flips, "discordance": t.discordance,
            "mcnemar_exact_p": mcnemar_p(t), "images_needed": needed if t.n else None, "outcome": outcome}


def class_rule(labels: np.ndarray, champion_right: np.ndarray, challenger_right: np.ndarray, classes: Sequence[str],
               rules: GateRules) -> list[dict[str, Any]]:
    """Per class present in `labels`: both recalls, the flips, the one-sided exact p that the challenger
    lost recall and the level it was tested at (`tarone_holm` over the judged classes, those with
    `min_support` images or more), and whether it fails. Failing classes first, then by drop."""
    k = len(classes)
    support = np.bincount(labels, minlength=k)
    hits = lambda right: np.bincount(labels, weights=right.astype(np.float64), minlength=k)  # noqa: E731
    champion_hits, challenger_hits = hits(champion_right), hits(challenger_right)
    negative, positive = hits(champion_right & ~challenger_right), hits(~champion_right & challenger_right)
    judged = support >= rules.min_support
    p = worse_p(negative, positive)
    rejected, level = np.zeros(k, dtype=bool), np.ones(k)
    # A class can only fail with more changed answers than max_class_drop of its images (b - c <= b + c):
    # below that it can reach no level that matters, and does not count in the correction either.
    changed = negative + positive
    least = np.where(changed > rules.max_class_drop * support, 0.5 ** changed, 1.0)
    rejected[judged], level[judged] = tarone_holm(p[judged], least[judged], rules.class_alpha)
    with np.errstate(invalid="ignore", divide="ignore"):
        before, after = champion_hits / support, challenger_hits / support
    drop = before - after
    failing = rejected & (drop > rules.max_class_drop + 1e-12)
    rows = [{"class": classes[i], "support": int(support[i]), "champion_recall": float(before[i]),
             "challenger_recall": float(after[i]), "drop": float(drop[i]), "negative_flips": int(negative[i]),
             "positive_flips": int(positive[i]), "p_worse": float(p[i]), "level": float(level[i]),
             "judged": bool(judged[i]), "failing": bool(failing[i])} for i in np.flatnonzero(support)]
    return sorted(rows, key=lambda r: (not r["failing"], -r["drop"], r["class"]))


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
    """Per (old class, new class) pair: the old class's test images the challenger now calls the new
    class, and whether that share is over `max_to_new_class` (judged on classes of `min_support`)."""
    k = len(classes)
    new_index = np.flatnonzero(~cmap.known)
    if not len(new_index):
        return []
    old = cmap.known[labels]
    support = np.bincount(labels, minlength=k)
    pairs = np.bincount(labels[old] * k + challenger_pred[old], minlength=k * k).reshape(k, k)[:, new_index]
    rows = []
    for i, j in zip(*np.nonzero(pairs)):
        count, of = int(pairs[i, j]), int(support[i])
        share = count / of
        rows.append({"from": classes[i], "to": classes[new_index[j]], "images": count, "of": of, "share": share,
                     "failing": bool(of >= rules.min_support and share > rules.max_to_new_class + 1e-12)})
    return sorted(rows, key=lambda r: (not r["failing"], -r["share"], r["from"], r["to"]))


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
          metrics: Mapping[str, Any] | None = None,
          slices: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
    """The gate's verdict on one test set.

    labels: each test image's class, an index into `classes` (today's).
    champion_pred: the champion's answer per image, an index into `champion_classes` (its own);
        None when there is no champion (the floors alone decide).
    challenger_pred: the challenger's answer, an index into `classes`.
    challenger_pred_known: its answer among the classes the champion knows (the argmax over those
        logits alone); default `challenger_pred`, where an old-class image called a new class counts
        as wrong.
    metrics: the challenger's eval.json numbers, for `rules.floors` (None: no floors checked).
    slices: name -> boolean mask over the test images; each gets `compare`'s statistics, reported.

    Returns `blessed`, `reasons` (every rule's outcome, in words) and `warnings`, with the numbers:
    `paired` (like for like), `classes_judged`, `classes_failing`, `worst_classes`, `new_classes`,
    `removed_classes`, `renamed`, `to_new_classes`, `too_small` and `slices`.
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
    paired = compare(champion_right[old], challenger_right[old], rules)
    verdict["paired"] = paired
    reasons.append(_paired_reason(paired, rules, len(classes) - len(cmap.new), int((~old).sum())))
    if paired["outcome"] in ("worse", "not-shown"):
        failed = True
    elif paired["outcome"] == "too-small":
        verdict["too_small"] = {"images": paired["images"], "needed": paired["images_needed"],
                                "action": rules.too_small}
        failed |= rules.too_small == "refuse"
        warnings.append(_too_small_warning(paired, rules))

    rows = class_rule(labels[old], champion_right[old], challenger_right[old], classes, rules)
    failing = [r for r in rows if r["failing"]]
    failed |= bool(failing)
    judged = sum(r["judged"] for r in rows)
    for r in failing:
        reasons.append(f"class {r['class']!r} loses {r['drop']:.1%} of recall ({r['champion_recall']:.1%} -> "
                       f"{r['challenger_recall']:.1%} on {r['support']} images; {r['negative_flips']} now wrong, "
                       f"{r['positive_flips']} now right; p={r['p_worse']:.2g}, below the {r['level']:.2g} the "
                       f"correction for {judged} classes asks), more than the allowed {rules.max_class_drop:.1%}")
    if not failing:
        reasons.append(f"no class loses recall beyond doubt and by more than {rules.max_class_drop:.1%} "
                       f"({judged} classes with at least {rules.min_support} test images judged, "
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
            reasons.append(f"{r['images']} of {r['of']} test images of {r['from']!r} ({r['share']:.1%}) are now "
                           f"called the new class {r['to']!r}: more than the allowed {rules.max_to_new_class:.0%}")
    if cmap.removed:
        reasons.append(f"classes the champion knew and today's data no longer has: {', '.join(cmap.removed)}")
    unknown = sorted(set(rules.renamed) - set(cmap.renamed))
    if unknown:
        warnings.append(f"release.renamed maps {', '.join(map(repr, unknown))}, which the champion does not know "
                        "or whose new name today's data lacks")
    for name, mask in (slices or {}).items():
        mask = np.asarray(mask, dtype=bool) & old
        verdict["slices"][name] = compare(champion_right[mask], challenger_right[mask], rules)
    verdict.update(new_classes=new_rows, removed_classes=cmap.removed, renamed=cmap.renamed,
                   to_new_classes=pulls[:REPORTED_CLASSES], blessed=not failed, reasons=reasons, warnings=warnings)
    return verdict


def _paired_reason(p: dict[str, Any], rules: GateRules, known: int, excluded: int) -> str:
    where = (f"the same {p['images']} test images of the {known} classes the champion knows"
             + (f" ({excluded} images of new classes left out)" if excluded else ""))
    head = (f"top-1 {p['challenger_top1']:.2%} against the champion's {p['champion_top1']:.2%} on {where}: "
            f"{p['difference']:+.2%}, at worst {p['lower_bound']:+.2%} and at best {p['upper_bound']:+.2%} "
            f"({rules.confidence:.0%} sure each)")
    tail = (f"; {p['negative_flips']} images it now gets wrong, {p['positive_flips']} it now gets right "
            f"(McNemar p={p['mcnemar_exact_p']:.3g})")
    outcome = {
        "non-inferior": f", within the allowed -{rules.margin:.2%}",
        "worse": f": worse than the champion beyond doubt, and possibly by more than the allowed -{rules.margin:.2%}",
        "not-shown": f": not shown within the allowed -{rules.margin:.2%} on {p['images']} images, enough to show it",
        "too-small": ": too few test images to judge",
    }[p["outcome"]]
    return head + outcome + tail


def _too_small_warning(p: dict[str, Any], rules: GateRules) -> str:
    need = (f"about {p['images_needed']:,} test images of the champion's classes are needed to tell a "
            f"{rules.margin:.0%} loss from none at this discordance ({p['discordance']:.1%} of answers change)"
            if p["images_needed"] is not None else "no test image of a class the champion knows")
    action = ("the loop blesses it with this warning (release.too_small: bless)" if rules.too_small == "bless"
              else "the loop refuses it (release.too_small: refuse)")
    return f"TOO SMALL TO JUDGE: {p['images']:,} test images; {need}; {action}"

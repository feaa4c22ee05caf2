"""The gate's rules and its per-class parts: `GateRules` (the params, resolved), how today's classes
map to the champion's (`class_map`), the per-class rule with small classes pooled (`class_rule`), and
the rules on new classes (`new_class_rule`, `new_class_pulls`, `new_class_share`). `cnnpipe.release.gate`
combines them into one verdict (`judge`); its module docstring says what each rule promises.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

import numpy as np
from scipy.stats import binom

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

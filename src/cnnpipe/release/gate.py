"""The gate: is the challenger at least as good as the champion it would replace?

TFX's Evaluator blesses a candidate on value and change thresholds; this gate adds what a threshold
on two accuracies cannot say, judged on the same test images (paired):

- **non-inferiority** of top-1: the one-sided 95% lower bound of (challenger - champion) must be
  above `-margin`. The bound is Newcombe's hybrid score interval for a difference of paired
  proportions (Newcombe 1998, Statistics in Medicine 17:2635, method 10): Wilson intervals of the two
  accuracies combined through the correlation of the pairs. Unlike the Wald bound it stays inside
  [-1, 1] and keeps its coverage when few images change;
- **McNemar's exact test** on the discordant pairs (champion right and challenger wrong: negative
  flips; the reverse: positive flips), reported beside it;
- **no class left behind**: no class with at least `min_support` test images may lose more than
  `max_class_drop` of recall (a supplier's mix-up of two classes hides in an overall top-1);
- **absolute floors** on the challenger's own metrics (top-1, and any other the user names).

With no champion the gate judges on the floors alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from scipy.stats import binomtest, norm


@dataclass(frozen=True)
class Paired:
    """Counts of a paired comparison on n images."""

    both_right: int
    negative_flips: int  # champion right, challenger wrong
    positive_flips: int  # champion wrong, challenger right
    both_wrong: int

    @property
    def n(self) -> int:
        return self.both_right + self.negative_flips + self.positive_flips + self.both_wrong

    @property
    def champion_top1(self) -> float:
        return (self.both_right + self.negative_flips) / max(self.n, 1)

    @property
    def challenger_top1(self) -> float:
        return (self.both_right + self.positive_flips) / max(self.n, 1)


def paired_counts(champion_right: np.ndarray, challenger_right: np.ndarray) -> Paired:
    """The four cells of the paired table from per-image correctness."""
    a, b = np.asarray(champion_right, bool), np.asarray(challenger_right, bool)
    return Paired(int(np.sum(a & b)), int(np.sum(a & ~b)), int(np.sum(~a & b)), int(np.sum(~a & ~b)))


def wilson(successes: int, n: int, z: float) -> tuple[float, float]:
    """Wilson score interval of a proportion."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


def difference_lower_bound(t: Paired, confidence: float = 0.95) -> float:
    """One-sided `confidence` lower bound of challenger - champion top-1 (Newcombe's method 10)."""
    if t.n == 0:
        return -1.0
    z = float(norm.ppf(confidence))
    p1, p2 = t.champion_top1, t.challenger_top1
    _, u1 = wilson(t.both_right + t.negative_flips, t.n, z)
    l2, _ = wilson(t.both_right + t.positive_flips, t.n, z)
    a, b, c, d = t.both_right, t.negative_flips, t.positive_flips, t.both_wrong
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(margins) if margins else 0.0
    return (p2 - p1) - math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))


def mcnemar_p(t: Paired) -> float:
    """Two-sided exact McNemar p: the discordant pairs against a fair coin."""
    flips = t.negative_flips + t.positive_flips
    return 1.0 if flips == 0 else float(binomtest(t.negative_flips, flips, 0.5).pvalue)


@dataclass(frozen=True)
class ClassChange:
    name: str
    support: int
    champion_recall: float | None  # None: a class the champion never saw
    challenger_recall: float

    @property
    def drop(self) -> float:
        return (self.champion_recall or 0.0) - self.challenger_recall


def class_changes(labels: np.ndarray, champion_pred: np.ndarray, challenger_pred: np.ndarray,
                  classes: Sequence[str], champion_classes: Sequence[str]) -> list[ClassChange]:
    """Per class of today's test split, both recalls (by class name: the champion may know other
    classes, or the same ones in another order), worst drop first."""
    known = set(champion_classes)
    out = []
    for k, name in enumerate(classes):
        mask = labels == k
        if not mask.any():
            continue
        out.append(ClassChange(name, int(mask.sum()),
                               float(np.mean(champion_pred[mask] == k)) if name in known else None,
                               float(np.mean(challenger_pred[mask] == k))))
    return sorted(out, key=lambda c: (-c.drop, c.name))


@dataclass(frozen=True)
class GateRules:
    """`release:` params that decide."""

    margin: float = 0.01
    min_support: int = 20
    max_class_drop: float = 0.05
    floors: dict[str, float] = field(default_factory=lambda: {"top1": 0.5})
    confidence: float = 0.95


def decide(rules: GateRules, challenger_metrics: dict[str, Any], paired: Paired | None,
           changes: list[ClassChange], new_classes: list[str]) -> dict[str, Any]:
    """The gate's verdict: `blessed` and every reason, in words a product owner can read."""
    reasons, failed = [], False
    for metric, floor in rules.floors.items():
        if not isinstance(challenger_metrics.get(metric), (int, float)):
            raise KeyError(f"release.floors names {metric!r}, which evaluate does not report "
                           f"(have: {', '.join(sorted(k for k, v in challenger_metrics.items() if isinstance(v, float)))})")
        value = float(challenger_metrics[metric])
        ok = value >= floor
        failed |= not ok
        reasons.append(f"{metric} {value:.4f} {'meets' if ok else 'is below'} the floor of {floor:.4f}")
    result: dict[str, Any] = {"first_model": paired is None}
    if paired is None:
        reasons.insert(0, "first model: no champion in production yet, so it is judged on the floors alone")
    else:
        lower = difference_lower_bound(paired, rules.confidence)
        inferior = lower <= -rules.margin
        failed |= inferior
        result["paired"] = {"images": paired.n, "champion_top1": paired.champion_top1,
                            "challenger_top1": paired.challenger_top1,
                            "difference": paired.challenger_top1 - paired.champion_top1,
                            "lower_bound": lower, "method": "Newcombe hybrid score (method 10), one-sided",
                            "confidence": rules.confidence, "negative_flips": paired.negative_flips,
                            "positive_flips": paired.positive_flips, "mcnemar_exact_p": mcnemar_p(paired)}
        reasons.append(
            f"top-1 {paired.challenger_top1:.2%} against the champion's {paired.champion_top1:.2%} on the same "
            f"{paired.n} test images: at worst {lower:+.2%} ({rules.confidence:.0%} sure), "
            + (f"below the allowed -{rules.margin:.2%}" if inferior else f"within the allowed -{rules.margin:.2%}")
            + f"; {paired.negative_flips} images it now gets wrong, {paired.positive_flips} it now gets right "
              f"(McNemar p={result['paired']['mcnemar_exact_p']:.3g})")
        judged = [c for c in changes if c.support >= rules.min_support and c.champion_recall is not None]
        dropped = [c for c in judged if c.drop > rules.max_class_drop + 1e-9]
        failed |= bool(dropped)
        for c in dropped:
            reasons.append(f"class {c.name!r} loses {c.drop:.1%} of recall ({c.champion_recall:.1%} -> "
                           f"{c.challenger_recall:.1%} on {c.support} images), more than the allowed "
                           f"{rules.max_class_drop:.1%}")
        if not dropped:
            reasons.append(f"no class with at least {rules.min_support} test images loses more than "
                           f"{rules.max_class_drop:.1%} of recall")
        if new_classes:
            reasons.append(f"new classes the champion never saw (its errors): {', '.join(new_classes)}")
        result["worst_classes"] = [{"class": c.name, "support": c.support, "champion_recall": c.champion_recall,
                                    "challenger_recall": c.challenger_recall, "drop": c.drop} for c in changes[:10]]
        result["classes_failing"] = [c.name for c in dropped]
    result.update(blessed=not failed, reasons=reasons, new_classes=new_classes)
    return result

"""How sure a comparison is: confidence intervals, McNemar's exact test, medians with their spread.

Pure functions of counts and lists, exact (the binomial tail, not a normal approximation), so the
verdicts in compare.md can be checked by hand.
"""

from __future__ import annotations

import math
import statistics

from scipy.stats import binom

Z95 = 1.959963984540054
"""Two-sided 95% quantile of the standard normal."""

SMALL_TEST = 500
"""Below this many test images a top-1 difference of several points is within chance."""

ALPHA = 0.05
"""Significance level of the paired test behind the headline's "better"."""


def wilson_interval(correct: int, total: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion `correct / total` (sound near 0, 1 and for small n)."""
    if total <= 0:
        return 0.0, 1.0
    p = correct / total
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pairs.

    `only_a`: items model A got right and B wrong; `only_b`: the reverse. Under "no difference"
    each discordant item is a fair coin, so the p-value is a binomial tail, doubled and capped at 1.
    scipy's binomial CDF: summing integer binomials took about a minute at 50k test images and hours
    at 1M; this takes microseconds at any size.
    """
    n = only_a + only_b
    if n == 0:
        return 1.0
    return float(min(1.0, 2 * binom.cdf(min(only_a, only_b), n, 0.5)))


def paired_counts(truth: list[str], pred_a: list[str], pred_b: list[str]) -> dict[str, int]:
    """Agreement table of two models' predictions on the same items, in the same order."""
    if not len(truth) == len(pred_a) == len(pred_b):
        raise ValueError(f"predictions differ in length: {len(truth)}, {len(pred_a)}, {len(pred_b)}")
    counts = {"both_right": 0, "only_a": 0, "only_b": 0, "both_wrong": 0}
    for y, a, b in zip(truth, pred_a, pred_b):
        key = ("both_right" if b == y else "only_a") if a == y else ("only_b" if b == y else "both_wrong")
        counts[key] += 1
    return counts


def median_iqr(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); with fewer than 4 values the quartiles are min and max."""
    if not values:
        raise ValueError("no values")
    if len(values) < 4:
        return min(values), statistics.median(values), max(values)
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def ratio_range(new: list[float], old: list[float]) -> dict[str, float | bool]:
    """Median ratio new/old with a range from the quartiles (low: new's Q1 over old's Q3), and
    whether the two interquartile ranges overlap (then the ratio is within run-to-run spread)."""
    n1, n2, n3 = median_iqr(new)
    o1, o2, o3 = median_iqr(old)
    return {"ratio": n2 / o2, "low": n1 / o3, "high": n3 / o1, "overlap": n1 <= o3 and o1 <= n3}

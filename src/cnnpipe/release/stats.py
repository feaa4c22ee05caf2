"""The paired statistics the gate decides with, pure and vectorised where the gate needs them per class.

- `newcombe_interval`: Newcombe's hybrid score interval for a difference of paired proportions
  (Newcombe 1998, Statistics in Medicine 17:2635, method 10), with the continuity-adjusted
  correlation of Fagerland, Lydersen and Laake (*Statistical Analysis of Contingency Tables*, 2017,
  ch. 8) and Altman's *Statistics with Confidence* (2000): AD - BC loses N/2 when it is above N/2
  and is 0 in between, which widens the interval on small tables.
- `mcnemar_p` / `worse_p`: McNemar's exact conditional test, two-sided and one-sided.
- `holm`: Holm's step-down adjustment (1979): family-wise error control with no assumption on how
  the tests depend on each other.
- `tarone_holm`: Holm's step-down with Tarone's count of the tests that can reach significance
  (Tarone 1990, Biometrics 46:515; Hommel and Krummenauer 1998, Biometrics 54:673). An exact
  McNemar test on a class whose answers changed on 6 images can never go below 2^-6 = 0.016: it
  cannot be significant among many classes, so it does not count in the correction. With
  thousands of classes, most with few changes, this is what leaves the gate the power to see one
  class that fell.
- `images_needed` / `margin_supported`: the test size a non-inferiority margin needs at a
  discordance, and the margin a test size supports, the normal approximation of the paired design
  (Connor 1987; Nam 1997) with the true difference at 0, on the bound the gate computes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import binom, binomtest, norm


@dataclass(frozen=True)
class Paired:
    """The four cells of a paired comparison on n images."""

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

    @property
    def difference(self) -> float:
        """Challenger minus champion."""
        return (self.positive_flips - self.negative_flips) / max(self.n, 1)

    @property
    def discordance(self) -> float:
        """The share of images on which the two disagree about being right."""
        return (self.positive_flips + self.negative_flips) / max(self.n, 1)


@functools.lru_cache(maxsize=64)
def z_of(confidence: float) -> float:
    """The standard normal quantile of a one-sided `confidence`."""
    return float(norm.ppf(confidence))


def paired_counts(champion_right: np.ndarray, challenger_right: np.ndarray) -> Paired:
    """The four cells of the paired table from per-image correctness."""
    a, b = np.asarray(champion_right, bool), np.asarray(challenger_right, bool)
    return Paired(int(np.sum(a & b)), int(np.sum(a & ~b)), int(np.sum(~a & b)), int(np.sum(~a & ~b)))


def wilson(successes: int, n: int, z: float) -> tuple[float, float]:
    """Wilson score interval of a proportion (each side at the level z stands for)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def continuity_adjusted_phi(t: Paired) -> float:
    """The correlation of the paired answers with N/2 taken off AD - BC (0 when within N/2)."""
    a, b, c, d = t.both_right, t.negative_flips, t.positive_flips, t.both_wrong
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    if margins == 0:
        return 0.0
    cross = a * d - b * c
    adjusted = cross - t.n / 2 if cross > t.n / 2 else (0.0 if cross >= 0 else cross)
    return adjusted / math.sqrt(margins)


def newcombe_interval(t: Paired, confidence: float = 0.95) -> tuple[float, float]:
    """Lower and upper bounds of challenger - champion top-1, each one-sided at `confidence`
    (so together a two-sided interval at 2 * confidence - 1)."""
    if t.n == 0:
        return -1.0, 1.0
    z = z_of(confidence)
    p_champion, p_challenger = t.champion_top1, t.challenger_top1
    l_champion, u_champion = wilson(t.both_right + t.negative_flips, t.n, z)
    l_challenger, u_challenger = wilson(t.both_right + t.positive_flips, t.n, z)
    phi = continuity_adjusted_phi(t)
    below_challenger, above_champion = p_challenger - l_challenger, u_champion - p_champion
    above_challenger, below_champion = u_challenger - p_challenger, p_champion - l_champion
    lower = t.difference - math.sqrt(max(0.0, below_challenger ** 2 + above_champion ** 2
                                         - 2 * phi * below_challenger * above_champion))
    upper = t.difference + math.sqrt(max(0.0, above_challenger ** 2 + below_champion ** 2
                                         - 2 * phi * above_challenger * below_champion))
    return max(-1.0, lower), min(1.0, upper)


def difference_lower_bound(t: Paired, confidence: float = 0.95) -> float:
    """One-sided `confidence` lower bound of challenger - champion top-1 (`newcombe_interval`)."""
    return newcombe_interval(t, confidence)[0]


def mcnemar_p(t: Paired) -> float:
    """Two-sided exact McNemar p: the discordant pairs against a fair coin."""
    flips = t.negative_flips + t.positive_flips
    return 1.0 if flips == 0 else float(binomtest(t.negative_flips, flips, 0.5).pvalue)


def worse_p(negative_flips: np.ndarray, positive_flips: np.ndarray) -> np.ndarray:
    """One-sided exact McNemar p that the challenger is worse: P(X >= negative | negative + positive,
    1/2), per element. 1 where nothing flipped."""
    neg, pos = np.asarray(negative_flips, np.int64), np.asarray(positive_flips, np.int64)
    return np.where(neg + pos > 0, binom.sf(neg - 1, neg + pos, 0.5), 1.0)


def holm(p: np.ndarray) -> np.ndarray:
    """Holm-adjusted p-values: a test is rejected at family-wise level alpha when its adjusted p is
    at most alpha. Step-down: the k-th smallest p times (m - k + 1), made monotone, capped at 1."""
    p = np.asarray(p, dtype=np.float64)
    m = len(p)
    if m == 0:
        return p
    order = np.argsort(p, kind="stable")
    stepped = np.maximum.accumulate(p[order] * (m - np.arange(m)))
    adjusted = np.empty(m)
    adjusted[order] = np.minimum(stepped, 1.0)
    return adjusted


NEVER = 2 ** 40  # "no test set of any size": a margin of 0


def tarone_holm(p: np.ndarray, least_p: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Which tests are rejected at family-wise level `alpha`, and the level each was tested at (1 when
    it could not be reached). `least_p` is each test's smallest achievable p (0.5^discordant pairs
    for a one-sided exact McNemar test), fixed by what the test conditions on.

    Step-down over the tests not yet rejected: K is the smallest k with at most k of them able to
    reach alpha / k; the smallest p among them is rejected when at most alpha / K, and the step
    repeats without it. Where every test can reach significance this is Holm's procedure."""
    p, least_p = np.asarray(p, np.float64), np.asarray(least_p, np.float64)
    rejected = np.zeros(len(p), dtype=bool)
    level = np.ones(len(p))
    remaining = np.ones(len(p), dtype=bool)
    while remaining.any():
        reachable = np.sort(least_p[remaining])
        ks = np.arange(1, len(reachable) + 2)
        counted = np.searchsorted(reachable, alpha / ks, side="right")
        k = int(ks[np.argmax(counted <= ks)])  # the smallest k with at most k tests able to reach alpha / k
        candidates = np.flatnonzero(remaining)
        best = candidates[np.argmin(p[candidates])]
        level[candidates] = np.where(least_p[candidates] <= alpha / k, alpha / k, level[candidates])
        if p[best] > alpha / k:
            break
        rejected[best], remaining[best] = True, False
    return rejected, level


def margin_supported(n: int, accuracy: float, discordance: float, confidence: float = 0.95,
                     power: float = 0.95) -> float:
    """The smallest non-inferiority margin `n` test images can show for an equal challenger with
    probability `power`: minus the one-sided `confidence` lower bound of an equal challenger's table
    whose difference is drawn `z_power` standard deviations unlucky (d = -z_power * sqrt(discordance / n)).
    Both models right on `accuracy` of the images, disagreeing on `discordance` of them. It depends on
    the test set and the planning discordance only, never on the observed difference."""
    if n <= 0:
        return 1.0
    d = -z_of(power) * math.sqrt(max(discordance, 0.0) / n)
    negative = n * (discordance - d) / 2
    positive = max(0.0, n * (discordance + d) / 2)
    both_right = max(0.0, n * accuracy - negative)
    table = Paired(both_right, negative, positive, max(0.0, n - both_right - negative - positive))  # type: ignore[arg-type]
    return -newcombe_interval(table, confidence)[0]


def images_needed(accuracy: float, discordance: float, margin: float, confidence: float = 0.95,
                  power: float = 0.95) -> int:
    """Test images a non-inferiority comparison needs so that an equal challenger clears `margin` with
    probability `power`: the smallest n with `margin_supported(n, ...)` below `margin`.

    For a large n this is the paired design's normal approximation (Connor 1987; Nam 1997),
    (z_confidence + z_power)^2 * discordance / margin^2; on the bound itself it also counts what a
    small table costs (the Wilson widths, the continuity adjustment), so models that never disagree
    still need enough images for their accuracies' intervals to fit in the margin."""
    if margin <= 0:
        return NEVER

    def clears(n: int) -> bool:
        return margin_supported(n, accuracy, discordance, confidence, power) < margin

    low, high = 1, 64
    while not clears(high):
        low, high = high, high * 2
        if high > NEVER:
            return NEVER
    while low < high:  # the smallest n that clears, between a failing `low` and a clearing `high`
        mid = (low + high) // 2
        low, high = (low, mid) if clears(mid) else (mid + 1, high)
    return high

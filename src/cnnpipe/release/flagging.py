"""The delivery check's decision rule: which classes and (given, predicted) pairs of a week's new
photos disagree with the champion beyond chance (`flag_pairs`), with the reference rates it tests
against (`pooled_prior`, `pooled_pair_prior`) and Holm within families (`grouped_holm`). Pure
functions of counts: `cnnpipe.release.delivery` runs the champion and lists the photos; the module
docstring there describes the two stages and what they promise.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.stats import betabinom

from cnnpipe.release_config import DeliveryConfig

# The predicted name of a flagged class's row when none of its pairs is flagged on its own: the class's
# confident disagreements summed over every class they went to (stage 1's count), not one class.
OTHER_CLASSES = "(other classes together; none flagged alone)"


def grouped_holm(p: np.ndarray, group: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Holm-adjusted p-values within families: `p` holds only the tests whose p is below 1 (the others'
    p is 1 and never rejected, so they need not be listed), `group` each one's family and `size[group]`
    each family's whole number of tests. Sparse, so a family of a million pairs costs its listed tests."""
    p, group = np.asarray(p, np.float64), np.asarray(group, np.int64)
    if len(p) == 0:
        return p
    order = np.lexsort((p, group))
    g, q = group[order], p[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    rank = np.arange(len(g)) - np.repeat(starts, np.diff(np.r_[starts, len(g)]))
    stepped = np.minimum(q * (np.asarray(size)[g] - rank), 1.0)
    family = np.cumsum(np.r_[0, (g[1:] != g[:-1]).astype(np.int64)])
    # Monotone within each family: one running maximum, the families lifted apart by 2 each (values <= 1).
    stepped = np.maximum.accumulate(stepped + 2 * family) - 2 * family
    adjusted = np.empty(len(p))
    adjusted[order] = stepped
    return adjusted


def _counts(given: np.ndarray, pred: np.ndarray, c: int) -> tuple[np.ndarray, np.ndarray]:
    """The (given, predicted) pairs that occur, as keys given * c + predicted, and their counts."""
    return np.unique(given.astype(np.int64) * c + pred, return_counts=True)


def _beta_prior(mu: float, spread: float, noise: float, floor: float, ceiling: float) -> tuple[float, float]:
    """A Beta prior by the method of moments: mean `mu`, strength from the rates' weighted `spread`
    beyond their binomial `noise` (none beyond it: the `ceiling`), kept in [`floor`, `ceiling`]."""
    mu = float(np.clip(mu, 1e-6, 1 - 1e-6))
    between = spread - noise
    strength = ceiling if between <= 0 else float(np.clip(mu * (1 - mu) / between - 1, floor, ceiling))
    return mu * strength, (1 - mu) * strength


def pooled_prior(m: np.ndarray, n: np.ndarray, floor: float = 2.0, ceiling: float = 1000.0) -> tuple[float, float]:
    """The Beta prior of a class's confident-disagreement rate, fitted across classes (empirical Bayes,
    method of moments for a beta-binomial): (a0, b0) with mean the pooled rate sum(m) / sum(n) and a
    strength a0 + b0 from how much the classes' rates differ beyond their binomial noise, kept in
    [`floor`, `ceiling`]. A class's own few test photos (20 of each at 1,000 classes) then refine a
    rate the other classes already pin down, instead of standing alone under a uniform prior, whose
    uncertainty hid ten misfiled photos among twenty honest ones. Classes that differ a lot (some
    look-alikes) weaken the prior, and a class the champion usually gets wrong keeps its own rate.
    The spread of a few classes' rates says little about how much classes differ, so the prior is
    worth at most one observation per class it was fitted on: at 10 classes whose error rates differ
    widely, a stronger one flagged 2.8% of honest weeks (`bench/delivery_check.py --scale --spread`).
    Fewer than five classes with test photos: the uniform prior (1, 1)."""
    have = n > 0
    if have.sum() < 5:
        return 1.0, 1.0
    m, n = m[have].astype(np.float64), n[have].astype(np.float64)
    mu = float(m.sum() / n.sum())
    spread = float(np.average((m / n - mu) ** 2, weights=n))
    return _beta_prior(mu, spread, mu * (1 - mu) * float(np.mean(1.0 / n)), floor, min(ceiling, float(len(n))))


def pooled_pair_prior(keys: np.ndarray, m: np.ndarray, n: np.ndarray, c: int, floor: float = 2.0,
                      ceiling: float = 1000.0) -> tuple[float, float]:
    """`pooled_prior` for the (given a, predicted b) rates m_ab / n_a over every pair of the classes
    with test photos (`keys` = a * c + b and `m` list the pairs that occur; the C(C - 1) others are
    zeros, counted without being listed). Look-alike pairs make the rates scatter, which keeps this
    prior weak where they exist; it matters where a pair's own count is zero of 20."""
    have = n > 0
    if have.sum() < 5 or c < 2:
        return 1.0, 1.0
    weight_all = float(n[have].sum()) * (c - 1)
    a = keys // c
    listed = have[a]
    m_l, n_l = m[listed].astype(np.float64), n[a[listed]].astype(np.float64)
    mu = float(m_l.sum() / weight_all)
    spread = (float(np.sum(n_l * (m_l / n_l - mu) ** 2)) + mu**2 * (weight_all - float(n_l.sum()))) / weight_all
    return _beta_prior(mu, spread, mu * (1 - mu) * float(np.mean(1.0 / n[have])), floor, ceiling)


def flag_pairs(given: np.ndarray, pred: np.ndarray, conf: np.ndarray, ref_given: np.ndarray,
               ref_pred: np.ndarray, ref_conf: np.ndarray, classes: list[str], checked: np.ndarray,
               cfg: DeliveryConfig) -> tuple[list[dict[str, Any]], np.ndarray, list[dict[str, Any]]]:
    """The two-stage test of the new photos (`given`, the champion's `pred` and `conf`, predictions in
    today's class indices, -1 for a class gone) against the reference (old test photos); `checked`
    masks the given classes the champion knows.

    Stage 1, per given class: its confident disagreements (any other class) against the champion's
    own rate on that class, Holm over the classes a flag could reach. Stage 2, inside each class
    stage 1 flags: each (given, predicted) pair against the champion's rate for that pair, Holm over
    the class's C - 1 pairs. An honest week is flagged only through stage 1, so at most `alpha` of
    honest weeks are, whatever the class count; ten photos all filed wrong in one class of 1,000 face
    a 1,000-test correction, not a 999,000-pair one. A flagged class none of whose pairs stands out on
    its own (its photos went to several classes) gets one row, predicted `OTHER_CLASSES`.

    Returns the pairs with k > 0 (flagged first, then by p), the mask of new photos flagged (every new
    photo of a flagged class: the delivery is held whole) and the classes tested at stage 1 (flagged
    first)."""
    c = len(classes)
    sure = (conf >= cfg.confidence) & (pred >= 0) & (pred != given) & checked[given]
    ref_sure = (ref_conf >= cfg.confidence) & (ref_pred >= 0) & (ref_pred != ref_given)
    n, n_ref = np.bincount(given, minlength=c), np.bincount(ref_given, minlength=c)
    big_k = np.bincount(given[sure], minlength=c)
    big_m = np.bincount(ref_given[ref_sure], minlength=c)
    able = checked & (n >= cfg.min_images)  # the classes a flag could reach: stage 1's family
    tested = np.flatnonzero(able & (big_k > 0))
    a0, b0 = pooled_prior(big_m[checked], n_ref[checked])
    p_class = betabinom.sf(big_k[tested] - 1, n[tested], big_m[tested] + a0, n_ref[tested] - big_m[tested] + b0)
    p_class_holm = grouped_holm(p_class, np.zeros(len(tested), np.int64), np.array([able.sum()]))
    class_flags = ((p_class_holm <= cfg.alpha) & (big_k[tested] >= cfg.min_images)
                   & (big_k[tested] / n[tested] >= cfg.min_share))
    flagged_class = np.zeros(c, bool)
    flagged_class[tested[class_flags]] = True
    class_rows = [{"given": classes[i], "images": int(big_k[i]), "of": int(n[i]), "share": float(big_k[i] / n[i]),
                   "expected": float((big_m[i] + a0) / (n_ref[i] + a0 + b0)), "test_images": int(n_ref[i]),
                   "test_disagreements": int(big_m[i]), "p": float(q),
                   "p_holm": float(h), "flagged": bool(f)}
                  for i, q, h, f in zip(tested, p_class, p_class_holm, class_flags)]
    class_rows.sort(key=lambda r: (not r["flagged"], r["p"], -r["images"]))

    keys, k = _counts(given[sure], pred[sure], c)
    a, b = np.divmod(keys, c)
    ref_keys, ref_k = _counts(ref_given[ref_sure], ref_pred[ref_sure], c)
    m = np.zeros(len(keys), np.int64)
    if len(ref_keys):
        at = np.minimum(np.searchsorted(ref_keys, keys), len(ref_keys) - 1)
        m = np.where(ref_keys[at] == keys, ref_k[at], 0)
    pa0, pb0 = pooled_pair_prior(ref_keys, ref_k, np.where(checked, n_ref, 0), c)
    p = betabinom.sf(k - 1, n[a], m + pa0, n_ref[a] - m + pb0)  # P(X >= k)
    p_holm = grouped_holm(p, a, np.full(c, c - 1))
    flags = flagged_class[a] & (p_holm <= cfg.alpha) & (k >= cfg.min_images) & (k / n[a] >= cfg.min_share)
    pairs = [{"given": classes[i], "predicted": classes[j], "images": int(x), "of": int(n[i]), "share": float(x / n[i]),
              "expected": float((y + pa0) / (n_ref[i] + pa0 + pb0)), "test_images": int(n_ref[i]),
              "test_disagreements": int(y), "p": float(q),
              "p_holm": float(h), "flagged": bool(f)}
             for i, j, x, y, q, h, f in zip(a, b, k, m, p, p_holm, flags)]
    alone = flagged_class.copy()
    alone[a[flags]] = False  # flagged classes with no pair standing out on its own
    index = {name: i for i, name in enumerate(classes)}
    pairs += [{**r, "predicted": OTHER_CLASSES} for r in class_rows if r["flagged"] and alone[index[r["given"]]]]
    pairs.sort(key=lambda r: (not r["flagged"], r["p"], -r["images"]))
    # A flagged class's delivery is held whole: beside the confident disagreements, its other new photos
    # came from the same bad batch (the champion unsure, or fooled), and one confident mistake in
    # three misfiled photos would otherwise leave two to train on.
    photos = flagged_class[given] & checked[given]
    return pairs, photos, class_rows

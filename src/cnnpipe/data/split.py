"""Class-balanced splits and subsets, drawn reproducibly from a seed.

`prepare` holds out validation and test with `stratified_split` and caps each split with
`balanced_positions`; training's validation subset and export's parity subset under a budget use
the same rule through `balanced_subset`.
"""

from __future__ import annotations

import numpy as np
from sklearn.model_selection import train_test_split

from cnnpipe.data.store import PreparedSplit


def stratified_split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split positions 0..N-1 into (keep, held_out) by class, with scikit-learn.

    Classes with fewer than two members cannot be stratified; they stay whole in `keep`.
    Both outputs are sorted, so the result depends only on labels, fraction and seed.
    """
    labels = np.asarray(labels)
    positions = np.arange(len(labels))
    counts = np.bincount(labels) if len(labels) else np.zeros(0, int)
    splittable = counts[labels] >= 2 if len(labels) else np.zeros(0, bool)
    fixed, pool = positions[~splittable], positions[splittable]
    if len(pool) == 0:
        return positions, np.zeros(0, dtype=int)
    n_classes = len(np.unique(labels[pool]))
    n_held = max(n_classes, int(round(fraction * len(pool))))
    if n_held >= len(pool) - n_classes + 1:
        n_held = max(1, len(pool) // 2)
    try:
        keep, held = train_test_split(pool, test_size=n_held, stratify=labels[pool], random_state=seed)
    except ValueError:  # too few samples for a stratified split: plain shuffle split
        keep, held = train_test_split(pool, test_size=n_held, random_state=seed)
    return np.sort(np.concatenate([fixed, keep])), np.sort(held)


def balanced_positions(labels: np.ndarray, cap: int | None, seed: int) -> np.ndarray:
    """Sorted positions of at most `cap` items, class proportions kept, drawn with `seed`; all when
    cap is None. The one class-balanced subset rule: prepare's caps and the budget's subsets."""
    positions = np.arange(len(labels))
    if cap is None or cap >= len(labels):
        return positions
    _, held = stratified_split(labels, cap / len(labels), seed)
    return held[:cap]


def balanced_subset(split: PreparedSplit, n: int | None, seed: int = 0) -> PreparedSplit:
    """A fixed subset of about `n` items of `split` with its class proportions (`balanced_positions`:
    the same items every epoch and every run for one seed); the split itself when n is None."""
    if n is None or n >= len(split):
        return split
    keep = balanced_positions(split.labels, n, seed)
    return PreparedSplit(images=np.asarray(split.images[keep]), labels=split.labels[keep], classes=split.classes)

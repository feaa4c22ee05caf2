"""Splits and class-balanced subsets, drawn reproducibly from a seed.

`prepare` holds out validation and test with `content_split`: an image's split is a function of
its content hash and the seed alone, so a catalog that gains or loses images keeps every other
image where it was. It caps each split with `balanced_positions`; training's validation subset
and export's parity subset under a budget use the same rule through `balanced_subset`.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from cnnpipe.data.store.shards import PreparedSplit


def stratified_split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split positions 0..N-1 into (keep, held_out) by class, with scikit-learn.

    Classes with fewer than two members cannot be stratified; they stay whole in `keep`.
    Both outputs are sorted, so the result depends only on labels, fraction and seed.
    """
    from sklearn.model_selection import train_test_split  # here: prepare (and its decoding processes) never need it

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


def hashed_unit(digest: str, seed: int) -> float:
    """A number in [0, 1) fixed by an image's content hash (hex sha256) and the seed."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{digest}".encode()).digest()[:8], "big") / 2**64


def content_split(digests: Sequence[str], labels: np.ndarray, held_out: Sequence[tuple[str, float]],
                  seed: int) -> np.ndarray:
    """Each item's split name: `held_out` is [(name, fraction), ...], cut in that order from [0, 1) by
    the item's `hashed_unit`; the rest is "train".

    Every class is cut by the same thresholds, so its proportions hold in expectation, and adding or
    removing images never moves another one. Small sets are the exception: a class of three or more
    images that the hash leaves without a member in a held-out split lends it its lowest-hash
    training image, which may return to train once the class gains a member of its own.
    """
    labels = np.unique(np.asarray(labels), return_inverse=True)[1].reshape(-1)
    units = np.fromiter((hashed_unit(d, seed) for d in digests), dtype=np.float64, count=len(digests))
    codes = np.zeros(len(units), dtype=np.int8)  # 0: train, k: the k-th held-out split
    low = 0.0
    for code, (_, fraction) in enumerate(held_out, start=1):
        codes[(units >= low) & (units < low + fraction)] = code
        low += fraction
    # One sort for every class and split (by class, then hash): linear in the catalog, not in
    # classes x images. A class's lowest-hash training image is its first train item in this order.
    order = np.lexsort((units, labels))
    classes = int(labels.max()) + 1 if len(labels) else 0
    size = np.bincount(labels, minlength=classes)
    for code in range(1, len(held_out) + 1):
        has = np.bincount(labels[codes == code], minlength=classes) > 0
        in_train = order[codes[order] == 0]
        first = in_train[np.r_[True, labels[in_train][1:] != labels[in_train][:-1]]] if len(in_train) else in_train
        train_size = np.bincount(labels[in_train], minlength=classes)
        lend = first[((size >= 3) & ~has & (train_size >= 2))[labels[first]]]
        codes[lend] = code
    return np.array(["train", *(name for name, _ in held_out)], dtype=object)[codes]


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

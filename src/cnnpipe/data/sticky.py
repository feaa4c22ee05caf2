"""Splits that never leak across catalog updates: what the previous store held out stays held out.

`content_split` alone keys an image's split on its bytes, so a photo re-encoded by a CDN, an EXIF
edit or a new export draws a new split: ~80% of re-exported test photos would go to train, and a
model compared on "the same test set" would have trained on part of it. These rules close that:

- **Sticky.** An image the previous store held keeps that split, found by content hash, else by
  source path (a re-encode: same path, new bytes). So does an image a small class lent to a
  held-out split: it never returns to train.
- **Together.** Identical bytes, and the photos of one group (a manifest's `group` column, a product
  id, which also draws one split per group), all go to the most held-out split any of them has
  (test, then val, then train), through chains too (a copy of one group's photo in another group):
  a copy in train would be a test image the model has seen. Copies under several labels are
  reported by path: one of the labels is wrong.
- **Stable caps.** `data.max_train_images` and `data.max_eval_images` keep each class's images with
  the lowest content hash, so a new photo changes a capped set by at most a class quota, never
  redraws it.

They move only the images whose split `prepare` assigns; a split the source gives (a split folder,
a manifest's split cell) is the user's and stays as given. A held-out image stays held out even
when the source starts giving that split for other images.
"""

from __future__ import annotations

import array
import hashlib
import itertools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cnnpipe.data.ingest import digest_at
from cnnpipe.data.split import hashed_unit
from cnnpipe.data.store import SPLITS

HELD_OUT_RANK = {split: code for code, split in enumerate(SPLITS)}  # SPLITS runs train, val, test
SPLIT_NAMES = np.array(SPLITS, dtype=object)  # split code -> name
SPLIT_RULE_FILE = "split_rule.json"
MAX_LISTED = 100  # conflicts listed in the data report (all are counted)


def path_key(path: str) -> int:
    """64-bit key of a source path (relative to the catalog's root), for lookups in sorted arrays."""
    return int.from_bytes(hashlib.blake2b(os.fsencode(path), digest_size=8).digest(), "big")


def split_rule(seed: int, val_fraction: float, test_fraction: float) -> dict[str, Any]:
    """What decides where `content_split` puts an image; stores made by the same rule are sticky."""
    return {"seed": seed, "val_fraction": val_fraction, "test_fraction": test_fraction}


class PreviousSplits:
    """Where the previous store put each image, by content hash and by source path (sorted arrays:
    17 bytes an image). Read whatever its decoding recipe (a new `data.stored_size` re-decodes every
    image but must not move one between splits), but only when it was split by the same `rule`
    (`SPLIT_RULE_FILE`; a store without one predates it and counts as the same): a new seed or new
    fractions are asked for to redraw the splits."""

    def __init__(self, store: Path, rule: dict[str, Any]) -> None:
        digests, paths, codes = bytearray(), array.array("Q"), array.array("b")
        rule_file = store / SPLIT_RULE_FILE
        self.same_rule = not rule_file.exists() or json.loads(rule_file.read_text()) == rule
        for code, split in enumerate(SPLITS):
            meta = store / f"{split}_meta.jsonl"
            if not meta.exists() or not self.same_rule:
                continue
            with open(meta, encoding="utf-8") as fh:
                for line in fh:
                    item = json.loads(line)
                    digests += bytes.fromhex(item["sha256"])
                    paths.append(path_key(item["source"]))
                    codes.append(code)
        all_digests = np.frombuffer(bytes(digests), dtype="S32")
        all_paths = np.frombuffer(paths, dtype=np.uint64)
        all_codes = np.frombuffer(codes, dtype=np.int8)
        # Within equal keys the most held-out split first: a digest the old store had in train and in
        # test (leakage it reported) is found as test.
        by_digest = np.lexsort((-all_codes, all_digests))
        by_path = np.lexsort((-all_codes, all_paths))
        self.digests, self.digest_codes = all_digests[by_digest], all_codes[by_digest]
        self.paths, self.path_codes = all_paths[by_path], all_codes[by_path]

    def __len__(self) -> int:
        return len(self.digests)

    def codes(self, digests: np.ndarray, paths: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Per image, its previous split code (into SPLITS) found by content, and by path; -1: none."""
        by_content = _find(self.digests, self.digest_codes, digests)
        keys = np.fromiter((path_key(p) for p in paths), dtype=np.uint64, count=len(paths))
        return by_content, _find(self.paths, self.path_codes, keys)


def _find(table: np.ndarray, codes: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    if not len(table):
        return np.full(len(wanted), -1, dtype=np.int8)
    i = np.minimum(np.searchsorted(table, wanted), len(table) - 1)
    return np.where(table[i] == wanted, codes[i], -1).astype(np.int8)


def keep_previous(names: np.ndarray, pool: np.ndarray, digests: np.ndarray, paths: Sequence[str],
                  previous: PreviousSplits) -> dict[str, int]:
    """In place: each `pool` image the previous store held goes back to that split (a held-out image
    stays held out even where the source now gives that split for other images). Returns what was
    kept, for the data report."""
    by_content, by_path = previous.codes(digests[pool], [paths[i] for i in pool])
    previous_code = np.where(by_content >= 0, by_content, by_path)
    keep = previous_code >= 0
    wanted = SPLIT_NAMES[previous_code[keep]]
    held = int(np.sum(names[pool[keep]] != wanted))
    names[pool[keep]] = wanted
    return {"kept_by_content": int(np.sum(by_content >= 0)),
            "kept_by_path_after_new_bytes": int(np.sum(keep & (by_content < 0))),
            "held_where_the_hash_would_move_them": held}


def _segments(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order that sorts `values`, each sorted item's segment number among equal values)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    return order, np.cumsum(np.r_[True, ordered[1:] != ordered[:-1]]) - 1


def _joined(keys: Sequence[np.ndarray]) -> np.ndarray:
    """Connected components of items linked by equal values in any of `keys` (A = B by content, B ~ C
    by group, C = D by content: one component): each item's component id, by min-propagation, one
    sort per key and round. Rounds grow with the longest chain, which real catalogs keep short."""
    component = np.arange(len(keys[0]))
    while True:
        before = component.copy()
        for key in keys:
            order, segment = _segments(key)
            lowest = np.full(segment[-1] + 1, len(component))
            np.minimum.at(lowest, segment, component[order])
            component[order] = lowest[segment]
        if np.array_equal(component, before):
            return component


def colocate(names: np.ndarray, members: np.ndarray, movable: np.ndarray, digests: np.ndarray,
             groups: np.ndarray) -> int:
    """In place: `members` joined by identical bytes or by a group (-1: none), directly or through a
    chain, all go to the most held-out split any of them has; only the `movable` ones (a boolean
    mask: the splits `prepare` assigns) move. Returns how many moved."""
    if not len(members):
        return 0
    lone = -1 - np.arange(len(members), dtype=np.int64)  # no group: a group of one
    component = _joined([digests[members], np.where(groups[members] >= 0, groups[members], lone)])
    rank = np.array([HELD_OUT_RANK[name] for name in names[members]], dtype=np.int64)
    order, segment = _segments(component)
    top = np.zeros(segment[-1] + 1, dtype=np.int64)
    np.maximum.at(top, segment, rank[order])
    target = np.empty_like(rank)
    target[order] = top[segment]
    move = movable[members] & (target != rank)
    names[members[move]] = SPLIT_NAMES[target[move]]
    return int(np.sum(move))


def label_conflicts(names: np.ndarray, members: np.ndarray, digests: np.ndarray, labels: np.ndarray,
                    paths: Sequence[str], classes: Sequence[str]) -> tuple[list[dict[str, Any]], int]:
    """Identical bytes under several labels (one label is wrong): the first `MAX_LISTED` (hash,
    labels, paths, split) and how many there are."""
    conflicts, count = [], 0
    if not len(members):
        return conflicts, count
    order, segment = _segments(digests[members])
    order = members[order]
    bounds = np.flatnonzero(np.r_[True, segment[1:] != segment[:-1], True])
    for a, b in itertools.pairwise(bounds):
        group = order[a:b]
        if len(group) < 2 or len(np.unique(labels[group])) < 2:
            continue
        count += 1
        if len(conflicts) < MAX_LISTED:
            conflicts.append({"sha256": digest_at(digests, int(group[0])).hex(),
                              "split": max(names[group], key=HELD_OUT_RANK.__getitem__),
                              "labels": sorted({classes[k] for k in labels[group]}),
                              "paths": [paths[i] for i in group]})
    return conflicts, count


def split_keys(digests: np.ndarray, groups: np.ndarray, group_keys: np.ndarray) -> np.ndarray:
    """What `content_split` draws each image's split from: its content hash, or, for an image with a
    group (-1: none), its group's key (`catalog.group_key`), which every photo of the group shares."""
    grouped = groups >= 0
    return np.where(grouped, group_keys, digests)


def stable_cap(labels: np.ndarray, digests: np.ndarray, cap: int | None, seed: int) -> np.ndarray:
    """Sorted positions of at most `cap` items: class proportions kept (largest remainder), and within
    a class the items whose `hashed_unit` (content hash and seed) is lowest. All when cap is None."""
    n = len(labels)
    if cap is None or cap >= n:
        return np.arange(n)
    units = np.fromiter((hashed_unit(digest_at(digests, i).hex(), seed) for i in range(n)), dtype=np.float64,
                        count=n)
    classes, counts = np.unique(labels, return_counts=True)
    exact = cap * counts / n
    quota = np.floor(exact).astype(np.int64)
    largest_remainder = np.lexsort((classes, -(exact - quota)))
    quota[largest_remainder[: cap - int(quota.sum())]] += 1
    order = np.lexsort((units, labels))  # by class, then by unit: one sort, whatever the class count
    rank_in_class = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.sort(order[rank_in_class < np.repeat(quota, counts)])

"""Splits that never leak across catalog updates: held out once, held out for good.

`content_split` alone keys an image's split on its bytes, so a photo re-encoded by a CDN, an EXIF
edit or a new export draws a new split, and ~80% of re-exported test photos would go to train. These
rules, applied to every image the same way (folder images, manifest rows marked `train`, blank
rows, given splits), close that:

- **The ledger decides.** An image the split ledger knows keeps its split, found by content hash,
  else by source path (a re-encode: same path, new bytes), whatever the source now says and however
  long it was absent. A new seed or new fractions draw only images the ledger has never seen; a
  reset (`data.split_reset`) redraws them all. The one move refused is the user's own: an image the
  source itself gave a held-out split, now given train (a photo moved from test/ to train/).
- **Together.** Identical bytes, and the photos of one group (a manifest's `group` column, a product
  id, which also draws one split per group), all go to the most held-out split any of them has
  (test, then val, then train), through chains too: a copy in train would be a test image the model
  has seen. Bytes shared by more than `data.placeholder_groups` groups or labels are a placeholder
  ("image coming soon"), not a photo of any product: left out and listed, never a link.
- **Conflicts.** Identical bytes under several labels (one label is wrong) all leave train: held out
  with the most held-out copy, or quarantined (`data.label_conflicts`).
- **Stable caps.** `data.max_train_images` and `data.max_eval_images` keep each class's images with
  the lowest content hash, so a new photo changes a capped set by at most a class quota.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from cnnpipe.config import DataConfig
from cnnpipe.data.sources.entries import DataError, Listing
from cnnpipe.data.store.keys import HexDigests, digest_at, path_keys
from cnnpipe.data.splits.ledger import GIVEN, HELD_BEFORE, RECORD, Ledger, group_prefix
from cnnpipe.data.splits.draw import content_split, hashed_unit
from cnnpipe.data.store.shards import SPLITS

HELD_OUT_RANK = {split: code for code, split in enumerate(SPLITS)}  # SPLITS runs train, val, test
SPLIT_NAMES = np.array(SPLITS, dtype=object)  # split code -> name
TEST = HELD_OUT_RANK["test"]
MAX_LISTED = 100  # conflicts and placeholders listed in the data report (all are counted)


def split_rule(seed: int, val_fraction: float, test_fraction: float) -> dict[str, Any]:
    """What decides where `content_split` puts an image the ledger has never seen."""
    return {"seed": seed, "val_fraction": val_fraction, "test_fraction": test_fraction}


def _segments(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order that sorts `values`, each sorted item's segment number among equal values)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    return order, np.cumsum(np.r_[True, ordered[1:] != ordered[:-1]]) - 1


def _runs(values: np.ndarray) -> list[np.ndarray]:
    """Positions of each run of two or more equal `values` (sorted by value)."""
    if not len(values):
        return []
    order, segment = _segments(values)
    bounds = np.flatnonzero(np.r_[True, segment[1:] != segment[:-1], True])
    return [order[a:b] for a, b in itertools.pairwise(bounds) if b - a > 1]


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
    mask) move. Returns how many moved."""
    if not len(members):
        return 0
    lone = -1 - np.arange(len(members), dtype=np.int64)  # no group: a group of one
    component = _joined([digests[members], np.where(groups[members] >= 0, groups[members], lone)])
    rank = _rank(names[members])
    order, segment = _segments(component)
    top = np.zeros(segment[-1] + 1, dtype=np.int64)
    np.maximum.at(top, segment, rank[order])
    target = np.empty_like(rank)
    target[order] = top[segment]
    move = movable[members] & (target != rank)
    names[members[move]] = SPLIT_NAMES[target[move]]
    return int(np.sum(move))


@dataclass
class Shared:
    """Identical bytes found in several files: placeholders (too many groups or labels to be a
    product's photo) and label conflicts (a few labels: one is wrong), as masks over the catalog."""

    placeholder: np.ndarray
    conflict: np.ndarray
    placeholders: list[dict[str, Any]]
    conflicts: list[list[int]]  # positions of each conflict's files


def shared_bytes(digests: np.ndarray, usable: np.ndarray, groups: np.ndarray, labels: np.ndarray,
                 paths: Sequence[str], classes: Sequence[str], most: int) -> Shared:
    """Sort the usable files by content once and judge each run of identical bytes."""
    placeholder, conflict = np.zeros(len(digests), dtype=bool), np.zeros(len(digests), dtype=bool)
    listed, conflicts = [], []
    members = np.flatnonzero(usable)
    for run in _runs(digests[members]):
        files = members[run]
        group = groups[files]
        n_groups = len(np.unique(group[group >= 0])) + int(np.sum(group < 0))
        n_labels = len(np.unique(labels[files]))
        if n_groups > most or n_labels > most:
            placeholder[files] = True
            listed.append({"sha256": digest_at(digests, int(files[0])).hex(), "files": len(files), "groups": n_groups,
                           "labels": n_labels, "paths": [paths[i] for i in files[:5]]})
        elif n_labels > 1:
            conflict[files] = True
            conflicts.append(files.tolist())
    return Shared(placeholder, conflict, listed, conflicts)


def split_keys(digests: np.ndarray, groups: np.ndarray, group_keys: np.ndarray) -> np.ndarray:
    """What `content_split` draws each image's split from: its content hash, or, for an image with a
    group (-1: none), its group's key (`catalog.group_key`), which every photo of the group shares."""
    return np.where(groups >= 0, group_keys, digests)


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


def _rank(names: np.ndarray) -> np.ndarray:
    """Split names (an object array) as codes into SPLITS, in two vector comparisons."""
    return np.where(names == "test", TEST, np.where(names == "val", HELD_OUT_RANK["val"], 0)).astype(np.int64)


@dataclass
class Assigned:
    """Where each listed image goes: `names` ("" for those in no split), the ledger records of the
    images placed, and what the data report says of it."""

    names: np.ndarray
    members: np.ndarray
    records: np.ndarray
    report: dict[str, Any]


def assign_splits(listing: Listing, labels: np.ndarray, usable: np.ndarray, digests: np.ndarray,
                  cfg: DataConfig, seed: int, ledger: Ledger, classes: list[str], reset: bool) -> Assigned:
    """Each usable image's split: the source's own splits, missing ones carved out by content
    (`content_split`: a new photo never moves an old one), then the ledger's for every image it
    knows (unless `reset`), conflicts held out, copies and groups kept together. Placeholders and
    quarantined conflicts take no part.

    Only images without a given split are carved: a manifest row marked `train` is not cut into val
    or test. A source that marks every image (a tree with train/ but no test/, a manifest without
    blank split cells) has its missing splits carved out of its train images instead."""
    entries, paths = listing.entries, listing.entries.paths
    given = entries.split_names(default="")
    groups = entries.group_codes()
    shared = shared_bytes(digests, usable, groups, labels, paths, classes, cfg.placeholder_groups)
    left_out = shared.placeholder | (shared.conflict if cfg.label_conflicts == "quarantine" else False)
    member = usable & ~left_out
    names = np.where(given == "", "train", given).astype(object)
    carved = [(s, f) for s, f in (("test", cfg.test_fraction), ("val", cfg.val_fraction)) if s not in listing.given_splits]
    unmarked = given == ""
    pool = member & (unmarked if unmarked.any() else (given == "train") & bool(carved))
    if carved and pool.any():
        keys = split_keys(digests, groups, entries.group_keys())
        names[pool] = content_split(HexDigests(keys[pool]), labels[pool], carved, seed)
    flags = np.where(member & ~pool & (given != ""), GIVEN, 0).astype(np.uint8)
    report: dict[str, Any] = {}

    known_code = np.full(len(names), -1, dtype=np.int8)
    if not reset:
        by_content = ledger.by_content(digests)
        by_path, path_flags = ledger.by_path(path_keys(paths))
        known_code = np.maximum(by_content, by_path)  # the more held-out of the two
        known = member & (known_code >= 0)
        was_given = ((path_flags & GIVEN) > 0) | ledger.given_by_content(digests)
        # The user's own move of an image they had held out into train is refused below, not undone.
        users_move = known & (given == "train") & ~pool & (known_code > 0) & was_given
        keep = known & ~users_move
        wanted = SPLIT_NAMES[known_code[keep]]
        report["ledger"] = {"known_by_content": int(np.sum(member & (by_content >= 0))),
                            "known_by_path_after_new_bytes": int(np.sum(member & (by_content < 0) & (by_path >= 0))),
                            "held_where_the_source_or_the_hash_would_move_them": int(np.sum(names[keep] != wanted)),
                            "new_images": int(np.sum(member & (known_code < 0)))}
        names[keep] = wanted
        flags[keep] = np.where(was_given[keep], GIVEN, 0)
    for files in shared.conflicts:  # every copy leaves train: with the most held-out copy, or to test
        if cfg.label_conflicts == "hold_out":
            top = int(_rank(names[files]).max())
            names[files] = SPLIT_NAMES[top if top > 0 else TEST]
    members = np.flatnonzero(member)
    moved = colocate(names, members, np.ones(len(names), dtype=bool), digests, groups)
    back = member & (names == "train") & (known_code > 0)
    if back.any():
        _refuse_held_out_to_train(np.flatnonzero(back), paths, known_code)
    held_before = ledger.ever_held_out(digests[members]) | (names[members] != "train")
    records = np.zeros(len(members), dtype=RECORD)
    records["digest"], records["path"] = digests[members], path_keys([paths[i] for i in members])
    records["group"] = np.where(groups[members] >= 0, group_prefix(entries.group_keys()[members]), 0)
    records["label"], records["split"] = labels[members], _rank(names[members])
    records["flags"] = flags[members] | np.where(held_before, HELD_BEFORE, 0)
    names[~member] = ""
    report.update({
        "moved_to_join_a_copy_or_group": moved,
        "groups": {"groups": int(groups.max(initial=-1)) + 1, "photos_in_groups": int(np.sum(groups[members] >= 0))},
        "placeholders": shared.placeholders[:MAX_LISTED], "num_placeholders": len(shared.placeholders),
        "label_conflicts": [{"sha256": digest_at(digests, files[0]).hex(), "labels": sorted({classes[k] for k in labels[files]}),
                             "split": names[files[0]] or "quarantined", "paths": [paths[i] for i in files]}
                            for files in shared.conflicts[:MAX_LISTED]],
        "num_label_conflicts": len(shared.conflicts),
        "relabels": relabels(ledger, digests, labels, member, shared.conflict, classes),
        "train_images_once_held_out": int(np.sum(held_before & (names[members] == "train"))),
    })
    return Assigned(names, members, records, report)


def relabels(ledger: Ledger, digests: np.ndarray, labels: np.ndarray, member: np.ndarray, conflict: np.ndarray,
             classes: Sequence[str]) -> list[dict[str, Any]]:
    """Bytes the ledger knew under one label and the catalog now gives another, counted per class pair
    (each distinct image once): `[{"from", "to", "images"}]`, most first."""
    files = np.flatnonzero(member & ~conflict)
    before = ledger.label_by_content(digests[files])
    where = {name: k for k, name in enumerate(classes)}
    now_code = np.array([where.get(name, -1) for name in ledger.classes] + [-1], dtype=np.int64)
    changed = (before >= 0) & (now_code[before] != labels[files])  # (-1 indexes the trailing -1)
    pairs: Counter = Counter()
    seen: set[bytes] = set()
    for i, old in zip(files[changed].tolist(), before[changed].tolist()):  # the few relabelled ones
        digest = digest_at(digests, i)
        if digest not in seen:
            seen.add(digest)
            pairs[(ledger.classes[old], classes[labels[i]])] += 1
    return [{"from": a, "to": b, "images": n} for (a, b), n in sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0]))]


def _refuse_held_out_to_train(files: np.ndarray, paths: Sequence[str], known_code: np.ndarray) -> None:
    shown = "\n".join(f"  {paths[i]} (held out in {SPLITS[known_code[i]]})" for i in files[:20])
    more = f"\n  ... and {len(files) - 20} more" if len(files) > 20 else ""
    raise DataError(
        f"{len(files)} image(s) the split ledger holds out would go to train, where the source now puts them:\n"
        f"{shown}{more}\nA test or validation photo in training inflates every later test result. Put them back "
        "in their split, or set data.split_reset to a new name (e.g. the date) to redraw every split on purpose: "
        "the redraw is recorded in data/split_ledger.")

"""What the data report says of a prepared store: copies across splits, changes against the previous
store, and the files that were skipped. Sorted numpy arrays throughout (32-40 bytes an image): a
dict of hex strings would take ~200 at 10M images."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from cnnpipe.data.store.keys import digest_at
from cnnpipe.data.store.meta import in_folder, split_keys
from cnnpipe.data.store.previous import Tree
from cnnpipe.data.store.shards import SPLITS

LISTED = 100
"""Files listed by name in the data report, per list (all are counted; the rest are in the store)."""


def split_codes(lengths: list[int]) -> np.ndarray:
    """The split code (position in SPLITS) of every item of splits of these lengths, in SPLITS order."""
    return np.repeat(np.arange(len(SPLITS), dtype=np.int8), lengths)


def leakage(digests: np.ndarray, codes: np.ndarray, source: Callable[[int], str]) -> list[dict[str, Any]]:
    """Byte-identical items found in more than one split, by sorting their hashes (40 bytes an item;
    a dict of hex strings would take ~200). `digests` (S32) and `codes` (into SPLITS) are in the
    order the store was written, so each split names its first copy; `source(j)` names item j."""
    order = np.argsort(digests, kind="stable")
    ordered = digests[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], len(order)]
    found = []
    for a, b in zip(starts[ends - starts > 1], ends[ends - starts > 1]):
        first: dict[str, int] = {}
        for j in order[a:b]:
            first.setdefault(SPLITS[codes[j]], int(j))
        if len(first) > 1:
            names = sorted(first)
            found.append({"sha256": digest_at(ordered, int(a)).hex(), "splits": names,
                          "sources": [source(first[n]) for n in names]})
    return found


def listed(out_dir: Path, bad: list[dict[str, str]], ignored: list[str]) -> dict[str, Any]:
    """The data report's file lists, the first `LISTED` of each with their counts: the report is
    git-tracked, and a catalog of millions can hold thousands of them. The whole lists go to
    `skipped_files.jsonl` in the store, which DVC tracks."""
    if len(bad) > LISTED or len(ignored) > LISTED:
        with open(out_dir / "skipped_files.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(b, ensure_ascii=False) + "\n" for b in bad)
            fh.writelines(json.dumps({"path": path, "reason": "not an image file"}, ensure_ascii=False) + "\n"
                          for path in ignored)
    return {"ignored_files": ignored[:LISTED], "num_ignored": len(ignored), "bad_files": bad[:LISTED],
            "num_bad": len(bad)}


def _members(store: Tree | None) -> list[np.ndarray] | None:
    """Per split (in SPLITS order), the sorted distinct content hashes (S32) of a prepared store;
    None when there is no store."""
    keys = [split_keys(store.path, split) for split in SPLITS] if store else [None]
    if all(k is None for k in keys):
        return None
    return [np.unique(k["sha256"]) if k is not None else np.zeros(0, dtype="S32") for k in keys]


def mark_new(previous: Tree | None, current: Path) -> dict[str, int]:
    """Write `<split>_new.npy` into the store at `current`: per image, in the split's order, whether
    its bytes are new since the `previous` store (in none of its splits; every image without one).
    What the week's checks slice by: the delivery check reads this week's new photos, the gate
    reports them apart from last week's. Returns the new images per split."""
    before = _members(previous)
    known = np.unique(np.concatenate(before)) if before else np.zeros(0, dtype="S32")
    counts = {}
    for split in SPLITS:
        keys = split_keys(in_folder(current), split)
        if keys is not None:
            new = ~np.isin(keys["sha256"], known)
            np.save(current / f"{split}_new.npy", new)
            counts[split] = int(new.sum())
    return counts


def split_changes(previous: Tree | None, current: Path) -> dict[str, Any] | None:
    """Images each split gained and lost against the previous store, and how many images present in
    both changed split (0 unless a reset was asked for, or new photos joined known ones to a copy or
    a group held out, or to a label conflict); None without a previous store."""
    before = _members(previous)
    if before is None:
        return None
    after = _members(Tree(current)) or [np.zeros(0, dtype="S32")] * len(SPLITS)
    # Where each old hash was; one in several splits (leakage) counts as in the last of them.
    table, codes = np.concatenate(before), split_codes([len(d) for d in before])
    order = np.argsort(table, kind="stable")
    table, codes = table[order], codes[order]
    last = np.r_[table[1:] != table[:-1], True][: len(table)]
    table, codes = table[last], codes[last]
    moved = 0
    for code, digests in enumerate(after if len(table) else []):
        i = np.minimum(np.searchsorted(table, digests), len(table) - 1)
        moved += int(np.sum((table[i] == digests) & (codes[i] != code)))
    return {"splits": {s: {"gained": len(np.setdiff1d(after[k], before[k], assume_unique=True)),
                           "lost": len(np.setdiff1d(before[k], after[k], assume_unique=True))}
                       for k, s in enumerate(SPLITS)},
            "moved_between_splits": moved}

"""Where the gate looks besides the whole test set: this week's new test images apart from last week's,
each supplier apart, and the labels the week changed.

A regression confined to one supplier's photos, or to the new photos of the week, is averaged away on
the whole set; the slices put their paired statistics side by side in gate.md (reported, not ruled
on: a slice is smaller than the set, and a rule per slice would refuse equal models more often).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from cnnpipe.data.store.shards import new_rows, suppliers

MAX_SUPPLIERS = 20  # the largest suppliers sliced; a catalog of thousands would make gate.md a phone book


def slice_masks(prepared_dir: Path, kept: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Boolean masks over the test split, in its order, by name: last week's and this week's new test
    images (when the store says which are new and both exist), and each supplier's (when the
    manifest names more than one, or some rows none). `kept`: the rows the gate judges (the delivery
    check's held-out photos left out); None: all."""
    slices = _masks(prepared_dir)
    return slices if kept is None else {name: mask[kept] for name, mask in slices.items()}


def _masks(prepared_dir: Path) -> dict[str, np.ndarray]:
    slices: dict[str, np.ndarray] = {}
    new = new_rows(prepared_dir, "test")
    if new is not None and new.any() and not new.all():
        slices["last week's test images"] = ~new
        slices["this week's new test images"] = new
    named = suppliers(prepared_dir, "test")
    counts = Counter(s for s in named if s is not None)
    if len(counts) > 1 or (counts and None in named):
        column = np.array([s if s is not None else "" for s in named], dtype=object)
        for name, _ in counts.most_common(MAX_SUPPLIERS):
            slices[f"supplier {name}"] = column == name
    return slices


def week_relabels(data_report: Path | None, index: dict[str, Any], max_share: float) -> tuple[list[dict[str, Any]], list[str]]:
    """The data report's relabels (bytes the ledger knew under another label), each with the share of
    its former class it took, and a warning per class that lost more than `max_share` of its images
    to relabels this week: a delivery that renamed a folder, or a supplier's mistake, to look at
    before trusting that class's numbers."""
    if data_report is None or not data_report.exists():
        return [], []
    pairs = json.loads(data_report.read_text()).get("relabels") or []
    today = Counter()
    for split in index["splits"].values():
        for name, n in zip(index["classes"], split["class_counts"]):
            today[name] += n
    moved = Counter()
    for p in pairs:
        moved[p["from"]] += p["images"]
    rows = [{**p, "share_of_from": p["images"] / (today[p["from"]] + moved[p["from"]])} for p in pairs]
    warnings = []
    for name, n in sorted(moved.items(), key=lambda kv: -kv[1]):
        share = n / (today[name] + n)
        if share > max_share:
            to = ", ".join(f"{p['images']} to {p['to']!r}" for p in pairs if p["from"] == name)
            warnings.append(f"{n} images of {name!r} ({share:.1%} of the class) now carry another label ({to}): more "
                            f"than release.max_relabel_share ({max_share:.0%}); check the delivery before trusting "
                            "this class's numbers")
    return rows, warnings

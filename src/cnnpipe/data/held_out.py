"""Photos held out this week: the delivery check's flagged photos under `release.delivery.policy:
hold_out`, kept out of training, validation and the test split until a person fixes their labels.

The list is the delivery stage's (a CSV, one row per photo: source, sha256, split, ..., `held_out`).
Nothing is removed from the store, the catalog or the split ledger: a reader opens its split and
leaves those rows out (`open_kept`), so next week's store, with the labels fixed, has them back.
"""

from __future__ import annotations

import csv
import hashlib
from pathlib import Path

import numpy as np

from cnnpipe.data.meta import in_folder, split_meta
from cnnpipe.data.store import PreparedSplit, ShardedImages, open_split


def subset(split: PreparedSplit, rows: np.ndarray) -> PreparedSplit:
    """The rows of `split` (indices, in order) as a split of their own, read lazily from the same shards."""
    images = split.images
    view = images.take(rows) if isinstance(images, ShardedImages) else images[rows]
    return PreparedSplit(view, np.asarray(split.labels[rows]), split.classes)


def held_out_sources(list_path: Path | None, split: str) -> set[tuple[str, str]]:
    """(source, sha256) of the photos of `split` the list holds out (none without a list)."""
    if list_path is None or not Path(list_path).exists():
        return set()
    with open(list_path, newline="", encoding="utf-8") as fh:
        return {(row["source"], row["sha256"]) for row in csv.DictReader(fh)
                if row["held_out"] == "true" and row["split"] == split}


def held_out_rows(prepared_dir: Path, split: str, list_path: Path | None) -> np.ndarray:
    """Indices (in the split's order) of the rows the list holds out; matched on source and sha256, so
    a photo replaced since the list was written is not held out."""
    wanted = held_out_sources(list_path, split)
    if not wanted:
        return np.zeros(0, np.int64)
    rows = [i for i, meta in enumerate(split_meta(in_folder(prepared_dir), split))
            if (meta.get("source"), meta.get("sha256")) in wanted]
    return np.asarray(rows, np.int64)


def open_kept(prepared_dir: Path, split: str, list_path: Path | None,
              limit: int | None = None) -> tuple[PreparedSplit, np.ndarray | None]:
    """`open_split` without the held-out photos; with the kept rows' indices in the full split (None:
    nothing held out, the split as `open_split` gives it)."""
    opened = open_split(prepared_dir, split, limit=limit)
    dropped = held_out_rows(prepared_dir, split, list_path)
    dropped = dropped[dropped < len(opened)]
    if not len(dropped):
        return opened, None
    kept = np.setdiff1d(np.arange(len(opened)), dropped)
    return subset(opened, kept), kept


def held_out_digest(prepared_dir: Path, list_path: Path | None, splits: tuple[str, ...]) -> str:
    """A short digest of the rows held out of `splits` ('' for none): what a resume must also match."""
    parts = [f"{s}:{','.join(map(str, held_out_rows(prepared_dir, s, list_path).tolist()))}" for s in splits]
    if not any(p.split(":", 1)[1] for p in parts):
        return ""
    return hashlib.sha256(";".join(parts).encode()).hexdigest()[:16]

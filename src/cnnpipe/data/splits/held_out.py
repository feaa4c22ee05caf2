"""Photos held out: the delivery check's flagged photos under `release.delivery.policy: hold_out`
(its list) and those the split ledger still holds (the store's `<split>_held.npy`, `data.splits.holds`),
kept out of training, validation and the test split until a person clears them or their label
changes; and, for judging a model, the test photos that were ever in a training split.

The list is the delivery stage's (a CSV, one row per photo: source, sha256, split, ..., `held_out`).
Nothing is removed from the store, the catalog or the split ledger: a reader opens its split and
leaves those rows out (`open_kept`, `open_judged`).
"""

from __future__ import annotations

import csv
import hashlib
from pathlib import Path
from typing import Sequence

import numpy as np

from cnnpipe.data.store.meta import in_folder, split_meta
from cnnpipe.data.store.shards import PreparedSplit, ShardedImages, open_split


def subset(split: PreparedSplit, rows: np.ndarray) -> PreparedSplit:
    """The rows of `split` (indices, in order) as a split of their own, read lazily from the same shards."""
    images = split.images
    view = images.take(rows) if isinstance(images, ShardedImages) else images[rows]
    return PreparedSplit(view, np.asarray(split.labels[rows]), split.classes)


CLEARED_COLUMNS = ("sha256", "note")


def sha256_column(hexes: Sequence[str], path: Path, lines: Sequence[int]) -> np.ndarray:
    """Hex sha256 cells (read from `path` at `lines`) as S32; a bad one is refused, naming its line."""
    for text, line in zip(hexes, lines):
        if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
            raise ValueError(f"{path}, line {line}: {text!r} is not a sha256 (64 hex digits, as the delivery list's "
                             "sha256 column gives it)")
    return np.frombuffer(b"".join(bytes.fromhex(t) for t in hexes), dtype="S32") if hexes else np.zeros(0, "S32")


def read_cleared(path: Path | None) -> np.ndarray:
    """The sha256 (as S32, sorted) of every photo a person cleared in `path` (none without the file)."""
    if path is None or not Path(path).exists():
        return np.zeros(0, "S32")
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        if "sha256" not in (reader.fieldnames or []):
            raise ValueError(f"{path}: no `sha256` column; the file starts with the line `{','.join(CLEARED_COLUMNS)}`")
        rows = [(row["sha256"].strip().lower(), reader.line_num) for row in reader if (row["sha256"] or "").strip()]
    return np.unique(sha256_column([r[0] for r in rows], Path(path), [r[1] for r in rows]))


def held_out_sources(list_path: Path | None, split: str) -> set[tuple[str, str]]:
    """(source, sha256) of the photos of `split` the list holds out (none without a list)."""
    if list_path is None or not Path(list_path).exists():
        return set()
    with open(list_path, newline="", encoding="utf-8") as fh:
        return {(row["source"], row["sha256"]) for row in csv.DictReader(fh)
                if row["held_out"] == "true" and row["split"] == split}


def store_mark(prepared_dir: Path, split: str, name: str) -> np.ndarray | None:
    """A split's per-image mark `<split>_<name>.npy` that prepare writes (new, arrived, trained,
    held), None for a store written before it."""
    path = Path(prepared_dir) / f"{split}_{name}.npy"
    return np.load(path) if path.exists() else None


def held_out_rows(prepared_dir: Path, split: str, list_path: Path | None) -> np.ndarray:
    """Indices (in the split's order) of the rows the list holds out, and those the store marks held;
    matched on source and sha256, so a photo replaced since the list was written is not held out."""
    marked = store_mark(prepared_dir, split, "held")
    from_store = np.flatnonzero(marked) if marked is not None else np.zeros(0, np.int64)
    return np.union1d(from_store, _listed_rows(prepared_dir, split, list_path)).astype(np.int64)


def _listed_rows(prepared_dir: Path, split: str, list_path: Path | None) -> np.ndarray:
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


def open_judged(prepared_dir: Path, split: str, list_path: Path | None,
                limit: int | None = None) -> tuple[PreparedSplit, np.ndarray | None, int]:
    """`open_kept` without the photos whose bytes were ever in a training split either (the ledger's
    `<split>_trained.npy`): what a model is judged on, since one that trained on a photo may have
    memorised it. Returns the split, the kept rows' indices (None: all) and how many such photos
    (not held out anyway) were left out."""
    opened, kept, counts = _judged(prepared_dir, split, list_path, limit, ("trained",))
    return opened, kept, counts["trained"]


def open_compared(prepared_dir: Path, split: str,
                  list_path: Path | None) -> tuple[PreparedSplit, np.ndarray | None, dict[str, int]]:
    """`open_judged` for the gate's comparison of two models: also without the photos whose label
    changed this week (`<split>_relabelled.npy`), which favour a challenger trained on the new labels
    against a champion that learnt the old. Returns the split, the kept rows (None: all) and how many
    each mark left out: {"trained": n, "relabelled": n}."""
    return _judged(prepared_dir, split, list_path, None, ("trained", "relabelled"))


def _judged(prepared_dir: Path, split: str, list_path: Path | None, limit: int | None,
            marks: tuple[str, ...]) -> tuple[PreparedSplit, np.ndarray | None, dict[str, int]]:
    """The split less its held-out rows and the rows each of `marks` sets, counted mark by mark
    (a row counted once, by the first mark that sets it; held-out rows not counted)."""
    opened = open_split(prepared_dir, split, limit=limit)
    dropped = held_out_rows(prepared_dir, split, list_path)
    dropped = dropped[dropped < len(opened)]
    gone = np.zeros(len(opened), bool)
    gone[dropped] = True
    counts = {}
    for name in marks:
        mark = store_mark(prepared_dir, split, name)
        hit = np.zeros(len(opened), bool) if mark is None else mark[: len(opened)] & ~gone
        counts[name] = int(hit.sum())
        gone |= hit
    if not gone.any():
        return opened, None, counts
    kept = np.flatnonzero(~gone)
    return subset(opened, kept), kept, counts


def held_out_digest(prepared_dir: Path, list_path: Path | None, splits: tuple[str, ...]) -> str:
    """A short digest of the rows held out of `splits` ('' for none): what a resume must also match."""
    parts = [f"{s}:{','.join(map(str, held_out_rows(prepared_dir, s, list_path).tolist()))}" for s in splits]
    if not any(p.split(":", 1)[1] for p in parts):
        return ""
    return hashlib.sha256(";".join(parts).encode()).hexdigest()[:16]

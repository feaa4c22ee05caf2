"""The split ledger: every image `prepare` has ever placed, and the split it got, never forgotten.

Stickiness against the previous store alone forgets an image the week it is absent (a product out of
stock), and a fresh clone without the store forgets them all: back in the catalog, a test photo
would draw its split again, and ~80% of them land in train. The ledger remembers each file ever
seen (content digest, source path, group, label, split, whether the source gave that split, whether
it was ever held out) in append-only segments: each prepare adds one segment holding only what is
new or changed, so a week's update costs O(new photos) and a segment, once written, never changes.

Where it lives: `data/split_ledger`, a DVC output of the prepare stage of its own, pulled with the
code (`dvc pull data/split_ledger`: ~100 bytes an image, without the store's pixels). Not in git:
at 10M photos it is a gigabyte of random hashes, which git can neither compress nor diff. Not
inside the store either: a CI machine or a fresh clone needs the splits, not 200 GB of pixels.

A reset (`data.split_reset`: a name, recorded in the segment it starts) redraws every split: only
the segments from the last reset on decide splits; the ones before still say which images were
ever held out.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from cnnpipe.data.store.keys import find_sorted, last_of_runs, path_keys
from cnnpipe.data.store.meta import split_meta
from cnnpipe.data.store.previous import Tree
from cnnpipe.data.store.shards import SPLITS

SEGMENTS = "segments"
RECORD = np.dtype([("digest", "S32"), ("path", "<u8"), ("group", "<u8"), ("label", "<u4"), ("split", "i1"),
                   ("flags", "u1")])
"""One file's place: sha256 of its bytes, `keys.path_key` of its source path, the first 8 bytes of its
group's key (0: none), its class (into the segment's `classes`), its split (into SPLITS) and FLAGS."""
GIVEN = 1         # the split is the one the source gave (a split folder, a manifest's split cell)
HELD_BEFORE = 2   # held out (val or test) at some time, before a reset too
HOLD = 4          # kept out of training and testing by the delivery check, under this label, until cleared


def group_prefix(group_keys: np.ndarray) -> np.ndarray:
    """The first 8 bytes of each 32-byte group key, as uint64 (0 where there is no group)."""
    return np.frombuffer(np.ascontiguousarray(group_keys).tobytes(), dtype="<u8").reshape(-1, 4)[:, 0].copy()


@dataclass
class Ledger:
    """What the segments say since the last reset, as sorted lookup tables (~60 bytes an image)."""

    classes: list[str] = field(default_factory=list)
    resets: list[str] = field(default_factory=list)
    rule: dict[str, Any] | None = None
    segments: int = 0
    records: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=RECORD))   # latest per (digest, path)
    _digests: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="S32"))
    _digest_split: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int8))
    _digest_label: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    _paths: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    _path_split: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int8))
    _path_flags: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint8))
    _record_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="S54"))
    _held_digests: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="S32"))
    _first_digests: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="S32"))  # sorted
    _first_segment: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # 2 * segment + trained
    _hold_digests: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="S32"))
    _hold_label: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @classmethod
    def read(cls, tree: Tree | None) -> Ledger:
        """The ledger in `tree` (an empty one when None or without segments)."""
        ledger = cls()
        if tree is None:
            return ledger
        headers = [tree.read_json(f"{SEGMENTS}/{name}") for name in tree.names(SEGMENTS) if name.endswith(".json")]
        ledger.segments = len(headers)
        ledger.resets = [h["reset"] for h in headers if h.get("reset")]
        ledger.rule = headers[-1]["rule"] if headers else None
        last_reset = max((k for k, h in enumerate(headers) if h.get("reset")), default=0)
        parts, held, seen = [], [], []
        for k, header in enumerate(headers):
            records = np.load(tree.path(f"{SEGMENTS}/{header['name']}.npy"))
            codes = np.array([ledger._class_code(name) for name in header["classes"]], dtype=np.uint32)
            records["label"] = codes[records["label"]] if len(records) else records["label"]
            held.append(records["digest"][(records["split"] > 0) | (records["flags"] & HELD_BEFORE > 0)])
            seen.append(records[["digest", "split"]])
            if k >= last_reset:
                parts.append(records)
        ledger._index(np.concatenate(parts) if parts else np.zeros(0, dtype=RECORD),
                      np.unique(np.concatenate(held)) if held else np.zeros(0, dtype="S32"))
        ledger._history(seen)
        return ledger

    @classmethod
    def from_records(cls, records: np.ndarray, classes: Sequence[str]) -> Ledger:
        """A ledger of these records alone (labels into `classes`), as if read from one segment."""
        ledger = cls(classes=list(classes), segments=1)
        ledger._index(records, np.unique(records["digest"][(records["split"] > 0) | (records["flags"] & HELD_BEFORE > 0)]))
        ledger._history([records[["digest", "split"]]])
        return ledger

    def _history(self, segments: list[np.ndarray]) -> None:
        """From every segment (before a reset too), in order: the segment where each digest first
        arrived, and the digests ever placed in train (what a model trained on some store may know)."""
        digests = np.concatenate([s["digest"] for s in segments]) if segments else np.zeros(0, dtype="S32")
        number = np.repeat(np.arange(len(segments)), [len(s) for s in segments])
        in_train = np.concatenate([s["split"] == 0 for s in segments]) if segments else np.zeros(0, dtype=bool)
        # One sorted table for both answers (a lookup of 32-byte keys is the cost at 10M images).
        self._first_digests, first, inverse = np.unique(digests, return_index=True, return_inverse=True)
        trained = np.zeros(len(self._first_digests), dtype=np.int64)
        trained[inverse[in_train]] = 1
        self._first_segment = number[first].astype(np.int64) * 2 + trained  # the first occurrence: its segment

    def _class_code(self, name: str) -> int:
        if name not in self.classes:
            self.classes.append(name)
        return self.classes.index(name)

    def _index(self, records: np.ndarray, held: np.ndarray) -> None:
        """Build the lookups from the records since the last reset, in the order they were written."""
        latest = records[last_of_runs(file_keys(records))]  # one record per file: its latest
        self.records, self._held_digests = latest, held
        self._record_keys = np.sort(record_keys(latest))
        # By content: a digest's most held-out split among its files, and its latest label.
        by_digest = np.lexsort((latest["split"], latest["digest"]))
        ordered = latest[by_digest]
        top = np.r_[ordered["digest"][1:] != ordered["digest"][:-1], True] if len(ordered) else np.zeros(0, bool)
        self._digests, self._digest_split = ordered["digest"][top], ordered["split"][top]
        newest = records[last_of_runs(records["digest"])]  # sorted by digest, the last written per digest
        self._digest_label = newest["label"].astype(np.int64)
        hold = newest[newest["flags"] & HOLD > 0]  # a digest's hold: its latest record says so
        self._hold_digests, self._hold_label = hold["digest"], hold["label"].astype(np.int64)
        # By path: the file's latest record, whatever its bytes.
        by_path = records[last_of_runs(records["path"])]
        self._paths, self._path_split, self._path_flags = by_path["path"], by_path["split"], by_path["flags"]

    def __len__(self) -> int:
        return len(self.records)

    def by_content(self, digests: np.ndarray) -> np.ndarray:
        """Each digest's split code (into SPLITS; the most held-out of its files), -1 when unknown."""
        return find_sorted(self._digests, self._digest_split, digests)

    def label_by_content(self, digests: np.ndarray) -> np.ndarray:
        """Each digest's latest label (into `self.classes`), -1 when unknown."""
        return find_sorted(self._digests, self._digest_label, digests)

    def by_path(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(split code, flags) of the latest record of each path key; (-1, 0) when unknown."""
        return (find_sorted(self._paths, self._path_split, keys),
                find_sorted(self._paths, self._path_flags, keys, missing=0))

    def given_by_content(self, digests: np.ndarray) -> np.ndarray:
        """Whether some file with each digest got its split from the source (the user's own call)."""
        given = self.records[self.records["flags"] & GIVEN > 0]["digest"]
        return np.isin(digests, given)

    def ever_held_out(self, digests: np.ndarray) -> np.ndarray:
        """Whether each digest was ever in val or test, before any reset too."""
        return np.isin(digests, self._held_digests)

    def history(self, digests: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per digest: the segment (0 = the first) in which it first arrived (-1: never seen), and
        whether it was ever in a training split, before any reset too."""
        both = find_sorted(self._first_digests, self._first_segment, digests)
        return np.where(both >= 0, both // 2, -1), (both >= 0) & (both % 2 == 1)

    def hold_label(self, digests: np.ndarray) -> np.ndarray:
        """The label (into `self.classes`) each digest is held under by the delivery check, -1 if none."""
        return find_sorted(self._hold_digests, self._hold_label, digests)

    def unchanged(self, records: np.ndarray) -> np.ndarray:
        """Which of `records` the ledger already holds as they are (same file, split, label, group, flags)."""
        return np.isin(record_keys(records), self._record_keys)


def _key_bytes(records: np.ndarray, fields: Sequence[str]) -> np.ndarray:
    """The `fields` of each record side by side as one fixed-width byte string (big-endian numbers,
    so bytes sort as the values do)."""
    columns = []
    for name in fields:
        column = records[name]
        if column.dtype.kind != "S":
            column = column.astype(column.dtype.newbyteorder(">"))
        columns.append(np.frombuffer(np.ascontiguousarray(column).tobytes(), dtype=np.uint8).reshape(len(records), -1))
    raw = np.concatenate(columns, axis=1) if len(records) else np.zeros((0, 1), dtype=np.uint8)
    return np.frombuffer(np.ascontiguousarray(raw).tobytes(), dtype=f"S{raw.shape[1]}")


def file_keys(records: np.ndarray) -> np.ndarray:
    """One key per file: its bytes and its path (a copy elsewhere, a re-encode, are other files)."""
    return _key_bytes(records, ("digest", "path"))


def record_keys(records: np.ndarray) -> np.ndarray:
    """A file's whole record as one key: equal keys mean the ledger needs no new line for it."""
    return _key_bytes(records, ("digest", "path", "group", "label", "split", "flags"))


def write_ledger(out: Path, previous: Tree | None, records: np.ndarray, paths: Sequence[str],
                 classes: Sequence[str], header: dict[str, Any]) -> dict[str, Any]:
    """`out` := the previous segments (hard-linked: their bytes and DVC cache objects stay) plus one
    new segment of `records` (their source `paths` beside them) when there is any, or a reset to
    record. Every file is fsynced. Returns what was done, for the data report."""
    folder = out / SEGMENTS
    folder.mkdir(parents=True, exist_ok=True)
    old = previous.names(SEGMENTS) if previous else []
    for name in old:
        _link_or_copy(previous.path(f"{SEGMENTS}/{name}"), folder / name)
    serial = 1 + max((int(name.split(".")[0]) for name in old if name.endswith(".json")), default=-1)
    added = len(records) > 0 or bool(header.get("reset"))
    if added:
        name = f"{serial:06d}"
        labels_used = sorted(set(records["label"].tolist()))
        remap = np.zeros(max(labels_used, default=0) + 1, dtype=np.uint32)
        remap[labels_used] = np.arange(len(labels_used), dtype=np.uint32)
        stored = records.copy()
        stored["label"] = remap[records["label"]] if len(records) else stored["label"]
        _write_synced(folder / f"{name}.npy", lambda fh: np.save(fh, stored))
        _write_synced(folder / f"{name}.paths", lambda fh: fh.write(
            "".join(json.dumps(p) + "\n" for p in paths).encode("utf-8", "surrogatepass")))
        full = {**header, "name": name, "rows": len(records), "classes": [classes[k] for k in labels_used],
                "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        _write_synced(folder / f"{name}.json", lambda fh: fh.write(json.dumps(full, indent=1).encode()))
    return {"segments": len(old) // 3 + added, "records_added": len(records)}


def _write_synced(path: Path, write: Any) -> None:
    with open(path, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())


def _link_or_copy(source: Path | None, target: Path) -> None:
    import shutil

    if source is None:
        raise FileNotFoundError(f"{target.name}: listed in the previous ledger but not found")
    try:
        os.link(source, target)
    except OSError:  # another filesystem, or links not allowed: a segment is small
        shutil.copyfile(source, target)


def split_names(codes: np.ndarray) -> np.ndarray:
    """Split codes (into SPLITS) as an object array of names; -1 becomes ""."""
    return np.array([*SPLITS, ""], dtype=object)[codes]


def records_from_store(tree: Tree, classes: list[str], given: frozenset[str] = frozenset()) -> tuple[np.ndarray, list[str]]:
    """The ledger records of the images a store holds, and their source paths: what seeds the ledger
    of a project whose store predates it, and what a fixed data set (Fashion-MNIST) records. Labels
    are mapped into `classes`, which gains the store's classes it lacks; splits in `given` count as
    the source's own."""
    index = tree.read_json("index.json") or {}
    remap = []
    for name in index.get("classes", []):
        if name not in classes:
            classes.append(name)
        remap.append(classes.index(name))
    parts, paths = [], []
    for code, split in enumerate(SPLITS):
        labels = tree.path(f"{split}_labels.npy")
        items = list(split_meta(tree.path, split)) if labels is not None else []
        if not items:
            continue
        records = np.zeros(len(items), dtype=RECORD)
        records["digest"] = np.frombuffer(b"".join(bytes.fromhex(item["sha256"]) for item in items), dtype="S32")
        records["path"] = path_keys([item["source"] for item in items])
        records["label"] = np.asarray(remap, dtype=np.uint32)[np.load(labels)] if len(items) else 0
        records["split"] = code
        records["flags"] = (GIVEN if split in given else 0) | (HELD_BEFORE if code > 0 else 0)
        parts.append(records)
        paths += [item["source"] for item in items]
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=RECORD)), paths

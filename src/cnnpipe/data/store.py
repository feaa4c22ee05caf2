"""The prepared format: pre-resized uint8 images in sealed, append-only shards, and a small index.

Layout of a prepared directory::

    index.json               classes, geometry, the shard list, per-split counts and fingerprints
    shards/<serial>-<split>.u8
                             raw uint8 pixels, shape (rows, size, size, channels), row-major; written
                             once and never rewritten (`writer.StoreWriter`)
    <split>_rows.npy         (N, 2) int32: each image's shard (its place in index.json's list) and row
    <split>_labels.npy       int64 labels
    <split>_meta.jsonl       one line per image: source path and sha256 of the source bytes (and, for
                             image files, their size and mtime: unchanged files are not read again)
    recipe.json              the decoding rules and size (image files only): which stores can share pixels
    split_rule.json          the seed and fractions the splits were drawn with (image files only)

The layout follows the sealed shards of MDS, WebDataset and LitData: a week's new photos go into new
shards and every full shard keeps its bytes, so DVC caches and pushes only what is new. What a split
*is* lives in the per-split files, which are in content order (sha256, then label), not in the order
images were added: a store grown week by week and one built at once from the same catalog read the
same images in the same order, so they train the same model. A removed image is a tombstone: a shard
row no split points at.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 2
SPLITS = ("train", "val", "test")
SHARDS = "shards"


def read_index(prepared_dir: Path) -> dict[str, Any]:
    """Load index.json, explaining what to run when it is missing."""
    path = Path(prepared_dir) / "index.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run `dvc repro prepare` first")
    index = json.loads(path.read_text(encoding="utf-8"))
    if index.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: format {index.get('format')} != {FORMAT_VERSION}; rerun `dvc repro prepare`")
    return index


class ShardedImages:
    """A read-only (N, size, size, channels) uint8 array of one split, gathered from its shards.

    Indexing with an int or an index array reads only those rows (each shard is memory-mapped on
    first use, in the process that reads it: a DataLoader worker maps its own); a slice is a view;
    `np.asarray` reads all. Pickles as paths, never as pixels."""

    dtype = np.dtype(np.uint8)
    ndim = 4

    def __init__(self, shards: list[Path], where: np.ndarray, frame: tuple[int, int, int]) -> None:
        self.shards, self.where, self.frame = shards, where, frame
        self._maps: dict[int, np.ndarray] = {}

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self.where), *self.frame)

    def __len__(self) -> int:
        return len(self.where)

    def _map(self, shard: int) -> np.ndarray:
        if shard not in self._maps:
            path = self.shards[shard]
            rows = path.stat().st_size // int(np.prod(self.frame))
            # a plain ndarray view: indexing the memmap subclass costs microseconds per call
            self._maps[shard] = np.memmap(path, dtype=np.uint8, mode="r", shape=(rows, *self.frame)).view(np.ndarray)
        return self._maps[shard]

    def __getitem__(self, key: Any) -> np.ndarray | ShardedImages:
        if isinstance(key, (int, np.integer)):
            shard, row = self.where[key]
            return self._map(int(shard))[row]
        if isinstance(key, slice):
            return ShardedImages(self.shards, self.where[key], self.frame)
        key = np.asarray(key)
        where = self.where[key if key.dtype == bool else key.astype(np.intp)]
        if not len(where):
            return np.empty((0, *self.frame), dtype=np.uint8)
        shards = where[:, 0]
        if (shards == shards[0]).all():  # the common case: one shard, one gather
            return self._map(int(shards[0]))[where[:, 1]]
        # Group the rows by shard with one sort: a batch from a catalog of thousands of shards
        # touches up to one shard per image, and a mask per shard would cost batch x shards.
        order = np.argsort(shards, kind="stable")
        by_shard, rows = shards[order], where[order, 1]
        bounds = np.flatnonzero(by_shard[1:] != by_shard[:-1]) + 1
        out = np.empty((len(where), *self.frame), dtype=np.uint8)
        for a, b in zip([0, *bounds.tolist()], [*bounds.tolist(), len(order)]):
            out[order[a:b]] = self._map(int(by_shard[a]))[rows[a:b]]
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[np.arange(len(self))]
        return out if dtype is None else out.astype(dtype)

    def __getstate__(self) -> dict[str, Any]:
        return {"shards": self.shards, "where": self.where, "frame": self.frame}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["shards"], state["where"], state["frame"])  # type: ignore[misc]


@dataclass
class PreparedSplit:
    """Read-only view of one prepared split, in content order."""

    images: ShardedImages | np.ndarray  # (N, size, size, channels) uint8
    labels: np.ndarray  # (N,) int64
    classes: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def channels(self) -> int:
        return int(self.images.shape[-1])

    def __len__(self) -> int:
        return len(self.labels)


def shard_paths(prepared_dir: Path, index: dict[str, Any]) -> list[Path]:
    """The shard files of a store, in the order its `<split>_rows.npy` number them."""
    return [Path(prepared_dir) / SHARDS / shard["name"] for shard in index["shards"]]


def open_split(prepared_dir: Path, split: str, limit: int | None = None) -> PreparedSplit:
    """Open `split` of a prepared directory; `limit` keeps the first N images."""
    prepared_dir = Path(prepared_dir)
    index = read_index(prepared_dir)
    if split not in index["splits"]:
        raise KeyError(f"{prepared_dir}: no split {split!r} (have {', '.join(index['splits'])})")
    frame = (index["size"], index["size"], index["channels"])
    where = np.load(prepared_dir / f"{split}_rows.npy")
    labels = np.load(prepared_dir / f"{split}_labels.npy")
    if len(where) != index["splits"][split]["count"] or len(labels) != len(where):
        raise ValueError(f"{prepared_dir}: {split} has {len(where)} rows and {len(labels)} labels, index.json says "
                         f"{index['splits'][split]['count']}; rerun `dvc repro prepare`")
    shards = shard_paths(prepared_dir, index)
    for shard, path in zip(index["shards"], shards):
        expected = shard["rows"] * int(np.prod(frame))
        if not path.exists() or path.stat().st_size != expected:
            found = f"{path.stat().st_size} bytes" if path.exists() else "missing"
            raise ValueError(f"{path}: {found}, index.json says {expected}; rerun `dvc repro prepare` "
                             "(or `dvc checkout data/prepared`)")
    images = ShardedImages(shards, where, frame)
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    return PreparedSplit(images=images, labels=labels, classes=list(index["classes"]))


def data_fingerprint(prepared_dir: Path) -> str:
    """What training depends on: the classes, the geometry and every split's images and labels (their
    fingerprints in index.json), not the store's layout; a grown store and one built at once from the
    same catalog share it. Empty when there is no store."""
    path = Path(prepared_dir) / "index.json"
    if not path.exists():
        return ""
    index = read_index(prepared_dir)
    identity = {"classes": index["classes"], "size": index["size"], "channels": index["channels"],
                "splits": {s: v["fingerprint"] for s, v in index["splits"].items()}}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def test_sources(prepared_dir: Path, n: int | None = None) -> list[str]:
    """Source paths of the test split's images in its order (the first `n`; None: all): what
    evaluate's predictions.csv lists and the gate checks it against."""
    with open(Path(prepared_dir) / "test_meta.jsonl", encoding="utf-8") as fh:
        return list(itertools.islice((json.loads(line)["source"] for line in fh), n))


def suppliers(prepared_dir: Path, split: str) -> list[str | None]:
    """Each image's supplier (a manifest's `supplier` column) in the split's order, None where the
    source gives none: what a per-supplier report slices by."""
    with open(Path(prepared_dir) / f"{split}_meta.jsonl", encoding="utf-8") as fh:
        return [json.loads(line).get("supplier") for line in fh]

"""The prepared format: pre-resized uint8 images in sealed, append-only shards, and a small index.

Layout of a prepared directory::

    index.json               classes, geometry, the shard list, per-split counts and fingerprints
    shards/<serial>-<split>.u8, shards/<serial>-mixed.u8
                             raw uint8 pixels, shape (rows, size, size, channels), row-major; written
                             once and never rewritten (`writer.StoreWriter`); a `mixed` shard is a
                             segment of a prepare's journal (the images it decoded, any split)
    shards/<serial>-<split>.jpg + .off
                             a JPEG store (index.json's `encoding`): one JPEG record per row, back to
                             back, and (rows + 1) little-endian uint64 offsets: row r is
                             bytes [off[r], off[r+1]) (`codec.pack`'s layout)
    <split>_rows.npy         (N, 2) int32: each image's shard (its place in index.json's list) and row
    <split>_labels.npy       int64 labels
    <split>_new.npy          bool: the image's bytes are new since the previous store (`new_rows`)
    <split>_arrived.npy      int32: the split ledger's segment its bytes first arrived in (`data.splits.holds`;
                             index.json's `generation` counts the segments)
    <split>_trained.npy      bool: its bytes were ever in a training split (the ledger)
    <split>_held.npy         bool: held out by the delivery check until relabelled or cleared
    <split>_meta.npy         (N, 2) int32: where each image's meta line is (segment, line)
    meta/<serial>.jsonl + .npy
                             sealed segments of meta lines (`meta`): source path and sha256 of the
                             source bytes (and, for image files, their size and mtime: unchanged files
                             are not read again), written once like the shards
    recipe.json              the decoding rules and size (image files only): which stores can share pixels
    split_rule.json          the seed and fractions the splits were drawn with (image files only)

A reader (`open_split`) pins the store it opens (`pin_store`: hard links, removed at exit) and maps
at most `max_open_shards()` shards at a time, so a run at 10M images neither runs out of file
descriptors nor loses its store when an update is swapped in while it trains.

`<split>_rows.npy` gives (shard, row) in either encoding: the row is a raw frame's place in its
shard, or a JPEG record's place in its offsets. A JPEG store is decoded on read, on the CPU by
`codec.decode_records` (the one decoder: training, evaluation, the gate and predict read the same
pixels for the same bytes); a raw store's index.json has no `encoding` key (stores before it read so).

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
import resource
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from cnnpipe.data.store import codec
from cnnpipe.data.store.meta import in_folder, split_meta
from cnnpipe.data.store.pins import pin_store

FORMAT_VERSION = 2
SPLITS = ("train", "val", "test")
SHARDS = "shards"
OFFSETS = ".off"
OFFSET_DTYPE = np.dtype("<u8")


def encoding_of(index: dict[str, Any]) -> str:
    """`raw` or `jpeg`: how a store keeps its images (a raw store, as before encodings, records none)."""
    return index.get("encoding", "raw")


def offsets_name(name: str) -> str:
    """The offsets sidecar of a JPEG shard: `000003-train.jpg` -> `000003-train.off`."""
    return name.rsplit(".", 1)[0] + OFFSETS


def shard_files(index: dict[str, Any]) -> list[str]:
    """Every file under shards/ a store's readers need, relative to the store."""
    jpeg = encoding_of(index) == "jpeg"
    return [f"{SHARDS}/{n}" for shard in index["shards"]
            for n in ([shard["name"], offsets_name(shard["name"])] if jpeg else [shard["name"]])]


def reader_files(index: dict[str, Any]) -> list[str]:
    """What a reader of the store pins besides index.json: each split's rows and labels, the shards."""
    return [f"{split}_{kind}.npy" for split in index["splits"] for kind in ("rows", "labels")] + shard_files(index)


def read_offsets(path: Path) -> np.ndarray:
    """A JPEG shard's (rows + 1,) offsets, as int64."""
    return np.fromfile(path, dtype=OFFSET_DTYPE).astype(np.int64)


def read_index(prepared_dir: Path) -> dict[str, Any]:
    """Load index.json, explaining what to run when it is missing."""
    path = Path(prepared_dir) / "index.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run `dvc repro prepare` first")
    index = json.loads(path.read_text(encoding="utf-8"))
    if index.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: format {index.get('format')} != {FORMAT_VERSION}; rerun `dvc repro prepare`")
    return index


def max_open_shards() -> int:
    """How many shards one process keeps mapped: each map holds a file descriptor, and a store of 10M
    images has thousands of shards, so a fixed share of the descriptors this process may open."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return int(max(8, min(128, soft // 8)))


def by_shard(where: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(shard, positions in `where`, rows in that shard) for each shard `where`'s (shard, row) pairs
    touch. One sort groups them: a batch from a catalog of thousands of shards touches up to one shard
    per image, and a mask per shard would cost batch x shards."""
    order = np.argsort(where[:, 0], kind="stable")
    shards, rows = where[order, 0], where[order, 1]
    bounds = [0, *(np.flatnonzero(shards[1:] != shards[:-1]) + 1).tolist(), len(order)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            yield int(shards[a]), order[a:b], rows[a:b]


class ShardedImages:
    """A read-only (N, size, size, channels) uint8 array of one split, gathered from its shards.

    Indexing with an int or an index array reads only those rows; a slice is a view; `np.asarray`
    reads all. Shards are memory-mapped on first use, in the process that reads them (a DataLoader
    worker maps its own), at most `max_open_shards()` at a time (the least recently used is unmapped).
    Pickles as the path of its row index and its slice, never as the index or the pixels: a spawned
    worker gets a few hundred bytes and maps the index itself. Of a JPEG store (`encoding`), it maps
    the records and decodes the rows it reads (`codec.decode_records`), in the process that reads
    them: a DataLoader's workers decode their own batches."""

    dtype = np.dtype(np.uint8)
    ndim = 4

    def __init__(self, shards: list[Path], where: np.ndarray, frame: tuple[int, int, int],
                 source: tuple[Path, slice] | None = None, encoding: str = "raw") -> None:
        self.shards, self.where, self.frame, self.source = shards, where, frame, source
        self.encoding = encoding
        self.max_open = max_open_shards()
        self._maps: OrderedDict[int, Any] = OrderedDict()
        self._stored_bytes: int | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self.where), *self.frame)

    def __len__(self) -> int:
        return len(self.where)

    def _map(self, shard: int) -> np.ndarray:
        mapped = self._maps.get(shard)
        if mapped is not None:
            self._maps.move_to_end(shard)
            return mapped
        while len(self._maps) >= self.max_open:
            self._maps.popitem(last=False)  # its map (and descriptor) closes with its last view
        path = self.shards[shard]
        if self.encoding == "jpeg":  # (the records, the offsets): decoded by `_decode_rows`
            mapped = (np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray),
                      read_offsets(path.with_name(offsets_name(path.name))))
        else:
            rows = path.stat().st_size // int(np.prod(self.frame))
            # a plain ndarray view: indexing the memmap subclass costs microseconds per call
            mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=(rows, *self.frame)).view(np.ndarray)
        self._maps[shard] = mapped
        return mapped

    def _rows(self, shard: int, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows `rows` of one shard as (len(rows), *frame) uint8: gathered (raw) or decoded (JPEG)."""
        mapped = self._map(shard)
        if self.encoding != "jpeg":
            return mapped[rows]
        records, offsets = mapped
        return codec.decode_records(records, offsets[rows], offsets[rows + 1], self.frame, out)

    def __getitem__(self, key: Any) -> np.ndarray | ShardedImages:
        if isinstance(key, (int, np.integer)):
            shard, row = self.where[key]
            return self._map(int(shard))[row] if self.encoding == "raw" else self._rows(int(shard), np.array([row]))[0]
        if isinstance(key, slice):
            source = None
            if self.source is not None:  # a slice of a slice is a slice: compose them through range
                window = range(*self.source[1].indices(2**62))[key]
                source = (self.source[0], slice(window.start, window.stop, window.step))
            return ShardedImages(self.shards, self.where[key], self.frame, source, self.encoding)
        key = np.asarray(key)
        where = self.where[key if key.dtype == bool else key.astype(np.intp)]
        if not len(where):
            return np.empty((0, *self.frame), dtype=np.uint8)
        if (where[:, 0] == where[0, 0]).all():  # the common case: one shard, one gather
            return self._rows(int(where[0, 0]), where[:, 1])
        out = np.empty((len(where), *self.frame), dtype=np.uint8)
        for shard, positions, rows in by_shard(where):
            out[positions] = self._rows(shard, rows)
        return out

    def take(self, rows: np.ndarray) -> ShardedImages:
        """The given rows (indices, in order) as images of their own, read lazily from the same shards
        with the same encoding (pickled with their row table: not a slice of the split's)."""
        return ShardedImages(self.shards, self.where[np.asarray(rows, dtype=np.intp)], self.frame,
                             encoding=self.encoding)

    def stored_bytes(self) -> int:
        """What these rows weigh in their shards, hence in the page cache: raw frames, or a JPEG
        store's records (a tenth of the pixels at 224 px). A JPEG store's offsets are read once per
        instance (~80 MB at 10M photos), however many loaders are built on it: the profile builds one
        per trial from the one split it opened."""
        if self.encoding != "jpeg":
            return len(self) * int(np.prod(self.frame))
        if self._stored_bytes is None:
            total = 0
            for shard, _, rows in by_shard(np.asarray(self.where)):
                offsets = read_offsets(self.shards[shard].with_name(offsets_name(self.shards[shard].name)))
                total += int(np.sum(offsets[rows + 1] - offsets[rows]))
            self._stored_bytes = total
        return self._stored_bytes

    def shard_of_each(self) -> np.ndarray:
        """Each image's shard number: what a shard-local shuffle groups by."""
        return np.asarray(self.where[:, 0])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[np.arange(len(self))]
        return out if dtype is None else out.astype(dtype)

    def __getstate__(self) -> dict[str, Any]:
        where = None if self.source is not None else self.where
        return {"shards": self.shards, "where": where, "frame": self.frame, "source": self.source,
                "encoding": self.encoding}

    def __setstate__(self, state: dict[str, Any]) -> None:
        where = state["where"]
        if where is None:
            rows, window = state["source"]
            where = _mapped(rows)[window]
        self.__init__(state["shards"], where, state["frame"], state["source"],  # type: ignore[misc]
                      state.get("encoding", "raw"))


@dataclass
class PreparedSplit:
    """Read-only view of one prepared split, in content order. Opened by `open_split`, it pickles as
    where it was opened from (`source`: folder, split, slice), a few hundred bytes whatever its size."""

    images: ShardedImages | np.ndarray  # (N, size, size, channels) uint8
    labels: np.ndarray  # (N,) int64
    classes: list[str]
    source: tuple[Path, str, slice] | None = None

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def channels(self) -> int:
        return int(self.images.shape[-1])

    @property
    def encoding(self) -> str:
        """How its store keeps the images: `raw` or `jpeg` (an in-memory array: raw)."""
        return getattr(self.images, "encoding", "raw")

    def __len__(self) -> int:
        return len(self.labels)

    def __reduce__(self) -> Any:
        if self.source is None:
            return PreparedSplit, (self.images, self.labels, self.classes)
        return _reopen, (*self.source, self.classes)


def _reopen(folder: Path, split: str, window: slice, classes: list[str]) -> PreparedSplit:
    """A pickled `PreparedSplit` back: its files mapped again from the (pinned) folder it came from."""
    opened = _open(Path(folder), split, read_index(folder))
    return PreparedSplit(opened.images[window], opened.labels[window], classes, (Path(folder), split, window))


def shard_paths(prepared_dir: Path, index: dict[str, Any]) -> list[Path]:
    """The shard files of a store, in the order its `<split>_rows.npy` number them."""
    return [Path(prepared_dir) / SHARDS / shard["name"] for shard in index["shards"]]


def _mapped(path: Path) -> np.ndarray:
    """A .npy file memory-mapped (shared through the page cache, never a copy per process), as a plain
    ndarray view: indexing the memmap subclass costs microseconds a call."""
    return np.load(path, mmap_mode="r").view(np.ndarray)


def _open(folder: Path, split: str, index: dict[str, Any]) -> PreparedSplit:
    if split not in index["splits"]:
        raise KeyError(f"{folder}: no split {split!r} (have {', '.join(index['splits'])})")
    frame = (index["size"], index["size"], index["channels"])
    rows_file = folder / f"{split}_rows.npy"
    where = _mapped(rows_file)
    labels = _mapped(folder / f"{split}_labels.npy")
    if len(where) != index["splits"][split]["count"] or len(labels) != len(where):
        raise ValueError(f"{folder}: {split} has {len(where)} rows and {len(labels)} labels, index.json says "
                         f"{index['splits'][split]['count']}; rerun `dvc repro prepare`")
    images = ShardedImages(shard_paths(folder, index), where, frame, (rows_file, slice(None)), encoding_of(index))
    return PreparedSplit(images, labels, list(index["classes"]), (folder, split, slice(None)))


def _shard_problem(path: Path, rows: int, frame: tuple[int, int, int], encoding: str) -> str:
    """What is wrong with a shard file against index.json's row count ("" when nothing)."""
    if not path.exists():
        return "missing"
    if encoding != "jpeg":
        expected = rows * int(np.prod(frame))
        return "" if path.stat().st_size == expected else f"{path.stat().st_size} bytes, index.json says {expected}"
    sidecar = path.with_name(offsets_name(path.name))
    if not sidecar.exists() or sidecar.stat().st_size != (rows + 1) * OFFSET_DTYPE.itemsize:
        return f"its offsets {sidecar.name} are missing or not the {rows + 1} index.json implies"
    end = int(read_offsets(sidecar)[-1])
    return "" if path.stat().st_size == end else f"{path.stat().st_size} bytes, its offsets end at {end}"


def open_split(prepared_dir: Path, split: str, limit: int | None = None) -> PreparedSplit:
    """Open `split` of a prepared directory, pinned (`pin_store`); `limit` keeps the first N images."""
    prepared_dir = Path(prepared_dir)
    read_index(prepared_dir)  # a missing or outdated store: the error says what to run
    folder = pin_store(prepared_dir, reader_files)
    index = read_index(folder)
    frame = (index["size"], index["size"], index["channels"])
    for shard, path in zip(index["shards"], shard_paths(folder, index)):
        problem = _shard_problem(path, shard["rows"], frame, encoding_of(index))
        if problem:
            raise ValueError(f"{path}: {problem}; rerun `dvc repro prepare` (or `dvc checkout data/prepared`)")
    opened = _open(folder, split, index)
    if limit is None:
        return opened
    window = slice(0, limit)
    return PreparedSplit(opened.images[window], opened.labels[window], opened.classes, (folder, split, window))


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
    if encoding_of(index) != "raw":  # other pixels (a raw store's fingerprint is as it was before encodings)
        identity.update({key: index[key] for key in ("encoding", "quality", "codec")})
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def test_sources(prepared_dir: Path, n: int | None = None) -> list[str]:
    """Source paths of the test split's images in its order (the first `n`; None: all): what
    evaluate's predictions.csv lists and the gate checks it against."""
    return [meta["source"] for meta in itertools.islice(split_meta(in_folder(prepared_dir), "test"), n)]


def new_rows(prepared_dir: Path, split: str) -> np.ndarray | None:
    """Per image of the split, in its order, whether its bytes are new since the store before this one
    (this week's photos); None for a store written before prepare recorded it."""
    path = Path(prepared_dir) / f"{split}_new.npy"
    return np.load(path) if path.exists() else None


def suppliers(prepared_dir: Path, split: str) -> list[str | None]:
    """Each image's supplier (a manifest's `supplier` column) in the split's order, None where the
    source gives none: what a per-supplier report slices by."""
    return [meta.get("supplier") for meta in split_meta(in_folder(prepared_dir), split)]

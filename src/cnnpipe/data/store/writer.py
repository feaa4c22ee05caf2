"""Writing a prepared store: new images into new sealed shards, kept images by reference.

`StoreWriter` is what `prepare` writes through. `add` appends a new image to its split's open shard
(sealed when it holds `data.shard_mb`); `keep` points at a row of a shard of the previous store, which
is hard-linked into the new store unchanged (copied where links are not possible). At `close`, a
previous shard that is mostly dead (under half its rows still wanted) is compacted: its live rows
move into new shards and it is dropped. So an update writes the new images, at most one partly
filled shard per split, and the rare compaction, and reads no old pixels otherwise.

Each image's meta line goes through `meta.MetaWriter`: kept in the previous store's sealed meta
segments where it is unchanged, else appended to this store's new one; the per-split files point at
them. A JPEG store (`encoding="jpeg"`) writes each new image as one JPEG record (`codec.encode`) and
seals a shard at `data.shard_mb` of records, with its offsets sidecar; kept shards are linked with
their sidecars, and compaction moves records as bytes (nothing is decoded or encoded again).
"""

from __future__ import annotations

import array
import errno
import hashlib
import os
import shutil
from pathlib import Path
from typing import IO, Any

import numpy as np

from cnnpipe.data.store import codec
from cnnpipe.data.store.keys import stat_key
from cnnpipe.data.store.meta import STAT, MetaWriter, PathOf, segment_files
from cnnpipe.data.store.shards import FORMAT_VERSION, OFFSET_DTYPE, SHARDS, SPLITS, offsets_name, read_offsets
from cnnpipe.files import write_json

COMPACT_BELOW = 0.5
"""A previous shard with fewer live rows than this share is compacted."""


def rows_per_shard(shard_mb: float, frame_bytes: int) -> int:
    """Images in a full shard of `shard_mb` MiB (at least one)."""
    return max(1, int(shard_mb * 2**20) // frame_bytes)


def shard_bytes(shard_mb: float) -> int:
    """Bytes of records in a full JPEG shard of `shard_mb` MiB (at least one)."""
    return max(1, int(shard_mb * 2**20))


def first_serial(names: list[str], recorded: int = 0) -> int:
    """The serial of a store's next new shard: past every shard name it holds and any it recorded."""
    return max([recorded, *(int(name.split("-", 1)[0]) + 1 for name in names)])


def _link(path: Path, target: Path) -> None:
    """Hard-link `path` as `target` (a copy where links fail): its bytes, and DVC cache object, stay."""
    try:
        os.link(path, target)
    except OSError as exc:  # another filesystem, or links not allowed: the bytes are what matter
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        shutil.copyfile(path, target)


class _SplitRows:
    """What one split holds, as flat buffers (~60 bytes an image, at any catalog size): shard, row,
    label and sha256 of each image, and where its meta line is (`meta.MetaWriter`)."""

    def __init__(self) -> None:
        self.shard, self.row, self.label = array.array("i"), array.array("i"), array.array("q")
        self.digests = bytearray()
        self.meta_segment, self.meta_line = array.array("i"), array.array("i")

    def append(self, shard: int, row: int, label: int, digest: bytes, meta_at: tuple[int, int]) -> None:
        self.shard.append(shard)
        self.row.append(row)
        self.label.append(label)
        self.digests += digest
        self.meta_segment.append(meta_at[0])
        self.meta_line.append(meta_at[1])


class _OpenShard:
    """The shard a split is appending to: its file, number, rows and (JPEG) record offsets."""

    def __init__(self, fh: IO[bytes], number: int, path: Path) -> None:
        self.fh, self.number, self.path = fh, number, path
        self.offsets = array.array("Q", [0])

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1


class StoreWriter:
    """Write a store of (size, size, channels) images into `out_dir`, reusing `previous`'s shards;
    `encoding` is `raw` or `jpeg` (at `quality`)."""

    def __init__(self, out_dir: Path, size: int, channels: int, shard_mb: float, first_serial: int = 0,
                 encoding: str = "raw", quality: int = codec.DEFAULT_QUALITY) -> None:
        if encoding not in ("raw", "jpeg"):
            raise ValueError(f"StoreWriter: encoding={encoding!r}; allowed: raw | jpeg (resolve `auto` first)")
        self.out_dir, self.frame = Path(out_dir), (size, size, channels)
        self.encoding, self.quality = encoding, codec.check_quality(quality)
        self.frame_bytes = size * size * channels
        self.rows_per_shard = rows_per_shard(shard_mb, self.frame_bytes)
        self.shard_bytes = shard_bytes(shard_mb)
        (self.out_dir / SHARDS).mkdir(parents=True, exist_ok=True)
        # Serials only grow (index.json keeps the next one): a shard name, once used, never names other
        # bytes, so a reader that opened an old store by name never reads another store's pixels.
        self._next_serial = first_serial
        self.shards: list[tuple[str, Path]] = []  # (name, file) of every shard an image points at
        self._numbers: dict[str, int] = {}
        self._new: set[int] = set()
        self._sidecars: dict[int, Path] = {}  # a JPEG shard's number -> its offsets file
        self._open: dict[str, _OpenShard] = {}  # split -> the shard it appends to
        self.splits = {s: _SplitRows() for s in SPLITS}
        self.meta = MetaWriter(self.out_dir)
        self._stats, self._stat_digests = array.array("Q"), bytearray()
        self.written_bytes = 0

    def _number(self, name: str, path: Path) -> int:
        if name not in self._numbers:
            self._numbers[name] = len(self.shards)
            self.shards.append((name, path))
        return self._numbers[name]

    def _full(self, shard: _OpenShard | None, record: int) -> bool:
        if shard is None:
            return True
        if self.encoding == "raw":
            return shard.rows >= self.rows_per_shard
        return shard.rows > 0 and shard.offsets[-1] + record > self.shard_bytes

    def _seal(self, shard: _OpenShard) -> None:
        shard.fh.close()
        if self.encoding == "jpeg":
            sidecar = shard.path.with_name(offsets_name(shard.path.name))
            np.asarray(shard.offsets, dtype=OFFSET_DTYPE).tofile(sidecar)
            self._sidecars[shard.number] = sidecar

    def _append_record(self, split: str, record: bytes) -> tuple[int, int]:
        """Write one record (a raw frame or a JPEG) to `split`'s open shard, opening a new one when
        none is or it is full."""
        shard = self._open.get(split)
        if self._full(shard, len(record)):
            if shard is not None:
                self._seal(shard)
            name = f"{self._next_serial:06d}-{split}.{'jpg' if self.encoding == 'jpeg' else 'u8'}"
            self._next_serial += 1
            path = self.out_dir / SHARDS / name
            shard = self._open[split] = _OpenShard(open(path, "wb"), self._number(name, path), path)
            self._new.add(shard.number)
        shard.fh.write(record)
        shard.offsets.append(shard.offsets[-1] + len(record))
        self.written_bytes += len(record)
        return shard.number, shard.rows - 1

    def _append_pixels(self, split: str, image: np.ndarray) -> tuple[int, int]:
        record = codec.encode(image, self.quality) if self.encoding == "jpeg" else np.ascontiguousarray(image).tobytes()
        return self._append_record(split, record)

    def add(self, split: str, image: np.ndarray, label: int, digest: bytes, meta: dict[str, Any]) -> None:
        """Append a new (size, size, channels) uint8 image; `meta` is its meta line (`meta.split_meta`)."""
        if image.shape != self.frame or image.dtype != np.uint8:
            raise ValueError(f"{meta.get('source')}: got {image.shape} {image.dtype}, expected {self.frame} uint8")
        shard, row = self._append_pixels(split, image)
        self.splits[split].append(shard, row, label, digest, self._meta_at(digest, meta))

    def keep(self, split: str, name: str, shard: Path, row: int, label: int, digest: bytes,
             meta: dict[str, Any], fresh: int = 0, sidecar: Path | None = None) -> None:
        """Point at row `row` of a sealed shard `name` whose file is `shard` (and, of a JPEG store,
        whose offsets are `sidecar`): one of the previous store (in it or in the DVC cache), or a
        segment of this run's journal (`fresh`: the bytes of its frame or record, written by this run,
        which `last_update` counts); no pixels are read or written here."""
        number = self._number(name, shard)
        if sidecar is not None:
            self._sidecars[number] = sidecar
        self.splits[split].append(number, row, label, digest, self._meta_at(digest, meta))
        self.written_bytes += fresh

    def lend_meta(self, path_of: PathOf) -> None:
        """Keep the meta lines the previous store holds (its segments, `meta`) where they are unchanged."""
        self.meta.use_previous(path_of)

    def _meta_at(self, digest: bytes, meta: dict[str, Any]) -> tuple[int, int]:
        if "mtime_ns" in meta:  # an image file: its stat goes to this machine's stat cache, not the store
            self._stats.append(stat_key(meta["source"], meta.get("size", -1), meta["mtime_ns"]))
            self._stat_digests += digest
        return self.meta.pointer(meta, digest, self._meta_name)

    def stat_table(self) -> np.ndarray:
        """The stat cache of the images written (`meta.STAT`, sorted): save it with `meta.stat_cache`
        beside the store once it is in place."""
        table = np.zeros(len(self._stats), dtype=STAT)
        table["stat"] = np.frombuffer(self._stats, np.uint64)
        table["sha256"] = np.frombuffer(bytes(self._stat_digests), "S32")
        return table[np.argsort(table["stat"], kind="stable")]

    def _meta_name(self) -> str:
        self._next_serial += 1
        return f"{self._next_serial - 1:06d}"

    def fresh_name(self) -> str:
        """A new shard's name, for a journal segment this store takes as a shard (any split's images)."""
        self._next_serial += 1
        return f"{self._next_serial - 1:06d}-mixed.{'jpg' if self.encoding == 'jpeg' else 'u8'}"

    def _rows_in(self, number: int) -> int:
        """Rows (frames or records) shard `number` holds."""
        if self.encoding == "jpeg":
            return self._sidecars[number].stat().st_size // OFFSET_DTYPE.itemsize - 1
        return self.shards[number][1].stat().st_size // self.frame_bytes

    def _live_rows(self) -> np.ndarray:
        """How many rows of each shard some split points at."""
        return sum((np.bincount(np.frombuffer(rows.shard, dtype=np.int32), minlength=len(self.shards))
                    for rows in self.splits.values()), np.zeros(len(self.shards), dtype=np.int64))

    def _compact(self) -> dict[str, int]:
        """Move the live rows of mostly dead previous shards into new shards; returns what it did."""
        live = self._live_rows()
        dying = {s for s in range(len(self.shards))
                 if s not in self._new and live[s] < COMPACT_BELOW * self._rows_in(s)}
        moved, files = 0, {}
        offsets = {s: read_offsets(self._sidecars[s]) for s in dying} if self.encoding == "jpeg" else {}
        try:
            files.update({s: os.open(self.shards[s][1], os.O_RDONLY) for s in dying})
            for split, rows in self.splits.items():
                for i, shard in enumerate(rows.shard):
                    if shard in dying:  # the record's bytes as they are: nothing decoded or encoded again
                        row = rows.row[i]
                        start, stop = ((int(offsets[shard][row]), int(offsets[shard][row + 1])) if offsets
                                       else (row * self.frame_bytes, (row + 1) * self.frame_bytes))
                        record = os.pread(files[shard], stop - start, start)
                        rows.shard[i], rows.row[i] = self._append_record(split, record)
                        moved += 1
        finally:
            for fd in files.values():
                os.close(fd)
        return {"compacted_shards": len(dying), "moved_rows": moved}

    def _link_kept(self, used: np.ndarray) -> list[dict[str, Any]]:
        """Hard-link each previous shard still in use into the new store (a copy where links fail):
        its bytes, and so its DVC cache object, stay the same. Returns index.json's shard list."""
        listed = []
        for number in np.flatnonzero(used):
            name, path = self.shards[number]
            if number not in self._new:
                _link(path, self.out_dir / SHARDS / name)
                if self.encoding == "jpeg":
                    _link(self._sidecars[number], self.out_dir / SHARDS / offsets_name(name))
            listed.append({"name": name, "rows": self._rows_in(number), "live": int(used[number])})
        return listed

    def abort(self) -> None:
        """Close every file after a failure (the caller removes the half-written store)."""
        for shard in self._open.values():
            shard.fh.close()
        self.meta.seal()

    def close(self, classes: list[str], source: str, carved: list[str]) -> dict[str, Any]:
        """Compact, seal the open shards, write each split in content order and index.json."""
        compaction = self._compact()
        for shard in self._open.values():
            self._seal(shard)
        used = self._live_rows()
        renumber = np.cumsum(used > 0) - 1
        shards = self._link_kept(used)
        meta, meta_renumber = self._close_meta()
        splits = {}
        for split, rows in self.splits.items():
            splits[split] = self._write_split(split, rows, renumber, meta_renumber, len(classes))
        index = {"format": FORMAT_VERSION, "source": source, "carved": sorted(carved), "classes": classes,
                 "size": self.frame[0], "channels": self.frame[2], "rows_per_shard": self.rows_per_shard,
                 "shards": shards, "meta": meta, "next_serial": self._next_serial, "splits": splits,
                 "last_update": {**compaction, "written_bytes": self.written_bytes}}
        if self.encoding == "jpeg":  # a raw store's index stays as it was before encodings
            index.update({"encoding": "jpeg", "quality": self.quality, "codec": codec.CODEC,
                          "shard_bytes": self.shard_bytes})
            del index["rows_per_shard"]
        write_json(self.out_dir / "index.json", index)
        return index

    def _close_meta(self) -> tuple[list[dict[str, Any]], np.ndarray]:
        """Compact the previous store's mostly dead meta segments (their live lines move to the new
        one), seal the new segment and link each kept one into the store. Returns index.json's `meta`
        list and each segment's new number (-1: dropped)."""
        meta = self.meta
        def live() -> np.ndarray:
            return sum((np.bincount(np.frombuffer(rows.meta_segment, dtype=np.int32), minlength=len(meta.names))
                        for rows in self.splits.values()), np.zeros(len(meta.names), dtype=np.int64))
        counts = live()
        dying = {n for n in range(len(meta.names)) if not meta.is_new(n) and counts[n] < COMPACT_BELOW * meta.lines[n]}
        for rows in self.splits.values():
            for i, number in enumerate(rows.meta_segment):
                if number in dying:
                    line, digest, code = meta.line_of(number, rows.meta_line[i])
                    rows.meta_segment[i], rows.meta_line[i] = meta.append(line, digest, code, self._meta_name)
        meta.seal()
        counts = live()
        listed = []
        for number in np.flatnonzero(counts):
            if not meta.is_new(number):
                for path, rel in zip(meta.files[number], segment_files(meta.names[number])):
                    (self.out_dir / rel).parent.mkdir(exist_ok=True)
                    _link(path, self.out_dir / rel)
            listed.append({"name": meta.names[number], "lines": meta.lines[number], "live": int(counts[number])})
        return listed, np.cumsum(counts > 0) - 1

    def _write_split(self, split: str, rows: _SplitRows, renumber: np.ndarray, meta_renumber: np.ndarray,
                     num_classes: int) -> dict[str, Any]:
        """`<split>_rows.npy`, `_labels.npy` and `_meta.npy` in content order (sha256, then label)."""
        digests = np.frombuffer(bytes(rows.digests), dtype="S32")
        labels = np.frombuffer(rows.label, dtype=np.int64)
        order = np.lexsort((labels, digests))
        where = np.stack([renumber[np.frombuffer(rows.shard, dtype=np.int32)],
                          np.frombuffer(rows.row, dtype=np.int32)], axis=1).astype(np.int32)
        np.save(self.out_dir / f"{split}_rows.npy", where[order].reshape(-1, 2))
        np.save(self.out_dir / f"{split}_labels.npy", labels[order])
        meta_at = np.stack([meta_renumber[np.frombuffer(rows.meta_segment, dtype=np.int32)],
                            np.frombuffer(rows.meta_line, dtype=np.int32)], axis=1).astype(np.int32)
        np.save(self.out_dir / f"{split}_meta.npy", meta_at[order].reshape(-1, 2))
        fingerprint = hashlib.sha256(digests[order].tobytes() + labels[order].tobytes()).hexdigest()
        return {"count": len(order), "class_counts": np.bincount(labels, minlength=num_classes).tolist(),
                "fingerprint": fingerprint}

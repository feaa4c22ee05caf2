"""Reading a catalog's images once each, in parallel, restartably, copying what the last store has.

`prepare` asks `ingest` for every listed image's content hash and pixels. Three places can answer
before any decoding:

- the **previous store** (`PreviousStore`): an image with the same path, size and mtime as one it
  holds, or (after one read to hash it) the same sha256, is kept (or copied) from it, not decoded, as long as
  the store was made by the same decoding rules at the same size (`recipe`);
- the **journal** of an interrupted run (`Journal`, in `<store>.work/`): what it decoded is kept,
  so a killed `prepare` continues where it stopped;
- only the rest is read and decoded, each file read once, by `data.prepare_workers` processes, with
  a bounded number of images in flight.
"""

from __future__ import annotations

import array
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from cnnpipe.data.catalog import Entry
from cnnpipe.data.decode import TRANSFORM, decode_bytes, decode_file
from cnnpipe.data.store import FORMAT_VERSION, SPLITS, shard_paths

RECIPE_FILE = "recipe.json"
CHUNK = 16              # images per task: amortises the inter-process round trip
CHUNKS_PER_WORKER = 4   # tasks in flight per worker: bounds decoded images held in memory
CHANNELS = 3
SYNC_EVERY_S = 0.2      # the journal's fsyncs, at most this often (and every CHUNK files at most)


class PrepareInterrupted(RuntimeError):
    """A decoding worker died; what was decoded so far is kept for the next run."""


def recipe(size: int, max_pixels: int) -> dict[str, Any]:
    """What makes two stores' pixels interchangeable."""
    return {"transform": TRANSFORM, "size": size, "channels": CHANNELS, "max_pixels": max_pixels}


def usable_cores() -> int:
    """CPUs this process may run on (a container's or `taskset`'s limit, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def stat_key(path: str, size: int, mtime_ns: int) -> int:
    """64-bit key of a file's path, size and mtime: equal keys mean an unchanged file."""
    return int.from_bytes(hashlib.blake2b(f"{path}\0{size}\0{mtime_ns}".encode(), digest_size=8).digest(), "big")


def digest_at(digests: np.ndarray, i: int) -> bytes:
    """All 32 bytes of `digests[i]`: indexing an S32 array drops trailing zero bytes (1 hash in 256)."""
    return digests[i : i + 1].tobytes()


class HexDigests(Sequence[str]):
    """The hex sha256 of every row of an S32 array, made when asked for (a list of them would hold
    ~120 bytes a row)."""

    def __init__(self, digests: np.ndarray) -> None:
        self.digests = digests

    def __len__(self) -> int:
        return len(self.digests)

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        return digest_at(self.digests, range(len(self))[i]).hex()  # range: IndexError past the end


def read_store_meta(meta: Path, with_keys: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(sha256 as S32, `stat_key` as uint64, empty unless `with_keys`) of every row of a split's meta
    file, streamed into flat buffers: 40 bytes an image, where lists of bytes and ints take ~150."""
    digests, keys = bytearray(), array.array("Q")
    with open(meta, encoding="utf-8") as fh:
        for line in fh:
            item = json.loads(line)
            digests += bytes.fromhex(item["sha256"])
            if with_keys:
                keys.append(stat_key(item["source"], item.get("size", -1), item.get("mtime_ns", -1)))
    return np.frombuffer(bytes(digests), dtype="S32"), np.frombuffer(keys, dtype=np.uint64)


def _read_frame(fd: int, row: int, shape: tuple[int, int, int]) -> np.ndarray:
    frame = shape[0] * shape[1] * shape[2]
    data = os.pread(fd, frame, row * frame)
    if len(data) != frame:
        raise OSError(f"short read: row {row} of a {frame}-byte-per-image file")
    return np.frombuffer(data, dtype=np.uint8).reshape(shape)


def _prefix(digest: bytes) -> np.uint64:
    return np.frombuffer(digest[:8], dtype=">u8")[0].astype(np.uint64)


# --------------------------------------------------------------------------- the previous store
class PreviousStore:
    """The images of the store being replaced, found by content hash or by unchanged file stats, with
    the shard file and row that hold each (a store of the one-file-per-split format before shards
    counts each split's file as one shard, to be copied from rather than kept).

    Lookups are sorted numpy arrays (~50 bytes an image), not dicts: at 10M images a dict of hashes
    alone would take gigabytes.
    """

    def __init__(self, store: Path, wanted: dict[str, Any]) -> None:
        self.store = store
        usable = (store / RECIPE_FILE).exists() and json.loads((store / RECIPE_FILE).read_text()) == wanted
        index = json.loads((store / "index.json").read_text()) if usable and (store / "index.json").exists() else {}
        self.sealed = index.get("format") == FORMAT_VERSION
        self.files = shard_paths(store, index) if self.sealed else [store / f"{split}.u8" for split in SPLITS]
        empty = (np.zeros(0, dtype="S32"), np.zeros(0, dtype=np.uint64))
        parts, wheres = [], []
        for code, split in enumerate(SPLITS):
            meta = store / f"{split}_meta.jsonl"
            parts.append(read_store_meta(meta) if index and meta.exists() else empty)
            count = len(parts[-1][0])
            wheres.append(np.load(store / f"{split}_rows.npy") if self.sealed and count
                          else np.stack([np.full(count, code), np.arange(count)], axis=1).astype(np.int32))
        all_digests, all_keys = np.concatenate([d for d, _ in parts]), np.concatenate([k for _, k in parts])
        where = np.concatenate(wheres).reshape(-1, 2)
        order = np.argsort(all_digests, kind="stable")
        self.digests, self.where = all_digests[order], where[order]
        by_key = np.argsort(all_keys, kind="stable")
        self.keys, self.key_digests = all_keys[by_key], all_digests[by_key]
        self.shape = (wanted["size"], wanted["size"], wanted["channels"])
        self._files: dict[Path, int] = {}

    def __len__(self) -> int:
        return len(self.digests)

    def find(self, digest: bytes) -> tuple[Path, int] | None:
        """(shard file, row) holding the image with this sha256, or None."""
        i = int(np.searchsorted(self.digests, digest))
        if i < len(self.digests) and digest_at(self.digests, i) == digest:
            shard, row = self.where[i]
            return self.files[shard], int(row)
        return None

    def digest_of_unchanged(self, key: int) -> bytes | None:
        """The sha256 recorded for a file with this `stat_key`, or None."""
        i = int(np.searchsorted(self.keys, np.uint64(key)))
        return digest_at(self.key_digests, i) if i < len(self.keys) and self.keys[i] == key else None

    def pixels(self, shard: Path, row: int) -> np.ndarray:
        """One image, read with pread: a memory map would count the whole old store in our RSS."""
        if shard not in self._files:
            self._files[shard] = os.open(shard, os.O_RDONLY)
        return _read_frame(self._files[shard], row, self.shape)

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def write_prefixes(self, path: Path) -> Path | None:
        """The sorted 64-bit hash prefixes, for workers to skip decoding what will be copied."""
        if not len(self):
            return None
        prefixes = np.frombuffer(self.digests.tobytes(), dtype=">u8").reshape(-1, 4)[:, 0]
        np.save(path, np.unique(prefixes.astype(np.uint64)))
        return path


# --------------------------------------------------------------------------- the journal
class Journal:
    """Decoded pixels and one JSON line per finished file, appended as they come: the resume point.

    Pixels are appended at once; their lines wait until the pixels are fsynced (`sync`: after `CHUNK`
    files once `SYNC_EVERY_S` has passed, so at most a few fsyncs a second even on NFS, where one can
    take 20 ms), so a line on disk has its pixels on disk even after a power cut, which may keep a
    file's length but not its last blocks. A kill loses at most that much decoding.
    A reopened journal still drops any line whose pixels are not there (and everything after it)
    and cuts off pixels past the last line. What it holds is looked up in sorted arrays (`lookup`),
    48 bytes a file.
    """

    def __init__(self, work: Path, wanted: dict[str, Any]) -> None:
        self.work, self.frame = work, wanted["size"] * wanted["size"] * wanted["channels"]
        self.shape = (wanted["size"], wanted["size"], wanted["channels"])
        recipe_path = work / RECIPE_FILE
        if work.exists() and (not recipe_path.exists() or json.loads(recipe_path.read_text()) != wanted):
            shutil.rmtree(work)
        work.mkdir(parents=True, exist_ok=True)
        recipe_path.write_text(json.dumps(wanted))
        lines_path, pixels_path = work / "journal.jsonl", work / "decoded.u8"
        keys, digests, rows = array.array("Q"), bytearray(), array.array("q")
        reasons: dict[int, str] = {}  # line number -> why the file is unusable (a few)
        whole = 0  # bytes of the lines file up to the last complete line
        on_disk = pixels_path.stat().st_size // self.frame if pixels_path.exists() else 0  # whole frames
        if lines_path.exists():
            with open(lines_path, "rb") as fh:
                for line in fh:
                    try:
                        item = json.loads(line) if line.endswith(b"\n") else None
                    except json.JSONDecodeError:
                        item = None
                    if item is None:  # the last line of a killed run may be cut short
                        break
                    if item["row"] >= on_disk:  # its pixels were lost (a power cut): decode it again
                        break
                    whole += len(line)
                    if item["reason"] is not None:
                        reasons[len(keys)] = item["reason"]
                    keys.append(item["key"])
                    digests += bytes.fromhex(item["sha256"])
                    rows.append(item["row"])
        all_keys = np.frombuffer(keys, dtype=np.uint64)
        # A file journalled twice (its copy source vanished, so it was read again) counts as its last line.
        order = np.argsort(all_keys, kind="stable")
        last = np.ones(len(order), dtype=bool)
        last[:-1] = all_keys[order][1:] != all_keys[order][:-1]
        self._lines_of = order[last]
        self._keys = all_keys[self._lines_of]
        self._digests = np.frombuffer(bytes(digests), dtype="S32")
        self._rows = np.frombuffer(rows, dtype=np.int64)
        self._reasons = reasons
        self.rows = int(self._rows.max()) + 1 if len(self._rows) else 0
        # Cut a torn last line off (so new lines do not follow half of one) and the pixels past the
        # last line; truncating costs nothing at 10M lines, where rewriting the file would not.
        with open(lines_path, "ab") as fh:
            fh.truncate(whole)
        with open(pixels_path, "ab") as fh:
            fh.truncate(self.rows * self.frame)
        self._lines = open(lines_path, "a", encoding="utf-8")
        self._pixels = open(pixels_path, "ab")
        self._reader: int | None = None
        self._pending: list[str] = []  # lines whose pixels are not yet fsynced
        self._synced_at = time.monotonic()

    def __len__(self) -> int:
        """Files the journal held when it was opened."""
        return len(self._keys)

    def lookup(self, key: int) -> tuple[bytes, int, str | None] | None:
        """(sha256, pixel row or -1, reason when unusable) journalled for a file's `stat_key`, or None."""
        i = int(np.searchsorted(self._keys, np.uint64(key)))
        if i == len(self._keys) or self._keys[i] != key:
            return None
        line = int(self._lines_of[i])
        return digest_at(self._digests, line), int(self._rows[line]), self._reasons.get(line)

    def record(self, key: int, digest: bytes, image: np.ndarray | None, reason: str | None) -> int:
        """Keep one file's outcome; returns the pixel row (-1 when there are no new pixels)."""
        row = -1
        if image is not None:
            self._pixels.write(np.ascontiguousarray(image).tobytes())
            self._pixels.flush()  # readable by `pixels` at once; durable at the next `sync`
            row, self.rows = self.rows, self.rows + 1
        self._pending.append(json.dumps({"key": key, "sha256": digest.hex(), "row": row, "reason": reason}))
        if len(self._pending) >= CHUNK and time.monotonic() - self._synced_at >= SYNC_EVERY_S:
            self.sync()
        return row

    def sync(self) -> None:
        """Make the pixels durable, then write the lines that point at them."""
        self._pixels.flush()
        os.fsync(self._pixels.fileno())
        if self._pending:
            self._lines.write("\n".join(self._pending) + "\n")
            self._lines.flush()
            os.fsync(self._lines.fileno())
            self._pending.clear()
        self._synced_at = time.monotonic()

    def pixels(self, row: int) -> np.ndarray:
        """One decoded image back (pread, not a memory map: see `PreviousStore.pixels`)."""
        if self._reader is None:
            self._pixels.flush()
            self._reader = os.open(self.work / "decoded.u8", os.O_RDONLY)
        return _read_frame(self._reader, row, self.shape)

    def close(self) -> None:
        self.sync()
        self._lines.close()
        self._pixels.close()
        if self._reader is not None:
            os.close(self._reader)
            self._reader = None


# --------------------------------------------------------------------------- decoding workers
_KNOWN: dict[str, np.ndarray] = {}


def _is_known(digest: bytes, prefixes_file: str | None) -> bool:
    if prefixes_file is None:
        return False
    if prefixes_file not in _KNOWN:  # once per worker process
        _KNOWN[prefixes_file] = np.load(prefixes_file, mmap_mode="r")
    known = _KNOWN[prefixes_file]
    p = _prefix(digest)
    i = int(np.searchsorted(known, p))
    return i < len(known) and known[i] == p


def ingest_files(paths: Sequence[str], size: int, max_pixels: int,
                 prefixes_file: str | None) -> list[tuple[bytes, np.ndarray | None, str | None, bool]]:
    """Read each file once: (sha256, pixels or None, reason when unusable, known to the previous store).
    A file whose hash the previous store may hold is not decoded (its pixels get copied)."""
    out = []
    for path in paths:
        try:
            out.append(_ingest_file(path, size, max_pixels, prefixes_file))
        except Exception as exc:  # noqa: BLE001 - one odd file must not stop the catalog, nor lose its name
            out.append(_unusable(path, f"cannot be read: {type(exc).__name__}: {exc}"))
    return out


def _unusable(path: str, reason: str) -> tuple[bytes, None, str, bool]:
    """The outcome of a file whose bytes could not be had: keyed by the hash of its path."""
    return hashlib.sha256(os.fsencode(path)).digest(), None, reason, False


def _ingest_file(path: str, size: int, max_pixels: int,
                 prefixes_file: str | None) -> tuple[bytes, np.ndarray | None, str | None, bool]:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        return _unusable(path, f"unreadable: {exc.strerror or exc}")
    digest = hashlib.sha256(data).digest()
    if _is_known(digest, prefixes_file):
        return digest, None, None, True
    decoded = decode_bytes(data, path, size, max_pixels, digest=digest.hex())
    return digest, decoded.image, decoded.reason, False


def _chunks(items: Sequence[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


def run_pool(paths: Sequence[str], workers: int, size: int, max_pixels: int,
             prefixes_file: str | None) -> Iterator[tuple[int, tuple[bytes, np.ndarray | None, str | None, bool]]]:
    """(position, result) for every path, in order, from `workers` processes with at most
    `workers * CHUNKS_PER_WORKER` chunks in flight. A worker that dies (the OOM killer, a crash in a
    codec) raises `PrepareInterrupted` naming the files it may have been on, instead of hanging."""
    positions = range(len(paths))
    if workers <= 1 or len(paths) < 4 * CHUNK:
        for chunk in _chunks(positions, CHUNK):
            yield from zip(chunk, ingest_files([paths[i] for i in chunk], size, max_pixels, prefixes_file))
        return
    pending: deque[tuple[list[int], Future]] = deque()
    chunks = _chunks(positions, CHUNK)
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        try:
            while True:
                while len(pending) < workers * CHUNKS_PER_WORKER:
                    chunk = next(chunks, None)
                    if chunk is None:
                        break
                    pending.append((chunk, pool.submit(ingest_files, [paths[i] for i in chunk], size,
                                                       max_pixels, prefixes_file)))
                if not pending:
                    return
                chunk, future = pending.popleft()
                yield from zip(chunk, future.result())
        except BrokenProcessPool:
            suspects = [paths[i] for c, _ in [(chunk, None), *pending] for i in c][: workers * CHUNK]
            raise PrepareInterrupted(
                f"a decoding worker died (killed by the system, often for lack of memory, or crashed in "
                f"an image codec) while on one of these files: {', '.join(suspects[:8])}"
                f"{' ...' if len(suspects) > 8 else ''}. Nothing was written to the store; the images decoded "
                f"so far are kept, so rerunning `dvc repro prepare` continues from there. If memory is short, "
                f"lower data.prepare_workers or data.max_pixels") from None


# --------------------------------------------------------------------------- the whole ingest
class _Paths(Sequence[str]):
    """The full paths of the files to read, made when asked for: a list of them all would hold
    another ~130 bytes an image for the whole run."""

    def __init__(self, root: Path, entries: Sequence[Entry], todo: Sequence[int]) -> None:
        self.root, self.entries, self.todo = root, entries, todo

    def __len__(self) -> int:
        return len(self.todo)

    def __getitem__(self, position: int) -> str:  # type: ignore[override]
        return str(self.root / self.entries[self.todo[position]].path)


@dataclass
class Ingested:
    """Per listed image: sha256, where its pixels are ('new' row in the journal, 'previous' store),
    or why it is unusable; and how each was obtained."""

    digests: np.ndarray                     # (N,) S32
    rows: np.ndarray                        # (N,) journal row, or -1
    reasons: dict[int, str]                 # position -> why the image is unusable
    counts: dict[str, int] = field(default_factory=dict)


def ingest(listing_root: Path, entries: Sequence[Entry], workers: int, size: int, max_pixels: int,
           previous: PreviousStore, journal: Journal, progress: Any = None) -> Ingested:
    """Hash every entry and make its pixels available, reading and decoding as little as possible."""
    n = len(entries)
    digests = np.zeros(n, dtype="S32")
    rows = np.full(n, -1, dtype=np.int64)
    reasons: dict[int, str] = {}
    counts = {"unchanged": 0, "resumed": 0, "read": 0, "decoded": 0, "copied_after_read": 0}
    todo = array.array("q")
    keys = np.fromiter((stat_key(e.path, e.size, e.mtime_ns) for e in entries), dtype=np.uint64, count=n)
    for i in range(n):
        key = int(keys[i])  # not keys.tolist(): a Python int per image for the whole loop
        done = journal.lookup(key)
        if done is not None and (done[1] >= 0 or done[2] is not None or previous.find(done[0])):
            digests[i], rows[i] = done[0], done[1]
            if done[2] is not None:
                reasons[i] = done[2]
            counts["resumed"] += 1
            continue
        digest = previous.digest_of_unchanged(key)
        if digest is not None:
            digests[i] = digest
            counts["unchanged"] += 1
            continue
        todo.append(i)
    prefixes = previous.write_prefixes(journal.work / "known_prefixes.npy")
    paths = _Paths(listing_root, entries, todo)
    results = run_pool(paths, workers, size, max_pixels, str(prefixes) if prefixes else None)
    for position, (digest, image, reason, known) in (progress(results, total=len(todo)) if progress else results):
        i = todo[position]
        counts["read"] += 1
        if known and previous.find(digest) is None:  # a 64-bit prefix collision: decode it here
            decoded = decode_file(paths[position], size, max_pixels)
            image, reason, known = decoded.image, decoded.reason, False
        counts["copied_after_read"] += known
        counts["decoded"] += image is not None
        digests[i], rows[i] = digest, journal.record(int(keys[i]), digest, image, reason)
        if reason is not None:
            reasons[i] = reason
    return Ingested(digests, rows, reasons, counts)

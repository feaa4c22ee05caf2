"""Reading a catalog's images once each, in parallel, restartably, keeping what the last store has.

`prepare` asks `ingest` for every listed image's content hash and pixels. Three places can answer
before any decoding:

- the **previous store** (`previous.PreviousStore`): an image with the same path, size and mtime as
  one it holds, or (after one read to hash it) the same sha256, is kept (or copied) from it, not
  decoded, as long as the store was made by the same decoding rules, decoders and size (`recipe`);
- the **journal** of an interrupted run (`journal.Journal`, in `<store>.work/`): what it decoded, or
  found unusable, is kept, so a killed `prepare` continues where it stopped;
- only the rest is read and decoded, each file read once, by `data.prepare_workers` processes with a
  bounded number of images in flight (`workers.DecodePool`: a file that kills its decoder or runs
  past its time limit is listed, never a stall).
"""

from __future__ import annotations

import array
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from cnnpipe.data.ingest.decode import TRANSFORM, decode_file, decoder_versions
from cnnpipe.data.sources.entries import Entry
from cnnpipe.data.ingest.journal import Journal
from cnnpipe.data.store.keys import path_keys, stat_key
from cnnpipe.data.store.previous import PreviousStore
from cnnpipe.data.ingest.workers import FAILED_TWICE, DecodePool, unusable

CHANNELS = 3


def recipe(size: int, max_pixels: int) -> dict[str, Any]:
    """What makes two stores' pixels interchangeable: the rules, the size and the decoders' versions."""
    return {"transform": TRANSFORM, "size": size, "channels": CHANNELS, "max_pixels": max_pixels,
            "decoders": decoder_versions()}


def usable_cores() -> int:
    """CPUs this process may run on (a container's or `taskset`'s limit, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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
    """Per listed image: sha256, its pixel row in the journal (-1: none, kept from the previous store
    or unusable), why it is unusable; and how each was obtained."""

    digests: np.ndarray                     # (N,) S32
    rows: np.ndarray                        # (N,) `journal.where` of its decoded pixels, or -1
    reasons: dict[int, str]                 # position -> why the image is unusable
    counts: dict[str, int] = field(default_factory=dict)
    failed: list[tuple[int, str]] = field(default_factory=list)  # (stat_key, reason) of files that failed twice


def ingest(listing_root: Path, entries: Sequence[Entry], workers: int, size: int, max_pixels: int,
           previous: PreviousStore, journal: Journal, timeout_s: float, progress: Any = None) -> Ingested:
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
        digest, failed = previous.digest_of_unchanged(key), previous.failed(key)
        if failed is not None:  # it killed its decoder twice already: listed, not tried a third time
            digests[i], reasons[i] = unusable(entries[i].path, failed)[0], failed
            counts["unchanged"] += 1
            continue
        if digest is not None:
            digests[i] = digest
            counts["unchanged"] += 1
            continue
        todo.append(i)
    # Decoded in the order of a hash of their paths: the journal's segments, which become the new
    # shards, then hold a random mix of classes (a block shuffle reads a few shards at a time), and
    # the same catalog gives the same shards on any machine, with any number of workers.
    todo_keys = path_keys([entries[i].path for i in todo])
    todo = array.array("q", np.asarray(todo, dtype=np.int64)[np.argsort(todo_keys, kind="stable")].tolist())
    prefixes = previous.write_prefixes(journal.work / "known_prefixes.npy")
    paths = _Paths(listing_root, entries, todo)
    pool = DecodePool(workers, size, max_pixels, str(prefixes) if prefixes else None, timeout_s,
                      journal.quality if journal.encoded else None)  # a JPEG store's records, encoded there
    results = pool.run(paths)
    for position, (digest, image, reason, known) in (progress(results, total=len(todo)) if progress else results):
        i = todo[position]
        counts["read"] += 1
        if known and previous.find(digest) is None:  # a 64-bit prefix collision (1 in 2^64/N): decode it here
            decoded = decode_file(paths[position], size, max_pixels)
            image, reason, known = decoded.image, decoded.reason, False
        counts["copied_after_read"] += known
        counts["decoded"] += image is not None
        digests[i], rows[i] = digest, journal.record(int(keys[i]), digest, image, reason)
        if reason is not None:
            reasons[i] = reason
    return Ingested(digests, rows, reasons, counts,
                    [(int(keys[i]), r) for i, r in sorted(reasons.items()) if r.startswith(FAILED_TWICE)])

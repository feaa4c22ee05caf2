"""Fixed-size keys for images, files and paths: what every lookup of `prepare` sorts and searches.

At 10M images a dict or set of strings costs gigabytes; a sorted numpy array of 8- or 32-byte keys
costs 8-32 bytes an image and is searched with `np.searchsorted`.
"""

from __future__ import annotations

import hashlib
import os
from typing import Sequence

import numpy as np


def digest_at(digests: np.ndarray, i: int) -> bytes:
    """All 32 bytes of `digests[i]`: indexing an S32 array drops trailing zero bytes (1 hash in 256)."""
    return digests[i : i + 1].tobytes()


def stat_key(path: str, size: int, mtime_ns: int) -> int:
    """64-bit key of a file's path, size and mtime: equal keys mean an unchanged file."""
    return int.from_bytes(hashlib.blake2b(f"{path}\0{size}\0{mtime_ns}".encode(), digest_size=8).digest(), "big")


def path_key(path: str) -> int:
    """64-bit key of a source path (relative to the catalog's root), for lookups in sorted arrays."""
    return int.from_bytes(hashlib.blake2b(os.fsencode(path), digest_size=8).digest(), "big")


def path_keys(paths: Sequence[str]) -> np.ndarray:
    """`path_key` of every path, as uint64."""
    return np.fromiter((path_key(p) for p in paths), dtype=np.uint64, count=len(paths))


def find_sorted(table: np.ndarray, codes: np.ndarray, wanted: np.ndarray, missing: int = -1) -> np.ndarray:
    """For each of `wanted`, the `codes` entry of the equal key in the sorted `table`, else `missing`."""
    if not len(table):
        return np.full(len(wanted), missing, dtype=codes.dtype)
    i = np.minimum(np.searchsorted(table, wanted), len(table) - 1)
    return np.where(table[i] == wanted, codes[i], missing).astype(codes.dtype)


def last_of_runs(keys: np.ndarray) -> np.ndarray:
    """Positions that sort `keys` (stable) and keep the last item of each run of equal keys: with
    items in the order they were recorded, the latest record of each key."""
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    last = np.r_[ordered[1:] != ordered[:-1], True] if len(order) else np.zeros(0, dtype=bool)
    return order[last]


class HexDigests(Sequence[str]):
    """The hex sha256 of every row of an S32 array, made when asked for (a list of them would hold
    ~120 bytes a row)."""

    def __init__(self, digests: np.ndarray) -> None:
        self.digests = digests

    def __len__(self) -> int:
        return len(self.digests)

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        return digest_at(self.digests, range(len(self))[i]).hex()  # range: IndexError past the end

"""Benchmark: training batches from a store that is not in memory, full permutation against the
shard-local shuffle.

Writes a synthetic store (--gb of --size px images in 64 MiB shards, pixels random so nothing
compresses), then for each order: evicts every shard from the page cache (fsync, then
posix_fadvise DONTNEED: the state of a store larger than memory), and times --batches batches of
256 through the fast loader's gather (`_UInt8Batches`), one process. Prints images/s and the shards
each batch touched, per order, and removes the store unless --keep.

    python bench/shuffle_cold.py                      # 2 GB of 64 px images
    python bench/shuffle_cold.py --gb 4 --batches 400
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from cnnpipe.data.loaders.host import _UInt8Batches
from cnnpipe.data.loaders.sampling import ShardSampler, shuffle_plan
from cnnpipe.data.store.shards import open_split
from cnnpipe.data.store.writer import StoreWriter


def write_store(out: Path, images: int, size: int) -> None:
    writer = StoreWriter(out, size, 3, 64.0)
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, (1024, size, size, 3), dtype=np.uint8)
    for i in range(images):
        writer.add("train", block[i % 1024], i % 100, hashlib.sha256(str(i).encode()).digest(),
                   {"source": f"{i}.jpg", "sha256": ""})
    writer.close([str(c) for c in range(100)], "synthetic", carved=[])


def evict(store: Path) -> None:
    """Drop the store's pages from the page cache (clean pages only: fsync first)."""
    for path in (store / "shards").glob("*.u8"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def time_order(store: Path, shards: np.ndarray | None, window: int, batches: int) -> tuple[float, float]:
    """(images/s, mean shards a batch touches) of `batches` cold batches in this order."""
    split = open_split(store, "train")
    dataset = _UInt8Batches(split)
    sampler = ShardSampler(len(split), 256, shuffle=True, drop_last=True, seed=0, shards=shards, window=window)
    which = split.images.shard_of_each()
    evict(store)
    touched, start = [], time.perf_counter()
    for _, batch in zip(range(batches), sampler):
        dataset[batch]
        touched.append(len(np.unique(which[batch])))
    return batches * 256 / (time.perf_counter() - start), statistics.mean(touched)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--dir", type=Path, default=Path("bench_out/shuffle_cold"))
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    store = args.dir / "prepared"
    frame = args.size**2 * 3
    images = int(args.gb * 2**30 // frame)
    if not (store / "index.json").exists():
        shutil.rmtree(store, ignore_errors=True)
        start = time.perf_counter()
        write_store(store, images, args.size)
        print(f"store: {images:,} images of {args.size} px, {images * frame / 2**30:.1f} GiB "
              f"({time.perf_counter() - start:.0f} s to write)")
    split = open_split(store, "train")
    shards, window = shuffle_plan(split, 256, memory_bytes=1)  # as chosen for a split larger than memory
    print(f"{len(np.unique(shards))} shards; shard-local window: {window} shards")
    for name, order in (("full permutation", (None, 0)), ("shard-local", (shards, window)),
                        ("full permutation", (None, 0)), ("shard-local", (shards, window))):
        speed, touched = time_order(store, *order, args.batches)
        print(f"{name:<18} cold: {speed:>9,.0f} images/s, {touched:6.1f} shards a batch")
    if not args.keep:
        shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()

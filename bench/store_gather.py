"""Benchmark: what the sharded store costs the fast loader's gather, against one file per split.

The fast loader reads each batch as one gather of sorted positions (`_UInt8Batches`). This copies a
prepared training split three ways into a scratch folder: one memory-mapped file (the layout before
shards), the sharded store with the default 64 MiB shards, and with 1 MiB shards (dozens of them, so
nearly every batch spans many); then times random batches through each, one core, page cache warm.
Prints µs per batch (median of repeats) and the ratio to the single file.

    python bench/store_gather.py                         # data/prepared from `dvc repro prepare`
    python bench/store_gather.py --prepared DIR --batch-size 256 --batches 400
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from cnnpipe.data.loaders.host import _UInt8Batches
from cnnpipe.data.store.shards import PreparedSplit, open_split
from cnnpipe.data.store.writer import StoreWriter


def resharded(split: PreparedSplit, out: Path, shard_mb: float) -> PreparedSplit:
    """`split` written again as a store of `shard_mb` shards."""
    size, channels = split.images.shape[1], split.channels
    writer = StoreWriter(out, size, channels, shard_mb)
    for i in range(len(split)):
        digest = hashlib.sha256(i.to_bytes(8, "big")).digest()
        writer.add("train", np.asarray(split.images[i]), int(split.labels[i]), digest, {"source": str(i)})
    writer.close(split.classes, "bench", carved=[])
    return open_split(out, "train")


def us_per_batch(split: PreparedSplit, batch_size: int, batches: int, seed: int) -> float:
    dataset = _UInt8Batches(split)
    rng = np.random.default_rng(seed)
    draws = [rng.choice(len(split), batch_size, replace=False) for _ in range(batches)]
    dataset[draws[0]]  # warm-up: maps the shards
    start = time.perf_counter()
    for indices in draws:
        dataset[indices]
    return (time.perf_counter() - start) / batches * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepared", default="data/prepared")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    source = open_split(Path(args.prepared), "train")
    scratch = Path(tempfile.mkdtemp(prefix="store_gather_"))
    try:
        flat_path = scratch / "train.u8"
        np.asarray(source.images).tofile(flat_path)
        flat = PreparedSplit(np.memmap(flat_path, dtype=np.uint8, mode="r", shape=source.images.shape),
                             source.labels, source.classes)
        layouts = {"one file per split": flat,
                   "64 MiB shards": resharded(source, scratch / "s64", 64),
                   "1 MiB shards": resharded(source, scratch / "s1", 1)}
        print(f"{len(source)} images of {source.images.shape[1:]} uint8, batch {args.batch_size}, "
              f"{args.batches} batches x {args.repeats} repeats, 1 core")
        base = None
        for name, split in layouts.items():
            shards = len(getattr(split.images, "shards", [flat_path]))
            runs = [us_per_batch(split, args.batch_size, args.batches, seed) for seed in range(args.repeats)]
            median = statistics.median(runs)
            base = base or median
            print(f"{name:>20} ({shards:>3} file(s)): {median:8.0f} µs per batch  {median / base:5.2f}x  "
                  f"(runs: {', '.join(f'{r:.0f}' for r in runs)})")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

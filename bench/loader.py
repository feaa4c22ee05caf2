"""Benchmark: baseline (per-sample PIL + torchvision) vs fast (batched tensor) training loader.

Both run on one core (torch threads = 1, no workers) over the same prepared split and image size,
through everything the model's input needs: read, crop, flip, normalise. Prints samples/s per
core for each (median of repeats, after a warm-up batch) and the ratio.

    python bench/loader.py                          # data/prepared from `dvc repro prepare`
    python bench/loader.py --prepared DIR --batches 40 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from cnnpipe.data.loaders.host import build_train_loader
from cnnpipe.data.loaders.transforms import AugmentConfig
from cnnpipe.data.store.shards import open_split


def samples_per_second(kind: str, split, batch_size: int, batches: int, image_size: int) -> float:
    """Images/s through the whole input pipeline of `kind`, one warm-up batch excluded."""
    aug = AugmentConfig(image_size, scale=(0.35, 1.0))
    loader = build_train_loader(split, kind=kind, batch_size=batch_size, aug=aug, mean=(0.5,) * split.channels,
                                std=(0.25,) * split.channels, seed=0, channels_last=True)
    it = iter(loader)
    loader.device_transform(next(it)[0])  # warm-up
    start = time.perf_counter()
    n = 0
    for _ in range(batches):
        images, labels = next(it)
        x = loader.device_transform(images)
        n += x.shape[0]
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepared", default="data/prepared")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=None, help="default: the stored size")
    args = parser.parse_args()
    torch.set_num_threads(1)
    split = open_split(Path(args.prepared), "train")
    size = args.image_size or split.images.shape[1]
    print(f"{len(split)} images of {split.images.shape[1]}px x{split.channels}ch -> {size}px crops, "
          f"batch {args.batch_size}, {args.batches} batches x {args.repeats} repeats, 1 core")
    results = {}
    for kind in ("baseline", "fast"):
        runs = [samples_per_second(kind, split, args.batch_size, args.batches, size) for _ in range(args.repeats)]
        results[kind] = statistics.median(runs)
        print(f"{kind:>9}: {results[kind]:>9.0f} img/s per core (runs: {', '.join(f'{r:.0f}' for r in runs)})")
    print(f"    ratio: {results['fast'] / results['baseline']:.1f}x")


if __name__ == "__main__":
    main()

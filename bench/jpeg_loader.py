"""Benchmark: a fast-loader epoch from a JPEG store against one from a raw store of the same photos.

The photos are `store_encoding.py`'s (real photographs shipped by installed packages, or `--photos`),
cut into squares at each `--sizes`, repeated to `--images`, and written into two stores through
`writer.StoreWriter` (raw, and JPEG at `--quality`; 64 MiB shards as the default params). Each epoch
is the training loader of `train.loader: fast` (shuffled batches of `--batch-size`, uint8 NHWC) with
`--workers` DataLoader workers, so a JPEG store's batches are decoded in those workers; the device
transform is left out: this times what the store costs, not the model's input. Prints images/s per
epoch (median and range of `--epochs`, after one warm-up epoch) and JPEG against raw, with the
store's bytes per image. The machine is shared: run it twice, and trust what agrees.

`--train N` times training instead: N steps of ResNet-50 (timm, random init) fed by that loader, its
device transform (random-resized crop, flip, normalise at the stored size), channels_last, bf16
autocast and SGD, after two warm-up steps, the raw and the JPEG store in alternating rounds
(`--rounds`): training img/s from each, and JPEG against raw. `--device cuda` trains on the GPU
(`bench/gpu_checks.sh`); `--decode cpu device` adds a third feed, the JPEG store's batches decoded
by nvJPEG on the device (`data.loaders.device`).

    python bench/jpeg_loader.py                                # 64 and 128 px, 0 and 2 workers
    python bench/jpeg_loader.py --sizes 128 --workers 2 --images 8192
    python bench/jpeg_loader.py --sizes 128 --workers 1 --train 6 --batch-size 64 --images 2048
    python bench/jpeg_loader.py --sizes 224 --workers 8 --train 30 --device cuda --decode cpu device
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from cnnpipe.data.ingest.decode import to_rgb
from cnnpipe.data.loaders.device import build_device_decoded_loader
from cnnpipe.data.loaders.host import build_train_loader
from cnnpipe.data.loaders.transforms import AugmentConfig
from cnnpipe.data.store.shards import open_split
from cnnpipe.data.store.writer import StoreWriter

sys.path.insert(0, str(Path(__file__).parent))
from store_encoding import find_photos, photo_set  # noqa: E402  (a sibling bench script)


def write_store(out: Path, images: np.ndarray, encoding: str, quality: int) -> int:
    """A store of `images` (all in train, ten labels) in `encoding`; returns its shard bytes."""
    writer = StoreWriter(out, images.shape[1], images.shape[3], 64, encoding=encoding, quality=quality)
    for i, image in enumerate(images):
        digest = i.to_bytes(32, "big")
        writer.add("train", image, i % 10, digest, {"source": f"photo-{i}", "sha256": digest.hex()})
    writer.close([f"class{c}" for c in range(10)], "bench", carved=[])
    return sum(p.stat().st_size for p in (out / "shards").iterdir())


def epoch_rates(store: Path, batch_size: int, workers: int, epochs: int) -> list[float]:
    """Images/s of each of `epochs` loader epochs (after a warm-up epoch, which starts the workers)."""
    split = open_split(store, "train")
    loader = build_train_loader(split, kind="fast", batch_size=batch_size, aug=AugmentConfig(split.images.shape[1]),
                                mean=(0.5,) * 3, std=(0.25,) * 3, seed=0, num_workers=workers)
    rates = []
    for epoch in range(epochs + 1):
        loader.set_epoch(epoch)
        start, n = time.perf_counter(), 0
        for images, _ in loader:
            n += len(images)
        if epoch:
            rates.append(n / (time.perf_counter() - start))
    return rates


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # the clock reads after the queued work, not before it
        torch.cuda.synchronize()


def train_rate(store: Path, batch_size: int, workers: int, steps: int, device: torch.device,
               decode: str = "cpu") -> float:
    """Training img/s of ResNet-50 fed from `store` over `steps` steps, after two warm-up steps;
    `decode` `device`: a JPEG store's batches decoded on `device`."""
    import timm

    torch.manual_seed(0)
    split = open_split(store, "train")
    build = build_device_decoded_loader if decode == "device" else partial(build_train_loader, kind="fast")
    loader = build(split, batch_size=batch_size, aug=AugmentConfig(split.images.shape[1]), mean=(0.5,) * 3,
                   std=(0.25,) * 3, seed=0, num_workers=workers, channels_last=True, pin_memory=device.type == "cuda")
    model = timm.create_model("resnet50", num_classes=10).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = iter(loader)
    start, seen = 0.0, 0
    for step in range(steps + 2):
        if step == 2:
            _sync(device)
            start = time.perf_counter()
        images, labels = next(batches)
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(loader.device_transform(images)), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        seen += len(labels) if step >= 2 else 0
    _sync(device)
    return seen / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--images", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--photos", type=Path, default=None)
    parser.add_argument("--train", type=int, default=0, help="time this many training steps instead of epochs")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--decode", nargs="+", choices=("cpu", "device"), default=["cpu"],
                        help="where a JPEG store's batches are decoded in --train (several: each is timed)")
    args = parser.parse_args()
    torch.set_num_threads(1 if not args.train else torch.get_num_threads())
    photos = [to_rgb(Image.open(p)) for p in find_photos(args.photos)]
    if not photos:
        print("no photos: pass --photos DIR or install the `bench` extra (scikit-image)")
        return 1
    timed = f"{args.train} steps x {args.rounds} rounds" if args.train else f"{args.epochs} epochs"
    print(f"{len(photos)} photos, {args.images} images per store, batch {args.batch_size}, "
          f"{timed} after a warm-up, quality {args.quality}")
    if not args.train:
        print("| stored size | workers | raw img/s | JPEG img/s | JPEG / raw | bytes/image raw | JPEG |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory(prefix="jpeg_loader-") as tmp:
        for size in args.sizes:
            squares = photo_set(photos, size, 3)
            images = squares[np.arange(args.images) % len(squares)]
            stores = {enc: Path(tmp) / f"{enc}-{size}" for enc in ("raw", "jpeg")}
            sizes = {enc: write_store(path, images, enc, args.quality) for enc, path in stores.items()}
            if args.train:
                device = torch.device(args.device)
                feeds = [("raw", "cpu")] + [("jpeg", where) for where in args.decode]
                for workers in args.workers:
                    got: dict[tuple[str, str], list[float]] = {feed: [] for feed in feeds}
                    for _ in range(args.rounds):
                        for enc, where in feeds:
                            got[(enc, where)].append(train_rate(stores[enc], args.batch_size, workers, args.train,
                                                                device, where))
                    raw = statistics.median(got[("raw", "cpu")])
                    print(f"training on {device}, {size} px, {workers} workers, {torch.get_num_threads()} threads: "
                          + "; ".join(f"{enc}{'' if enc == 'raw' else f' (decoded on the {where})'} "
                                      f"{statistics.median(r):.1f} img/s ({', '.join(f'{x:.1f}' for x in r)}), "
                                      f"{statistics.median(r) / raw:.3f}x raw" for (enc, where), r in got.items()),
                          flush=True)
                continue
            for workers in args.workers:
                got = {enc: epoch_rates(path, args.batch_size, workers, args.epochs) for enc, path in stores.items()}
                med = {enc: statistics.median(r) for enc, r in got.items()}
                span = {enc: f"{min(r):,.0f}-{max(r):,.0f}" for enc, r in got.items()}
                print(f"| {size} px | {workers} | {med['raw']:,.0f} ({span['raw']}) "
                      f"| {med['jpeg']:,.0f} ({span['jpeg']}) "
                      f"| {med['jpeg'] / med['raw']:.2f} | {sizes['raw'] / args.images:,.0f} "
                      f"| {sizes['jpeg'] / args.images:,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: the profile stage of both recipes on a device without the real data set.

For a lent GPU machine (no apt, no network): writes a synthetic Fashion-MNIST-shaped IDX set, prepares
it at `--size`, then runs `profile_variant` for each variant on `--device`, and writes the JSON files,
tuned values and report.md next to each other under `--out`, as the profile stage would.

    python bench/device_profile.py --device cuda --out $OUT/profile
    python bench/device_profile.py --device cpu --train-images 2000 --size 32 --out /tmp/p   # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from cnnpipe.data.sources import idx
from cnnpipe.data.prepare import prepare_fashion_mnist
from cnnpipe.params import load_params, resolve
from cnnpipe.profile.box import TimeBox
from cnnpipe.profile.report import write_report
from cnnpipe.profile.run import profile_variant, save_profile, summary
from cnnpipe.train.distributed import DistInfo


def synthetic_idx(out: Path, train: int, test: int) -> Path:
    """Noise images with a label-dependent bright square: learnable, and shaped like Fashion-MNIST."""
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("test", test)):
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        images = rng.integers(0, 60, size=(n, 28, 28), dtype=np.uint8)
        for i, label in enumerate(labels):
            r, c = divmod(int(label), 5)
            images[i, 2 + r * 12: 10 + r * 12, 1 + c * 5: 6 + c * 5] = 220
        idx.write_split(out, split, images, labels)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--size", type=int, default=64, help="stored image size (and the model's, by default)")
    parser.add_argument("--image-size", default=None, help="the model's input size, or `auto` (default: --size)")
    parser.add_argument("--train-images", type=int, default=20000)
    parser.add_argument("--variants", nargs="+", default=["baseline", "optimized"])
    parser.add_argument("--out", type=Path, default=Path("bench_out/device_profile"))
    parser.add_argument("--work", type=Path, default=None, help="data and traces (default: OUT/work, OUT/logs)")
    parser.add_argument("--time-box", type=float, default=None,
                        help="each profile's time box in seconds, as profile.budget_share gives it (default: none)")
    parser.add_argument("--prepare-workers", type=int, default=None)
    parser.add_argument("--encoding", choices=("raw", "jpeg", "auto"), default=None,
                        help="the store's data.encoding (default: the params'; `auto` stores 224 px grayscale as JPEG)")
    args = parser.parse_args()
    work = args.work or args.out / "work"
    raw = synthetic_idx(work / "raw", args.train_images, max(1000, args.train_images // 10))
    params = load_params(args.params)
    info = DistInfo(device=torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu"))
    prepared = work / "prepared"
    for variant in args.variants:
        cfg = resolve(params, variant)
        image_size = args.size if args.image_size is None else (
            args.image_size if args.image_size == "auto" else int(args.image_size))
        data = dataclasses.replace(cfg.data, image_size=image_size, stored_size=args.size,
                                   prepare_workers=args.prepare_workers or cfg.data.prepare_workers,
                                   encoding=args.encoding or cfg.data.encoding)
        cfg = dataclasses.replace(cfg, data=data)
        cfg = cfg.with_train(device=args.device)
        if not (prepared / "index.json").exists():
            prepared.mkdir(parents=True, exist_ok=True)
            prepare_fashion_mnist(cfg.data, cfg.seed, prepared, search_dirs=(raw,))
        t0 = time.perf_counter()
        box = None if args.time_box is None else TimeBox(time.monotonic() + args.time_box)  # as if the stage started now
        result = profile_variant(cfg, info, prepared, work / "logs" / variant, True, args.time_box, box=box)
        result["stage_time_s"] = time.perf_counter() - t0
        save_profile(result, args.out)
        print(summary(result), flush=True)
    print(f"report: {write_report(args.out, args.variants)}")


if __name__ == "__main__":
    main()

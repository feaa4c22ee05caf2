"""Benchmark: inference images/s of a timm model at each batch size, in fp32 and bf16.

The profile times inference at evaluation's batch (256) when its box has room, else at a halved one;
the plan predicts evaluate, validation and export from that speed. Whether a halved batch's speed
stands for batch 256 depends on the image size and the CPU: this measures it, eval mode, no autograd,
the recipes' layouts (fp32 contiguous, as export and the baseline run; bf16 autocast channels_last, as
the optimized recipe evaluates). Each cell is the median of three timed rounds of about `--images`
images after one untimed call.

    python bench/inference_batch.py                      # ResNet-50 at 128 and 32 px, ~7 min on 2 cores
    python bench/inference_batch.py --sizes 224 --batches 8 16 32
"""

from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch


def images_per_second(model: torch.nn.Module, batch: int, size: int, bf16: bool, images: int) -> float:
    """Median images/s over three rounds of forward passes of `batch` random images at `size` px."""
    x = torch.randn(batch, 3, size, size)
    if bf16:
        x = x.to(memory_format=torch.channels_last)
    calls = max(1, images // batch)
    rounds = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        model(x)  # untimed: oneDNN picks and caches its kernels for this shape
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(calls):
                model(x)
            rounds.append(calls * batch / (time.perf_counter() - t0))
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 32])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--images", type=int, default=512, help="images per timed round at 128 px (scaled by size)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.model}, {args.threads} threads; images/s (and against batch {args.batches[-1]})")
    print(f"| size | precision | {' | '.join(f'batch {b}' for b in args.batches)} |")
    print(f"| --- | --- | {' | '.join('---:' for _ in args.batches)} |")
    for size in args.sizes:
        images = args.images * max(1, 128 // size)  # small images: more of them for a round of similar length
        for bf16 in (False, True):
            model = timm.create_model(args.model, num_classes=10).eval()
            if bf16:
                model = model.to(memory_format=torch.channels_last)
            speeds = [images_per_second(model, b, size, bf16, images) for b in args.batches]
            cells = " | ".join(f"{s:.0f} ({s / speeds[-1]:.2f}x)" for s in speeds)
            print(f"| {size} px | {'bf16 channels_last' if bf16 else 'fp32'} | {cells} |", flush=True)


if __name__ == "__main__":
    main()

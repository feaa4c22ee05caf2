"""Benchmark: inference images/s of a timm model at each batch size, in fp32 and bf16.

The profile times inference at evaluation's batch (256) when its box has room, else at a halved one,
and validation and evaluate then run at that batch (budget.yaml `eval_batch`). How much a batch's speed
differs from 256's depends on the image size and the CPU: this measures it, eval mode, no autograd,
the recipes' layouts (fp32 contiguous, as export and the baseline run; bf16 autocast channels_last, as
the optimized recipe evaluates), timed as the profile times it (`engine.forward_times`: one untimed
call, then the median of at least three timed calls, about `--images` images in all).

    python bench/inference_batch.py                      # ResNet-50 at 128 and 32 px, ~3 min on 2 cores
    python bench/inference_batch.py --sizes 224 --batches 8 16 32
"""

from __future__ import annotations

import argparse
import statistics

import timm
import torch

from cnnpipe.train.engine import forward_times


def images_per_second(model: torch.nn.Module, batch: int, size: int, bf16: bool, images: int) -> float:
    """`batch` over the median call of `engine.forward_times` (the profile's own inference timing), with
    enough calls for about `images` images and at least three."""
    times = forward_times(model, 3, size, bf16, "bf16" if bf16 else "off", torch.device("cpu"), batch=batch,
                          calls=max(3, images // batch))
    return batch / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 32])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--images", type=int, default=512, help="images timed per cell at 128 px (more at smaller sizes)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.model}, {args.threads} threads; images/s (and against batch {args.batches[-1]})")
    print(f"| size | precision | {' | '.join(f'batch {b}' for b in args.batches)} |")
    print(f"| --- | --- | {' | '.join('---:' for _ in args.batches)} |")
    for size in args.sizes:
        images = args.images * max(1, 128 // size)  # small images: more of them, for cells of similar length
        for bf16 in (False, True):
            model = timm.create_model(args.model, num_classes=10).eval()
            if bf16:
                model = model.to(memory_format=torch.channels_last)
            speeds = [images_per_second(model, b, size, bf16, images) for b in args.batches]
            cells = " | ".join(f"{s:.0f} ({s / speeds[-1]:.2f}x)" for s in speeds)
            print(f"| {size} px | {'bf16 channels_last' if bf16 else 'fp32'} | {cells} |", flush=True)


if __name__ == "__main__":
    main()

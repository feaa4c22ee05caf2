"""Benchmark: a training step with glibc's defaults against `train.malloc: keep`, in fresh processes.

Each run is its own process (the allocator's state is the process's), in turns (system, keep,
system, keep, ...: the VM's speed drifts within minutes, each round's ratio is taken between
neighbours). A run trains ResNet-50 (random weights: the speed does not depend on them) on random
images for `--steps` steps after `--warmup`, with SGD and momentum, and reports the median step's
images/s, its minor page faults, the kernel's share of the process's CPU time and the peak RSS.
Each run also times inference (`engine.forward_times`, as the profile and evaluate do; the median of
10 calls) at `--infer-batch` twice: first thing in the fresh process, and after its training steps,
where the profile times it: the second table sets them side by side.

    python bench/malloc.py                          # 32 and 128 px, batch 64 and 256, fp32 and bf16
    python bench/malloc.py --size 128 --batch 64 --rounds 3 --precision bf16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

SETTINGS = {"fp32": ("off", False), "bf16": ("bf16", True)}
"""--precision: (autocast, channels_last), as the baseline and the optimized recipe run them."""


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(mode: str, size: int, batch: int, precision: str, steps: int, warmup: int, infer_batch: int) -> dict:
    """One run in this process: the allocator set first, an inference timing, the steps, the timing again."""
    import timm
    import torch

    from cnnpipe.malloc import KernelTime, usage, use_malloc
    from cnnpipe.train.engine import forward_times

    use_malloc(mode)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    amp, channels_last = SETTINGS[precision]
    torch.manual_seed(0)
    model = timm.create_model("resnet50", num_classes=10)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def inference() -> float:
        times = forward_times(model, 3, size, channels_last, amp, torch.device("cpu"), batch=infer_batch, calls=10)
        return infer_batch / statistics.median(times)

    fresh = inference()
    rates, faults, kernel = [], [], []
    for i in range(warmup + steps):
        start, t0 = usage(), time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16"):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds, used = time.perf_counter() - t0, KernelTime.since(start)
        if i >= warmup:
            rates.append(batch / seconds)
            faults.append(used.faults)
            kernel.append(used.kernel_frac)
    return {"img_s": statistics.median(rates), "faults": statistics.median(faults),
            "kernel_frac": statistics.median(kernel), "peak_rss_mb": peak_rss_mb(),
            "infer_fresh": fresh, "infer_trained": inference()}


def run(mode: str, size: int, batch: int, precision: str, args: argparse.Namespace) -> dict:
    """One child process's results (`child`)."""
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--size", str(size), "--batch", str(batch),
                          "--precision", precision, "--steps", str(args.steps), "--warmup", str(args.warmup),
                          "--infer-batch", str(args.infer_batch)], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--precision", nargs="+", choices=sorted(SETTINGS), default=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--infer-batch", type=int, default=16, help="the inference timing's batch")
    parser.add_argument("--child", choices=("system", "keep"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.size[0], args.batch[0], args.precision[0], args.steps, args.warmup,
                               args.infer_batch)))
        return 0
    inference_rows = []
    print("| size | batch | precision | system img/s | keep img/s | keep/system (range) | page faults a step "
          "(system / keep) | kernel's CPU share | peak RSS MB |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in args.size:
        for batch in args.batch:
            for precision in args.precision:
                runs: dict[str, list[dict]] = {"system": [], "keep": []}
                for r in range(args.rounds):
                    for mode in ("system", "keep") if r % 2 == 0 else ("keep", "system"):
                        runs[mode].append(run(mode, size, batch, precision, args))
                ratios = [k["img_s"] / s["img_s"] for s, k in zip(runs["system"], runs["keep"])]

                def med(mode: str, key: str) -> float:
                    return statistics.median(r[key] for r in runs[mode])

                print(f"| {size} | {batch} | {precision} | {med('system', 'img_s'):.1f} | {med('keep', 'img_s'):.1f} | "
                      f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | "
                      f"{med('system', 'faults'):,.0f} / {med('keep', 'faults'):,.0f} | "
                      f"{med('system', 'kernel_frac'):.0%} / {med('keep', 'kernel_frac'):.0%} | "
                      f"{med('system', 'peak_rss_mb'):,.0f} / {med('keep', 'peak_rss_mb'):,.0f} |", flush=True)
                cold = [r["infer_fresh"] / r["infer_trained"] for r in runs["system"]]
                kept = [r["infer_fresh"] / s["infer_trained"] for s, r in zip(runs["system"], runs["keep"])]
                inference_rows.append(
                    f"| {size} | {batch} | {precision} | {med('system', 'infer_trained'):.1f} | "
                    f"{med('system', 'infer_fresh'):.1f} ({statistics.median(cold):.2f}x) | "
                    f"{med('keep', 'infer_fresh'):.1f} ({statistics.median(kept):.2f}x) |")
    print(f"\nInference at batch {args.infer_batch}, img/s: after the training steps (where the profile times it), "
          "and first thing in a fresh process (where evaluate and export run), against the first")
    print("| size | training batch | precision | system, after training | system, fresh | keep, fresh |")
    print("| ---: | ---: | --- | ---: | ---: | ---: |")
    print("\n".join(inference_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

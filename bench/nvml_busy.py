"""Benchmark: the GPU's busy share by NVML over un-profiled training steps, beside the profile's own figure.

The profile's busy share is kernel time per recorded step over the un-profiled step time
(`profile/measure.py: trace_window`). This checks it against the driver: NVML's utilisation
(the share of each sample period in which a kernel ran), sampled every 20 ms over `--steps`
un-profiled steps of a recipe with the profile's tuned values, after `--warmup` steps (compile,
autotuning and the allocator out of the window). Prints both, the step time and the host time
per step the step's own code spends (two steps queued from an empty queue, never waiting for the GPU).

    python bench/nvml_busy.py --prepared $WORK/prepared --profile $WORK/profile/optimized.json
    python bench/nvml_busy.py --device cpu --prepared /tmp/p/work/prepared --steps 5   # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from cnnpipe.data.store.shards import open_split
from cnnpipe.monitor import GpuUtilSampler
from cnnpipe.params import load_params, resolve
from cnnpipe.profile.measure import build_setup, train_step
from cnnpipe.train.distributed import DistInfo
from cnnpipe.train.engine import sync_device
from cnnpipe.train.tuning import resolve_auto


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--variant", default="optimized")
    parser.add_argument("--prepared", type=Path, required=True)
    parser.add_argument("--profile", type=Path, default=None, help="the variant's profile JSON (tuned values, busy)")
    parser.add_argument("--size", default=None, help="the model's input size (default: the profile's)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--interval", type=float, default=0.02)
    args = parser.parse_args()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    profile = json.loads(args.profile.read_text()) if args.profile and args.profile.exists() else {}
    cfg = resolve(load_params(args.params), args.variant).with_train(device=args.device)
    size = args.size or profile.get("image_size")
    if size:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, image_size=int(size)))
    tuned = {k: v for k, v in profile.get("tuned", {}).items() if k != "at_batch"}
    cfg = resolve_auto(cfg, device, tuned)
    s = build_setup(cfg, DistInfo(device=device), open_split(args.prepared, "train"))
    for _ in range(args.warmup):
        train_step(s)
    sync_device(device)
    sampler = GpuUtilSampler(device, interval_s=args.interval)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        train_step(s)
    sync_device(device)
    wall = time.perf_counter() - t0
    nvml = sampler.stop()
    host = []  # the host's own time: two steps queued from an empty queue (they fit in CUDA's queue)
    for _ in range(10):
        sync_device(device)
        h0 = time.perf_counter()
        train_step(s)
        train_step(s)
        host.append((time.perf_counter() - h0) / 2)
    sync_device(device)
    step_s = wall / args.steps
    out = {"variant": args.variant, "device": str(device), "image_size": cfg.data.image_size,
           "batch": s.images_per_step, "amp": s.ctx.amp, "compile": cfg.train.compile, "steps": args.steps,
           "step_s": step_s, "img_s": s.images_per_step / step_s,
           "host_us_per_step_median": statistics.median(host) * 1e6,
           "nvml_busy_pct": nvml, "nvml_samples": len(sampler.samples),
           "profile_busy_pct": None if profile.get("gpu_busy_frac") is None else 100 * profile["gpu_busy_frac"],
           "profile_busy_basis": profile.get("gpu_busy_basis")}
    print(json.dumps(out, indent=1))

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.0f}%"

    print(f"busy: NVML {pct(nvml)} over {args.steps} un-profiled steps; profile {pct(out['profile_busy_pct'])}; "
          f"{out['img_s']:.0f} img/s; host {out['host_us_per_step_median']:.0f} us per step")


if __name__ == "__main__":
    main()

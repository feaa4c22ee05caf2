"""Benchmark: which batch a budget-shortened run should train at (the evidence behind train.min_steps).

A tight time budget draws few images per epoch, so a recipe's run has few optimizer steps. This
trains each (fraction of the training split per epoch, batch) cell with the pipeline's own `fit`,
the profile's tuned values applied as `dvc repro` would, and the batch forced (min_steps off), and
prints best validation top-1, optimizer steps and training img/s per cell. The baseline recipe at
its own batch is one more row per fraction.

    python bench/short_runs.py                                   # 3/32, 1/8, 1/4 x batch 256, 128, 64
    python bench/short_runs.py --fractions 3/32 --batches 256 128 --no-baseline

~2 min per cell at 3/32 on a 2-core AVX512-BF16 Xeon, ~4 min at 1/4. Writes bench_out/short_runs.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
from fractions import Fraction
from pathlib import Path

import torch

from cnnpipe.data.store.shards import read_index
from cnnpipe.hardware import cpu_report
from cnnpipe.params import load_params, resolve
from cnnpipe.plan.plan import images_for
from cnnpipe.train.distributed import init_distributed
from cnnpipe.train.trainer import fit
from cnnpipe.train.tuning import read_tuned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--data", type=Path, default=Path("data/prepared"))
    parser.add_argument("--tuned", type=Path, default=Path("metrics/profile"), help="holds <variant>_tuned.yaml")
    parser.add_argument("--fractions", nargs="+", default=["3/32", "1/8", "1/4"])
    parser.add_argument("--batches", nargs="+", type=int, default=[256, 128, 64])
    parser.add_argument("--no-baseline", action="store_true", help="skip the baseline row of each fraction")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    raw = load_params(args.params)
    info = init_distributed("auto")
    n_train = read_index(args.data)["splits"]["train"]["count"]
    cells = []
    for text in args.fractions:
        images = images_for(float(Fraction(text)), n_train, max(args.batches))
        runs = [("optimized", b) for b in args.batches] + ([] if args.no_baseline else [("baseline", None)])
        for variant, batch in runs:
            cfg = resolve(raw, variant)
            cfg = cfg.with_train(epochs=cfg.train.epoch_count, images_per_epoch=images, min_steps=None,
                                 batch_size=batch or cfg.train.batch_size)
            work = args.out / "short_runs" / variant
            shutil.rmtree(work, ignore_errors=True)  # a fresh run, never a resume
            print(f"{text} of the split ({images} images/epoch), {variant} at batch {cfg.train.batch_size}", flush=True)
            summary = fit(cfg, info, args.data, work / "models", work / "train.json", work / "live",
                          tuned=read_tuned(args.tuned / f"{variant}_tuned.yaml"))
            shutil.rmtree(work, ignore_errors=True)
            cells.append({"fraction": text, "images_per_epoch": images, "variant": variant,
                          "global_batch": summary["global_batch"], "optimizer_steps": summary["optimizer_steps"],
                          "best_val_top1": summary["best_val_top1"], "throughput_img_s": summary["throughput_img_s"]})
    cpu = cpu_report()
    print(f"\n{cpu['model']}, {torch.get_num_threads()} threads, flags {' '.join(cpu['features'])}")
    print(f"{'fraction':<9} {'recipe':<10} {'batch':>5} {'steps':>6} {'val top-1':>10} {'img/s':>7}")
    for c in cells:
        print(f"{c['fraction']:<9} {c['variant']:<10} {c['global_batch']:>5} {c['optimizer_steps']:>6} "
              f"{c['best_val_top1']:>10.2%} {c['throughput_img_s']:>7.0f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "short_runs.json").write_text(json.dumps({"cpu": cpu, "cells": cells}, indent=2) + "\n")


if __name__ == "__main__":
    main()

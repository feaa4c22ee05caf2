"""Benchmark: on a small catalog, what more epochs buy each recipe, against one run's luck.

bench/epochs_auto.py compares one `dvc repro` with `train.epochs: auto` against one with 4 epochs:
McNemar's test there says whether those two models differ on the test images, not whether another
seed would have turned the difference around. This trains each recipe for each count in `--epochs`
with each seed in `--seeds` (`seed`: initialisation, augmentation and batch order; the split stays
put) on one prepared store, with the pipeline's own `fit` (the `auto` knobs at their defaults, as a
profile without trials leaves them) and `evaluate` (best.pt: the best validation epoch). Prints each
arm's test top-1 per seed, its mean and spread, and each seed's paired difference.

    python bench/epochs_seeds.py --set photos212 --epochs 4 16 --seeds 0 1 2 --threads 1
    python bench/epochs_seeds.py --set fmnist500 --epochs 4 12

Writes bench_out/epochs_seeds.json; removes its store and runs unless `--dir` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from cnnpipe.data.prepare import prepare
from cnnpipe.evaluate.evaluation import evaluate
from cnnpipe.hardware import cpu_report
from cnnpipe.params import load_params, resolve
from cnnpipe.train.distributed import DistInfo
from cnnpipe.train.trainer import fit
from epochs_auto import FMNIST_SETS, PHOTO_SETS, ROOT, make_photo_set


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default="photos212", choices=[*PHOTO_SETS, *FMNIST_SETS])
    parser.add_argument("--epochs", nargs="+", type=int, default=[4, 16])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--size", type=int, default=32, help="stored and trained size (px)")
    parser.add_argument("--threads", type=int, default=None, help="train.threads (default: one per usable core)")
    parser.add_argument("--dir", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="epochs_seeds_"))
    raw = load_params(ROOT / "params.yaml")
    results: dict[str, dict[int, dict[int, float]]] = {}
    try:
        store, data = prepared(work, args, raw)
        for seed in args.seeds:
            for variant in ("baseline", "optimized"):
                for epochs in args.epochs:
                    cfg = resolve(raw, variant)
                    cfg = dataclasses.replace(cfg, seed=seed, data=data).with_train(epochs=epochs, threads=args.threads)
                    run = work / "run"
                    shutil.rmtree(run, ignore_errors=True)  # a fresh run, never a resume
                    print(f"{args.set}: {variant}, {epochs} epochs, seed {seed}", flush=True)
                    fit(cfg, DistInfo(), store, run / "models", run / "train.json", run / "live")
                    top1 = evaluate(run / "models", store, run / "eval", torch.device("cpu"))["top1"]
                    results.setdefault(variant, {}).setdefault(epochs, {})[seed] = top1
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    report(results, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "epochs_seeds.json").write_text(json.dumps(
        {"cpu": cpu_report(), "set": args.set, "size": args.size, "threads": args.threads, "results": results},
        indent=2))
    return 0


def prepared(work: Path, args: argparse.Namespace, raw: dict):
    """(the prepared store, the data config it was made with) for `args.set`."""
    data = resolve(raw, "optimized").data
    if args.set in PHOTO_SETS:
        make_photo_set(work / "photos", *PHOTO_SETS[args.set])
        data = dataclasses.replace(data, source=str(work / "photos"), stored_size=args.size, image_size=args.size)
    else:
        train, evaluation = FMNIST_SETS[args.set]
        data = dataclasses.replace(data, max_train_images=train, max_eval_images=evaluation)
    prepare(data, raw.get("seed", 0), work / "prepared", work / "data_report.json")
    return work / "prepared", data


def report(results: dict[str, dict[int, dict[int, float]]], args: argparse.Namespace) -> None:
    """Each arm's test top-1 per seed, mean and spread; each seed's paired difference."""
    cpu = cpu_report()
    print(f"\n{cpu['model']}, {cpu['usable_cores']} usable cores, train.threads {args.threads}; {args.set} "
          f"at {args.size} px; test top-1 of best.pt")
    print("| recipe | epochs | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean (sd) |")
    print("| --- | ---: | " + " | ".join("---:" for _ in args.seeds) + " | ---: |")
    for variant, arms in results.items():
        for epochs, by_seed in arms.items():
            values = [by_seed[s] for s in args.seeds]
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            print(f"| {variant} | {epochs} | " + " | ".join(f"{100 * v:.1f}%" for v in values)
                  + f" | {100 * statistics.mean(values):.1f}% ({100 * sd:.1f}) |")
    low, *more = args.epochs
    for variant, arms in results.items():
        for epochs in more:
            gains = [arms[epochs][s] - arms[low][s] for s in args.seeds]
            print(f"{variant}: {epochs} - {low} epochs per seed: " + ", ".join(f"{100 * g:+.1f}" for g in gains)
                  + f" points (mean {100 * statistics.mean(gains):+.1f})")


if __name__ == "__main__":
    sys.exit(main())

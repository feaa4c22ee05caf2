"""Benchmark: wall time for each recipe to reach a target test top-1 on the prepared data.

Trains each variant of params.yaml (the profile's tuned values applied, as `dvc repro` would) with
the pipeline's own `fit`, evaluates test top-1 after every epoch (outside the timed epoch), and
reports the cumulative training time at the first epoch that reaches `--target`. Each run is a
full recipe: its LR schedule spans `--epochs`, so an early epoch of a cosine run is measured
mid-schedule (a pessimistic reading for it).

    python bench/time_to_accuracy.py --target 0.88 --epochs 4            # after `dvc repro prepare profile`
    python bench/time_to_accuracy.py --variants optimized --epochs 2 --images-per-epoch 13824

Prints a table and writes bench_out/time_to_accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from cnnpipe.config import RunConfig, load_params, resolve
from cnnpipe.data.loaders import build_eval_loader
from cnnpipe.data.store import open_split
from cnnpipe.distributed import init_distributed
from cnnpipe.engine import evaluate_top1
from cnnpipe.evaluation import make_transform
from cnnpipe.hardware import cpu_report
from cnnpipe.models import model_mean_std
from cnnpipe.precision import resolve_amp
from cnnpipe.trainer import fit
from cnnpipe.tuning import read_tuned, resolve_auto


def test_hook(prepared: Path, info, cfg: RunConfig):
    """An epoch hook returning test top-1 under evaluation's own transform and precision."""
    split = open_split(prepared, "test")
    loader = build_eval_loader(split, batch_size=256)
    amp = resolve_amp(cfg.train.amp, info.device)

    def hook(model: torch.nn.Module) -> dict[str, float]:
        t0 = time.perf_counter()
        mean, std = model_mean_std(model, split.channels)
        meta = {"image_size": cfg.data.image_size, "mean": mean, "std": std, "channels_last": cfg.train.channels_last}
        top1 = evaluate_top1(model, loader, make_transform(meta), info, amp)["top1"]
        return {"test_top1": top1, "test_eval_s": time.perf_counter() - t0}

    return hook


def time_to_target(history: list[dict], target: float) -> tuple[float | None, int | None]:
    """(cumulative training seconds, epoch) at the first epoch whose test top-1 reaches `target`."""
    elapsed = 0.0
    for record in history:
        elapsed += record["epoch_time_s"]
        if record["test_top1"] >= target:
            return elapsed, record["epoch"]
    return None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--data", type=Path, default=Path("data/prepared"))
    parser.add_argument("--tuned", type=Path, default=Path("metrics/profile"), help="holds <variant>_tuned.yaml")
    parser.add_argument("--variants", nargs="+", default=["baseline", "optimized"])
    parser.add_argument("--target", type=float, default=0.88)
    parser.add_argument("--epochs", type=int, help="override train.epochs (the schedule's length)")
    parser.add_argument("--images-per-epoch", type=int, help="override train.images_per_epoch")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    raw = load_params(args.params)
    info = init_distributed("auto")
    results = {}
    for variant in args.variants:
        cfg = resolve(raw, variant)
        changes = {k: v for k, v in (("epochs", args.epochs), ("images_per_epoch", args.images_per_epoch)) if v}
        cfg = cfg.with_train(**changes)
        work = args.out / "tta" / variant
        shutil.rmtree(work, ignore_errors=True)  # a fresh run, never a resume
        tuned = read_tuned(args.tuned / f"{variant}_tuned.yaml")
        hook = test_hook(args.data, info, resolve_auto(cfg, info.device, tuned))  # what fit will run
        summary = fit(cfg, info, args.data, work / "models", work / "train.json", work / "live", tuned=tuned,
                      epoch_hook=hook)
        seconds, epoch = time_to_target(summary["history"], args.target)
        results[variant] = {"seconds_to_target": seconds, "epoch_reached": epoch,
                            "test_top1": [h["test_top1"] for h in summary["history"]],
                            "epoch_time_s": [h["epoch_time_s"] for h in summary["history"]],
                            "images_per_epoch": cfg.train.images_per_epoch, "epochs": cfg.train.epochs,
                            "throughput_img_s": summary["throughput_img_s"]}
    print(f"\ntarget test top-1 {args.target:.1%} ({cpu_report()['model']}, {torch.get_num_threads()} threads)")
    print(f"{'recipe':<10} {'epochs':>6} {'img/s':>6} {'test top-1 per epoch':<34} {'time to target':>15}")
    for variant, r in results.items():
        curve = " ".join(f"{t:.3f}" for t in r["test_top1"])
        reached = f"{r['seconds_to_target']:.0f} s (ep {r['epoch_reached']})" if r["seconds_to_target"] else "not reached"
        print(f"{variant:<10} {r['epochs']:>6} {r['throughput_img_s']:>6.0f} {curve:<34} {reached:>15}")
    if {"baseline", "optimized"} <= set(results):
        b, o = results["baseline"]["seconds_to_target"], results["optimized"]["seconds_to_target"]
        ratio = o / b if b and o else None
        results["optimized_over_baseline"] = ratio
        print("optimized / baseline time to target: " + (f"{ratio:.2f}" if ratio else "n/a (a recipe missed it)"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "time_to_accuracy.json").write_text(json.dumps({"target": args.target, "cpu": cpu_report(),
                                                                 "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()

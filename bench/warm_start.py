"""Benchmark: a warm start from last week's champion against a fresh start, on Fashion-MNIST in "weeks".

Week 0 is the catalog at 80% of the training split (the content-stable cap: each class's lowest
hashes), week 1 the whole split; validation and test are the same in both. The optimized recipe
trains the champion on week 0 from its usual start (`pretrained: auto`), then two challengers on
week 1 with the same recipe, images per epoch and epochs: one from the champion's weights
(`model.init: champion`), one from the usual start. Prints, per challenger, the validation top-1
per epoch, the training time until it first reaches the champion's best validation top-1, and its
final test top-1. Writes bench_out/warm_start.json.

    python bench/warm_start.py                                  # 4 epochs of 10,000 images each
    python bench/warm_start.py --epochs 6 --images-per-epoch 20000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import torch
import yaml

from cnnpipe.data.prepare import prepare
from cnnpipe.evaluate.evaluation import evaluate
from cnnpipe.params import data_config, load_params, resolve
from cnnpipe.train.distributed import DistInfo
from cnnpipe.train.trainer import fit


def time_to_reach(history: list[dict], target: float) -> float | None:
    """Training seconds until the first epoch whose validation top-1 reaches `target`."""
    spent = 0.0
    for record in history:
        spent += record["epoch_time_s"]
        if record["val_top1"] >= target:
            return spent
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--images-per-epoch", type=int, default=10_000)
    parser.add_argument("--week0-share", type=float, default=0.8)
    parser.add_argument("--dir", type=Path, default=Path("bench_out/warm_start"))
    parser.add_argument("--tuned", type=Path, default=Path("metrics/profile/optimized_tuned.yaml"),
                        help="the profile's tuned values for the optimized recipe (default: this machine's)")
    args = parser.parse_args()
    raw = load_params("params.yaml")
    base = data_config(raw)
    stores = {}
    for week, share in (("week0", args.week0_share), ("week1", None)):
        stores[week] = args.dir / week / "prepared"
        cap = None if share is None else int(share * 53_967)  # the 60k minus validation, at the default seed
        prepare(dataclasses.replace(base, max_train_images=cap), raw.get("seed", 0), stores[week],
                args.dir / week / "report.json")
    tuned = yaml.safe_load(args.tuned.read_text()) if args.tuned.exists() else None
    cfg = resolve(raw, "optimized").with_train(epochs=args.epochs, images_per_epoch=args.images_per_epoch)
    runs = {}
    plan = (("champion", "week0", "pretrained", None), ("warm", "week1", "champion", "champion"),
            ("fresh", "week1", "pretrained", None))
    for name, week, init, champion in plan:
        out = args.dir / name
        shutil.rmtree(out, ignore_errors=True)
        run_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init=init))
        summary = fit(run_cfg, DistInfo(), stores[week], out / "model", out / "train.json", out / "live", tuned=tuned,
                      champion=args.dir / champion / "model" if champion else None)
        test = evaluate(out / "model", stores[week], out / "eval", torch.device("cpu"))
        runs[name] = {"init": summary["init"], "val_top1": [h["val_top1"] for h in summary["history"]],
                      "epoch_time_s": [h["epoch_time_s"] for h in summary["history"]],
                      "train_time_s": summary["train_time_s"], "test_top1": test["top1"]}
    target = max(runs["champion"]["val_top1"])
    print(f"\nweek 0: {args.week0_share:.0%} of the split; week 1: all of it; {args.epochs} epochs x "
          f"{args.images_per_epoch} images; champion's best val top-1 {target:.4f}, test {runs['champion']['test_top1']:.4f}")
    print(f"{'challenger':<11}{'val top-1 per epoch':<40}{'s to reach the champion':>25}{'test top-1':>12}")
    for name in ("warm", "fresh"):
        reached = time_to_reach([{"val_top1": v, "epoch_time_s": t} for v, t in
                                 zip(runs[name]["val_top1"], runs[name]["epoch_time_s"])], target)
        runs[name]["seconds_to_champion"] = reached
        curve = " ".join(f"{v:.3f}" for v in runs[name]["val_top1"])
        shown = "never" if reached is None else f"{reached:.0f}"
        print(f"{name:<11}{curve:<40}{shown:>25}{runs[name]['test_top1']:>12.4f}")
    (args.dir.parent / "warm_start.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                               "target_val_top1": target, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()

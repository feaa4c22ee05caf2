"""Benchmark: wall time for each recipe to reach a target test top-1 on the prepared data.

Trains each variant of params.yaml, the profile's tuned values applied as `dvc repro` would, with
the pipeline's own `fit`, evaluates test top-1 after every epoch, and stops a recipe at the first
epoch that reaches `--target`. The time reported is wall time from the start of `fit` to the end
of that epoch (model build, training, per-epoch validation and checkpoints: what a user waits
for), minus the benchmark's own test evaluations. Each run is a whole recipe: its LR schedule spans
`--epochs`, so stopping a cosine run at its target is what that recipe costs to get there.

`--max-minutes` caps each recipe (checked at epoch ends); one that misses the target within it is
reported as "not reached after T s", which still bounds the ratio: optimized / baseline < t_opt / T.

    python bench/time_to_accuracy.py --target 0.88                          # after `dvc repro`
    python bench/time_to_accuracy.py --epochs optimized=4 baseline=8 --cap-ratio 2.2

Prints a table and writes bench_out/time_to_accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from cnnpipe.config import VariantConfig
from cnnpipe.data.loaders.host import build_eval_loader
from cnnpipe.data.store.shards import open_split
from cnnpipe.hardware import cpu_report
from cnnpipe.models import model_mean_std
from cnnpipe.params import load_params, resolve
from cnnpipe.train.distributed import DistInfo, init_distributed
from cnnpipe.train.engine import evaluate_top1
from cnnpipe.train.precision import resolve_amp
from cnnpipe.train.trained import make_transform
from cnnpipe.train.trainer import fit
from cnnpipe.train.tuning import read_tuned, resolve_auto


class Stop(Exception):
    """Raised from the epoch hook: the target was reached, or the time cap passed."""


class Top1Tracker:
    """Evaluates test top-1 after each epoch with evaluation's transform and precision; keeps the
    wall-clock curve (its own evaluation time excluded) and stops the run at the target or the cap."""

    def __init__(self, prepared: Path, info: DistInfo, cfg: VariantConfig, target: float, cap_s: float | None) -> None:
        self.split = open_split(prepared, "test")
        self.loader = build_eval_loader(self.split, batch_size=256)
        self.info, self.cfg, self.target, self.cap_s = info, cfg, target, cap_s
        self.amp = resolve_amp(cfg.train.amp, info.device)
        self.curve: list[dict[str, float]] = []
        self.t0, self.own_s = time.perf_counter(), 0.0

    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        wall = time.perf_counter() - self.t0 - self.own_s
        t_eval = time.perf_counter()
        mean, std = model_mean_std(model, self.split.channels)
        meta = {"image_size": self.cfg.data.image_size, "mean": mean, "std": std,
                "channels_last": self.cfg.train.channels_last}
        top1 = evaluate_top1(model, self.loader, make_transform(meta), self.info, self.amp)["top1"]
        self.own_s += time.perf_counter() - t_eval
        self.curve.append({"epoch": len(self.curve) + 1, "wall_s": wall, "test_top1": top1})
        print(f"  epoch {len(self.curve)}: test top-1 {top1:.4f} after {wall:.0f} s", flush=True)
        if top1 >= self.target:
            raise Stop("target reached")
        if self.cap_s is not None and wall >= self.cap_s:
            raise Stop("time cap")
        return {"test_top1": top1}


def parse_epochs(values: list[str] | None) -> dict[str, int]:
    """`--epochs 6` (every variant) or `--epochs optimized=4 baseline=8`."""
    out: dict[str, int] = {}
    for value in values or []:
        name, _, count = value.rpartition("=")
        out[name or "*"] = int(count)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--data", type=Path, default=Path("data/prepared"))
    parser.add_argument("--tuned", type=Path, default=Path("metrics/profile"), help="holds <variant>_tuned.yaml")
    parser.add_argument("--variants", nargs="+", default=["optimized", "baseline"])
    parser.add_argument("--target", type=float, default=0.88)
    parser.add_argument("--epochs", nargs="+", help="schedule length: N, or VARIANT=N per variant")
    parser.add_argument("--images-per-epoch", type=int, help="override train.images_per_epoch (default: all)")
    parser.add_argument("--max-minutes", type=float, help="stop a recipe that has not reached the target by then")
    parser.add_argument("--cap-ratio", type=float,
                        help="cap every later recipe at this multiple of the first one's time to target "
                             "(e.g. 2.0 answers 'does the second take at least twice as long?' for less)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    raw, epochs = load_params(args.params), parse_epochs(args.epochs)
    info = init_distributed("auto")
    results: dict[str, dict] = {}
    for variant in args.variants:
        cfg = resolve(raw, variant)
        count = epochs.get(variant, epochs.get("*", cfg.train.epoch_count))
        cfg = cfg.with_train(epochs=count, images_per_epoch=args.images_per_epoch)
        tuned = read_tuned(args.tuned / f"{variant}_tuned.yaml")
        work = args.out / "tta" / variant
        shutil.rmtree(work, ignore_errors=True)  # a fresh run, never a resume
        print(f"{variant}: up to {count} epochs, target test top-1 {args.target:.1%}", flush=True)
        caps = [args.max_minutes * 60] if args.max_minutes else []
        first = next(iter(results.values()), None)
        if args.cap_ratio and first and first["seconds_to_target"]:
            caps.append(args.cap_ratio * first["seconds_to_target"])
        hook = Top1Tracker(args.data, info, resolve_auto(cfg, info.device, tuned), args.target,
                           min(caps) if caps else None)
        try:
            fit(cfg, info, args.data, work / "models", work / "train.json", work / "live", tuned=tuned,
                epoch_hook=hook)
        except Stop:
            pass
        reached = hook.curve[-1] if hook.curve and hook.curve[-1]["test_top1"] >= args.target else None
        results[variant] = {"epochs_scheduled": count, "curve": hook.curve,
                            "seconds_to_target": reached["wall_s"] if reached else None,
                            "epoch_reached": reached["epoch"] if reached else None,
                            "seconds_run": hook.curve[-1]["wall_s"] if hook.curve else 0.0}
        shutil.rmtree(work, ignore_errors=True)  # 280 MB of checkpoints per recipe
    cpu = cpu_report()
    print(f"\ntarget: test top-1 >= {args.target:.1%}; {cpu['model']}, {torch.get_num_threads()} threads, "
          f"flags {' '.join(cpu['features'])}")
    print(f"{'recipe':<10} {'test top-1 per epoch':<40} {'time to target':>22}")
    for variant, r in results.items():
        curve = " ".join(f"{c['test_top1']:.4f}" for c in r["curve"])
        when = (f"{r['seconds_to_target']:.0f} s (epoch {r['epoch_reached']})" if r["seconds_to_target"]
                else f"not reached after {r['seconds_run']:.0f} s")
        print(f"{variant:<10} {curve:<40} {when:>22}")
    if {"baseline", "optimized"} <= set(results):
        opt, base = results["optimized"], results["baseline"]
        if opt["seconds_to_target"] and base["seconds_to_target"]:
            ratio = opt["seconds_to_target"] / base["seconds_to_target"]
            print(f"optimized / baseline time to target: {ratio:.2f}")
        elif opt["seconds_to_target"]:
            ratio = opt["seconds_to_target"] / base["seconds_run"]
            print(f"optimized / baseline time to target: < {ratio:.2f} (the baseline missed it)")
        else:
            ratio = None
            print("optimized / baseline time to target: n/a (the optimized recipe missed it)")
        results["optimized_over_baseline"] = ratio
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "time_to_accuracy.json").write_text(json.dumps({"target": args.target, "cpu": cpu,
                                                                 "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()

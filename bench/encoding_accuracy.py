"""Benchmark: does a JPEG store train as accurate a model as the raw store of the same images?

Copies the project next to a work folder, prepares Fashion-MNIST as a raw store, then changes
`data.encoding` to `jpeg` and prepares again, which converts the store from its own pixels: the
same images, in the same order and splits. The optimized recipe then trains on each store with the
same seed, the same tuned settings (this checkout's `metrics/profile/optimized_tuned.yaml`, or the
defaults) and the same epochs and images per epoch, and each model is evaluated on its store's
test split. Prints each store's bytes, training img/s and test top-1 (Wilson 95%), and the paired
difference JPEG - raw on the same test images: Newcombe's 95% interval and McNemar's exact p. JPEG
is as accurate as raw when that interval holds 0 and raw's top-1 interval holds JPEG's top-1.
Writes bench_out/encoding_accuracy.json.

Fashion-MNIST at 32 px is the hard case for JPEG: the images are tiny, grayscale and made of
edges, so its artefacts are a larger part of each image than in a 160 px product photo.

    python bench/encoding_accuracy.py                        # 4 epochs of 13,312 images, ~20 min on 2 cores
    python bench/encoding_accuracy.py --epochs 2 --images-per-epoch 4096   # a quick look
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from cnnpipe.evaluate.stats import wilson_interval
from cnnpipe.hardware import cpu_report
from cnnpipe.release.stats import mcnemar_p, newcombe_interval, paired_counts

sys.path.insert(0, str(Path(__file__).parent))
from project_copy import ROOT, copy_project  # noqa: E402  (a sibling bench script)

ENCODINGS = ("raw", "jpeg")


def make_project(project: Path, args: argparse.Namespace) -> None:
    """A copy of the project's code and params, set for a fixed-length run with no budget."""
    copy_project(project)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["run"]["budget_minutes"] = None
    params["seed"] = args.seed
    params["data"].update(encoding="raw", quality=args.quality, stored_size=args.stored_size)
    params["train"].update(epochs=args.epochs, images_per_epoch=args.images_per_epoch, val_images=args.val_images)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    tuned = ROOT / "metrics" / "profile" / "optimized_tuned.yaml"
    (project / "tuned.yaml").write_text(tuned.read_text() if tuned.exists() else "{}\n")


def set_encoding(project: Path, encoding: str) -> None:
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["data"]["encoding"] = encoding
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def run(cmd: list[str], cwd: Path) -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, *cmd], cwd=cwd, check=True)
    return time.monotonic() - t0


def prepare_both(project: Path) -> dict[str, Path]:
    """The raw store, then the JPEG store converted from it (the raw one kept aside)."""
    prepare = ["stages/prepare.py", "--out", "data/prepared", "--ledger", "data/split_ledger",
               "--report", "metrics/data_report.json"]
    run(prepare, project)
    stores = {"raw": project / "stores" / "raw", "jpeg": project / "stores" / "jpeg"}
    stores["raw"].parent.mkdir(exist_ok=True)
    shutil.copytree(project / "data" / "prepared", stores["raw"])
    set_encoding(project, "jpeg")
    run(prepare, project)
    shutil.copytree(project / "data" / "prepared", stores["jpeg"])
    return stores


def right_by_image(predictions: Path) -> dict[str, bool]:
    with open(predictions, newline="", encoding="utf-8") as fh:
        return {row["source"]: row["actual"] == row["predicted"] for row in csv.DictReader(fh)}


def train_and_evaluate(project: Path, encoding: str, store: Path) -> dict:
    """Train and evaluate the optimized recipe on `store`; its numbers and per-image correctness."""
    set_encoding(project, encoding)  # the params the stages read must name the store they get
    models, metrics = f"models_{encoding}", f"metrics_{encoding}"
    train_s = run(["stages/train.py", "optimized", "--data", str(store), "--models", models, "--metrics", metrics,
                   "--tuned", "tuned.yaml"], project)
    run(["stages/evaluate.py", "optimized", "--data", str(store), "--models", models, "--metrics", metrics], project)
    train = json.loads((project / metrics / "optimized" / "train.json").read_text())
    evaluation = json.loads((project / metrics / "optimized" / "eval.json").read_text())
    shards = [p for p in (store / "shards").iterdir() if p.is_file()]
    return {"store_bytes": sum(p.stat().st_size for p in shards), "train_stage_s": train_s,
            "throughput_img_s": train["throughput_img_s"],
            "epoch_img_s": [h["throughput_img_s"] for h in train["history"]],
            "best_val_top1": train["best_val_top1"], "top1": evaluation["top1"], "images": evaluation["images"],
            "right": right_by_image(project / metrics / "optimized" / "predictions.csv")}


def summarise(results: dict[str, dict]) -> dict:
    raw, jpeg = results["raw"], results["jpeg"]
    if raw["right"].keys() != jpeg["right"].keys():
        raise SystemExit("the two stores' test splits differ: the conversion moved images")
    keys = sorted(raw["right"])
    table = paired_counts(np.array([raw["right"][k] for k in keys]), np.array([jpeg["right"][k] for k in keys]))
    low, high = newcombe_interval(table, 0.975)  # each side at 97.5%: a two-sided 95% interval
    n = table.n
    raw_ci = wilson_interval(round(raw["top1"] * n), n)
    return {"test_images": n, "difference": table.difference, "difference_ci95": [low, high],
            "mcnemar_p": mcnemar_p(table), "only_raw_right": table.negative_flips,
            "only_jpeg_right": table.positive_flips, "raw_top1_ci95": list(raw_ci),
            "jpeg_inside_raw_ci": raw_ci[0] <= jpeg["top1"] <= raw_ci[1],
            "store_ratio": raw["store_bytes"] / jpeg["store_bytes"],
            "throughput_ratio": jpeg["throughput_img_s"] / raw["throughput_img_s"]}


def report(results: dict[str, dict], summary: dict, args: argparse.Namespace) -> None:
    print(f"\nFashion-MNIST at {args.stored_size} px, optimized recipe, {args.epochs} epochs of "
          f"{args.images_per_epoch:,} images, seed {args.seed}, JPEG quality {args.quality}")
    print("| store | shards | train img/s (epochs' median) | best val top-1 | test top-1 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for encoding in ENCODINGS:
        r = results[encoding]
        print(f"| {encoding} | {r['store_bytes'] / 2**20:.1f} MiB | {np.median(r['epoch_img_s']):.1f} | "
              f"{r['best_val_top1']:.3f} | {r['top1']:.2%} |")
    s = summary
    low, high = s["difference_ci95"]
    print(f"JPEG - raw on the same {s['test_images']:,} test images: {s['difference']:+.2%} "
          f"(95%: {low:+.2%} to {high:+.2%}), only raw right {s['only_raw_right']}, only JPEG right "
          f"{s['only_jpeg_right']}, McNemar p = {s['mcnemar_p']:.3g}")
    print(f"raw's top-1 95% interval {s['raw_top1_ci95'][0]:.2%} to {s['raw_top1_ci95'][1]:.2%}: JPEG's "
          f"{'inside' if s['jpeg_inside_raw_ci'] else 'OUTSIDE'}; store {s['store_ratio']:.2f}x smaller, "
          f"training {s['throughput_ratio']:.2f}x raw's img/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--images-per-epoch", type=int, default=13312)
    parser.add_argument("--val-images", type=int, default=1000)
    parser.add_argument("--stored-size", type=int, default=32)
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--dir", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="encoding_accuracy_"))
    project = work / "project"
    try:
        make_project(project, args)
        stores = prepare_both(project)
        results = {e: train_and_evaluate(project, e, stores[e]) for e in ENCODINGS}
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    summary = summarise(results)
    report(results, summary, args)
    Path("bench_out").mkdir(exist_ok=True)
    out = {"cpu": cpu_report(), "args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
           "runs": {e: {k: v for k, v in r.items() if k != "right"} for e, r in results.items()}}
    Path("bench_out/encoding_accuracy.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

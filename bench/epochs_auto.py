"""Benchmark: `train.epochs: auto` against a fixed 4 epochs, at the same budget, on small catalogs.

For each data set, two real `dvc repro compare` runs in a copy of the project, identical but for
`train.epochs` (`auto`, then `4`): the plan's choice, each recipe's test top-1 with its 95% Wilson
interval, McNemar's exact test on the same test images (auto against 4), and every stage's
predicted time against its measured one (the whole run's against the plan's `fits` tolerance,
`plan.KEEP_BAND`). Data sets (`--sets`):

- `photos212`: two classes of 320x240 scene photos (bench/own_images.py's look, each class its own
  tint), 212 training, 48 validation and 400 test photos in train/ val/ test/ folders, at `--size`
  (64 px);
- `photos1000`: the same with four classes, 1,000 training photos (the weekly loop's size);
- `fmnist2k`: Fashion-MNIST from the Debian package, 2,000 training and 2,000 test images
  (`data.max_train_images`, `data.max_eval_images`), 32 px; `fmnist500`: 500 training and 1,000
  test images (not in the default list).

    python bench/epochs_auto.py                              # all three, 4-minute budget (~30 min)
    python bench/epochs_auto.py --sets photos212 --budget 6
    python bench/epochs_auto.py --size 32 --threads 1 --budget 5  # a small run on a busy shared machine
    python bench/epochs_auto.py --arms auto 4 8              # a third arm: 8 fixed epochs

Writes bench_out/epochs_auto.json; removes its projects and photos unless `--dir` is given.
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
from PIL import Image, ImageDraw

from cnnpipe.evaluate.stats import mcnemar_exact
from cnnpipe.hardware import cpu_report
from cnnpipe.plan.plan import KEEP_BAND

sys.path.insert(0, str(Path(__file__).parent))
from project_copy import copy_project  # noqa: E402  (a sibling bench script)

PHOTO_SETS = {"photos212": (2, {"train": 106, "val": 24, "test": 200}),
              "photos1000": (4, {"train": 250, "val": 25, "test": 100})}
"""name: (classes, photos per class in each split folder)."""
FMNIST_SETS = {"fmnist500": (500, 1000), "fmnist2k": (2000, 2000)}
"""name: (data.max_train_images, data.max_eval_images) of Fashion-MNIST."""


def scene(base: np.ndarray, rng: np.random.Generator, shape: int) -> Image.Image:
    """A 320x240 photo in bench/own_images.py's look: a tinted sky gradient with random shapes."""
    tint = np.clip(base + rng.integers(-40, 40, size=3), 0, 255)
    sky = np.linspace(0, 1, 240)[:, None, None] * (255 - tint) + tint
    img = Image.fromarray(np.broadcast_to(sky, (240, 320, 3)).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 9))):
        x, y = int(rng.integers(0, 300)), int(rng.integers(0, 220))
        w, h = int(rng.integers(10, 120)), int(rng.integers(10, 120))
        colour = tuple(int(v) for v in rng.integers(0, 255, size=3))
        (draw.ellipse if shape else draw.rectangle)([x, y, x + w, y + h], fill=colour)
    return img


def make_photo_set(out: Path, classes: int, per_split: dict[str, int], seed: int = 0) -> None:
    """train/ val/ test/ folders of JPEGs; a class's tint is the same in every split."""
    bases = np.random.default_rng(seed).integers(40, 215, size=(classes, 3))
    for s, (split, count) in enumerate(per_split.items()):
        for c in range(classes):
            folder = out / split / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                rng = np.random.default_rng([seed, s, c, i])
                scene(bases[c], rng, (i + c) % 2).save(folder / f"p{i:05d}.jpg", quality=90)


def make_project(work: Path, name: str, arm: str, args: argparse.Namespace) -> Path:
    """A git + DVC copy of the project set up for data set `name` and `train.epochs: arm`."""
    project = copy_project(work / f"{name}-{arm}")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["run"]["budget_minutes"] = args.budget
    params["train"]["epochs"] = arm if arm == "auto" else int(arm)
    params["train"]["threads"] = args.threads
    if name in PHOTO_SETS:
        photos = work / "photos" / name
        if not photos.exists():
            make_photo_set(photos, *PHOTO_SETS[name])
        shutil.copytree(photos, project / "data" / "raw" / "products")
        params["data"].update(source="data/raw/products", stored_size=args.size, image_size=args.size)
    else:
        train, evaluation = FMNIST_SETS[name]
        params["data"].update(max_train_images=train, max_eval_images=evaluation)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    subprocess.run(["dvc", "init", "-q"], cwd=project, check=True)
    if name in PHOTO_SETS:
        subprocess.run(["dvc", "add", "-q", "data/raw/products"], cwd=project, check=True)
    subprocess.run(["git", "add", "-A"], cwd=project, check=True)
    subprocess.run([*git, "commit", "-qm", f"{name} {arm}"], cwd=project, check=True)
    return project


def read_run(project: Path, wall_s: float) -> dict:
    """The plan's choice, each recipe's result and every stage's predicted and measured time."""
    metrics = project / "metrics"
    plan = json.loads((metrics / "plan" / "plan.json").read_text())
    compare = json.loads((metrics / "compare.json").read_text())["plan"]
    out = {"wall_s": wall_s, "plan": {k: plan.get(k) for k in ("epochs", "epochs_auto", "fraction", "images_per_epoch",
                                                             "train_images", "batch", "predicted_total_s", "fits",
                                                             "reason")},
           "measured_total_s": compare["measured_total_s"], "stages": compare["stages"], "variants": {}}
    for variant in ("baseline", "optimized"):
        ev = json.loads((metrics / variant / "eval.json").read_text())
        train = json.loads((metrics / variant / "train.json").read_text())
        with open(metrics / variant / "predictions.csv", newline="", encoding="utf-8") as fh:
            right = {row["source"]: row["actual"] == row["predicted"] for row in csv.DictReader(fh)}
        out["variants"][variant] = {
            "top1": ev["top1"], "ci": [ev["top1_ci95_low"], ev["top1_ci95_high"]], "images": ev["images"],
            "epochs": train["epochs"], "optimizer_steps": train["optimizer_steps"],
            "global_batch": train["global_batch"], "train_time_s": train["train_time_s"],
            "best_val_top1": train["best_val_top1"], "right": right}
    return out


def paired(a: dict[str, bool], b: dict[str, bool]) -> tuple[int, int, float]:
    """(only a right, only b right, McNemar's exact two-sided p) on the test images both runs scored."""
    assert a.keys() == b.keys(), "the two runs were evaluated on different test images"
    only_a = sum(a[k] and not b[k] for k in a)
    only_b = sum(b[k] and not a[k] for k in a)
    return only_a, only_b, mcnemar_exact(only_a, only_b)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", nargs="+", default=["photos212", "photos1000", "fmnist2k"],
                        choices=[*PHOTO_SETS, *FMNIST_SETS])
    parser.add_argument("--arms", nargs="+", default=["auto", "4"], help="train.epochs values; the first is the "
                        "one the others are compared against")
    parser.add_argument("--budget", type=float, default=4.0, help="run.budget_minutes")
    parser.add_argument("--size", type=int, default=64, help="stored and trained size of the photo sets (px)")
    parser.add_argument("--threads", type=int, default=None, help="train.threads (default: one per usable core); "
                        "1 keeps OpenMP from spinning against other processes on a shared machine")
    parser.add_argument("--dir", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="epochs_auto_"))
    results: dict[str, dict[str, dict]] = {}
    try:
        for name in args.sets:
            for arm in args.arms:
                project = make_project(work, name, arm, args)
                t0 = time.monotonic()
                subprocess.run(["dvc", "repro", "compare"], cwd=project, check=True)
                results.setdefault(name, {})[arm] = read_run(project, time.monotonic() - t0)
                shutil.rmtree(project, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    report(results, args)
    args.out.mkdir(parents=True, exist_ok=True)
    for runs in results.values():
        for run in runs.values():
            for v in run["variants"].values():
                v.pop("right")
    conditions = {"cpu": cpu_report(), "budget_minutes": args.budget, "threads": args.threads, "size": args.size}
    (args.out / "epochs_auto.json").write_text(json.dumps({**conditions, "results": results}, indent=2))
    return 0


def report(results: dict[str, dict[str, dict]], args: argparse.Namespace) -> None:
    """The comparison table, the paired tests and the plan's predictions against the measured times."""
    cpu = cpu_report()
    print(f"\n{cpu['model']}, {cpu['usable_cores']} usable cores, train.threads {args.threads}; budget "
          f"{args.budget:g} min; photos at {args.size} px\n")
    print("| data | train.epochs | epochs (steps b/o) | baseline top-1 | optimized top-1 | predicted | measured | "
          "measured / predicted |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, runs in results.items():
        for arm, run in runs.items():
            v = run["variants"]
            cells = [f"{100 * v[r]['top1']:.1f}% ({100 * v[r]['ci'][0]:.1f}-{100 * v[r]['ci'][1]:.1f})"
                     for r in ("baseline", "optimized")]
            ratio = run["measured_total_s"] / run["plan"]["predicted_total_s"]
            print(f"| {name} | {arm} | {v['optimized']['epochs']} ({v['baseline']['optimizer_steps']}/"
                  f"{v['optimized']['optimizer_steps']}) | {cells[0]} | {cells[1]} | "
                  f"{run['plan']['predicted_total_s'] / 60:.1f} min | {run['measured_total_s'] / 60:.1f} min | "
                  f"{ratio:.2f}x{'' if ratio <= KEEP_BAND[1] else ' (over the tolerance)'} |")
    print()
    first = args.arms[0]
    for name, runs in results.items():
        for arm in args.arms[1:]:
            for variant in ("baseline", "optimized"):
                a, b = runs[first]["variants"][variant], runs[arm]["variants"][variant]
                only_a, only_b, p = paired(a["right"], b["right"])
                print(f"{name}, {variant}: epochs {first} - {arm} = {100 * (a['top1'] - b['top1']):+.1f} points on "
                      f"{a['images']} test images ({only_a} only {first} got right, {only_b} only {arm}; "
                      f"McNemar p = {p:.2g})")
    print("\nPredicted vs measured, per stage (actual / predicted):")
    for name, runs in results.items():
        for arm, run in runs.items():
            stages = ", ".join(f"{s} {r['ratio']:.2f}x" for s, r in run["stages"].items() if r.get("ratio"))
            print(f"  {name} {arm}: {stages}; plan: {run['plan']['reason']}")


if __name__ == "__main__":
    sys.exit(main())

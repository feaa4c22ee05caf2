"""Benchmark: the README's own-images recipe under a budget: what the profiles cost and what the plan says.

Makes a folder tree of JPEG photos (one folder per class, 320x240, a class-coloured scene with
random shapes: decoding and training cost what real photos of that size cost), copies the project
next to it, and runs the README's recipe (`data.stored_size=160`, `data.image_size=128`) with a
budget, up to `--until` (default: the plan, which is what sizes the rest). Prints each stage's time,
the profiles' share of the budget and of the planned run, the batch each profile measured at, which
knobs were measured, and the plan's verdict. Writes bench_out/own_images.json.

    python bench/own_images.py --budget 6                 # both profiles within 20% of 6 minutes?
    python bench/own_images.py --budget 20                # the default budget: profiles <= 15% of the run?
    python bench/own_images.py --budget 6 --until compare # and the whole run inside its budget
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).parent))
from project_copy import copy_project  # noqa: E402  (a sibling bench script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from slowest_tests import stage_times  # noqa: E402  (the suite's reader of the stage log)


def make_photos(out: Path, classes: int, per_class: int, seed: int = 0) -> None:
    """`classes` folders of `per_class` 320x240 JPEGs (skipped when the tree is already there)."""
    if out.exists() and sum(1 for _ in out.rglob("*.jpg")) == classes * per_class:
        return
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = out / f"class_{c}"
        folder.mkdir(parents=True, exist_ok=True)
        base = rng.integers(40, 215, size=3)
        for i in range(per_class):
            tint = np.clip(base + rng.integers(-40, 40, size=3), 0, 255)
            sky = np.linspace(0, 1, 240)[:, None, None] * (255 - tint) + tint
            img = Image.fromarray(np.broadcast_to(sky, (240, 320, 3)).astype(np.uint8))
            draw = ImageDraw.Draw(img)
            for _ in range(int(rng.integers(3, 9))):
                x, y = int(rng.integers(0, 300)), int(rng.integers(0, 220))
                w, h = int(rng.integers(10, 120)), int(rng.integers(10, 120))
                colour = tuple(int(v) for v in rng.integers(0, 255, size=3))
                (draw.ellipse if (i + c) % 2 else draw.rectangle)([x, y, x + w, y + h], fill=colour)
            img.save(folder / f"p{i:05d}.jpg", quality=90)


HOOKS = Path(__file__).resolve().parents[1] / "tests" / "child_hooks"
"""The suite's stage-timing hook: each stage's command logs its start and end (CNNPIPE_STAGE_LOG)."""


def run(cmd: list[str], cwd: Path, stage_log: Path) -> float:
    """`cmd`'s wall seconds; every DVC stage it runs logs its start and end to `stage_log`."""
    env = {**os.environ, "CNNPIPE_STAGE_LOG": str(stage_log),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HOOKS), os.environ.get("PYTHONPATH")]))}
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=cwd, check=True, env=env)
    return time.monotonic() - t0


def stage_seconds(stage_log: Path) -> dict[str, float]:
    """Each stage's command, start to end (what the plan predicts; DVC's own work is the rest), as the
    suite's own reader pairs the log's lines (`scripts/slowest_tests.py`; outside pytest the test is "")."""
    return {stage: sum(run or 0.0 for run in runs) for stage, runs in stage_times(stage_log).get("", {}).items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=6.0, help="run.budget_minutes")
    parser.add_argument("--classes", type=int, default=6)
    parser.add_argument("--per-class", type=int, default=300)
    parser.add_argument("--until", default="plan", help="the dvc.yaml stage to reproduce up to")
    parser.add_argument("--dir", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="own_images_"))
    project = work / "project"
    try:
        copy_project(project)
        make_photos(work / "photos", args.classes, args.per_class)
        shutil.copytree(work / "photos", project / "data" / "raw" / "products")
        params = yaml.safe_load((project / "params.yaml").read_text())
        params["data"].update(source="data/raw/products", stored_size=160, image_size=128)
        params["run"]["budget_minutes"] = args.budget
        (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        subprocess.run(["git", "init", "-q"], cwd=project, check=True)
        subprocess.run(["dvc", "init", "-q"], cwd=project, check=True)
        subprocess.run(["dvc", "add", "-q", "data/raw/products"], cwd=project, check=True)  # as the README says
        subprocess.run(["git", "add", "-A"], cwd=project, check=True)
        subprocess.run(["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm",
                        "own images"], cwd=project, check=True)
        wall = run(["dvc", "repro", args.until], project, work / "stages.jsonl")
        out = report(project, args, wall)
        out["stages"] = against_plan(project, stage_seconds(work / "stages.jsonl"), wall, args.budget * 60)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    Path("bench_out").mkdir(exist_ok=True)
    Path("bench_out/own_images.json").write_text(json.dumps(out, indent=2))
    return 0


def report(project: Path, args: argparse.Namespace, wall: float) -> dict:
    """Print and return the profiles' times and choices, and the plan's verdict."""
    budget_s = args.budget * 60
    profiles = {v: json.loads((project / "metrics" / "profile" / f"{v}.json").read_text())
                for v in ("baseline", "optimized")}
    plan = json.loads((project / "metrics" / "plan" / "plan.json").read_text())
    spent = sum(p["stage_time_s"] for p in profiles.values())
    out = {"budget_s": budget_s, "wall_s": wall, "profiles_s": spent, "plan": {k: plan[k] for k in (
        "fraction", "images_per_epoch", "train_images", "predicted_total_s", "fits", "reason")}, "profiles": {}}
    print(f"{args.classes} classes x {args.per_class} photos, 160 px stored, 128 px trained, "
          f"budget {args.budget:g} min; dvc repro {args.until}: {wall:.0f} s")
    for v, p in profiles.items():
        measured = [t["change"] for t in p["trials"] if t["speedup"]]
        smaller = {e["change"]["batch_size"]: ("predicted" if e.get("predicted") else f"{e['speedup']:.2f}x")
                   for e in p["smaller_batches"]}
        print(f"  profile@{v}: {p['stage_time_s']:.0f} s (box {p['time_box_s']:.0f} s, start-up {p['startup_s']:.0f} s); "
              f"measured at batch {p['batch_size']} of {p.get('recipe_batch_size', p['batch_size'])}: "
              f"{p['step_time_median_s']:.2f} s/step, {p['throughput_img_s']:.0f} img/s; trials measured: {measured}; "
              f"smaller batches: {smaller}; tuned: {p['tuned']}")
        out["profiles"][v] = {k: p.get(k) for k in ("stage_time_s", "time_box_s", "startup_s", "batch_size",
                                                    "recipe_batch_size", "step_time_median_s", "throughput_img_s",
                                                    "tuned", "box_too_small", "inference_batch")}
        out["profiles"][v]["trials_measured"] = measured
        out["profiles"][v]["smaller_batches"] = smaller
    total = plan["predicted_total_s"]
    print(f"  profiles together: {spent:.0f} s = {spent / budget_s:.1%} of the budget, "
          f"{spent / total:.1%} of the planned run ({total:.0f} s)")
    print(f"  plan: {plan['fraction']:.4g} of {plan['train_images']} images per epoch "
          f"({plan['images_per_epoch']}), {'fits' if plan['fits'] else 'OVER budget'}: {plan['reason']}")
    return out


def against_plan(project: Path, measured: dict[str, float], wall: float, budget_s: float) -> dict:
    """Print each stage's measured seconds beside the plan's prediction, DVC's own share and the whole run
    against the budget; return them."""
    plan = json.loads((project / "metrics" / "plan" / "plan.json").read_text())
    predicted = {**plan.get("profile_s", {}), **plan.get("spent_s", {}), **plan["predicted_s"]}
    print(f"  {'stage':24} {'measured':>9} {'predicted':>10} {'ratio':>6}")
    for stage, seconds in measured.items():
        guess = predicted.get(stage)
        ratio = f"{seconds / guess:5.2f}x" if guess else "   -"
        print(f"  {stage:24} {seconds:8.0f}s {guess or 0:9.0f}s {ratio}")
    stages = sum(measured.values())
    print(f"  stages {stages:.0f} s; DVC's own work {wall - stages:.0f} s; whole `dvc repro` {wall:.0f} s = "
          f"{wall / budget_s:.2f}x the budget ({plan['predicted_total_s']:.0f} s predicted)")
    return {"measured_s": measured, "predicted_s": predicted, "dvc_own_s": wall - stages, "wall_s": wall,
            "budget_ratio": wall / budget_s}


if __name__ == "__main__":
    sys.exit(main())

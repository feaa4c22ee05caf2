"""Benchmark: `prepare` on a synthetic product catalog, through `dvc repro` in a copy of the project:
speed per core, peak memory, and the weekly update's time, bytes written and disk held.

Makes (once, reused after) a catalog of JPEG product photos, 300-1,200 px a side in the aspect
ratios catalogs have, one folder per category (each photo one of --rendered rendered shots, with
bytes of its own: `make_catalog`); then times, each in a fresh process:

1. a full prepare of a tenth of it (through a manifest, `prepare` called directly), for how peak
   memory grows with the catalog;
2. `dvc repro prepare` of the whole catalog, in a git + DVC copy of the project (its own dvc.yaml
   and .dvc/config) where the catalog is `data/raw/catalog`;
3. the weekly update: 10% new photos moved in, `dvc repro prepare` again.

Prints images/s (and per decoding worker), the prepare process's peak RSS (and per listed image)
and the largest worker's, the update's time as a share of the full prepare, the bytes each `dvc
repro` wrote to the disk (the kernel's per-process write accounting, summed over every process it
ran) and what the project holds on disk (workspace outputs and DVC cache, each inode once), against
the store's size. Writes bench_out/prepare_scale.json. Removes the project (not the catalog) at the
end unless --keep.

    python bench/prepare_scale.py                        # 100k images + 10k new, 100 categories
    python bench/prepare_scale.py --classes 1000         # peak RSS per image with 1,000 categories
    python bench/prepare_scale.py --images 20000 --stored-size 224
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml
from PIL import Image, ImageDraw, ImageFilter

from cnnpipe.data.ingest.reading import usable_cores

sys.path.insert(0, str(Path(__file__).parent))
from project_copy import copy_project  # noqa: E402  (a sibling bench script)

PROJECT_FILES = ("dvc.yaml", "params.yaml", "stages", "src", ".dvc/config", ".dvcignore", ".gitignore")

# Run in a fresh process: the command given, with a watcher that samples the peak RSS (VmHWM) of the
# process running stages/prepare.py and of its decoding workers (RUSAGE_CHILDREN would report the
# largest process of all, dvc's own included); then what every process under it wrote to the disk.
WATCH = """
import json, os, resource, subprocess, sys, threading, time
peaks, stop, seen = {"main": 0.0, "worker": 0.0}, threading.Event(), {}
def tree(pid):
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            for child in open(f"/proc/{pid}/task/{task}/children").read().split():
                yield child
                yield from tree(child)
    except OSError:
        return
def watch(root):
    while not stop.wait(0.2):
        for pid in [str(root), *tree(root)]:
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
                kind = "worker" if b"spawn_main" in cmd else "main" if b"stages/prepare.py" in cmd else None
                if kind == "main":  # when the prepare process ran: the rest of the time is dvc's
                    seen.setdefault(pid, [time.perf_counter(), 0.0])[1] = time.perf_counter()
                if kind:
                    for line in open(f"/proc/{pid}/status"):
                        if line.startswith("VmHWM:"):
                            peaks[kind] = max(peaks[kind], int(line.split()[1]) / 1024)
            except OSError:
                pass
start = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:])
threading.Thread(target=watch, args=(proc.pid,), daemon=True).start()
code = proc.wait()
stop.set()
print(json.dumps({"seconds": time.perf_counter() - start, "returncode": code,
                  "prepare_seconds": sum(b - a for a, b in seen.values()),
                  "written": resource.getrusage(resource.RUSAGE_CHILDREN).ru_oublock * 512,
                  "rss_main_mb": peaks["main"], "rss_worker_mb": peaks["worker"]}))
"""


def product_photo(index: int, seed: int) -> Image.Image:
    """A product shot: white backdrop, one smoothly shaded object of the category's colour, a soft shadow."""
    rng = np.random.default_rng([seed, index])
    long_side = int(rng.integers(300, 1201))
    aspect = float(rng.choice([1.0, 1.0, 0.75, 4 / 3, 2 / 3]))
    w, h = (long_side, int(long_side * aspect)) if aspect <= 1 else (int(long_side / aspect), long_side)
    img = Image.new("RGB", (w, h), (250, 250, 250))
    draw = ImageDraw.Draw(img)
    colour = tuple(int(c) for c in rng.integers(20, 230, 3))
    x0, y0 = int(w * rng.uniform(0.1, 0.3)), int(h * rng.uniform(0.1, 0.3))
    x1, y1 = int(w * rng.uniform(0.7, 0.9)), int(h * rng.uniform(0.7, 0.9))
    draw.ellipse((x0 + 8, y1 - 10, x1 + 8, y1 + 12), fill=(215, 215, 215))
    (draw.ellipse if index % 3 else draw.rounded_rectangle)((x0, y0, x1, y1), fill=colour)
    seam = tuple(min(255, c + 40) for c in colour)
    draw.line((x0, (y0 + y1) // 2, x1, (y0 + y1) // 2), fill=seam, width=max(2, h // 60))
    img = img.filter(ImageFilter.GaussianBlur(1.5))
    grain = rng.normal(0, 4, (h, w, 1)).astype(np.int16)
    return Image.fromarray(np.clip(np.asarray(img, np.int16) + grain, 0, 255).astype(np.uint8))


def _render(args: tuple[Path, int, int]) -> None:
    shots, index, seed = args
    path = shots / f"{index:05d}.jpg"
    if not path.exists():
        product_photo(index, seed).save(path, quality=88)


def make_catalog(root: Path, start: int, stop: int, classes: int, seed: int, shots: Path, rendered: int) -> None:
    """Photos start..stop-1: each one of `rendered` rendered product shots (made once, in `shots`),
    given bytes of its own by a JPEG comment naming the photo: every file is distinct to its sha256
    and decodes like a real shot of its size, and 110,000 of them take minutes to write, not the
    hours their rendering takes on a shared 2-core machine."""
    shots.mkdir(parents=True, exist_ok=True)
    with mp.get_context("spawn").Pool(usable_cores()) as pool:
        pool.map(_render, [(shots, i, seed) for i in range(rendered)], chunksize=16)
    for index in range(start, stop):
        path = root / f"category_{index % classes:03d}" / f"sku_{index:07d}.jpg"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            data = (shots / f"{index % rendered:05d}.jpg").read_bytes()
            comment = f"sku {index}".encode()
            # After the start-of-image marker: a COM segment (0xFFFE, its length, the text).
            path.write_bytes(data[:2] + b"\xff\xfe" + (len(comment) + 2).to_bytes(2, "big") + comment + data[2:])


def run(cmd: list[str], cwd: Path) -> dict:
    """`cmd` under the watcher; raises with its output when it fails."""
    done = subprocess.run([sys.executable, "-c", WATCH, *cmd], cwd=cwd, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["returncode"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return result


def held(project: Path) -> int:
    """Bytes the project holds for the store: workspace outputs and DVC cache, each inode once."""
    seen, total = set(), 0
    for top in ("data/prepared", "data/split_ledger", ".dvc/cache"):
        for parent, _, files in os.walk(project / top):
            for name in files:
                st = os.lstat(os.path.join(parent, name))
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_size
    return total


def store_bytes(project: Path) -> int:
    return sum(p.stat().st_size for p in (project / "data" / "prepared").rglob("*") if p.is_file())


def make_project(project: Path, args: argparse.Namespace) -> None:
    """A git + DVC copy of the project whose data.source is data/raw/catalog."""
    copy_project(project, PROJECT_FILES)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["data"].update(source="data/raw/catalog", stored_size=args.stored_size, image_size=args.stored_size,
                          shard_mb=args.shard_mb, prepare_workers=args.workers)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (project / "data" / "raw").mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=100_000)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--stored-size", type=int, default=64)
    parser.add_argument("--workers", default="auto")
    parser.add_argument("--dir", type=Path, default=Path("bench_out/prepare_scale"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-mb", type=float, default=64.0)
    parser.add_argument("--rendered", type=int, default=2000, help="distinct product shots rendered")
    parser.add_argument("--keep", action="store_true", help="keep the project (and its DVC cache) afterwards")
    args = parser.parse_args()
    catalog, new = args.images, args.images // 10
    args.dir = args.dir.resolve()
    root, spare, project = args.dir / "catalog", args.dir / "update", args.dir / "project"
    env = dict(os.environ, PYTHONPATH=str(project / "src"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    os.environ.update(env)

    start = time.perf_counter()
    if (project / "data" / "raw" / "catalog").is_dir():  # an interrupted run left it there
        (project / "data" / "raw" / "catalog").rename(root)
    for photo in sorted(root.glob("*/sku_*.jpg")):  # a previous run's update, moved back out
        if int(photo.stem[4:]) >= catalog:
            (spare / photo.parent.name).mkdir(parents=True, exist_ok=True)
            photo.rename(spare / photo.parent.name / photo.name)
    make_catalog(root, 0, catalog, args.classes, args.seed, args.dir / "shots", args.rendered)
    make_catalog(spare, catalog, catalog + new, args.classes, args.seed, args.dir / "shots", args.rendered)
    print(f"catalog: {catalog} JPEGs under {root} ({time.perf_counter() - start:.0f} s to make or check)")
    sizes = [p.stat().st_size for p in list(root.glob("*/sku_*.jpg"))[:2000]]
    print(f"  files: median {np.median(sizes) / 1024:.0f} KiB")

    subset = args.dir / "tenth.csv"
    subset.write_text("path,label\n" + "".join(f"catalog/category_{i % args.classes:03d}/sku_{i:07d}.jpg,"
                                               f"category_{i % args.classes:03d}\n" for i in range(catalog // 10)))
    tenth_out = args.dir / "prepared_tenth"
    for leftover in (tenth_out, tenth_out.with_name("prepared_tenth_ledger"), tenth_out.with_name("prepared_tenth.work")):
        shutil.rmtree(leftover, ignore_errors=True)
    make_project(project, args)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["data"]["source"] = str(subset)
    (args.dir / "tenth_params.yaml").write_text(yaml.safe_dump(params))
    tenth = run([sys.executable, str(project / "stages" / "prepare.py"), "--params", str(args.dir / "tenth_params.yaml"),
                 "--out", str(tenth_out), "--report", str(args.dir / "tenth_report.json")], args.dir)
    tenth["work"] = json.loads((args.dir / "tenth_report.json").read_text())["work"]
    shutil.rmtree(tenth_out, ignore_errors=True)
    shutil.rmtree(tenth_out.with_name("prepared_tenth_ledger"), ignore_errors=True)

    root.rename(project / "data" / "raw" / "catalog")
    try:
        full = run(["dvc", "repro", "prepare"], project)
        full["work"] = json.loads((project / "metrics" / "data_report.json").read_text())["work"]
        full["store"], full["held"] = store_bytes(project), held(project)
        for photo in sorted(spare.glob("*/sku_*.jpg")):
            photo.rename(project / "data" / "raw" / "catalog" / photo.parent.name / photo.name)
        update = run(["dvc", "repro", "prepare"], project)
        report = json.loads((project / "metrics" / "data_report.json").read_text())
        update["work"], update["changes"] = report["work"], report["changes"]
        update["store"], update["held"] = store_bytes(project), held(project)
        index = json.loads((project / "data" / "prepared" / "index.json").read_text())
    finally:
        (project / "data" / "raw" / "catalog").rename(root)
    if not args.keep:
        shutil.rmtree(project)

    workers = full["work"]["workers"]
    rows = [("a tenth (manifest)", tenth), ("full catalog", full), ("+10% new photos", update)]
    print(f"\nprepare at stored_size {args.stored_size}, {workers} worker(s) on {usable_cores()} usable core(s); "
          f"the last two through `dvc repro prepare`")
    print(f"{'run':<20}{'images':>9}{'decoded':>9}{'kept':>9}{'seconds':>9}{'img/s':>8}{'per worker':>11}"
          f"{'RSS main':>10}{'per image':>10}{'RSS worker':>11}")
    for name, r in rows:
        images = r["work"]["listed"]
        speed = images / r["seconds"]
        print(f"{name:<20}{images:>9}{r['work']['decoded']:>9}{r['work']['kept']:>9}{r['seconds']:>9.1f}"
              f"{speed:>8.0f}{speed / workers:>11.0f}{r['rss_main_mb']:>8.0f}MB{r['rss_main_mb'] * 2**20 / images:>9.0f}B"
              f"{r['rss_worker_mb']:>9.0f}MB")
    marginal = (full["rss_main_mb"] - tenth["rss_main_mb"]) * 2**20 / (full["work"]["listed"] - tenth["work"]["listed"])
    print(f"\nupdate / full prepare, both through dvc repro: {update['seconds'] / full['seconds']:.3f}; "
          f"main RSS, full / tenth: {full['rss_main_mb'] / tenth['rss_main_mb']:.2f}x for 10x the images, "
          f"{marginal:,.0f} bytes per extra image")
    print(f"the prepare process itself (sampled every 0.2 s): full {full['prepare_seconds']:.1f} s, update "
          f"{update['prepare_seconds']:.1f} s ({update['prepare_seconds'] / full['prepare_seconds']:.3f}); the rest "
          f"of each `dvc repro` is DVC's own work, mostly hashing the {update['work']['listed']:,}-file data/raw "
          f"dependency: {full['seconds'] - full['prepare_seconds']:.1f} s and "
          f"{update['seconds'] - update['prepare_seconds']:.1f} s")
    for name, r in (("full", full), ("update", update)):
        print(f"{name}: `dvc repro prepare` wrote {r['written'] / 2**20:,.1f} MiB ({r['written'] / r['store']:.3f}x the "
              f"{r['store'] / 2**20:,.1f} MiB store); the project holds {r['held'] / 2**20:,.1f} MiB "
              f"({r['held'] / r['store']:.3f}x)")
    print(f"update: {index['last_update']['written_bytes'] / 2**20:,.1f} MiB of new pixels in "
          f"{len(index['shards'])} shards of {args.shard_mb:g} MiB; moved between splits: "
          f"{update['changes']['moved_between_splits']}")
    out = {"images": catalog, "new": new, "classes": args.classes, "stored_size": args.stored_size,
           "workers": workers, "shard_mb": args.shard_mb, "tenth": tenth, "full": full, "update": update,
           "rss_bytes_per_extra_image": marginal,
           "max_rss_self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    (args.dir.parent / "prepare_scale.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

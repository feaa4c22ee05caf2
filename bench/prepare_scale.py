"""Benchmark: `prepare` on a synthetic product catalog: speed per core, peak memory, weekly update.

Makes (once, reused after) a catalog of JPEG product photos, 300-1,200 px a side in the aspect
ratios catalogs have, one folder per category; then times, each in a fresh process:

1. a full prepare of a tenth of it (through a manifest), for how peak memory grows;
2. a full prepare of the catalog;
3. the weekly update: 10% new photos added, prepared against the store of step 2.

Prints images/s (and per decoding worker), the main process's peak RSS (and per listed image) and
the largest worker's, and the update's time as a share of the full prepare. Both stores of steps 2
and 3 are added to a real DVC cache (`dvc add`, in a project of its own under --dir): the update's
bytes written, how many old shards kept their md5, and how much the DVC cache grew, against the
store's size. Writes bench_out/prepare_scale.json.

    python bench/prepare_scale.py                        # 100k images + 10k new, 100 categories
    python bench/prepare_scale.py --classes 1000         # peak RSS per image with 1,000 categories
    python bench/prepare_scale.py --images 20000 --stored-size 224
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from cnnpipe.data.ingest import usable_cores

# Run in a fresh process. Workers' peaks are sampled from /proc (VmHWM): RUSAGE_CHILDREN would
# count the parent's pages in any child forked before its exec.
PREPARE_ONE = """
import json, os, resource, sys, threading, time
from pathlib import Path
from cnnpipe.config import DataConfig
from cnnpipe.data.prepare import prepare
source, out, size, workers, shard_mb = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
cfg = DataConfig(source=source, stored_size=size, image_size=size, shard_mb=float(shard_mb),
                 prepare_workers=workers if workers == "auto" else int(workers))
peaks, stop = {}, threading.Event()
def watch():
    me = os.getpid()
    while not stop.wait(0.2):
        try:
            children = open(f"/proc/{me}/task/{me}/children").read().split()
            for pid in children:
                for line in open(f"/proc/{pid}/status"):
                    if line.startswith("VmHWM:"):
                        peaks[pid] = max(peaks.get(pid, 0), int(line.split()[1]) / 1024)
        except OSError:
            pass
threading.Thread(target=watch, daemon=True).start()
start = time.perf_counter()
report = prepare(cfg, 0, out, out.with_name(out.name + "_report.json"))
seconds = time.perf_counter() - start
stop.set()
print(json.dumps({"seconds": seconds, "work": report["work"], "images": sum(report["splits"].values()),
                  "rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rss_worker_mb": max(peaks.values(), default=0.0)}))
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


def _write(args: tuple[Path, int, int, int]) -> None:
    root, index, classes, seed = args
    path = root / f"category_{index % classes:03d}" / f"sku_{index:07d}.jpg"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        product_photo(index, seed).save(path, quality=88)


def make_catalog(root: Path, start: int, stop: int, classes: int, seed: int) -> None:
    with mp.get_context("spawn").Pool(usable_cores()) as pool:
        pool.map(_write, [(root, i, classes, seed) for i in range(start, stop)], chunksize=64)


def run_prepare(source: Path, out: Path, size: int, workers: str, shard_mb: float) -> dict:
    done = subprocess.run([sys.executable, "-c", PREPARE_ONE, str(source), str(out), str(size), workers,
                           str(shard_mb)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def shard_md5s(store: Path) -> dict[str, str]:
    """md5 of every shard file: what DVC keys its cache on."""
    out = {}
    for path in sorted((store / "shards").glob("*.u8")):
        digest = hashlib.md5()
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 24):
                digest.update(chunk)
        out[path.name] = digest.hexdigest()
    return out


def dvc_add(project: Path, target: str) -> int:
    """`dvc add` the store into the project's cache; returns the cache's size in bytes after."""
    subprocess.run([sys.executable, "-m", "dvc", "add", "-q", target], cwd=project, check=True)
    return sum(p.stat().st_size for p in (project / ".dvc" / "cache").rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=100_000)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--stored-size", type=int, default=64)
    parser.add_argument("--workers", default="auto")
    parser.add_argument("--dir", type=Path, default=Path("bench_out/prepare_scale"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-mb", type=float, default=64.0)
    args = parser.parse_args()
    catalog, new = args.images, args.images // 10
    root = args.dir / "catalog"

    start = time.perf_counter()
    spare = args.dir / "update"  # the week's new photos, made once and moved in for step 3
    for photo in sorted(root.glob("*/sku_*.jpg")):  # a previous run's update, moved back out
        if int(photo.stem[4:]) >= catalog:
            (spare / photo.parent.name).mkdir(parents=True, exist_ok=True)
            photo.rename(spare / photo.parent.name / photo.name)
    make_catalog(root, 0, catalog, args.classes, args.seed)
    make_catalog(spare, catalog, catalog + new, args.classes, args.seed)
    print(f"catalog: {catalog} JPEGs under {root} ({time.perf_counter() - start:.0f} s to make or check)")
    sizes = [p.stat().st_size for p in list(root.glob("*/sku_*.jpg"))[:2000]]
    print(f"  files: median {np.median(sizes) / 1024:.0f} KiB")

    subset = args.dir / "tenth.csv"
    subset.write_text("path,label\n" + "".join(f"catalog/category_{i % args.classes:03d}/sku_{i:07d}.jpg,"
                                               f"category_{i % args.classes:03d}\n" for i in range(catalog // 10)))
    store = args.dir / "prepared"
    for leftover in (store, args.dir / "prepared_tenth", args.dir / ".dvc"):
        subprocess.run(["rm", "-rf", str(leftover), str(leftover) + ".work", str(leftover) + ".dvc"], check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=args.dir, check=True)
    tenth = run_prepare(subset, args.dir / "prepared_tenth", args.stored_size, args.workers, args.shard_mb)
    full = run_prepare(root, store, args.stored_size, args.workers, args.shard_mb)
    cache_full, md5_full = dvc_add(args.dir, "prepared"), shard_md5s(store)
    for photo in sorted(spare.glob("*/sku_*.jpg")):
        photo.rename(root / photo.parent.name / photo.name)
    update = run_prepare(root, store, args.stored_size, args.workers, args.shard_mb)
    cache_update, md5_update = dvc_add(args.dir, "prepared"), shard_md5s(store)
    index = json.loads((store / "index.json").read_text())
    frame = args.stored_size**2 * 3
    store_bytes = sum(s["rows"] for s in index["shards"]) * frame
    dvc = {"store_bytes": store_bytes, "shards_before": len(md5_full),
           "old_shards_unchanged": sum(md5_update.get(k) == v for k, v in md5_full.items()),
           "new_pixel_bytes": update["work"]["decoded"] * frame,
           "written_bytes": index["last_update"]["written_bytes"],
           "cache_after_full": cache_full, "cache_growth": cache_update - cache_full}

    workers = full["work"]["workers"]
    rows = [("a tenth (manifest)", tenth), ("full catalog", full), ("+10% new photos", update)]
    print(f"\nprepare at stored_size {args.stored_size}, {workers} worker(s) on {usable_cores()} usable core(s)")
    print(f"{'run':<20}{'images':>9}{'decoded':>9}{'kept':>9}{'seconds':>9}{'img/s':>8}{'per worker':>11}"
          f"{'RSS main':>10}{'per image':>10}{'RSS worker':>11}")
    for name, r in rows:
        speed, listed = r["images"] / r["seconds"], r["work"]["listed"]
        print(f"{name:<20}{r['images']:>9}{r['work']['decoded']:>9}{r['work']['kept']:>9}{r['seconds']:>9.1f}"
              f"{speed:>8.0f}{speed / workers:>11.0f}{r['rss_main_mb']:>8.0f}MB{r['rss_main_mb'] * 2**20 / listed:>9.0f}B"
              f"{r['rss_worker_mb']:>9.0f}MB")
    marginal = (full["rss_main_mb"] - tenth["rss_main_mb"]) * 2**20 / (full["work"]["listed"] - tenth["work"]["listed"])
    print(f"\nupdate / full prepare: {update['seconds'] / full['seconds']:.3f}; "
          f"main RSS, full / tenth: {full['rss_main_mb'] / tenth['rss_main_mb']:.2f}x for 10x the images, "
          f"{marginal:,.0f} bytes per extra image")
    print(f"store: {store_bytes / 2**20:,.0f} MiB of pixels in {len(md5_update)} shards of {args.shard_mb:g} MiB; "
          f"the update kept {dvc['old_shards_unchanged']} of {dvc['shards_before']} old shards byte for byte, "
          f"wrote {dvc['written_bytes'] / 2**20:,.1f} MiB of pixels ({dvc['new_pixel_bytes'] / 2**20:,.1f} MiB new), "
          f"and grew the DVC cache by {dvc['cache_growth'] / 2**20:,.1f} MiB "
          f"({dvc['cache_growth'] / store_bytes:.1%} of the store)")
    out = {"images": catalog, "new": new, "classes": args.classes, "stored_size": args.stored_size,
           "workers": workers, "shard_mb": args.shard_mb, "tenth": tenth, "full": full, "update": update, "dvc": dvc,
           "rss_bytes_per_extra_image": marginal,
           "max_rss_self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    (args.dir.parent / "prepare_scale.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

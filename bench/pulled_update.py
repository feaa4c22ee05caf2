"""Benchmark: the weekly catalog update on a machine whose store came from `dvc pull`, the way a
user runs it, at a few catalog sizes: bytes written and disk held, against the store's size.

For each size N, in a producer copy of the project (git + DVC, a local DVC remote): N product photos
under `data/raw/catalog`, `dvc add` it, `dvc repro prepare`, `dvc push`, `git commit`. Then another
machine: `git clone`, `dvc pull`, N/10 new photos copied in, `dvc add data/raw/catalog` and
`dvc repro prepare`. Each command's bytes written to the disk are the kernel's per-process write
accounting summed over every process it ran (`getrusage(RUSAGE_CHILDREN).ru_oublock`); what the
project holds is the store's workspace files, the ledger's and every DVC cache object that is not a
photo, each inode once. The store is the one `data.encoding` picks (default `auto`: JPEG at 64 px
colour). A least-squares line through the sizes splits each figure into a fixed cost and a cost per
byte of store, so the small sizes' start-up costs do not pass for per-photo costs.

    python bench/pulled_update.py                        # 1,000 / 2,000 / 4,000 photos + 10%, 64 px
    python bench/pulled_update.py --sizes 4000 --encoding raw
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml
from PIL import Image, ImageDraw, ImageFilter

sys.path.insert(0, str(Path(__file__).parent))
from project_copy import PROJECT_FILES, copy_project  # noqa: E402  (a sibling bench script)

WRITES = ("import json, resource, subprocess, sys; done = subprocess.run(sys.argv[1:], capture_output=True, "
          "text=True); print(json.dumps({'rc': done.returncode, 'out': (done.stdout + done.stderr)[-3000:], "
          "'written': resource.getrusage(resource.RUSAGE_CHILDREN).ru_oublock * 512}))")
"""Runs a command in a fresh process and prints what it and every process under it wrote to the disk."""


def product_photo(index: int, side: int = 96) -> Image.Image:
    """A small product shot: white backdrop, one smoothly shaded object, a seam, sensor grain."""
    rng = np.random.default_rng(index)
    w, h = side, int(side * float(rng.choice([1.0, 0.75, 4 / 3])))
    img = Image.new("RGB", (w, h), (250, 250, 250))
    draw = ImageDraw.Draw(img)
    colour = tuple(int(c) for c in rng.integers(20, 230, 3))
    x0, y0 = int(w * rng.uniform(0.1, 0.3)), int(h * rng.uniform(0.1, 0.3))
    x1, y1 = int(w * rng.uniform(0.7, 0.9)), int(h * rng.uniform(0.7, 0.9))
    draw.ellipse((x0 + 4, y1 - 5, x1 + 4, y1 + 6), fill=(215, 215, 215))
    (draw.ellipse if index % 3 else draw.rounded_rectangle)((x0, y0, x1, y1), fill=colour)
    draw.line((x0, (y0 + y1) // 2, x1, (y0 + y1) // 2), fill=tuple(min(255, c + 40) for c in colour), width=2)
    img = img.filter(ImageFilter.GaussianBlur(1.0))
    grain = rng.normal(0, 3, (h, w, 1)).astype(np.int16)
    return Image.fromarray(np.clip(np.asarray(img, np.int16) + grain, 0, 255).astype(np.uint8))


def photos(root: Path, start: int, stop: int, side: int = 96, classes: int = 10) -> None:
    for i in range(start, stop):
        path = root / f"category_{i % classes:02d}" / f"sku_{i:07d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        product_photo(i, side).save(path, quality=88)


def run(cmd: list[str], cwd: Path) -> int:
    """Bytes `cmd` wrote; raises with its output when it fails."""
    done = subprocess.run([sys.executable, "-c", WRITES, *cmd], cwd=cwd, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["rc"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result['out']}")
    return result["written"]


def catalog_listings(project: Path) -> set[str]:
    """The DVC cache's listings of the catalog's versions (this one and the commit's): DVC's record of
    the photos, not of the store."""
    texts = [(project / "data" / "raw" / "catalog.dvc").read_text()]
    texts.append(subprocess.run(["git", "show", "HEAD:data/raw/catalog.dvc"], cwd=project, capture_output=True,
                                text=True).stdout)
    md5s = {out["md5"] for text in texts if text for out in yaml.safe_load(text)["outs"]}
    return {f"{md5[:2]}/{md5[2:]}" for md5 in md5s}


def held(project: Path) -> int:
    """Bytes the project holds for the store and ledger: their workspace files, the DVC cache's
    objects, each inode once, and prepare's stat cache; the photos (data/raw, and their cache objects:
    the same inodes) and the catalog's listings left out."""
    seen = {os.lstat(os.path.join(parent, name)).st_ino
            for parent, _, files in os.walk(project / "data" / "raw") for name in files}
    listings = catalog_listings(project)
    stat = project / "data" / "prepared.stat.npy"
    total = stat.stat().st_size if stat.exists() else 0
    for top in ("data/prepared", "data/split_ledger", ".dvc/cache"):
        for parent, _, files in os.walk(project / top):
            for name in files:
                path = os.path.join(parent, name)
                st = os.lstat(path)
                if st.st_ino not in seen and "/".join(Path(path).parts[-2:]) not in listings:
                    seen.add(st.st_ino)
                    total += st.st_size
    return total


def store_bytes(project: Path) -> int:
    return sum(p.stat().st_size for p in (project / "data" / "prepared").rglob("*") if p.is_file())


def week(n: int, dirs: Path, args: argparse.Namespace) -> dict:
    """One size: the producer's first prepare, then the pulled machine's +10% update."""
    producer, pulled, remote = dirs / "producer", dirs / "pulled", dirs / "remote"
    for folder in (producer, pulled, remote):
        shutil.rmtree(folder, ignore_errors=True)
    copy_project(producer, (*PROJECT_FILES, ".dvc/config", ".dvc/.gitignore"))
    params = yaml.safe_load((producer / "params.yaml").read_text())
    params["data"].update(source="data/raw/catalog", stored_size=args.stored_size, encoding=args.encoding,
                          prepare_workers=args.workers)
    (producer / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    side = max(96, args.stored_size * 5 // 4)  # photos a little larger than the store keeps
    photos(producer / "data" / "raw" / "catalog", 0, n, side)
    for cmd in (["git", "init", "-q"], ["dvc", "remote", "add", "-q", "-d", "shared", str(remote)],
                ["dvc", "add", "-q", "data/raw/catalog"], ["dvc", "repro", "-q", "prepare"], ["dvc", "push", "-q", "prepare", "data/raw/catalog.dvc"],
                ["git", "add", "-A"], ["git", "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "week 1"]):
        run(cmd, producer)
    run(["git", "clone", "-q", str(producer), str(pulled)], dirs)
    run(["dvc", "pull", "-q", "prepare", "data/raw/catalog.dvc"], pulled)
    first = store_bytes(pulled)
    photos(pulled / "data" / "raw" / "catalog", n, n + n // 10, side)
    add = run(["dvc", "add", "-q", "data/raw/catalog"], pulled)
    repro = run(["dvc", "repro", "-q", "prepare"], pulled)
    report = json.loads((pulled / "metrics" / "data_report.json").read_text())
    index = json.loads((pulled / "data" / "prepared" / "index.json").read_text())
    result = {"photos": n, "new": n // 10, "encoding": index.get("encoding", "raw"), "store_before": first,
              "store": store_bytes(pulled), "held": held(pulled), "add_written": add, "repro_written": repro,
              "decoded": report["work"]["decoded"], "kept": report["work"]["kept"],
              "new_records": index["last_update"]["written_bytes"]}
    if not args.keep:
        for folder in (producer, pulled, remote):
            shutil.rmtree(folder, ignore_errors=True)
    return result


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(fixed, per unit of x) of the least-squares line through the points; (0, y/x) for one point."""
    if len(xs) < 2:
        return 0.0, ys[0] / xs[0]
    slope, fixed = np.polyfit(xs, ys, 1)
    return float(fixed), float(slope)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,2000,4000", help="photos before the update, comma-separated")
    parser.add_argument("--stored-size", type=int, default=64)
    parser.add_argument("--encoding", default="auto")
    parser.add_argument("--workers", default="auto")
    parser.add_argument("--dir", type=Path, default=Path("bench_out/pulled_update"))
    parser.add_argument("--keep", action="store_true", help="keep the last size's projects")
    args = parser.parse_args()
    dirs = args.dir.resolve()
    dirs.mkdir(parents=True, exist_ok=True)
    os.environ.update(DVC_NO_ANALYTICS="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    rows = [week(int(n), dirs, args) for n in args.sizes.split(",")]
    print(f"\nthe pulled machine's +10% update at stored_size {args.stored_size}, data.encoding {args.encoding} "
          f"({rows[0]['encoding']} store); MiB, and x the store after the update")
    print(f"{'photos':>8}{'+new':>6}{'store':>9}{'new recs':>10}{'dvc add':>9}{'repro wrote':>13}{'x':>7}"
          f"{'held':>9}{'x':>7}")
    mib = 2**20
    for r in rows:
        print(f"{r['photos']:>8}{r['new']:>6}{r['store'] / mib:>9.2f}{r['new_records'] / mib:>10.2f}"
              f"{r['add_written'] / mib:>9.2f}{r['repro_written'] / mib:>13.2f}{r['repro_written'] / r['store']:>7.3f}"
              f"{r['held'] / mib:>9.2f}{r['held'] / r['store']:>7.3f}")
    stores = [r["store"] for r in rows]
    for what in ("repro_written", "held", "new_records"):
        fixed, per = fit(stores, [r[what] for r in rows])
        print(f"{what:>14}: {fixed / mib:6.2f} MiB fixed + {per:.3f}x the store")
    out = dirs.parent / "pulled_update.json"
    out.write_text(json.dumps({"stored_size": args.stored_size, "encoding": args.encoding, "rows": rows,
                               "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, indent=2))


if __name__ == "__main__":
    main()

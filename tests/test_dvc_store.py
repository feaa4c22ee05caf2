"""The store held once, through the commands users run: real `dvc repro prepare`, `dvc push` and
`dvc pull` in copies of the project with its own .dvc/config. A +10% update writes about the new
images' bytes, and the workspace and the DVC cache together hold the store about once, on the
machine that produced it and on one whose store came from `dvc pull`, raw and in the JPEG store
`data.encoding: auto` picks for photos."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from cnnpipe.data.store.shards import data_fingerprint
from conftest import ROOT, base_params, colour_image, copy_project, meta_lines, save_image, tiny_params, write_params

pytestmark = pytest.mark.slow

WRITES = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
          "print('WRITTEN', resource.getrusage(resource.RUSAGE_CHILDREN).ru_oublock * 512); sys.exit(done.returncode)")
"""Runs a command and prints the bytes it and every process under it wrote to the disk (the kernel's
per-task write accounting, summed over the reaped children)."""


def sh(cmd: list[str], cwd: Path) -> str:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def repro_writes(project: Path) -> int:
    """Bytes written to the disk by `dvc repro prepare` and everything it ran."""
    out = sh([sys.executable, "-c", WRITES, "dvc", "repro", "prepare"], project)
    return int(out.rsplit("WRITTEN ", 1)[1].split()[0])


def held(project: Path, skip: set[int] = frozenset(), skip_names: set[str] = frozenset()) -> int:
    """Bytes the project holds for the store: workspace outputs and DVC cache, each inode once (but
    the inodes in `skip`, and cache objects named `skip_names`: "ab/cdef...")."""
    seen, total = set(skip), 0
    for top in ("data/prepared", "data/split_ledger", ".dvc/cache"):
        for parent, _, files in os.walk(project / top):
            for name in files:
                st = os.lstat(os.path.join(parent, name))
                if st.st_ino not in seen and f"{Path(parent).name}/{name}" not in skip_names:
                    seen.add(st.st_ino)
                    total += st.st_size
    return total


def store_bytes(project: Path) -> int:
    return sum(p.stat().st_size for p in (project / "data" / "prepared").rglob("*") if p.is_file())


def photos(root: Path, start: int, stop: int) -> None:
    for i in range(start, stop):
        save_image(root / f"class{i % 4}" / f"{i:05d}.jpg", colour_image(i, (36, 36)), quality=90)


def test_an_update_through_dvc_repro_writes_the_new_bytes_and_the_store_is_held_once(tmp_path):
    producer = copy_project(tmp_path / "producer")
    catalog = producer / "data" / "raw" / "catalog"
    photos(catalog, 0, 1000)
    params = tiny_params()
    # 128 px, a catalog's usual stored size (49 KB an image): DVC's own bookkeeping of the input files
    # (~1 KB a file and run, in its state database) counts in what `dvc repro` writes, too.
    # Raw: a JPEG store's update also journals each new photo's raw pixels (transient, in prepared.work)
    # before encoding it, so its writes are not "the new bytes" of the store (docs/data.md).
    params["data"].update(source="data/raw/catalog", stored_size=128, image_size=32, shard_mb=2, encoding="raw")
    write_params(producer / "params.yaml", params)
    sh(["git", "init", "-q"], producer)
    sh(["dvc", "remote", "add", "-q", "-d", "shared", str(tmp_path / "remote")], producer)

    written_full = repro_writes(producer)
    store = store_bytes(producer)
    if written_full < store:
        pytest.skip(f"this filesystem does not account writes per process ({written_full} B written for a "
                    f"{store} B store): nothing to measure")
    assert held(producer) <= 1.3 * store
    sh(["dvc", "push", "-q", "prepare"], producer)
    sh(["git", "add", "-A"], producer)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "week 1"], producer)

    pulled = tmp_path / "pulled"  # another machine: the code from git, the data from the remote
    sh(["git", "clone", "-q", str(producer), str(pulled)], tmp_path)
    sh(["dvc", "pull", "-q", "prepare"], pulled)
    assert data_fingerprint(pulled / "data" / "prepared") == data_fingerprint(producer / "data" / "prepared")
    assert held(pulled) <= 1.3 * store

    results = {}
    for name, project in (("producer", producer), ("pulled", pulled)):
        photos(project / "data" / "raw" / "catalog", 1000, 1100)  # the week's +10%
        written = repro_writes(project)
        report = json.loads((project / "metrics" / "data_report.json").read_text())
        assert report["work"]["decoded"] == 100 and report["work"]["kept"] == 1000, name
        assert report["changes"]["moved_between_splits"] == 0 and report["ledger"]["records_added"] == 100
        new_store = store_bytes(project)
        results[name] = (written / new_store, held(project) / new_store)
        print(f"{name}: store {new_store} B; the update wrote {written} B ({written / new_store:.2f}x), "
              f"the project holds {held(project)} B ({held(project) / new_store:.2f}x)")
        assert written <= 0.35 * new_store, (name, written, new_store)
        assert held(project) <= 1.3 * new_store, (name, held(project), new_store)
    assert data_fingerprint(pulled / "data" / "prepared") == data_fingerprint(producer / "data" / "prepared")
    assert "up to date" in sh(["dvc", "status", "prepare"], pulled).lower() or "changed" not in \
        sh(["dvc", "status", "prepare"], pulled)


def product_photo(i: int, side: int = 240) -> np.ndarray:
    """A product shot as JPEG stores see them: a white backdrop, one smooth object, sensor grain."""
    rng = np.random.default_rng(i)
    y, x = np.mgrid[0:side, 0:side] / side
    cy, cx, r = rng.uniform(0.35, 0.65), rng.uniform(0.35, 0.65), rng.uniform(0.2, 0.35)
    inside = ((y - cy) ** 2 + (x - cx) ** 2 < r * r)[..., None]
    shade = (1.2 - 0.5 * y)[..., None] * rng.integers(30, 220, 3)
    image = np.where(inside, shade, 248.0) + rng.normal(0, 3, (side, side, 1))
    return np.clip(image, 0, 255).astype(np.uint8)


def product_photos(root: Path, start: int, stop: int) -> None:
    for i in range(start, stop):
        save_image(root / f"class{i % 4}" / f"{i:05d}.jpg", product_photo(i), quality=88)


def test_a_pulled_machines_weekly_update_of_the_default_jpeg_store_writes_its_new_records_and_holds_it_once(tmp_path):
    """Where a second node or CI stands: `git clone`, `dvc pull`, the week's photos `dvc add`ed, `dvc
    repro prepare`, with the store `data.encoding: auto` picks (JPEG at 224 px). The journal holds
    JPEG records, not raw pixels, and the metadata lines are sealed segments the update links and
    extends: it writes about the new records (DVC's own bookkeeping included) and the project
    holds the store about once."""
    producer = copy_project(tmp_path / "producer")
    shutil.copy(ROOT / ".dvc" / ".gitignore", producer / ".dvc" / ".gitignore")  # no DVC cache in git
    product_photos(producer / "data" / "raw" / "catalog", 0, 2000)
    params = tiny_params()
    params["data"].update(source="data/raw/catalog", stored_size=224, image_size=32)
    assert params["data"]["encoding"] == base_params()["data"]["encoding"] == "auto"  # the default store
    write_params(producer / "params.yaml", params)
    sh(["git", "init", "-q"], producer)
    sh(["dvc", "remote", "add", "-q", "-d", "shared", str(tmp_path / "remote")], producer)
    sh(["dvc", "add", "-q", "data/raw/catalog"], producer)
    sh(["dvc", "repro", "-q", "prepare"], producer)
    assert json.loads((producer / "data" / "prepared" / "index.json").read_text())["encoding"] == "jpeg"
    sh(["dvc", "push", "-q", "prepare", "data/raw/catalog.dvc"], producer)
    sh(["git", "add", "-A"], producer)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "week 1"], producer)

    pulled = tmp_path / "pulled"
    sh(["git", "clone", "-q", str(producer), str(pulled)], tmp_path)
    sh(["dvc", "pull", "-q", "prepare", "data/raw/catalog.dvc"], pulled)
    product_photos(pulled / "data" / "raw" / "catalog", 2000, 2200)  # the week's +10%
    sh(["dvc", "add", "-q", "data/raw/catalog"], pulled)
    written = repro_writes(pulled)
    report = json.loads((pulled / "metrics" / "data_report.json").read_text())
    assert report["work"]["decoded"] == 200 and report["work"]["kept"] == 2000
    store = store_bytes(pulled)
    if written < 0.05 * store:
        pytest.skip(f"this filesystem does not account writes per process ({written} B written): nothing to measure")
    # What the project holds for the store: the catalog's photos and DVC's listings of them left out.
    photos = {os.lstat(p).st_ino for p in (pulled / "data" / "raw").rglob("*") if p.is_file()}
    listings = {yaml.safe_load(text)["outs"][0]["md5"] for text in (
        (pulled / "data" / "raw" / "catalog.dvc").read_text(),
        sh(["git", "show", "HEAD:data/raw/catalog.dvc"], pulled))}
    holds = held(pulled, skip=photos, skip_names={f"{m[:2]}/{m[2:]}" for m in listings})
    stat_cache = pulled / "data" / "prepared.stat.npy"  # this machine's stat cache
    holds += stat_cache.stat().st_size if stat_cache.exists() else 0
    print(f"pulled: store {store} B; the update wrote {written} B ({written / store:.2f}x), the project holds "
          f"{holds} B ({holds / store:.2f}x)")
    assert written <= 0.35 * store, (written, store)
    assert holds <= 1.3 * store, (holds, store)
    index = json.loads((pulled / "data" / "prepared" / "index.json").read_text())
    assert len(index["meta"]) == 2 and index["meta"][1]["lines"] == 200  # the week's lines only


def test_a_catalog_seen_before_never_brings_back_an_older_ledger(tmp_path):
    """DVC's run cache would restore week 1's store and ledger when the catalog is week 1's again,
    forgetting the photos week 2 held out; prepare stays out of it (a persistent report)."""
    project = copy_project(tmp_path / "project")
    catalog = project / "data" / "raw" / "catalog"
    photos(catalog, 0, 200)
    params = tiny_params()
    params["data"].update(source="data/raw/catalog", stored_size=8, image_size=8)
    write_params(project / "params.yaml", params)
    sh(["git", "init", "-q"], project)
    sh(["dvc", "repro", "prepare"], project)  # week 1
    week2 = tmp_path / "week2"
    photos(week2, 200, 300)
    shutil.copytree(week2, catalog, dirs_exist_ok=True)
    sh(["dvc", "repro", "prepare"], project)  # week 2: 100 new photos, some held out
    held = {s: meta["source"] for s in ("val", "test")
            for meta in meta_lines(project / "data" / "prepared", s)}
    new_held = {path for path in held.values() if int(Path(path).stem) >= 200}
    assert new_held
    for path in week2.rglob("*.jpg"):  # week 3: the catalog is exactly week 1's again
        (catalog / path.relative_to(week2)).unlink()
    out = sh(["dvc", "repro", "prepare"], project)
    assert "Running stage 'prepare'" in out  # run, not restored from the run cache
    shutil.copytree(week2, catalog, dirs_exist_ok=True)  # week 4: they are back
    sh(["dvc", "repro", "prepare"], project)
    train = {meta["source"] for meta in meta_lines(project / "data" / "prepared", "train")}
    assert not new_held & train


def test_dvc_repro_after_a_change_of_encoding_converts_the_store_from_its_own_pixels(tmp_path):
    """`dvc exp run -S data.encoding=jpeg` on a raw store: DVC removes the store first, prepare finds
    it in the DVC cache through dvc.lock and encodes its pixels; no photo is read, no split moves."""
    project = copy_project(tmp_path / "project")
    photos(project / "data" / "raw" / "catalog", 0, 200)
    params = tiny_params()
    params["data"].update(source="data/raw/catalog", stored_size=32, image_size=32, encoding="raw")
    write_params(project / "params.yaml", params)
    sh(["git", "init", "-q"], project)
    sh(["dvc", "repro", "-q", "prepare"], project)

    params["data"]["encoding"] = "jpeg"
    write_params(project / "params.yaml", params)
    assert "data.encoding" in sh(["dvc", "status", "prepare"], project)  # the param change makes it stale
    sh(["dvc", "repro", "-q", "prepare"], project)
    report = json.loads((project / "metrics" / "data_report.json").read_text())
    assert report["work"]["read"] == 0 and report["work"]["decoded"] == 0 and report["work"]["copied"] == 200
    assert report["changes"]["moved_between_splits"] == 0 and report["ledger"]["records_added"] == 0
    assert all(change == {"gained": 0, "lost": 0} for change in report["changes"]["splits"].values())
    index = json.loads((project / "data" / "prepared" / "index.json").read_text())
    assert index["encoding"] == "jpeg" and all(s["name"].endswith(".jpg") for s in index["shards"])

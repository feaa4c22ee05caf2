"""Sealed shards: an update writes only what is new, a grown store trains like a fresh one, and the
content split is linear (one sort) yet draws what the per-class loop drew."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cnnpipe.config import DataConfig
from cnnpipe.data.loaders.host import build_train_loader
from cnnpipe.data.loaders.transforms import AugmentConfig
from cnnpipe.data.prepare import prepare
from cnnpipe.data.splits.draw import content_split, hashed_unit
from cnnpipe.data.store.shards import SHARDS, data_fingerprint, open_split, read_index
from conftest import colour_image, meta_lines, save_image

DVC = [sys.executable, "-m", "dvc"]


def make_catalog(root: Path, start: int, stop: int, classes: int = 4, side: int = 36) -> None:
    """Product photos `start`..`stop`-1, as small JPEGs in `classes` folders."""
    for i in range(start, stop):
        save_image(root / f"class{i % classes}" / f"{i:06d}.jpg", colour_image(i, (side, side)), quality=90)


def shard_md5s(store: Path) -> dict[str, str]:
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in sorted((store / SHARDS).glob("*.u8"))}


def cache_bytes(project: Path) -> int:
    return sum(p.stat().st_size for p in (project / ".dvc" / "cache").rglob("*") if p.is_file())


def split_view(store: Path) -> dict[str, tuple[bytes, bytes, list[str]]]:
    """What training reads from each split: pixels, labels and sources, in the store's order."""
    out = {}
    for split in ("train", "val", "test"):
        data = open_split(store, split)
        sources = [meta["source"] for meta in meta_lines(store, split)]
        out[split] = (np.asarray(data.images).tobytes(), data.labels.tobytes(), sources)
    return out


def test_a_ten_percent_update_keeps_every_old_shard_and_caches_about_the_new_bytes(tmp_path):
    """10,000 photos, then 1,000 more, each store committed to a real DVC cache."""
    project = tmp_path / "project"
    project.mkdir()
    subprocess.run([*DVC, "init", "--no-scm", "-q"], cwd=project, check=True)
    make_catalog(project / "catalog", 0, 10_000)
    cfg = DataConfig(source=str(project / "catalog"), stored_size=32, image_size=32, shard_mb=1,
                     encoding="raw")  # `auto` would store 32 px colour as JPEG (tests/test_jpeg_store.py)
    store, report = project / "prepared", project / "report.json"

    prepare(cfg, 0, store, report)
    subprocess.run([*DVC, "add", "-q", "prepared"], cwd=project, check=True)
    before, cached_before = shard_md5s(store), cache_bytes(project)
    store_bytes = sum(p.stat().st_size for p in (store / SHARDS).glob("*.u8"))
    assert len(before) >= 30  # 30 MB of pixels in 1 MiB shards

    make_catalog(project / "catalog", 10_000, 11_000)
    second = prepare(cfg, 0, store, report)
    subprocess.run([*DVC, "add", "-q", "prepared"], cwd=project, check=True)
    after = shard_md5s(store)

    assert {name: after.get(name) for name in before} == before  # every old shard kept, byte for byte
    frame = 32 * 32 * 3
    assert second["work"]["decoded"] == 1_000 and second["work"]["kept"] == 10_000
    assert read_index(store)["last_update"]["written_bytes"] == 1_000 * frame  # no old frame rewritten
    new_pixels = sum(p.stat().st_size for p in (store / SHARDS).glob("*.u8") if p.name not in before)
    assert new_pixels == 1_000 * frame
    growth = cache_bytes(project) - cached_before
    # The new pixels, plus the per-image lists (meta lines ~130 bytes an image, rewritten): at most a
    # quarter of the store, where one file per split made every update a whole new copy.
    print(f"store {store_bytes} B, new pixels {new_pixels} B, DVC cache growth {growth} B")
    assert 1_000 * frame <= growth <= store_bytes / 4, (growth, store_bytes)


def train_a_few_steps(store: Path) -> dict[str, torch.Tensor]:
    """A tiny model trained on `store` for four steps of the fast loader."""
    torch.manual_seed(0)
    split = open_split(store, "train")
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(4, split.num_classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = build_train_loader(split, kind="fast", batch_size=16, aug=AugmentConfig(12), mean=(0.5,) * 3,
                                std=(0.25,) * 3, seed=0)
    for step, (images, labels) in zip(range(4), loader):
        loss = torch.nn.functional.cross_entropy(model(loader.device_transform(images)), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.state_dict()


def test_a_store_grown_week_by_week_trains_the_same_model_as_one_built_at_once(tmp_path):
    cfg = DataConfig(source=str(tmp_path / "catalog"), stored_size=16, image_size=16, prepare_workers=1,
                     shard_mb=0.01)  # 13 images a shard: the two layouts differ everywhere
    make_catalog(tmp_path / "catalog", 0, 300, side=20)
    prepare(cfg, 0, tmp_path / "grown", tmp_path / "r.json")
    make_catalog(tmp_path / "catalog", 300, 360, side=20)
    prepare(cfg, 0, tmp_path / "grown", tmp_path / "r.json")
    prepare(cfg, 0, tmp_path / "scratch", tmp_path / "r2.json")

    assert shard_md5s(tmp_path / "grown") != shard_md5s(tmp_path / "scratch")  # different layouts...
    assert split_view(tmp_path / "grown") == split_view(tmp_path / "scratch")  # ...the same data
    assert data_fingerprint(tmp_path / "grown") == data_fingerprint(tmp_path / "scratch")
    grown, scratch = train_a_few_steps(tmp_path / "grown"), train_a_few_steps(tmp_path / "scratch")
    assert all(torch.equal(grown[k], scratch[k]) for k in grown)


def test_removed_photos_are_tombstones_until_a_shard_is_mostly_dead(tmp_path):
    root = tmp_path / "catalog"
    cfg = DataConfig(source=str(root), stored_size=16, image_size=16, prepare_workers=1, shard_mb=0.01)
    make_catalog(root, 0, 200, side=20)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    first = read_index(tmp_path / "p")
    # Remove one photo in ten: every shard keeps most of its rows, none is rewritten.
    for path in sorted(root.rglob("*.jpg"))[::10]:
        path.unlink()
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    second = read_index(tmp_path / "p")
    assert second["last_update"] == {"compacted_shards": 0, "moved_rows": 0, "written_bytes": 0}
    assert sum(s["rows"] - s["live"] for s in second["shards"]) == 20  # the tombstones
    assert sorted(s["name"] for s in second["shards"]) == sorted(s["name"] for s in first["shards"])

    # Remove most of them: mostly dead shards are compacted, and the store still reads as a fresh one.
    for path in sorted(root.rglob("*.jpg"))[::4] + sorted(root.rglob("*.jpg"))[1::4]:
        path.unlink(missing_ok=True)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    third = read_index(tmp_path / "p")
    assert third["last_update"]["compacted_shards"] > 0 and third["last_update"]["moved_rows"] > 0
    assert all(s["live"] >= s["rows"] / 2 for s in third["shards"])
    prepare(cfg, 0, tmp_path / "scratch", tmp_path / "r2.json")
    assert split_view(tmp_path / "p") == split_view(tmp_path / "scratch")


def test_a_store_of_the_one_file_per_split_format_is_upgraded_from_its_pixels(tmp_path):
    """A store written before shards (`<split>.u8`): its pixels are copied once, not decoded."""
    root = tmp_path / "catalog"
    cfg = DataConfig(source=str(root), stored_size=16, image_size=16, prepare_workers=1)
    make_catalog(root, 0, 60, side=20)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    store = tmp_path / "p"
    index = read_index(store)
    for split in ("train", "val", "test"):  # rewrite it the old way: one pixel file per split
        data = open_split(store, split)
        (store / f"{split}.u8").write_bytes(np.asarray(data.images).tobytes())
        (store / f"{split}_rows.npy").unlink()
    shutil.rmtree(store / SHARDS)
    index["format"] = 1
    (store / "index.json").write_text(json.dumps(index))
    report = prepare(cfg, 0, store, tmp_path / "r.json")
    assert report["work"]["decoded"] == 0 and report["work"]["copied"] == 60
    prepare(cfg, 0, tmp_path / "scratch", tmp_path / "r2.json")
    assert split_view(store) == split_view(tmp_path / "scratch")


def content_split_per_class(digests, labels, held_out, seed):
    """The rule as first written, one pass per split and class (O(splits x classes x N))."""
    labels = np.asarray(labels)
    units = np.array([hashed_unit(d, seed) for d in digests])
    names = np.full(len(units), "train", dtype=object)
    low = 0.0
    for name, fraction in held_out:
        names[(units >= low) & (units < low + fraction)] = name
        low += fraction
    for name, _ in held_out:
        for label in np.unique(labels):
            members = np.flatnonzero(labels == label)
            train = members[names[members] == "train"]
            if len(members) >= 3 and not (names[members] == name).any() and len(train) >= 2:
                names[train[np.argmin(units[train])]] = name
    return names


@pytest.mark.parametrize("case", range(40))
def test_the_one_sort_content_split_draws_what_the_per_class_loop_drew(case):
    rng = np.random.default_rng(case)
    n = int(rng.integers(0, 60))
    labels = rng.integers(0, int(rng.integers(1, 12)), n) * int(rng.integers(1, 4))  # gaps in the labels
    digests = [f"{rng.integers(0, 10**6 if case % 3 else 20)}" for _ in range(n)]  # some equal hashes
    held_out = [("test", float(rng.uniform(0.05, 0.4))), ("val", float(rng.uniform(0.05, 0.4)))][: 1 + case % 2]
    expected = content_split_per_class(digests, labels, held_out, case)
    assert list(content_split(digests, labels, held_out, case)) == list(expected)


def test_an_empty_selection_or_split_reads_as_an_empty_array(tmp_path):
    cfg = DataConfig(source=str(tmp_path / "catalog"), stored_size=16, image_size=16, prepare_workers=1, shard_mb=0.01)
    make_catalog(tmp_path / "catalog", 0, 40, side=20)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    images = open_split(tmp_path / "p", "train").images
    assert images[[]].shape == (0, 16, 16, 3) and images[np.zeros(len(images), bool)].shape == (0, 16, 16, 3)
    assert np.asarray(images[:0]).shape == (0, 16, 16, 3)

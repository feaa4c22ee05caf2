"""A JPEG store: the same images, order and splits as a raw one, decoded within JPEG's tolerance, with
every property of the sealed shards (grown equals built at once, a +10% update keeps every old shard,
tombstones and compaction), `auto`'s choice, and a rebuild (from the raw store's own pixels) when the
encoding or quality changes."""

import hashlib
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import simplejpeg

from cnnpipe.config import DataConfig, ParamsError
from cnnpipe.data.store import codec
from cnnpipe.data.splits.held_out import subset
from cnnpipe.data.prepare import prepare, prepare_fashion_mnist, store_encoding
from cnnpipe.data.store.shards import SHARDS, data_fingerprint, open_split, read_index
from cnnpipe.train.recipe import STORE_KEYS, input_recipe, photo_input, recipe_differences, store_recipe
from conftest import colour_image, meta_lines, save_image
from test_shards import make_catalog, split_view, train_a_few_steps

DVC = [sys.executable, "-m", "dvc"]


def smooth_image(seed: int, side: int) -> np.ndarray:
    """A photo-like (side, side, 3) image: smooth colour gradients and a sharp-edged square."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side] / side
    channels = [128 + 100 * np.sin(2 * np.pi * (rng.uniform(0.3, 1.5) * x + rng.uniform(0.3, 1.5) * y)
                                   + rng.uniform(0, 6)) for _ in range(3)]
    image = np.stack(channels, -1)
    a, b = sorted(rng.integers(side // 8, side - side // 8, 2))
    image[a:b, a:b] = rng.integers(0, 255, 3)
    return image.clip(0, 255).astype(np.uint8)


def make_photos(root: Path, start: int, stop: int, side: int = 40, classes: int = 4, smooth: bool = True) -> None:
    for i in range(start, stop):
        pixels = smooth_image(i, side) if smooth else colour_image(i, (side, side))
        save_image(root / f"class{i % classes}" / f"{i:06d}.png", pixels)


def shard_md5s(store: Path) -> dict[str, str]:
    """Every shard file, records and offsets, by name."""
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in sorted((store / SHARDS).iterdir())}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def test_a_jpeg_store_holds_the_raw_stores_images_in_the_same_order_and_splits(tmp_path):
    make_photos(tmp_path / "catalog", 0, 120)
    common = dict(source=str(tmp_path / "catalog"), stored_size=32, image_size=32, prepare_workers=1, shard_mb=0.02)
    prepare(DataConfig(**common, encoding="raw"), 0, tmp_path / "raw", tmp_path / "r1.json")
    prepare(DataConfig(**common, encoding="jpeg", quality=90), 0, tmp_path / "jpeg", tmp_path / "r2.json")

    index = read_index(tmp_path / "jpeg")
    assert index["encoding"] == "jpeg" and index["quality"] == 90 and "encoding" not in read_index(tmp_path / "raw")
    assert len(index["shards"]) > 1 and all(s["name"].endswith(".jpg") for s in index["shards"])
    for split in ("train", "val", "test"):
        raw, jpeg = open_split(tmp_path / "raw", split), open_split(tmp_path / "jpeg", split)
        assert len(raw) > 0 and np.array_equal(raw.labels, jpeg.labels)
        assert meta_lines(tmp_path / "raw", split) == meta_lines(tmp_path / "jpeg", split)
        exact, decoded = np.asarray(raw.images), np.asarray(jpeg.images)
        assert decoded.shape == exact.shape and decoded.dtype == np.uint8
        # Exactly the codec's round trip of the raw store's pixels: the same pixels went in, once.
        assert np.array_equal(decoded, np.stack([codec.decode(codec.encode(a, 90), 3) for a in exact]))
        # These photos at 32 px, quality 90, 4:2:0: median 32 dB (5th percentile 27.6, worst 25.4 dB,
        # on a sharp-edged colour square that 4:2:0 chroma blurs); real photos give 32-35 dB at 64-224 px.
        assert np.median([psnr(a, b) for a, b in zip(exact, decoded)]) > 30
        # Every way of reading gives the same decoded pixels: one image, a batch across shards, a slice.
        picks = np.array([len(jpeg) - 1, 0, len(jpeg) // 2])
        assert np.array_equal(jpeg.images[picks], decoded[picks])
        assert np.array_equal(jpeg.images[1], decoded[1]) and np.array_equal(np.asarray(jpeg.images[1:3]), decoded[1:3])
        assert np.array_equal(np.asarray(pickle.loads(pickle.dumps(jpeg)).images), decoded)  # a worker's copy
        # Some rows as a split of their own (the delivery check's new photos, the held-out ones left out).
        part = subset(jpeg, picks)
        assert np.array_equal(np.asarray(part.images), decoded[picks]) and np.array_equal(part.labels, jpeg.labels[picks])
        assert np.array_equal(np.asarray(pickle.loads(pickle.dumps(part)).images), decoded[picks])
    assert data_fingerprint(tmp_path / "raw") != data_fingerprint(tmp_path / "jpeg")  # other pixels, other runs


def test_a_jpeg_store_grown_week_by_week_trains_the_same_model_as_one_built_at_once(tmp_path):
    cfg = DataConfig(source=str(tmp_path / "catalog"), stored_size=16, image_size=16, prepare_workers=1,
                     shard_mb=0.01, encoding="jpeg")  # ~15 records a shard: the two layouts differ everywhere
    make_photos(tmp_path / "catalog", 0, 300, side=20, smooth=False)
    prepare(cfg, 0, tmp_path / "grown", tmp_path / "r.json")
    make_photos(tmp_path / "catalog", 300, 360, side=20, smooth=False)
    prepare(cfg, 0, tmp_path / "grown", tmp_path / "r.json")
    prepare(cfg, 0, tmp_path / "scratch", tmp_path / "r2.json")

    assert shard_md5s(tmp_path / "grown") != shard_md5s(tmp_path / "scratch")  # different layouts...
    assert split_view(tmp_path / "grown") == split_view(tmp_path / "scratch")  # ...the same data
    assert data_fingerprint(tmp_path / "grown") == data_fingerprint(tmp_path / "scratch")
    grown, scratch = train_a_few_steps(tmp_path / "grown"), train_a_few_steps(tmp_path / "scratch")
    assert all(np.array_equal(grown[k].numpy(), scratch[k].numpy()) for k in grown)


def test_a_ten_percent_update_of_a_jpeg_store_keeps_every_old_shard_byte_for_byte(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    subprocess.run([*DVC, "init", "--no-scm", "-q"], cwd=project, check=True)
    make_photos(project / "catalog", 0, 1000, side=36, smooth=False)
    cfg = DataConfig(source=str(project / "catalog"), stored_size=32, image_size=32, shard_mb=0.05, encoding="jpeg")
    store = project / "prepared"
    prepare(cfg, 0, store, project / "report.json")
    subprocess.run([*DVC, "add", "-q", "prepared"], cwd=project, check=True)  # links the store to the cache
    before = shard_md5s(store)
    inodes = {n: (store / SHARDS / n).stat().st_ino for n in before}
    assert len(before) >= 2 * 10  # records and offsets of 10+ shards

    make_photos(project / "catalog", 1000, 1100, side=36, smooth=False)
    second = prepare(cfg, 0, store, project / "report.json")
    after = shard_md5s(store)
    assert {name: after.get(name) for name in before} == before  # every old shard and sidecar kept
    assert second["work"]["decoded"] == 100 and second["work"]["kept"] == 1000
    new_records = sum((store / SHARDS / n).stat().st_size for n in after if n not in before and n.endswith(".jpg"))
    assert read_index(store)["last_update"]["written_bytes"] == new_records  # only the new records written
    assert {n: (store / SHARDS / n).stat().st_ino for n in before} == inodes  # hard-linked, not copied


def test_removed_photos_are_tombstones_in_a_jpeg_store_until_its_shards_are_compacted(tmp_path):
    root = tmp_path / "catalog"
    cfg = DataConfig(source=str(root), stored_size=16, image_size=16, prepare_workers=1, shard_mb=0.01,
                     encoding="jpeg")
    make_catalog(root, 0, 200, side=20)  # test_shards' catalog: the same splits as its raw twin
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    first = shard_md5s(tmp_path / "p")
    for path in sorted(root.rglob("*.jpg"))[::10]:
        path.unlink()
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    assert read_index(tmp_path / "p")["last_update"] == {"compacted_shards": 0, "moved_rows": 0, "written_bytes": 0}
    assert shard_md5s(tmp_path / "p") == first

    for path in sorted(root.rglob("*.jpg"))[::4] + sorted(root.rglob("*.jpg"))[1::4]:
        path.unlink(missing_ok=True)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    third = read_index(tmp_path / "p")
    assert third["last_update"]["compacted_shards"] > 0 and third["last_update"]["moved_rows"] > 0
    assert all(s["live"] >= s["rows"] / 2 for s in third["shards"])
    prepare(cfg, 0, tmp_path / "scratch", tmp_path / "r2.json")
    assert split_view(tmp_path / "p") == split_view(tmp_path / "scratch")  # moved as bytes, not re-encoded


def test_auto_keeps_fashion_mnist_at_32_px_raw_and_stores_128_px_photos_as_jpeg(tmp_path, fake_fmnist):
    assert store_encoding(DataConfig(), 1) == {}  # the default run: Fashion-MNIST, 32 px, one channel
    assert store_encoding(DataConfig(stored_size=128), 3)["encoding"] == "jpeg"
    prepare_fashion_mnist(DataConfig(), 0, tmp_path / "fm", search_dirs=(fake_fmnist,))
    assert "encoding" not in read_index(tmp_path / "fm") and list((tmp_path / "fm" / SHARDS).glob("*.u8"))

    make_photos(tmp_path / "catalog", 0, 24, side=140)
    prepare(DataConfig(source=str(tmp_path / "catalog"), stored_size=128, prepare_workers=1), 0,
            tmp_path / "photos", tmp_path / "r.json")
    index = read_index(tmp_path / "photos")
    assert index["encoding"] == "jpeg" and index["channels"] == 3
    assert open_split(tmp_path / "photos", "train").images[0].shape == (128, 128, 3)


def test_a_grayscale_jpeg_store_stays_one_channel(tmp_path, fake_fmnist):
    prepare_fashion_mnist(DataConfig(encoding="jpeg"), 0, tmp_path / "fm", search_dirs=(fake_fmnist,))
    prepare_fashion_mnist(DataConfig(encoding="raw"), 0, tmp_path / "raw", search_dirs=(fake_fmnist,))
    index = read_index(tmp_path / "fm")
    first = (tmp_path / "fm" / SHARDS / index["shards"][0]["name"]).read_bytes()
    assert simplejpeg.decode_jpeg_header(first)[2] == "Gray"  # the record itself is one channel
    jpeg, raw = open_split(tmp_path / "fm", "test"), open_split(tmp_path / "raw", "test")
    assert jpeg.channels == 1 and np.asarray(jpeg.images).shape == np.asarray(raw.images).shape
    assert np.array_equal(jpeg.labels, raw.labels)


def test_changing_the_encoding_or_quality_rebuilds_the_store_a_raw_one_from_its_own_pixels(tmp_path):
    root = tmp_path / "catalog"
    make_photos(root, 0, 80, side=40)
    common = dict(source=str(root), stored_size=32, image_size=32, prepare_workers=1, shard_mb=0.02)
    store = tmp_path / "p"
    prepare(DataConfig(**common, encoding="raw"), 0, store, tmp_path / "r.json")
    raw_view, raw_fingerprint = split_view(store), data_fingerprint(store)
    rule = (store / "split_rule.json").read_text()

    converted = prepare(DataConfig(**common, encoding="jpeg"), 0, store, tmp_path / "r.json")
    assert converted["work"]["decoded"] == 0 and converted["work"]["read"] == 0  # no catalog file read
    assert converted["work"]["copied"] == 80
    assert json.loads((store / "recipe.json").read_text())["encoding"] == "jpeg"
    assert (store / "split_rule.json").read_text() == rule and converted["changes"]["moved_between_splits"] == 0
    assert all(change == {"gained": 0, "lost": 0} for change in converted["changes"]["splits"].values())
    prepare(DataConfig(**common, encoding="jpeg"), 0, tmp_path / "scratch", tmp_path / "r2.json")
    assert split_view(store) == split_view(tmp_path / "scratch")  # the same records as one built from the photos

    requality = prepare(DataConfig(**common, encoding="jpeg", quality=70), 0, store, tmp_path / "r.json")
    assert requality["work"]["decoded"] == 80  # lossy pixels are never encoded again: decoded from the photos
    assert read_index(store)["quality"] == 70 and split_view(store) != split_view(tmp_path / "scratch")

    back = prepare(DataConfig(**common, encoding="raw"), 0, store, tmp_path / "r.json")
    assert back["work"]["decoded"] == 80  # from the photos again: the JPEG store's pixels are not the originals
    assert split_view(store) == raw_view and data_fingerprint(store) == raw_fingerprint


def test_a_jpeg_shard_without_its_offsets_is_named_when_opened(tmp_path):
    make_photos(tmp_path / "catalog", 0, 30, side=20)
    cfg = DataConfig(source=str(tmp_path / "catalog"), stored_size=16, prepare_workers=1, encoding="jpeg")
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    next((tmp_path / "p" / SHARDS).glob("*.off")).unlink()
    with pytest.raises(ValueError, match=r"offsets .*\.off are missing.*dvc repro prepare"):
        open_split(tmp_path / "p", "train")


@pytest.mark.parametrize("key, value", [("encoding", "png"), ("quality", 0), ("quality", 101), ("quality", True)])
def test_a_bad_encoding_or_quality_names_its_key(key, value):
    with pytest.raises(ParamsError, match=rf"data\.{key}"):
        DataConfig(**{key: value})


def test_predict_reads_a_photo_as_the_jpeg_store_holds_it_and_the_gate_sees_the_encoding(tmp_path):
    make_photos(tmp_path / "catalog", 0, 30, side=40)
    cfg = DataConfig(source=str(tmp_path / "catalog"), stored_size=32, image_size=32, prepare_workers=1,
                     encoding="jpeg")
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    recipe = input_recipe(cfg, 3, (0.5,) * 3, (0.25,) * 3)
    train = open_split(tmp_path / "p", "train")
    source = meta_lines(tmp_path / "p", "train")[0]["source"]
    photo = photo_input(recipe, tmp_path / "catalog" / source, cfg.max_pixels)
    assert np.array_equal(photo, train.images[0])  # predict's pixels are training's, bit for bit
    raw_recipe = input_recipe(DataConfig(**{**cfg.__dict__, "encoding": "raw"}), 3, (0.5,) * 3, (0.25,) * 3)
    assert not np.array_equal(photo_input(raw_recipe, tmp_path / "catalog" / source, cfg.max_pixels), photo)
    store = store_recipe(read_index(tmp_path / "p"))
    assert recipe_differences(recipe, store, STORE_KEYS) == []
    assert recipe_differences(raw_recipe, store, STORE_KEYS) == [f"stored_as: 'raw' != {store['stored_as']!r}"]

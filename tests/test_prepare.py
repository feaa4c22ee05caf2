"""The prepare stage on Fashion-MNIST-format files and on real image folders made with PIL."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cnnpipe.config import DataConfig
from cnnpipe.data.sources import idx
from cnnpipe.data.ingest.decode import decode_file, to_rgb
from cnnpipe.data.prepare import DataError, prepare, prepare_fashion_mnist
from cnnpipe.data.splits.draw import content_split, stratified_split
from cnnpipe.data.store.shards import open_split, read_index
from conftest import colour_image, meta_lines, save_image


def tree_hash(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def test_fashion_mnist_split_is_deterministic_and_holds_out_every_class(fake_fmnist, tmp_path):
    cfg = DataConfig(stored_size=32, image_size=32, val_fraction=0.1)
    reports = []
    for name in ("a", "b"):
        out = tmp_path / name
        out.mkdir()
        reports.append(prepare_fashion_mnist(cfg, 7, out, search_dirs=(fake_fmnist,)))
    assert tree_hash(tmp_path / "a") == tree_hash(tmp_path / "b")  # byte-identical outputs
    splits = reports[0]["splits"]
    assert splits["train"] + splits["val"] == 600 and 40 <= splits["val"] <= 80 and splits["test"] == 200
    index = read_index(tmp_path / "a")
    assert index["classes"][0] == "T-shirt/top" and index["channels"] == 1 and index["size"] == 32
    assert all(n >= 1 for n in index["splits"]["val"]["class_counts"])  # every class held out
    train = open_split(tmp_path / "a", "train")
    assert train.images.shape == (splits["train"], 32, 32, 1) and train.images.dtype == np.uint8


def test_fashion_mnist_caps_and_missing_data_message(fake_fmnist, tmp_path):
    cfg = DataConfig(max_train_images=100, max_eval_images=50)
    report = prepare_fashion_mnist(cfg, 0, tmp_path, search_dirs=(fake_fmnist,))
    assert report["splits"] == {"train": 100, "val": 50, "test": 50}
    with pytest.raises(idx.DatasetMissing) as err:
        idx.locate((tmp_path / "nowhere",))
    assert "apt-get install -y dataset-fashion-mnist" in str(err.value)
    assert "data/raw/fashion-mnist" in str(err.value)


def test_truncated_idx_is_a_clear_error(fake_fmnist, tmp_path):
    broken = tmp_path / "raw"
    broken.mkdir()
    for f in fake_fmnist.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    import gzip

    data = gzip.decompress((broken / "t10k-images-idx3-ubyte.gz").read_bytes())
    (broken / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(data[:-100]))
    with pytest.raises(ValueError, match="truncated"):
        prepare_fashion_mnist(DataConfig(), 0, tmp_path / "x", search_dirs=(broken,))


def test_content_split_never_moves_an_image_when_others_come_or_go():
    """A catalog gains and loses photos every week: the old test images stay test, the old train
    images stay train, so two model versions are compared on the same test images."""
    rng = np.random.default_rng(0)
    digests = [f"{rng.integers(2**63):x}" for _ in range(3000)]
    labels = rng.integers(0, 5, size=3000)
    held = [("test", 0.1), ("val", 0.1)]
    before = dict(zip(digests[:2000], content_split(digests[:2000], labels[:2000], held, seed=3)))
    grown = dict(zip(digests, content_split(digests, labels, held, seed=3)))  # +1,000 photos
    shrunk = dict(zip(digests[500:2000], content_split(digests[500:2000], labels[500:2000], held, seed=3)))
    assert all(grown[d] == split for d, split in before.items())
    assert all(before[d] == split for d, split in shrunk.items())
    names = np.array(list(grown.values()))
    for label in range(5):  # class proportions hold
        share = (names[labels == label] == "test").mean()
        assert 0.06 < share < 0.14
    other_seed = content_split(digests, labels, held, seed=4)
    assert (other_seed != names).any()  # the seed is part of the assignment


def test_a_tiny_class_still_gets_a_held_out_image():
    labels = np.array([0] * 4 + [1] * 40)
    digests = [f"img{i}" for i in range(44)]
    names = content_split(digests, labels, [("test", 0.1), ("val", 0.1)], seed=0)
    for label in (0, 1):
        assert {"test", "val", "train"} <= set(names[labels == label])


def test_a_second_prepare_reports_what_each_split_gained_and_lost(tmp_path):
    root = tmp_path / "tree"
    for i in range(200):  # enough per class that no class needs a stand-in
        save_image(root / ("a" if i % 2 else "b") / f"{i}.png", colour_image(i))
    cfg = DataConfig(source=str(root), stored_size=16, image_size=16, prepare_workers=1)
    first = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    assert first["changes"] is None  # nothing to compare with
    where = {meta["source"]: split for split in ("train", "val", "test")
             for meta in meta_lines(tmp_path / "p", split)}
    for i in range(200, 260):
        save_image(root / ("a" if i % 2 else "b") / f"{i}.png", colour_image(i))
    second = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    again = {meta["source"]: split for split in ("train", "val", "test")
             for meta in meta_lines(tmp_path / "p", split)}
    assert all(again[source] == split for source, split in where.items())  # no old image moved
    changes = second["changes"]
    assert changes["moved_between_splits"] == 0
    assert sum(c["gained"] for c in changes["splits"].values()) == 60
    assert all(c["lost"] == 0 for c in changes["splits"].values())


def _fake_store(store: Path, members: dict[str, list[str]]) -> None:
    store.mkdir()
    for split, digests in members.items():
        (store / f"{split}_meta.jsonl").write_text(
            "".join(json.dumps({"sha256": d, "source": f"{split}/{j}.png"}) + "\n" for j, d in enumerate(digests)))


def test_split_changes_and_leakage_count_what_sets_of_hashes_would(tmp_path):
    """The sorted-array versions against plain set arithmetic, with images moved (a new seed or
    fraction), gained, lost, duplicated within a split, and in two splits at once."""
    from cnnpipe.data.store.previous import Tree
    from cnnpipe.data.report import leakage, split_changes

    rng = np.random.default_rng(0)
    pool = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)).hex() for _ in range(400)] + ["ab" * 31 + "00"]
    def draw(n):
        return [pool[i] for i in rng.integers(0, len(pool), n)]
    before = {"train": draw(300) + pool[-1:], "val": draw(40), "test": draw(40)}
    after = {"train": draw(320), "val": draw(30) + pool[-1:] * 2, "test": draw(50) + pool[-1:]}  # a hash ending in 00
    _fake_store(tmp_path / "old", before)
    _fake_store(tmp_path / "new", after)

    where = {d: s for s in ("train", "val", "test") for d in before[s]}  # the last split wins
    expected = {"splits": {s: {"gained": len(set(after[s]) - set(before[s])),
                               "lost": len(set(before[s]) - set(after[s]))} for s in before},
                "moved_between_splits": sum(where.get(d, s) != s for s in after for d in set(after[s]))}
    changes = split_changes(Tree(tmp_path / "old"), tmp_path / "new")
    assert changes == expected and changes["moved_between_splits"] > 0
    assert split_changes(None, tmp_path / "new") is None

    items = [(s, d, f"{s}/{j}.png") for s in ("train", "val", "test") for j, d in enumerate(after[s])]
    first: dict[str, dict[str, str]] = {}
    for s, d, source in items:
        first.setdefault(d, {}).setdefault(s, source)
    expected_leaks = [{"sha256": d, "splits": sorted(f), "sources": [f[k] for k in sorted(f)]}
                      for d, f in sorted(first.items()) if len(f) > 1]
    digests = np.frombuffer(b"".join(bytes.fromhex(d) for _, d, _ in items), dtype="S32")
    codes = np.array([("train", "val", "test").index(s) for s, _, _ in items], dtype=np.int8)
    leaks = leakage(digests, codes, lambda j: items[j][2])
    assert leaks == expected_leaks and len(leaks) > 10


def test_stratified_split_keeps_singleton_classes_in_train():
    labels = np.array([0] * 10 + [1] * 10 + [2])
    keep, held = stratified_split(labels, 0.2, 0)
    assert len(set(keep) & set(held)) == 0 and len(keep) + len(held) == len(labels)
    assert 20 in keep  # the lone class-2 item
    assert np.bincount(labels[held], minlength=3).tolist() == [2, 2, 0]


# ---------------------------------------------------------------- ImageFolder
def make_varied_tree(root: Path) -> None:
    """Two classes of real files in every format/mode the prepare stage must read, plus junk."""
    a, b = root / "cats", root / "dogs (big)"
    rgb = colour_image(0, (60, 40))
    save_image(a / "plain.jpg", rgb)
    save_image(a / "UPPER.JPEG", rgb[:, ::-1].copy())
    save_image(a / "grey.png", rgb[..., 0].copy())
    save_image(a / "alpha.png", np.dstack([rgb, np.full(rgb.shape[:2], 128, np.uint8)]))
    save_image(a / "palette.gif", rgb, mode="P")
    save_image(a / "la.png", np.dstack([rgb[..., 0], rgb[..., 1]]).copy(), mode=None)
    save_image(a / "photo.webp", colour_image(1, (50, 50)))
    save_image(a / "bitmap.bmp", colour_image(2, (33, 47)))
    save_image(a / "scan.tiff", colour_image(3, (30, 30)))
    Image.fromarray(colour_image(4, (40, 40))).convert("CMYK").save(a / "print.jpg")
    Image.fromarray((np.arange(1600, dtype=np.uint16).reshape(40, 40) * 40)).save(a / "depth16.png")
    save_image(a / "ünïcödé name.with.dots (1).png", colour_image(5))
    save_image(b / "nested" / "deep.png", colour_image(6))
    for i in range(8):
        save_image(b / f"dog_{i}.jpg", colour_image(10 + i))
        save_image(a / f"cat_{i}.png", colour_image(20 + i))
    # junk that must be skipped or ignored
    (a / "empty.jpg").write_bytes(b"")
    (a / "not_an_image.png").write_text("hello, I am text")
    truncated = (a / "plain.jpg").read_bytes()
    (b / "truncated.jpg").write_bytes(truncated[: len(truncated) // 2])
    (a / "notes.txt").write_text("not an image")
    (a / ".hidden.png").write_bytes((a / "grey.png").read_bytes())
    (root / "empty_class").mkdir()


def test_image_folder_reads_every_format_and_reports_broken_files(tmp_path):
    root = tmp_path / "photos"
    make_varied_tree(root)
    cfg = DataConfig(source=str(root), stored_size=24, image_size=24, val_fraction=0.15, test_fraction=0.15)
    report = prepare(cfg, 0, tmp_path / "prepared", tmp_path / "report.json")
    assert report["classes"] == ["cats", "dogs (big)"]
    assert report["empty_classes"] == ["empty_class"]
    reasons = {Path(b["path"]).name: b["reason"] for b in report["bad_files"]}
    assert "0 bytes" in reasons["empty.jpg"]
    assert "not an image" in reasons["not_an_image.png"]
    assert "truncated" in reasons["truncated.jpg"] or "corrupt" in reasons["truncated.jpg"]
    assert "notes.txt" in " ".join(report["ignored_files"])
    total = sum(report["splits"].values())
    assert total == 12 + 8 + 1 + 8  # every good file, none of the junk, not the hidden one
    assert json.loads((tmp_path / "report.json").read_text())["num_bad"] == 3
    for split in ("train", "val", "test"):
        data = open_split(tmp_path / "prepared", split)
        assert data.images.shape[1:] == (24, 24, 3)
    meta = meta_lines(tmp_path / "prepared", "train")
    assert all(len(m["sha256"]) == 64 for m in meta)


def test_on_bad_image_fail_lists_the_files(tmp_path):
    root = tmp_path / "photos"
    make_varied_tree(root)
    cfg = DataConfig(source=str(root), stored_size=24, image_size=24, on_bad_image="fail")
    with pytest.raises(DataError, match="empty.jpg"):
        prepare(cfg, 0, tmp_path / "prepared", tmp_path / "report.json")


def test_alpha_composites_on_white_and_exif_orientation(tmp_path):
    transparent = np.zeros((10, 10, 4), np.uint8)
    assert np.asarray(to_rgb(Image.fromarray(transparent, "RGBA"))).min() == 255
    # A 40x20 landscape stored with EXIF orientation 6 (rotate 90°) must come out portrait.
    img = Image.new("RGB", (40, 20))
    img.paste((255, 0, 0), (0, 0, 20, 20))  # left half red
    exif = img.getexif()
    exif[0x0112] = 6
    path = tmp_path / "rotated.jpg"
    img.save(path, exif=exif, quality=95)
    decoded = decode_file(path, size=20, max_pixels=10**6)
    assert decoded.image is not None
    # After a 90° clockwise rotation the red half is on top.
    top, bottom = decoded.image[:5].mean(axis=(0, 1)), decoded.image[-5:].mean(axis=(0, 1))
    assert top[0] > 200 and bottom[0] < 60


def test_decompression_bomb_rejected_from_header(tmp_path):
    path = save_image(tmp_path / "huge.png", np.zeros((300, 400), np.uint8))
    result = decode_file(path, size=16, max_pixels=100_000)
    assert result.image is None and "decompression bomb" in result.reason and "data.max_pixels" in result.reason


def test_one_class_tree_is_a_clear_error(tmp_path):
    for i in range(5):
        save_image(tmp_path / "only" / f"{i}.png", colour_image(i))
    with pytest.raises(DataError, match="need at least two"):
        prepare(DataConfig(source=str(tmp_path)), 0, tmp_path / "out", tmp_path / "r.json")


def test_predefined_splits_are_kept_and_a_copy_in_train_joins_its_test_twin(tmp_path):
    root = tmp_path / "tree"
    seed = 0
    for split, n in (("train", 6), ("validation", 2), ("test", 2)):
        for cls in ("a", "b"):
            for i in range(n):
                seed += 1
                save_image(root / split / cls / f"{i}.png", colour_image(seed))
    # the same bytes in train and test: the train copy is a test image the model would see
    (root / "test" / "a" / "copy.png").write_bytes((root / "train" / "a" / "0.png").read_bytes())
    cfg = DataConfig(source=str(root), stored_size=16, image_size=16)
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    assert report["predefined_splits"] is True
    assert report["splits"] == {"train": 11, "val": 4, "test": 6}
    assert report["moved_to_join_a_copy_or_group"] == 1 and report["leakage"] == []
    test = [meta["source"] for meta in meta_lines(tmp_path / "p", "test")]
    assert "train/a/0.png" in test


def test_a_split_folder_of_images_without_class_folders_fails_at_once(tmp_path):
    """ImageNet's val/ layout: read as an empty split it trained with val top-1 0 every epoch."""
    root = tmp_path / "tree"
    for i in range(4):
        save_image(root / "train" / ("a" if i % 2 else "b") / f"{i}.png", colour_image(i))
        save_image(root / "val" / f"ILSVRC_val_{i}.JPEG", colour_image(10 + i))
    cfg = DataConfig(source=str(root), stored_size=16, image_size=16)
    with pytest.raises(DataError) as err:
        prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    message = str(err.value)
    assert str(root / "val") in message and "4 image file(s) but no class folders" in message
    assert "subfolder named after its class" in message
    assert not (tmp_path / "p").exists()  # nothing half-written


def test_image_folder_prepare_is_deterministic(tmp_path):
    root = tmp_path / "photos"
    make_varied_tree(root)
    cfg = DataConfig(source=str(root), stored_size=16, image_size=16, prepare_workers=2)
    prepare(cfg, 3, tmp_path / "p1", tmp_path / "r1.json")
    prepare(cfg, 3, tmp_path / "p2", tmp_path / "r2.json")
    assert tree_hash(tmp_path / "p1") == tree_hash(tmp_path / "p2")

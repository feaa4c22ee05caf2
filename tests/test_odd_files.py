"""Ingest that survives any file: each odd file or folder is listed with its reason, the rest is
prepared; explicit splits are never carved."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from cnnpipe.config import DataConfig
from cnnpipe.data.ingest import decode
from cnnpipe.data.prepare import DataError, prepare
from conftest import colour_image, meta_lines, save_image


def _two_classes(root: Path, n: int = 6) -> None:
    for i in range(n):
        save_image(root / "shoes" / f"{i}.png", colour_image(i))
        save_image(root / "bags" / f"{i}.png", colour_image(100 + i))


def _sources(store: Path, split: str) -> list[str]:
    return [meta["source"] for meta in meta_lines(store, split)]


def test_odd_files_are_each_listed_with_their_reason_and_the_rest_is_prepared(tmp_path):
    root = tmp_path / "catalog"
    _two_classes(root)
    # A name that is not UTF-8 (a Latin-1 export): kept by the OS as bytes, refused by name.
    latin1 = os.fsdecode(b"caf\xe9.png")
    save_image(root / "shoes" / latin1, colour_image(50))
    # A folder symlink back to its class folder's parent: followed, it lists every file ~40 times.
    os.symlink("..", root / "bags" / "loop")
    # A 1 x 200,000 strip: resized whole at 16 px it would need 51M pixels, over data.max_pixels.
    save_image(root / "shoes" / "strip.png", np.full((1, 200_000, 3), 90, np.uint8))
    cfg = DataConfig(source=str(root), stored_size=16, image_size=16, max_pixels=1_000_000, prepare_workers=1)
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")

    bad = {b["path"]: b["reason"] for b in report["bad_files"]}
    assert set(bad) == {"shoes/caf\\xe9.png"}, bad
    assert "not valid UTF-8" in bad["shoes/caf\\xe9.png"]
    assert report["skipped_folders"] == [{"path": "bags/loop", "reason": "a symlink to a folder above it (a loop): "
                                                                         "not followed"}]
    assert sum(report["splits"].values()) == 12 + 1  # the twelve photos and the strip, each once
    stored = [s for split in ("train", "val", "test") for s in _sources(tmp_path / "p", split)]
    assert "shoes/strip.png" in stored and len(stored) == len(set(stored))
    json.loads((tmp_path / "r.json").read_text())  # the report is valid JSON whatever the names


def test_any_exception_a_codec_raises_is_that_files_reason(tmp_path, monkeypatch):
    """Pillow's EXIF handling has raised TypeError on odd files: the file is listed with it, never a crash."""
    from cnnpipe.data.ingest.workers import ingest_file

    path = save_image(tmp_path / "odd exif.png", colour_image(7, (37, 23)))
    real_transpose = ImageOps.exif_transpose

    def transpose(img: Image.Image, **kwargs):
        if img.size == (37, 23):
            raise TypeError("'NoneType' object is not subscriptable")
        return real_transpose(img, **kwargs)

    monkeypatch.setattr(ImageOps, "exif_transpose", transpose)  # the decoding function, run in this process
    digest, image, reason, known = ingest_file(str(path), 16, 10**6, None)
    assert image is None and not known and reason.startswith("cannot be decoded: TypeError")


def test_a_strip_is_resized_from_its_centre_square_never_whole(monkeypatch):
    rng = np.random.default_rng(0)
    strip = Image.fromarray(rng.integers(0, 255, (8, 400, 3), dtype=np.uint8))
    whole = np.asarray(decode.resize_center_square(strip, 16), dtype=np.int16)  # 16 x 800 on the way
    sizes = []
    real_resize = Image.Image.resize

    def resize(self, size, *args, **kwargs):
        sizes.append(size)
        return real_resize(self, size, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "resize", resize)
    cropped = np.asarray(decode.resize_center_square(strip, 16, max_pixels=16 * 400), dtype=np.int16)
    assert sizes == [(16, 16)]  # nothing larger than the stored square was made
    assert cropped.shape == whole.shape == (16, 16, 3)
    # The same centre region: they differ only in how the edge columns are resampled.
    assert np.abs(cropped - whole)[:, 2:-2].mean() < 3.0
    # Under the bound, the pixels are exactly what they were (the TRANSFORM of existing stores holds).
    again = np.asarray(decode.resize_center_square(strip, 16, max_pixels=16 * 800), dtype=np.int16)
    assert np.array_equal(again, whole)


def test_folders_that_are_not_read_are_reported(tmp_path):
    root = tmp_path / "tree"
    for split in ("train", "val", "validation", "test"):
        for i in range(3):
            save_image(root / split / ("a" if i % 2 else "b") / f"{split}{i}.png", colour_image(len(split) * 10 + i))
    save_image(root / "extra" / "a" / "lost.png", colour_image(9))  # beside train/: not a split
    report = prepare(DataConfig(source=str(root), stored_size=16, image_size=16, prepare_workers=1), 0,
                     tmp_path / "p", tmp_path / "r.json")
    reasons = {f["path"]: f["reason"] for f in report["skipped_folders"]}
    assert set(reasons) == {"extra", "validation"}
    assert "a second val folder beside val/" in reasons["validation"] and "train/" in reasons["extra"]
    assert report["splits"] == {"train": 3, "val": 3, "test": 3}


def test_manifest_paths_outside_its_folder_are_refused_row_by_row(tmp_path):
    export = tmp_path / "export"
    save_image(export / "img" / "a.png", colour_image(0))
    save_image(tmp_path / "elsewhere.png", colour_image(1))
    (export / "catalog.csv").write_text(f"img/a.png,red,\n../elsewhere.png,red,\n{tmp_path / 'elsewhere.png'},blue,\n")
    with pytest.raises(DataError) as err:
        prepare(DataConfig(source=str(export / "catalog.csv"), stored_size=16, image_size=16), 0,
                tmp_path / "p", tmp_path / "r.json")
    message = str(err.value)
    assert "2 bad row(s)" in message
    assert "catalog.csv:2: ../elsewhere.png: outside the manifest's folder" in message
    assert f"catalog.csv:3: {tmp_path / 'elsewhere.png'}: outside the manifest's folder" in message


def test_a_manifest_that_is_not_utf8_is_named(tmp_path):
    export = tmp_path / "export"
    save_image(export / "a.png", colour_image(0))
    (export / "catalog.csv").write_bytes(b"a.png,red,\na.png,caf\xe9,\n")
    with pytest.raises(DataError, match=r"catalog.csv is not UTF-8 text \(at line 2"):
        prepare(DataConfig(source=str(export / "catalog.csv"), stored_size=16, image_size=16), 0,
                tmp_path / "p", tmp_path / "r.json")


def test_rows_marked_train_are_never_carved_into_val_or_test(tmp_path):
    export = tmp_path / "export"
    rows = []
    for i in range(80):
        save_image(export / "img" / f"{i:03d}.png", colour_image(i))
        rows.append(f"img/{i:03d}.png,{'red' if i % 2 else 'blue'},{'train' if i < 40 else ''}")
    (export / "catalog.csv").write_text("\n".join(rows) + "\n")
    cfg = DataConfig(source=str(export / "catalog.csv"), stored_size=16, image_size=16, prepare_workers=1,
                     val_fraction=0.25, test_fraction=0.25)
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    marked = {f"img/{i:03d}.png" for i in range(40)}
    held_out = set(_sources(tmp_path / "p", "val")) | set(_sources(tmp_path / "p", "test"))
    assert held_out and not held_out & marked  # carved from the 40 blank rows only
    assert marked <= set(_sources(tmp_path / "p", "train"))
    assert report["splits"]["val"] + report["splits"]["test"] == len(held_out) < 40


def test_long_lists_of_skipped_files_stay_out_of_the_git_tracked_report(tmp_path):
    root = tmp_path / "catalog"
    _two_classes(root, 3)
    for i in range(104):
        (root / "shoes" / f"notes {i}.txt").write_text("not an image")
    (root / "bags" / "empty.png").write_bytes(b"")
    report = prepare(DataConfig(source=str(root), stored_size=16, image_size=16, prepare_workers=1), 0,
                     tmp_path / "p", tmp_path / "r.json")
    assert report["num_ignored"] == 104 and len(report["ignored_files"]) == 100
    assert report["num_bad"] == 1 and report["bad_files"][0]["path"] == "bags/empty.png"
    listed = [json.loads(line) for line in (tmp_path / "p" / "skipped_files.jsonl").read_text().splitlines()]
    assert len(listed) == 105 and listed[0] == {**report["bad_files"][0]}
    assert {item["path"] for item in listed[1:]} == {f"shoes/notes {i}.txt" for i in range(104)}

"""Catalogs that change: incremental and restartable prepare, a dying worker, manifests."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from cnnpipe.config import DataConfig
from cnnpipe.data.prepare import DataError, prepare
from cnnpipe.data.store.shards import open_split
from conftest import ROOT, colour_image, meta_lines, save_image


def make_catalog(root: Path, start: int, stop: int, side: int = 24) -> None:
    for i in range(start, stop):
        save_image(root / ("shoes" if i % 2 else "bags") / f"{i:05d}.png", colour_image(i, (side, side)))


def store_pixels(store: Path) -> dict[str, tuple[bytes, bytes, list[str]]]:
    """Per split: pixels, labels and sources, to compare stores made different ways."""
    out = {}
    for split in ("train", "val", "test"):
        sources = [meta["source"] for meta in meta_lines(store, split)]
        data = open_split(store, split)
        out[split] = (np.asarray(data.images).tobytes(), data.labels.tobytes(), sources)
    return out


def test_adding_images_decodes_only_the_new_ones_and_matches_a_full_prepare(tmp_path):
    root = tmp_path / "catalog"
    make_catalog(root, 0, 200)
    cfg = DataConfig(source=str(root), stored_size=16, image_size=16, prepare_workers=1)
    first = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    assert first["work"]["decoded"] == 200 and first["work"]["copied"] == 0

    make_catalog(root, 200, 220)
    second = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    assert second["work"]["decoded"] == 20 and second["work"]["read"] == 20
    assert second["work"]["kept"] == 200 and second["work"]["copied"] == 0 and second["work"]["unchanged_not_read"] == 200

    full = prepare(cfg, 0, tmp_path / "scratch", tmp_path / "r2.json")
    assert full["work"]["decoded"] == 220
    assert store_pixels(tmp_path / "p") == store_pixels(tmp_path / "scratch")


def test_a_recopied_catalog_is_read_once_but_not_decoded_again(tmp_path):
    """`cp -r` again gives every file a new mtime: each is read to hash it, and copied by its hash."""
    make_catalog(tmp_path / "catalog", 0, 120)
    cfg = DataConfig(source=str(tmp_path / "copy"), stored_size=16, image_size=16, prepare_workers=2)
    shutil.copytree(tmp_path / "catalog", tmp_path / "copy", copy_function=shutil.copy)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    shutil.rmtree(tmp_path / "copy")
    time.sleep(0.01)
    shutil.copytree(tmp_path / "catalog", tmp_path / "copy", copy_function=shutil.copy)
    again = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    assert again["work"]["read"] == 120 and again["work"]["decoded"] == 0 and again["work"]["kept"] == 120


def test_every_stored_hash_is_the_files_whole_sha256(tmp_path):
    """Reading one hash out of a numpy S32 array drops its trailing zero bytes: the catalog below
    holds a file whose sha256 ends in 00, which must be stored, split and copied by all 32 bytes."""
    root, seed, zero_tail = tmp_path / "catalog", 0, False
    while not zero_tail or seed < 40:
        path = save_image(root / ("a" if seed % 2 else "b") / f"{seed}.png", colour_image(seed, (8, 8)))
        zero_tail |= hashlib.sha256(path.read_bytes()).digest()[-1] == 0
        seed += 1
    cfg = DataConfig(source=str(root), stored_size=8, image_size=8, prepare_workers=1)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    shutil.copytree(root, tmp_path / "copy", copy_function=shutil.copy)  # new mtimes: copied by hash
    again = prepare(DataConfig(source=str(tmp_path / "copy"), stored_size=8, image_size=8, prepare_workers=1),
                    0, tmp_path / "p", tmp_path / "r.json")
    assert again["work"]["decoded"] == 0 and again["work"]["kept"] == seed
    for split in ("train", "val", "test"):
        for item in meta_lines(tmp_path / "p", split):
            assert item["sha256"] == hashlib.sha256((tmp_path / "copy" / item["source"]).read_bytes()).hexdigest()


def test_a_new_stored_size_decodes_everything_again(tmp_path):
    make_catalog(tmp_path / "catalog", 0, 60)
    cfg = DataConfig(source=str(tmp_path / "catalog"), stored_size=16, image_size=16, prepare_workers=1)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    bigger = DataConfig(source=str(tmp_path / "catalog"), stored_size=20, image_size=20, prepare_workers=1)
    report = prepare(bigger, 0, tmp_path / "p", tmp_path / "r.json")
    assert report["work"]["decoded"] == 60 and report["work"]["copied"] == 0
    assert open_split(tmp_path / "p", "train").images.shape[1:] == (20, 20, 3)


def _params(tmp_path: Path, source: Path, workers: int) -> Path:
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"seed": 0, "data": {"source": str(source), "stored_size": 16,
                                                          "image_size": 16, "prepare_workers": workers}}))
    return params


PAUSED = """
import os, runpy, signal, sys, time
from pathlib import Path
from cnnpipe.data.ingest.journal import Journal

record, count, pause_at = Journal.record, [0], int(os.environ["PAUSE_AT"])

def record_then_pause(self, *args):
    at = record(self, *args)
    count[0] += 1
    if count[0] == pause_at:  # the journal's lines made durable, then the test is told, and acts
        self.sync()
        Path(os.environ["PAUSED_FILE"]).write_text(str(count[0]))
        while not Path(os.environ["RESUME_FILE"]).exists():
            time.sleep(0.01)
    return at

Journal.record = record_then_pause
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
"""`python -c PAUSED stages/prepare.py ...`: the prepare, paused after the journal's `PAUSE_AT`th file
until RESUME_FILE exists, having written PAUSED_FILE: a kill placed there, not after a delay."""


def _start_prepare(tmp_path: Path, params: Path, pause_at: int | None = None) -> subprocess.Popen:
    cmd = [str(ROOT / "stages" / "prepare.py"), "--params", str(params),
           "--out", str(tmp_path / "p"), "--report", str(tmp_path / "r.json")]
    env = dict(os.environ, PAUSE_AT=str(pause_at), PAUSED_FILE=str(tmp_path / "paused"),
               RESUME_FILE=str(tmp_path / "resume"))
    return subprocess.Popen([sys.executable, *(["-c", PAUSED] if pause_at else []), *cmd], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_paused(tmp_path: Path, proc: subprocess.Popen) -> None:
    """Until the prepare says it paused; a generous bound only a hang reaches."""
    deadline = time.monotonic() + 600
    while not (tmp_path / "paused").exists():
        assert proc.poll() is None, f"the prepare ended before its pause: {proc.communicate()}"
        assert time.monotonic() < deadline, "the prepare never reached its pause"
        time.sleep(0.02)


def _journal_lines(tmp_path: Path) -> int:
    journal = tmp_path / "p.work" / "journal.jsonl"
    return len(journal.read_text().splitlines()) if journal.exists() else 0


def test_a_killed_prepare_continues_where_it_stopped(tmp_path):
    root = tmp_path / "catalog"
    make_catalog(root, 0, 400, side=48)
    proc = _start_prepare(tmp_path, _params(tmp_path, root, workers=1), pause_at=100)
    _wait_paused(tmp_path, proc)  # 100 files journalled: the kill lands mid-way, on any machine
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = _journal_lines(tmp_path)
    assert 100 <= done < 400, "the kill should land mid-way"
    assert not (tmp_path / "p").exists()  # nothing was swapped in

    cfg = DataConfig(source=str(root), stored_size=16, image_size=16, prepare_workers=1)
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    assert report["work"]["resumed"] >= done - 1  # a torn last line is decoded again
    assert report["work"]["decoded"] == 400 - report["work"]["resumed"]
    assert sum(report["splits"].values()) == 400
    assert not (tmp_path / "p.work").exists()
    prepare(cfg, 0, tmp_path / "scratch", tmp_path / "r2.json")
    assert store_pixels(tmp_path / "p") == store_pixels(tmp_path / "scratch")


def _journal_of_three(work: Path, wanted: dict, image: np.ndarray):
    """An open journal (two frames a segment) holding three decoded images: keys 0-2, pixels `image + key`."""
    from cnnpipe.data.ingest.journal import Journal

    journal = Journal(work, wanted, rows_per_segment=2)
    for key in range(3):
        journal.record(key, bytes([key]) * 32, image + key, None)
    return journal


def test_a_jpeg_stores_journal_holds_records_that_become_a_shard_and_survives_a_torn_write(tmp_path):
    """A JPEG store's journal keeps each image's JPEG record (never its pixels), segments of
    `segment_bytes`; a reopened journal keeps its whole records, and a segment's offsets make it a
    shard as it is."""
    from cnnpipe.data.store import codec
    from cnnpipe.data.ingest.journal import Journal, where
    from cnnpipe.data.store.shards import read_offsets

    wanted, encoding = {"size": 16, "channels": 3}, {"encoding": "jpeg", "quality": 90, "codec": codec.CODEC}
    images = [np.asarray(colour_image(k, (16, 16))) for k in range(4)]
    records = [codec.encode(image, 90) for image in images]
    journal = Journal(tmp_path / "w", wanted, 8, encoding, segment_bytes=len(records[0]) + len(records[1]))
    assert journal.record(0, bytes([0]) * 32, images[0], None) == where(0, 0)  # pixels given: encoded here
    assert journal.record(1, bytes([1]) * 32, records[1], None) == where(0, 1)  # a worker's record
    assert journal.record(2, bytes([2]) * 32, records[2], None) == where(1, 0)  # the segment is full
    journal.close()
    segment = tmp_path / "w" / "segments" / "000000.jpg"
    assert segment.read_bytes() == records[0] + records[1]
    with open(tmp_path / "w" / "segments" / "000001.jpg", "ab") as fh:  # a record cut short by a kill
        fh.write(records[3][:10])
    journal = Journal(tmp_path / "w", wanted, 8, encoding, segment_bytes=10**6)
    assert len(journal) == 3 and journal.lookup(2) == (bytes([2]) * 32, where(1, 0), None)
    assert (tmp_path / "w" / "segments" / "000001.jpg").read_bytes() == records[2]  # only whole records kept
    offsets = read_offsets(journal.sidecar(0))
    assert offsets.tolist() == [0, len(records[0]), len(records[0]) + len(records[1])]
    assert np.array_equal(journal.pixels(where(0, 1)), codec.decode(records[1], 3))
    assert journal.record(3, bytes([3]) * 32, records[3], None) == where(2, 0)  # never a reopened segment
    journal.close()
    assert Journal(tmp_path / "w", wanted, 8).lookup(0) is None  # a raw journal starts afresh


def test_a_journal_reopened_after_a_torn_write_keeps_every_whole_line(tmp_path):
    from cnnpipe.data.ingest.journal import Journal, where

    wanted = {"size": 2, "channels": 3}
    image = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    journal = _journal_of_three(tmp_path / "w", wanted, image)
    journal.record(3, bytes([3]) * 32, None, "cannot be decoded")
    journal.close()
    with open(tmp_path / "w" / "journal.jsonl", "ab") as fh:  # killed mid-line, after the pixels
        fh.write(b'{"key": 4, "sha256": "04')
    with open(tmp_path / "w" / "segments" / "000001.u8", "ab") as fh:
        fh.write(bytes(7))

    journal = Journal(tmp_path / "w", wanted, rows_per_segment=2)
    assert len(journal) == 4 and journal.lookup(4) is None
    assert journal.lookup(1) == (bytes([1]) * 32, where(0, 1), None)
    assert journal.lookup(3) == (bytes([3]) * 32, -1, "cannot be decoded")
    assert (tmp_path / "w" / "segments" / "000001.u8").stat().st_size == 12  # the torn bytes cut off
    assert journal.record(4, bytes([4]) * 32, image + 4, None) == where(2, 0)  # a new segment, never a reopened one
    assert np.array_equal(journal.pixels(where(0, 1)), image + 1)
    assert np.array_equal(journal.pixels(where(2, 0)), image + 4)
    journal.record(0, bytes([9]) * 32, image + 9, None)  # journalled again: the last line counts
    journal.close()
    journal = Journal(tmp_path / "w", wanted, rows_per_segment=2)
    assert len(journal) == 5 and journal.lookup(4) == (bytes([4]) * 32, where(2, 0), None)
    assert journal.lookup(0) == (bytes([9]) * 32, where(2, 1), None)
    journal.close()
    journal = Journal(tmp_path / "w", {"size": 4, "channels": 3}, rows_per_segment=2)
    assert len(journal) == 0  # another recipe starts over
    journal.close()


def test_a_journal_whose_last_frame_was_cut_decodes_that_image_again_and_never_truncates_a_shared_file(tmp_path):
    from cnnpipe.data.ingest.journal import Journal, where

    wanted = {"size": 2, "channels": 3}
    image = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    _journal_of_three(tmp_path / "w", wanted, image).close()
    lines = (tmp_path / "w" / "journal.jsonl").read_text().splitlines()
    assert len(lines) == 3  # close() wrote the lines its fsync made safe
    first = tmp_path / "w" / "segments" / "000000.u8"
    os.link(first, tmp_path / "shard-in-a-store.u8")  # a store took this segment as a shard
    with open(first, "r+b") as fh:  # a power cut kept the lines but not the last frame's blocks
        fh.truncate(12 + 5)

    journal = Journal(tmp_path / "w", wanted, rows_per_segment=2)
    assert len(journal) == 1 and journal.lookup(1) is None and journal.lookup(2) is None  # and what followed
    assert first.stat().st_size == 12  # the torn frame is cut, never padded with zeros...
    assert (tmp_path / "shard-in-a-store.u8").stat().st_size == 12 + 5  # ...in a new file: the store's is untouched
    assert journal.record(1, bytes([1]) * 32, image + 1, None) == where(2, 0)
    assert np.array_equal(journal.pixels(where(2, 0)), image + 1) and np.array_equal(journal.pixels(where(0, 0)), image)
    journal.close()


def test_a_worker_killed_mid_decode_costs_no_file_and_the_prepare_finishes(tmp_path):
    """The OOM killer takes a decoding worker: the file it was on is decoded again alone (it was not
    the file's fault), the rest of its chunk goes to a fresh worker, and nothing is listed as bad."""
    root = tmp_path / "catalog"
    make_catalog(root, 0, 600, side=400)
    proc = _start_prepare(tmp_path, _params(tmp_path, root, workers=2), pause_at=40)
    _wait_paused(tmp_path, proc)  # the workers are up and the prepare is mid-way, on any machine
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    workers = [pid for pid in children
               if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]
    assert workers, "expected decoding worker processes"
    os.kill(int(workers[-1]), signal.SIGKILL)  # what the OOM killer does
    (tmp_path / "resume").touch()
    _, err = proc.communicate(timeout=300)  # no hang, no error
    assert proc.returncode == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["num_bad"] == 0 and sum(report["splits"].values()) == 600
    assert report["work"]["decoded"] == 600


# ---------------------------------------------------------------- manifests
def _manifest_tree(tmp_path: Path) -> Path:
    for i in range(40):
        save_image(tmp_path / "export" / "img" / f"{i:03d}.jpg", colour_image(i))
    return tmp_path / "export"


def test_a_manifest_is_a_source_with_its_own_splits(tmp_path):
    export = _manifest_tree(tmp_path)
    rows = ["path\tlabel\tsplit"] + [f"img/{i:03d}.jpg\t{'red' if i % 2 else 'blue'}\t{'test' if i < 8 else ''}"
                                      for i in range(40)]
    (export / "catalog.tsv").write_text("\n".join(rows) + "\n")
    cfg = DataConfig(source=str(export / "catalog.tsv"), stored_size=16, image_size=16, prepare_workers=1)
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    assert report["classes"] == ["blue", "red"] and report["splits"]["test"] == 8
    assert report["splits"]["train"] + report["splits"]["val"] == 32 and report["splits"]["val"] > 0
    test_sources = [item["source"] for item in meta_lines(tmp_path / "p", "test")]
    assert sorted(test_sources) == [f"img/{i:03d}.jpg" for i in range(8)]


def test_a_manifests_listing_is_in_split_class_path_order_whatever_the_row_order(tmp_path):
    from cnnpipe.data.sources.catalog import read_manifest

    export = _manifest_tree(tmp_path)
    rng = np.random.default_rng(0)
    split_of = ["", "train", "val", "test", "validation"]
    rows = [(f"img/{i:03d}.jpg", ["zebra", "ant", "moth"][i % 3], split_of[int(rng.integers(0, 5))])
            for i in rng.permutation(40)]
    (export / "catalog.csv").write_text("".join(f"{p},{label},{split}\n" for p, label, split in rows))
    listing = read_manifest(export / "catalog.csv")
    order = {"": 0, "train": 0, "val": 1, "validation": 1, "test": 2}
    expected = sorted(rows, key=lambda r: (order[r[2]], r[1], r[0]))
    assert [(e.path, e.label) for e in listing.entries] == [(p, label) for p, label, _ in expected]
    assert [e.split for e in listing.entries] == [{"": None, "validation": "val"}.get(s, s) for _, _, s in expected]
    assert listing.given_splits == {"train", "val", "test"}
    entry = listing.entries[0]
    assert entry.size == (export / entry.path).stat().st_size and entry.mtime_ns > 0
    assert listing.entries.label_indices(["ant", "moth", "zebra"]).tolist() == [
        ["ant", "moth", "zebra"].index(e.label) for e in listing.entries]


def test_a_manifests_bad_rows_are_all_named_before_any_decoding(tmp_path):
    export = _manifest_tree(tmp_path)
    (export / "catalog.csv").write_text(
        "path,label,split\n"
        "img/000.jpg,red,train\n"
        "img/001.jpg,,train\n"           # empty label
        "img/002.jpg,red,holdout\n"      # unknown split
        "img/missing.jpg,blue,\n"        # no such file: the image's problem, not the manifest's
        "img/003.jpg,blue,test,sku,acme,more\n"  # too many columns
        "img/004.jpg,blue\n")
    cfg = DataConfig(source=str(export / "catalog.csv"), stored_size=16, image_size=16)
    with pytest.raises(DataError) as err:
        prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    message = str(err.value)
    assert "3 bad row(s)" in message and "missing.jpg" not in message
    assert "catalog.csv:3: img/001.jpg: empty label" in message
    assert "catalog.csv:4: img/002.jpg: unknown split 'holdout'" in message
    assert "catalog.csv:6: 6 columns" in message
    assert not (tmp_path / "p").exists() and not (tmp_path / "p.work").exists()


def test_a_manifest_row_whose_file_is_missing_follows_on_bad_image(tmp_path):
    export = _manifest_tree(tmp_path)
    rows = [f"img/{i:03d}.jpg,{'red' if i % 2 else 'blue'}," for i in range(40)] + ["img/gone.jpg,red,"]
    (export / "catalog.csv").write_text("\n".join(rows) + "\n")
    cfg = DataConfig(source=str(export / "catalog.csv"), stored_size=16, image_size=16, prepare_workers=1)
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    assert report["num_bad"] == 1 and sum(report["splits"].values()) == 40
    assert report["bad_files"][0]["path"] == "img/gone.jpg" and "file not found" in report["bad_files"][0]["reason"]
    with pytest.raises(DataError, match=r"1 unusable image\(s\).*\n  img/gone.jpg: file not found"):
        prepare(DataConfig(source=str(export / "catalog.csv"), on_bad_image="fail"), 0, tmp_path / "q", tmp_path / "r.json")
    assert not (tmp_path / "q.work").exists()  # refused before anything was decoded


def test_the_flat_folder_error_offers_a_manifest(tmp_path):
    root = tmp_path / "tree"
    for i in range(4):
        save_image(root / "train" / ("a" if i % 2 else "b") / f"{i}.png", colour_image(i))
        save_image(root / "val" / f"{i}.png", colour_image(10 + i))
    with pytest.raises(DataError, match=r"or list them in a manifest \(a \.csv with the columns path,label"):
        prepare(DataConfig(source=str(root), stored_size=16, image_size=16), 0, tmp_path / "p", tmp_path / "r.json")

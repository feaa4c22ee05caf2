"""Splits that never leak across weekly catalog updates: the split ledger (absences, fresh clones,
resets), re-encodes, a growing small class, twins, placeholders, label conflicts and relabels."""

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from cnnpipe.config import DataConfig
from cnnpipe.data.prepare import DataError, prepare
from cnnpipe.data.splits.draw import hashed_unit
from cnnpipe.data.store.shards import new_rows, suppliers
from conftest import colour_image, meta_lines, save_image


def _store(store: Path) -> dict[str, dict[str, str]]:
    """Per split: source path -> sha256."""
    out = {}
    for split in ("train", "val", "test"):
        out[split] = {item["source"]: item["sha256"] for item in meta_lines(store, split)}
    return out


SEEDS = {"shoes": 0, "bags": 1000, "hats": 2000}


def _photo(root: Path, cls: str, i: int, quality: int = 95) -> Path:
    return save_image(root / cls / f"{i:03d}.jpg", colour_image(SEEDS[cls] + i, (24, 24)), quality=quality)


def test_two_weeks_of_updates_never_put_an_old_test_photo_in_train(tmp_path):
    root = tmp_path / "catalog"
    for i in range(40):
        _photo(root, "shoes", i)
        _photo(root, "bags", i)
    for i in range(3):  # a class so small that the hash may leave it no test photo: it lends one
        _photo(root, "hats", i)
    cfg = DataConfig(source=str(root), stored_size=16, image_size=16, prepare_workers=1)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    week1 = _store(tmp_path / "p")
    held1 = {p for s in ("val", "test") for p in week1[s]}

    # Week 2: the small class grows, every tenth photo is re-exported (same path, new bytes), and a
    # test photo of shoes comes back, byte for byte, labelled bags.
    for i in range(3, 12):
        _photo(root, "hats", i)
    resaved = [f"{cls}/{i:03d}.jpg" for cls in ("shoes", "bags") for i in range(0, 40, 10)]
    for rel in resaved:
        cls, name = rel.split("/")
        _photo(root, cls, int(name[:3]), quality=60)
    twin_of = min(p for p in week1["test"] if p.startswith("shoes/") and p not in resaved)
    twin = root / "bags" / "twin.jpg"
    twin.write_bytes((root / twin_of).read_bytes())
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    week2 = _store(tmp_path / "p")

    assert not set(week1["test"]) & set(week2["train"])  # by path
    assert not set(week1["test"].values()) & set(week2["train"].values())  # by content
    for split in ("train", "val", "test"):  # every old photo, re-encoded or not, kept its split
        assert set(week1[split]) <= set(week2[split]), split
    assert not held1 & set(week2["train"])
    assert report["leakage"] == []
    assert report["num_label_conflicts"] == 1
    conflict = report["label_conflicts"][0]
    assert conflict["labels"] == ["bags", "shoes"] and conflict["split"] == "test"
    assert sorted(conflict["paths"]) == ["bags/twin.jpg", twin_of] and "bags/twin.jpg" in week2["test"]
    kept = report["ledger"]
    changed = [rel for rel in resaved if hashlib.sha256((root / rel).read_bytes()).hexdigest() not in
               {h for s in week1.values() for h in s.values()}]
    assert kept["known_by_path_after_new_bytes"] == len(changed) == len(resaved)
    assert kept["known_by_content"] == sum(len(s) for s in week1.values()) - len(resaved) + 1  # + the twin
    assert report["splits"]["test"] >= len(week1["test"]) + 1
    # Week 3: a test photo is re-exported with bytes whose hash alone says train, and a copy of those
    # bytes arrives under a new name: the photo keeps test by its path, and the copy goes with it.
    photo = min(p for p in week2["test"] if p.startswith("bags/") and p != "bags/twin.jpg")
    for quality in range(30, 90):
        data = _photo(root, "bags", int(photo[5:8]), quality=quality).read_bytes()
        if hashed_unit(hashlib.sha256(data).hexdigest(), 0) >= 0.2:  # past test (0.1) and val (0.1)
            break
    (root / "bags" / "copy.jpg").write_bytes(data)
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    week3 = _store(tmp_path / "p")
    assert report["leakage"] == [] and {photo, "bags/copy.jpg"} <= set(week3["test"])


def test_a_new_stored_size_re_decodes_but_moves_nothing(tmp_path):
    root = tmp_path / "catalog"
    for i in range(30):
        _photo(root, "shoes", i)
        _photo(root, "bags", i)
    cfg = DataConfig(source=str(root), stored_size=16, image_size=16, prepare_workers=1)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    before = _store(tmp_path / "p")
    for rel in list(before["test"])[:3]:  # re-exported too, in the same run
        cls, name = rel.split("/")
        _photo(root, cls, int(name[:3]), quality=50)
    report = prepare(DataConfig(source=str(root), stored_size=20, image_size=16, prepare_workers=1), 0,
                     tmp_path / "p", tmp_path / "r.json")
    after = _store(tmp_path / "p")
    assert report["work"]["decoded"] == 60 and report["changes"]["moved_between_splits"] == 0
    assert {s: set(v) for s, v in before.items()} == {s: set(v) for s, v in after.items()}
    assert np.load(tmp_path / "p" / "train_labels.npy").size == len(after["train"])


def test_a_capped_split_changes_by_the_new_photos_not_a_redraw():
    from cnnpipe.data.splits.sticky import stable_cap

    rng = np.random.default_rng(0)
    digests = np.frombuffer(rng.bytes(32 * 1100), dtype="S32")
    labels = rng.integers(0, 5, 1100)
    old = stable_cap(labels[:1000], digests[:1000], 200, seed=3)
    new = stable_cap(labels, digests, 200, seed=3)  # 100 new photos arrive
    assert len(old) == len(new) == 200
    assert np.abs(np.bincount(labels[new], minlength=5) - 200 * np.bincount(labels, minlength=5) / 1100).max() < 1
    dropped = set(old) - set(new)
    came = set(new) - set(old)
    # Each photo that left was displaced by a new one with a lower hash, or by its class's quota.
    assert len(dropped) == len(came) <= len([i for i in came if i >= 1000]) + 5
    assert np.array_equal(stable_cap(labels, digests, None, seed=3), np.arange(1100))


def test_a_new_seed_or_new_fractions_draw_only_new_photos_and_a_reset_redraws_all(tmp_path):
    root = tmp_path / "catalog"
    for i in range(40):
        _photo(root, "shoes", i)
        _photo(root, "bags", i)
    cfg = DataConfig(source=str(root), stored_size=16, image_size=16, prepare_workers=1)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    before = _store(tmp_path / "p")
    for i in range(40, 60):
        _photo(root, "shoes", i)
    wider = dataclasses.replace(cfg, val_fraction=0.4)
    report = prepare(wider, 1, tmp_path / "p", tmp_path / "r.json")  # a new seed too
    after = _store(tmp_path / "p")
    assert report["ledger"]["rule_changed"] is True and report["changes"]["moved_between_splits"] == 0
    assert all(set(before[s]) <= set(after[s]) for s in before)  # the known photos keep their splits
    new = {f"shoes/{i:03d}.jpg" for i in range(40, 60)}
    assert len(new & set(after["val"])) >= 4  # drawn by the new rule: 40% val

    redraw = dataclasses.replace(wider, split_reset="2024-06 rebalance")
    report = prepare(redraw, 1, tmp_path / "p", tmp_path / "r.json")
    assert report["ledger"]["reset"] == "2024-06 rebalance" and report["changes"]["moved_between_splits"] > 0
    assert len(_store(tmp_path / "p")["val"]) > 30
    assert report["train_images_once_held_out"] > 0  # the ledger remembers what the reset let back
    again = prepare(redraw, 1, tmp_path / "p", tmp_path / "r.json")  # the same name: recorded, not redone
    assert again["ledger"]["reset"] is None and again["changes"]["moved_between_splits"] == 0
    assert again["ledger"]["records_added"] == 0 and again["ledger"]["segments"] == 3


def _export(root: Path, week: int, quality: int = 95) -> None:
    """200 photos of two classes, exported at `quality` (a new export: new bytes, same paths)."""
    for i in range(200):
        cls = "shoes" if i % 2 else "bags"
        save_image(root / cls / f"{i:03d}.jpg", colour_image(SEEDS[cls] + i, (24, 24)), quality=quality)


def test_a_photo_absent_for_a_week_keeps_its_test_split_when_it_returns(tmp_path):
    """Re-exported test photos keep test by path; out of stock a week later; back the week after."""
    root = tmp_path / "catalog"
    cfg = DataConfig(source=str(root), stored_size=8, image_size=8, prepare_workers=1)
    _export(root, 1)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    week1 = _store(tmp_path / "p")
    _export(root, 2, quality=70)  # every photo re-exported
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    assert {s: set(v) for s, v in _store(tmp_path / "p").items()} == {s: set(v) for s, v in week1.items()}
    away = {rel: (root / rel).read_bytes() for rel in week1["test"]}
    for rel in away:
        (root / rel).unlink()
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    for rel, data in away.items():  # back in the catalog
        (root / rel).write_bytes(data)
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    week4 = _store(tmp_path / "p")
    assert set(week4["test"]) == set(week1["test"]) and not set(away) & set(week4["train"])
    assert report["ledger"]["known_by_content"] == 200


def test_a_fresh_clone_with_the_ledger_but_no_store_draws_the_same_splits(tmp_path):
    root = tmp_path / "catalog"
    cfg = DataConfig(source=str(root), stored_size=8, image_size=8, prepare_workers=1)
    _export(root, 1)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    _export(root, 2, quality=70)  # new bytes: the hash alone would draw ~80% of the test photos again
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    grown = _store(tmp_path / "p")
    clone = tmp_path / "clone"
    shutil.copytree(tmp_path / "p_ledger", clone / "ledger")  # what `dvc pull data/split_ledger` brings
    report = prepare(cfg, 0, clone / "prepared", clone / "r.json", ledger_dir=clone / "ledger")
    assert report["work"]["decoded"] == 200 and report["ledger"]["records_added"] == 0
    assert {s: set(v) for s, v in _store(clone / "prepared").items()} == {s: set(v) for s, v in grown.items()}
    scratch = prepare(cfg, 0, tmp_path / "scratch", tmp_path / "r2.json")  # no ledger at all: drawn afresh
    assert set(_store(tmp_path / "scratch")["test"]) != set(grown["test"])
    assert scratch["ledger"]["segments"] == 1


def test_a_fresh_clone_whose_dvc_lock_names_a_ledger_it_lacks_refuses_with_the_fix(tmp_path):
    project = tmp_path / "project"
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=project.mkdir() or project, check=True)
    (project / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {"prepare": {"cmd": "x", "outs": [
        {"path": "data/split_ledger", "hash": "md5", "md5": "0" * 32 + ".dir", "size": 10, "nfiles": 3}]}}}))
    root = tmp_path / "catalog"
    _export(root, 1)
    cfg = DataConfig(source=str(root), stored_size=8, image_size=8, prepare_workers=1)
    data = project / "data"
    with pytest.raises(DataError) as err:
        prepare(cfg, 0, data / "prepared", tmp_path / "r.json", ledger_dir=data / "split_ledger")
    assert "dvc.lock records data/split_ledger" in str(err.value) and "dvc pull" in str(err.value)
    assert "data.split_reset" not in str(err.value) and not (data / "prepared").exists()  # no advice that forgets
    reset = dataclasses.replace(cfg, split_reset="new machine")  # starting over on purpose is allowed (docs/data.md)
    assert prepare(reset, 0, data / "prepared", tmp_path / "r.json", ledger_dir=data / "split_ledger")["ledger"][
        "reset"] == "new machine"


def test_one_blank_manifest_cell_moves_nothing(tmp_path):
    """Week 1 marks every row train (val and test are carved from them); week 2 leaves one cell blank."""
    export = tmp_path / "export"
    for i in range(100):
        save_image(export / "img" / f"{i:03d}.png", colour_image(i, (12, 12)))
    lines = [f"img/{i:03d}.png,{'red' if i % 2 else 'blue'},train" for i in range(100)]
    (export / "catalog.csv").write_text("\n".join(lines) + "\n")
    cfg = DataConfig(source=str(export / "catalog.csv"), stored_size=8, image_size=8, prepare_workers=1)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    week1 = _store(tmp_path / "p")
    assert week1["test"] and week1["val"]
    lines[50] = lines[50][: -len("train")]
    (export / "catalog.csv").write_text("\n".join(lines) + "\n")
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    assert {s: set(v) for s, v in _store(tmp_path / "p").items()} == {s: set(v) for s, v in week1.items()}
    assert report["changes"]["moved_between_splits"] == 0 and report["leakage"] == []


def test_sixty_groups_sharing_one_placeholder_keep_their_splits(tmp_path):
    """Each product group carries the same "coming soon" image: a placeholder, not a link."""
    export = tmp_path / "export"
    rows = []
    for g in range(60):
        for k in range(3):
            i = 3 * g + k
            save_image(export / "img" / f"{i:04d}.png", colour_image(i, (12, 12)))
            rows.append(f"img/{i:04d}.png,{('shoes', 'bags', 'hats')[g % 3]},,sku{g}")
    for i in range(180, 600):
        save_image(export / "img" / f"{i:04d}.png", colour_image(i, (12, 12)))
        rows.append(f"img/{i:04d}.png,{('shoes', 'bags', 'hats')[i % 3]},,")
    (export / "catalog.csv").write_text("\n".join(rows) + "\n")
    cfg = DataConfig(source=str(export / "catalog.csv"), stored_size=8, image_size=8, prepare_workers=1)
    prepare(cfg, 0, tmp_path / "without", tmp_path / "r.json")
    save_image(export / "img" / "coming_soon.png", np.full((12, 12, 3), 200, np.uint8))
    for g in range(60):
        (export / "img" / f"soon{g}.png").write_bytes((export / "img" / "coming_soon.png").read_bytes())
        rows.append(f"img/soon{g}.png,{('shoes', 'bags', 'hats')[g % 3]},,sku{g}")
    (export / "catalog.csv").write_text("\n".join(rows) + "\n")
    report = prepare(cfg, 0, tmp_path / "with", tmp_path / "r.json")
    without, with_ = _store(tmp_path / "without"), _store(tmp_path / "with")
    assert {s: set(v) for s, v in with_.items()} == {s: set(v) for s, v in without.items()}
    assert report["num_placeholders"] == 1 and report["placeholders"][0]["files"] == 60
    assert report["placeholders"][0]["groups"] == 60 and report["placeholders"][0]["labels"] == 3


@pytest.mark.parametrize("action", ["hold_out", "quarantine"])
def test_a_label_conflicts_copies_leave_train(tmp_path, action):
    root = tmp_path / "catalog"
    for i in range(30):
        _photo(root, "shoes", i)
        _photo(root, "bags", i)
    cfg = DataConfig(source=str(root), stored_size=8, image_size=8, prepare_workers=1, label_conflicts=action)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    photo = min(_store(tmp_path / "p")["train"])  # in train, and so its copy by content
    copy = root / ("bags" if photo.startswith("shoes") else "shoes") / "copy.jpg"
    copy.write_bytes((root / photo).read_bytes())
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    store = _store(tmp_path / "p")
    where = {path: split for split, items in store.items() for path in items}
    pair = {photo, copy.relative_to(root).as_posix()}
    assert report["num_label_conflicts"] == 1 and set(report["label_conflicts"][0]["paths"]) == pair
    assert {where.get(p) for p in pair} == ({"test"} if action == "hold_out" else {None})
    assert report["leakage"] == []


def test_a_relabel_between_weeks_is_counted_per_class_pair(tmp_path):
    root = tmp_path / "catalog"
    for i in range(20):
        _photo(root, "shoes", i)
        _photo(root, "bags", i)
        _photo(root, "hats", i)
    cfg = DataConfig(source=str(root), stored_size=8, image_size=8, prepare_workers=1)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    for i in range(3):  # three shoes were bags all along, one hat was a bag
        (root / "shoes" / f"{i:03d}.jpg").rename(root / "bags" / f"from_shoes_{i}.jpg")
    (root / "hats" / "000.jpg").rename(root / "bags" / "from_hats.jpg")
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    assert report["relabels"] == [{"from": "shoes", "to": "bags", "images": 3}, {"from": "hats", "to": "bags", "images": 1}]
    assert json.loads((tmp_path / "r.json").read_text())["relabels"] == report["relabels"]
    assert report["changes"]["moved_between_splits"] == 0


def test_a_held_out_photo_the_source_moves_into_train_is_refused_unless_a_reset_asks(tmp_path):
    root = tmp_path / "tree"
    for split, n in (("train", 12), ("val", 3), ("test", 3)):
        for cls in ("shoes", "bags"):
            for i in range(n):
                save_image(root / split / cls / f"{split}{i}.png", colour_image(SEEDS[cls] + len(split) * 100 + i, (12, 12)))
    cfg = DataConfig(source=str(root), stored_size=8, image_size=8, prepare_workers=1)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    (root / "test" / "bags" / "test0.png").rename(root / "train" / "bags" / "test0.png")
    with pytest.raises(DataError, match=r"(?s)1 image\(s\) the split ledger holds out.*train/bags/test0.png \(held out "
                                        r"in test\).*data.split_reset"):
        prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    report = prepare(dataclasses.replace(cfg, split_reset="moved by hand"), 0, tmp_path / "p", tmp_path / "r.json")
    assert "train/bags/test0.png" in _store(tmp_path / "p")["train"] and report["ledger"]["reset"] == "moved by hand"


def test_a_manifests_suppliers_are_kept_per_image(tmp_path):
    export = tmp_path / "export"
    rows = ["title,path,supplier,label"]  # a header names the columns, in any order; others are ignored
    for i in range(40):
        save_image(export / "img" / f"{i:03d}.png", colour_image(i, (12, 12)))
        rows.append(f"item {i},img/{i:03d}.png,{'acme' if i % 3 else ''},{'red' if i % 2 else 'blue'}")
    (export / "catalog.csv").write_text("\n".join(rows) + "\n")
    cfg = DataConfig(source=str(export / "catalog.csv"), stored_size=8, image_size=8, prepare_workers=1)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    for split, sources in _store(tmp_path / "p").items():
        expected = [None if int(p[4:7]) % 3 == 0 else "acme" for p in sources]
        assert suppliers(tmp_path / "p", split) == expected


def test_every_photo_of_a_group_lands_in_one_split(tmp_path):
    export = tmp_path / "export"
    rows = []
    for g in range(30):
        for k in range(3):  # three photos of each product, different bytes
            i = 3 * g + k
            save_image(export / "img" / f"{i:03d}.png", colour_image(i))
            rows.append(f"img/{i:03d}.png,{'red' if g % 2 else 'blue'},,sku-{g}")
    rows.append("img/extra.png,red,,")  # no group: a group of one
    save_image(export / "img" / "extra.png", colour_image(999))
    (export / "catalog.csv").write_text("path,label,split,group\n" + "\n".join(rows) + "\n")
    cfg = DataConfig(source=str(export / "catalog.csv"), stored_size=16, image_size=16, prepare_workers=1,
                     val_fraction=0.2, test_fraction=0.2)
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    store = _store(tmp_path / "p")
    split_of = {path: split for split, sources in store.items() for path in sources}
    for g in range(30):
        assert len({split_of[f"img/{3 * g + k:03d}.png"] for k in range(3)}) == 1, g
    assert len(set(split_of.values())) == 3 and len(split_of) == 91
    assert report["groups"]["groups"] == 30 and report["groups"]["photos_in_groups"] == 90


def test_copies_and_groups_are_kept_together_through_a_chain():
    from cnnpipe.data.splits.sticky import colocate

    # A, B: group 0 (test); C, D: group 1 (train); A and C the same bytes; D and E the same bytes.
    digests = np.array([b"a" * 32, b"b" * 32, b"a" * 32, b"d" * 32, b"d" * 32], dtype="S32")
    groups = np.array([0, 0, 1, 1, -1])
    names = np.array(["test", "test", "train", "train", "train"], dtype=object)
    movable = np.array([True, True, True, True, True])
    assert colocate(names, np.arange(5), movable, digests, groups) == 3
    assert list(names) == ["test"] * 5
    names = np.array(["train", "train", "val", "train", "train"], dtype=object)
    movable[2] = False  # a split the source gives: it stays, and pulls the chain to val
    colocate(names, np.arange(5), movable, digests, groups)
    assert list(names) == ["val", "val", "val", "val", "val"]


def _manifest(export: Path, rows: list[tuple[int, str, str, str]]) -> Path:
    for i, _, _, _ in rows:
        save_image(export / "img" / f"{i:03d}.png", colour_image(i))
    text = "".join(f"img/{i:03d}.png,{label},{split},{group}\n" for i, label, split, group in rows)
    (export / "catalog.csv").write_text(text)
    return export / "catalog.csv"


def test_blank_rows_join_their_group_and_held_out_photos_stay_held_out_when_the_source_gives_test(tmp_path):
    # Week 1: every row blank, test and val carved.
    rows = [(i, "red" if i % 2 else "blue", "", "") for i in range(60)]
    manifest = _manifest(tmp_path / "export", rows)
    cfg = DataConfig(source=str(manifest), stored_size=16, image_size=16, prepare_workers=1,
                     test_fraction=0.2, val_fraction=0.1)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    week1 = _store(tmp_path / "p")
    # Week 2: the export now marks a few new rows test, and one blank row is a group mate of one.
    rows += [(60 + i, "red", "test", "sku-new" if i == 0 else "") for i in range(3)]
    rows.append((70, "red", "", "sku-new"))
    manifest = _manifest(tmp_path / "export", rows)
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    week2 = _store(tmp_path / "p")
    assert not set(week1["test"]) & set(week2["train"])  # test is no longer carved, yet they stay out
    assert set(week1["test"]) <= set(week2["test"]) | set(week2["val"])
    assert "img/070.png" in week2["test"] and report["moved_to_join_a_copy_or_group"] >= 1


def test_a_folder_tree_groups_photos_by_a_file_name_rule(tmp_path):
    """`data.group_pattern`: sku0007_front.jpg and sku0007_back.jpg of one class share a split; the
    same product id under another class is another group."""
    root = tmp_path / "catalog"
    for sku in range(30):
        for view in ("front", "back", "side"):
            save_image(root / "shoes" / f"sku{sku:04d}_{view}.png", colour_image(sku * 10 + len(view), (12, 12)))
    save_image(root / "bags" / "sku0000_front.png", colour_image(999, (12, 12)))
    for i in range(20):
        save_image(root / "bags" / f"loose{i}.png", colour_image(500 + i, (12, 12)))
    cfg = DataConfig(source=str(root), stored_size=8, image_size=8, prepare_workers=1, group_pattern=r"^(sku\d+)_")
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    split_of = {path: split for split, items in _store(tmp_path / "p").items() for path in items}
    for sku in range(30):
        assert len({split_of[f"shoes/sku{sku:04d}_{view}.png"] for view in ("front", "back", "side")}) == 1
    assert {split_of[p] for p in split_of if p.startswith("shoes/")} == {"train", "val", "test"}
    assert report["groups"] == {"groups": 31, "photos_in_groups": 91}


def test_the_store_marks_the_images_new_since_the_previous_store(tmp_path):
    """What the delivery check and the gate's slices read: new bytes, in each split's order."""
    root = tmp_path / "catalog"
    for i in range(30):
        _photo(root, "shoes", i)
        _photo(root, "bags", i)
    cfg = DataConfig(source=str(root), stored_size=8, image_size=8, prepare_workers=1)
    first = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    assert all(new_rows(tmp_path / "p", s).all() for s in ("train", "val", "test"))  # no store before
    assert sum(first["new_images"].values()) == 60
    for i in range(30, 50):
        _photo(root, "shoes", i)
    _photo(root, "bags", 0, quality=60)  # re-exported: new bytes
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    fresh = {f"shoes/{i:03d}.jpg" for i in range(30, 50)} | {"bags/000.jpg"}
    for split in ("train", "val", "test"):
        sources = [meta["source"] for meta in meta_lines(tmp_path / "p", split)]
        marked = new_rows(tmp_path / "p", split)
        assert len(marked) == len(sources)
        assert {s for s, new in zip(sources, marked) if new} == fresh & set(sources), split
    assert sum(report["new_images"].values()) == len(fresh)

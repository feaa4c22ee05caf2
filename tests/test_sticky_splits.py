"""Splits that never leak across weekly catalog updates (re-encodes, a growing small class, twins)."""

import hashlib
import json
from pathlib import Path

import numpy as np

from cnnpipe.config import DataConfig
from cnnpipe.data.prepare import prepare
from cnnpipe.data.split import hashed_unit
from conftest import colour_image, save_image


def _store(store: Path) -> dict[str, dict[str, str]]:
    """Per split: source path -> sha256."""
    out = {}
    for split in ("train", "val", "test"):
        lines = (store / f"{split}_meta.jsonl").read_text().splitlines()
        out[split] = {item["source"]: item["sha256"] for item in map(json.loads, lines)}
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
    kept = report["kept_from_previous_store"]
    changed = [rel for rel in resaved if hashlib.sha256((root / rel).read_bytes()).hexdigest() not in
               {h for s in week1.values() for h in s.values()}]
    assert kept["kept_by_path_after_new_bytes"] == len(changed) == len(resaved)
    assert kept["kept_by_content"] == sum(len(s) for s in week1.values()) - len(resaved) + 1  # + the twin
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
    from cnnpipe.data.sticky import stable_cap

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


def test_a_new_seed_or_new_fractions_redraw_the_splits(tmp_path):
    root = tmp_path / "catalog"
    for i in range(40):
        _photo(root, "shoes", i)
        _photo(root, "bags", i)
    prepare(DataConfig(source=str(root), stored_size=16, image_size=16, prepare_workers=1), 0,
            tmp_path / "p", tmp_path / "r.json")
    report = prepare(DataConfig(source=str(root), stored_size=16, image_size=16, prepare_workers=1,
                                val_fraction=0.3), 0, tmp_path / "p", tmp_path / "r.json")
    assert report["kept_from_previous_store"]["split_rule_changed"] is True
    assert report["kept_from_previous_store"]["kept_by_content"] == 0
    assert report["changes"]["moved_between_splits"] > 0 and report["splits"]["val"] > 12


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
    from cnnpipe.data.sticky import colocate

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

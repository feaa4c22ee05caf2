"""The weekly loop's memory of the delivery check and of training, on stores `prepare` writes and the
colour-probe champion of test_delivery (right and calibrated by construction, nothing learned):
the check's photos are those the champion's data did not hold, so a rerun checks them again; a held
photo stays held the weeks after until relabelled or cleared; a test image once in a training split
is left out of the gate's comparison and evaluate's numbers; and by default a swapped week is held
out and promote asks for an acknowledgement."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from cnnpipe.config import DataConfig
from cnnpipe.data.splits.held_out import open_compared, open_judged, open_kept
from cnnpipe.data.sources.entries import DataError
from cnnpipe.data.splits.holds import empty_list_md5, last_list, read_held_list
from cnnpipe.data.splits.ledger import HOLD
from cnnpipe.data.prepare import prepare
from cnnpipe.data.store.shards import new_rows, open_split, read_index
from cnnpipe.release.clear import main as clear_main
from cnnpipe.release.delivery import check_delivery, write_delivery
from cnnpipe.release.production import ProductionUnknown
from cnnpipe.release_config import ReleaseConfig
from cnnpipe.train import checkpoint as ckpt
from conftest import ROOT, base_params, meta_lines, tiny_params, write_params
from test_delivery import CLASSES, COLOURS, colour_photo, probe_checkpoint, read_list, run_stage

SWAPPED = [("red", "green", 40), ("green", "red", 40)]


def catalog_config(root: Path, **overrides) -> DataConfig:
    return DataConfig(source=str(root / "catalog"), stored_size=8, image_size=8, prepare_workers=1,
                      val_fraction=0.1, test_fraction=0.3, **overrides)


def add_photos(root: Path, week: list[tuple[str, str, int]], tag: str, seed: int) -> None:
    """`week`'s (true colour, folder, count) photos into the catalog, named new-<tag>-<true>-<i>."""
    for j, (true, folder, count) in enumerate(week):
        for i in range(count):
            path = root / "catalog" / folder / f"new-{tag}-{true}-{i:03d}.png"
            colour_photo(path, COLOURS[true], seed + 1000 * j + i)


def week_store(root: Path, old: int = 60) -> tuple[DataConfig, Path]:
    """`old` photos a colour prepared once (store generation 1), then a week of 20 honest photos a
    colour plus 40 red photos filed as green and 40 green as red, prepared again (generation 2)."""
    cfg = catalog_config(root)
    for k, name in enumerate(CLASSES):
        for i in range(old):
            colour_photo(root / "catalog" / name / f"old-{i:03d}.png", COLOURS[name], 1000 * k + i)
    prepare(cfg, 0, root / "prepared", root / "report.json")
    add_photos(root, [(c, c, 20) for c in CLASSES] + SWAPPED, "w1", 10**5)
    prepare(cfg, 0, root / "prepared", root / "report.json")
    return cfg, root / "prepared"


def champion_of(folder: Path, generation: int | None) -> Path:
    """The colour probe, recorded as trained on the store of `generation` (as `fit` records it)."""
    path = probe_checkpoint(folder, COLOURS, 8)
    state = ckpt.load(path / "best.pt")
    state["meta"]["data_generation"] = generation
    ckpt.save_atomic(state, path / "best.pt")
    return path


def swapped_sources(files: list[dict]) -> set[str]:
    return {f["source"] for f in files if "/new-w1-red-" in f["source"] or "/new-w1-green-" in f["source"]}


def test_a_second_prepare_in_the_same_week_checks_the_same_new_photos(tmp_path):
    cfg, prepared = week_store(tmp_path)
    assert read_index(prepared)["generation"] == 2
    champion = champion_of(tmp_path / "champion", 1)
    first, files = check_delivery(prepared, champion, ReleaseConfig(), torch.device("cpu"))
    assert first["new_images"] == 4 * 20 + 80 and first["flagged"] and "champion's data" in first["new_since"]
    prepare(cfg, 0, prepared, tmp_path / "report.json")  # a rerun in the same week: nothing new since the last
    assert sum(int(new_rows(prepared, s).sum()) for s in ("train", "val", "test")) == 0  # what the check once used
    again, files_again = check_delivery(prepared, champion, ReleaseConfig(), torch.device("cpu"))
    assert again["new_images"] == first["new_images"] and again["pairs"] == first["pairs"]
    assert {f["source"] for f in files_again} == {f["source"] for f in files} and len(swapped_sources(files)) >= 70


def test_a_held_photo_stays_out_the_following_weeks_until_relabelled_or_cleared(tmp_path):
    cfg, prepared = week_store(tmp_path)
    listed, report_path = tmp_path / "delivery" / "flagged.csv", tmp_path / "delivery.json"
    report, files = check_delivery(prepared, champion_of(tmp_path / "week1", 1), ReleaseConfig(), torch.device("cpu"))
    write_delivery(report, files, report_path, listed)
    held = {f["sha256"] for f in files}
    assert report["open_flags"] == len(held) >= 70 and all(f["held_out"] for f in files)

    # The next week: the champion now is a model trained on that store (the held photos were in its
    # store, never in its training), and 10 honest photos a colour arrive.
    add_photos(tmp_path, [(c, c, 10) for c in CLASSES], "w2", 2 * 10**5)
    prepare(cfg, 0, prepared, tmp_path / "report.json", held_out=listed)
    champion = champion_of(tmp_path / "week2", 2)
    report, files = check_delivery(prepared, champion, ReleaseConfig(), torch.device("cpu"))
    assert report["new_images"] == 40 and report["held_from_earlier_weeks"] == len(held) == report["open_flags"]
    assert {f["sha256"] for f in files if f["status"] == "held"} == held and all(f["held_out"] for f in files)
    for split in ("train", "val", "test"):
        whole, (kept, _) = open_split(prepared, split), open_kept(prepared, split, None)  # the store alone holds them
        sources = [meta["sha256"] for meta in meta_lines(prepared, split)]
        assert len(whole) - len(kept) == sum(s in held for s in sources)
    segments = sorted((tmp_path / "prepared_ledger" / "segments").glob("*.npy"))
    recorded = np.load(segments[-1])
    assert int(np.sum(recorded["flags"] & HOLD > 0)) >= len(held)  # the hold is in the ledger

    # Five held photos moved to the folder of their true colour, three cleared by a person: out of the hold.
    moved = [Path(r["source"]) for r in read_list(listed) if r["given"] == "red" and "new-w1-green-" in r["source"]][:5]
    for m in moved:
        (tmp_path / "catalog" / m).rename(tmp_path / "catalog" / "green" / f"moved-{m.name}")  # names of its own
    rows = [r for r in read_list(listed) if "new-w1-red-" in r["source"]][:3]
    cleared = tmp_path / "cleared.csv"
    assert clear_main(["--list", str(listed), "--cleared", str(cleared), "--note", "looked fine",
                       "--sha256", *[r["sha256"] for r in rows]]) == 0
    write_delivery(report, files, report_path, listed)
    prepare(cfg, 0, prepared, tmp_path / "report.json", held_out=listed, cleared=cleared)
    report, files = check_delivery(prepared, champion, ReleaseConfig(), torch.device("cpu"), cleared)
    assert moved and report["held_from_earlier_weeks"] == len(held) - len(moved) - 3
    assert not {r["sha256"] for r in rows} & {f["sha256"] for f in files if f["held_out"]}


def test_a_test_image_once_trained_on_is_kept_out_of_the_comparison_and_evaluate(tmp_path):
    """A redraw of the splits (`data.split_reset`) moves some training images into the test split:
    the ledger says they were trained on, and the gate and evaluate leave them out, counted."""
    from cnnpipe.evaluate.evaluation import evaluate
    from cnnpipe.release.verdict import run_gate

    cfg, prepared = week_store(tmp_path)
    before = open_split(prepared, "test")
    assert open_judged(prepared, "test", None)[2] == 0
    prepare(catalog_config(tmp_path, split_reset="redraw"), 7, prepared, tmp_path / "report.json")
    trained = np.load(prepared / "test_trained.npy")
    split, kept, memorised = open_judged(prepared, "test", None)
    assert memorised == int(trained.sum()) > 0 and len(split) == len(open_split(prepared, "test")) - memorised
    assert len(before) and np.load(prepared / "train_trained.npy").all()

    champion = champion_of(tmp_path / "champion", 1)
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "eval.json").write_text(json.dumps({"top1": 0.9}))
    verdict = run_gate(ReleaseConfig(artifact="m"), champion, champion, tmp_path / "eval", prepared, tmp_path / "gate",
                       torch.device("cpu"))
    assert verdict["challenger"]["test_images"] == len(split) and verdict["challenger"]["test_images_once_trained_on"] \
        == memorised
    assert any(f"{memorised} test image(s) were in a training split before" in w for w in verdict["warnings"])
    result = evaluate(champion, prepared, tmp_path / "evaluated", torch.device("cpu"))
    assert result["images"] == len(split) and result["once_trained_on_left_out"] == memorised


def test_by_default_a_swapped_week_is_held_out_and_promote_asks_for_an_acknowledgement(tmp_path, capsys):
    """The default policy holds the flagged photos out of training and the gate's test; promote names
    the open flags and refuses until --accept-flagged (before it touches git)."""
    from cnnpipe.release import promote as promote_mod
    from cnnpipe.release.verdict import run_gate

    assert base_params()["release"]["delivery"]["policy"] == ReleaseConfig().delivery.policy == "hold_out"
    _, prepared = week_store(tmp_path / "w")
    champion = champion_of(tmp_path / "champion", 1)
    rc, out, _, listed = run_stage(tmp_path, prepared, champion, base_params()["release"]["delivery"]["policy"], capsys)
    rows = read_list(listed)
    assert rc == 0 and len(rows) >= 70 and all(r["held_out"] == "true" and r["status"] == "flagged" for r in rows)
    train, _ = open_kept(prepared, "train", listed)
    assert len(train) == len(open_split(prepared, "train")) - sum(r["split"] == "train" for r in rows)
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "eval.json").write_text(json.dumps({"top1": 0.9}))
    verdict = run_gate(ReleaseConfig(artifact="m"), champion, champion, tmp_path / "eval", prepared, tmp_path / "gate",
                       torch.device("cpu"), delivery=tmp_path / "metrics" / "delivery.json", held_out=listed)
    assert verdict["delivery"]["open_flags"] == len(rows)
    assert f"{len(rows)} flagged photo(s) open: `python -m cnnpipe.promote` asks for `--accept-flagged`" in \
        (tmp_path / "gate" / "gate.md").read_text()
    verdict = {**verdict, "blessed": True}
    with pytest.raises(promote_mod.Refused, match=r"(?s)left \d+ flagged photo\(s\) open.*'red'.*--accept-flagged"):
        promote_mod.promote(tmp_path, ReleaseConfig(artifact="m"), verdict)
    with pytest.raises((promote_mod.Refused, ProductionUnknown)) as refused:  # acknowledged: on to git (none here)
        promote_mod.promote(tmp_path, ReleaseConfig(artifact="m", remote=None), verdict, accept_flagged=True)
    assert "flagged photo" not in str(refused.value)
    shutil.rmtree(tmp_path / "w")


def test_clear_records_the_photos_a_person_cleared_and_refuses_what_is_not_a_sha256(tmp_path, capsys):
    from cnnpipe.data.splits.held_out import read_cleared
    from cnnpipe.release.clear import main

    listed, cleared = tmp_path / "flagged.csv", tmp_path / "cleared.csv"
    rows = [("a.png", "ab" * 32, "red", "green", "flagged"), ("b.png", "cd" * 31 + "00", "green", "red", "held"),
            ("c.png", "ef" * 32, "red", "green", "cleared")]
    listed.write_text("source,sha256,split,given,predicted,confidence,held_out,status\n" + "".join(
        f"{s},{h},train,{g},{p},0.9,{'false' if st == 'cleared' else 'true'},{st}\n" for s, h, g, p, st in rows))
    assert main(["--list", str(listed), "--cleared", str(cleared), "--note", "x", "--sha256", "ab" * 31]) == 2
    assert not cleared.exists() and "is not a sha256" in capsys.readouterr().err
    assert main(["--list", str(listed), "--cleared", str(cleared), "--note", "checked by Ana", "--all",
                 "--given", "green"]) == 0
    assert main(["--list", str(listed), "--cleared", str(cleared), "--note", "again", "--all"]) == 0  # the open ones
    assert cleared.read_text().splitlines() == ["sha256,note", f"{'cd' * 31}00,checked by Ana", f"{'ab' * 32},again"]
    assert len(read_cleared(cleared)) == 2 and "1 photo(s) added" in capsys.readouterr().out


def test_training_records_the_generation_of_the_store_it_was_trained_on(tmp_path, prepared):
    """What the next week's check compares arrivals with: `fit` writes index.json's generation into best.pt."""
    from cnnpipe.params import load_params, resolve
    from cnnpipe.train import trainer
    from cnnpipe.train.distributed import DistInfo

    store = shutil.copytree(prepared, tmp_path / "prepared")
    index = json.loads((store / "index.json").read_text())
    (store / "index.json").write_text(json.dumps({**index, "generation": 3}))
    cfg = resolve(load_params(write_params(tmp_path / "params.yaml", tiny_params(epochs=1))), "baseline")
    trainer.fit(cfg, DistInfo(), store, tmp_path / "models", tmp_path / "train.json", tmp_path / "live")
    assert ckpt.load(tmp_path / "models" / "best.pt")["meta"]["data_generation"] == 3


def test_a_rerun_of_the_check_alone_keeps_the_last_checks_holds(tmp_path):
    """After a promote or a rollback the champion changes and the check reruns before any prepare: the
    photos it held are no longer new to that champion, yet they stay held (the last list of this same
    store, read back), until a person clears them."""
    cfg, prepared = week_store(tmp_path)
    listed, report_path = tmp_path / "delivery" / "flagged.csv", tmp_path / "delivery.json"
    report, files = check_delivery(prepared, champion_of(tmp_path / "week1", 1), ReleaseConfig(), torch.device("cpu"))
    write_delivery(report, files, report_path, listed)
    held = {f["sha256"] for f in files if f["held_out"]}
    assert len(held) >= 70

    later = champion_of(tmp_path / "promoted", 2)  # a champion whose data held this store: nothing is new to it
    forgot, _ = check_delivery(prepared, later, ReleaseConfig(), torch.device("cpu"))
    assert forgot["new_images"] == 0 and forgot["open_flags"] == 0  # what the list alone would have kept
    previous = read_held_list(listed)
    report, files = check_delivery(prepared, later, ReleaseConfig(), torch.device("cpu"), previous=previous)
    assert {f["sha256"] for f in files if f["held_out"] and f["status"] == "held"} == held
    assert report["open_flags"] == len(held) == report["held_from_earlier_weeks"]

    cleared = tmp_path / "cleared.csv"
    first = sorted(held)[:3]
    assert clear_main(["--list", str(listed), "--cleared", str(cleared), "--note", "checked", "--sha256", *first]) == 0
    report, files = check_delivery(prepared, later, ReleaseConfig(), torch.device("cpu"), cleared, previous)
    assert report["open_flags"] == len(held) - 3 and not set(first) & {f["sha256"] for f in files if f["held_out"]}


DELIVERY_ONLY = """stages:
  delivery:
    cmd: python probe_stage.py --params params.yaml --data prepared --champion champion --out delivery.json
      --list flagged.csv --cleared cleared.csv
    deps:
      - prepared
      - champion
    outs:
      - flagged.csv
    metrics:
      - delivery.json:
          cache: false
"""
PROBE_STAGE = """import runpy, sys
sys.path.insert(0, {tests!r})
import test_delivery  # registers the colour probe with timm: the champion's model
runpy.run_path({stage!r}, run_name="__main__")
"""


def test_dvc_repro_of_the_check_after_a_new_champion_keeps_its_holds(tmp_path):
    """The same as above, the way the loop runs it: `dvc repro delivery`, the champion replaced (a promote
    with --accept-flagged, or a rollback), `dvc repro delivery` again before any prepare. DVC removes the
    list before the stage runs, so the stage reads its last list back from the DVC cache (dvc.lock's
    record); every photo it held is listed held again, none trained on."""
    project = tmp_path / "project"
    _, prepared = week_store(project)
    champion_of(project / "champion", 1)
    params = base_params()
    params["train"]["device"] = "cpu"
    write_params(project / "params.yaml", params)
    (project / "dvc.yaml").write_text(DELIVERY_ONLY)
    (project / "probe_stage.py").write_text(PROBE_STAGE.format(tests=str(ROOT / "tests"),
                                                               stage=str(ROOT / "stages" / "delivery.py")))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "DVC_NO_ANALYTICS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def dvc(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    dvc("init", "-q", "--no-scm")
    dvc("repro", "-q", "delivery")
    first = read_list(project / "flagged.csv")
    held = {r["sha256"] for r in first if r["held_out"] == "true"}
    assert len(held) >= 70 and all(r["status"] == "flagged" for r in first)

    shutil.rmtree(project / "champion")
    champion_of(project / "champion", 2)  # trained on this store: none of its photos is new to it
    dvc("repro", "-q", "delivery")
    again = read_list(project / "flagged.csv")
    assert {r["sha256"] for r in again if r["status"] == "held" and r["held_out"] == "true"} == held
    report = json.loads((project / "delivery.json").read_text())
    assert report["new_images"] == 0 and report["open_flags"] == len(held) == report["held_from_earlier_weeks"]


def test_a_known_photo_relabelled_is_checked_like_a_new_one_and_left_out_of_the_gates_comparison(tmp_path):
    """Thirty photos the champion's data held as red, now filed under green (a supplier's re-export):
    arrival is by content, so they were never checked. Marked relabelled, they are new to the check,
    which flags them; their test photos, which favour a challenger trained on the new labels, are left
    out of the gate's comparison and counted. A class renamed on purpose relabels nothing."""
    cfg, prepared = week_store(tmp_path)
    champion = champion_of(tmp_path / "champion", 2)  # trained on this store: nothing is new to it
    assert check_delivery(prepared, champion, ReleaseConfig(), torch.device("cpu"))[0]["new_images"] == 0
    moved = sorted((tmp_path / "catalog" / "red").glob("old-*.png"))[:30]
    for path in moved:
        path.rename(tmp_path / "catalog" / "green" / path.name.replace("old-", "was-red-"))
    report = prepare(cfg, 0, prepared, tmp_path / "report.json")
    assert sum(report["holds"]["relabelled"].values()) == 30
    checked, files = check_delivery(prepared, champion, ReleaseConfig(), torch.device("cpu"))
    assert checked["new_images"] == 30 and checked["flagged"]
    assert {f["source"] for f in files} == {f"green/{p.name.replace('old-', 'was-red-')}" for p in moved}
    _, kept, left_out = open_compared(prepared, "test", None)
    in_test = int(np.load(prepared / "test_relabelled.npy").sum())
    assert in_test > 0 and left_out["relabelled"] == in_test and len(kept) == len(open_split(prepared, "test")) - in_test
    (tmp_path / "catalog" / "red").rename(tmp_path / "catalog" / "scarlet")
    renamed = prepare(cfg, 0, prepared, tmp_path / "report.json", renamed={"red": "scarlet"})
    assert sum(renamed["holds"]["relabelled"].values()) == 0  # red's photos are scarlet's now, on purpose


@pytest.mark.parametrize("listed", [False, True])
def test_a_fresh_clone_reruns_a_check_that_listed_nothing_and_is_refused_one_that_listed_photos(tmp_path, listed):
    """A fresh clone (no DVC cache, no remote) whose dvc.lock records the delivery list of the very store
    its prepare rebuilt: a list of no photo (the demo's, before any champion: its header row alone) holds
    nothing, so the check reruns; a list with photos in it is refused, naming it (its holds would be lost)."""
    project = tmp_path / "project"
    project.mkdir()
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q", "--no-scm"], cwd=project, check=True,
                   env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    store, listed_md5 = "0" * 32 + ".dir", ("1" * 32 if listed else empty_list_md5())
    lock = {"schema": "2.0", "stages": {
        "prepare": {"cmd": "prepare", "outs": [{"path": "data/prepared", "hash": "md5", "md5": store}]},
        "delivery": {"cmd": "check", "deps": [{"path": "data/prepared", "hash": "md5", "md5": store}],
                     "outs": [{"path": "data/delivery/flagged.csv", "hash": "md5", "md5": listed_md5, "size": 64}]}}}
    (project / "dvc.lock").write_text(yaml.safe_dump(lock))
    if listed:
        with pytest.raises(DataError, match="dvc.lock records the delivery list data/delivery/flagged.csv"):
            last_list(project / "data" / "delivery" / "flagged.csv", project / "data" / "prepared", recheck=False)
    else:
        assert last_list(project / "data" / "delivery" / "flagged.csv", project / "data" / "prepared",
                         recheck=False) == (None, None)

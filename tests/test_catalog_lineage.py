"""A split ledger belongs to a catalog: in a clone whose dvc.lock records a ledger it lacks, another
catalog starts a new ledger (said in one line), the same one (or the same files moved) is refused with
advice that works there (no DVC remote: said first), and a leftover reset name redraws nothing."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cnnpipe.config import DataConfig
from cnnpipe.data.store.keys import path_keys
from cnnpipe.data.splits.lineage import catalog_identity, path_overlap
from cnnpipe.data.prepare import DataError, prepare
from conftest import colour_image, save_image

REPO = Path(__file__).resolve().parents[1]


def _catalog(root: Path, prefix: str = "", n: int = 40) -> Path:
    for i in range(n):
        cls = "shoes" if i % 2 else "bags"
        save_image(root / cls / f"{prefix}{i:03d}.jpg", colour_image(len(prefix) * 1000 + i, (16, 16)))
    return root


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=project, check=True)
    return project


def _lock(project: Path, source: str, split_reset: str | None = None, report: Path | None = None) -> None:
    """A dvc.lock whose prepare recorded `source` and a ledger and store this project lacks (a fresh clone)."""
    outs = [{"path": "data/prepared", "hash": "md5", "md5": "1" * 32 + ".dir", "size": 10, "nfiles": 9},
            {"path": "data/split_ledger", "hash": "md5", "md5": "0" * 32 + ".dir", "size": 10, "nfiles": 3}]
    if report is not None:
        outs.append({"path": report.relative_to(project).as_posix(), "hash": "md5",
                     "md5": hashlib.md5(report.read_bytes()).hexdigest(), "size": report.stat().st_size})
    params = {"params.yaml": {"data.source": source, "data.split_reset": split_reset, "seed": 0}}
    (project / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {"prepare": {
        "cmd": "python stages/prepare.py", "params": params, "outs": outs}}}))


def _prepare(project: Path, cfg: DataConfig) -> dict:
    data = project / "data"
    return prepare(cfg, 0, data / "prepared", project / "metrics" / "data_report.json", ledger_dir=data / "split_ledger")


def test_a_clone_whose_lock_records_another_catalogs_ledger_starts_a_new_one_and_says_so(tmp_path):
    project = _project(tmp_path)
    _lock(project, "fashion-mnist")  # the committed demo's lock, as a fresh clone of it has
    root = _catalog(project / "data" / "raw" / "products")
    (project / "params.yaml").write_text(yaml.safe_dump({"seed": 0, "data": {
        "source": str(root), "stored_size": 8, "image_size": 8, "prepare_workers": 1}}))
    run = subprocess.run([sys.executable, str(REPO / "stages" / "prepare.py"), "--out", "data/prepared",
                          "--ledger", "data/split_ledger", "--report", "metrics/data_report.json"],
                         cwd=project, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    said = [line for line in run.stdout.splitlines() if "a new split ledger starts" in line]
    assert len(said) == 1 and "fashion-mnist" in said[0], run.stdout
    assert (project / "data" / "split_ledger" / "segments").is_dir()
    report = yaml.safe_load((project / "metrics" / "data_report.json").read_text())
    assert report["ledger"]["catalog"]["source"] == str(root) and len(report["ledger"]["catalog"]["sketch"]) == 40


def test_the_same_catalog_refuses_and_says_first_that_no_dvc_remote_is_configured(tmp_path):
    project = _project(tmp_path)
    root = _catalog(tmp_path / "catalog")
    _lock(project, os.path.relpath(root, project) + "/")  # the same folder, written another way
    cfg = DataConfig(source=str(root), stored_size=8, image_size=8, prepare_workers=1)
    with pytest.raises(DataError) as err:
        _prepare(project, cfg)
    said = str(err.value)
    assert "dvc.lock records data/split_ledger" in said and "No DVC remote is configured" in said
    assert said.index("No DVC remote") < said.index("dvc pull") and "dvc remote add -d" in said
    assert "data.split_reset" not in said and not (project / "data" / "prepared").exists()  # no advice that forgets
    subprocess.run([sys.executable, "-m", "dvc", "remote", "add", "-d", "storage", str(tmp_path / "remote")],
                   cwd=project, check=True, capture_output=True)
    with pytest.raises(DataError) as err:
        _prepare(project, cfg)
    assert "No DVC remote" not in str(err.value) and "from DVC remote 'storage'" in str(err.value)


def test_a_leftover_reset_name_redraws_nothing_a_new_one_starts_over(tmp_path):
    project = _project(tmp_path)
    root = _catalog(tmp_path / "catalog")
    _lock(project, str(root), split_reset="2026-01 rebalance")  # the name params.yaml still holds
    leftover = DataConfig(source=str(root), stored_size=8, image_size=8, prepare_workers=1,
                          split_reset="2026-01 rebalance")
    with pytest.raises(DataError, match="already recorded"):
        _prepare(project, leftover)
    assert not (project / "data" / "split_ledger").exists()
    fresh = DataConfig(source=str(root), stored_size=8, image_size=8, prepare_workers=1, split_reset="new machine")
    assert _prepare(project, fresh)["ledger"]["reset"] == "new machine"


def test_the_same_files_moved_to_another_folder_are_the_same_catalog(tmp_path):
    project = _project(tmp_path)
    old = _catalog(tmp_path / "old")
    cfg = DataConfig(source=str(old), stored_size=8, image_size=8, prepare_workers=1)
    report = project / "metrics" / "data_report.json"
    _prepare(project, cfg)  # the run dvc.lock records: its report (git-tracked) holds the catalog's sketch
    shutil.rmtree(project / "data")
    _lock(project, str(old), report=report)
    moved = tmp_path / "moved"
    shutil.move(old, moved)
    _catalog(moved, n=44)  # and grown a little
    with pytest.raises(DataError, match="split ledger of an earlier prepare of this catalog"):
        _prepare(project, DataConfig(source=str(moved), stored_size=8, image_size=8, prepare_workers=1))
    other = _catalog(tmp_path / "other", prefix="sku-")
    started = _prepare(project, DataConfig(source=str(other), stored_size=8, image_size=8, prepare_workers=1))
    assert "a new split ledger starts" in started["ledger"]["started"] and "0% of its file paths" in \
        started["ledger"]["started"]


def test_the_path_sketch_estimates_the_share_of_a_large_catalog_without_its_photos():
    week1 = [f"c{i % 50}/{i:07d}.jpg" for i in range(200_000)]
    week9 = week1[20_000:] + [f"c{i % 50}/{i:07d}.jpg" for i in range(200_000, 260_000)]  # -10%, +30%
    a, b = catalog_identity("imagefolder", "a", path_keys(week1)), catalog_identity("imagefolder", "b", path_keys(week9))
    assert len(a["sketch"]) == 256 and 0.75 < path_overlap(a, b) < 1.0
    unrelated = catalog_identity("imagefolder", "c", path_keys([f"x/{i}.png" for i in range(1000)]))
    assert path_overlap(a, unrelated) < 0.05

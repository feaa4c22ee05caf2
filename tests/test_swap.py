"""A prepare killed at any step of its swap loses nothing: afterwards the store and its split ledger
are both the old ones or both the new ones, never one of each, and never gone."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cnnpipe.config import DataConfig
from cnnpipe.data.store import swap
from cnnpipe.data.prepare import prepare
from cnnpipe.data.store.shards import data_fingerprint
from conftest import ROOT, colour_image, save_image

STEPS = ["staged", "marked", "p set aside", "p swapped in", "p_ledger set aside", "p_ledger swapped in", "unmarked"]

KILLED_AT = """
import os, signal, sys
from pathlib import Path
from cnnpipe.config import DataConfig
from cnnpipe.data.store import swap
from cnnpipe.data.prepare import prepare

def reached(step):
    if step == sys.argv[3]:
        os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no finally: what a power cut leaves

swap._reached = reached
folder = Path(sys.argv[2])
prepare(DataConfig(source=sys.argv[1], stored_size=8, image_size=8, prepare_workers=1), 0, folder / "p", folder / "r.json")
"""


def _photos(root: Path, start: int, stop: int) -> None:
    for i in range(start, stop):
        save_image(root / ("shoes" if i % 2 else "bags") / f"{i:03d}.png", colour_image(i, (12, 12)))


def _state(folder: Path) -> tuple[str, int]:
    """(the store's fingerprint, the ledger's segments)."""
    return data_fingerprint(folder / "p"), len(list((folder / "p_ledger" / "segments").glob("*.json")))


@pytest.fixture(scope="module")
def week(tmp_path_factory) -> tuple[Path, Path, tuple[str, int], tuple[str, int]]:
    """A catalog and the store and ledger of week 1 (`base`), the catalog grown since, and the states
    of week 1 and of week 2 prepared without a crash."""
    base = tmp_path_factory.mktemp("swap")
    catalog = base / "catalog"
    _photos(catalog, 0, 40)
    cfg = DataConfig(source=str(catalog), stored_size=8, image_size=8, prepare_workers=1)
    prepare(cfg, 0, base / "week" / "p", base / "week" / "r.json")
    _photos(catalog, 40, 50)
    shutil.copytree(base / "week", base / "clean")
    prepare(cfg, 0, base / "clean" / "p", base / "clean" / "r.json")
    return catalog, base / "week", _state(base / "week"), _state(base / "clean")


@pytest.mark.parametrize("step", STEPS)
def test_a_kill_at_any_step_of_the_swap_loses_nothing(week, step, tmp_path):
    catalog, before, old, new = week
    assert old[1] == 1 and new[1] == 2 and old[0] != new[0]
    folder = tmp_path / "project"
    shutil.copytree(before, folder)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    killed = subprocess.run([sys.executable, "-c", KILLED_AT, str(catalog), str(folder), step], env=env,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    done = swap.recover([folder / "p", folder / "p_ledger"])
    # Past the marker the new pair is complete, and the swap is finished; before it, undone.
    assert _state(folder) == (new if STEPS.index(step) >= STEPS.index("marked") else old), done
    assert sorted(p.name for p in folder.iterdir()) == ["p", "p.stat.npy", "p.work", "p_ledger", "r.json"]
    cfg = DataConfig(source=str(catalog), stored_size=8, image_size=8, prepare_workers=1)
    prepare(cfg, 0, folder / "p", folder / "r.json")  # and the next run goes on from there
    assert _state(folder) == new
    assert sorted(p.name for p in folder.iterdir()) == ["p", "p.stat.npy", "p_ledger", "r.json"]


def test_every_file_and_folder_is_fsynced_before_the_old_store_is_set_aside(week, tmp_path, monkeypatch):
    catalog, before, _, _ = week
    shutil.copytree(before, tmp_path / "project")
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = swap._fsync, os.rename
    monkeypatch.setattr(swap, "_fsync", lambda path: events.append(("fsync", str(path))) or real_fsync(path))
    monkeypatch.setattr(swap.os, "rename", lambda a, b: events.append(("rename", str(a))) or real_rename(a, b))
    cfg = DataConfig(source=str(catalog), stored_size=8, image_size=8, prepare_workers=1)
    prepare(cfg, 0, tmp_path / "project" / "p", tmp_path / "project" / "r.json")
    first_rename = next(k for k, (kind, _) in enumerate(events) if kind == "rename")
    synced = {path for kind, path in events[:first_rename] if kind == "fsync"}
    staged = tmp_path / "project"
    for name in ("p", "p_ledger"):
        for path in (staged / name).rglob("*"):  # now in place: each was fsynced under its .new name
            assert str(path).replace(f"/{name}/", f"/{name}.new/", 1) in synced, path
    assert str(staged / "p.swap") in synced or str(staged) in synced

"""The weekly loop, end to end: three weeks of a growing catalog on a git + DVC project with a bare git
remote and a DVC remote on disk; the gate blesses or refuses, GTO tags on the remote say what is in
production, a clone without tags and a serving machine find it, `gto deprecate` and a rollback pushed
from another clone move it for everyone alike, and `verify` tells a blessed assignment from a hand-made one.

No verdict here depends on what a tiny model happens to learn. The classes are colours far apart
(channel means 90+ apart, noise 20), so any model the floor lets through tells them apart; week 1's
challenger is judged like for like on the 300 test images of the five old classes, where a model no
worse than the champion is blessed (non-inferior, or too small to judge at most: both bless), and
only one worse beyond doubt (at least ~7 more mistakes than the champion on colours it already
tells apart) could be refused; week 2's supplier files 120 photos of each of two classes under the
other's label, 5 in 6 of those classes' training photos, so the challenger learns the swap and loses
most of both classes' 60 test images (a class fails with 10 lost and none won: p = 2^-10). The
serving checks compare bytes and the same model's answers, not accuracy.
"""

import csv
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import SMALLEST_PROFILE, copy_project, save_image, tiny_params, write_params

pytestmark = pytest.mark.slow

ARTIFACT = "fashion-classifier"
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "yellow": (230, 220, 30),
           "grey": (128, 128, 128), "purple": (160, 30, 200)}
OLD = ("red", "green", "blue", "yellow", "grey")
ENV = {"GIT_AUTHOR_NAME": "Product Owner", "GIT_AUTHOR_EMAIL": "po@example.com",
       "GIT_COMMITTER_NAME": "Product Owner", "GIT_COMMITTER_EMAIL": "po@example.com", "DVC_NO_ANALYTICS": "1"}


def sh(cmd: list[str], cwd: Path, ok: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **ENV)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    if ok:
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def photo(path: Path, colour: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(COLOURS[colour]) + rng.normal(0, 20, (32, 32, 3)), 0, 255).astype(np.uint8)
    save_image(path, pixels)


def add_photos(project: Path, rows: list[tuple[str, str, str, str]]) -> None:
    """Photos (file colour, label, split, name) into the catalog and its manifest."""
    catalog = project / "data" / "raw" / "catalog"
    manifest = catalog / "catalog.csv"
    lines = manifest.read_text().splitlines() if manifest.exists() else ["path,label,split"]
    for colour, label, split, name in rows:
        photo(catalog / "img" / f"{name}.png", colour, zlib.crc32(name.encode()))
        lines.append(f"img/{name}.png,{label},{split}")
    manifest.write_text("\n".join(lines) + "\n")


def delivery(week: int, colours: tuple[str, ...], train: int, val: int, test: int) -> list[tuple[str, str, str, str]]:
    """Correctly labelled photos of `colours`, with their splits set in the manifest."""
    return [(c, c, split, f"w{week}-{c}-{split}-{i}") for c in colours
            for split, n in (("train", train), ("val", val), ("test", test)) for i in range(n)]


def week(project: Path, message: str) -> dict:
    """The README's weekly commands up to promote: `dvc add`, `dvc repro gate`, commit, `dvc push`,
    `git push origin main`; returns the gate's verdict."""
    sh(["dvc", "add", "-q", "data/raw/catalog"], project)
    out = sh(["dvc", "repro", "gate"], project)
    assert "Running stage 'train@baseline'" not in out.stdout  # the weekly loop trains only the optimized recipe
    sh(["git", "add", "-A"], project)
    sh(["git", "commit", "-qm", message], project)
    sh(["dvc", "push", "-q"], project)
    sh(["git", "push", "-q", "origin", "main"], project)
    return json.loads((project / "metrics" / "gate.json").read_text())


def promote(project: Path) -> subprocess.CompletedProcess:
    return sh([sys.executable, "-m", "cnnpipe.promote"], project, ok=False)


def remote_tags(origin: Path) -> set[str]:
    return set(sh(["git", "tag", "-l"], origin).stdout.split())


def champion_in(project: Path) -> dict:
    sh(["dvc", "repro", "champion"], project)
    return json.loads((project / "models" / "champion" / "champion.json").read_text())


def served(where: Path, origin: Path) -> dict:
    """The serving machine's command: the model in prod from the remotes."""
    out = sh([sys.executable, "-m", "cnnpipe.release.fetch", str(origin), "-o", "model/best.pt"], where)
    return json.loads(out.stdout)


@pytest.fixture()
def project(tmp_path) -> Path:
    root = copy_project(tmp_path / "project")
    params = tiny_params(epochs=4)
    params["data"].update(source="data/raw/catalog/catalog.csv", stored_size=28, image_size=28)
    params["release"].update(floors={"top1": 0.6})
    # The shipped budget: a short one lets the stages' start-ups on a loaded machine shrink each week's
    # images per epoch, and a new class trained on too few of them is refused for its recall.
    params["profile"]["budget_share"] = SMALLEST_PROFILE  # six profiles (two a week) that nothing here reads
    write_params(root / "params.yaml", params)
    sh(["git", "init", "-q", "-b", "main"], root)
    sh(["git", "init", "-q", "--bare", "-b", "main", str(tmp_path / "origin.git")], tmp_path)
    sh(["git", "remote", "add", "origin", str(tmp_path / "origin.git")], root)
    sh(["dvc", "remote", "add", "-q", "-d", "storage", str(tmp_path / "dvc-remote")], root)
    sh(["git", "add", "-A"], root)
    sh(["git", "commit", "-qm", "the project"], root)
    return root


def test_three_weeks_bless_promote_refuse_serve_and_roll_back(project, tmp_path):
    origin = tmp_path / "origin.git"
    # Week 0: the first model, judged on the floors alone, becomes v0.1.0 in prod; promote pushes the tags.
    add_photos(project, delivery(0, OLD, train=24, val=8, test=60))
    gate = week(project, "week 0")
    assert gate["blessed"] and gate["first_model"] and gate["champion"]["version"] is None
    again = sh(["dvc", "repro", "gate"], project).stdout  # nothing moved: the champion reruns, nothing after it
    assert "Running stage 'champion'" in again and "Running stage 'gate'" not in again
    done = promote(project)
    assert done.returncode == 0, done.stderr
    assert {f"{ARTIFACT}@v0.1.0", f"{ARTIFACT}#prod#1"} <= remote_tags(origin)
    message = sh(["git", "tag", "-l", "--format=%(contents)", f"{ARTIFACT}#prod#1"], project).stdout
    assert "gate: blessed" in message and "first model" in message

    # Week 1: 10% more photos and a new class; the challenger starts from the champion and is judged on
    # the old classes alone, its answers taken among them.
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["variants"]["optimized"]["model"]["init"] = "champion"
    write_params(project / "params.yaml", params)
    add_photos(project, delivery(1, OLD, train=3, val=0, test=0) + delivery(1, ("purple",), train=24, val=8, test=20))
    gate = week(project, "week 1")
    champion = json.loads((project / "models" / "champion" / "champion.json").read_text())
    assert champion["version"] == "v0.1.0" and champion["tag"] == f"{ARTIFACT}#prod#1"
    train = json.loads((project / "metrics" / "optimized" / "train.json").read_text())
    assert train["init"].startswith("champion:v0.1.0") and "new classes: purple" in train["init"]
    assert gate["blessed"], gate["reasons"]
    assert gate["paired"]["images"] == 300 and [c["class"] for c in gate["new_classes"]] == ["purple"]
    assert any("20 images of new classes left out" in r for r in gate["reasons"])
    assert gate["slices"]["last week's test images"]["images"] == 300  # this week's are purple: judged on their own
    assert promote(project).returncode == 0
    assert {f"{ARTIFACT}@v0.2.0", f"{ARTIFACT}#prod#2"} <= remote_tags(origin)

    # Week 2: a supplier's training photos of red and blue, each filed under the other's label. With the
    # default params the check holds them out of training, and promote names them and asks to be told.
    add_photos(project, [("red", "blue", "train", f"w2-red-{i}") for i in range(120)]
               + [("blue", "red", "train", f"w2-blue-{i}") for i in range(120)])
    before = remote_tags(origin)
    gate = week(project, "week 2")
    named = {(p["given"], p["predicted"]) for p in gate["delivery"]["pairs"]}  # the check before training, repeated
    # How many of the 240 the champion is sure of (>= 0.8) depends on what it learnt (the CPU's numerics, the
    # threads); a flagged class's delivery is held whole: all 240, each held out and named by promote.
    flagged = gate["delivery"]["flagged_images"]
    assert named == {("red", "blue"), ("blue", "red")} and flagged == 240, flagged
    assert gate["delivery"]["policy"] == "hold_out" and gate["delivery"]["open_flags"] == flagged
    with open(project / "data" / "delivery" / "flagged.csv", newline="") as fh:
        assert sum(r["held_out"] == "true" for r in csv.DictReader(fh)) == flagged  # what train@optimized left out
    refused = promote(project)
    assert refused.returncode == 2 and "REFUSED" in refused.stderr
    assert f"{flagged} flagged photo(s) open" in refused.stderr
    assert "--accept-flagged" in refused.stderr and "'red'" in refused.stderr
    assert remote_tags(origin) == before

    # A CI checkout without tags finds prod on the remote.
    ci = tmp_path / "ci"
    sh(["git", "clone", "-q", "--no-tags", str(origin), str(ci)], tmp_path)
    assert champion_in(ci)["version"] == "v0.2.0"
    server = tmp_path / "server"
    server.mkdir()

    # `gto deprecate` unassigns v0.2.0: the champion stage and the serving command both fall back to v0.1.0.
    sh(["gto", "deprecate", ARTIFACT, "v0.2.0", "prod"], project)
    sh(["git", "push", "-q", "origin", "--tags"], project)
    assert champion_in(project)["version"] == "v0.1.0" == served(server, origin)["version"]

    # A rollback pushed from the other clone: prod is v0.2.0 again, for the project and the server alike.
    sh(["gto", "assign", ARTIFACT, "--stage", "prod", "--version", "v0.2.0", "--force", "-m", "back"], ci)
    sh(["git", "push", "-q", "origin", "--tags"], ci)
    champion = champion_in(project)
    assert champion["version"] == "v0.2.0" == served(server, origin)["version"]
    release = json.loads((server / "model" / "release.json").read_text())
    assert release["tag"] == champion["tag"] and release["sha256"] == champion["sha256"]  # the very bytes judged
    photo(server / "new" / "a.png", "purple", 1)
    photo(server / "new" / "b.png", "green", 2)
    sh([sys.executable, "-m", "cnnpipe.predict", "new", "--model", "model/best.pt", "--out", "preds.csv"], server)
    with open(server / "preds.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [Path(r["path"]).name for r in rows] == ["a.png", "b.png"] and all(r["label"] in COLOURS for r in rows)

    # CI's check on a pushed assignment: the blessed week 1 passes; a hand-made assignment of week 2 fails.
    ok = sh([sys.executable, "-m", "cnnpipe.release.verify", f"{ARTIFACT}#prod#2"], project)
    assert "verify: OK" in ok.stdout
    hand = f"{ARTIFACT}#prod#9"  # what `gto assign ... HEAD` writes, past the gate
    sh(["git", "tag", "-a", hand, "-m", "by hand", "HEAD"], project)
    bad = sh([sys.executable, "-m", "cnnpipe.release.verify", hand], project, ok=False)
    assert bad.returncode == 1 and "and no tag records" in bad.stderr, bad.stderr  # refused, or flags left open

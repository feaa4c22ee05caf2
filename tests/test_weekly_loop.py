"""The weekly loop, end to end: three weeks of a growing catalog on a git + DVC project with a bare git
remote and a DVC remote on disk; the gate blesses or refuses, GTO tags say what is in production,
a serving machine fetches it with `dvc artifacts get`, and `gto assign` of an old version rolls back.
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

from conftest import copy_project, save_image, tiny_params, write_params

pytestmark = pytest.mark.slow

ARTIFACT = "fashion-classifier"
COLOURS = {"red": (220, 40, 40), "green": (40, 190, 40), "blue": (40, 40, 220), "yellow": (225, 215, 40),
           "grey": (128, 128, 128), "purple": (150, 40, 170)}
GIT = ["git", "-c", "user.name=Product Owner", "-c", "user.email=po@example.com"]


def sh(cmd: list[str], cwd: Path, ok: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               GIT_AUTHOR_NAME="Product Owner", GIT_AUTHOR_EMAIL="po@example.com",
               GIT_COMMITTER_NAME="Product Owner", GIT_COMMITTER_EMAIL="po@example.com", DVC_NO_ANALYTICS="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    if ok:
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def photo(path: Path, colour: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(COLOURS[colour]) + rng.normal(0, 25, (32, 32, 3)), 0, 255).astype(np.uint8)
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


def week(project: Path, message: str) -> dict:
    """`dvc add` the catalog, `dvc repro` the weekly stages, commit, `dvc push`; the gate's verdict."""
    sh(["dvc", "add", "-q", "data/raw/catalog"], project)
    out = sh(["dvc", "repro", "gate"], project)
    assert "Running stage 'train@baseline'" not in out.stdout  # the weekly loop trains only the optimized recipe
    sh(["git", "add", "-A"], project)
    sh([*GIT, "commit", "-qm", message], project)
    sh(["dvc", "push", "-q"], project)
    return json.loads((project / "metrics" / "gate.json").read_text())


def promote(project: Path) -> subprocess.CompletedProcess:
    return sh([sys.executable, "-m", "cnnpipe.promote"], project, ok=False)


def tags(project: Path) -> set[str]:
    return set(sh(["git", "tag", "-l"], project).stdout.split())


def in_prod(project: Path) -> str:
    return sh(["gto", "show", f"{ARTIFACT}#prod", "--version"], project).stdout.strip()


@pytest.fixture()
def project(tmp_path) -> Path:
    root = copy_project(tmp_path / "project")
    params = tiny_params(epochs=4)
    params["data"].update(source="data/raw/catalog/catalog.csv", stored_size=28, image_size=28)
    params["release"].update(min_support=3, floors={"top1": 0.6})
    params["run"]["budget_minutes"] = 5
    write_params(root / "params.yaml", params)
    sh(["git", "init", "-q", "-b", "main"], root)
    sh(["git", "init", "-q", "--bare", "-b", "main", str(tmp_path / "origin.git")], tmp_path)
    sh(["git", "remote", "add", "origin", str(tmp_path / "origin.git")], root)
    sh(["dvc", "remote", "add", "-q", "-d", "storage", str(tmp_path / "dvc-remote")], root)
    sh(["git", "add", "-A"], root)
    sh([*GIT, "commit", "-qm", "the project"], root)
    return root


def test_three_weeks_bless_promote_refuse_serve_and_roll_back(project, tmp_path):
    # Week 0: the first model, judged on the floors alone, becomes v0.1.0 in prod.
    add_photos(project, [(c, c, "", f"w0-{c}-{i}") for c in ("red", "green", "blue", "yellow", "grey")
                         for i in range(40)])
    gate = week(project, "week 0")
    assert gate["blessed"] and gate["first_model"] and gate["champion"]["version"] is None
    again = sh(["dvc", "repro", "gate"], project).stdout  # nothing moved: the champion reruns, nothing after it
    assert "Running stage 'champion'" in again and "Running stage 'gate'" not in again
    done = promote(project)
    assert done.returncode == 0, done.stderr
    assert {f"{ARTIFACT}@v0.1.0", f"{ARTIFACT}#prod#1"} <= tags(project)
    assert "git push origin" in done.stdout
    message = sh(["git", "tag", "-l", "--format=%(contents)", f"{ARTIFACT}#prod#1"], project).stdout
    assert "gate: blessed" in message and "first model" in message
    sh(["git", "push", "-q", "origin", "main", "--tags"], project)
    assert in_prod(project) == "v0.1.0"

    # Week 1: 10% more photos and a new class; the challenger starts from the champion.
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["variants"]["optimized"]["model"]["init"] = "champion"
    write_params(project / "params.yaml", params)
    add_photos(project, [(c, c, "", f"w1-{c}-{i}") for c in ("red", "green", "blue", "yellow", "grey")
                         for i in range(4)] + [("purple", "purple", "", f"w1-purple-{i}") for i in range(40)])
    gate = week(project, "week 1")
    champion = json.loads((project / "models" / "champion" / "champion.json").read_text())
    assert champion["version"] == "v0.1.0" and champion["tag"] == f"{ARTIFACT}#prod#1"
    train = json.loads((project / "metrics" / "optimized" / "train.json").read_text())
    assert train["init"].startswith("champion:v0.1.0") and "new classes: purple" in train["init"]
    assert gate["blessed"], gate["reasons"]
    assert gate["new_classes"] == ["purple"] and gate["paired"]["challenger_top1"] > gate["paired"]["champion_top1"]
    assert promote(project).returncode == 0
    assert {f"{ARTIFACT}@v0.2.0", f"{ARTIFACT}#prod#2"} <= tags(project)
    sh(["git", "push", "-q", "origin", "main", "--tags"], project)
    assert in_prod(project) == "v0.2.0"

    # Week 2: a supplier's training photos with red and blue swapped, more of them than the real ones.
    add_photos(project, [("red", "blue", "train", f"w2-red-{i}") for i in range(70)]
               + [("blue", "red", "train", f"w2-blue-{i}") for i in range(70)])
    before = tags(project)
    gate = week(project, "week 2")
    assert not gate["blessed"]
    # Which of the two swapped classes the challenger gets wrong on 3 test images each depends on
    # its random crops; that the gate blames them, and only them, does not.
    failing = set(gate["classes_failing"])
    assert failing and failing <= {"red", "blue"}, gate["reasons"]
    assert all(any(f"'{c}' loses" in r for r in gate["reasons"]) for c in failing)
    refused = promote(project)
    blamed = sorted(failing)[0]
    assert refused.returncode == 2 and "REFUSED" in refused.stderr and f"'{blamed}' loses" in refused.stderr
    assert tags(project) == before and in_prod(project) == "v0.2.0"

    # A serving machine: the model in prod from the remotes, and predict with it.
    serving = tmp_path / "serving"
    serving.mkdir()
    sh(["dvc", "artifacts", "get", str(tmp_path / "origin.git"), ARTIFACT, "--stage", "prod", "-o", "model/best.pt"],
       serving)
    photo(serving / "new" / "a.png", "purple", 1)
    photo(serving / "new" / "b.png", "green", 2)
    sh([sys.executable, "-m", "cnnpipe.predict", "new", "--model", "model/best.pt", "--out", "preds.csv"], serving)
    with open(serving / "preds.csv", newline="") as fh:
        labels = {Path(r["path"]).name: r["label"] for r in csv.DictReader(fh)}
    assert labels == {"a.png": "purple", "b.png": "green"}

    # A rollback: prod goes back to v0.1.0, and the champion stage follows it.
    sh(["gto", "assign", ARTIFACT, "--stage", "prod", "--version", "v0.1.0", "--force", "-m", "roll back"], project)
    assert in_prod(project) == "v0.1.0"
    sh(["dvc", "repro", "champion"], project)
    assert json.loads((project / "models" / "champion" / "champion.json").read_text())["version"] == "v0.1.0"

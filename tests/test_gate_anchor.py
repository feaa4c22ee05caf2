"""Where the gate's drift anchor is recorded and found: the verdict committed with a release names it
(`anchor_next`), and the champion stage fetches it at its commit, checked against the recorded sha256."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from cnnpipe.files import file_sha256
from cnnpipe.release import champion as champion_mod
from cnnpipe.release.champion import fetch_anchor, recorded_anchor
from cnnpipe.release.looks import look_at_anchor
from cnnpipe.release.production import ProductionUnknown

ENV = {"GIT_AUTHOR_NAME": "Product Owner", "GIT_AUTHOR_EMAIL": "po@example.com",
       "GIT_COMMITTER_NAME": "Product Owner", "GIT_COMMITTER_EMAIL": "po@example.com"}


def commit(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    for args in (["add", "-A"], ["commit", "-q", "--allow-empty", "-m", message]):
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, env={**os.environ, **ENV})
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True, text=True,
                          env={**os.environ, **ENV}).stdout.strip()


@pytest.fixture()
def repo(tmp_path):
    subprocess.run(["git", "init", "-q", "-b", "main", str(tmp_path / "r")], check=True, env={**os.environ, **ENV})
    return tmp_path / "r"


def test_the_verdict_committed_with_a_release_names_its_anchor(repo):
    before = commit(repo, {"README": "no verdict yet"}, "before anchors")
    shown = commit(repo, {"metrics/gate.json": json.dumps({"blessed": True, "anchor_next": {"self": True}})}, "w1")
    assert recorded_anchor(repo, before) is None
    assert recorded_anchor(repo, shown) == {"self": True}
    broken = commit(repo, {"metrics/gate.json": "{not json"}, "w2")
    with pytest.raises(ProductionUnknown, match="metrics/gate.json at commit .* is not a gate verdict"):
        recorded_anchor(repo, broken)


def test_the_champion_stage_fetches_another_anchor_and_checks_its_bytes(repo, tmp_path, monkeypatch):
    """A champion blessed within the drift budget but not shown within the margin carries the anchor
    before it: fetched at the anchor's commit into anchor/best.pt; bytes other than those recorded are
    refused. A champion that is its own anchor leaves no anchor/ folder behind."""
    model = tmp_path / "anchor-model.pt"
    model.write_bytes(b"the anchor's weights")
    record = {"commit": "d" * 40, "version": "v0.1.0", "path": "models/optimized/best.pt",
              "sha256": file_sha256(model)}
    carried = commit(repo, {"metrics/gate.json": json.dumps({"anchor_next": record})}, "week 2")
    fetched = []

    def download(where, path, at, out, expected=None):
        fetched.append((path, at))
        out.parent.mkdir(parents=True, exist_ok=True)
        if expected is None or file_sha256(model) == expected:  # champion.download's rule: never other bytes
            out.write_bytes(model.read_bytes())
        return file_sha256(model)

    monkeypatch.setattr(champion_mod, "download", download)
    out = tmp_path / "champion"
    found = {"commit": carried, "version": "v0.2.0"}
    about = fetch_anchor(repo, found, "models/optimized/best.pt", "e" * 64, out)
    assert fetched == [(record["path"], record["commit"])] and (out / "anchor" / "best.pt").exists()
    assert {k: about[k] for k in record} == record and not about["same_as_champion"]
    model.write_bytes(b"other weights")
    with pytest.raises(ProductionUnknown, match="has other bytes"):
        fetch_anchor(repo, found, "models/optimized/best.pt", "e" * 64, out)
    assert (out / "anchor" / "best.pt").read_bytes() != b"other weights"  # the refused bytes never landed
    itself = commit(repo, {"metrics/gate.json": json.dumps({"anchor_next": {"self": True}})}, "week 3")
    about = fetch_anchor(repo, {"commit": itself, "version": "v0.3.0"}, "models/optimized/best.pt", "f" * 64, out)
    assert about["same_as_champion"] and about["commit"] == itself and not (out / "anchor").exists()


def verdict_at(anchor: str, challenger: str, champion: str | None = None) -> str:
    """A committed verdict's fields that say which look it was: its anchor and its challenger."""
    about = {"sha256": champion or anchor, "anchor": {"sha256": anchor, "same_as_champion": champion is None}}
    return json.dumps({"blessed": False, "drift": {}, "champion": about, "challenger": {"sha256": challenger}})


def test_looks_at_an_anchor_count_every_challenger_judged_against_it_and_restart_with_a_new_anchor(repo, tmp_path):
    """Every committed verdict against the anchor is a look, retries in the same week and experiments on
    other refs included; the same challenger judged again is the same look; another anchor's verdicts
    do not count, and a new anchor starts at look 1."""
    gate = repo / "metrics" / "gate.json"
    assert look_at_anchor(gate, "A", "x")["look"] == 1  # no commit holds a verdict yet
    commit(repo, {"metrics/gate.json": verdict_at("A", "x")}, "week 1")
    commit(repo, {"metrics/gate.json": verdict_at("A", "y")}, "week 1, retried")
    subprocess.run(["git", "-C", str(repo), "checkout", "-q", "-b", "exp"], check=True)
    commit(repo, {"metrics/gate.json": verdict_at("A", "z", champion="C")}, "an experiment, champion C, anchor A")
    subprocess.run(["git", "-C", str(repo), "checkout", "-q", "main"], check=True)
    commit(repo, {"metrics/gate.json": verdict_at("A", "x")}, "week 1's challenger judged again")
    assert look_at_anchor(gate, "A", "w") == {"look": 4, "earlier_challengers": ["x", "y", "z"],
                                              "counted_from": "4 commit(s) on any ref holding metrics/gate.json"}
    assert look_at_anchor(gate, "A", "y")["look"] == 3  # itself once
    commit(repo, {"metrics/gate.json": verdict_at("B", "v")}, "week 2: the anchor moved to B")
    assert look_at_anchor(gate, "B", "u")["look"] == 2 and look_at_anchor(gate, "A", "w")["look"] == 4
    assert look_at_anchor(gate, "D", "u")["look"] == 1
    outside = look_at_anchor(tmp_path / "elsewhere" / "metrics" / "gate.json", "A", "w")
    assert outside["look"] == 1 and "in no git repository" in outside["counted_from"]

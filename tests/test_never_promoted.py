"""The demo needs no git remote: a project that never promoted anything (no `registry.json` record in
the commit, no tags here) runs the champion stage with `origin` unreachable; a recorded promotion, or
the artifact's tags in the clone, still require it (fail-closed), and promote commits the record."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cnnpipe.release import promote as promote_mod
from cnnpipe.release.champion import fetch_champion
from cnnpipe.release.production import REGISTRY_RECORD, ProductionUnknown, lookup, record_promotion
from cnnpipe.release_config import ReleaseConfig
from conftest import copy_project, tiny_params, write_params

ENV = {"GIT_AUTHOR_NAME": "Product Owner", "GIT_AUTHOR_EMAIL": "po@example.com",
       "GIT_COMMITTER_NAME": "Product Owner", "GIT_COMMITTER_EMAIL": "po@example.com"}
UNREACHABLE = ["/nonexistent/path/origin.git", "http://127.0.0.1:9/catalog.git"]  # no repo; a closed port
CFG = ReleaseConfig(artifact="m")


def sh(cwd: Path, *cmd: str, ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, **ENV, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    assert not ok or proc.returncode == 0, f"{' '.join(cmd)}: {proc.stdout}\n{proc.stderr}"
    return proc


def _repo(tmp_path: Path, origin: str) -> Path:
    repo = tmp_path / "clone"
    repo.mkdir(parents=True)
    sh(repo, "git", "init", "-q", "-b", "main")
    sh(repo, "git", "commit", "-q", "--allow-empty", "-m", "the project")
    sh(repo, "git", "remote", "add", "origin", origin)
    return repo


@pytest.mark.parametrize("origin", UNREACHABLE)
def test_a_project_never_promoted_needs_no_reachable_origin(tmp_path, origin):
    repo = _repo(tmp_path, origin)
    found, told = lookup(repo, "m", "prod", "origin")
    assert found is None and "never promoted" in told and "'origin'" in told
    about = fetch_champion(repo, CFG, tmp_path / "champion")
    assert about["version"] is None and "never promoted" in about["told"]
    written = json.loads((tmp_path / "champion" / "champion.json").read_text())
    reachable = _repo(tmp_path / "online", str(tmp_path / "nothing-promoted.git"))
    subprocess.run(["git", "init", "-q", "--bare", str(tmp_path / "nothing-promoted.git")], check=True)
    assert fetch_champion(reachable, CFG, tmp_path / "online-champion")["told"] == ""
    # Offline or online, the same champion.json: nothing downstream reruns when the network comes and goes.
    assert json.loads((tmp_path / "online-champion" / "champion.json").read_text()) == written


def test_a_recorded_promotion_or_local_tags_still_require_origin(tmp_path):
    repo = _repo(tmp_path, UNREACHABLE[0])
    record_promotion(repo, "m", "origin")  # in the working tree only: still a record
    with pytest.raises(ProductionUnknown, match="cannot read the tags of git remote 'origin'"):
        lookup(repo, "m", "prod", "origin")
    sh(repo, "git", "add", REGISTRY_RECORD)
    sh(repo, "git", "commit", "-q", "-m", "the first promotion's record")
    (repo / REGISTRY_RECORD).unlink()  # deleted here, still in the commit
    with pytest.raises(ProductionUnknown, match="cannot read the tags"):
        lookup(repo, "m", "prod", "origin")
    assert lookup(repo, "other-model", "prod", "origin")[0] is None  # the record names the artifact
    sh(repo, "git", "checkout", "-q", "--", REGISTRY_RECORD)
    (repo / REGISTRY_RECORD).write_text("{not json")
    with pytest.raises(ProductionUnknown, match="not a registry record"):
        lookup(repo, "m", "prod", "origin")

    tagged = _repo(tmp_path / "b", UNREACHABLE[1])  # no record, but this clone has the artifact's tags
    sh(tagged, "git", "tag", "-a", "m@v0.1.0", "-m", "registered")
    with pytest.raises(ProductionUnknown, match="cannot read the tags"):
        lookup(tagged, "m", "prod", "origin")


def test_promote_commits_the_record_into_the_version_it_registers(tmp_path, monkeypatch):
    """The record's commit goes to the remote's main branch, whatever the local branch is called."""
    origin, repo = tmp_path / "origin.git", tmp_path / "a"
    sh(tmp_path, "git", "init", "-q", "--bare", "-b", "main", str(origin))
    sh(tmp_path, "git", "clone", "-q", str(origin), str(repo))
    sh(repo, "git", "checkout", "-q", "-b", "weekly")
    sh(repo, "git", "commit", "-q", "--allow-empty", "-m", "week 0")
    sh(repo, "git", "push", "-q", "origin", "weekly:main")
    monkeypatch.setattr(promote_mod, "check_ready", lambda *args: "main")  # the remote's main, checked
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    blessed = {"blessed": True, "reasons": ["fine"], "warnings": [], "champion": None,
               "delivery": {"checked": False, "reason": "no champion yet", "open_flags": 0}}
    version, tags, new = promote_mod.promote(repo, CFG, blessed)
    assert (version, new) == ("v0.1.0", True)
    recorded = json.loads(sh(repo, "git", "show", f"m@v0.1.0:{REGISTRY_RECORD}").stdout)
    assert "m" in recorded["artifacts"]
    assert sh(origin, "git", "rev-parse", "main").stdout == sh(repo, "git", "rev-parse", "HEAD").stdout  # pushed
    assert promote_mod.promote(repo, CFG, blessed)[2] is False  # nothing to do, no second record commit
    ci = tmp_path / "ci"
    sh(tmp_path, "git", "clone", "-q", "--no-tags", str(origin), str(ci))
    assert lookup(ci, "m", "prod", "origin")[0]["version"] == "v0.1.0"
    sh(ci, "git", "remote", "set-url", "origin", UNREACHABLE[0])
    with pytest.raises(ProductionUnknown, match="cannot read the tags"):  # a tagless clone of a promoted project
        lookup(ci, "m", "prod", "origin")


def test_dvc_repro_gets_past_the_champion_stage_with_origin_unreachable_until_a_promotion_is_recorded(tmp_path):
    root = copy_project(tmp_path / "project")
    write_params(root / "params.yaml", tiny_params())
    sh(root, "git", "init", "-q", "-b", "main")
    sh(root, "git", "remote", "add", "origin", UNREACHABLE[1])
    sh(root, "git", "add", "-A")
    sh(root, "git", "commit", "-qm", "the project, cloned from an archive")
    ran = sh(root, "dvc", "repro", "champion")
    assert "never promoted" in ran.stdout
    assert json.loads((root / "models" / "champion" / "champion.json").read_text())["version"] is None
    artifact = tiny_params()["release"]["artifact"]
    record_promotion(root, artifact, "origin")
    sh(root, "git", "add", REGISTRY_RECORD)
    sh(root, "git", "commit", "-qm", "a promotion recorded")
    refused = sh(root, "dvc", "repro", "champion", ok=False)
    assert refused.returncode != 0 and "cannot read the tags of git remote 'origin'" in refused.stderr + refused.stdout


def test_promote_takes_the_record_back_when_the_remotes_main_moved_on(tmp_path, monkeypatch):
    """Another clone pushed to main after this one's gate: the record cannot be pushed, so it is not
    left behind as a local commit that a rerun would refuse as "not on main"."""
    origin, repo, other = tmp_path / "origin.git", tmp_path / "a", tmp_path / "b"
    sh(tmp_path, "git", "init", "-q", "--bare", "-b", "main", str(origin))
    sh(tmp_path, "git", "clone", "-q", str(origin), str(repo))
    sh(repo, "git", "commit", "-q", "--allow-empty", "-m", "week 0")
    sh(repo, "git", "push", "-q", "origin", "main")
    sh(tmp_path, "git", "clone", "-q", str(origin), str(other))
    sh(other, "git", "commit", "-q", "--allow-empty", "-m", "someone else's week")
    sh(other, "git", "push", "-q", "origin", "main")
    monkeypatch.setattr(promote_mod, "check_ready", lambda *args: "main")
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    before = sh(repo, "git", "rev-parse", "HEAD").stdout
    blessed = {"blessed": True, "reasons": ["fine"], "warnings": [], "champion": None,
               "delivery": {"checked": False, "reason": "no champion yet", "open_flags": 0}}
    with pytest.raises(promote_mod.Refused, match=f"could not push the commit recording {REGISTRY_RECORD}"):
        promote_mod.promote(repo, CFG, blessed)
    assert sh(repo, "git", "rev-parse", "HEAD").stdout == before and not (repo / REGISTRY_RECORD).exists()
    assert sh(repo, "git", "tag", "-l").stdout == ""

"""Serve what was judged: `release.fetch` and the champion stage check the served bytes against the
promoted commit's dvc.lock, `release.verify` checks the DVC remote holds the model, promote refuses a
tree git does not hold and a commit off the remote's main. A real (tiny) DVC project: a
`train@optimized` stage that writes the model folder, a gate stage that blesses it, a bare git
remote and a DVC remote on disk, GTO tags written as GTO writes them."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cnnpipe.release import promote as promote_mod
from cnnpipe.release.champion import fetch_champion
from cnnpipe.release.fetch import Mismatch, fetch_production
from cnnpipe.release.remote import ModelUnchecked, recorded_md5
from cnnpipe.release_config import ReleaseConfig
from cnnpipe.files import file_md5
from conftest import ROOT

ENV = {"GIT_AUTHOR_NAME": "Product Owner", "GIT_AUTHOR_EMAIL": "po@example.com",
       "GIT_COMMITTER_NAME": "Product Owner", "GIT_COMMITTER_EMAIL": "po@example.com", "DVC_NO_ANALYTICS": "1"}
DVC_YAML = """stages:
  train:
    foreach: [optimized]
    do:
      cmd: python train.py models/${item}
      deps:
        - train.py
      outs:
        - models/${item}
  gate:
    cmd: python gate.py
    deps:
      - gate.py
      - models/optimized
    outs:
      - metrics/gate.json:
          cache: false
artifacts:
  m:
    path: models/optimized/best.pt
    type: model
"""


def sh(cwd: Path, *cmd: str, ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, **ENV, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0 or not ok, f"{' '.join(cmd)}: {proc.stdout}{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def promoted(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(project, git origin, DVC remote): the model built, committed, pushed to both remotes, and
    assigned to prod (m@v0.1.0, m#prod#1) on the origin."""
    root = tmp_path_factory.mktemp("served")
    project, origin, storage = root / "project", root / "origin.git", root / "dvc-remote"
    sh(root, "git", "init", "-q", "--bare", "-b", "main", str(origin))
    sh(root, "git", "clone", "-q", str(origin), str(project))
    sh(project, "dvc", "init", "-q")
    sh(project, "dvc", "remote", "add", "-q", "-d", "storage", str(storage))
    (project / "metrics").mkdir()
    (project / "dvc.yaml").write_text(DVC_YAML)
    (project / "train.py").write_text("import pathlib, sys\nout = pathlib.Path(sys.argv[1])\nout.mkdir(parents=True)\n"
                                      "(out / 'best.pt').write_bytes(b'judged weights')\n"
                                      "(out / 'last.pt').write_bytes(b'last epoch')\n")
    (project / "gate.py").write_text("import json\njson.dump({'blessed': True, 'reasons': ['fine'], 'warnings': [], "
                                     "'delivery': {'checked': False, 'open_flags': 0}}, "
                                     "open('metrics/gate.json', 'w'))\n")
    sh(project, "dvc", "repro", "-q")
    sh(project, "git", "add", "-A")
    sh(project, "git", "commit", "-qm", "week 0")
    sh(project, "dvc", "push", "-q")
    sh(project, "git", "push", "-q", "origin", "main")
    for name in ("m@v0.1.0", "m#prod#1"):
        sh(project, "git", "tag", "-a", name, "-m", name, "HEAD")
    sh(project, "git", "push", "-q", "origin", "--tags")
    return project, origin, storage


def remote_object(storage: Path, project: Path) -> Path:
    """The DVC remote's file holding best.pt's bytes."""
    md5 = file_md5(project / "models" / "optimized" / "best.pt")
    return storage / "files" / "md5" / md5[:2] / md5[2:]


def test_fetch_serves_the_judged_bytes_and_refuses_others(promoted, tmp_path):
    project, origin, storage = promoted
    out = tmp_path / "server" / "model" / "best.pt"
    about = fetch_production(str(origin), "m", "prod", out)
    assert out.read_bytes() == b"judged weights" and about["md5"] == file_md5(project / "models/optimized/best.pt")
    stored = remote_object(storage, project)
    judged = stored.read_bytes()
    try:
        stored.chmod(0o644)
        stored.write_bytes(b"other weights")  # the remote's copy is not what was judged
        with pytest.raises(Mismatch, match=rf"have md5 {file_md5(stored)}, but that commit's dvc.lock records md5 "
                                           rf"{about['md5']}.*run `dvc push` where the model was promoted"):
            fetch_production(str(origin), "m", "prod", out)
        assert out.read_bytes() == b"judged weights" and sorted(p.name for p in out.parent.iterdir()) == \
            ["best.pt", "release.json"]  # the served file untouched, nothing half-written beside it
        cli = sh(tmp_path, sys.executable, "-m", "cnnpipe.release.fetch", str(origin), "-o", str(out),
                 "--artifact", "m", ok=False)
        assert cli.returncode == 2 and "fetch: REFUSED: the bytes served for models/optimized/best.pt" in cli.stderr
    finally:
        stored.write_bytes(judged)


def test_the_champion_stage_refuses_a_cached_champion_that_is_not_what_was_judged(promoted, tmp_path):
    """DVC does not re-hash what it reads: a champion whose object in the local DVC cache holds other
    bytes is refused by the stage (exit 2, both md5s named), and the champion already there stays."""
    project, _, _ = promoted
    out = tmp_path / "champion"
    about = fetch_champion(project, ReleaseConfig(artifact="m"), out)
    judged_md5 = file_md5(project / "models" / "optimized" / "best.pt")
    assert about["version"] == "v0.1.0" and (out / "best.pt").read_bytes() == b"judged weights"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    cached = project / ".dvc" / "cache" / "files" / "md5" / judged_md5[:2] / judged_md5[2:]
    judged = cached.read_bytes()
    params = tmp_path / "params.yaml"
    params.write_text("release:\n  artifact: m\n")
    try:
        cached.chmod(0o644)
        cached.write_bytes(b"tampered weights")  # the cache's copy is not what was judged
        stage = sh(project, sys.executable, str(ROOT / "stages" / "champion.py"), "--params", str(params),
                   "--out", str(out), ok=False)
    finally:
        cached.write_bytes(judged)
    assert stage.returncode == 2, stage.stderr
    assert (f"champion: REFUSED: the bytes served for models/optimized/best.pt at commit {about['commit'][:12]} have "
            f"md5 {hashlib.md5(b'tampered weights').hexdigest()}, but that commit's dvc.lock records md5 {judged_md5}"
            ) in stage.stderr, stage.stderr
    assert str(cached) in stage.stderr and "`dvc fetch --all-tags`" in stage.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # best.pt, champion.json: as they were
    with pytest.raises(ModelUnchecked, match="records no output holding models/optimized/best.pt"):
        recorded_md5("stages: {}\n", "models/optimized/best.pt", [])  # unrecorded: refused, not skipped


def test_verify_refuses_when_the_dvc_remote_lacks_the_model(promoted):
    project, _, storage = promoted
    ok = sh(project, sys.executable, "-m", "cnnpipe.release.verify", "m#prod#1", "--artifact", "m")
    assert "verify: the DVC remote holds the model" in ok.stdout and "verify: OK" in ok.stdout
    stored = remote_object(storage, project)
    moved = stored.with_name(stored.name + ".away")
    stored.rename(moved)
    try:
        bad = sh(project, sys.executable, "-m", "cnnpipe.release.verify", "m#prod#1", "--artifact", "m", ok=False)
    finally:
        moved.rename(stored)
    assert bad.returncode == 1 and "the gate blessed it" in bad.stderr
    assert ("does not hold the model at" in bad.stderr and "missing models/optimized/best.pt" in bad.stderr
            and "run `dvc push` where it was promoted" in bad.stderr and "NOT VERIFIED" in bad.stderr), bad.stderr


def test_promote_refuses_an_untracked_file_and_a_commit_off_the_remotes_main(promoted, tmp_path):
    project, origin, _ = promoted
    clone = tmp_path / "clone"
    sh(tmp_path, "git", "clone", "-q", str(origin), str(clone))
    gate = clone / "metrics" / "gate.json"

    def refusal() -> str:
        with pytest.raises(promote_mod.Refused) as caught:
            promote_mod.check_ready(clone, "train@optimized", gate, "origin")
        return str(caught.value)

    (clone / "notes.txt").write_text("a file git does not hold")
    said = refusal()
    assert "untracked files" in said and "notes.txt" in said and "uncommitted changes" not in said
    (clone / "notes.txt").unlink()
    (clone / "dvc.yaml").write_text((clone / "dvc.yaml").read_text() + "\n")
    assert "uncommitted changes" in refusal()
    sh(clone, "git", "checkout", "-q", "dvc.yaml")
    sh(clone, "git", "checkout", "-q", "-b", "side")
    sh(clone, "git", "commit", "-q", "--allow-empty", "-m", "on a side branch")
    sh(clone, "git", "push", "-q", "origin", "side")  # on a branch of the remote, but not on its main
    said = refusal()
    assert "not on 'origin''s main" in said and "git push origin HEAD:main" in said
    sh(clone, "git", "checkout", "-q", "main")
    assert "not on 'origin''s main" not in refusal()  # on main: the checks go on (here to DVC's)


def refused_week(clone: Path, weights: bytes, champion_commit: str) -> dict:
    """A week whose gate refuses a new model (`weights`) judged against the champion at `champion_commit`:
    built, committed, pushed to both remotes; returns the verdict."""
    (clone / "train.py").write_text("import pathlib, sys\nout = pathlib.Path(sys.argv[1])\nout.mkdir(parents=True)\n"
                                    f"(out / 'best.pt').write_bytes({weights!r})\n")
    verdict = {"blessed": False, "reasons": ["top-1 not shown within the margin"], "warnings": [],
               "champion": {"commit": champion_commit, "version": "v0.1.0"},
               "delivery": {"checked": False, "open_flags": 0}}
    (clone / "gate.py").write_text(f"import json\njson.dump({verdict!r}, open('metrics/gate.json', 'w'))\n")
    sh(clone, "dvc", "repro", "-q")
    sh(clone, "git", "add", "-A")
    sh(clone, "git", "commit", "-qm", f"a week refused: {weights!r}")
    sh(clone, "dvc", "push", "-q")
    sh(clone, "git", "push", "-q", "origin", "main")
    return verdict


def test_an_override_made_by_promote_verifies_and_a_hand_written_one_is_refused(promoted, tmp_path, monkeypatch):
    """`promote --override` records who, why and the md5s of the refused verdict and its model; verify
    accepts that. A hand-written "OVERRIDE by" tag, and promote's own record copied onto a commit whose
    model is another, are refused, each saying why; every other check passes on that commit."""
    from cnnpipe.release.verify import verify

    project, origin, _ = promoted
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    own_origin, clone = tmp_path / "origin.git", tmp_path / "clone"
    sh(tmp_path, "git", "clone", "-q", "--bare", str(origin), str(own_origin))  # the module's origin stays as it is
    sh(tmp_path, "git", "clone", "-q", str(own_origin), str(clone))
    sh(clone, "git", "config", "user.name", "Product Owner")
    sh(clone, "git", "config", "user.email", "po@example.com")
    champion = sh(clone, "git", "rev-parse", "m#prod#1^{commit}").stdout.strip()
    verdict = refused_week(clone, b"overridden weights", champion)
    with pytest.raises(promote_mod.Refused, match="the gate did not bless this model"):
        promote_mod.promote(clone, ReleaseConfig(artifact="m"), verdict)
    version, tags, _ = promote_mod.promote(clone, ReleaseConfig(artifact="m"), verdict, override="the test set is wrong")
    assert version == "v0.2.0" and "m#prod#2" in tags
    ok, findings = verify(clone, "m#prod#2", "m")
    assert ok, findings
    assert any("m#prod#2 records the override by Product Owner: the test set is wrong" in f for f in findings), findings

    message = sh(clone, "git", "tag", "-l", "--format=%(contents)", "m#prod#2").stdout.strip()
    refused_week(clone, b"other weights", champion)
    for name, text in (("hand-written", "OVERRIDE by Mallory: trust me"), ("copied", message)):
        sh(clone, "git", "tag", "-a", "m#prod#3", "-m", text, "HEAD")
        try:
            ok, findings = verify(clone, "m#prod#3", "m")
        finally:
            sh(clone, "git", "tag", "-d", "m#prod#3")
        assert not ok, (name, findings)
        assert "the DVC remote holds the model" in findings and any("REFUSED it and no tag records an override made "
                                                                     "for it" in f for f in findings), findings
        said = ("m#prod#3 says OVERRIDE but carries no override record" if name == "hand-written"
                else "m#prod#3's override was made for another verdict or model (model_md5")
        assert any(said in f for f in findings), findings

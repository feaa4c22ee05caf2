"""What is in production, fail-closed and fresh, and promote's publishing: real git repositories and
GTO's tag grammar (tags are written with `git tag -a` at set times, so that order and ties are
built, not left to the clock)."""

import os
import subprocess
from pathlib import Path

import gto.api
import pytest

from cnnpipe.release_config import ReleaseConfig
from cnnpipe.release import promote as promote_mod
from cnnpipe.release.promote import open_flags
from cnnpipe.release.production import REGISTRY_RECORD, ProductionUnknown, artifact_events, in_stage, \
    record_promotion, resolve

ENV = {"GIT_AUTHOR_NAME": "Product Owner", "GIT_AUTHOR_EMAIL": "po@example.com",
       "GIT_COMMITTER_NAME": "Product Owner", "GIT_COMMITTER_EMAIL": "po@example.com"}


def git(repo: Path, *args: str, when: int | None = None) -> str:
    env = {**os.environ, **ENV, **({"GIT_COMMITTER_DATE": f"@{when} +0000"} if when else {})}
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, f"git {' '.join(args)}: {proc.stderr}"
    return proc.stdout.strip()


def tag(repo: Path, name: str, commit: str, when: int) -> None:
    """A GTO tag as GTO writes it (annotated), at unix time `when`."""
    git(repo, "tag", "-a", name, "-m", f"{name} at {when}", commit, when=when)


@pytest.fixture()
def registry(tmp_path):
    """A bare origin and a clone with three commits pushed: (clone, origin, [c1, c2, c3])."""
    origin, clone = tmp_path / "origin.git", tmp_path / "a"
    git(tmp_path, "init", "-q", "--bare", "-b", "main", str(origin))
    git(tmp_path, "clone", "-q", str(origin), str(clone))
    commits = []
    for i in range(3):
        git(clone, "commit", "-q", "--allow-empty", "-m", f"week {i}")
        commits.append(git(clone, "rev-parse", "HEAD"))
    git(clone, "push", "-q", "origin", "main")
    return clone, origin, commits


def gto_prod(repo: Path) -> str | None:
    shown = gto.api.show(str(repo), "m#prod")
    return shown[0]["version"] if shown else None


def ours(repo: Path) -> str | None:
    found = in_stage(artifact_events(repo, "m"), "m", "prod")
    return found and found["version"]


def test_production_follows_gto_through_rollbacks_deregistrations_and_unassignments(registry):
    clone, _, (c1, c2, c3) = registry
    steps = [("m@v0.1.0", c1, None), ("m#prod#1", c1, "v0.1.0"), ("m@v0.2.0", c2, "v0.1.0"),
             ("m#prod#2", c2, "v0.2.0"), ("m#prod#3", c1, "v0.1.0"),  # a rollback
             ("m#prod#4", c2, "v0.2.0"), ("m@v0.2.0!#5", c2, "v0.1.0"),  # `gto deprecate m v0.2.0`: deregistered
             ("m@v0.3.0", c3, "v0.1.0"), ("m#prod#6", c3, "v0.3.0"),
             ("m#prod!#7", c3, "v0.1.0")]  # `gto deprecate m v0.3.0 prod`: unassigned, prod falls back
    for second, (name, commit, expected) in enumerate(steps):
        tag(clone, name, commit, 1_800_000_000 + second)
        assert ours(clone) == gto_prod(clone) == expected, name
    found = in_stage(artifact_events(clone, "m"), "m", "prod")
    assert found["tag"] == "m#prod#3" and found["commit"] == c1
    tag(clone, "m@deprecated#8", c3, 1_800_000_100)  # `gto deprecate m`: nothing is in any stage
    assert gto_prod(clone) is None
    with pytest.raises(ProductionUnknown, match="deprecated"):
        ours(clone)


def test_two_assignments_in_the_same_second_are_ordered_by_gtos_counter(registry):
    """A promote and a rollback within one second: the tag times tie, GTO's counter (#9 before #10,
    as numbers, not as text) says which came last."""
    clone, _, (c1, c2, _) = registry
    tag(clone, "m@v0.1.0", c1, 1_800_000_000)
    tag(clone, "m@v0.2.0", c2, 1_800_000_000)
    tag(clone, "m#prod#9", c2, 1_800_000_001)
    tag(clone, "m#prod#10", c1, 1_800_000_001)
    assert ours(clone) == "v0.1.0"
    git(clone, "tag", "-d", "m#prod#10")
    tag(clone, "m#prod#10", c2, 1_800_000_001)
    tag(clone, "m#prod#8", c1, 1_800_000_001)
    assert ours(clone) == "v0.2.0"


def test_a_tagless_clone_fetches_prod_and_one_that_cannot_reach_the_remote_refuses(registry, tmp_path):
    clone, origin, (c1, _, _) = registry
    tag(clone, "m@v0.1.0", c1, 1_800_000_000)
    tag(clone, "m#prod#1", c1, 1_800_000_001)
    record_promotion(clone, "m", "origin")  # as promote commits it: this project has a registry
    git(clone, "add", REGISTRY_RECORD)
    git(clone, "commit", "-q", "-m", "the registry record")
    git(clone, "push", "-q", "origin", "main", "--tags")
    tagless = tmp_path / "ci"
    git(tmp_path, "clone", "-q", "--no-tags", str(origin), str(tagless))
    assert git(tagless, "tag", "-l") == "" and ours(tagless) is None  # what the old lookup saw: "no champion"
    found = resolve(tagless, "m", "prod", "origin")
    assert found["version"] == "v0.1.0" and found["remote"] == "origin"
    git(tagless, "tag", "-d", "m#prod#1", "m@v0.1.0")
    git(tagless, "remote", "set-url", "origin", str(tmp_path / "moved.git"))
    with pytest.raises(ProductionUnknown, match="cannot read the tags of git remote 'origin'"):
        resolve(tagless, "m", "prod", "origin")
    assert resolve(tagless, "m", "prod", None) is None  # release.remote: null: this clone's tags, on purpose


def test_a_rollback_pushed_from_another_clone_is_seen_and_disagreements_are_refused(registry, tmp_path):
    clone, origin, (c1, c2, _) = registry
    for i, (name, commit) in enumerate([("m@v0.1.0", c1), ("m#prod#1", c1), ("m@v0.2.0", c2), ("m#prod#2", c2)]):
        tag(clone, name, commit, 1_800_000_000 + i)
    git(clone, "push", "-q", "origin", "--tags")
    other = tmp_path / "b"
    git(tmp_path, "clone", "-q", str(origin), str(other))
    tag(other, "m#prod#3", c1, 1_800_000_010)  # `gto assign m --stage prod --version v0.1.0 --force`
    git(other, "push", "-q", "origin", "m#prod#3")
    assert ours(clone) == "v0.2.0"  # stale
    assert resolve(clone, "m", "prod", "origin")["version"] == "v0.1.0"
    tag(clone, "m#prod#4", c2, 1_800_000_020)  # made here, never pushed
    with pytest.raises(ProductionUnknown, match=r"tags that 'origin' does not: m#prod#4.*git push origin m#prod#4"):
        resolve(clone, "m", "prod", "origin")
    tag(other, "m#prod#4", c1, 1_800_000_030)  # and another clone pushed a different #4
    git(other, "push", "-q", "origin", "m#prod#4")
    with pytest.raises(ProductionUnknown, match=r"tags differ .*m#prod#4.*git tag -d m#prod#4"):
        resolve(clone, "m", "prod", "origin")


@pytest.fixture()
def promotable(registry, monkeypatch):
    """The registry with promote's readiness checks (dvc status, the DVC remote) taken as passed: the
    weekly loop's end-to-end test runs them for real."""
    monkeypatch.setattr(promote_mod, "check_ready", lambda *args: None)
    monkeypatch.setattr(promote_mod, "_run", lambda args, repo: subprocess.CompletedProcess(args, 0, "Product Owner", ""))
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    return registry


BLESSED = {"blessed": True, "reasons": ["fine"], "warnings": [], "champion": None,
           "delivery": {"checked": False, "reason": "no champion yet", "open_flags": 0}}
CFG = ReleaseConfig(artifact="m")


def remote_tags(origin: Path) -> set[str]:
    return set(git(origin, "tag", "-l").split())


def test_promote_publishes_its_tags_and_a_second_run_has_nothing_to_do(promotable):
    clone, origin, _ = promotable
    version, tags, new = promote_mod.promote(clone, CFG, BLESSED)
    assert (version, new) == ("v0.1.0", True) and set(tags) == {"m@v0.1.0", "m#prod#1"} == remote_tags(origin)
    assert promote_mod.promote(clone, CFG, BLESSED)[2] is False  # already in prod, published
    with pytest.raises(promote_mod.Refused, match="judged against no champion, but 'prod' now holds v0.1.0"):
        git(clone, "commit", "-q", "--allow-empty", "-m", "week 3")
        promote_mod.promote(clone, CFG, BLESSED)


def test_promote_finishes_a_run_stopped_half_way_and_reuses_heads_version(promotable):
    clone, origin, (_, _, c3) = promotable
    promote_mod.promote(clone, CFG, BLESSED)  # v0.1.0 at the commit after c3 that records the registry
    champion = {"version": "v0.1.0", "commit": git(clone, "rev-parse", "HEAD")}
    assert git(clone, "rev-parse", "HEAD~1") == c3
    git(clone, "commit", "-q", "--allow-empty", "-m", "week 3")
    git(clone, "push", "-q", "origin", "main")
    gto.api.register(str(clone), "m", "HEAD", bump_minor=True)  # registered, then the run died
    version, tags, _ = promote_mod.promote(clone, CFG, {**BLESSED, "champion": champion})
    assert version == "v0.2.0" and {"m@v0.2.0", "m#prod#2"} <= remote_tags(origin)  # no v0.3.0
    champion = {"version": "v0.2.0", "commit": git(clone, "rev-parse", "HEAD")}
    git(clone, "commit", "-q", "--allow-empty", "-m", "week 4")
    git(clone, "push", "-q", "origin", "main")
    gto.api.register(str(clone), "m", "HEAD", bump_minor=True)
    gto.api.assign(str(clone), "m", "prod", version="v0.3.0")  # tagged, then the push failed
    version, tags, _ = promote_mod.promote(clone, CFG, {**BLESSED, "champion": champion})
    assert version == "v0.3.0" and {"m@v0.3.0", "m#prod#3"} <= remote_tags(origin)
    assert resolve(clone, "m", "prod", "origin")["version"] == "v0.3.0"


def test_promote_refuses_what_it_cannot_publish(promotable, tmp_path):
    clone, origin, (c1, _, _) = promotable
    refused = {"blessed": False, "reasons": ["class 'red' loses 90.0% of recall"], "champion": None}
    with pytest.raises(promote_mod.Refused, match="did not bless this model:\n  - class 'red' loses"):
        promote_mod.promote(clone, CFG, refused)
    tag(clone, "m#prod#7", c1, 1_800_000_000)  # somebody's unpublished tag, not this commit's
    with pytest.raises(promote_mod.Refused, match="does not: m#prod#7"):
        promote_mod.promote(clone, CFG, BLESSED)
    git(clone, "tag", "-d", "m#prod#7")
    git(clone, "remote", "remove", "origin")
    with pytest.raises(promote_mod.Refused, match="no git remote 'origin' to publish"):
        promote_mod.promote(clone, CFG, BLESSED)
    version, _, _ = promote_mod.promote(clone, ReleaseConfig(artifact="m", remote=None), BLESSED)
    assert version == "v0.1.0" and remote_tags(origin) == set()  # release.remote: null: local on purpose


def test_a_push_that_loses_a_race_deletes_its_copies(registry, tmp_path):
    clone, origin, (c1, c2, _) = registry
    other = tmp_path / "b"
    git(tmp_path, "clone", "-q", str(origin), str(other))
    tag(other, "m#prod#1", c2, 1_800_000_000)
    git(other, "push", "-q", "origin", "m#prod#1")
    tag(clone, "m#prod#1", c1, 1_800_000_001)
    with pytest.raises(promote_mod.Refused, match="already has m#prod#1 from another promote"):
        promote_mod.publish(clone, "origin", ["m#prod#1"])
    assert git(clone, "tag", "-l") == ""


def test_a_verdict_without_a_delivery_check_or_with_one_switched_off_is_asked_about():
    """No delivery section is not "no flags", and a check that could not run (the store's inputs
    changed since the champion's) is not a check passed: both are refusals that --accept-flagged
    answers. Open flags say how many were held out and how many trained on."""
    assert open_flags({**BLESSED}) is None
    bare = {k: v for k, v in BLESSED.items() if k != "delivery"}
    assert "records no delivery check" in open_flags(bare)
    switched_off = {**BLESSED, "delivery": {"checked": False, "unchecked": 37, "open_flags": 0,
                                            "reason": "the champion was trained on other inputs than this store"}}
    said = open_flags(switched_off)
    assert "did not run on 37 new photo(s)" in said and "other inputs" in said
    reported = {**BLESSED, "delivery": {"checked": True, "flagged": True, "open_flags": 12, "held_out_images": 5,
                                        "held_from_earlier_weeks": 5, "policy": "report", "pairs": []}}
    assert "5 held out of training, 7 trained on" in open_flags(reported)

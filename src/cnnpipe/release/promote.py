"""Promote this commit's model, the GTO way, and publish it: `python -m cnnpipe.promote`.

Refuses, with exit code 2 and the reasons, when: the model was not blessed (unless `--override
"why"`, which goes into the tags), the gate judged against another champion than the one in the
stage now, the working tree or dvc.lock is not committed, the pipeline is not up to date with
dvc.lock, the model is not in the DVC remote, the commit is not on the git remote, or this clone's
tags disagree with the remote's. Otherwise it registers the commit as the next version (`name@v0.1.0`
first, then `--bump-minor`; a version HEAD already has is reused), assigns it to the stage
(`name#prod#N`), both annotated tags carrying the gate's summary, and pushes both to the git
remote (`release.remote`). The first time (and on any branch that lacks it) it first commits
`registry.json` recording the artifact and pushes that commit, which it then registers: a commit
that holds the record requires the git remote to tell the champion; one without it, in a clone
without tags, has never promoted anything and needs no remote (`production.lookup`). A run stopped half-way (registered but not assigned, or tagged but not
pushed) is finished by running it again. `gto show` lists the history; a rollback is `gto assign NAME
--stage prod --version vX.Y.Z --force` and a push of its tag, which the champion stage follows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from cnnpipe.release_config import ReleaseConfig
from cnnpipe.params import ParamsError, load_params, release_config
from cnnpipe.release.production import (
    REGISTRY_RECORD,
    ProductionUnknown,
    artifact_events,
    git,
    in_stage,
    read_record,
    record_promotion,
    remote_of,
    sync_tags,
    unpublished_error,
)

FIRST_VERSION = "v0.1.0"


class Refused(RuntimeError):
    """Promotion refused; the message says why and what to do."""


def _run(args: list[str], repo: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=repo, capture_output=True, text=True, check=False)


def summary(verdict: dict[str, Any]) -> str:
    """One paragraph for the tag message: the verdict and its reasons (and warnings)."""
    return f"gate: {'blessed' if verdict['blessed'] else 'REFUSED'}. " + " ".join(
        line.rstrip(".") + "." for line in verdict.get("warnings", []) + verdict["reasons"])


def check_ready(repo: Path, model_stage: str, gate: Path, remote: str | None) -> None:
    """Refuse unless the tree is committed (dvc.lock and the verdict included), the pipeline matches
    dvc.lock, the model is pushed to the DVC remote and the commit to the git remote."""
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], repo)
    if dirty.returncode != 0:
        raise Refused(f"{repo} is not a git repository: {dirty.stderr.strip()}")
    tracked = _run(["git", "ls-files", "--error-unmatch", "dvc.lock", str(gate.resolve().relative_to(repo))], repo)
    if tracked.returncode != 0:
        raise Refused(f"dvc.lock and {gate} must be committed with the model: {tracked.stderr.strip()}")
    if dirty.stdout.strip():
        raise Refused("the working tree has uncommitted changes (dvc.lock, metrics, code?):\n"
                      f"{dirty.stdout.rstrip()}\ncommit them first: the version must name the commit that made it")
    # The gate and everything it stands on (prepare, train@optimized, evaluate@optimized): a weekly run
    # may leave the baseline's stages behind.
    status = _run([sys.executable, "-m", "dvc", "status", "--json", "--with-deps", "gate"], repo)
    stale = {} if status.returncode else {stage: changes for stage, changes in json.loads(status.stdout or "{}").items()
                                          if changes != ["always changed"]}  # the machine and champion stages
    if status.returncode or stale:
        raise Refused(f"the gate or the model is not up to date with dvc.lock ({', '.join(stale) or status.stderr.strip()}"
                      "): run `dvc repro gate` and commit")
    cloud = _run([sys.executable, "-m", "dvc", "status", "--cloud", "--json", model_stage], repo)
    if cloud.returncode != 0:
        raise Refused(f"cannot check the DVC remote: {cloud.stderr.strip()}: configure one (`dvc remote add -d ...`)")
    if json.loads(cloud.stdout or "{}"):
        raise Refused("the model is not in the DVC remote yet: run `dvc push` (a serving machine fetches it from there)")
    if remote is not None:
        git(repo, "fetch", "--quiet", "--no-tags", remote)
        on_remote = git(repo, "branch", "-r", "--contains", "HEAD", "--format=%(refname:short)").stdout.split()
        if not any(b.startswith(f"{remote}/") for b in on_remote):
            raise Refused(f"this commit is on no branch of {remote!r}: push it first (`git push {remote} HEAD`), so that "
                          "the version's commit is where every clone can find it")


def check_same_champion(now: dict[str, Any] | None, cfg: ReleaseConfig, verdict: dict[str, Any]) -> None:
    """Refuse a verdict judged against another champion than the one in the stage now (the stage
    moved since `dvc repro gate`)."""
    judged = verdict.get("champion") or {}
    if (now or {}).get("commit") != judged.get("commit"):
        raise Refused(f"the gate judged against {judged.get('version') or 'no champion'}, but {cfg.stage!r} now holds "
                      f"{(now or {}).get('version') or 'nothing'}: rerun `dvc repro gate` and commit")


def commit_record(repo: Path, artifact: str, remote: str | None) -> str | None:
    """Commit `REGISTRY_RECORD` with `artifact` in it unless HEAD already holds it, and push the commit
    to `remote`; returns the new HEAD, or None when nothing was needed."""
    shown = git(repo, "show", f"HEAD:{REGISTRY_RECORD}", check=False)
    if shown.returncode == 0 and artifact in read_record(shown.stdout, f"{REGISTRY_RECORD} at HEAD")["artifacts"]:
        return None
    record_promotion(repo, artifact, remote)
    git(repo, "add", REGISTRY_RECORD)
    git(repo, "commit", "--quiet", "-m", f"Record {artifact!r} in {REGISTRY_RECORD}: its promotions need the git "
        "remote from this commit on", "--", REGISTRY_RECORD)
    if remote is not None:
        git(repo, "push", "--quiet", remote, "HEAD")
    return git(repo, "rev-parse", "HEAD").stdout.strip()


def publish(repo: Path, remote: str | None, tags: list[str]) -> None:
    """Push `tags` to `remote`. When the remote already has a tag of that name (another promote got there
    first), this clone's copies are deleted and the run refused: running it again numbers after theirs."""
    if remote is None or not tags:
        return
    pushed = git(repo, "push", "--quiet", remote, *(f"refs/tags/{t}" for t in tags), check=False)
    if pushed.returncode == 0:
        return
    if "already exists" in pushed.stderr or "rejected" in pushed.stderr:
        theirs = git(repo, "ls-remote", "--tags", remote, *(f"refs/tags/{t}" for t in tags), check=False).stdout
        taken = [t for t in tags if f"refs/tags/{t}\n" in theirs + "\n"]
        git(repo, "tag", "-d", *taken, check=False)
        raise Refused(f"{remote!r} already has {', '.join(taken)} from another promote: this clone's copies were "
                      "deleted; run promote again to number after them")
    raise Refused(f"the tags {', '.join(tags)} were made but could not be pushed to {remote!r} "
                  f"({pushed.stderr.strip()}): run promote again to push them")


def promote(repo: Path, cfg: ReleaseConfig, verdict: dict[str, Any], override: str | None = None,
            model_stage: str = "train@optimized", gate: Path = Path("metrics/gate.json")) -> tuple[str, list[str], bool]:
    """Register, assign and publish; returns the version, its tags and whether anything was new."""
    import gto.api
    from gto.exceptions import GTOException

    if not verdict["blessed"] and not override:
        raise Refused("the gate did not bless this model:\n" + "\n".join(f"  - {r}" for r in verdict["reasons"])
                      + "\nfix the data or the recipe, or promote anyway with --override \"why\" (recorded in the tags)")
    remote = remote_of(repo, cfg.remote)
    if remote is None and cfg.remote is not None:
        raise Refused(f"this repository has no git remote {cfg.remote!r} to publish the tags to: add it "
                      f"(`git remote add {cfg.remote} URL`), or set release.remote: null to keep them local on purpose")
    head = git(repo, "rev-parse", "HEAD").stdout.strip()
    try:
        unpublished = sync_tags(repo, remote, cfg.artifact) if remote else []
        events = artifact_events(repo, cfg.artifact)
        # Our own leftovers (a run stopped before its push) are finished; anything else is refused.
        ours = {e.tag for e in events if e.tag in unpublished and e.commit == head
                and (e.action == "register" or (e.action == "assign" and e.stage == cfg.stage))}
        if set(unpublished) - ours:
            raise unpublished_error(remote or "", sorted(set(unpublished) - ours))
        now = in_stage([e for e in events if e.tag not in ours], cfg.artifact, cfg.stage)
        if now is not None and now["commit"] == head and not ours:
            return now["version"], [now["tag"]], False
        check_same_champion(now, cfg, verdict)
        check_ready(repo, model_stage, repo / gate, remote)
        if not ours and not any(e.action == "register" and e.commit == head for e in events):
            head = commit_record(repo, cfg.artifact, remote) or head  # the version's commit holds the record
    except ProductionUnknown as exc:
        raise Refused(str(exc)) from exc
    message = summary(verdict)
    if override:
        who = _run(["git", "config", "user.name"], repo).stdout.strip() or "unknown"
        message = f"OVERRIDE by {who}: {override}. {message}"
    versions = [e for e in events if e.action == "register" and e.commit == head]
    try:
        if versions:
            version = versions[-1].version
            made = [versions[-1].tag] if versions[-1].tag in ours else []
        else:
            first = not any(e.action == "register" for e in events)
            registered = gto.api.register(str(repo), cfg.artifact, "HEAD", message=message,
                                          **({"version": FIRST_VERSION} if first else {"bump_minor": True}))
            version, made = registered.version, [registered.tag]
        assigned = in_stage(artifact_events(repo, cfg.artifact), cfg.artifact, cfg.stage)
        if assigned is not None and assigned["commit"] == head:
            made += [assigned["tag"]] if assigned["tag"] in ours else []
            tag = assigned["tag"]
        else:
            tag = gto.api.assign(str(repo), cfg.artifact, cfg.stage, version=version, message=message).tag
            made.append(tag)
    except GTOException as exc:
        raise Refused(f"GTO refused: {exc}") from exc
    publish(repo, remote, made)
    return version, sorted({*made, tag}), True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cnnpipe.promote", description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=Path("."), help="the project (paths below are inside it)")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--gate", type=Path, default=Path("metrics/gate.json"), help="the gate stage's verdict")
    parser.add_argument("--override", metavar="WHY", help="promote a model the gate refused; WHY goes into the tags")
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    try:
        cfg = release_config(load_params(repo / args.params))
        if not (repo / args.gate).exists():
            raise Refused(f"{args.gate} not found: run `dvc repro gate` first")
        verdict = json.loads((repo / args.gate).read_text())
        version, tags, new = promote(repo, cfg, verdict, args.override, gate=args.gate)
    except (Refused, ParamsError) as exc:
        print(f"promote: REFUSED: {exc}", file=sys.stderr)
        return 2
    if not new:
        print(f"promote: {cfg.artifact} {version} is already in {cfg.stage!r} ({', '.join(tags)}): nothing to do")
        return 0
    where = f"pushed to {cfg.remote!r}" if remote_of(repo, cfg.remote) else "local only (release.remote: null)"
    print(f"promote: {cfg.artifact} {version} is now in {cfg.stage!r} ({', '.join(tags)}; {where})")
    return 0

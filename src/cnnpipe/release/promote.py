"""Promote this commit's model, the GTO way, and publish it: `python -m cnnpipe.promote`.

Refuses, with exit code 2 and the reasons, when: the model was not blessed (unless `--override
"why"`, which goes into the tags with a record verify checks: `cnnpipe.release.override`), the delivery check left flagged photos open (named; unless
`--accept-flagged`, said in the tags), the gate judged against another champion than the one in the
stage now, the working tree (an untracked file included) or dvc.lock is not committed, the pipeline
is not up to date with dvc.lock, the model is not in the DVC remote, the commit is not on the git
remote's main branch, or this clone's
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
from cnnpipe.release.override import record_line
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
ACCEPTED = "ACCEPTED with --accept-flagged"  # in the tags' message: what verify looks for


class Refused(RuntimeError):
    """Promotion refused; the message says why and what to do."""


def _run(args: list[str], repo: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=repo, capture_output=True, text=True, check=False)


def summary(verdict: dict[str, Any]) -> str:
    """One paragraph for the tag message: the verdict and its reasons (and warnings)."""
    return f"gate: {'blessed' if verdict['blessed'] else 'REFUSED'}. " + " ".join(
        line.rstrip(".") + "." for line in verdict.get("warnings", []) + verdict["reasons"])


def check_ready(repo: Path, model_stage: str, gate: Path, remote: str | None) -> str | None:
    """Refuse unless the tree is committed (dvc.lock and the verdict included, no untracked file), the
    commit is on the git remote's main branch, the pipeline matches dvc.lock and the model is pushed
    to the DVC remote. Returns that main branch's name (None without a remote)."""
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=all"], repo)
    if dirty.returncode != 0:
        raise Refused(f"{repo} is not a git repository: {dirty.stderr.strip()}")
    tracked = _run(["git", "ls-files", "--error-unmatch", "dvc.lock", str(gate.resolve().relative_to(repo))], repo)
    if tracked.returncode != 0:
        raise Refused(f"dvc.lock and {gate} must be committed with the model: {tracked.stderr.strip()}")
    lines = dirty.stdout.splitlines()
    changed, untracked = [s for s in lines if not s.startswith("??")], [s[3:] for s in lines if s.startswith("??")]
    if changed:
        raise Refused("the working tree has uncommitted changes (dvc.lock, metrics, code?):\n"
                      + "\n".join(changed) + "\ncommit them first: the version must name the commit that made it")
    if untracked:
        raise Refused("the working tree has untracked files, which the version's commit would not hold:\n"
                      + "\n".join(f"  {name}" for name in untracked) + "\ncommit them (`git add`), or list them in "
                      ".gitignore if they are not part of the project")
    branch = check_on_main(repo, remote) if remote is not None else None
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
    return branch


def check_on_main(repo: Path, remote: str) -> str:
    """Refuse unless HEAD is in the history of `remote`'s main branch (its HEAD, else `main`), fetched
    now: a commit only on a side branch, or not pushed, is not where every clone and CI look. Returns
    that branch's name."""
    symref = git(repo, "ls-remote", "--symref", remote, "HEAD", check=False)
    head = next((line.split()[1] for line in symref.stdout.splitlines() if line.startswith("ref: ")), "refs/heads/main")
    branch = head.removeprefix("refs/heads/")
    fetched = git(repo, "fetch", "--quiet", "--no-tags", remote, f"+{head}:refs/remotes/{remote}/{branch}", check=False)
    if fetched.returncode != 0:
        raise Refused(f"cannot read branch {branch!r} of git remote {remote!r} ({fetched.stderr.strip()}): push this "
                      f"commit there first (`git push {remote} HEAD:{branch}`)")
    if git(repo, "merge-base", "--is-ancestor", "HEAD", f"refs/remotes/{remote}/{branch}", check=False).returncode:
        raise Refused(f"this commit is not on {remote!r}'s {branch}: push it there first (`git push {remote} "
                      f"HEAD:{branch}`, merged if it sits on another branch), so that the version's commit is in the "
                      "history every clone and CI check out")
    return branch


def open_flags(verdict: dict[str, Any]) -> str | None:
    """What the delivery check left open (photos flagged this week or held since, not cleared; new
    photos it could not check; no check recorded at all), as the lines of a refusal; None when nothing
    is open. A verdict without a delivery section is not one without flags: it is asked about."""
    if "delivery" not in verdict:
        return ("the gate's verdict records no delivery check (metrics/gate.json written without "
                "metrics/delivery.json): rerun `dvc repro gate` and commit; or promote anyway with --accept-flagged")
    checked = verdict.get("delivery") or {}
    if checked.get("unchecked"):
        return (f"the delivery check did not run on {checked['unchecked']} new photo(s): {checked.get('reason')}. "
                "Nothing stands between a mislabelled delivery and production this week: look at the new photos, "
                "or retrain the champion on this store's inputs first; then promote with --accept-flagged")
    count = checked.get("open_flags")
    if count is None:  # a report older than holds: its flags are this week's
        count = checked.get("flagged_images") or 0 if checked.get("flagged") else 0
    if not count:
        return None
    pairs = [f"  - {r['images']} of {r['of']} new {r['given']!r} photos look like {r['predicted']!r}"
             for r in checked.get("pairs") or []]
    held = checked.get("held_from_earlier_weeks") or 0
    held_out = checked.get("held_out_images")
    trained = "" if held_out is None else f"; {held_out} held out of training, {count - held_out} trained on"
    where = checked.get("list") or "data/delivery/flagged.csv"
    return "\n".join([f"the delivery check left {count} flagged photo(s) open (policy {checked.get('policy')}; "
                      f"{held} held since an earlier week{trained}), listed in {where}:", *pairs,
                      "fix their labels in the catalog, or clear them (`python -m cnnpipe.release.clear --note WHY "
                      "--all`: data/delivery/cleared.csv), then rerun `dvc repro gate` and commit; or promote anyway "
                      "with --accept-flagged"])


def check_same_champion(now: dict[str, Any] | None, cfg: ReleaseConfig, verdict: dict[str, Any]) -> None:
    """Refuse a verdict judged against another champion than the one in the stage now (the stage
    moved since `dvc repro gate`)."""
    judged = verdict.get("champion") or {}
    if (now or {}).get("commit") != judged.get("commit"):
        raise Refused(f"the gate judged against {judged.get('version') or 'no champion'}, but {cfg.stage!r} now holds "
                      f"{(now or {}).get('version') or 'nothing'}: rerun `dvc repro gate` and commit")


def commit_record(repo: Path, artifact: str, remote: str | None, branch: str | None) -> str | None:
    """Commit `REGISTRY_RECORD` with `artifact` in it unless HEAD already holds it, and push the commit
    to `remote`'s main `branch` (whatever the local branch is called, or a detached HEAD); returns the
    new HEAD, or None when nothing was needed. A push the remote refuses (its main moved on) takes the
    commit back and refuses: the version must be registered on a commit every clone has."""
    shown = git(repo, "show", f"HEAD:{REGISTRY_RECORD}", check=False)
    if shown.returncode == 0 and artifact in read_record(shown.stdout, f"{REGISTRY_RECORD} at HEAD")["artifacts"]:
        return None
    record_promotion(repo, artifact, remote)
    git(repo, "add", REGISTRY_RECORD)
    git(repo, "commit", "--quiet", "-m", f"Record {artifact!r} in {REGISTRY_RECORD}: its promotions need the git "
        "remote from this commit on", "--", REGISTRY_RECORD)
    if remote is not None:
        pushed = git(repo, "push", "--quiet", remote, f"HEAD:refs/heads/{branch or 'main'}", check=False)
        if pushed.returncode != 0:
            git(repo, "reset", "--quiet", "--keep", "HEAD~1", check=False)
            raise Refused(f"could not push the commit recording {REGISTRY_RECORD} to {remote!r}'s {branch or 'main'} "
                          f"({pushed.stderr.strip()}): pull, rerun `dvc repro gate` if anything changed, and promote again")
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
            model_stage: str = "train@optimized", gate: Path = Path("metrics/gate.json"),
            accept_flagged: bool = False) -> tuple[str, list[str], bool]:
    """Register, assign and publish; returns the version, its tags and whether anything was new. Open
    delivery flags refuse it unless `accept_flagged` (recorded in the tags)."""
    import gto.api
    from gto.exceptions import GTOException

    flags = open_flags(verdict)
    unflagged = "\nand " + flags if flags and not accept_flagged else ""  # both said at once: one rerun fixes both
    if not verdict["blessed"] and not override:
        raise Refused("the gate did not bless this model:\n" + "\n".join(f"  - {r}" for r in verdict["reasons"])
                      + "\nfix the data or the recipe, or promote anyway with --override \"why\" (recorded in the tags)"
                      + unflagged)
    if flags and not accept_flagged:
        raise Refused(flags)
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
        branch = check_ready(repo, model_stage, repo / gate, remote)
        if not ours and not any(e.action == "register" and e.commit == head for e in events):
            head = commit_record(repo, cfg.artifact, remote, branch) or head  # the version's commit holds the record
    except ProductionUnknown as exc:
        raise Refused(str(exc)) from exc
    message = summary(verdict)
    who = _run(["git", "config", "user.name"], repo).stdout.strip() or "unknown"
    if override:
        message = f"OVERRIDE by {who}: {override}. {message}"
    if flags:  # after the gate's words, so that an override still leads the message
        message = f"{message} Delivery: {flags.splitlines()[0].rstrip(':')}: {ACCEPTED} by {who}."
    if override and not verdict["blessed"]:  # what verify checks: this commit's verdict and model, by md5
        try:
            message += "\n\n" + record_line(who, override, git(repo, "show", "HEAD:dvc.lock").stdout)
        except (ValueError, ProductionUnknown) as exc:
            raise Refused(str(exc)) from exc
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
    parser.add_argument("--accept-flagged", action="store_true",
                        help="promote although the delivery check left flagged photos open (said in the tags)")
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    try:
        cfg = release_config(load_params(repo / args.params))
        if not (repo / args.gate).exists():
            raise Refused(f"{args.gate} not found: run `dvc repro gate` first")
        verdict = json.loads((repo / args.gate).read_text())
        version, tags, new = promote(repo, cfg, verdict, args.override, gate=args.gate,
                                     accept_flagged=args.accept_flagged)
    except (Refused, ParamsError) as exc:
        print(f"promote: REFUSED: {exc}", file=sys.stderr)
        return 2
    if not new:
        print(f"promote: {cfg.artifact} {version} is already in {cfg.stage!r} ({', '.join(tags)}): nothing to do")
        return 0
    where = f"pushed to {cfg.remote!r}" if remote_of(repo, cfg.remote) else "local only (release.remote: null)"
    print(f"promote: {cfg.artifact} {version} is now in {cfg.stage!r} ({', '.join(tags)}; {where})")
    return 0

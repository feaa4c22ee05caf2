"""What is in production: one resolution of a GTO stage, from tags fresh from the git remote, failing closed.

GTO records the registry as annotated git tags: `name@v0.2.0` registers a version, `name@v0.2.0!#4`
deregisters it, `name#prod#3` assigns the version at the tag's commit to `prod`, `name#prod!#5`
unassigns it, `name@deprecated#6` deprecates the artifact. `in_stage` follows GTO's semantics
(gto.base: a stage's version is the active version whose newest assignment is the newest, a version
is inactive once deregistered, an assignment once unassigned, everything once deprecated) with one
difference: events in the same second (a tag's time has one-second resolution) are ordered by
GTO's own counter (`#N`, one sequence per artifact), where GTO leaves the order to its sort.

`dvc artifacts get --stage prod` takes the newest tag naming the stage, unassignments included, so it
can serve another version than GTO says; the champion stage, promote's checks and the serving
command (`python -m cnnpipe.release.fetch`) all use `in_stage` instead, on tags `sync_tags` has just
compared with the remote's: a clone without tags, or with stale ones, either fetches what it lacks
or refuses with the fix, never "no champion".
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ProductionUnknown(RuntimeError):
    """What is in production cannot be told for sure; the message says why and what to do."""


@dataclass(frozen=True)
class Event:
    """One GTO tag of the artifact."""

    tag: str
    action: str  # register, deregister, assign, unassign, deprecate
    commit: str
    time: int  # the tagger's time, unix seconds
    counter: int  # GTO's #N; -1 for a tag without one (a registration)
    version: str | None = None
    stage: str | None = None
    message: str = ""

    @property
    def order(self) -> tuple[int, int, str]:
        return self.time, self.counter, self.tag


def git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`git -C repo args` (text, captured); raises ProductionUnknown with git's words when `check`."""
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise ProductionUnknown(f"`git {' '.join(args)}` failed in {repo}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def artifact_events(repo: Path, artifact: str) -> list[Event]:
    """The artifact's GTO events from the local annotated tags (lightweight tags are not GTO's),
    parsed with GTO's own tag grammar, oldest first."""
    from gto.tag import parse_name

    fields = "%(refname:strip=2)%1f%(objecttype)%1f%(*objectname)%1f%(taggerdate:unix)%1f%(contents)%1e"
    out = git(repo, "for-each-ref", f"--format={fields}", "refs/tags").stdout
    events = []
    for record in out.split("\x1e"):
        parts = record.strip("\n").split("\x1f")
        if len(parts) != 5 or parts[1] != "tag":
            continue
        name, _, commit, when, message = parts
        parsed = parse_name(name, raise_on_fail=False)
        if not parsed or parsed.get("name") != artifact or "action" not in parsed:
            continue
        events.append(Event(name, parsed["action"].value, commit, int(when or 0), int(parsed.get("counter", -1)),
                            parsed.get("version"), parsed.get("stage"), message.strip()))
    return sorted(events, key=lambda e: e.order)


def in_stage(events: list[Event], artifact: str, stage: str) -> dict[str, Any] | None:
    """The version of `artifact` in `stage` (version, commit, tag, its time and message), or None when
    none is. Raises ProductionUnknown when the artifact is deprecated."""
    if events and events[-1].action == "deprecate":
        raise ProductionUnknown(f"{artifact!r} is deprecated in GTO ({events[-1].tag}): no version of it is in any "
                                "stage. Register and assign a version to revive it, or name another release.artifact")
    registered: dict[str, str] = {}  # commit -> version
    active: dict[str, bool] = {}  # commit -> not deregistered
    newest: dict[str, Event] = {}  # commit -> its newest assign/unassign in `stage`
    for e in events:  # oldest first: the last word wins
        if e.action in ("register", "deregister"):
            registered.setdefault(e.commit, e.version or e.commit)
            active[e.commit] = e.action == "register"
        elif e.action in ("assign", "unassign") and e.stage == stage:
            newest[e.commit] = e
    live = [e for commit, e in newest.items() if e.action == "assign" and active.get(commit, True)]
    if not live:
        return None
    top = max(live, key=lambda e: e.order)
    return {"artifact": artifact, "stage": stage, "version": registered.get(top.commit, top.commit),
            "commit": top.commit, "tag": top.tag, "assigned_at": top.time, "message": top.message}


def remote_of(repo: Path, remote: str | None) -> str | None:
    """`remote` when the repository has a remote of that name, else None (local tags only)."""
    if remote is None or not (repo / ".git").exists():
        return None
    return remote if git(repo, "remote", "get-url", remote, check=False).returncode == 0 else None


def _gto_tag(name: str, artifact: str) -> bool:
    from gto.tag import parse_name

    parsed = parse_name(name, raise_on_fail=False)
    return bool(parsed) and parsed.get("name") == artifact


def local_tags(repo: Path, artifact: str) -> dict[str, str]:
    """The artifact's GTO tags here: name -> tag object id."""
    out = git(repo, "for-each-ref", "--format=%(refname:strip=2) %(objectname)", "refs/tags").stdout
    pairs = (line.rsplit(" ", 1) for line in out.splitlines() if line.strip())
    return {name: obj for name, obj in pairs if _gto_tag(name, artifact)}


def remote_tags(repo: Path, remote: str, artifact: str) -> dict[str, str]:
    """The artifact's GTO tags on `remote`: name -> tag object id. Raises when it cannot be reached."""
    proc = git(repo, "ls-remote", "--tags", remote, check=False)
    if proc.returncode != 0:
        raise ProductionUnknown(f"cannot read the tags of git remote {remote!r} ({proc.stderr.strip()}): what is in "
                                "production cannot be told. Fix the network or the remote, or set release.remote: null "
                                "to trust this clone's tags on purpose")
    tags = {}
    for line in proc.stdout.splitlines():
        obj, _, ref = line.partition("\t")
        name = ref.removeprefix("refs/tags/")
        if ref.startswith("refs/tags/") and not name.endswith("^{}") and _gto_tag(name, artifact):
            tags[name] = obj
    return tags


def sync_tags(repo: Path, remote: str, artifact: str) -> list[str]:
    """Make this clone's tags of `artifact` the remote's: fetch those it lacks, refuse (ProductionUnknown,
    with the fix) when a tag differs on the two sides. Returns the local tags the remote does not have
    (unpublished), for the caller to judge."""
    theirs = remote_tags(repo, remote, artifact)
    ours = local_tags(repo, artifact)
    differ = sorted(name for name in theirs.keys() & ours.keys() if theirs[name] != ours[name])
    if differ:
        raise ProductionUnknown(f"tags differ between this clone and {remote!r}: {', '.join(differ)}. Take the "
                                f"remote's: `git tag -d {' '.join(differ)} && git fetch {remote} --tags`")
    missing = sorted(theirs.keys() - ours.keys())
    if missing:
        git(repo, "fetch", "--quiet", "--no-tags", remote, *(f"refs/tags/{t}:refs/tags/{t}" for t in missing))
        fetched = local_tags(repo, artifact)
        if any(fetched.get(t) != theirs[t] for t in missing):
            raise ProductionUnknown(f"fetching {len(missing)} tags from {remote!r} did not bring them as they are there")
    return sorted(ours.keys() - theirs.keys())


def unpublished_error(remote: str, tags: list[str]) -> ProductionUnknown:
    """The refusal for local tags the remote lacks (a promote never pushed, or a tag deleted there)."""
    return ProductionUnknown(f"this clone has GTO tags that {remote!r} does not: {', '.join(tags)}. Publish them "
                             f"(`git push {remote} {' '.join(tags)}`, or rerun `python -m cnnpipe.promote`, which "
                             f"publishes its own) or delete them (`git tag -d {' '.join(tags)}`)")


def resolve(repo: Path, artifact: str, stage: str, remote: str | None) -> dict[str, Any] | None:
    """What is in `stage` now: the remote's tags first (fetched, compared: refused on any disagreement),
    then `in_stage`. None only when neither this clone nor the remote has a version in the stage."""
    if not (repo / ".git").exists():
        return None
    where = remote_of(repo, remote)
    if where is not None:
        extra = sync_tags(repo, where, artifact)
        if extra:
            raise unpublished_error(where, extra)
    found = in_stage(artifact_events(repo, artifact), artifact, stage)
    return None if found is None else {**found, "remote": where}

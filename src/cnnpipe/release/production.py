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

A project that has never promoted anything needs no remote: promote commits `REGISTRY_RECORD`
(`registry.json`) into the commit it registers, the first time and whenever a branch lacks it, so a
commit that holds the record (or a clone with the artifact's tags) requires the remote, fail-closed
as above; one that holds neither is "never promoted" and asks the remote only where it answers (a
promotion made by hand with `gto`): an unreachable `origin` (an archive, a mirror, an offline cluster)
is then "no champion", said so in champion.json.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any


REGISTRY_RECORD = "registry.json"
"""Committed by promote: the artifacts this project has promoted, so a clone that cannot see the
registry (no tags, no reachable remote) knows it has one and refuses instead of saying "none"."""
UNRECORDED_TIMEOUT_S = 30
"""How long the lookup waits for the git remote when nothing records a promotion (a firewall that
drops packets would otherwise hold `git ls-remote` for minutes, for an answer that is not needed)."""


class ProductionUnknown(RuntimeError):
    """What is in production cannot be told for sure; the message says why and what to do."""


class RemoteUnreachable(ProductionUnknown):
    """The git remote's tags could not be read."""


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


def remote_tags(repo: Path, remote: str, artifact: str, timeout: float | None = None) -> dict[str, str]:
    """The artifact's GTO tags on `remote`: name -> tag object id. Raises RemoteUnreachable when it
    cannot be reached (within `timeout` seconds, when given)."""
    try:
        proc = subprocess.run(["git", "-C", str(repo), "ls-remote", "--tags", remote], capture_output=True,
                              text=True, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc = subprocess.CompletedProcess([], 1, "", f"no answer in {timeout:.0f} s")
    if proc.returncode != 0:
        raise RemoteUnreachable(f"cannot read the tags of git remote {remote!r} ({proc.stderr.strip()}): what is in "
                                "production cannot be told. Fix the network or the remote, or set release.remote: null "
                                "to trust this clone's tags on purpose")
    tags = {}
    for line in proc.stdout.splitlines():
        obj, _, ref = line.partition("\t")
        name = ref.removeprefix("refs/tags/")
        if ref.startswith("refs/tags/") and not name.endswith("^{}") and _gto_tag(name, artifact):
            tags[name] = obj
    return tags


def sync_tags(repo: Path, remote: str, artifact: str, timeout: float | None = None) -> list[str]:
    """Make this clone's tags of `artifact` the remote's: fetch those it lacks, refuse (ProductionUnknown,
    with the fix) when a tag differs on the two sides. Returns the local tags the remote does not have
    (unpublished), for the caller to judge."""
    theirs = remote_tags(repo, remote, artifact, timeout)
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


def read_record(text: str, where: str) -> dict[str, Any]:
    """A registry record's JSON (`where`: its name in errors); ProductionUnknown when it is not one."""
    try:
        record = json.loads(text)
        if not isinstance(record.get("artifacts"), dict):
            raise ValueError("no `artifacts` mapping")
        return record
    except ValueError as exc:
        raise ProductionUnknown(f"{where}: not a registry record ({exc}); restore it from git "
                                f"(`git checkout -- {REGISTRY_RECORD}`)") from exc


def promotion_recorded(repo: Path, artifact: str) -> bool:
    """Whether this commit (HEAD's tree) or the working tree records a promotion of `artifact` in
    `REGISTRY_RECORD`. A record that cannot be read is an error, never "not recorded"."""
    texts = []
    if (repo / ".git").exists():
        shown = git(repo, "show", f"HEAD:{REGISTRY_RECORD}", check=False)
        if shown.returncode == 0:
            texts.append((shown.stdout, f"{REGISTRY_RECORD} at HEAD"))
    if (repo / REGISTRY_RECORD).is_file():
        texts.append(((repo / REGISTRY_RECORD).read_text(encoding="utf-8"), str(repo / REGISTRY_RECORD)))
    records = [read_record(text, where) for text, where in texts]  # each read: a broken one is an error
    return any(artifact in record["artifacts"] for record in records)


def lookup(repo: Path, artifact: str, stage: str, remote: str | None) -> tuple[dict[str, Any] | None, str]:
    """`resolve`, and how a missing version was told: "" when both this clone and the remote were
    asked, else why the remote was not needed."""
    recorded = promotion_recorded(repo, artifact)
    if not (repo / ".git").exists():
        if recorded:
            raise ProductionUnknown(f"{REGISTRY_RECORD} records a promotion of {artifact!r}, but {repo} is no git "
                                    "repository, so its registry (GTO tags) cannot be read: work in a `git clone`")
        return None, f"{repo} is no git repository and records no promotion"
    where = remote_of(repo, remote)
    if where is not None:
        required = recorded or bool(local_tags(repo, artifact))
        try:
            extra = sync_tags(repo, where, artifact, None if required else UNRECORDED_TIMEOUT_S)
        except RemoteUnreachable as exc:
            if required:
                raise
            return None, (f"never promoted: this commit records no promotion ({REGISTRY_RECORD}) and this clone has "
                          f"no tags of {artifact!r}, so the git remote is not needed; "
                          f"{str(exc).split(': what is')[0]}")
        if extra:
            raise unpublished_error(where, extra)
    found = in_stage(artifact_events(repo, artifact), artifact, stage)
    return (None, "") if found is None else ({**found, "remote": where}, "")


def resolve(repo: Path, artifact: str, stage: str, remote: str | None) -> dict[str, Any] | None:
    """What is in `stage` now: the remote's tags first (fetched, compared: refused on any disagreement),
    then `in_stage`. None only when neither this clone nor the remote has a version in the stage, or
    when nothing records a promotion and the remote cannot be read (`lookup` says which)."""
    return lookup(repo, artifact, stage, remote)[0]


def record_promotion(repo: Path, artifact: str, remote: str | None) -> bool:
    """Add `artifact` to `REGISTRY_RECORD` in the working tree (created when missing); returns whether
    the file changed. Promote commits it before registering, so the promoted commit holds it."""
    path = repo / REGISTRY_RECORD
    record = read_record(path.read_text(encoding="utf-8"), str(path)) if path.is_file() else {
        "about": "Written by `python -m cnnpipe.promote`: this project has a model registry (GTO tags on the git "
                 "remote), so the champion stage requires that remote. Keep it committed (docs/weekly-loop.md).",
        "artifacts": {}}
    if artifact in record["artifacts"]:
        return False
    record["artifacts"][artifact] = {"remote": remote}
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return True

"""`python -m cnnpipe.release.verify TAG_OR_REF`: was the model at this `#prod#` assignment (or commit) blessed?

Exits 0 only when, at the commit the tag (or ref) names:

- metrics/gate.json says `blessed`, or a GTO tag of the artifact on that commit records an override
  that `python -m cnnpipe.promote --override` made for that commit's verdict and model (its record
  names their md5s, `cnnpipe.release.override`): a hand-written "OVERRIDE by ..." tag is refused;
- the delivery check left no flagged photo open, or a tag on that commit records the acknowledgement
  (`python -m cnnpipe.promote --accept-flagged`);
- that gate.json is the gate stage's own output (its md5 is the one dvc.lock records for it);
- the gate judged that commit's model: the gate stage's recorded input `models/optimized` has the
  hash dvc.lock records for train@optimized's output, the artifact's folder;
- the DVC remote holds that model: every file of the artifact's folder as that commit's dvc.lock
  records it (the folder's listing checked against its md5), so a server can fetch what was judged.

Git answers the first three; the last asks the default DVC remote of the checkout (`.dvc/config`,
with `config.local`'s credentials), so the CI job on every tag push needs read access to it: a `gto
assign` made by hand, past the gate, or a model never pushed, fails the build (docs/weekly-loop.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from cnnpipe.release_config import ReleaseConfig
from cnnpipe.release.champion import artifact_path
from cnnpipe.release.production import ProductionUnknown, artifact_events, git
from cnnpipe.release.remote import ModelUnchecked, Remote
from cnnpipe.release.override import GATE, MODEL_DIR, MODEL_STAGE, check_override, claims_override, describe
from cnnpipe.release.promote import ACCEPTED, open_flags


def _lock_entry(entries: list[dict[str, Any]], path: str) -> dict[str, Any] | None:
    return next((e for e in entries or [] if e.get("path") == path), None)


def remote_holds(repo: Path, commit: str, artifact: str, lock_text: str) -> list[str]:
    """Why the DVC remote cannot serve the artifact at `commit`: [] when it holds every file of it."""
    try:
        path = artifact_path(None, artifact, git(repo, "show", f"{commit}:dvc.yaml").stdout)
        with Remote(repo) as remote:
            missing = remote.missing(lock_text, path)
            where = f"{remote.name!r} ({remote.url})"
    except (ModelUnchecked, KeyError) as exc:
        return [f"the DVC remote cannot be checked: {exc}"]
    except Exception as exc:  # DVC could not reach the remote: unchecked is refused, never passed
        return [f"the DVC remote cannot be checked ({exc.__class__.__name__}: {exc})"]
    if missing:
        return [f"the DVC remote {where} does not hold the model at {commit[:12]}: missing {', '.join(missing)}. "
                "A server cannot fetch it: run `dvc push` where it was promoted (its cache holds it)"]
    return []


def verify(repo: Path, ref: str, artifact: str) -> tuple[bool, list[str]]:
    """Whether the model at `ref` was blessed by a gate run on its commit (or overridden on record),
    and the findings, one line each."""
    commit = git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False).stdout.strip()
    if not commit:
        raise ProductionUnknown(f"{ref!r} names no commit here (fetch the tags: `git fetch --tags`)")
    findings = [f"{ref} is commit {commit[:12]}"]
    claimed = [e for e in artifact_events(repo, artifact) if e.commit == commit and claims_override(e.message)]
    raw = git(repo, "show", f"{commit}:{GATE}", check=False)
    lock_text = git(repo, "show", f"{commit}:dvc.lock", check=False)
    if raw.returncode != 0 or lock_text.returncode != 0:
        return False, findings + [f"no {GATE} or dvc.lock committed there: no gate ran on this commit"]
    verdict = json.loads(raw.stdout)
    stages = (yaml.safe_load(lock_text.stdout) or {}).get("stages") or {}
    gate, train = stages.get("gate") or {}, stages.get(MODEL_STAGE) or {}
    ok = True
    recorded = _lock_entry(gate.get("outs"), GATE)
    actual = hashlib.md5(subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{GATE}"], capture_output=True,
                                        check=True).stdout).hexdigest()  # the bytes, as DVC hashed them
    if recorded is None or recorded.get("md5") != actual:
        ok = False
        findings.append(f"{GATE} is not what the gate stage wrote (dvc.lock records md5 "
                        f"{(recorded or {}).get('md5')}, the file has {actual})")
    judged, built = _lock_entry(gate.get("deps"), MODEL_DIR), _lock_entry(train.get("outs"), MODEL_DIR)
    if judged is None or built is None or judged.get("md5") != built.get("md5"):
        ok = False
        findings.append(f"the gate did not judge this commit's model ({MODEL_DIR}: the gate read "
                        f"{(judged or {}).get('md5')}, {MODEL_STAGE} made {(built or {}).get('md5')})")
    if verdict.get("blessed"):
        findings.append("the gate blessed it: " + "; ".join(verdict.get("warnings", []) + verdict["reasons"][:1]))
    else:
        why_not = {e.tag: check_override(e.tag, e.message, lock_text.stdout) for e in claimed}
        held = sorted((e for e in claimed if why_not[e.tag] is None), key=lambda e: e.tag != ref)  # ref's own first
        if held:
            findings.append(f"the gate refused it, and {held[0].tag} records the override {describe(held[0].message)}")
        else:
            ok = False
            findings += [w for w in why_not.values() if w]
            findings.append("the gate REFUSED it and no tag records an override made for it: "
                            + "; ".join(verdict["reasons"]))
    flags = open_flags(verdict)
    accepted = [e for e in artifact_events(repo, artifact) if e.commit == commit and ACCEPTED in e.message]
    if flags and not accepted:
        ok = False
        findings.append(flags.splitlines()[0].rstrip(":") + ", and no tag records --accept-flagged")
    problems = remote_holds(repo, commit, artifact, lock_text.stdout)
    findings += problems or ["the DVC remote holds the model"]
    return ok and not problems, findings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cnnpipe.release.verify", description=__doc__.split("\n")[0])
    parser.add_argument("ref", help="a GTO tag (fashion-classifier#prod#3), a version tag or any git ref")
    parser.add_argument("--repo", type=Path, default=Path("."))
    parser.add_argument("--artifact", default=ReleaseConfig().artifact)
    args = parser.parse_args(argv)
    try:
        ok, findings = verify(args.repo.resolve(), args.ref, args.artifact)
    except ProductionUnknown as exc:
        print(f"verify: {exc}", file=sys.stderr)
        return 2
    for line in findings:
        print(f"verify: {line}", file=sys.stdout if ok else sys.stderr)
    print(f"verify: {'OK' if ok else 'NOT VERIFIED'}: {args.ref}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

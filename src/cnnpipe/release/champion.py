"""The champion: the model assigned to a GTO stage (`release.stage`, prod), fetched at its commit.

Which version that is comes from `production.lookup`: the git remote's tags first (fetched when
this clone lacks them, refused when they disagree), then GTO's rules, so a rollback pushed from
another clone is what the next run fetches, and a clone without tags never mistakes itself for a
first week; a commit that records no promotion (`registry.json`) needs no reachable remote. The
model's bytes come from DVC at the tagged commit (`dvc.api.open`: the local cache, else the DVC
remote), so the champion is what was promoted, whatever the workspace holds; and, since DVC does not
re-hash what it reads, they are written only when their md5 is the one that commit's `dvc.lock`
records (a folder output's file through the folder's listing, itself checked against dvc.lock:
`release.remote.recorded_md5`), else refused (`Mismatch`) with the old champion left in place.
The output is rewritten only when its content changes: the stage reruns every time, and nothing
downstream does unless the champion (or the hand-over below) changed.

The anchor of the gate's drift budget comes with it: the verdict committed with the champion
(`metrics/gate.json` at its commit, `anchor_next`) names the model the weeks after it are measured
against: the champion itself when it was shown within the margin of its own anchor (or was the first
model), else that anchor, whose bytes are fetched at its commit into `anchor/best.pt` and checked
against the sha256 recorded. A release whose verdict records no anchor (one promoted before anchors
were recorded, or by hand without a verdict) makes the champion the anchor, and champion.json says so.

champion.json also carries the warm start's hand-over from the release params (`warm_start`:
`renamed` and `across_recipes`), so that training, which reads it, reruns when they change.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from cnnpipe.release_config import ReleaseConfig
from cnnpipe.files import ANCHOR_DIR, CHAMPION_FILE, file_sha256, write_json
from cnnpipe.release.production import ProductionUnknown, git, lookup
from cnnpipe.release.remote import ModelUnchecked, project_stores, recorded_md5

MODEL = "best.pt"
VERDICT = "metrics/gate.json"  # where the gate stage's verdict is committed (dvc.yaml: the gate's metrics)


class Mismatch(RuntimeError):
    """DVC served other bytes than the commit's dvc.lock records; the message names both md5s."""


def artifact_path(repo: Path | None, name: str, dvc_yaml: str | None = None) -> str:
    """Where dvc.yaml's `artifacts:` puts model `name` (`dvc_yaml`: that file's text, else repo's)."""
    text = dvc_yaml if dvc_yaml is not None else (Path(repo) / "dvc.yaml").read_text()  # type: ignore[arg-type]
    declared = (yaml.safe_load(text) or {}).get("artifacts") or {}
    if name not in declared:
        raise KeyError(f"release.artifact={name!r} is not under `artifacts:` in dvc.yaml "
                       f"(declared: {', '.join(declared) or 'none'})")
    return str(declared[name]["path"])


def download(repo: str, path: str, commit: str, out: Path, expected: str | None = None,
             md5: str | None = None) -> str:
    """`path` at `commit` of the DVC project `repo` (a folder or a git URL) into `out`, atomically;
    returns its sha256. The file is replaced only when its content changed, and never by bytes whose
    sha256 is not `expected` (when given: the caller refuses those) or whose md5 is not `md5` (when
    given: raises Mismatch)."""
    import dvc.api

    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.parent / f".{out.name}.tmp"
    sha256, served = hashlib.sha256(), hashlib.md5()  # both while copying: the model is read once
    with dvc.api.open(path, repo=repo, rev=commit, mode="rb") as src, open(temp, "wb") as dst:
        for block in iter(lambda: src.read(1 << 20), b""):
            dst.write(block)
            sha256.update(block)
            served.update(block)
    if md5 is not None and served.hexdigest() != md5:
        temp.unlink()
        raise Mismatch(f"the bytes served for {path} at commit {commit[:12]} have md5 {served.hexdigest()}, but that "
                       f"commit's dvc.lock records md5 {md5} ({out} was left as it was)")
    digest = sha256.hexdigest()
    if (out.exists() and file_sha256(out) == digest) or (expected is not None and digest != expected):
        temp.unlink()
    else:
        os.replace(temp, out)
    return digest


def committed_lock(repo: Path, commit: str, version: str | None) -> str:
    """The text of `commit`'s dvc.lock: what says which bytes were judged. Raises ModelUnchecked without one."""
    lock = git(repo, "show", f"{commit}:dvc.lock", check=False)
    if lock.returncode != 0:
        raise ModelUnchecked(f"{version}'s commit {commit[:12]} has no dvc.lock: nothing records which bytes were "
                             "judged, so none are served")
    return lock.stdout


def download_judged(repo: Path, found: dict[str, Any], path: str, out: Path) -> str:
    """The champion `found`'s `path` into `out` (`download`), only with the md5 its commit's dvc.lock
    records (read through the local DVC cache, else the default remote); returns its sha256. Raises
    ModelUnchecked when the record cannot be read, Mismatch when the bytes are others: `out` stays."""
    commit, version = found["commit"], found.get("version")
    lock = committed_lock(repo, commit, version)
    with project_stores(repo, commit) as stores:
        md5 = recorded_md5(lock, path, stores)
        objects = "; ".join(f"{name}: {odb.oid_to_path(md5)}" for name, odb in stores)
    try:
        return download(str(repo), path, commit, out, md5=md5)
    except Mismatch as exc:
        raise Mismatch(f"{exc}: the champion {version} is not the model that was judged. DVC reads it from the first "
                       f"of these that holds it: {objects}. Delete the copy whose md5 is not {md5} and fetch the "
                       "judged bytes again (`dvc fetch --all-tags`); a remote's wrong copy, deleted, needs `dvc push` "
                       "from a clone whose cache holds the judged bytes") from exc


def recorded_anchor(repo: Path, commit: str, verdict: str = VERDICT) -> dict[str, Any] | None:
    """The anchor the verdict committed at `commit` names for the weeks after it (`anchor_next`:
    `{"self": true}` or the anchor's commit, version, path and sha256), or None when the commit holds
    no verdict or the verdict names none. A verdict that cannot be read is an error."""
    shown = git(repo, "show", f"{commit}:{verdict}", check=False)
    if shown.returncode != 0:
        return None
    try:
        return json.loads(shown.stdout).get("anchor_next")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ProductionUnknown(f"{verdict} at commit {commit[:12]} is not a gate verdict ({exc}): the anchor of the "
                                "drift budget cannot be told; restore the file the gate wrote there") from exc


def fetch_anchor(repo: Path, found: dict[str, Any], path: str, digest: str, out: Path,
                 verdict: str = VERDICT) -> dict[str, Any]:
    """The anchor for the champion `found` (its artifact `path`, its sha256 `digest`): fetched into
    `out/anchor/best.pt` when it is another model, removed from there when it is the champion."""
    record = recorded_anchor(repo, found["commit"], verdict)
    folder = out / ANCHOR_DIR
    if record is None or record.get("self") or record.get("commit") == found["commit"]:
        shutil.rmtree(folder, ignore_errors=True)
        why = (f"the champion: its release's {verdict} records no anchor" if record is None
               else "the champion, shown within the margin of the anchor before it")
        return {"commit": found["commit"], "version": found.get("version"), "path": path, "sha256": digest,
                "same_as_champion": True, "why": why}
    got = download(str(repo), record["path"], record["commit"], folder / MODEL, expected=record.get("sha256"))
    if got != record.get("sha256"):
        raise ProductionUnknown(f"the anchor {record.get('version')} at commit {record['commit'][:12]} has other bytes "
                                f"({got[:12]}) than its verdict recorded ({str(record.get('sha256'))[:12]}): "
                                "`dvc pull` at that commit, or promote a model shown within the margin")
    return {**{k: record.get(k) for k in ("commit", "version", "path", "sha256")}, "same_as_champion": False,
            "why": f"{record.get('version')}, the last model shown within the margin of the anchor before it"}


def fetch_champion(repo: Path, cfg: ReleaseConfig, out: Path, verdict: str = VERDICT) -> dict[str, Any]:
    """Write the champion's best.pt and champion.json to `out`, or champion.json saying there is none
    (the returned dict then says, under `told`, when the remote was not needed, "" otherwise); with the
    champion, the drift budget's anchor (`fetch_anchor`). Raises production.ProductionUnknown when what
    is in production, or its anchor, cannot be told for sure, and remote.ModelUnchecked or Mismatch
    when its bytes cannot be shown to be those its commit's dvc.lock records (`download_judged`)."""
    found, told = lookup(repo, cfg.artifact, cfg.stage, cfg.remote)
    handover = {"renamed": dict(cfg.renamed), "across_recipes": cfg.warm_start_across_recipes}
    out.mkdir(parents=True, exist_ok=True)
    if found is None:
        (out / MODEL).unlink(missing_ok=True)
        shutil.rmtree(out / ANCHOR_DIR, ignore_errors=True)
        about: dict[str, Any] = {"artifact": cfg.artifact, "stage": cfg.stage, "version": None,
                                 "reason": f"no version of {cfg.artifact!r} is in {cfg.stage!r}, here or on the remote: "
                                           "the gate judges on the floors alone and training starts as `pretrained`",
                                 "warm_start": handover}
        _write_if_changed(out / CHAMPION_FILE, about)  # the same whether or not the remote answered today:
        return {**about, "told": told}  # a laptop going offline retrains nothing
    path = artifact_path(repo, cfg.artifact)
    digest = download_judged(repo, found, path, out / MODEL)
    anchor = fetch_anchor(repo, found, path, digest, out, verdict)
    about = {**found, "path": path, "sha256": digest, "warm_start": handover, "anchor": anchor}
    _write_if_changed(out / CHAMPION_FILE, about)
    return about


def _write_if_changed(path: Path, content: dict[str, Any]) -> None:
    if not path.exists() or json.loads(path.read_text()) != json.loads(json.dumps(content, default=str)):
        write_json(path, content)

"""The champion: the model assigned to a GTO stage (`release.stage`, prod), fetched at its commit.

GTO records versions and stage assignments as annotated git tags (`name@v0.2.0`, `name#prod#3`);
the newest assignment wins, so `gto assign` of an older version is a rollback. The model's bytes
come from DVC at the tagged commit (`dvc.api.open`: the local cache, else the DVC remote), so the
champion is exactly what was promoted, whatever the workspace holds. The output is rewritten only
when the champion changed: the stage reruns every time, and nothing downstream does.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from cnnpipe.files import CHAMPION_FILE, file_sha256, write_json

MODEL = "best.pt"


def artifact_path(repo: Path, name: str) -> str:
    """Where dvc.yaml's `artifacts:` puts model `name`."""
    declared = (yaml.safe_load((repo / "dvc.yaml").read_text()) or {}).get("artifacts") or {}
    if name not in declared:
        raise KeyError(f"release.artifact={name!r} is not under `artifacts:` in {repo / 'dvc.yaml'} "
                       f"(declared: {', '.join(declared) or 'none'})")
    return str(declared[name]["path"])


def in_stage(repo: Path, name: str, stage: str) -> dict[str, Any] | None:
    """The version of `name` last assigned to `stage` (version, commit, date, tag, message), or None:
    no git repository, no version registered, or none in that stage."""
    import gto.api  # here: a fresh clone without tags never needs it loaded
    from gto.exceptions import GTOException

    if not (repo / ".git").exists():
        return None
    try:
        versions = gto.api.show(str(repo), f"{name}#{stage}")  # newest assignment first: rollbacks count
    except GTOException:  # nothing registered under this name yet
        return None
    if not versions:
        return None
    version = versions[0]
    assignment = next(s for s in version["stages"] if s["stage"] == stage)["assignments"][-1]
    return {"artifact": name, "stage": stage, "version": version["version"], "commit": version["commit_hexsha"],
            "assigned_at": str(assignment["created_at"]), "tag": assignment["tag"],
            "message": assignment["message"]}


def fetch_champion(repo: Path, name: str, stage: str, out: Path) -> dict[str, Any]:
    """Write the champion's best.pt and champion.json to `out`, or champion.json saying there is none.
    Files are replaced only when their content changes."""
    found = in_stage(repo, name, stage)
    out.mkdir(parents=True, exist_ok=True)
    if found is None:
        (out / MODEL).unlink(missing_ok=True)
        about: dict[str, Any] = {"artifact": name, "stage": stage, "version": None,
                                 "reason": f"no version of {name!r} is assigned to {stage!r} yet: the gate judges "
                                           "on the floors alone and training starts as `pretrained`"}
        _write_if_changed(out / CHAMPION_FILE, about)
        return about
    import dvc.api

    path = artifact_path(repo, name)
    temp = out / f".{MODEL}.tmp"
    with dvc.api.open(path, repo=str(repo), rev=found["commit"], mode="rb") as src, open(temp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    digest = file_sha256(temp)
    if (out / MODEL).exists() and file_sha256(out / MODEL) == digest:
        temp.unlink()
    else:
        os.replace(temp, out / MODEL)
    about = {**found, "path": path, "sha256": digest}
    _write_if_changed(out / CHAMPION_FILE, about)
    return about


def _write_if_changed(path: Path, content: dict[str, Any]) -> None:
    if not path.exists() or json.loads(path.read_text()) != json.loads(json.dumps(content, default=str)):
        write_json(path, content)

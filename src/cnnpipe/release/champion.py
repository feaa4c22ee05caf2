"""The champion: the model assigned to a GTO stage (`release.stage`, prod), fetched at its commit.

Which version that is comes from `production.lookup`: the git remote's tags first (fetched when
this clone lacks them, refused when they disagree), then GTO's rules, so a rollback pushed from
another clone is what the next run fetches, and a clone without tags never mistakes itself for a
first week; a commit that records no promotion (`registry.json`) needs no reachable remote. The
model's bytes come from DVC at the tagged commit (`dvc.api.open`: the local cache, else the DVC
remote), so the champion is exactly what was promoted, whatever the workspace holds.
The output is rewritten only when its content changes: the stage reruns every time, and nothing
downstream does unless the champion (or the hand-over below) changed.

champion.json also carries the warm start's hand-over from the release params (`warm_start`:
`renamed` and `across_recipes`), so that training, which reads it, reruns when they change.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from cnnpipe.release_config import ReleaseConfig
from cnnpipe.files import CHAMPION_FILE, file_sha256, write_json
from cnnpipe.release.production import lookup

MODEL = "best.pt"


def artifact_path(repo: Path | None, name: str, dvc_yaml: str | None = None) -> str:
    """Where dvc.yaml's `artifacts:` puts model `name` (`dvc_yaml`: that file's text, else repo's)."""
    text = dvc_yaml if dvc_yaml is not None else (Path(repo) / "dvc.yaml").read_text()  # type: ignore[arg-type]
    declared = (yaml.safe_load(text) or {}).get("artifacts") or {}
    if name not in declared:
        raise KeyError(f"release.artifact={name!r} is not under `artifacts:` in dvc.yaml "
                       f"(declared: {', '.join(declared) or 'none'})")
    return str(declared[name]["path"])


def download(repo: str, path: str, commit: str, out: Path) -> str:
    """`path` at `commit` of the DVC project `repo` (a folder or a git URL) into `out`, atomically;
    returns its sha256. The file is replaced only when its content changed."""
    import dvc.api

    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.parent / f".{out.name}.tmp"
    with dvc.api.open(path, repo=repo, rev=commit, mode="rb") as src, open(temp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    digest = file_sha256(temp)
    if out.exists() and file_sha256(out) == digest:
        temp.unlink()
    else:
        os.replace(temp, out)
    return digest


def fetch_champion(repo: Path, cfg: ReleaseConfig, out: Path) -> dict[str, Any]:
    """Write the champion's best.pt and champion.json to `out`, or champion.json saying there is none
    (the returned dict then says, under `told`, when the remote was not needed, "" otherwise).
    Raises production.ProductionUnknown when what is in production cannot be told for sure."""
    found, told = lookup(repo, cfg.artifact, cfg.stage, cfg.remote)
    handover = {"renamed": dict(cfg.renamed), "across_recipes": cfg.warm_start_across_recipes}
    out.mkdir(parents=True, exist_ok=True)
    if found is None:
        (out / MODEL).unlink(missing_ok=True)
        about: dict[str, Any] = {"artifact": cfg.artifact, "stage": cfg.stage, "version": None,
                                 "reason": f"no version of {cfg.artifact!r} is in {cfg.stage!r}, here or on the remote: "
                                           "the gate judges on the floors alone and training starts as `pretrained`",
                                 "warm_start": handover}
        _write_if_changed(out / CHAMPION_FILE, about)  # the same whether or not the remote answered today:
        return {**about, "told": told}  # a laptop going offline retrains nothing
    path = artifact_path(repo, cfg.artifact)
    digest = download(str(repo), path, found["commit"], out / MODEL)
    about = {**found, "path": path, "sha256": digest, "warm_start": handover}
    _write_if_changed(out / CHAMPION_FILE, about)
    return about


def _write_if_changed(path: Path, content: dict[str, Any]) -> None:
    if not path.exists() or json.loads(path.read_text()) != json.loads(json.dumps(content, default=str)):
        write_json(path, content)

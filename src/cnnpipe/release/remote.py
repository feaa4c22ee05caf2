"""A commit's model as git recorded it: the md5 in that commit's `dvc.lock`, and the DVC remote that holds it.

`dvc.lock` records a stage output's md5; for a folder (`models/optimized`) that is the md5 of DVC's
`.dir` listing, which names each file's md5. The listing itself is read from the DVC remote and
checked against the recorded md5 before it is believed, so the md5 a served file is compared with
comes from git, never from the remote that served it. `dvc status --cloud` answers the same
existence question for a checked-out workspace; this answers it for any commit, from git alone
plus the remote, with DVC's own object store (`Repo.cloud.get_remote_odb`). A project's own checkout
(the champion stage) reads the listing where DVC itself does: its local cache (`Repo.cache.local`),
else its default remote (`project_stores`).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml


class ModelUnchecked(RuntimeError):
    """The model's bytes could not be checked against the record; the message says why and what to do."""


def locked_output(lock_text: str, path: str) -> tuple[str, str, str]:
    """The stage, output path and md5 `dvc.lock` (its text) records for the output holding `path` (the
    file itself or a folder above it). Raises ModelUnchecked when no output holds it."""
    stages = (yaml.safe_load(lock_text) or {}).get("stages") or {}
    for stage, entry in stages.items():
        for out in entry.get("outs") or []:
            where = str(out.get("path", "")).rstrip("/")
            if where and (path == where or path.startswith(where + "/")) and out.get("md5"):
                return stage, where, str(out["md5"])
    raise ModelUnchecked(f"dvc.lock records no output holding {path}: nothing says which bytes were judged")


Stores = Sequence[tuple[str, Any]]  # (how to name it, a DVC object store), in the order DVC reads them


def listing(dir_md5: str, stores: Stores) -> dict[str, str]:
    """relpath -> md5 of a folder output, from the `.dir` object of the first of `stores` holding it,
    refused unless its bytes have the md5 dvc.lock recorded."""
    for name, odb in stores:
        if odb.exists(dir_md5):
            where = odb.oid_to_path(dir_md5)
            raw = odb.fs.cat_file(where)
            if (got := hashlib.md5(raw).hexdigest()) != dir_md5.removesuffix(".dir"):
                raise ModelUnchecked(f"the folder listing {where} in {name} is not what dvc.lock recorded "
                                     f"(md5 {got}.dir, recorded {dir_md5})")
            return {entry["relpath"]: entry["md5"] for entry in json.loads(raw)}
    raise ModelUnchecked(f"{' and '.join(name for name, _ in stores)} lack{'s' if len(stores) == 1 else ''} "
                         f"the folder listing {dir_md5}: run `dvc push` where the model was promoted (its cache holds "
                         "it), then `dvc pull` here")


def recorded_md5(lock_text: str, path: str, stores: Stores) -> str:
    """The md5 `dvc.lock` (its text) records for the file `path`: its output's own, or for a folder
    output the file's entry in the folder's listing (read from `stores`, checked against dvc.lock)."""
    _, where, md5 = locked_output(lock_text, path)
    if not md5.endswith(".dir"):
        return md5
    inside = posixpath.relpath(path, where)
    files = listing(md5, stores)
    if inside not in files:
        raise ModelUnchecked(f"{where} as dvc.lock recorded it (md5 {md5}) holds no {inside}")
    return files[inside]


@contextmanager
def project_stores(repo: Path, rev: str) -> Iterator[list[tuple[str, Any]]]:
    """The object stores the DVC project at `repo` (a checkout), read at `rev`, serves from: its local
    cache, then its default remote when one is configured."""
    from dvc.config import NoRemoteError
    from dvc.repo import Repo

    with Repo(str(repo), rev=rev) as project:
        stores: list[tuple[str, Any]] = [(f"the local DVC cache ({project.cache.local.path})", project.cache.local)]
        try:
            odb = project.cloud.get_remote_odb()
        except NoRemoteError:
            pass  # the cache alone: what DVC itself would read
        else:
            stores.append((f"the DVC remote {project.config['core'].get('remote')!r} ({odb.path})", odb))
        yield stores


class Remote:
    """The DVC remote of the project at `repo` (a checkout, or a clone read at `rev`): its object store."""

    def __init__(self, repo: Path, rev: str | None = None) -> None:
        from dvc.config import NoRemoteError
        from dvc.repo import Repo

        self._repo = Repo(str(repo), rev=rev)
        try:
            self.odb = self._repo.cloud.get_remote_odb()
        except NoRemoteError as exc:
            self._repo.close()
            raise ModelUnchecked(f"no default DVC remote is configured{' at ' + rev[:12] if rev else ''}: nothing "
                                 "to check the model against. Add one and commit .dvc/config (`dvc remote add -d "
                                 "storage URL && git add .dvc/config && git commit`)") from exc
        self.name = self._repo.config["core"].get("remote")
        self.url = str((self._repo.config["remote"].get(self.name) or {}).get("url", self.odb.path))

    def __enter__(self) -> "Remote":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._repo.close()

    @property
    def stores(self) -> Stores:
        """This remote alone, as the object stores `listing` and `recorded_md5` read."""
        return [(f"the DVC remote {self.name!r} ({self.url})", self.odb)]

    def listing(self, dir_md5: str) -> dict[str, str]:
        """relpath -> md5 of a folder output, from the remote's `.dir` object (`listing`)."""
        return listing(dir_md5, self.stores)

    def recorded_md5(self, lock_text: str, path: str) -> str:
        """The md5 `dvc.lock` records for the file `path`, a folder's listing read from the remote (`recorded_md5`)."""
        return recorded_md5(lock_text, path, self.stores)

    def missing(self, lock_text: str, path: str) -> list[str]:
        """The files of the output holding `path` that the remote lacks (its folder listing too): [] when
        it holds every one."""
        _, where, md5 = locked_output(lock_text, path)
        if not md5.endswith(".dir"):
            return [] if self.odb.exists(md5) else [where]
        try:
            files = self.listing(md5)
        except ModelUnchecked as exc:
            return [f"{where} ({exc})"]
        return [posixpath.join(where, rel) for rel, oid in sorted(files.items()) if not self.odb.exists(oid)]

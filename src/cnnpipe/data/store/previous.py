"""What the last prepare left: its store and its split ledger, on disk or in the DVC cache.

`dvc repro` deletes a stage's outputs before running it (unless `persist`, which first copies every
linked file out of the cache: the whole store again). So prepare finds its previous outputs where
`dvc.lock` says they are: the cache objects of the recorded directories, which a hard-linked
checkout shares with the workspace. Kept shards are hard-linked from there into the new store, so
an update writes only its new bytes and the project holds the store once (`docs/data.md`). Run by
hand (no DVC, or a store already in place), the folder on disk is the previous one.

`PreviousStore` finds a previous store's images by content hash or by unchanged file stats, for
`ingest` to keep instead of decoding. A store of the same pixels in another encoding is used when it
is raw (its pixels are exact: a raw store becomes a JPEG one without reading the catalog), never when
it is JPEG (its pixels are lossy: those are decoded again from the catalog).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from cnnpipe.data.store.keys import digest_at
from cnnpipe.data.store.meta import STAT, read_stat_cache, split_keys
from cnnpipe.data.store.shards import FORMAT_VERSION, SPLITS, offsets_name

RECIPE_FILE = "recipe.json"
ENCODING_KEYS = ("encoding", "quality", "codec")
"""The keys of recipe.json that say how the pixels are stored (none for a raw store)."""
FAILED_FILE = "failed_files.jsonl"
"""Files whose decoding process died or ran out of time twice: with the same size and mtime (and the
same decoders), a later prepare lists them again without trying them a third time."""


class Tree:
    """The files of a folder an earlier prepare wrote, by relative path ("shards/000001-train.u8"):
    the folder itself, or the cache objects DVC recorded for it (`files`)."""

    def __init__(self, root: Path, files: dict[str, Path] | None = None, origin: str = "") -> None:
        self.root, self.files = Path(root), files
        self.origin = origin or str(root)

    def path(self, rel: str) -> Path | None:
        """The file holding `rel`, or None when the folder has none."""
        if self.files is not None:
            return self.files.get(rel)
        path = self.root / rel
        return path if path.is_file() else None

    def names(self, folder: str) -> list[str]:
        """Sorted names of the files directly under `folder` (a relative path)."""
        if self.files is not None:
            prefix = folder.rstrip("/") + "/"
            return sorted(rel[len(prefix):] for rel in self.files if rel.startswith(prefix) and "/" not in rel[len(prefix):])
        directory = self.root / folder
        return sorted(p.name for p in directory.iterdir() if p.is_file()) if directory.is_dir() else []

    def read_json(self, rel: str) -> Any:
        path = self.path(rel)
        return None if path is None else json.loads(path.read_text(encoding="utf-8"))


@dataclass
class Found:
    """An earlier output: where its files are (None: nowhere we can read), and what `dvc.lock` says
    of it ("" when it records none): the sign that a history exists even when the files are gone."""

    tree: Tree | None
    recorded: str = ""


def dvc_root(path: Path) -> Path | None:
    """The DVC project holding `path` (the nearest folder above it with a `.dvc/` folder), or None."""
    for folder in Path(os.path.abspath(path)).parents:
        if (folder / ".dvc").is_dir():
            return folder
    return None


def locked_stages(root: Path) -> dict[str, dict[str, Any]]:
    """Every stage `dvc.lock` records (its cmd, deps, params and outs), by name."""
    lock = root / "dvc.lock"
    if not lock.exists():
        return {}
    return (yaml.safe_load(lock.read_text(encoding="utf-8")) or {}).get("stages", {}) or {}


def locked_stage_of(root: Path, out_rel: str) -> dict[str, Any] | None:
    """The `dvc.lock` entry of the stage that writes `out_rel` (a project-relative path), or None."""
    return next((stage for stage in locked_stages(root).values()
                 if any(out.get("path") == out_rel for out in stage.get("outs", []))), None)


def _locked_outs(root: Path) -> dict[str, dict[str, Any]]:
    """Every output `dvc.lock` records, by path relative to the project."""
    return {out["path"]: out for stage in locked_stages(root).values() for out in stage.get("outs", [])
            if "path" in out}


def project_path(root: Path, path: Path) -> str:
    """`path` relative to the DVC project at `root`, as dvc.lock writes it."""
    return Path(os.path.relpath(os.path.abspath(path), root)).as_posix()


@functools.lru_cache(maxsize=4)
def _caches(root: Path) -> tuple[Any, Any]:
    """The project's DVC caches (its own and the pre-3.0 one), which map an md5 to its file."""
    from dvc.repo import Repo  # here: a second of imports, paid only when the workspace copy is gone

    with Repo(str(root)) as repo:
        return repo.cache.local, repo.cache.legacy


def cached_file(root: Path, out: dict[str, Any]) -> Path:
    """Where the DVC cache keeps the object of a file output `dvc.lock` records (it may be absent)."""
    local, legacy = _caches(root)
    return Path((local if out.get("hash") == "md5" else legacy).oid_to_path(out["md5"]))


def _cached_files(root: Path, out: dict[str, Any]) -> dict[str, Path] | None:
    """The cache objects of a directory output, by relative path; None unless every one is there."""
    local, legacy = _caches(root)
    odb = local if out.get("hash") == "md5" else legacy
    listing = Path(odb.oid_to_path(out["md5"]))
    if not listing.is_file():
        return None
    files = {entry["relpath"]: Path(odb.oid_to_path(entry["md5"]))
             for entry in json.loads(listing.read_text(encoding="utf-8"))}
    return files if all(p.is_file() for p in files.values()) else None


def find_previous(folder: Path) -> Found:
    """The last output written at `folder`: the folder itself when it is there, else the cache
    objects `dvc.lock` names for it (a `dvc repro` removed the folder), else nothing."""
    folder = Path(folder)
    if folder.is_dir() and any(folder.iterdir()):
        return Found(Tree(folder))
    root = dvc_root(folder)
    if root is None:
        return Found(None)
    rel = project_path(root, folder)
    out = _locked_outs(root).get(rel)
    if out is None or not str(out.get("md5", "")).endswith(".dir"):
        return Found(None)
    recorded = f"dvc.lock records {rel} (md5 {out['md5'][:12]}..., {out.get('nfiles', '?')} files)"
    files = _cached_files(root, out)
    return Found(Tree(folder, files, f"the DVC cache ({recorded})") if files is not None else None, recorded)


def put_back(found: Found, folder: Path) -> bool:
    """Lay the cache objects of a previous output (`found`, read from the DVC cache) out at `folder`
    again, as DVC's hard-linked checkout would: for a failed prepare, whose outputs `dvc repro`
    removed before it ran. Does nothing when the folder is there or the files are not cached.
    Returns whether it laid them out."""
    tree = found.tree
    if tree is None or tree.files is None or folder.exists():
        return False
    staging = folder.with_name(folder.name + ".back")
    shutil.rmtree(staging, ignore_errors=True)
    for rel, source in tree.files.items():
        target = staging / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target)  # the cache's own bytes, as the project's `cache.type` links them
        except OSError:
            os.symlink(source, target)  # another filesystem: `cache.type` falls back to symlinks too
    os.rename(staging, folder)  # whole or not at all
    return True


# --------------------------------------------------------------------------- the previous store's images
def read_frame(fd: int, row: int, shape: tuple[int, int, int]) -> np.ndarray:
    """Row `row` of a raw (rows, *shape) uint8 file, with one pread."""
    frame = shape[0] * shape[1] * shape[2]
    data = os.pread(fd, frame, row * frame)
    if len(data) != frame:
        raise OSError(f"short read: row {row} of a {frame}-byte-per-image file")
    return np.frombuffer(data, dtype=np.uint8).reshape(shape)


class PreviousStore:
    """The images of the store being replaced, found by content hash or by unchanged file stats, with
    the shard that holds each (a store of the one-file-per-split format before shards counts each
    split's file as one shard, to be copied from rather than kept).

    Lookups are sorted numpy arrays (~50 bytes an image), not dicts: at 10M images a dict of hashes
    alone would take gigabytes.

    `encoding`: the recipe keys of the store being written (`ENCODING_KEYS`; {} for raw). A previous
    store in the same encoding lends its shards (`same_encoding`); a raw one of the same pixels lends
    its pixels (`pixels`, to be encoded again); any other is not used.
    """

    def __init__(self, tree: Tree | None, wanted: dict[str, Any], encoding: dict[str, Any] | None = None) -> None:
        recipe_used = (tree.read_json(RECIPE_FILE) if tree else None) or {}
        stored = {k: v for k, v in recipe_used.items() if k in ENCODING_KEYS}
        pixels = {k: v for k, v in recipe_used.items() if k not in ENCODING_KEYS}
        usable = bool(recipe_used) and pixels == wanted and stored in ({}, encoding or {})
        index = (tree.read_json("index.json") or {}) if tree and usable else {}
        self.tree, self.index = tree, index
        self.same_encoding = stored == (encoding or {})
        self.sealed = index.get("format") == FORMAT_VERSION
        self.sidecars: list[Path | None] = []
        if self.sealed:
            self.names = [shard["name"] for shard in index["shards"]]
            self.files = [tree.path(f"shards/{name}") for name in self.names]
            if stored:
                self.sidecars = [tree.path(f"shards/{offsets_name(name)}") for name in self.names]
        else:
            self.names = [f"{split}.u8" for split in SPLITS]
            self.files = [tree.path(name) if tree else None for name in self.names]
        empty = (np.zeros(0, dtype="S32"), np.zeros(0, dtype=np.uint64))
        parts, wheres = [], []
        for code, split in enumerate(SPLITS):
            table = split_keys(tree.path, split) if index else None  # no JSON parsed since `meta.KEYS`
            parts.append((table["sha256"], table["stat"]) if table is not None else empty)
            count = len(parts[-1][0])
            rows = tree.path(f"{split}_rows.npy") if self.sealed and count else None
            wheres.append(np.load(rows) if rows else np.stack([np.full(count, code), np.arange(count)], axis=1))
        all_digests, all_keys = np.concatenate([d for d, _ in parts]), np.concatenate([k for _, k in parts])
        where = np.concatenate(wheres).reshape(-1, 2).astype(np.int32)
        order = np.argsort(all_digests, kind="stable")
        self.digests, self.where = all_digests[order], where[order]
        # Unchanged files by their stat: recorded in a store before segments, else in this machine's
        # stat cache (its entries for images this store holds: a cache left by another store is no use).
        cached = read_stat_cache(tree.root) if index else np.zeros(0, dtype=STAT)
        cached = cached[np.isin(cached["sha256"], self.digests)] if len(cached) else cached
        recorded = all_keys != 0
        all_keys = np.concatenate([all_keys[recorded], cached["stat"]])
        all_digests = np.concatenate([all_digests[recorded], cached["sha256"]])
        by_key = np.argsort(all_keys, kind="stable")
        self.keys, self.key_digests = all_keys[by_key], all_digests[by_key]
        self.shape = (wanted["size"], wanted["size"], wanted["channels"])
        # Serials only grow, also past a store whose shards are not used (a new encoding or size).
        self.next_serial = int(((tree.read_json("index.json") or {}) if tree else {}).get("next_serial", 0))
        failed = tree.path(FAILED_FILE) if index else None
        self._failed = {}
        if failed is not None:
            with open(failed, encoding="utf-8") as fh:
                self._failed = {item["key"]: item["reason"] for item in map(json.loads, fh)}
        self._fds: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.digests)

    def find(self, digest: bytes) -> tuple[int, int] | None:
        """(shard number, row) of the image with this sha256, or None."""
        i = int(np.searchsorted(self.digests, digest))
        if i < len(self.digests) and digest_at(self.digests, i) == digest:
            shard, row = self.where[i]
            return int(shard), int(row)
        return None

    def digest_of_unchanged(self, key: int) -> bytes | None:
        """The sha256 recorded for a file with this `stat_key`, or None."""
        i = int(np.searchsorted(self.keys, np.uint64(key)))
        return digest_at(self.key_digests, i) if i < len(self.keys) and self.keys[i] == key else None

    def failed(self, key: int) -> str | None:
        """Why a file with this `stat_key` could not be decoded twice before, or None."""
        return self._failed.get(key)

    @property
    def lends_shards(self) -> bool:
        """Whether kept images point at this store's shards (else their pixels are copied, `pixels`)."""
        return self.sealed and self.same_encoding

    def pixels(self, shard: int, row: int) -> np.ndarray:
        """One image of a raw store, read with pread: a memory map would count the whole old store in
        our RSS."""
        if shard not in self._fds:
            self._fds[shard] = os.open(self.files[shard], os.O_RDONLY)
        return read_frame(self._fds[shard], row, self.shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def write_prefixes(self, path: Path) -> Path | None:
        """The sorted 64-bit hash prefixes, for workers to skip decoding what will be copied."""
        if not len(self):
            return None
        prefixes = np.frombuffer(self.digests.tobytes(), dtype=">u8").reshape(-1, 4)[:, 0]
        np.save(path, np.unique(prefixes.astype(np.uint64)))
        return path

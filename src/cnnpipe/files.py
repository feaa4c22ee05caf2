"""Atomic writes (a crash, or a full disk, never leaves a half-written result file behind), and the
one way stages read the small YAML files earlier stages wrote."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import yaml

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}

CHAMPION_FILE = "champion.json"
"""What the champion stage writes beside the model in production: its version and commit (read by the
warm start and the gate)."""
ANCHOR_DIR = "anchor"
"""The champion stage's folder for the gate's drift anchor (its best.pt), when that is another model."""


class DiskFull(OSError):
    """A write ran out of disk space (or quota); the message names the file, the space and what survives."""


def _no_space_cause(exc: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT error behind `exc`, following its chain (torch.save re-raises the writer's
    OSError as a RuntimeError from its zip writer, `unexpected pos`)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _mb(n: float) -> str:
    return f"{n / 2**20:,.0f} MB" if n >= 2**20 else f"{n / 2**10:,.1f} KB"


@contextlib.contextmanager
def atomic_path(path: Path, needed_bytes: int | None = None, survives: str = "") -> Iterator[Path]:
    """A temp path beside `path` to write to; renamed over `path` on success, removed on any failure.

    A full disk becomes one `DiskFull` that names the file, the space it needs (`needed_bytes`, or at
    least what was written before the failure) and the space free, plus `survives` (what is intact).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as exc:
        written = tmp.stat().st_size if tmp.exists() else 0
        tmp.unlink(missing_ok=True)
        if _no_space_cause(exc) is None:
            raise
        free = shutil.disk_usage(path.parent).free
        needed = max(needed_bytes or 0, written)
        raise DiskFull(errno.ENOSPC, f"{path}: the disk is full (needs {'about' if needed_bytes else 'over'} "
                       f"{_mb(needed)}, {_mb(free)} free on {path.parent}); the partial file was removed. "
                       f"{survives}".rstrip()) from None


def write_text(path: Path, text: str) -> None:
    """Write to a temp file beside `path`, then rename over it."""
    data = text.encode("utf-8")
    survives = f"The previous {Path(path).name} is unchanged." if Path(path).exists() else ""
    with atomic_path(path, len(data), survives) as tmp:
        tmp.write_bytes(data)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Indented UTF-8 JSON, written atomically."""
    write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def read_yaml_mapping(path: Path | None, problem: str) -> dict[str, Any]:
    """A YAML mapping written by an earlier stage; empty when `path` is None or absent. Anything else
    than a mapping raises ValueError naming the file and `problem` (what was expected, how to fix it)."""
    if path is None or not Path(path).exists():
        return {}
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {problem}")
    return data


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, streamed."""
    return _file_digest(path, hashlib.sha256())


def file_md5(path: str | Path) -> str:
    """md5 of a file, streamed: the hash DVC records for an output (`hash: md5` in dvc.lock)."""
    return _file_digest(path, hashlib.md5())


def _file_digest(path: str | Path, digest: Any) -> str:
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()

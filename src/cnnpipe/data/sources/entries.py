"""A catalog's images as a listing: an `Entry` per image, kept as columns.

A listing has, per image, its path, class, the split the source gives it, its group and supplier,
and the size and modification time read from the directory scan (or one `stat` per manifest row), so
`prepare` can tell unchanged files without reading them. At millions of images, a tuple of Python
objects per image would cost twice the memory, so `Entries` keeps columns.
"""

from __future__ import annotations

import hashlib
import os
import re
from array import array
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import numpy as np

SPLIT_ALIASES = {"train": "train", "val": "val", "validation": "val", "valid": "val", "test": "test"}
_SPLIT_NAMES: tuple[str | None, ...] = ("train", "val", "test", None)  # codes 0..2, and 3: none given


class DataError(ValueError):
    """The input data cannot make a usable data set; the message says what to fix."""


class Entry(NamedTuple):
    """One image of the catalog: `path` relative to the listing's root, its class name, the split the
    source gives it (None: `prepare` assigns one), the file's size and mtime (ns), and its supplier
    (a manifest's `supplier` column; None when it has none)."""

    path: str
    label: str
    split: str | None
    size: int
    mtime_ns: int
    supplier: str | None = None


class _Codes:
    """Distinct strings, each stored once, and a code per image (4 bytes)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._code: dict[str, int] = {}
        self.codes = array("i")

    def append(self, name: str | None) -> None:
        if name is None:
            self.codes.append(-1)
            return
        code = self._code.setdefault(name, len(self.names))
        if code == len(self.names):
            self.names.append(name)
        self.codes.append(code)

    def __getitem__(self, i: int) -> str | None:
        code = self.codes[i]
        return self.names[code] if code >= 0 else None


class Entries(Sequence[Entry]):
    """A listing's images as columns: per image a path string and ~30 bytes of numbers (label, split
    and supplier codes, size, mtime, group key), ~100 bytes less than a tuple; `entries[i]` makes the
    `Entry`."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self._labels, self._suppliers = _Codes(), _Codes()
        # A group (a manifest's `group` column) is kept as the 32-byte `group_key` of its name, not as
        # a string in a dict: a catalog of millions of products would hold millions of them.
        self._group_keys, self._grouped = bytearray(), array("b")
        self._splits = array("b")
        self._sizes, self._mtimes = array("q"), array("q")

    @property
    def labels(self) -> list[str]:
        """The distinct class names, in order of first appearance."""
        return self._labels.names

    def append(self, path: str, label: str, split: str | None, size: int, mtime_ns: int,
               group: str | None = None, supplier: str | None = None) -> None:
        self._labels.append(label)
        self._suppliers.append(supplier)
        self._group_keys += group_key(group) if group else bytes(32)
        self._grouped.append(bool(group))
        self.paths.append(path)
        self._splits.append(_SPLIT_NAMES.index(split))
        self._sizes.append(size)
        self._mtimes.append(mtime_ns)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Entry:  # type: ignore[override]
        return Entry(self.paths[i], self._labels[i], _SPLIT_NAMES[self._splits[i]], self._sizes[i],
                     self._mtimes[i], self._suppliers[i])

    def __iter__(self) -> Iterator[Entry]:
        return (self[i] for i in range(len(self)))

    def label_indices(self, classes: Sequence[str]) -> np.ndarray:
        """Each image's class as its position in `classes` (which must hold every label)."""
        where = {name: i for i, name in enumerate(classes)}
        remap = np.array([where[name] for name in self.labels], dtype=np.int64)
        return remap[np.frombuffer(self._labels.codes, dtype=np.int32)]

    def split_names(self, default: str) -> np.ndarray:
        """Each image's given split (object array), `default` where the source gives none."""
        names = np.array([*_SPLIT_NAMES[:-1], default], dtype=object)
        return names[np.frombuffer(self._splits, dtype=np.int8)]

    def has_suppliers(self) -> bool:
        return bool(self._suppliers.names)

    def group_keys(self) -> np.ndarray:
        """Each image's `group_key` (S32), zeros where it has none."""
        return np.frombuffer(bytes(self._group_keys), dtype="S32")

    def group_by_name(self, pattern: str) -> int:
        """Give each image without a group the one `pattern` (a regex with one capture group) finds
        in its file name, with its class: `^([^_]+)_` puts sku123_front.jpg and sku123_back.jpg of one
        class in one group. Returns how many images it grouped."""
        rule, found = re.compile(pattern), 0
        for i, path in enumerate(self.paths):
            match = None if self._grouped[i] else rule.search(os.path.basename(path))
            if match and match.group(1):
                name = f"{self._labels[i]}\0{match.group(1)}"
                self._group_keys[32 * i : 32 * i + 32] = group_key(name)
                self._grouped[i] = 1
                found += 1
        return found

    def group_codes(self) -> np.ndarray:
        """Each image's group as a number shared by the group's photos (0, 1, ...); -1 where it has none."""
        grouped = np.frombuffer(self._grouped, dtype=np.int8).astype(bool)
        codes = np.full(len(self), -1, dtype=np.int64)
        codes[grouped] = np.unique(self.group_keys()[grouped], return_inverse=True)[1].reshape(-1)
        return codes

    def given_splits(self) -> set[str]:
        codes = np.unique(np.frombuffer(self._splits, dtype=np.int8))
        return {name for name in (_SPLIT_NAMES[c] for c in codes) if name is not None}

    def sort(self) -> None:
        """In place, by (split, class, path); images without a given split count as train."""
        order = np.array(sorted(range(len(self)), key=self.paths.__getitem__), dtype=np.int64)
        label_rank = np.argsort(np.argsort(np.array(self.labels, dtype=object)))
        split_rank = np.array([0, 1, 2, 0])[np.frombuffer(self._splits, dtype=np.int8)]
        major = split_rank * len(self.labels) + label_rank[np.frombuffer(self._labels.codes, dtype=np.int32)]
        order = order[np.argsort(major[order], kind="stable")].tolist()
        self.paths = [self.paths[i] for i in order]
        for column in (self._labels, self._suppliers):
            column.codes = array("i", (column.codes[i] for i in order))
        for name in ("_splits", "_grouped", "_sizes", "_mtimes"):
            column = getattr(self, name)
            setattr(self, name, array(column.typecode, (column[i] for i in order)))
        self._group_keys = bytearray(self.group_keys()[order].tobytes()) if len(self) else bytearray()


@dataclass
class Listing:
    """Every image of a source, in a fixed order (sorted by split, class, path), plus what was skipped:
    `ignored` files (not images), `refused` image files the listing cannot take ({"path", "reason"}:
    a name that is not UTF-8, a manifest row whose file is missing) and `skipped_folders` ({"path",
    "reason"}: a symlink loop, a folder beside train/, a second folder for one split). Paths in those
    lists are `printable`."""

    root: Path
    entries: Entries
    ignored: list[str] = field(default_factory=list)
    kind: str = "imagefolder"
    empty_classes: list[str] = field(default_factory=list)  # class folders without an image file
    refused: list[dict[str, str]] = field(default_factory=list)
    skipped_folders: list[dict[str, str]] = field(default_factory=list)

    @cached_property
    def given_splits(self) -> set[str]:
        """The splits the source names itself (split folders, or a manifest's split column)."""
        return self.entries.given_splits()


def group_key(name: str) -> bytes:
    """32 bytes fixed by a group's name: what its photos' split is drawn from, and how they are found."""
    return hashlib.sha256(b"group\0" + name.encode("utf-8", "surrogateescape")).digest()


def printable(path: str) -> str:
    """`path` as text any JSON file or terminal takes: bytes of a name that are not UTF-8 (which
    `os.fsdecode` keeps as lone surrogates) shown as \\xNN."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def is_utf8(path: str) -> bool:
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True

"""What a catalog holds: the image files of an ImageFolder tree or a CSV/TSV manifest, as a listing.

A listing has an `Entry` per image, with the size and modification time read from the directory
scan (or one `stat` per manifest row), so `prepare` can tell unchanged files without reading them.
The entries are kept as columns (`Entries`): at millions of images, a tuple of Python objects per
image would cost twice the memory.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import os
import re
from array import array
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from cnnpipe.data.decode import IMAGE_EXTENSIONS

SPLIT_ALIASES = {"train": "train", "val": "val", "validation": "val", "valid": "val", "test": "test"}
MANIFEST_SUFFIXES = {".csv": ",", ".tsv": "\t"}
MAX_LISTED_ERRORS = 20
_SPLIT_NAMES: tuple[str | None, ...] = ("train", "val", "test", None)  # codes 0..2, and 3: none given


class DataError(ValueError):
    """The input data cannot make a usable data set; the message says what to fix."""


class Entry(NamedTuple):
    """One image of the catalog: `path` relative to the listing's root, its class name, the split the
    source gives it (None: `prepare` assigns one), and the file's size and mtime (ns)."""

    path: str
    label: str
    split: str | None
    size: int
    mtime_ns: int


class Entries(Sequence[Entry]):
    """A listing's images as columns: per image a path string and 21 bytes of numbers (label and split
    codes, size, mtime), ~100 bytes less than a tuple; `entries[i]` makes the `Entry`."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.labels: list[str] = []  # the distinct class names, in order of first appearance
        self._label_code: dict[str, int] = {}
        # A group (a manifest's `group` column) is kept as the 32-byte `group_key` of its name, not as
        # a string in a dict: a catalog of millions of products would hold millions of them.
        self._group_keys, self._grouped = bytearray(), array("b")
        self._labels, self._splits = array("i"), array("b")
        self._sizes, self._mtimes = array("q"), array("q")

    def append(self, path: str, label: str, split: str | None, size: int, mtime_ns: int,
               group: str | None = None) -> None:
        code = self._label_code.setdefault(label, len(self.labels))
        if code == len(self.labels):
            self.labels.append(label)
        self._group_keys += group_key(group) if group else bytes(32)
        self._grouped.append(bool(group))
        self.paths.append(path)
        self._labels.append(code)
        self._splits.append(_SPLIT_NAMES.index(split))
        self._sizes.append(size)
        self._mtimes.append(mtime_ns)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Entry:  # type: ignore[override]
        return Entry(self.paths[i], self.labels[self._labels[i]], _SPLIT_NAMES[self._splits[i]],
                     self._sizes[i], self._mtimes[i])

    def __iter__(self) -> Iterator[Entry]:
        return (self[i] for i in range(len(self)))

    def label_indices(self, classes: Sequence[str]) -> np.ndarray:
        """Each image's class as its position in `classes` (which must hold every label)."""
        where = {name: i for i, name in enumerate(classes)}
        remap = np.array([where[name] for name in self.labels], dtype=np.int64)
        return remap[np.frombuffer(self._labels, dtype=np.int32)]

    def split_names(self, default: str) -> np.ndarray:
        """Each image's given split (object array), `default` where the source gives none."""
        names = np.array([*_SPLIT_NAMES[:-1], default], dtype=object)
        return names[np.frombuffer(self._splits, dtype=np.int8)]

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
                name = f"{self.labels[self._labels[i]]}\0{match.group(1)}"
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
        major = split_rank * len(self.labels) + label_rank[np.frombuffer(self._labels, dtype=np.int32)]
        order = order[np.argsort(major[order], kind="stable")].tolist()
        self.paths = [self.paths[i] for i in order]
        for name in ("_labels", "_splits", "_grouped", "_sizes", "_mtimes"):
            column = getattr(self, name)
            setattr(self, name, array(column.typecode, (column[i] for i in order)))
        self._group_keys = bytearray(self.group_keys()[order].tobytes()) if len(self) else bytearray()


@dataclass
class Listing:
    """Every image of a source, in a fixed order (sorted by split, class, path), plus what was skipped:
    `ignored` files (not images), `refused` image files the listing cannot take ({"path", "reason"}:
    a name that is not UTF-8) and `skipped_folders` ({"path", "reason"}: a symlink loop, a folder
    beside train/, a second folder for one split). Paths in those lists are `printable`."""

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


def list_source(source: str | Path, group_pattern: str | None = None) -> Listing:
    """The listing of an ImageFolder tree or of a `.csv`/`.tsv` manifest; `group_pattern` groups the
    photos the source leaves ungrouped by their file names (`Entries.group_by_name`)."""
    path = Path(source).expanduser()
    listing = read_manifest(path) if path.suffix.lower() in MANIFEST_SUFFIXES else list_folder(path)
    if group_pattern:
        listing.entries.group_by_name(group_pattern)
    return listing


# --------------------------------------------------------------------------- folders
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


def _file_id(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _walk(directory: str, root: Path, skipped: list[dict[str, str]],
          above: frozenset[tuple[int, int]]) -> Iterator[os.DirEntry]:
    """Files below `directory`, depth first in name order, skipping dot-files and dot-folders.
    Folder symlinks are followed, except one back to a folder `above` it (a loop, which would list
    every file dozens of times before the system's ELOOP): that one is skipped and reported."""
    def skip(path: str, reason: str) -> None:
        skipped.append({"path": printable(os.path.relpath(path, root)), "reason": reason})

    try:
        above = above | {_file_id(directory)}
        with os.scandir(directory) as it:
            children = sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError as exc:  # a folder we may not read (lost+found on a data volume)
        skip(directory, f"unreadable: {exc.strerror or exc}")
        return
    for child in children:
        try:
            is_dir = child.is_dir()
            loop = is_dir and _file_id(child.path) in above
        except OSError as exc:  # a symlink to itself: ELOOP
            skip(child.path, f"unreadable: {exc.strerror or exc}")
            continue
        if loop:
            skip(child.path, "a symlink to a folder above it (a loop): not followed")
        elif is_dir:
            yield from _walk(child.path, root, skipped, above)
        elif child.is_file():
            yield child


def _add_class(listing: Listing, class_dir: Path, label: str, split: str | None,
               above: frozenset[tuple[int, int]]) -> None:
    for item in _walk(str(class_dir), listing.root, listing.skipped_folders, above):
        rel = os.path.relpath(item.path, listing.root)
        if os.path.splitext(item.name)[1].lower() not in IMAGE_EXTENSIONS:
            listing.ignored.append(printable(rel))
        elif not is_utf8(rel):
            listing.refused.append({"path": printable(rel), "reason": "its name (or its folder's) is not valid "
                                    "UTF-8; rename it (e.g. `convmv -f latin1 -t utf8`)"})
        else:
            try:
                st = item.stat()
            except OSError as exc:  # gone since the folder was read
                listing.refused.append({"path": printable(rel), "reason": f"unreadable: {exc.strerror or exc}"})
                continue
            listing.entries.append(rel, label, split, st.st_size, st.st_mtime_ns)


def _split_folders(root: Path, subdirs: dict[str, Path], skipped: list[dict[str, str]]) -> dict[str | None, Path]:
    """The folders to read, by the split they give (None: prepare assigns one). With a train/ folder,
    the train/ val/ test/ folders (and their aliases); a second folder for one split (`val/` and
    `validation/`) and any other folder are skipped and reported, never read silently or dropped."""
    split_dirs: dict[str | None, Path] = {}
    for name, folder in subdirs.items():
        split = SPLIT_ALIASES.get(name.lower())
        if split is None:
            continue
        if split in split_dirs:
            skipped.append({"path": printable(name), "reason": f"a second {split} folder beside "
                            f"{split_dirs[split].name}/: not read; merge the two"})
        else:
            split_dirs[split] = folder
    if "train" not in split_dirs:
        return {None: root}
    skipped += [{"path": printable(name), "reason": "not a split folder, and the tree has train/: not read; move "
                 "its class folders into train/, val/ or test/"}
                for name in subdirs if name.lower() not in SPLIT_ALIASES]
    return split_dirs


def list_folder(root: Path) -> Listing:
    """Class folders under `root`, or under its train/ val/ test/ folders when it has a train/."""
    if not root.is_dir():
        raise DataError(f"data.source: {root} is neither a directory nor a .csv/.tsv manifest; give "
                        "`fashion-mnist`, an ImageFolder tree (one folder per class) or a manifest")
    listing = Listing(root, Entries())
    subdirs = {p.name: p for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".")}
    folders: set[str] = set()
    for split, directory in _split_folders(root, subdirs, listing.skipped_folders).items():
        refuse_flat_folder(directory)
        above = frozenset({_file_id(str(root)), _file_id(str(directory))})
        for class_dir in sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".")):
            folders.add(printable(class_dir.name))  # not UTF-8: its files are refused one by one
            _add_class(listing, class_dir, class_dir.name, split, above)
        listing.ignored += [printable(os.path.relpath(p, root)) for p in sorted(directory.iterdir())
                            if p.is_file() and not p.name.startswith(".")]
    listing.ignored.sort()
    listing.empty_classes = sorted(folders - set(listing.entries.labels))
    return listing


def refuse_flat_folder(directory: Path) -> None:
    """A folder of images with no class folders (ImageNet's val/, most catalog exports) would be
    read as an empty split: validation top-1 0 every epoch, best.pt stuck at the first epoch."""
    entries = [p for p in directory.iterdir() if not p.name.startswith(".")]
    if any(p.is_dir() for p in entries):
        return
    images = [p for p in entries if p.suffix.lower() in IMAGE_EXTENSIONS]
    if images:
        raise DataError(
            f"data.source: {directory} holds {len(images)} image file(s) but no class folders, so their "
            f"labels are unknown. Either move each image into a subfolder named after its class "
            f"({directory}/<class>/{images[0].name}), or list them in a manifest (a .csv with the columns "
            f"path,label[,split[,group]], paths relative to the manifest) and set data.source to that file")


# --------------------------------------------------------------------------- manifests
def _rows(path: Path, delimiter: str) -> Iterator[tuple[int, list[str]]]:
    """(line number, cells) of every non-blank row; a header row `path,label[,...]` is skipped."""
    number = 0
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            for number, row in enumerate(csv.reader(fh, delimiter=delimiter), start=1):
                cells = [c.strip() for c in row]
                if not any(cells):
                    continue
                if number == 1 and [c.lower() for c in cells[:2]] == ["path", "label"]:
                    continue
                yield number, cells
    except UnicodeDecodeError:
        raw = path.read_bytes()
        try:
            raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:  # the reader decodes in blocks: find the line from the bytes
            bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0  # not counted in exc.start
            number = raw.count(b"\n", 0, bom + exc.start) + 1
        raise DataError(f"data.source: manifest {path} is not UTF-8 text (at line {number}); save it as "
                        "UTF-8") from None


def _outside(rel: str) -> bool:
    """True for an absolute path or one that climbs out of the manifest's folder (`../`)."""
    return os.path.isabs(rel) or os.path.normpath(rel).split(os.sep, 1)[0] == os.pardir


def read_manifest(path: Path) -> Listing:
    """Rows `path,label[,split[,group]]` (comma for .csv, tab for .tsv; paths relative to the manifest).

    Every row is checked before anything is decoded; all problems are reported at once, each with
    its line and reason. An empty split cell leaves the row to `prepare`. A group (a product id,
    say) keeps every photo of that group in one split; an empty group cell is a group of one.
    """
    if not path.is_file():
        raise DataError(f"data.source: manifest {path} not found")
    root = path.parent
    entries = Entries()
    errors: list[str] = []
    seen: dict[str, int] = {}
    for number, cells in _rows(path, MANIFEST_SUFFIXES[path.suffix.lower()]):
        where = f"{path}:{number}"
        if len(cells) not in (2, 3, 4):
            errors.append(f"{where}: {len(cells)} columns; expected path,label[,split[,group]]")
            continue
        rel, label, split, group = (*cells, "", "")[:4]
        if not rel:
            errors.append(f"{where}: empty path")
            continue
        if not label:
            errors.append(f"{where}: {rel}: empty label")
            continue
        if _outside(rel):
            errors.append(f"{where}: {rel}: outside the manifest's folder {root}; give paths relative to it "
                          "and below it (DVC then tracks the images with the manifest and reruns prepare "
                          "when they change)")
            continue
        if split and split.lower() not in SPLIT_ALIASES:
            errors.append(f"{where}: {rel}: unknown split {split!r}; use train, val or test (or leave it empty)")
            continue
        if os.path.splitext(rel)[1].lower() not in IMAGE_EXTENSIONS:
            errors.append(f"{where}: {rel}: not an image file name ({', '.join(sorted(IMAGE_EXTENSIONS))})")
            continue
        if rel in seen:
            errors.append(f"{where}: {rel}: listed again (first at line {seen[rel]})")
            continue
        seen[rel] = number
        try:
            st = os.stat(root / rel)
        except OSError:
            errors.append(f"{where}: {rel}: file not found under {root}")
            continue
        entries.append(rel, label, SPLIT_ALIASES[split.lower()] if split else None, st.st_size, st.st_mtime_ns,
                       group=group or None)
    if errors:
        shown = "\n".join(f"  {e}" for e in errors[:MAX_LISTED_ERRORS])
        more = f"\n  ... and {len(errors) - MAX_LISTED_ERRORS} more" if len(errors) > MAX_LISTED_ERRORS else ""
        raise DataError(f"data.source: {len(errors)} bad row(s) in manifest {path}; fix them and rerun:\n{shown}{more}")
    if not entries:
        raise DataError(f"data.source: manifest {path} lists no images (rows: path,label[,split[,group]])")
    entries.sort()
    return Listing(root, entries, kind="manifest")

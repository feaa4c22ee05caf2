"""What a catalog holds: the image files of an ImageFolder tree or a CSV/TSV manifest, as a listing.

A folder tree is one folder per class, optionally under train/ val/ test/ folders; manifests are
`cnnpipe.data.sources.manifest`. Either way the listing (`entries.Listing`) has an `Entry` per image with
the size and modification time read from the directory scan, so `prepare` can tell unchanged files
without reading them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from cnnpipe.data.sources.entries import SPLIT_ALIASES, DataError, Entries, Listing, is_utf8, printable
from cnnpipe.data.sources.manifest import MANIFEST_SUFFIXES, read_manifest

# What a catalog counts as an image: the formats `ingest.decode` reads (HEIC/HEIF and AVIF where their
# codecs are installed; a file it cannot decode is listed, never dropped).
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".heic", ".heif",
                              ".avif"})


def is_hidden(path: Path, root: Path) -> bool:
    """A dot-file, or a file under a dot-folder below `root`: skipped by prepare and predict alike."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def list_source(source: str | Path, group_pattern: str | None = None) -> Listing:
    """The listing of an ImageFolder tree or of a `.csv`/`.tsv` manifest; `group_pattern` groups the
    photos the source leaves ungrouped by their file names (`Entries.group_by_name`)."""
    path = Path(source).expanduser()
    listing = read_manifest(path) if path.suffix.lower() in MANIFEST_SUFFIXES else list_folder(path)
    if group_pattern:
        listing.entries.group_by_name(group_pattern)
    return listing


# --------------------------------------------------------------------------- folders
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
    prefix = len(str(listing.root)) + 1  # every path below is root/...: slicing, not os.path.relpath (5x)
    for item in _walk(str(class_dir), listing.root, listing.skipped_folders, above):
        rel = item.path[prefix:]
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

"""A CSV/TSV manifest as a listing: rows `path,label[,split[,group[,supplier]]]`, or any columns named
by a header row.

Every row is checked before anything is decoded, and the manifest's own mistakes (an empty path or
label, an unknown split, a path outside its folder, a row listed twice, the wrong number of columns)
are reported all at once, each with its line. A row whose file is missing is the image's problem, not
the manifest's: it is listed with the other bad files and follows `data.on_bad_image`, as does a file
no decoder reads (a `.heic` without its plugin, a `.txt` by mistake).
"""

from __future__ import annotations

import codecs
import csv
import os
from pathlib import Path
from typing import Iterator

from cnnpipe.data.sources.entries import SPLIT_ALIASES, DataError, Entries, Listing

MANIFEST_SUFFIXES = {".csv": ",", ".tsv": "\t"}
MAX_LISTED_ERRORS = 20
COLUMNS = ("path", "label", "split", "group", "supplier")
"""The columns a manifest may have, in this order when it has no header row naming them."""


def _rows(path: Path, delimiter: str) -> Iterator[tuple[int, list[str]]]:
    """(line number, cells) of every non-blank row, the header row too."""
    number = 0
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            for number, row in enumerate(csv.reader(fh, delimiter=delimiter), start=1):
                cells = [c.strip() for c in row]
                if any(cells):
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


def _header(cells: list[str]) -> dict[str, int] | None:
    """The column of each known name when `cells` is a header row (it names `path` and `label`);
    other columns (a price, a title) are ignored."""
    names = [c.lower() for c in cells]
    if "path" not in names or "label" not in names:
        return None
    return {name: names.index(name) for name in COLUMNS if name in names}


def _outside(rel: str) -> bool:
    """True for an absolute path or one that climbs out of the manifest's folder (`../`)."""
    return os.path.isabs(rel) or os.path.normpath(rel).split(os.sep, 1)[0] == os.pardir


def read_manifest(path: Path) -> Listing:
    """The listing of a manifest (comma for .csv, tab for .tsv; paths relative to the manifest).

    An empty split cell leaves the row to `prepare`. A group (a product id, say) keeps every photo of
    that group in one split; an empty group cell is a group of one. A supplier is kept with each image
    in the store (`store.suppliers`).
    """
    if not path.is_file():
        raise DataError(f"data.source: manifest {path} not found")
    listing = Listing(path.parent, Entries(), kind="manifest")
    root, errors, seen = path.parent, [], {}
    columns: dict[str, int] | None = None
    width = len(COLUMNS)
    for number, cells in _rows(path, MANIFEST_SUFFIXES[path.suffix.lower()]):
        where = f"{path}:{number}"
        if columns is None:
            columns = _header(cells)
            if columns is not None:
                width = len(cells)
                continue
            columns, width = {}, len(COLUMNS)
        if columns and len(cells) > width:
            errors.append(f"{where}: {len(cells)} columns; the header row names {width}")
            continue
        if not columns and len(cells) not in range(2, len(COLUMNS) + 1):
            errors.append(f"{where}: {len(cells)} columns; expected path,label[,split[,group[,supplier]]] (or a "
                          "header row naming the columns)")
            continue
        cell = {name: cells[k] if k < len(cells) else "" for name, k in (columns or dict(zip(COLUMNS, range(5)))).items()}
        rel, label, split = cell["path"], cell["label"], cell.get("split", "")
        if not rel:
            errors.append(f"{where}: empty path")
        elif not label:
            errors.append(f"{where}: {rel}: empty label")
        elif _outside(rel):
            errors.append(f"{where}: {rel}: outside the manifest's folder {root}; give paths relative to it "
                          "and below it (DVC then tracks the images with the manifest and reruns prepare "
                          "when they change)")
        elif split and split.lower() not in SPLIT_ALIASES:
            errors.append(f"{where}: {rel}: unknown split {split!r}; use train, val or test (or leave it empty)")
        elif rel in seen:
            errors.append(f"{where}: {rel}: listed again (first at line {seen[rel]})")
        else:
            seen[rel] = number
            try:
                st = os.stat(root / rel)
            except OSError as exc:
                listing.refused.append({"path": rel, "reason": f"file not found under {root} (line {number}: "
                                        f"{exc.strerror or exc})"})
                continue
            listing.entries.append(rel, label, SPLIT_ALIASES[split.lower()] if split else None, st.st_size,
                                   st.st_mtime_ns, group=cell.get("group") or None, supplier=cell.get("supplier") or None)
    if errors:
        shown = "\n".join(f"  {e}" for e in errors[:MAX_LISTED_ERRORS])
        more = f"\n  ... and {len(errors) - MAX_LISTED_ERRORS} more" if len(errors) > MAX_LISTED_ERRORS else ""
        raise DataError(f"data.source: {len(errors)} bad row(s) in manifest {path}; fix them and rerun:\n{shown}{more}")
    if not listing.entries and not listing.refused:
        raise DataError(f"data.source: manifest {path} lists no images (rows: path,label[,split[,group[,supplier]]])")
    listing.entries.sort()
    return listing

"""Photos the delivery check holds out, for good: until their label changes or a person clears them.

The delivery stage lists the photos it flags (`data/delivery/flagged.csv`, a `held_out` column).
The next prepare records each held photo in the split ledger (the `HOLD` flag on its record, with
the label it was held under), so the hold outlives the week and any rerun: every store prepare
writes then marks them (`<split>_held.npy`), the delivery stage lists them each week, and training,
evaluation and the gate leave them out. A hold ends when the catalog files the photo under another
label (the fix), or when a person clears it: its sha256 in `data/delivery/cleared.csv`, a committed
file (`sha256,note`; `python -m cnnpipe.release.clear` writes it), which prepare and the delivery
check both read.

The store also carries, per image, what the ledger knows of its history (`mark_store`): the segment
its bytes first arrived in (`<split>_arrived.npy`, against the `generation` in index.json that a
trained model records) and whether its bytes were ever in a training split (`<split>_trained.npy`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from cnnpipe.data.sources.entries import DataError
from cnnpipe.data.splits.held_out import read_cleared as cleared_digests, sha256_column
from cnnpipe.data.store.keys import find_sorted
from cnnpipe.data.splits.ledger import HOLD, Ledger
from cnnpipe.data.splits.lineage import pull_advice
from cnnpipe.data.store.previous import cached_file, dvc_root, locked_stage_of, project_path
from cnnpipe.data.store.meta import in_folder, split_keys
from cnnpipe.data.store.shards import SPLITS
from cnnpipe.files import write_json


def read_cleared(path: Path | None) -> np.ndarray:
    """`held_out.read_cleared`, its complaint a DataError (what prepare reports)."""
    try:
        return cleared_digests(path)
    except ValueError as exc:
        raise DataError(str(exc)) from exc


LIST_COLUMNS = ["source", "sha256", "split", "given", "predicted", "confidence", "held_out", "status"]
"""The delivery list's columns (data/delivery/flagged.csv): the delivery stage writes it, prepare reads it.
`status`: flagged (by this check), held (by the ledger since an earlier week) or cleared (by a person)."""


def empty_list_md5() -> str:
    """The md5 of a delivery list with no rows (its header row alone, as csv writes it): what dvc.lock
    records for a check that listed no photo."""
    header = io.StringIO(newline="")
    csv.DictWriter(header, fieldnames=LIST_COLUMNS).writeheader()
    return hashlib.md5(header.getvalue().encode()).hexdigest()


def read_held_list(path: Path | None) -> dict[str, str]:
    """{hex sha256: the label it was held under} of the rows a delivery list holds out (none without one)."""
    if path is None or not Path(path).exists():
        return {}
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = {"sha256", "given", "held_out"} - set(reader.fieldnames or [])
        if missing:
            raise DataError(f"{path}: not a delivery list (no {', '.join(sorted(missing))} column): rerun "
                            "`dvc repro delivery`, or remove the file")
        rows = [(row["sha256"], row["given"], reader.line_num) for row in reader if row["held_out"] == "true"]
    try:
        sha256_column([r[0] for r in rows], Path(path), [r[2] for r in rows])  # each one checked
    except ValueError as exc:
        raise DataError(str(exc)) from exc
    return {r[0]: r[1] for r in rows}


def holds(records: np.ndarray, classes: Sequence[str], ledger: Ledger, listed: dict[str, str],
          cleared: np.ndarray) -> np.ndarray:
    """Which of `records` (labels into `classes`) stay held: the ledger holds them, or the last
    delivery list did, under the label they still have; and no person cleared them."""
    today = {name: k for k, name in enumerate(classes)}
    labels = records["label"].astype(np.int64)
    to_today = np.array([today.get(name, -1) for name in ledger.classes] + [-1], dtype=np.int64)  # -1 stays -1
    held_code = ledger.hold_label(records["digest"])
    held = (held_code >= 0) & (to_today[held_code] == labels)  # label codes: no object per image
    if listed:
        wanted = np.frombuffer(b"".join(bytes.fromhex(h) for h in listed), dtype="S32")
        for i in np.flatnonzero(among(records["digest"], wanted)).tolist():  # a delivery's flags: few
            held[i] |= today.get(listed[records["digest"][i : i + 1].tobytes().hex()], -1) == labels[i]
    return held & ~among(records["digest"], cleared)


def among(digests: np.ndarray, few: np.ndarray) -> np.ndarray:
    """Whether each of `digests` is one of the `few` (a binary search in them, not a sort of all)."""
    few = np.sort(few)
    return find_sorted(few, np.ones(len(few), dtype=np.int8), digests, missing=0).astype(bool)


def apply_holds(records: np.ndarray, held: np.ndarray) -> np.ndarray:
    """`records` with the HOLD flag set where `held`, cleared elsewhere (a copy)."""
    out = records.copy()
    out["flags"] = np.where(held, out["flags"] | HOLD, out["flags"] & ~np.uint8(HOLD)).astype(np.uint8)
    return out


def mark_store(store: Path, ledger: Ledger, held: np.ndarray, generation: int,
               renamed: dict[str, str] | None = None) -> dict[str, Any]:
    """Write each split's `<split>_arrived.npy` (int32: the ledger segment its bytes first arrived in
    under their label; this prepare's is `generation - 1`), `<split>_trained.npy` (bool: ever in a
    training split, this one too), `<split>_held.npy` (bool: its digest is among `held`) and
    `<split>_relabelled.npy` (bool: the ledger knew its bytes under another label), and `generation`
    (the ledger's segments) into index.json. A relabelled photo arrives again: the delivery check
    sees it as new, since a label is what a delivery brings; a class renamed on purpose (`renamed`,
    old name -> new: `release.renamed`) relabels nothing. Returns the counts for the data report."""
    counts: dict[str, Any] = {"generation": generation, "held": {}, "once_trained_on": {}, "relabelled": {}}
    index = json.loads((store / "index.json").read_text(encoding="utf-8"))
    classes = index["classes"]
    for split in SPLITS:
        keys = split_keys(in_folder(store), split)
        if keys is None:
            continue
        digests = keys["sha256"]
        arrived, trained = ledger.history(digests)
        relabelled = _relabelled(ledger, digests, np.load(store / f"{split}_labels.npy"), classes, renamed or {})
        arrived[(arrived < 0) | relabelled] = generation - 1
        trained |= split == "train"
        on_hold = among(digests, held)
        np.save(store / f"{split}_arrived.npy", arrived.astype(np.int32))
        np.save(store / f"{split}_trained.npy", trained)
        np.save(store / f"{split}_held.npy", on_hold)
        np.save(store / f"{split}_relabelled.npy", relabelled)
        counts["held"][split] = int(on_hold.sum())
        counts["relabelled"][split] = int(relabelled.sum())
        if split != "train":
            counts["once_trained_on"][split] = int(trained.sum())
    write_json(store / "index.json", {**index, "generation": generation})
    return counts


def _relabelled(ledger: Ledger, digests: np.ndarray, labels: np.ndarray, classes: Sequence[str],
                renamed: dict[str, str]) -> np.ndarray:
    """Which of `digests` (filed under `labels`, into `classes`) the ledger knew under another label
    than today's, a class renamed (`renamed`) counting as its new name."""
    before = ledger.label_by_content(digests)
    names = np.array([renamed.get(c, c) for c in ledger.classes] + [""], dtype=object)[before]  # -1 -> ""
    now = np.array(list(classes), dtype=object)[np.asarray(labels, dtype=np.int64)]
    return (before >= 0) & (names != now)


def last_list(path: Path | None, store: Path, recheck: bool = True) -> tuple[Path | None, str | None]:
    """The delivery list this prepare must honour (None: none), and why a recorded one is not read.

    A list belongs to the store its check ran on: the delivery stage's `dvc.lock` entry records the
    store it read (`store`, data/prepared). Prepare reads the list only when that is the store the last
    prepare wrote, the one this prepare replaces. A list checked against an older store was read by the
    prepare that replaced that store (its holds are in the ledger since); one checked against another
    catalog's store (the demo's list, in a clone that prepares the user's own photos) holds none of
    these photos. Neither is read, so neither blocks. Run by hand (no DVC, nothing recorded), the file
    at `path` is the list. A list that is this store's and cannot be read is refused: its holds would
    be lost (`recheck`: the refusal offers to check the store again, which the delivery stage is)."""
    if path is None:
        return None, None
    path = Path(path)
    root = dvc_root(path)
    if root is None:
        return (path if path.exists() else None), None
    rel, store_rel = project_path(root, path), project_path(root, store)
    checker, writer = locked_stage_of(root, rel), locked_stage_of(root, store_rel)
    if checker is None:
        return (path if path.exists() else None), None
    checked = next((d.get("md5") for d in checker.get("deps", []) if d.get("path") == store_rel), None)
    written = next((o.get("md5") for o in (writer or {}).get("outs", []) if o.get("path") == store_rel), None)
    if checked is not None and written is not None and checked != written:
        return None, (f"{rel} (as dvc.lock records it) was checked against another store than the one the last "
                      f"prepare wrote ({store_rel} md5 {str(checked)[:12]}..., not {str(written)[:12]}...): not read; "
                      "an earlier prepare recorded its holds in the split ledger, or it is another catalog's")
    if path.exists():
        return path, None
    out = next(o for o in checker["outs"] if o.get("path") == rel)
    if "md5" not in out or out["md5"] == empty_list_md5():  # (a list of no photo holds none: nothing to fetch)
        return None, None
    cached = cached_file(root, out)
    if cached.is_file():
        return cached, None
    fetch = pull_advice(root, rel)
    again = "; or check that store again, which is back in place (`dvc repro -s delivery`); then rerun prepare" \
        if recheck else ", then rerun"
    raise DataError(f"dvc.lock records the delivery list {rel} (md5 {out['md5'][:12]}...), the check of the store the "
                    f"last prepare wrote, but neither it nor its DVC cache object is here: the photos it holds out "
                    f"would be trained on. {fetch}{again}.")

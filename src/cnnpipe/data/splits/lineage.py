"""Which catalog a split ledger belongs to, and what to do when `dvc.lock` records one that is not here.

A ledger protects one catalog's held-out photos. A fresh clone lacks the ledger that `dvc.lock`
records (no DVC cache; often no DVC remote either): for that same catalog, drawing splits again
could put test photos in train, so prepare refuses; for another catalog (the clone's own photos
where the lock recorded the Fashion-MNIST demo) the recorded ledger says nothing about any photo,
so prepare starts a new one and says so.

"The same catalog" cannot mean the same bytes: a product catalog changes every week. It is told from
what is known without reading a photo: the source the lock recorded (`data.source`), and, where the
previous data report (git-tracked, checked against the md5 `dvc.lock` records for it) holds the
ledger's catalog identity, a bottom-k sketch of its files' path keys, so a catalog moved to a new
folder is still the same catalog (a few hundred keys whatever its size; listing the folder is all it
costs today). What cannot be told is treated as the same catalog: refused, never redrawn.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cnnpipe.data.store.previous import Found, dvc_root, locked_stage_of, project_path
from cnnpipe.files import file_md5

SKETCH_SIZE = 256
"""Path keys kept in a catalog's sketch: the smallest ones (a bottom-k sample, the same files whatever
order they were listed in); about 5 KB of JSON in the ledger's header and the data report."""
SAME_CATALOG_OVERLAP = 0.05
"""A catalog sharing at least this fraction of the smaller one's paths with the recorded one is the
same catalog (moved, grown, pruned): its ledger is required."""


def catalog_identity(kind: str, source: str, keys: np.ndarray | None) -> dict[str, Any]:
    """What a ledger records of the catalog it was drawn for: its kind and source, and for image files
    the number of files and a bottom-k sketch of their path keys (`keys.path_key`, as hex)."""
    identity: dict[str, Any] = {"kind": kind, "source": source}
    if keys is not None:
        keys = np.asarray(keys, dtype=np.uint64)  # one per file: a listing names each path once
        smallest = np.unique(np.partition(keys, SKETCH_SIZE - 1)[:SKETCH_SIZE] if len(keys) > SKETCH_SIZE else keys)
        identity.update(files=len(keys), sketch=[f"{int(k):016x}" for k in smallest])
    return identity


def path_overlap(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """Estimated share of the smaller catalog's paths that the other also has, from two sketches
    (the bottom-k estimate of the Jaccard index, scaled by the catalogs' sizes); None without both."""
    if not a.get("sketch") or not b.get("sketch") or not a.get("files") or not b.get("files"):
        return None
    sa, sb = {int(k, 16) for k in a["sketch"]}, {int(k, 16) for k in b["sketch"]}
    union = sorted(sa | sb)[:SKETCH_SIZE]
    jaccard = sum(1 for k in union if k in sa and k in sb) / len(union)
    both = jaccard * (a["files"] + b["files"]) / (1 + jaccard)  # |A∩B| from J = |A∩B| / |A∪B|
    return both / min(a["files"], b["files"])


@dataclass(frozen=True)
class Recorded:
    """What the project records of the last prepare, without its outputs: the catalog identity (None:
    not recorded), the reset names, and the project's root."""

    identity: dict[str, Any] | None
    resets: frozenset[str]
    root: Path


def recorded_catalog(folder: Path, report: Path) -> Recorded | None:
    """What `dvc.lock` recorded for the prepare that wrote `folder` (its `data.source`, its
    `data.split_reset`) and what that run's data report `report` says of the ledger (its catalog
    identity, every reset name), the report used only when its md5 is the one the lock records."""
    root = dvc_root(folder)
    if root is None:
        return None
    stage = locked_stage_of(root, project_path(root, folder)) or {}
    params = {k: v for values in (stage.get("params") or {}).values() for k, v in (values or {}).items()}
    resets = {params["data.split_reset"]} if params.get("data.split_reset") else set()
    identity = {"kind": _kind(str(params["data.source"])), "source": str(params["data.source"])} \
        if params.get("data.source") else None
    report_rel = project_path(root, report)
    locked = next((out for out in stage.get("outs", []) if out.get("path") == report_rel), None)
    if locked and Path(report).is_file() and locked.get("md5") == file_md5(Path(report)):
        ledger = (json.loads(Path(report).read_text(encoding="utf-8")) or {}).get("ledger") or {}
        resets |= set(ledger.get("resets") or [])
        if ledger.get("catalog") and (identity is None or ledger["catalog"].get("source") == identity["source"]):
            identity = ledger["catalog"]
    return Recorded(identity, frozenset(resets), root)


def _kind(source: str) -> str:
    """The kind of source a `data.source` value names, from the value alone."""
    if source == "fashion-mnist":
        return "fashion-mnist"
    return "manifest" if Path(source).suffix.lower() in (".csv", ".tsv") else "imagefolder"


def _same_source(a: str, b: str, root: Path) -> bool:
    """Whether two `data.source` values name one source: the same words, or the same path once
    normalised against the project (`./data/raw/x/` and an absolute path to it are one folder)."""
    if a == b:
        return True
    if "fashion-mnist" in (a, b):
        return False
    return os.path.realpath(root / os.path.expanduser(a)) == os.path.realpath(root / os.path.expanduser(b))


def another_catalog(recorded: Recorded | None, today: dict[str, Any]) -> str | None:
    """Why the recorded ledger belongs to another catalog than `today`'s (one line), or None when it
    is the same catalog or that cannot be told (then its ledger is required)."""
    if recorded is None or recorded.identity is None:
        return None
    was = recorded.identity
    if _same_source(str(was.get("source")), today["source"], recorded.root):
        return None
    overlap = path_overlap(was, today)
    if overlap is None and was.get("kind") != "fashion-mnist":
        return None  # no paths recorded to compare (a report before sketches): cannot be told, so refused
    if overlap is not None and overlap >= SAME_CATALOG_OVERLAP:
        return None  # the same files under another name: moved, not replaced
    shared = "" if overlap is None else f", ~{overlap:.0%} of its file paths shared"
    drawn_for = was["source"] if was.get("kind") == was["source"] else f"{was.get('kind')} {was['source']!r}"
    return f"the recorded split ledger was drawn for {drawn_for}, not {today['source']!r}{shared}"


def dvc_remotes(root: Path) -> tuple[list[str], str | None]:
    """The DVC remotes configured for the project (repo, local, global and system config) and the default."""
    from dvc.config import Config

    config = Config(dvc_dir=str(root / ".dvc"), validate=False)
    return sorted(config.get("remote", {})), config.get("core", {}).get("remote")


def pull_advice(root: Path | None, target: Path | str, aside: str = "") -> str:
    """How to fetch a recorded output `target` from where the user is: the DVC remote to add first when
    none is configured, the one to name when none is the default (`aside`: a last word in brackets)."""
    remotes, default = dvc_remotes(root) if root is not None else ([], None)
    if not remotes:
        return ("No DVC remote is configured here, so `dvc pull` has nowhere to fetch it from: add the one that "
                f"holds it (`dvc remote add -d storage URL`), then `dvc pull {target}`")
    if default is None:
        return (f"Fetch it first: `dvc pull -r {remotes[0]} {target}` (no default remote is set; configured: "
                f"{', '.join(remotes)})")
    return f"Fetch it first: `dvc pull {target}` (from DVC remote {default!r}{aside})"


def missing_history(found: Found, folder: Path, what: str, root: Path | None, leftover: str | None) -> str:
    """The refusal for a recorded `what` (the split ledger, a store) that cannot be read here, with advice
    that works where the user is (`pull_advice`)."""
    fetch = pull_advice(root, folder, "; the store is not needed")
    again = (f" (data.split_reset={leftover!r} is the name of a redraw already recorded: it redraws nothing)"
             if leftover else "")
    # No reset is offered: a new ledger would forget which photos were ever held out, trained on or held
    # by the delivery check, the memory this refusal exists to keep (docs/data.md: when no copy is left).
    return (f"{found.recorded}: the {what} of an earlier prepare of this catalog, but neither {folder} nor its DVC "
            "cache objects are here (a fresh clone, a new machine?). It remembers which photos were held out, once "
            "trained on and held by the delivery check; drawn again without it, held-out photos could land in train. "
            f"{fetch}, then rerun{again}.")

"""The prepare stage: ingest a labelled image set, split it, write the prepared store and the split ledger.

Every run writes the new store and ledger beside the old ones and swaps them in (`swap`), reading the
previous ones where the last run left them: on disk, or in the DVC cache where `dvc.lock` records
them (`previous`). Image files keep the ledger's splits (`sticky`); Fashion-MNIST's are its published
test split and a content draw of validation, recorded in the ledger as they are.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

from cnnpipe.config import DataConfig
from cnnpipe.data.store import codec
from cnnpipe.data.sources import idx
from cnnpipe.data.sources.catalog import DataError, Listing, list_source
from cnnpipe.data.ingest.reading import Ingested, ingest, recipe, usable_cores
from cnnpipe.data.ingest.journal import Journal
from cnnpipe.data.splits.holds import apply_holds, holds, last_list, mark_store, read_cleared, read_held_list
from cnnpipe.data.store.keys import HexDigests, digest_at, path_keys
from cnnpipe.data.splits.ledger import RECORD, Ledger, records_from_store, write_ledger
from cnnpipe.data.splits.lineage import another_catalog, catalog_identity, missing_history, recorded_catalog
from cnnpipe.data.store.meta import STAT_FILE, stat_cache
from cnnpipe.data.store.previous import (ENCODING_KEYS, FAILED_FILE, RECIPE_FILE, Found, PreviousStore, Tree,
                                         find_previous, put_back)
from cnnpipe.data.report import leakage, listed, mark_new, split_changes, split_codes
from cnnpipe.data.splits.draw import content_split
from cnnpipe.data.splits.sticky import Assigned, assign_splits, split_rule, stable_cap
from cnnpipe.data.store.shards import SPLITS
from cnnpipe.data.store.swap import recover, staged, swap_in
from cnnpipe.data.store.writer import StoreWriter, first_serial, rows_per_shard, shard_bytes
from cnnpipe.files import write_json

__all__ = ["DataError", "prepare", "prepare_fashion_mnist"]

SPLIT_RULE_FILE = "split_rule.json"


# --------------------------------------------------------------------------- Fashion-MNIST
def _resize_batch(images: np.ndarray, size: int) -> np.ndarray:
    """(N, H, W) uint8 → (N, size, size, 1) uint8 with antialiased bilinear resizing."""
    import torch  # here, not at the top: image-file catalogs need no torch (a lean main process)
    import torch.nn.functional as F

    if images.shape[1] == size and images.shape[2] == size:
        return images[..., None].copy()
    out = np.empty((len(images), size, size, 1), dtype=np.uint8)
    for start in range(0, len(images), 4096):
        chunk = torch.from_numpy(np.ascontiguousarray(images[start : start + 4096])).float()[:, None]
        resized = F.interpolate(chunk, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        out[start : start + 4096] = resized.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return out


def store_encoding(cfg: DataConfig, channels: int) -> dict[str, Any]:
    """The recipe keys of the store's encoding (`previous.ENCODING_KEYS`): {} for raw, the JPEG's
    quality and codec otherwise; `auto` resolved by `codec.auto_encoding` from the geometry alone."""
    if codec.resolve_encoding(cfg.encoding, cfg.stored_size, channels) == "raw":
        return {}
    return dict(zip(ENCODING_KEYS, ("jpeg", cfg.quality, codec.CODEC)))


def _writer(cfg: DataConfig, out_dir: Path, channels: int, serial: int = 0) -> StoreWriter:
    encoding = store_encoding(cfg, channels)
    return StoreWriter(out_dir, cfg.stored_size, channels, cfg.shard_mb, serial,
                       encoding.get("encoding", "raw"), cfg.quality)


def _sha256_rows(images: np.ndarray) -> np.ndarray:
    """The sha256 of each image's raw bytes, as an S32 array: what splits and leakage are keyed on."""
    return np.frombuffer(b"".join(hashlib.sha256(image.tobytes()).digest() for image in images), dtype="S32")


def prepare_fashion_mnist(cfg: DataConfig, seed: int, out_dir: Path,
                          search_dirs: tuple[Path, ...] = idx.SEARCH_DIRS) -> dict[str, Any]:
    """Fashion-MNIST → train/val (`content_split` of the 60k) and the official 10k test."""
    raw_dir = idx.locate(search_dirs)
    train_x, train_y = idx.load_split(raw_dir, "train")
    test_x, test_y = idx.load_split(raw_dir, "test")
    train_hashes, test_hashes = _sha256_rows(train_x), _sha256_rows(test_x)
    names = content_split(HexDigests(train_hashes), train_y, [("val", cfg.val_fraction)], seed)
    keep, val = np.flatnonzero(names == "train"), np.flatnonzero(names == "val")
    keep = keep[stable_cap(train_y[keep], train_hashes[keep], cfg.max_train_images, seed)]
    val = val[stable_cap(train_y[val], train_hashes[val], cfg.max_eval_images, seed)]
    test = stable_cap(test_y, test_hashes, cfg.max_eval_images, seed)
    parts = {
        "train": (train_x, train_y, train_hashes, keep, "train-images-idx3-ubyte"),
        "val": (train_x, train_y, train_hashes, val, "train-images-idx3-ubyte"),
        "test": (test_x, test_y, test_hashes, test, "t10k-images-idx3-ubyte"),
    }
    writer = _writer(cfg, out_dir, 1)
    sources: list[str] = []
    for split, (images, labels, hashes, positions, file_name) in parts.items():
        positions = positions[np.argsort(hashes[positions], kind="stable")]  # shards in content order
        resized = _resize_batch(images[positions], cfg.stored_size)
        for image, pos, label in zip(resized, positions, labels[positions]):
            sources.append(f"{file_name}#{pos}")
            writer.add(split, image, int(label), digest_at(hashes, pos), {"source": sources[-1],
                                                                          "sha256": digest_at(hashes, pos).hex()})
        parts[split] = (images, labels, hashes, positions, file_name)
    written = np.concatenate([hashes[positions] for _, _, hashes, positions, _ in parts.values()])
    codes = split_codes([len(positions) for _, _, _, positions, _ in parts.values()])
    index = writer.close(list(idx.CLASSES), f"fashion-mnist:{raw_dir}", carved=["val"])
    return {
        "source": "fashion-mnist",
        "raw_dir": str(raw_dir),
        "splits": {s: v["count"] for s, v in index["splits"].items()},
        "classes": list(idx.CLASSES),
        "bad_files": [],
        "num_bad": 0,
        "leakage": leakage(written, codes, sources.__getitem__),
    }


# --------------------------------------------------------------------------- ImageFolder trees, manifests
def _write_splits(writer: StoreWriter, splits: dict[str, np.ndarray], listing: Listing, got: Ingested,
                  labels: np.ndarray, journal: Journal, old: PreviousStore) -> tuple[int, int]:
    """Each split's images into `writer`, in content order, all by reference to a shard but those of
    a store before shards or in another encoding (copied, and encoded): decoded ones to their journal
    segment (a JPEG store's journal holds records), the previous store's to theirs. In place,
    `splits` takes that order. Returns (kept, copied)."""
    kept = copied = 0
    segments: dict[Path, tuple[str, Path | None]] = {}  # journal segment -> its shard name (and offsets)
    for split in SPLITS:
        members = splits[split] = splits[split][np.argsort(got.digests[splits[split]], kind="stable")]
        for i in members:
            entry, digest, row = listing.entries[i], digest_at(got.digests, i), int(got.rows[i])
            meta = {"source": entry.path, "sha256": digest.hex(), "size": entry.size, "mtime_ns": entry.mtime_ns}
            if entry.supplier is not None:
                meta["supplier"] = entry.supplier
            if row >= 0:  # decoded by this run: its journal segment becomes a shard as it is
                segment, segment_row = journal.frame_of(row)
                if segment not in segments:
                    segments[segment] = (writer.fresh_name(), journal.sidecar(row >> 32) if journal.encoded else None)
                name, sidecar = segments[segment]
                writer.keep(split, name, segment, segment_row, int(labels[i]), digest, meta,
                            fresh=journal.size_of(row), sidecar=sidecar)
            elif old.lends_shards:  # a shard of the previous store holds it: point at it, read nothing
                shard, shard_row = old.find(digest)
                writer.keep(split, old.names[shard], old.files[shard], shard_row, int(labels[i]), digest, meta,
                            sidecar=old.sidecars[shard] if old.sidecars else None)
                kept += 1
            else:
                writer.add(split, old.pixels(*old.find(digest)), int(labels[i]), digest, meta)
                copied += 1
    return kept, copied


def _bad_files(listing: Listing, got: Ingested, cfg: DataConfig) -> list[dict[str, str]]:
    """Every file that could not be used, with its reason; the stage stops here under `on_bad_image: fail`."""
    bad = [{"path": listing.entries[i].path, "split": listing.entries[i].split or "assigned by prepare",
            "reason": r} for i, r in sorted(got.reasons.items())]
    bad += [{**refused, "split": "not listed"} for refused in listing.refused]
    if bad and cfg.on_bad_image == "fail":
        shown = "\n".join(f"  {b['path']}: {b['reason']}" for b in bad[:50])
        raise DataError(f"{len(bad)} unusable image(s) under {listing.root} and data.on_bad_image=fail:\n{shown}\n"
                        "Fix or remove them, or set data.on_bad_image: skip to list them and go on.")
    return bad


def prepare_catalog(cfg: DataConfig, seed: int, out_dir: Path, previous: Tree | None, ledger: Ledger,
                    work: Path, listing: Listing) -> tuple[dict[str, Any], Assigned, list[str], list[str], bool]:
    """Ingest an ImageFolder tree or a manifest (`listing`) into `out_dir`, keeping what `previous` already holds
    and resuming what an interrupted run left in `work`; splits as the ledger says (`sticky`). Broken
    files are skipped and listed (or fail the stage). Returns the report, the assignment, the classes
    and whether the splits were reset."""
    if listing.refused and cfg.on_bad_image == "fail":  # before any decoding
        _bad_files(listing, Ingested(np.zeros(0, "S32"), np.zeros(0, np.int64), {}), cfg)
    root = listing.root
    all_classes = sorted(listing.entries.labels)
    wanted, encoding = recipe(cfg.stored_size, cfg.max_pixels), store_encoding(cfg, 3)
    journal = Journal(work, wanted, rows_per_shard(cfg.shard_mb, cfg.stored_size**2 * 3), encoding,
                      shard_bytes(cfg.shard_mb))  # raw pixels, or a JPEG store's records
    old = PreviousStore(previous, wanted, encoding)
    workers = usable_cores() if cfg.prepare_workers == "auto" else int(cfg.prepare_workers)
    try:
        progress = partial(tqdm, desc="prepare", unit="img", disable=None, mininterval=2.0)
        got = ingest(root, listing.entries, workers, cfg.stored_size, cfg.max_pixels, old, journal,
                     cfg.decode_timeout_s, progress)
        all_labels = listing.entries.label_indices(all_classes)
        usable = np.ones(len(listing.entries), dtype=bool)
        usable[list(got.reasons)] = False
        bad = _bad_files(listing, got, cfg)
        present = np.bincount(all_labels[usable], minlength=len(all_classes))
        classes = [c for c, n in zip(all_classes, present) if n]
        if len(classes) < 2:
            raise DataError(f"data.source: {root} has {len(classes)} class(es) with usable images "
                            f"({', '.join(classes) or 'none'}); need at least two (one folder, or label, per class)")
        labels = (np.cumsum(present > 0) - 1)[all_labels]  # drop classes without a usable image, keep the order
        reset = cfg.split_reset is not None and cfg.split_reset not in ledger.resets
        assigned = assign_splits(listing, labels, usable, got.digests, cfg, seed, ledger, classes, reset)
        caps = {"train": cfg.max_train_images, "val": cfg.max_eval_images, "test": cfg.max_eval_images}
        splits = {}
        for split, cap in caps.items():
            members = np.flatnonzero(assigned.names == split)
            splits[split] = members[stable_cap(labels[members], got.digests[members], cap, seed)]
        writer = _writer(cfg, out_dir, 3, first_serial(old.names if old.sealed else [], old.next_serial))
        if previous is not None:
            writer.lend_meta(previous.path)  # its meta lines kept where unchanged (`meta`)
        try:
            kept, copied = _write_splits(writer, splits, listing, got, labels, journal, old)
        except BaseException:
            writer.abort()
            raise
        written = np.concatenate([splits[s] for s in SPLITS])
        codes = split_codes([len(splits[s]) for s in SPLITS])
        leaks = leakage(got.digests[written], codes, lambda j: listing.entries[written[j]].path)
        index = writer.close(classes, f"{listing.kind}:{cfg.source}",
                             carved=[s for s in ("val", "test") if s not in listing.given_splits])
    finally:
        journal.close()
        old.close()
    no_train = [classes[i] for i, n in enumerate(index["splits"]["train"]["class_counts"]) if n == 0]
    if len(classes) - len(no_train) < 2:
        raise DataError(f"data.source: {root}: fewer than two classes have a usable training image "
                        f"(without any: {', '.join(no_train)}); see metrics/data_report.json")
    (out_dir / RECIPE_FILE).write_text(json.dumps({**wanted, **encoding}))
    np.save(work / STAT_FILE, writer.stat_table())
    if got.failed:
        (out_dir / FAILED_FILE).write_text("".join(json.dumps({"key": k, "reason": r}) + "\n" for k, r in got.failed))
    report = {
        "source": str(cfg.source),
        "predefined_splits": bool(listing.given_splits),
        "splits": {s: v["count"] for s, v in index["splits"].items()},
        "classes": classes,
        "empty_classes": sorted(set(listing.empty_classes) | (set(all_classes) - set(classes))),
        "classes_without_train_images": no_train,
        **listed(out_dir, bad, listing.ignored),
        "skipped_folders": listing.skipped_folders,
        "leakage": leaks,
        **assigned.report,
        "work": {"listed": len(listing.entries), "decoded": got.counts["decoded"], "kept": kept, "copied": copied,
                 "read": got.counts["read"], "unchanged_not_read": got.counts["unchanged"],
                 "resumed": got.counts["resumed"], "workers": workers},
    }
    return report, assigned, [listing.entries.paths[i] for i in assigned.members], classes, reset


# --------------------------------------------------------------------------- the split ledger
def _missing(cfg: DataConfig, found: Found, folder: Path, what: str, report: Path,
             today: Callable[[], dict[str, Any]]) -> str | None:
    """A recorded `what` that cannot be read: the line saying a new ledger starts (it was another
    catalog's, `lineage`), None for a reset named knowingly; refused otherwise, a leftover reset name too."""
    recorded = recorded_catalog(folder, report)
    why = another_catalog(recorded, today())
    if why is not None:
        return f"{why}: a new split ledger starts for this catalog"
    resets = recorded.resets if recorded is not None else frozenset()
    if cfg.split_reset is not None and cfg.split_reset not in resets:
        return None
    raise DataError(missing_history(found, folder, what, recorded.root if recorded else None,
                                    cfg.split_reset if cfg.split_reset in resets else None))


def open_ledger(cfg: DataConfig, ledger: Found, store: Found, folder: Path, report: Path,
                today: Callable[[], dict[str, Any]]) -> tuple[Ledger, np.ndarray, list[str], list[str], str | None]:
    """The ledger prepare draws splits from, the records to seed a new one with, and the line that says a
    new one starts: the ledger on disk or in the DVC cache; else, for a project whose store predates
    ledgers, what that store holds. A history that exists (dvc.lock records it) but cannot be read is
    refused, never redrawn, unless it was drawn for another catalog than `today()`'s (`lineage`: asked
    only then, as it hashes every listed path)."""
    empty = np.zeros(0, dtype=RECORD)
    if ledger.tree is not None:
        return Ledger.read(ledger.tree), empty, [], [], None
    if ledger.recorded:
        return Ledger(), empty, [], [], _missing(cfg, ledger, folder, "split ledger", report, today)
    if cfg.split_reset is not None:
        return Ledger(), empty, [], [], None
    if store.tree is not None and store.tree.path("index.json") is not None:
        classes: list[str] = []
        records, paths = records_from_store(store.tree, classes)
        return Ledger.from_records(records, classes), records, paths, classes, None
    if store.recorded:
        note = _missing(cfg, store, folder, "prepared store (whose splits seed the split ledger)", report, today)
        return Ledger(), empty, [], [], note
    return Ledger(), empty, [], [], None


def _ledger_update(ledger: Ledger, records: np.ndarray, paths: list[str], reset: bool) -> tuple[np.ndarray, list[str]]:
    """What to append: every record after a reset, else those the ledger does not hold as they are."""
    if reset:
        return records, paths
    fresh = ~ledger.unchanged(records)
    return records[fresh], [p for p, f in zip(paths, fresh) if f]


# --------------------------------------------------------------------------- entry point
def prepare(cfg: DataConfig, seed: int, out_dir: Path, report_path: Path, ledger_dir: Path | None = None,
            held_out: Path | None = None, cleared: Path | None = None,
            renamed: dict[str, str] | None = None, clock: Callable[[], float] | None = None) -> dict[str, Any]:
    """Write the prepared data set to `out_dir`, its split ledger to `ledger_dir` (default: beside
    it, `<out_dir>_ledger`) and the data report to `report_path`. The photos the last delivery list
    `held_out` holds out, and those the ledger already holds, stay held under their label unless
    cleared in `cleared` (`data.splits.holds`). A photo whose label changed (other than by a class
    `renamed` on purpose, old -> new) is marked so, and new to the delivery check. `clock`: the
    seconds the stage has taken so far, recorded as the report's `stage_time_s` (the plan counts it).

    The new store and ledger are written beside the old ones (`<name>.new`) and swapped in by renames
    (`swap`), so no file of the old store is ever rewritten: a trainer that has it memory-mapped (a
    shared filesystem, a hardlinked DVC cache) keeps reading the old version, and a failed prepare
    leaves the old ones as they were. Images are kept from the old store when they can be, and
    decoded ones are journalled in `<out_dir>.work` until the swap, so a killed run resumes.
    """
    out_dir, report_path = Path(out_dir), Path(report_path)
    ledger_dir = Path(ledger_dir) if ledger_dir is not None else out_dir.with_name(out_dir.name + "_ledger")
    recovered = recover([out_dir, ledger_dir])
    new_store, new_ledger = staged(out_dir), staged(ledger_dir)
    work = out_dir.with_name(out_dir.name + ".work")
    store, ledger_found = find_previous(out_dir), find_previous(ledger_dir)
    rule = split_rule(seed, cfg.val_fraction, cfg.test_fraction)
    started, skipped_list = None, None
    try:
        # The last list's holds belong to the ledger found: without one (a new catalog, a first run) none apply.
        listed: dict[str, str] = {}
        if ledger_found.tree is not None:
            found_list, skipped_list = last_list(held_out, out_dir)
            listed = read_held_list(found_list)
        cleared_digests = read_cleared(cleared)
        new_store.mkdir(parents=True)
        if cfg.source == "fashion-mnist":
            report = prepare_fashion_mnist(cfg, seed, new_store)
            ledger, classes, reset = Ledger.read(ledger_found.tree), list(report["classes"]), False
            identity = catalog_identity("fashion-mnist", "fashion-mnist", None)
            seed_records, seed_paths = np.zeros(0, dtype=RECORD), []
            records, paths = records_from_store(Tree(new_store), classes, given=frozenset({"test"}))
        else:
            listing = list_source(cfg.source, cfg.group_pattern)  # file stats only: no photo is read
            today = partial(catalog_identity, listing.kind, str(cfg.source))  # of path keys
            ledger, seed_records, seed_paths, classes, started = open_ledger(
                cfg, ledger_found, store, ledger_dir, report_path, lambda: today(path_keys(listing.entries.paths)))
            report, assigned, paths, current, reset = prepare_catalog(cfg, seed, new_store, store.tree, ledger, work,
                                                                      listing)
            records = assigned.records.copy()
            identity = today(records["path"])  # the keys sticky computed: the placed images' paths
            remap = np.array([classes.index(c) if c in classes else classes.append(c) or len(classes) - 1
                              for c in current], dtype=np.uint32)
            records["label"] = remap[records["label"]] if len(records) else records["label"]
            (new_store / SPLIT_RULE_FILE).write_text(json.dumps(rule))
        held = holds(records, classes, ledger, listed, cleared_digests)
        records = apply_holds(records, held)
        fresh, fresh_paths = _ledger_update(ledger, records, paths, reset)
        header = {"rule": rule, "reset": cfg.split_reset if reset else None, "source": str(cfg.source),
                  "catalog": identity}
        done = write_ledger(new_ledger, ledger_found.tree, np.concatenate([seed_records, fresh]),
                            seed_paths + fresh_paths, classes, header)
        report["ledger"] = {**report.get("ledger", {}), **done, "reset": header["reset"], "started": started,
                            "resets": ledger.resets + ([header["reset"]] if reset else []), "catalog": identity,
                            "rule_changed": ledger.rule is not None and ledger.rule != rule,
                            "read_from": ledger_found.tree.origin if ledger_found.tree else None}
        report["holds"] = mark_store(new_store, ledger, records["digest"][held], done["segments"], renamed)
    except BaseException:
        shutil.rmtree(new_store, ignore_errors=True)
        shutil.rmtree(new_ledger, ignore_errors=True)
        # A refusal loses nothing: the store and ledger `dvc repro` removed go back where they were.
        put_back(store, out_dir)
        put_back(ledger_found, ledger_dir)
        raise
    if skipped_list:
        report["holds"]["list_not_read"] = skipped_list
    report["changes"] = split_changes(store.tree, new_store)
    report["new_images"] = mark_new(store.tree, new_store)
    if recovered:
        report["recovered"] = recovered
    swap_in([(new_store, out_dir), (new_ledger, ledger_dir)])
    if (work / STAT_FILE).exists():  # this machine's stat cache of the store now in place (`meta`)
        os.replace(work / STAT_FILE, stat_cache(out_dir))
    shutil.rmtree(work, ignore_errors=True)
    if clock is not None:
        report["stage_time_s"] = round(clock(), 1)
    write_json(report_path, report)
    return report

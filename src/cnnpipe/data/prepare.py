"""The prepare stage: ingest a labelled image set, split it, write the prepared format."""

from __future__ import annotations

import hashlib
import json
import shutil
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

from cnnpipe.config import DataConfig
from cnnpipe.data import idx
from cnnpipe.data.catalog import DataError, Listing, list_source
from cnnpipe.data.ingest import (
    RECIPE_FILE,
    HexDigests,
    Journal,
    PreviousStore,
    digest_at,
    ingest,
    read_store_meta,
    recipe,
    usable_cores,
)
from cnnpipe.data.split import content_split
from cnnpipe.data.sticky import (
    SPLIT_RULE_FILE,
    PreviousSplits,
    colocate,
    keep_previous,
    label_conflicts,
    split_keys,
    split_rule,
    stable_cap,
)
from cnnpipe.data.store import SPLITS
from cnnpipe.data.writer import StoreWriter
from cnnpipe.files import write_json

__all__ = ["DataError", "prepare", "prepare_fashion_mnist", "split_changes"]

LISTED = 100
"""Files listed by name in the data report, per list (all are counted; the rest are in the store)."""


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
    writer = StoreWriter(out_dir, cfg.stored_size, 1, cfg.shard_mb)
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
    codes = _split_codes([len(positions) for _, _, _, positions, _ in parts.values()])
    index = writer.close(list(idx.CLASSES), f"fashion-mnist:{raw_dir}", carved=["val"])
    return {
        "source": "fashion-mnist",
        "raw_dir": str(raw_dir),
        "splits": {s: v["count"] for s, v in index["splits"].items()},
        "classes": list(idx.CLASSES),
        "bad_files": [],
        "num_bad": 0,
        "leakage": _leakage(written, codes, sources.__getitem__),
    }


# --------------------------------------------------------------------------- ImageFolder trees, manifests
def _assign_splits(listing: Listing, labels: np.ndarray, usable: np.ndarray, digests: np.ndarray,
                   cfg: DataConfig, seed: int, previous: PreviousSplits,
                   classes: list[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Positions per split, and what the data report says of them: the source's own splits kept,
    missing ones carved out by content (`content_split`: a new photo never moves an old one), then
    made sticky and kept together (`sticky`: what the previous store held keeps its split, re-encodes
    too; copies and groups go to the most held-out split of any member); unusable images take no part.

    Only images without a given split are carved: a manifest row marked `train` stays in train. A
    source that marks every image (a tree with train/ but no test/, a manifest without blank split
    cells) has its missing splits carved out of its train images instead."""
    given = listing.entries.split_names(default="")
    names = np.where(given == "", "train", given).astype(object)
    carved = [(s, f) for s, f in (("test", cfg.test_fraction), ("val", cfg.val_fraction))
              if s not in listing.given_splits]
    # The images whose split `prepare` assigns: the unmarked ones, or, in a source that marks all,
    # its train images when a split is missing (nothing else moves a split the source gives).
    unmarked = given == ""
    pool = np.flatnonzero(usable & (unmarked if unmarked.any() else (given == "train") & bool(carved)))
    groups = listing.entries.group_codes()
    report: dict[str, Any] = {"label_conflicts": [], "num_label_conflicts": 0}
    if len(pool):
        paths = listing.entries.paths
        if carved:
            keys = split_keys(digests, groups, listing.entries.group_keys())
            names[pool] = content_split(HexDigests(keys[pool]), labels[pool], carved, seed)
        report["kept_from_previous_store"] = {**keep_previous(names, pool, digests, paths, previous),
                                              "split_rule_changed": not previous.same_rule}
        movable = np.zeros(len(names), dtype=bool)
        movable[pool] = True
        members = np.flatnonzero(usable)
        report["moved_to_join_a_copy_or_group"] = colocate(names, members, movable, digests, groups)
        report["label_conflicts"], report["num_label_conflicts"] = label_conflicts(
            names, members, digests, labels, paths, classes)
        report["groups"] = {"groups": int(groups.max(initial=-1)) + 1,
                            "photos_in_groups": int(np.sum(groups[members] >= 0))}
    caps = {"train": cfg.max_train_images, "val": cfg.max_eval_images, "test": cfg.max_eval_images}
    splits = {}
    for split, cap in caps.items():
        members = np.flatnonzero(usable & (names == split))
        splits[split] = members[stable_cap(labels[members], digests[members], cap, seed)]
    return splits, report


def _split_codes(lengths: list[int]) -> np.ndarray:
    """The split code (position in SPLITS) of every item of splits of these lengths, in SPLITS order."""
    return np.repeat(np.arange(len(SPLITS), dtype=np.int8), lengths)


def _leakage(digests: np.ndarray, codes: np.ndarray, source: Callable[[int], str]) -> list[dict[str, Any]]:
    """Byte-identical items found in more than one split, by sorting their hashes (40 bytes an item;
    a dict of hex strings would take ~200). `digests` (S32) and `codes` (into SPLITS) are in the
    order the store was written, so each split names its first copy; `source(j)` names item j."""
    order = np.argsort(digests, kind="stable")
    ordered = digests[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], len(order)]
    found = []
    for a, b in zip(starts[ends - starts > 1], ends[ends - starts > 1]):
        first: dict[str, int] = {}
        for j in order[a:b]:
            first.setdefault(SPLITS[codes[j]], int(j))
        if len(first) > 1:
            names = sorted(first)
            found.append({"sha256": digest_at(ordered, int(a)).hex(), "splits": names,
                          "sources": [source(first[n]) for n in names]})
    return found


def _listed(out_dir: Path, bad: list[dict[str, str]], ignored: list[str]) -> dict[str, Any]:
    """The data report's file lists, the first `LISTED` of each with their counts: the report is
    git-tracked, and a catalog of millions can hold thousands of them. The whole lists go to
    `skipped_files.jsonl` in the store, which DVC tracks."""
    if len(bad) > LISTED or len(ignored) > LISTED:
        with open(out_dir / "skipped_files.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(b, ensure_ascii=False) + "\n" for b in bad)
            fh.writelines(json.dumps({"path": path, "reason": "not an image file"}, ensure_ascii=False) + "\n"
                          for path in ignored)
    return {"ignored_files": ignored[:LISTED], "num_ignored": len(ignored), "bad_files": bad[:LISTED],
            "num_bad": len(bad)}


def _write_splits(writer: StoreWriter, splits: dict[str, np.ndarray], listing: Listing, got: Any,
                  labels: np.ndarray, journal: Journal, old: PreviousStore) -> tuple[int, int]:
    """Each split's images into `writer`, in content order: decoded ones from the journal, the
    previous store's by reference to their shard (or copied, from a store before shards). In place,
    `splits` takes that order. Returns (kept, copied)."""
    kept = copied = 0
    for split in SPLITS:
        members = splits[split] = splits[split][np.argsort(got.digests[splits[split]], kind="stable")]
        for i in members:
            entry, digest, row = listing.entries[i], digest_at(got.digests, i), int(got.rows[i])
            meta = {"source": entry.path, "sha256": digest.hex(), "size": entry.size, "mtime_ns": entry.mtime_ns}
            if row >= 0:
                writer.add(split, journal.pixels(row), int(labels[i]), digest, meta)
            elif old.sealed:  # a shard of the previous store holds it: point at it, read nothing
                writer.keep(split, *old.find(digest), int(labels[i]), digest, meta)
                kept += 1
            else:
                writer.add(split, old.pixels(*old.find(digest)), int(labels[i]), digest, meta)
                copied += 1
    return kept, copied


def prepare_catalog(cfg: DataConfig, seed: int, out_dir: Path, previous: Path, work: Path) -> dict[str, Any]:
    """Ingest an ImageFolder tree or a manifest into `out_dir`, copying what `previous` already holds
    and resuming what an interrupted run left in `work`. Broken files are skipped and listed (or
    fail the stage)."""
    listing = list_source(cfg.source, cfg.group_pattern)
    root = listing.root
    all_classes = sorted(listing.entries.labels)
    wanted = recipe(cfg.stored_size, cfg.max_pixels)
    journal, old = Journal(work, wanted), PreviousStore(previous, wanted)
    workers = usable_cores() if cfg.prepare_workers == "auto" else int(cfg.prepare_workers)
    try:
        progress = partial(tqdm, desc="prepare", unit="img", disable=None, mininterval=2.0)
        got = ingest(root, listing.entries, workers, cfg.stored_size, cfg.max_pixels, old, journal, progress)
        all_labels = listing.entries.label_indices(all_classes)
        usable = np.ones(len(listing.entries), dtype=bool)
        usable[list(got.reasons)] = False
        bad = [{"path": listing.entries[i].path, "split": listing.entries[i].split or "assigned by prepare",
                "reason": r} for i, r in sorted(got.reasons.items())]
        bad += [{**refused, "split": "not listed"} for refused in listing.refused]
        if bad and cfg.on_bad_image == "fail":
            shown = "\n".join(f"  {b['path']}: {b['reason']}" for b in bad[:50])
            raise DataError(f"{len(bad)} unusable image(s) under {root} and data.on_bad_image=fail:\n{shown}\n"
                            "Fix or remove them, or set data.on_bad_image: skip to list them and go on.")
        present = np.bincount(all_labels[usable], minlength=len(all_classes))
        classes = [c for c, n in zip(all_classes, present) if n]
        if len(classes) < 2:
            raise DataError(f"data.source: {root} has {len(classes)} class(es) with usable images "
                            f"({', '.join(classes) or 'none'}); need at least two (one folder, or label, per class)")
        relabel = np.cumsum(present > 0) - 1  # drop classes without a usable image, keep the order
        labels = relabel[all_labels]
        rule = split_rule(seed, cfg.val_fraction, cfg.test_fraction)
        splits, split_report = _assign_splits(listing, labels, usable, got.digests, cfg, seed,
                                              PreviousSplits(previous, rule), classes)
        writer = StoreWriter(out_dir, cfg.stored_size, 3, cfg.shard_mb, previous if old.sealed else None)
        try:
            kept, copied = _write_splits(writer, splits, listing, got, labels, journal, old)
        except BaseException:
            writer.abort()
            raise
        written = np.concatenate([splits[s] for s in SPLITS])
        codes = _split_codes([len(splits[s]) for s in SPLITS])
        leakage = _leakage(got.digests[written], codes, lambda j: listing.entries[written[j]].path)
        index = writer.close(classes, f"{listing.kind}:{cfg.source}",
                             carved=[s for s in ("val", "test") if s not in listing.given_splits])
    finally:
        journal.close()
        old.close()
    no_train = [classes[i] for i, n in enumerate(index["splits"]["train"]["class_counts"]) if n == 0]
    if len(classes) - len(no_train) < 2:
        raise DataError(f"data.source: {root}: fewer than two classes have a usable training image "
                        f"(without any: {', '.join(no_train)}); see metrics/data_report.json")
    (out_dir / RECIPE_FILE).write_text(json.dumps(wanted))
    (out_dir / SPLIT_RULE_FILE).write_text(json.dumps(rule))
    return {
        "source": str(cfg.source),
        "predefined_splits": bool(listing.given_splits),
        "splits": {s: v["count"] for s, v in index["splits"].items()},
        "classes": classes,
        "empty_classes": sorted(set(listing.empty_classes) | (set(all_classes) - set(classes))),
        "classes_without_train_images": no_train,
        **_listed(out_dir, bad, listing.ignored),
        "skipped_folders": listing.skipped_folders,
        "leakage": leakage,
        **split_report,
        "work": {"listed": len(listing.entries), "decoded": got.counts["decoded"], "kept": kept, "copied": copied,
                 "read": got.counts["read"], "unchanged_not_read": got.counts["unchanged"],
                 "resumed": got.counts["resumed"], "workers": workers},
    }


# --------------------------------------------------------------------------- entry point
def _members(store: Path) -> list[np.ndarray] | None:
    """Per split (in SPLITS order), the sorted distinct content hashes (S32) of a prepared store;
    None when there is no store."""
    metas = [store / f"{split}_meta.jsonl" for split in SPLITS]
    if not any(meta.exists() for meta in metas):
        return None
    return [np.unique(read_store_meta(meta, with_keys=False)[0]) if meta.exists() else np.zeros(0, dtype="S32")
            for meta in metas]


def split_changes(previous: Path, current: Path) -> dict[str, Any] | None:
    """Images each split gained and lost against the previous store, and how many images present in
    both changed split (0 unless the seed, the fractions or the caps changed); None without one.
    Sorted hash arrays throughout: 32 bytes an image, at any catalog size."""
    before = _members(previous)
    if before is None:
        return None
    after = _members(current) or [np.zeros(0, dtype="S32")] * len(SPLITS)
    # Where each old hash was; one in several splits (leakage) counts as in the last of them.
    table, codes = np.concatenate(before), _split_codes([len(d) for d in before])
    order = np.argsort(table, kind="stable")
    table, codes = table[order], codes[order]
    last = np.r_[table[1:] != table[:-1], True][: len(table)]
    table, codes = table[last], codes[last]
    moved = 0
    for code, digests in enumerate(after if len(table) else []):
        i = np.minimum(np.searchsorted(table, digests), len(table) - 1)
        moved += int(np.sum((table[i] == digests) & (codes[i] != code)))
    return {"splits": {s: {"gained": len(np.setdiff1d(after[k], before[k], assume_unique=True)),
                           "lost": len(np.setdiff1d(before[k], after[k], assume_unique=True))}
                       for k, s in enumerate(SPLITS)},
            "moved_between_splits": moved}


def prepare(cfg: DataConfig, seed: int, out_dir: Path, report_path: Path) -> dict[str, Any]:
    """Write the prepared data set to `out_dir` and the data report to `report_path`.

    The new store is written beside the old one (`<out_dir>.new`) and swapped in by renames, so no
    file of the old store is ever rewritten: a trainer that has it memory-mapped (a shared
    filesystem, a hardlinked DVC cache) keeps reading the old version, and a failed prepare leaves
    the old store as it was. Images are copied from the old store when they can be, and decoded
    ones are journalled in `<out_dir>.work` until the swap, so a killed run resumes (`ingest`).
    """
    out_dir, report_path = Path(out_dir), Path(report_path)
    new, old = (out_dir.with_name(out_dir.name + suffix) for suffix in (".new", ".old"))
    work = out_dir.with_name(out_dir.name + ".work")
    for leftover in (new, old):
        if leftover.exists():
            shutil.rmtree(leftover)
    new.mkdir(parents=True)
    try:
        if cfg.source == "fashion-mnist":
            report = prepare_fashion_mnist(cfg, seed, new)
        else:
            report = prepare_catalog(cfg, seed, new, previous=out_dir, work=work)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    report["changes"] = split_changes(out_dir, new)
    if out_dir.exists():
        out_dir.rename(old)
    new.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)  # unlinks only: open maps of the old files stay valid
    shutil.rmtree(work, ignore_errors=True)
    write_json(report_path, report)
    return report

"""The prepare stage: ingest a labelled image set, split it, write the prepared format."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import shutil
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from cnnpipe.config import DataConfig
from cnnpipe.data import idx
from cnnpipe.data.decode import IMAGE_EXTENSIONS, Decoded, decode_file, is_hidden
from cnnpipe.data.split import balanced_positions, content_split
from cnnpipe.data.store import SPLITS, SplitWriter, write_index
from cnnpipe.files import write_json

SPLIT_ALIASES = {"train": "train", "val": "val", "validation": "val", "valid": "val", "test": "test"}


class DataError(ValueError):
    """The input data cannot make a usable data set; the message says what to fix."""


# --------------------------------------------------------------------------- Fashion-MNIST
def _resize_batch(images: np.ndarray, size: int) -> np.ndarray:
    """(N, H, W) uint8 → (N, size, size, 1) uint8 with antialiased bilinear resizing."""
    if images.shape[1] == size and images.shape[2] == size:
        return images[..., None].copy()
    out = np.empty((len(images), size, size, 1), dtype=np.uint8)
    for start in range(0, len(images), 4096):
        chunk = torch.from_numpy(np.ascontiguousarray(images[start : start + 4096])).float()[:, None]
        resized = F.interpolate(chunk, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        out[start : start + 4096] = resized.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return out


def prepare_fashion_mnist(cfg: DataConfig, seed: int, out_dir: Path,
                          search_dirs: tuple[Path, ...] = idx.SEARCH_DIRS) -> dict[str, Any]:
    """Fashion-MNIST → train/val (`content_split` of the 60k) and the official 10k test."""
    raw_dir = idx.locate(search_dirs)
    train_x, train_y = idx.load_split(raw_dir, "train")
    test_x, test_y = idx.load_split(raw_dir, "test")
    digests = [hashlib.sha256(image.tobytes()).hexdigest() for image in train_x]
    names = content_split(digests, train_y, [("val", cfg.val_fraction)], seed)
    keep, val = np.flatnonzero(names == "train"), np.flatnonzero(names == "val")
    keep = keep[balanced_positions(train_y[keep], cfg.max_train_images, seed)]
    val = val[balanced_positions(train_y[val], cfg.max_eval_images, seed)]
    test = balanced_positions(test_y, cfg.max_eval_images, seed)
    parts = {
        "train": (train_x, train_y, keep, "train-images-idx3-ubyte"),
        "val": (train_x, train_y, val, "train-images-idx3-ubyte"),
        "test": (test_x, test_y, test, "t10k-images-idx3-ubyte"),
    }
    counts: dict[str, list[int]] = {}
    hashes: dict[str, dict[str, str]] = {}
    for split, (images, labels, positions, file_name) in parts.items():
        writer = SplitWriter(out_dir, split, cfg.stored_size, channels=1)
        resized = _resize_batch(images[positions], cfg.stored_size)
        split_hashes = {}
        for image, pos, label in zip(resized, positions, labels[positions]):
            digest = hashlib.sha256(images[pos].tobytes()).hexdigest()
            source = f"{file_name}#{pos}"
            writer.add(image, int(label), source, digest)
            split_hashes.setdefault(digest, source)
        writer.close()
        counts[split] = np.bincount(labels[positions], minlength=len(idx.CLASSES)).tolist()
        hashes[split] = split_hashes
    index = write_index(out_dir, list(idx.CLASSES), cfg.stored_size, 1, counts, f"fashion-mnist:{raw_dir}",
                        carved=["val"])
    return {
        "source": "fashion-mnist",
        "raw_dir": str(raw_dir),
        "splits": {s: v["count"] for s, v in index["splits"].items()},
        "classes": list(idx.CLASSES),
        "bad_files": [],
        "num_bad": 0,
        "leakage": _leakage(hashes),
    }


# --------------------------------------------------------------------------- ImageFolder
def _class_files(class_dir: Path) -> tuple[list[Path], list[Path]]:
    """(image files, ignored non-image files) under one class folder, recursively, sorted."""
    images, ignored = [], []
    for path in sorted(p for p in class_dir.rglob("*") if p.is_file() or p.is_symlink()):
        if is_hidden(path, class_dir):
            continue
        (images if path.suffix.lower() in IMAGE_EXTENSIONS else ignored).append(path)
    return images, ignored


def scan_tree(root: Path) -> tuple[dict[str, dict[str, list[Path]]], list[Path], bool]:
    """Find class folders; returns ({split or 'all': {class: files}}, ignored files, predefined)."""
    if not root.is_dir():
        raise DataError(f"data.source: {root} is not a directory; give `fashion-mnist` or an ImageFolder tree")
    subdirs = {p.name: p for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".")}
    split_dirs = {SPLIT_ALIASES[n.lower()]: p for n, p in subdirs.items() if n.lower() in SPLIT_ALIASES}
    predefined = "train" in split_dirs
    groups = split_dirs if predefined else {"all": root}
    tree: dict[str, dict[str, list[Path]]] = {}
    ignored: list[Path] = []
    for split, directory in groups.items():
        _refuse_flat_folder(directory)
        tree[split] = {}
        for class_dir in sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".")):
            files, skipped = _class_files(class_dir)
            tree[split][class_dir.name] = files
            ignored += skipped
        ignored += [p for p in directory.iterdir() if p.is_file() and not p.name.startswith(".")]
    return tree, sorted(ignored), predefined


def _refuse_flat_folder(directory: Path) -> None:
    """A folder of images with no class folders (ImageNet's val/, most catalog exports) would be
    read as an empty split: validation top-1 0 every epoch, best.pt stuck at the first epoch."""
    entries = [p for p in directory.iterdir() if not p.name.startswith(".")]
    if any(p.is_dir() for p in entries):
        return
    images = [p for p in entries if p.suffix.lower() in IMAGE_EXTENSIONS]
    if images:
        raise DataError(f"data.source: {directory} holds {len(images)} image file(s) but no class folders, so "
                        f"their labels are unknown. Move each image into a subfolder named after its class "
                        f"({directory}/<class>/{images[0].name}), or leave this folder out of data.source")


def _assign_splits(tree: dict[str, dict[str, list[Path]]], predefined: bool, classes: list[str],
                   cfg: DataConfig, seed: int) -> dict[str, list[tuple[Path, int]]]:
    """Items per split: predefined folders kept, missing splits carved out of train by content
    (`content_split`: a new photo never moves an old one)."""
    label_of = {c: i for i, c in enumerate(classes)}

    def items(group: dict[str, list[Path]]) -> list[tuple[Path, int]]:
        return [(f, label_of[c]) for c in sorted(group) if c in label_of for f in group[c]]

    pool = items(tree["train" if predefined else "all"])
    splits = {s: items(tree[s]) for s in ("test", "val") if predefined and s in tree}
    carved = [(s, f) for s, f in (("test", cfg.test_fraction), ("val", cfg.val_fraction)) if s not in splits]
    names = content_split([_file_digest(p) for p, _ in pool], np.array([label for _, label in pool], dtype=int),
                          carved, seed) if carved else np.full(len(pool), "train", dtype=object)
    for split in ("train", *(s for s, _ in carved)):
        splits[split] = [item for item, name in zip(pool, names) if name == split]
    caps = {"train": cfg.max_train_images, "val": cfg.max_eval_images, "test": cfg.max_eval_images}
    for split, cap in caps.items():
        labels = np.array([label for _, label in splits[split]], dtype=int)
        splits[split] = [splits[split][i] for i in balanced_positions(labels, cap, seed)]
    return splits


def _file_digest(path: Path) -> str:
    """sha256 of the file's bytes (the digest `decode_file` records); of its path when unreadable, so
    the split stays a pure function of the tree and decoding reports the file."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return hashlib.sha256(str(path).encode()).hexdigest()


def _leakage(hashes: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    """Byte-identical items found in more than one split."""
    where: dict[str, dict[str, str]] = defaultdict(dict)
    for split, by_hash in hashes.items():
        for digest, source in by_hash.items():
            where[digest][split] = source
    return [{"sha256": d, "splits": sorted(s), "sources": [s[k] for k in sorted(s)]}
            for d, s in sorted(where.items()) if len(s) > 1]


def _decode_all(paths: list[Path], cfg: DataConfig, desc: str) -> Iterable[Decoded]:
    """Decode in `data.prepare_workers` processes, in input order (so output is deterministic)."""
    work = partial(decode_file, size=cfg.stored_size, max_pixels=cfg.max_pixels)
    bar = partial(tqdm, total=len(paths), desc=desc, unit="img", disable=None, mininterval=2.0)
    if cfg.prepare_workers == 1 or len(paths) < 64:
        yield from bar(map(work, paths))
        return
    with mp.get_context("spawn").Pool(cfg.prepare_workers) as pool:
        yield from bar(pool.imap(work, paths, chunksize=32))


def prepare_image_folder(cfg: DataConfig, seed: int, out_dir: Path, root: Path) -> dict[str, Any]:
    """Ingest an ImageFolder tree; broken files are skipped and listed (or fail the stage)."""
    tree, ignored, predefined = scan_tree(root)
    all_classes = sorted({c for group in tree.values() for c in group})
    empty = sorted(c for c in all_classes if not any(group.get(c) for group in tree.values()))
    classes = [c for c in all_classes if c not in empty]
    if len(classes) < 2:
        raise DataError(f"data.source: {root} has {len(classes)} usable class folder(s) "
                        f"({', '.join(classes) or 'none'}); need at least two (one folder per class)")
    splits = _assign_splits(tree, predefined, classes, cfg, seed)
    bad: list[dict[str, str]] = []
    counts: dict[str, list[int]] = {}
    hashes: dict[str, dict[str, str]] = {}
    for split in SPLITS:
        writer = SplitWriter(out_dir, split, cfg.stored_size, channels=3)
        split_hashes: dict[str, str] = {}
        for (path, label), result in zip(splits[split], _decode_all([p for p, _ in splits[split]], cfg, split)):
            rel = str(path.relative_to(root))
            if result.image is None:
                bad.append({"path": rel, "split": split, "reason": str(result.reason)})
                continue
            writer.add(result.image, label, rel, result.sha256)
            split_hashes.setdefault(result.sha256, rel)
        writer.close()
        counts[split] = np.bincount(np.asarray(writer.labels, dtype=int), minlength=len(classes)).tolist()
        hashes[split] = split_hashes
    if bad and cfg.on_bad_image == "fail":
        listing = "\n".join(f"  {b['path']}: {b['reason']}" for b in bad[:50])
        raise DataError(f"{len(bad)} unusable image(s) under {root} and data.on_bad_image=fail:\n{listing}\n"
                        "Fix or remove them, or set data.on_bad_image: skip to list them and go on.")
    no_train = [classes[i] for i, n in enumerate(counts["train"]) if n == 0]
    if len(classes) - len(no_train) < 2:
        raise DataError(f"data.source: {root}: fewer than two classes have a usable training image "
                        f"(without any: {', '.join(no_train)}); see metrics/data_report.json")
    index = write_index(out_dir, classes, cfg.stored_size, 3, counts, f"imagefolder:{root}",
                        carved=[s for s in ("val", "test") if not (predefined and s in tree)])
    return {
        "source": str(root),
        "predefined_splits": predefined,
        "splits": {s: v["count"] for s, v in index["splits"].items()},
        "classes": classes,
        "empty_classes": empty,
        "classes_without_train_images": no_train,
        "ignored_files": [str(p.relative_to(root)) for p in ignored],
        "bad_files": bad,
        "num_bad": len(bad),
        "leakage": _leakage(hashes),
    }


# --------------------------------------------------------------------------- entry point
def _members(store: Path) -> dict[str, set[str]]:
    """{split: content hashes} of a prepared store (empty when there is none)."""
    out: dict[str, set[str]] = {}
    for split in SPLITS:
        meta = store / f"{split}_meta.jsonl"
        if meta.exists():
            with open(meta, encoding="utf-8") as fh:
                out[split] = {json.loads(line)["sha256"] for line in fh}
    return out


def split_changes(previous: Path, current: Path) -> dict[str, Any] | None:
    """Images each split gained and lost against the previous store, and how many images present in
    both changed split (0 unless the seed, the fractions or the caps changed); None without one."""
    before, after = _members(previous), _members(current)
    if not before:
        return None
    where = {d: s for s, digests in before.items() for d in digests}
    moved = sum(1 for s, digests in after.items() for d in digests if where.get(d, s) != s)
    return {"splits": {s: {"gained": len(after.get(s, set()) - before.get(s, set())),
                           "lost": len(before.get(s, set()) - after.get(s, set()))} for s in SPLITS},
            "moved_between_splits": moved}



def prepare(cfg: DataConfig, seed: int, out_dir: Path, report_path: Path) -> dict[str, Any]:
    """Write the prepared data set to `out_dir` and the data report to `report_path`.

    The new store is written beside the old one (`<out_dir>.new`) and swapped in by renames, so no
    file of the old store is ever rewritten: a trainer that has it memory-mapped (a shared
    filesystem, a hardlinked DVC cache) keeps reading the old version, and a failed prepare leaves
    the old store as it was.
    """
    out_dir, report_path = Path(out_dir), Path(report_path)
    new, old = out_dir.with_name(out_dir.name + ".new"), out_dir.with_name(out_dir.name + ".old")
    for leftover in (new, old):
        if leftover.exists():
            shutil.rmtree(leftover)
    new.mkdir(parents=True)
    try:
        if cfg.source == "fashion-mnist":
            report = prepare_fashion_mnist(cfg, seed, new)
        else:
            report = prepare_image_folder(cfg, seed, new, Path(cfg.source).expanduser())
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    report["changes"] = split_changes(out_dir, new)
    if out_dir.exists():
        out_dir.rename(old)
    new.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)  # unlinks only: open maps of the old files stay valid
    write_json(report_path, report)
    return report

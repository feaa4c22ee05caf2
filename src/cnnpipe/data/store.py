"""The prepared format: pre-resized uint8 images in one memory-mappable file per split.

Layout of a prepared directory::

    index.json            classes, channels, size, per-split counts (the contract readers check)
    <split>.u8            raw uint8 pixels, shape (count, size, size, channels), row-major
    <split>_labels.npy    int64 labels
    <split>_meta.jsonl    one line per image: source path and sha256 of the source bytes (and, for
                          image files, their size and mtime: unchanged files are not read again)
    recipe.json           the decoding rules and size (image files only): which stores can share pixels

Raw files rather than .npy so that a split can be written streaming, one image at a time, without
knowing in advance how many of the candidate files will decode: memory stays flat.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cnnpipe.files import write_json

FORMAT_VERSION = 1
SPLITS = ("train", "val", "test")


class SplitWriter:
    """Append images of one split to `<split>.u8`, streaming."""

    def __init__(self, out_dir: Path, split: str, size: int, channels: int) -> None:
        self.out_dir, self.split, self.size, self.channels = out_dir, split, size, channels
        self._pixels = open(out_dir / f"{split}.u8", "wb")
        self._meta = open(out_dir / f"{split}_meta.jsonl", "w", encoding="utf-8")
        self.labels: list[int] = []

    def add(self, image: np.ndarray, label: int, source: str, sha256: str,
            extra: dict[str, Any] | None = None) -> None:
        """Append one (size, size, channels) uint8 image; `extra` goes into its meta line."""
        expected = (self.size, self.size, self.channels)
        if image.shape != expected or image.dtype != np.uint8:
            raise ValueError(f"{source}: got {image.shape} {image.dtype}, expected {expected} uint8")
        self._pixels.write(np.ascontiguousarray(image).tobytes())
        self._meta.write(json.dumps({"source": source, "sha256": sha256, **(extra or {})}, ensure_ascii=False) + "\n")
        self.labels.append(int(label))

    def close(self) -> int:
        """Flush everything; return the number of images written."""
        self._pixels.close()
        self._meta.close()
        np.save(self.out_dir / f"{self.split}_labels.npy", np.asarray(self.labels, dtype=np.int64))
        return len(self.labels)


def write_index(out_dir: Path, classes: list[str], size: int, channels: int,
                counts: dict[str, list[int]], source: str, carved: list[str]) -> dict[str, Any]:
    """Write index.json (class names, geometry, per-split per-class counts, and which splits were
    carved out of the training images rather than given by the source)."""
    index = {
        "format": FORMAT_VERSION,
        "source": source,
        "carved": sorted(carved),
        "classes": classes,
        "size": size,
        "channels": channels,
        "splits": {s: {"count": int(sum(c)), "class_counts": [int(x) for x in c]} for s, c in counts.items()},
    }
    write_json(out_dir / "index.json", index)
    return index


@dataclass
class PreparedSplit:
    """Read-only, memory-mapped view of one prepared split."""

    images: np.ndarray  # (N, size, size, channels) uint8, memory-mapped
    labels: np.ndarray  # (N,) int64
    classes: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def channels(self) -> int:
        return int(self.images.shape[-1])

    def __len__(self) -> int:
        return len(self.labels)


def read_index(prepared_dir: Path) -> dict[str, Any]:
    """Load index.json, explaining what to run when it is missing."""
    path = Path(prepared_dir) / "index.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run `dvc repro prepare` first")
    index = json.loads(path.read_text(encoding="utf-8"))
    if index.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: format {index.get('format')} != {FORMAT_VERSION}; rerun `dvc repro prepare`")
    return index


def open_split(prepared_dir: Path, split: str, limit: int | None = None) -> PreparedSplit:
    """Memory-map `split` of a prepared directory; `limit` keeps the first N images."""
    prepared_dir = Path(prepared_dir)
    index = read_index(prepared_dir)
    if split not in index["splits"]:
        raise KeyError(f"{prepared_dir}: no split {split!r} (have {', '.join(index['splits'])})")
    count = index["splits"][split]["count"]
    shape = (count, index["size"], index["size"], index["channels"])
    raw = prepared_dir / f"{split}.u8"
    expected = int(np.prod(shape))
    if raw.stat().st_size != expected:
        raise ValueError(f"{raw}: {raw.stat().st_size} bytes, index says {expected}; rerun `dvc repro prepare`")
    images = np.memmap(raw, dtype=np.uint8, mode="r", shape=shape) if count else np.zeros(shape, np.uint8)
    labels = np.load(prepared_dir / f"{split}_labels.npy")
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    return PreparedSplit(images=images, labels=labels, classes=list(index["classes"]))

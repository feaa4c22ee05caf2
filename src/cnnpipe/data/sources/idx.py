"""Fashion-MNIST in its original IDX format, as shipped by Debian's `dataset-fashion-mnist`."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
SEARCH_DIRS = (Path("data/raw/fashion-mnist"), Path("/usr/share/datasets/fashion-mnist"))
HOW_TO_GET = (
    "Fashion-MNIST not found. Either install the Debian package:\n"
    "    sudo apt-get update && sudo apt-get install -y dataset-fashion-mnist\n"
    "(it puts the four IDX files in /usr/share/datasets/fashion-mnist/), or copy the four files\n"
    "train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz],\n"
    "t10k-labels-idx1-ubyte[.gz] into data/raw/fashion-mnist/."
)


class DatasetMissing(FileNotFoundError):
    """The raw data set is not where we look for it."""


def _find(directory: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (directory / name).is_file():
            return directory / name
    return None


def locate(search_dirs: tuple[Path, ...] = SEARCH_DIRS) -> Path:
    """The first directory holding all four IDX files (plain or gzipped)."""
    for directory in search_dirs:
        if all(_find(directory, stem) for pair in FILES.values() for stem in pair):
            return directory
    looked = ", ".join(str(d) for d in search_dirs)
    raise DatasetMissing(f"{HOW_TO_GET}\n(looked in: {looked})")


def _read(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        data = fh.read()
    if len(data) < 8:
        raise ValueError(f"{path}: too short to be an IDX file")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {data[:4].hex()})")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape} but holds {body.size} bytes (truncated?)")
    return body.reshape(shape)


def write_split(directory: Path, split: str, images: np.ndarray, labels: np.ndarray) -> None:
    """Write a split as the two gzipped IDX files `load_split` reads (for tests and synthetic sets)."""
    directory.mkdir(parents=True, exist_ok=True)
    for stem, array in zip(FILES[split], (images, labels)):
        header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
        with gzip.open(directory / f"{stem}.gz", "wb", compresslevel=1) as fh:
            fh.write(header + array.astype(np.uint8).tobytes())


def load_split(directory: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 28, 28) uint8 and labels (N,) int64 of the `train` or `test` split."""
    image_stem, label_stem = FILES[split]
    images = _read(_find(directory, image_stem))  # type: ignore[arg-type]
    labels = _read(_find(directory, label_stem)).astype(np.int64)  # type: ignore[arg-type]
    if len(images) != len(labels):
        raise ValueError(f"{directory}: {len(images)} {split} images but {len(labels)} labels")
    return images, labels

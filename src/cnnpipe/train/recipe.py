"""A model's input recipe: every step from a raw photo to the tensor the model was trained on.

The decode to the stored square (`data.ingest.decode` for photo files, its rules named by TRANSFORM), the
channels (ITU-R 601 luma for a greyscale model), how the store keeps it (`stored_as`: raw, or JPEG at
a quality, whose round trip a photo then goes through too), the resize to the input size and the
mean/std.
Training records it in best.pt's meta (`input`); predict (`photo_input`, then
`trained.make_transform`), both exports' meta.json and the gate apply exactly it, and a warm start
or a gate across two recipes is refused (`recipe_differences`), so production sees the pixels the
gate judged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from cnnpipe.config import DataConfig
from cnnpipe.data.store import codec
from cnnpipe.data.ingest.decode import TRANSFORM, decode_file

# Fashion-MNIST's store: the IDX arrays (28 px greyscale) resized with torch's antialiased bilinear.
IDX_DECODE = "fashion-mnist-idx-bilinear-antialias"
RESIZE = "bilinear-antialias"  # stored square -> input size: `loaders.eval_transform`
# ITU-R 601-2 luma, the weights PIL's convert("L") uses: a photo turns grey as a greyscale scan would.
LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)
# What must match for two models to see the same pixels from the same photo.
# (Not `stored_as`: features learnt on raw pixels warm-start a model of JPEG ones; but a store in
# another encoding shows other pixels than the model's photos go through, so the gate's check has it.)
RECIPE_KEYS = ("decode", "stored_size", "channels", "resize", "image_size", "mean", "std")
STORE_KEYS = ("decode", "stored_size", "channels", "stored_as")  # what a prepared store fixes


def stored_as(encoding: str, quality: int) -> str:
    """`raw`, or `jpeg-q<quality>/<codec.CODEC>`: the pixels a store of this encoding reads back."""
    return "raw" if encoding == "raw" else f"jpeg-q{quality}/{codec.CODEC}"


def input_recipe(data: DataConfig, channels: int, mean: Sequence[float], std: Sequence[float]) -> dict[str, Any]:
    """The input recipe of a model trained on `data` (image_size resolved) at `channels`."""
    if not isinstance(data.image_size, int):
        raise ValueError(f"data.image_size={data.image_size!r} must be resolved before the recipe is recorded")
    encoding = codec.resolve_encoding(data.encoding, data.stored_size, channels)
    return {"decode": IDX_DECODE if data.source == "fashion-mnist" else TRANSFORM, "stored_size": data.stored_size,
            "channels": channels, "stored_as": stored_as(encoding, data.quality), "resize": RESIZE,
            "image_size": data.image_size,
            "mean": [float(m) for m in mean], "std": [float(s) for s in std]}


def store_recipe(index: dict[str, Any]) -> dict[str, Any]:
    """What a prepared store's index.json fixes of the recipe: its decode, stored size and channels."""
    idx = str(index.get("source", "")).startswith("fashion-mnist")
    return {"decode": IDX_DECODE if idx else TRANSFORM, "stored_size": int(index["size"]),
            "channels": int(index["channels"]),
            "stored_as": stored_as(index.get("encoding", "raw"), int(index.get("quality", codec.DEFAULT_QUALITY)))}


def recipe_of(meta: dict[str, Any]) -> dict[str, Any]:
    """A model's input recipe from its meta; a checkpoint older than the recipe gets what its meta
    says (stored_size and decode None: unknown)."""
    if meta.get("input"):
        return dict(meta["input"])
    return {"decode": None, "stored_size": None, "channels": meta["in_chans"], "resize": RESIZE,
            "image_size": meta["image_size"], "mean": list(meta["mean"]), "std": list(meta["std"])}


def recipe_differences(a: dict[str, Any], b: dict[str, Any], keys: Sequence[str] = RECIPE_KEYS) -> list[str]:
    """`key: a != b` for every key of `keys` on which two recipes differ (floats to 6 places); a key
    either leaves unknown (None: a checkpoint older than the recipe) is not a difference."""
    def norm(v: Any) -> Any:
        return [round(float(x), 6) for x in v] if isinstance(v, (list, tuple)) else v
    return [f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in keys
            if a.get(k) is not None and b.get(k) is not None and norm(a.get(k)) != norm(b.get(k))]


def to_channels(image: np.ndarray, channels: int) -> np.ndarray:
    """RGB (H, W, 3) uint8 -> (H, W, channels) uint8, the layout the model was trained on."""
    if channels == 3:
        return image
    if channels == 1:
        grey = np.rint(image.astype(np.float32) @ LUMA).clip(0, 255).astype(np.uint8)
        return grey[..., None]
    raise ValueError(f"models with {channels} input channels are not supported (1 or 3)")


def photo_input(recipe: dict[str, Any], path: Path, max_pixels: int) -> np.ndarray | str:
    """A raw photo as the model's stored square (S, S, channels) uint8, by its recipe, or why not.
    `make_transform` then resizes and normalises it, as for the store's images."""
    if recipe.get("resize", RESIZE) != RESIZE:
        raise ValueError(f"input recipe resize={recipe['resize']!r}: this version applies only {RESIZE!r}")
    decoded = decode_file(path, int(recipe["stored_size"]), max_pixels)
    if decoded.image is None:
        return decoded.reason or "unreadable"
    image = to_channels(decoded.image, int(recipe["channels"]))
    kept = recipe.get("stored_as") or "raw"  # unknown (a checkpoint older than encodings): a raw store
    if kept != "raw":  # the model learnt the store's JPEG pixels: a photo goes through the same round trip
        if not kept.endswith(f"/{codec.CODEC}"):
            raise ValueError(f"input recipe stored_as={kept!r}: this version reads only {codec.CODEC!r} stores")
        image = codec.decode(codec.encode(image, int(kept.split("/")[0].removeprefix("jpeg-q"))), image.shape[-1])
    return image

"""Encoded images for the prepared store: JPEG at a chosen quality, decoded the same way everywhere.

A store keeps each image either raw (its uint8 pixels) or as JPEG bytes; `auto` picks by geometry
(`choose_encoding`). This module is the codec and nothing else: it knows no shard, index or loader.

Encoding (`encode`): Pillow's libjpeg-turbo, baseline (not progressive: nvJPEG's GPU decode and the
fastest CPU paths want baseline), Huffman tables optimised per image (4-15% fewer bytes at 224-64 px,
paid once at prepare), chroma 4:2:0 for colour, as most camera and catalog JPEGs already have
it (4:4:4 measured 26-29% larger and 1.4-1.7x slower to decode, for 2.8-3.5 dB; `bench/store_encoding.py
--settings`), one channel for grayscale. The same pixels and quality always give the same bytes.

Decoding on the CPU (`decode`, `decode_batch`) is simplejpeg, chosen by measurement
(`bench/store_encoding.py`, docs/benchmarks.md): among the maintained libjpeg-turbo bindings it was
the fastest per core at 64-224 px on real photos (1.2-2.0x torchvision.io's CPU decode, 1.5-4x
Pillow's, whose per-image object costs most on small images, 1.04-1.5x PyTurboJPEG's); it decodes
straight into a slice of the batch array (no copy); its wheel bundles libjpeg-turbo (no system
library, unlike PyTurboJPEG, whose 2.x also needs a libjpeg-turbo 3 that Debian 13 does not ship);
and torchvision's image decoders are deprecated since 0.29. All four gave the same pixels on every
photo measured (accurate integer IDCT, smooth chroma upsampling: the libjpeg defaults, pinned here),
but only one of them runs here: training, evaluation, the gate and the export's checks all read a
JPEG store through `_decode`, so the same stored bytes are the same pixels wherever they are read on
a CPU.

Decoding on a GPU (`decode_batch_on`) hands the batch's records to nvJPEG as one list through
`torchvision.io.decode_jpeg(..., device="cuda")`. nvJPEG's IDCT and upsampling are not libjpeg's:
its pixels may differ from the CPU's by a level or two, so it feeds training only.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import simplejpeg
from PIL import Image

if TYPE_CHECKING:  # torch is imported where it is used: prepare and the CPU decode never need it
    import torch

ENCODINGS = ("raw", "jpeg", "auto")
DEFAULT_QUALITY = 90

# Names the encoder's and decoder's settings above. A store records it with its encoding and quality;
# change it whenever a change here changes the bytes written or the pixels read back.
CODEC = "jpeg-baseline-420-optimized-huffman/simplejpeg-islow-fancy-v1"

_COLORSPACE = {1: "GRAY", 3: "RGB"}


class RecordError(ValueError):
    """A stored record that does not decode to the store's frame; `index` is its place in the batch."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"record {index} of the batch: {message}")
        self.index = index


def check_quality(quality: int, key: str = "data.quality") -> int:
    """`quality` if it is a JPEG quality (an integer in [1, 100]), else a ValueError naming `key`."""
    if isinstance(quality, bool) or not isinstance(quality, (int, np.integer)) or not 1 <= quality <= 100:
        raise ValueError(f"{key} = {quality!r} is invalid; allowed: an integer in [1, 100] (default "
                         f"{DEFAULT_QUALITY}; above 95 the bytes grow fast for no visible gain)")
    return int(quality)


def _channels(shape: tuple[int, ...], what: str) -> int:
    if len(shape) != 3 or shape[-1] not in _COLORSPACE:
        raise ValueError(f"{what}: got shape {shape}, expected (height, width, channels) with 1 or 3 channels")
    return shape[-1]


# --------------------------------------------------------------------------- one image
def encode(image: np.ndarray, quality: int = DEFAULT_QUALITY) -> bytes:
    """JPEG bytes of an (H, W, C) uint8 image, C = 1 (stays one channel) or 3."""
    channels = _channels(image.shape, "encode")
    if image.dtype != np.uint8:
        raise ValueError(f"encode: got {image.dtype}, expected uint8 pixels")
    pixels = np.ascontiguousarray(image[..., 0] if channels == 1 else image)
    out = io.BytesIO()
    Image.fromarray(pixels).save(
        out, "JPEG", quality=check_quality(quality), optimize=True, progressive=False, subsampling="4:2:0")
    return out.getvalue()


def _decode(record: bytes | memoryview | np.ndarray, channels: int, out: np.ndarray | None = None) -> np.ndarray:
    """The one CPU decoder: every reader of a JPEG store comes through here (see the module docstring)."""
    return simplejpeg.decode_jpeg(record, _COLORSPACE[channels], fastdct=False, fastupsample=False,
                                  buffer=out, strict=True)


def decode(record: bytes | memoryview | np.ndarray, channels: int) -> np.ndarray:
    """An (H, W, channels) uint8 array from JPEG bytes; a ValueError for bytes that are not a JPEG."""
    if channels not in _COLORSPACE:
        raise ValueError(f"decode: channels={channels}; allowed: 1 or 3")
    return _decode(record, channels)


# --------------------------------------------------------------------------- batches of records
def pack(records: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(flat uint8 buffer, (N+1,) int64 offsets) holding `records` back to back: record i is
    buffer[offsets[i]:offsets[i+1]], the layout of encoded records in a shard and in a batch."""
    offsets = np.zeros(len(records) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in records], out=offsets[1:])
    buffer = np.frombuffer(b"".join(records), dtype=np.uint8) if records else np.zeros(0, np.uint8)
    return buffer, offsets


def _check_offsets(offsets: np.ndarray, buffer_len: int) -> np.ndarray:
    offsets = np.asarray(offsets, dtype=np.int64)
    if offsets.ndim != 1 or len(offsets) < 1:
        raise ValueError(f"offsets: got shape {offsets.shape}, expected (N+1,): record i is "
                         "buffer[offsets[i]:offsets[i+1]]")
    if offsets[0] < 0 or offsets[-1] > buffer_len or (np.diff(offsets) < 0).any():
        raise ValueError(f"offsets must rise from >= 0 to <= the buffer's {buffer_len} bytes; got "
                         f"{offsets[0]}..{offsets[-1]}{' (not monotone)' if (np.diff(offsets) < 0).any() else ''}")
    return offsets


def decode_batch(buffer: np.ndarray | bytes, offsets: np.ndarray, frame: tuple[int, int, int],
                 out: np.ndarray | None = None) -> np.ndarray:
    """(N, H, W, C) uint8 from N records of `buffer` (see `pack`), each decoded into its slice of `out`
    (allocated when None). A record that is no JPEG, or not of `frame` = (H, W, C), raises RecordError."""
    buffer = np.frombuffer(buffer, np.uint8) if isinstance(buffer, (bytes, bytearray, memoryview)) else buffer
    buffer = np.asarray(buffer, dtype=np.uint8).reshape(-1)
    offsets = _check_offsets(offsets, len(buffer))
    return decode_records(buffer, offsets[:-1], offsets[1:], frame, out)


def decode_records(buffer: np.ndarray, starts: np.ndarray, stops: np.ndarray, frame: tuple[int, int, int],
                   out: np.ndarray | None = None) -> np.ndarray:
    """`decode_batch` for records anywhere in `buffer` (a shard's map): record i is
    buffer[starts[i]:stops[i]]. What a reader gathering rows of a shard calls."""
    channels = _channels(tuple(frame), "frame")
    n = len(starts)
    if out is None:
        out = np.empty((n, *frame), dtype=np.uint8)
    elif out.shape != (n, *frame) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"out: got {out.shape} {out.dtype}, expected a C-contiguous {(n, *frame)} uint8 array")
    for i, (start, stop) in enumerate(zip(np.asarray(starts).tolist(), np.asarray(stops).tolist())):
        record = buffer[start:stop]
        try:
            decoded = _decode(record, channels, out[i])
        except ValueError as exc:  # not a JPEG, truncated, or larger than the frame's buffer
            raise RecordError(i, f"{len(record)} bytes do not decode to a {frame} image: {exc}") from exc
        if decoded.shape != tuple(frame):
            raise RecordError(i, f"decoded to {decoded.shape}, the store's frame is {tuple(frame)}")
    return out


def record_tensors(buffer: torch.Tensor | np.ndarray, offsets: np.ndarray | torch.Tensor) -> list[torch.Tensor]:
    """The records of a batch as 1-D uint8 CPU tensors that view `buffer` (no copy): the list
    `torchvision.io.decode_jpeg` takes. A pinned buffer gives pinned views."""
    import torch

    if isinstance(buffer, np.ndarray):
        buffer = torch.from_numpy(np.require(buffer, np.uint8, ["C", "W"]).reshape(-1))  # a copy only if read-only
    if buffer.dtype != torch.uint8 or buffer.device.type != "cpu":
        raise ValueError(f"buffer: got {buffer.dtype} on {buffer.device}, expected uint8 bytes on the CPU")
    buffer = buffer.reshape(-1)
    bounds = _check_offsets(torch.as_tensor(offsets).numpy() if isinstance(offsets, torch.Tensor) else offsets,
                            buffer.numel()).tolist()
    return [buffer[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]


def decode_batch_on(buffer: torch.Tensor | np.ndarray, offsets: np.ndarray | torch.Tensor,
                    frame: tuple[int, int, int], device: torch.device | str) -> torch.Tensor:
    """The batch decoded by torchvision.io.decode_jpeg on `device` (nvJPEG on CUDA, one call for the
    whole list), stacked into one (N, C, H, W) uint8 tensor there and returned as its (N, H, W, C)
    view: the layout the fast loader's batches have, so `loaders.FastTransform` takes it unchanged
    (its `to_nchw` gives back the stacked tensor, no copy).

    torchvision's image decoders are deprecated since 0.29 in favour of TorchCodec; this function is
    the one place that calls them.
    """
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    channels = _channels(tuple(frame), "frame")
    height, width = frame[:2]
    device = torch.device(device)
    records = record_tensors(buffer, offsets)
    if not records:
        return torch.empty((0, *frame), dtype=torch.uint8, device=device)
    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # said once above, not once per batch
        images = decode_jpeg(records, mode=mode, device=device)
    for i, image in enumerate(images):
        if tuple(image.shape) != (channels, height, width):
            raise RecordError(i, f"decoded to {tuple(image.shape)} (C, H, W), the store's frame is {tuple(frame)}")
    return torch.stack(images).permute(0, 2, 3, 1)


# --------------------------------------------------------------------------- auto
# Measured on real photos at quality 90 (`python bench/store_encoding.py --crossover`, docs/data.md):
# stored size -> (mean JPEG bytes, `decode_batch` images per CPU-second of one core of the 2-core
# Xeon VM, the slowest machine we run on), per channel count; grayscale is the same photos in one
# channel. Interpolated log-log between sizes.
MEASURED: dict[int, dict[int, tuple[float, float]]] = {
    1: {16: (295, 110329), 24: (429, 74846), 32: (601, 56747), 48: (1040, 39133), 64: (1600, 28838),
        96: (3044, 15132), 128: (4908, 11159), 160: (7223, 7665), 224: (13388, 4381), 320: (26237, 2170),
        448: (54176, 973)},
    3: {16: (450, 70999), 24: (643, 50475), 32: (819, 34781), 48: (1340, 23141), 64: (1998, 16115),
        96: (3687, 8997), 128: (5852, 7933), 160: (8536, 4241), 224: (15645, 2603), 320: (30447, 1388),
        448: (61901, 745)},
}

MIN_SAVING = 2.0
"""JPEG must at least halve the store: a smaller saving does not pay for lossy pixels and a decode on
every read of every epoch."""
TRAIN_IMG_S = 6833.0
"""The fastest training the store must feed: ResNet-50 on one H200 (bf16, channels_last, compiled) at
224 px (docs/benchmarks.md). On a GPU the pipeline trains at 224 px whatever the stored size."""
LOADER_CORES = 8
"""CPU cores that decode for one GPU: 8-GPU servers have 64-224 cores; the lent H200 box had 16."""


@dataclass(frozen=True)
class EncodingChoice:
    """What `auto` resolved to and the numbers it weighed."""

    encoding: str
    reason: str
    raw_bytes: int
    jpeg_bytes: float
    decode_img_s: float

    @property
    def saving(self) -> float:
        return self.raw_bytes / self.jpeg_bytes


def choose_encoding(size: int, channels: int, *, jpeg_bytes: float, decode_img_s: float,
                    train_img_s: float = TRAIN_IMG_S, loader_cores: int = LOADER_CORES,
                    min_saving: float = MIN_SAVING) -> EncodingChoice:
    """`raw` or `jpeg` for a store of `size` px squares of `channels`, from the JPEG bytes an image
    takes and the images one core decodes a second: raw where JPEG saves less than `min_saving`x,
    or where `loader_cores` decoding could not keep up with a device training `train_img_s`."""
    raw = size * size * channels
    facts = dict(raw_bytes=raw, jpeg_bytes=float(jpeg_bytes), decode_img_s=float(decode_img_s))
    saving = raw / jpeg_bytes
    if saving < min_saving:
        return EncodingChoice("raw", f"JPEG would save {saving:.2f}x, under {min_saving:g}x", **facts)
    if decode_img_s * loader_cores < train_img_s:
        return EncodingChoice("raw", f"{loader_cores} cores decode {decode_img_s * loader_cores:,.0f} img/s, "
                                     f"under the {train_img_s:,.0f} img/s training needs", **facts)
    return EncodingChoice("jpeg", f"JPEG saves {saving:.1f}x and {loader_cores} cores decode "
                                  f"{decode_img_s * loader_cores:,.0f} img/s", **facts)


def measured_costs(size: int, channels: int) -> tuple[float, float]:
    """(JPEG bytes, decodes per second per core) at `size` from `MEASURED`, interpolated log-log
    (extrapolated from the nearest two sizes outside the table)."""
    table = sorted(MEASURED[channels].items())
    sizes = np.log([s for s, _ in table])
    at = math.log(size)
    costs = []
    for k in range(2):
        values = np.log([v[k] for _, v in table])
        i = int(np.clip(np.searchsorted(sizes, at) - 1, 0, len(sizes) - 2))
        slope = (values[i + 1] - values[i]) / (sizes[i + 1] - sizes[i])
        costs.append(float(math.exp(values[i] + slope * (at - sizes[i]))))
    return costs[0], costs[1]


def auto_encoding(size: int, channels: int) -> EncodingChoice:
    """`auto` for a store of `size` px squares of `channels`: `choose_encoding` on the measured costs.
    A function of the geometry alone, so every node and every week resolves the same store."""
    if channels not in MEASURED:
        raise ValueError(f"auto_encoding: channels={channels}; allowed: 1 or 3")
    jpeg_bytes, decode_img_s = measured_costs(size, channels)
    return choose_encoding(size, channels, jpeg_bytes=jpeg_bytes, decode_img_s=decode_img_s)


def resolve_encoding(encoding: str, size: int, channels: int) -> str:
    """`data.encoding` (`raw`, `jpeg` or `auto`) as the store's `raw` or `jpeg`."""
    if encoding not in ENCODINGS:
        raise ValueError(f"data.encoding = {encoding!r} is invalid; allowed: {' | '.join(ENCODINGS)}")
    return auto_encoding(size, channels).encoding if encoding == "auto" else encoding

"""Decode any real-world image file into a square, pre-resized uint8 array.

Rules (documented in the README):
- EXIF orientation is applied first, so photos stand the way the camera held them.
- Transparency (modes LA, PA, RGBA, P with a transparency key) is composited onto white, the
  background of product photos; CMYK goes through PIL's conversion; 16-bit greyscale is scaled
  to 8 bits; every image ends as RGB.
- The short side is resized to `size` (bicubic, antialiased) and the centre square is kept:
  the aspect ratio is preserved, and the same centre region is what evaluation sees. A strip whose
  resized whole would exceed `max_pixels` (1 x 80M pixels at 32 px: 2.5G) has only its centre
  square resized, the same region.
- More pixels than `max_pixels` (read from the header, before decoding) is a decompression bomb
  and is rejected without decoding.
- Whatever else goes wrong with one file (any exception a codec or EXIF parser raises) rejects that
  file with the exception named; it never stops the catalog.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

# Names the decoding rules above. A prepared store records it, and `prepare` copies images from the
# previous store only when it matches: change it whenever a change here changes the pixels.
TRANSFORM = "exif-rgb-white-shortside-bicubic-centre-v1"

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})

# We enforce our own limit (data.max_pixels) from the header; PIL's global guard would raise
# a different exception type, or only warn, depending on the size.
Image.MAX_IMAGE_PIXELS = None


def is_hidden(path: Path, root: Path) -> bool:
    """A dot-file, or a file under a dot-folder below `root`: skipped by prepare and predict alike."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)


@dataclass(frozen=True)
class Decoded:
    """Outcome of decoding one file: `image` is None when the file was rejected."""

    path: str
    sha256: str
    image: np.ndarray | None
    reason: str | None = None


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any PIL mode to RGB, compositing transparency onto white."""
    if img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    if img.mode == "PA":
        img = img.convert("RGBA")
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16/32-bit greyscale: keep the top 8 bits of the range actually used by the format.
        arr = np.asarray(img, dtype=np.uint32)
        shift = 8 if img.mode.startswith("I;16") or arr.max() <= 0xFFFF else 24
        img = Image.fromarray((arr >> shift).astype(np.uint8), mode="L")
    if img.mode == "F":
        arr = np.clip(np.asarray(img), 0, 255).astype(np.uint8)
        img = Image.fromarray(arr, mode="L")
    if img.mode in ("LA", "RGBA"):
        background = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, img.convert("RGBA"))
    return img.convert("RGB")


def resize_center_square(img: Image.Image, size: int, max_pixels: int | None = None) -> Image.Image:
    """Resize the short side to `size` (aspect kept), then keep the centre `size` square.

    When the resized whole would hold more than `max_pixels` (a strip: 1 x 80M pixels upscaled 32x
    is 7.7 GB), only the centre square of the source is resized. Images under that bound take the
    first path, so their pixels (and `TRANSFORM`) are what they were; above it they used to run out
    of memory.
    """
    w, h = img.size
    scale = size / min(w, h)
    new_w, new_h = max(size, round(w * scale)), max(size, round(h * scale))
    if max_pixels is not None and new_w * new_h > max_pixels:
        side = min(w, h)
        left, top = (w - side) / 2, (h - side) / 2
        return img.resize((size, size), Image.Resampling.BICUBIC, box=(left, top, left + side, top + side),
                          reducing_gap=3.0)
    img = img.resize((new_w, new_h), Image.Resampling.BICUBIC, reducing_gap=3.0)
    left, top = (new_w - size) // 2, (new_h - size) // 2
    return img.crop((left, top, left + size, top + size))


def decode_file(path: str | Path, size: int, max_pixels: int) -> Decoded:
    """Read, check and pre-resize one image file; never raises for a bad image."""
    path = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        return Decoded(path, "", None, f"unreadable: {exc.strerror or exc}")
    return decode_bytes(data, path, size, max_pixels)


def decode_bytes(data: bytes, path: str, size: int, max_pixels: int,
                 digest: str | None = None) -> Decoded:
    """`decode_file` on bytes already read (prepare reads each file once, to hash and to decode)."""
    digest = digest or hashlib.sha256(data).hexdigest()
    if not data:
        return Decoded(path, digest, None, "empty file (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PIL's EXIF/metadata warnings are not our business
            with Image.open(io.BytesIO(data)) as img:
                w, h = img.size
                if w * h > max_pixels:
                    return Decoded(path, digest, None,
                                   f"decompression bomb: {w}x{h} = {w * h} pixels > data.max_pixels={max_pixels}")
                if img.format == "JPEG":
                    # Decode at the smallest DCT scale that keeps twice the stored size (Pillow's own
                    # reducing_gap=2 rule): several times faster, and the bicubic resize still antialiases.
                    img.draft("RGB", (size * 2, size * 2))
                img.seek(0)  # GIF/TIFF: first frame
                img.load()
                img = ImageOps.exif_transpose(img)
                img = resize_center_square(to_rgb(img), size, max_pixels)
                array = np.asarray(img, dtype=np.uint8).copy()
    except UnidentifiedImageError:
        return Decoded(path, digest, None, "not an image (unrecognised format)")
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        return Decoded(path, digest, None, f"corrupt or truncated: {exc}")
    except Exception as exc:  # noqa: BLE001 - Pillow and its EXIF parser raise TypeError, KeyError, ZeroDivisionError...
        return Decoded(path, digest, None, f"cannot be decoded: {type(exc).__name__}: {exc}")
    return Decoded(path, digest, array)

"""Decode any real-world image file into a square, pre-resized uint8 sRGB array.

Rules (documented in docs/data.md):
- EXIF orientation is applied first, so photos stand the way the camera held them.
- 16-bit and 32-bit greyscale are scaled from the range their values use (8, 10, 12, 14, 16 or 32
  bits: a 12-bit scan fills 0-255, not 0-15); float images from [0, 1] (or [0, 255], else their own
  minimum and maximum).
- Transparency (modes LA, PA, RGBA, P with a transparency key) is composited onto white, the
  background of product photos.
- The short side is resized to `size` (bicubic, antialiased) and the centre square is kept:
  the aspect ratio is preserved, and the same centre region is what evaluation sees. A strip whose
  resized whole would exceed `max_pixels` has only its centre square resized, the same region.
- A photo with an ICC profile (CMYK from print, Display P3 from phones, Adobe RGB from cameras) is
  converted to sRGB through it; one without is taken as sRGB. Every image ends as RGB.
- HEIC/HEIF through the pillow-heif plugin, AVIF through Pillow's own codec; where either is missing,
  the file is listed with the package to install.
- More pixels than `max_pixels` (read from the header, before decoding) is a decompression bomb
  and is rejected without decoding.
- Whatever else goes wrong with one file (any exception a codec or EXIF parser raises) rejects that
  file with the exception named; it never stops the catalog.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL
from PIL import Image, ImageCms, ImageOps, UnidentifiedImageError, features

try:  # HEIC/HEIF (iPhone photos): a maintained Pillow plugin, registered once per process
    import pillow_heif

    pillow_heif.register_heif_opener()
    HEIF_VERSION: str | None = pillow_heif.__version__
except ImportError:  # pragma: no cover - listed per file with the package to install
    HEIF_VERSION = None

# Names the decoding rules above. A prepared store records it (with `decoder_versions`), and `prepare`
# keeps images from the previous store only when both match: change it whenever a change here
# changes the pixels.
TRANSFORM = "exif-depth-white-shortside-bicubic-centre-icc-srgb-v2"

_NEEDS = {".heic": ("HEIC", HEIF_VERSION, "pip install pillow-heif"),
          ".heif": ("HEIF", HEIF_VERSION, "pip install pillow-heif"),
          ".avif": ("AVIF", features.check("avif") or None, "Pillow >= 11.3 built with libavif")}

# We enforce our own limit (data.max_pixels) from the header; PIL's global guard would raise
# a different exception type, or only warn, depending on the size.
Image.MAX_IMAGE_PIXELS = None

_SRGB = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB"))
_TRANSFORMS: OrderedDict[tuple[bytes, str], Any] = OrderedDict()  # (profile digest, mode) -> lcms transform
_MAX_TRANSFORMS = 32


def decoder_versions() -> dict[str, str | None]:
    """The libraries that turn file bytes into pixels: a new version may change pixels, so a store
    records them and a later prepare reuses its pixels only when they are the same."""
    versions: dict[str, str | None] = {"pillow": PIL.__version__, "pillow_heif": HEIF_VERSION}
    for name in ("libjpeg_turbo", "jpg", "zlib", "libtiff", "webp", "avif", "littlecms2", "jpg_2000"):
        versions[name] = features.version(name)
    return versions


@dataclass(frozen=True)
class Decoded:
    """Outcome of decoding one file: `image` is None when the file was rejected."""

    path: str
    sha256: str
    image: np.ndarray | None
    reason: str | None = None


def scale_depth(img: Image.Image) -> Image.Image:
    """16/32-bit integer and float greyscale as 8-bit L, scaled from the range its values use."""
    if img.mode.startswith("I"):
        arr = np.asarray(img).astype(np.float64).clip(0, None)
        top = float(arr.max(initial=0))
        bits = next((b for b in (8, 10, 12, 14, 16) if top < 2**b), 32)
        return Image.fromarray(np.round(arr * (255 / (2**bits - 1))).clip(0, 255).astype(np.uint8), mode="L")
    if img.mode == "F":
        arr = np.nan_to_num(np.asarray(img, dtype=np.float64))
        low, high = float(arr.min(initial=0)), float(arr.max(initial=0))
        if low >= 0 and high <= 1:
            low, high = 0.0, 1.0
        elif low >= 0 and high <= 255:
            low, high = 0.0, 255.0
        span = high - low or 1.0
        return Image.fromarray(np.round((arr - low) * (255 / span)).clip(0, 255).astype(np.uint8), mode="L")
    return img


def flatten(img: Image.Image) -> Image.Image:
    """Palette images expanded and transparency composited onto white; L, RGB and CMYK stay as they are."""
    img = scale_depth(img)
    if img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    if img.mode == "PA":
        img = img.convert("RGBA")
    if img.mode in ("LA", "RGBA", "La", "RGBa"):
        background = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, img.convert("RGBA")).convert("RGB")
    if img.mode not in ("L", "RGB", "CMYK"):
        img = img.convert("RGB")
    return img


def to_srgb(img: Image.Image, icc: bytes | None) -> Image.Image:
    """RGB in sRGB: through the image's ICC profile when it has a usable one, else as it is."""
    if icc:
        key = (hashlib.sha1(icc).digest(), img.mode)
        try:
            if key not in _TRANSFORMS:
                source = ImageCms.ImageCmsProfile(io.BytesIO(icc))
                _TRANSFORMS[key] = ImageCms.buildTransform(source, _SRGB, img.mode, "RGB")
                if len(_TRANSFORMS) > _MAX_TRANSFORMS:
                    _TRANSFORMS.popitem(last=False)
            _TRANSFORMS.move_to_end(key)
            return ImageCms.applyTransform(img, _TRANSFORMS[key])
        except (ImageCms.PyCMSError, OSError, ValueError):
            pass  # a broken or mismatched profile: the pixels are still good, taken as sRGB
    return img.convert("RGB")


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode as RGB (deep and float images scaled, transparency on white, ICC profile applied)."""
    return to_srgb(flatten(img), img.info.get("icc_profile"))


def resize_center_square(img: Image.Image, size: int, max_pixels: int | None = None) -> Image.Image:
    """Resize the short side to `size` (aspect kept), then keep the centre `size` square.

    When the resized whole would hold more than `max_pixels` (a strip: 1 x 80M pixels upscaled 32x
    is 7.7 GB), only the centre square of the source is resized. Images under that bound take the
    first path; above it they used to run out of memory.
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


def _unrecognised(path: str) -> str:
    """Why a file no decoder took is not an image: a format whose decoder is missing says which."""
    name, available, install = _NEEDS.get(Path(path).suffix.lower(), (None, True, ""))
    if not available:
        return f"{name} needs a decoder this environment lacks ({install})"
    return "not an image (unrecognised format)"


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
                icc = img.info.get("icc_profile")
                img = resize_center_square(flatten(ImageOps.exif_transpose(img)), size, max_pixels)
                array = np.asarray(to_srgb(img, icc), dtype=np.uint8).copy()  # on the small image: cheap
    except UnidentifiedImageError:
        return Decoded(path, digest, None, _unrecognised(path))
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        return Decoded(path, digest, None, f"corrupt or truncated: {exc}")
    except Exception as exc:  # noqa: BLE001 - Pillow and its EXIF parser raise TypeError, KeyError, ZeroDivisionError...
        return Decoded(path, digest, None, f"cannot be decoded: {type(exc).__name__}: {exc}")
    return Decoded(path, digest, array)

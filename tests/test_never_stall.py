"""A prepare that never stalls: a file that kills or hangs its decoder is listed, not fatal; HEIC and
AVIF decode (or are listed with the package to install); colour profiles, deep and float images; the
decoders' versions in the store's recipe."""

import json
import struct
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageCms

from cnnpipe.config import DataConfig
from cnnpipe.data.ingest.decode import decode_file, decoder_versions
from cnnpipe.data.prepare import prepare
from conftest import colour_image, meta_lines, save_image

# Loaded by every decoding worker at start-up (PYTHONPATH): a Pillow plugin for files that begin with
# a magic word, standing in for a codec that crashes or loops on one file. Nothing in cnnpipe knows it.
SITE = '''
import os, signal, sys
{extra}
from PIL import Image, ImageFile

class Poison(ImageFile.ImageFile):
    format = "POISON"

    def _open(self):
        magic = self.fp.read(8)
        if magic == b"SEGFAULT":
            os.kill(os.getpid(), signal.SIGSEGV)
        while magic == b"HANGHANG":  # a codec stuck in a loop
            pass
        raise SyntaxError("not poison")

Image.register_open("POISON", Poison, lambda prefix: prefix[:8] in (b"SEGFAULT", b"HANGHANG"))
'''


@pytest.fixture
def poisoned_workers(tmp_path, monkeypatch):
    """Decoding workers that load the poison plugin (and, given `extra`, more start-up code)."""
    def install(extra: str = "") -> None:
        site = tmp_path / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(SITE.format(extra=extra))
        monkeypatch.setenv("PYTHONPATH", f"{site}:{Path(__file__).resolve().parents[1] / 'src'}")
    return install


def _catalog(root: Path, n: int = 20) -> None:
    for i in range(n):
        save_image(root / ("shoes" if i % 2 else "bags") / f"{i:03d}.png", colour_image(i, (16, 16)))


def _stored(store: Path) -> set[str]:
    return {meta["source"] for split in ("train", "val", "test")
            for meta in meta_lines(store, split)}


def test_a_file_that_kills_its_decoder_is_retried_alone_then_listed_and_prepare_finishes(tmp_path, poisoned_workers):
    poisoned_workers()
    root = tmp_path / "catalog"
    _catalog(root, 60)
    (root / "shoes" / "crash.png").write_bytes(b"SEGFAULT" + bytes(100))
    cfg = DataConfig(source=str(root), stored_size=8, image_size=8, prepare_workers=2)
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    assert [b["path"] for b in report["bad_files"]] == ["shoes/crash.png"]
    reason = report["bad_files"][0]["reason"]
    assert "failed twice, the second time alone" in reason and reason.count("SIGSEGV") == 2
    assert len(_stored(tmp_path / "p")) == 60
    again = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")  # unchanged: not tried a third time
    assert again["work"]["read"] == 0 and again["bad_files"] == report["bad_files"]


def test_a_file_that_hangs_its_decoder_is_listed_after_its_time_limit(tmp_path, poisoned_workers):
    poisoned_workers()
    root = tmp_path / "catalog"
    _catalog(root)
    (root / "bags" / "loop.png").write_bytes(b"HANGHANG" + bytes(100))
    cfg = DataConfig(source=str(root), stored_size=8, image_size=8, prepare_workers=1, decode_timeout_s=2)
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    assert [b["path"] for b in report["bad_files"]] == ["bags/loop.png"]
    assert report["bad_files"][0]["reason"].count("over data.decode_timeout_s=2 s") == 2
    assert len(_stored(tmp_path / "p")) == 20


def _heic_manifest(export: Path) -> Path:
    import pillow_heif  # noqa: F401 - registers the HEIF writer too

    _catalog(export / "img")
    Image.fromarray(colour_image(99, (30, 20))).save(export / "img" / "iphone.heic")
    Image.fromarray(colour_image(98, (30, 20))).save(export / "img" / "web.avif")
    rows = [f"img/{p.parent.name}/{p.name},{p.parent.name}," for p in sorted((export / "img").glob("*/*.png"))]
    rows += ["img/iphone.heic,shoes,", "img/web.avif,bags,"]
    (export / "catalog.csv").write_text("\n".join(rows) + "\n")
    return export / "catalog.csv"


def test_heic_and_avif_manifest_rows_are_decoded(tmp_path):
    manifest = _heic_manifest(tmp_path / "export")
    report = prepare(DataConfig(source=str(manifest), stored_size=8, image_size=8, prepare_workers=1), 0,
                     tmp_path / "p", tmp_path / "r.json")
    assert report["num_bad"] == 0 and {"img/iphone.heic", "img/web.avif"} <= _stored(tmp_path / "p")
    assert json.loads((tmp_path / "p" / "recipe.json").read_text())["decoders"]["pillow_heif"] is not None


def test_a_heic_row_without_its_decoder_is_listed_with_the_package_not_fatal(tmp_path, poisoned_workers):
    poisoned_workers("sys.modules['pillow_heif'] = None  # as if it were not installed")
    manifest = _heic_manifest(tmp_path / "export")
    report = prepare(DataConfig(source=str(manifest), stored_size=8, image_size=8, prepare_workers=1), 0,
                     tmp_path / "p", tmp_path / "r.json")
    assert [b["path"] for b in report["bad_files"]] == ["img/iphone.heic"]
    assert "pip install pillow-heif" in report["bad_files"][0]["reason"]
    assert "img/web.avif" in _stored(tmp_path / "p")


def display_p3() -> bytes:
    """A Display P3 profile: sRGB's (same tone curves, same white) with P3's primaries (D50-adapted)."""
    data = bytearray(ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes())
    primaries = {b"rXYZ": (0.5151, 0.2412, -0.0011), b"gXYZ": (0.2920, 0.6922, 0.0419),
                 b"bXYZ": (0.1571, 0.0666, 0.7841)}
    (count,) = struct.unpack(">I", data[128:132])
    for k in range(count):
        tag, offset, _ = struct.unpack(">4sII", data[132 + 12 * k : 144 + 12 * k])
        if tag in primaries:  # an XYZType: 'XYZ ', 4 reserved bytes, three s15Fixed16 numbers
            data[offset + 8 : offset + 20] = struct.pack(">3i", *(round(v * 65536) for v in primaries[tag]))
    return bytes(data)


def test_a_photo_with_a_colour_profile_is_converted_to_srgb(tmp_path):
    """A Display P3 phone photo's values mean P3 colours: in sRGB they are other numbers."""
    colour = (200, 120, 80)
    flat = Image.new("RGB", (40, 30), colour)
    p3 = ImageCms.ImageCmsProfile(BytesIO(display_p3()))
    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB"))
    flat.save(tmp_path / "p3.png", icc_profile=display_p3())
    flat.save(tmp_path / "srgb.png", icc_profile=srgb.tobytes())
    flat.save(tmp_path / "plain.png")
    expected = np.asarray(ImageCms.profileToProfile(flat, p3, srgb, outputMode="RGB"))[0, 0].astype(int)
    assert np.abs(expected - colour).max() > 10  # P3 and sRGB differ here
    assert np.abs(decode_file(tmp_path / "p3.png", 8, 10**6).image.astype(int) - expected).max() <= 1
    for name in ("srgb.png", "plain.png"):  # sRGB, or no profile (taken as sRGB): as they are
        assert np.abs(decode_file(tmp_path / name, 8, 10**6).image.astype(int) - colour).max() <= 1


def test_a_12_bit_scan_and_a_float_image_are_scaled_from_their_range(tmp_path):
    ramp = (np.arange(40 * 40).reshape(40, 40) * 4095 // (40 * 40 - 1)).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "scan12.tif")  # 12-bit values in a 16-bit file
    Image.fromarray(ramp.astype(np.float32) / 4095).save(tmp_path / "depth.tif")  # float in [0, 1]
    for name in ("scan12.tif", "depth.tif"):
        image = decode_file(tmp_path / name, 40, 10**6).image
        assert image.max() >= 250 and image.min() <= 5, name  # the whole range, not near black
        assert abs(int(image[..., 0].mean()) - 127) <= 3


def test_new_decoder_versions_decode_every_image_again(tmp_path):
    root = tmp_path / "catalog"
    _catalog(root)
    cfg = DataConfig(source=str(root), stored_size=8, image_size=8, prepare_workers=1)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    recipe = json.loads((tmp_path / "p" / "recipe.json").read_text())
    assert recipe["decoders"] == json.loads(json.dumps(decoder_versions())) and recipe["decoders"]["pillow"]
    recipe["decoders"]["libjpeg_turbo"] = "0.0.1"  # the store was made by another libjpeg
    (tmp_path / "p" / "recipe.json").write_text(json.dumps(recipe))
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    assert report["work"]["decoded"] == 20 and report["changes"]["moved_between_splits"] == 0

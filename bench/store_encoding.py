"""Benchmark: what each encoding of the prepared store costs, in bytes and in decode time, on real photos.

The photos are real photographs that installed packages ship (scikit-image's sample data, from the
`bench` extra; scikit-learn's sample images; matplotlib's sample data), or `--photos DIR`. Each is
cut into squares at four scales and up to nine positions, never upsampled, and resized to the
stored size with prepare's bicubic filter. For each `--sizes` the first section prints bytes per
image raw and as JPEG at `--quality` (and the PSNR), the store of 1.28M such photos, and the images
one core decodes a second: raw as the fast loader's gather (batches of 256 sorted random rows of a
memory-mapped shard), JPEG through `codec.decode_batch` (the store's decoder, into the batch array)
and through each libjpeg-turbo binding that imports here (simplejpeg, Pillow, torchvision.io on the
CPU, PyTurboJPEG), and whether they all give the same pixels. Decoders are timed in interleaved
rounds on this thread's CPU clock (the machine is shared): images per CPU-second, median and best
round.

`--device cuda` adds nvJPEG's batch decode (`codec.decode_batch_on`, batches of 256 from pinned
memory; img/s of the whole GPU). `--crossover` prints the table `codec.MEASURED` holds (16-448 px,
colour and grayscale, and Fashion-MNIST when its package is installed) with `auto`'s verdict;
`--settings` weighs the encoder's settings (4:4:4 chroma, default Huffman tables) against the codec's;
`--project` the store, the DVC remote and a node's pull time for 1.28M and 10M photos at the largest
size. Writes bench_out/store_encoding.json.

    python bench/store_encoding.py                         # 64/128/160/224 px, quality 90
    python bench/store_encoding.py --crossover --project
    PYTHONPATH=src:/path/to/pyturbojpeg python bench/store_encoding.py --sizes 224
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image

from cnnpipe.data.store import codec
from cnnpipe.data.ingest.decode import to_rgb

# Photographs (not scans, charts or micrographs) in packages the project installs: (package, path).
PACKAGE_PHOTOS = [
    ("skimage", "data/astronaut.png"), ("skimage", "data/chelsea.png"), ("skimage", "data/coffee.png"),
    ("skimage", "data/motorcycle_left.png"), ("skimage", "data/motorcycle_right.png"), ("skimage", "data/rocket.jpg"),
    ("sklearn", "datasets/images/china.jpg"), ("sklearn", "datasets/images/flower.jpg"),
    ("matplotlib", "mpl-data/sample_data/grace_hopper.jpg"),
]
SCALES = (1.0, 0.8, 0.64, 0.5)
_PIL_MODES = {1: "L", 3: "RGB"}
BATCH = 256
CATALOGS = (1_280_000, 10_000_000)
LINKS_GBIT = (1, 10)


def find_photos(folder: Path | None) -> list[Path]:
    """The photo files: every image under `folder`, or those of PACKAGE_PHOTOS that are installed."""
    if folder is not None:
        return sorted(p for p in folder.rglob("*") if p.suffix.lower() in {".jpg", ".jpeg", ".png", ".webp"})
    found = []
    for package, rel in PACKAGE_PHOTOS:
        spec = importlib.util.find_spec(package)
        folders = (spec.submodule_search_locations or []) if spec else []
        if folders and (path := Path(folders[0]) / rel).exists():
            found.append(path)
    return found


def squares(photo: Image.Image, size: int) -> list[np.ndarray]:
    """`size` px squares of `photo`: at each scale of its short side, up to 3x3 positions, none upsampled."""
    w, h = photo.size
    boxes = set()
    for scale in SCALES:
        side = int(scale * min(w, h))
        if side < size:
            continue
        for fx in (0.0, 0.5, 1.0):
            for fy in (0.0, 0.5, 1.0):
                boxes.add((round(fx * (w - side)), round(fy * (h - side)), side))
    return [np.asarray(photo.resize((size, size), Image.Resampling.BICUBIC, box=(x, y, x + s, y + s), reducing_gap=3.0))
            for x, y, s in sorted(boxes)]


def photo_set(photos: list[Image.Image], size: int, channels: int) -> np.ndarray:
    """(N, size, size, channels) uint8: the squares of every photo (grayscale by luma for 1 channel)."""
    images = [im for p in photos for im in squares(p if channels == 3 else p.convert("L"), size)]
    return np.stack(images).reshape(len(images), size, size, channels)


def fashion_mnist(size: int, n: int = 2000) -> np.ndarray | None:
    """The first `n` Fashion-MNIST test images at `size` px, resized as prepare does; None without the data."""
    from cnnpipe.data.sources import idx

    try:
        images, _ = idx.load_split(idx.locate(), "test")
    except idx.DatasetMissing:
        return None
    x = torch.from_numpy(np.array(images[:n])).float()[:, None]
    x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


# --------------------------------------------------------------------------- decoders
def decoders(channels: int) -> tuple[dict[str, Callable[[bytes], np.ndarray]], dict[str, str]]:
    """{name: bytes -> (H, W, C) uint8} of each libjpeg-turbo binding that imports, and why others do not."""
    found: dict[str, Callable[[bytes], np.ndarray]] = {}
    missing: dict[str, str] = {}
    import simplejpeg

    space = "GRAY" if channels == 1 else "RGB"
    found["simplejpeg"] = lambda d: simplejpeg.decode_jpeg(d, space)
    def pillow(data: bytes) -> np.ndarray:
        image = Image.open(io.BytesIO(data))
        return np.asarray(image if image.mode == _PIL_MODES[channels] else image.convert(_PIL_MODES[channels]))

    found["Pillow"] = pillow
    from torchvision.io import ImageReadMode, decode_jpeg

    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
    found["torchvision"] = lambda d: decode_jpeg(torch.frombuffer(bytearray(d), dtype=torch.uint8),
                                                 mode=mode).permute(1, 2, 0).numpy()
    try:
        import turbojpeg

        tj, fmt = turbojpeg.TurboJPEG(), turbojpeg.TJPF_GRAY if channels == 1 else turbojpeg.TJPF_RGB
        found["PyTurboJPEG"] = lambda d: tj.decode(d, pixel_format=fmt)
    except Exception as exc:  # noqa: BLE001 - not installed, or its system libturbojpeg missing
        missing["PyTurboJPEG"] = f"{type(exc).__name__}: {exc}"
    return found, missing


def rates(work: dict[str, Callable[[], int]], rounds: int, seconds: float = 0.2,
          clock: Callable[[], float] = time.thread_time) -> dict[str, list[float]]:
    """Images per second of `clock` of each `work` (a callable doing a pass and returning its image
    count), in `rounds` interleaved rounds of about `seconds` each, after one warm-up pass.

    The clock is this thread's CPU time: images per CPU-second of one core, which other processes on
    a shared machine do not inflate the way they inflate wall time (caches and memory bandwidth they
    still share). A device's work is timed on the wall clock (`time.perf_counter`)."""
    passes = {}
    for name, fn in work.items():
        t0 = clock()
        fn()
        passes[name] = max(1, int(seconds / max(clock() - t0, 1e-6)))
    out: dict[str, list[float]] = {name: [] for name in work}
    for _ in range(rounds):
        for name, fn in work.items():
            t0 = clock()
            images = sum(fn() for _ in range(passes[name]))
            out[name].append(images / (clock() - t0))
    return out


def raw_gather(images: np.ndarray, scratch: Path) -> Callable[[], int]:
    """One pass of the fast loader's raw read: batches of BATCH sorted random rows of a memory-mapped shard."""
    path = scratch / f"raw-{images.shape[1]}-{images.shape[3]}.u8"
    images.tofile(path)
    shard = np.memmap(path, dtype=np.uint8, mode="r", shape=images.shape).view(np.ndarray)
    rng = np.random.default_rng(0)
    batches = [np.sort(rng.integers(0, len(images), BATCH)) for _ in range(max(1, len(images) // BATCH))]
    return lambda: sum(len(shard[b]) for b in batches)


def device_decode(records: list[bytes], frame: tuple[int, ...], device: str) -> Callable[[], int]:
    """One pass of `codec.decode_batch_on` over `records` in batches of BATCH (nvJPEG on CUDA, from
    pinned buffers as the loader hands them), waiting for the device at the end."""
    cuda = torch.device(device).type == "cuda"
    batches = []
    for start in range(0, len(records), BATCH):
        buffer, offsets = codec.pack(records[start : start + BATCH])
        tensor = torch.from_numpy(buffer.copy())
        batches.append((tensor.pin_memory() if cuda else tensor, offsets))

    def run() -> int:
        n = sum(len(codec.decode_batch_on(b, o, frame, device)) for b, o in batches)
        if cuda:
            torch.cuda.synchronize()
        return n

    return run


# --------------------------------------------------------------------------- sections
def encoding_table(photos: list[Image.Image], args: argparse.Namespace, scratch: Path) -> list[dict]:
    """Bytes, PSNR and decode img/s per core of each encoding at each size (colour photos)."""
    rows = []
    for size in args.sizes:
        images = photo_set(photos, size, 3)
        records = [codec.encode(im, args.quality) for im in images]
        buffer, offsets = codec.pack(records)
        frame = images.shape[1:]
        reference = codec.decode_batch(buffer, offsets, frame)
        found, missing = decoders(3)
        same = {name: all(np.array_equal(fn(r), ref) for r, ref in zip(records, reference))
                for name, fn in found.items()}
        work = {"raw gather": raw_gather(images, scratch),
                "codec.decode_batch": lambda: len(codec.decode_batch(buffer, offsets, frame, out=reference))}
        work.update({name: (lambda fn=fn: sum(1 for r in records if fn(r) is not None)) for name, fn in found.items()})
        measured = rates(work, args.rounds)
        if args.device:  # the GPU's time, not this thread's: the wall clock, in rounds of their own
            measured.update(rates({f"decode_batch_on {args.device}": device_decode(records, frame, args.device)},
                                  args.rounds, clock=time.perf_counter))
        raw_b, jpeg_b = images[0].nbytes, float(np.mean([len(r) for r in records]))
        quality = [psnr(a, b) for a, b in zip(images, reference)]
        row = {"size": size, "images": len(images), "raw_bytes": raw_b, "jpeg_bytes": jpeg_b, "saving": raw_b / jpeg_b,
               "psnr_median": statistics.median(quality), "psnr_min": min(quality), "same_pixels": same,
               "missing": missing, "img_s": {k: {"median": statistics.median(v), "best": max(v), "rounds": v}
                                             for k, v in measured.items()}}
        rows.append(row)
        print(f"{size:>4} px: {len(images)} images, raw {raw_b / 1e3:.1f} KB, "
              f"JPEG q{args.quality} {jpeg_b / 1e3:.1f} KB "
              f"({raw_b / jpeg_b:.1f}x smaller; PSNR median {row['psnr_median']:.1f} dB, worst {row['psnr_min']:.1f}); "
              f"1.28M photos: {raw_b * 1.28e6 / 1e9:.1f} GB raw, {jpeg_b * 1.28e6 / 1e9:.1f} GB JPEG", flush=True)
        for name, r in row["img_s"].items():
            note = "" if name not in same else ("  same pixels" if same[name] else "  DIFFERENT pixels")
            print(f"      {name:>20}: {r['median']:>10,.0f} img/s per core (best {r['best']:,.0f}){note}", flush=True)
        for name, why in missing.items():
            print(f"      {name:>20}: not measured ({why})")
    print_markdown(rows, args.quality)
    return rows


def print_markdown(rows: list[dict], quality: int) -> None:
    names = list(rows[0]["img_s"])
    print(f"\n| stored size | raw | JPEG q{quality} | smaller by | PSNR (median) | 1.28M photos, raw / JPEG | "
          + " | ".join(f"{n} img/s" for n in names) + " |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in names) + " |")
    for r in rows:
        raw_gb, jpeg_gb = (r[k] * 1.28e6 / 1e9 for k in ("raw_bytes", "jpeg_bytes"))
        print(f"| {r['size']} px | {r['raw_bytes'] / 1e3:.1f} KB | {r['jpeg_bytes'] / 1e3:.1f} KB | "
              f"{r['saving']:.1f}x | {r['psnr_median']:.1f} dB | {raw_gb:,.1f} / {jpeg_gb:,.1f} GB | "
              + " | ".join(f"{r['img_s'][n]['median']:,.0f}" for n in names) + " |")


def crossover_table(photos: list[Image.Image], args: argparse.Namespace) -> list[dict]:
    """JPEG bytes and `codec.decode_batch` img/s per core (median round) from 16 to 448 px, and auto's verdict."""
    rows = []
    sets = [("photos", 3), ("photos, grayscale", 1), ("Fashion-MNIST", 1)]
    for size in args.crossover_sizes:
        for name, channels in sets:
            images = fashion_mnist(size) if name == "Fashion-MNIST" else photo_set(photos, size, channels)
            if images is None or not len(images):
                continue
            records = [codec.encode(im, args.quality) for im in images]
            buffer, offsets = codec.pack(records)
            out = np.empty(images.shape, np.uint8)
            one_pass = {"decode": lambda: len(codec.decode_batch(buffer, offsets, images.shape[1:], out))}
            img_s = statistics.median(rates(one_pass, args.rounds)["decode"])
            jpeg_b = float(np.mean([len(r) for r in records]))
            choice = codec.choose_encoding(size, channels, jpeg_bytes=jpeg_b, decode_img_s=img_s)
            rows.append({"set": name, "size": size, "channels": channels, "images": len(images),
                         "raw_bytes": images[0].nbytes, "jpeg_bytes": jpeg_b, "decode_img_s": img_s,
                         "verdict": choice.encoding, "reason": choice.reason})
            print(f"{size:>4} px {name:>18}: raw {images[0].nbytes:>7,} B, JPEG {jpeg_b:>8,.0f} B "
                  f"({choice.saving:4.1f}x), {img_s:>8,.0f} img/s per core -> {choice.encoding} ({choice.reason})",
                  flush=True)
    print("\nMEASURED = {")
    for channels, name in ((1, "photos, grayscale"), (3, "photos")):
        cells = [f"{r['size']}: ({r['jpeg_bytes']:.0f}, {r['decode_img_s']:.0f})," for r in rows if r["set"] == name]
        print(f"    {channels}: {{" + "".join(f"\n        {c}" for c in cells) + "\n    },")
    print("}")
    return rows


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:,.0f} min"


def settings_table(photos: list[Image.Image], args: argparse.Namespace) -> list[dict]:
    """The encoder's settings weighed: the codec's (4:2:0 chroma, optimised Huffman tables) against
    default tables and against full-resolution chroma (4:4:4): bytes, PSNR and decode img/s per core."""
    variants = {"codec (4:2:0, optimised)": None, "4:2:0, default tables": ("4:2:0", False),
                "4:4:4, optimised": ("4:4:4", True)}
    rows = []
    for size in args.sizes:
        images = photo_set(photos, size, 3)
        for name, setting in variants.items():
            if setting is None:
                records = [codec.encode(im, args.quality) for im in images]
            else:
                records = []
                for im in images:
                    out = io.BytesIO()
                    Image.fromarray(im).save(out, "JPEG", quality=args.quality, subsampling=setting[0],
                                             optimize=setting[1])
                    records.append(out.getvalue())
            buffer, offsets = codec.pack(records)
            decoded = codec.decode_batch(buffer, offsets, images.shape[1:])
            img_s = statistics.median(rates({"d": lambda: len(codec.decode_batch(buffer, offsets, images.shape[1:],
                                                                                   decoded))}, args.rounds)["d"])
            row = {"size": size, "setting": name, "jpeg_bytes": float(np.mean([len(r) for r in records])),
                   "psnr_median": statistics.median(psnr(a, b) for a, b in zip(images, decoded)), "img_s": img_s}
            rows.append(row)
            print(f"{size:>4} px {name:>26}: {row['jpeg_bytes']:>8,.0f} B, PSNR {row['psnr_median']:.1f} dB, "
                  f"{img_s:>7,.0f} img/s per core", flush=True)
    return rows


def projection(rows: list[dict]) -> list[dict]:
    """Store, DVC remote and a node's pull time for CATALOGS photos at the largest measured size."""
    r = max(rows, key=lambda r: r["size"])
    out = []
    print(f"\nAt {r['size']} px (raw {r['raw_bytes'] / 1e3:.1f} KB, JPEG {r['jpeg_bytes'] / 1e3:.1f} KB an image):")
    print("| photos | encoding | store = one copy in the DVC remote | +10% week | "
          + " | ".join(f"pull at {g} Gbit/s" for g in LINKS_GBIT) + " |")
    print("| ---: | --- | ---: | ---: | " + " | ".join("---:" for _ in LINKS_GBIT) + " |")
    for n in CATALOGS:
        for enc, per in (("raw", r["raw_bytes"]), ("jpeg", r["jpeg_bytes"])):
            total = n * per
            pulls = [total * 8 / (g * 1e9) for g in LINKS_GBIT]
            out.append({"photos": n, "encoding": enc, "bytes": total, "pull_s": dict(zip(LINKS_GBIT, pulls))})
            print(f"| {n / 1e6:g}M | {enc} | {total / 1e9:,.0f} GB | {total / 10 / 1e9:,.1f} GB | "
                  + " | ".join(duration(s) for s in pulls) + " |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 160, 224])
    parser.add_argument("--quality", type=int, default=codec.DEFAULT_QUALITY)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds per decoder")
    parser.add_argument("--photos", type=Path, default=None, help="a folder of photos instead of the packages' ones")
    parser.add_argument("--crossover", action="store_true", help="also the table behind auto (codec.MEASURED)")
    parser.add_argument("--crossover-sizes", type=int, nargs="+",
                        default=[16, 24, 32, 48, 64, 96, 128, 160, 224, 320, 448])
    parser.add_argument("--settings", action="store_true", help="also the encoder's settings weighed (4:4:4, tables)")
    parser.add_argument("--project", action="store_true", help="also the store and pull time for 1.28M and 10M photos")
    parser.add_argument("--device", default=None, help="also time codec.decode_batch_on there (cuda: nvJPEG, "
                        "whole-device img/s, not per core)")
    parser.add_argument("--skip-table", action="store_true", help="only the sections asked for")
    args = parser.parse_args()
    torch.set_num_threads(1)  # per core: the loader's workers are one process and one thread each
    paths = find_photos(args.photos)
    if not paths:
        print("no photos: install the bench extra (pip install -e .[bench]) or pass --photos DIR", file=sys.stderr)
        return 1
    photos = [to_rgb(Image.open(p)) for p in paths]
    print(f"{len(photos)} photos ({', '.join(f'{p.name} {im.size[0]}x{im.size[1]}' for p, im in zip(paths, photos))}); "
          f"JPEG quality {args.quality}; one core, {args.rounds} interleaved rounds")
    result: dict = {"photos": [str(p) for p in paths], "quality": args.quality}
    with tempfile.TemporaryDirectory(prefix="store_encoding_") as scratch:
        if not args.skip_table:
            result["table"] = encoding_table(photos, args, Path(scratch))
        if args.settings:
            result["settings"] = settings_table(photos, args)
        if args.crossover:
            result["crossover"] = crossover_table(photos, args)
        if args.project and result.get("table"):
            result["projection"] = projection(result["table"])
    Path("bench_out").mkdir(exist_ok=True)
    Path("bench_out/store_encoding.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

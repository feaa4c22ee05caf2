"""The store's JPEG codec: round trip within JPEG's tolerance, one channel stays one, batches decode
exactly as single images, the GPU path's batching, and what `auto` picks.

The photos are scikit-learn's two sample photographs (shipped in its wheel), cut into squares the
way prepare stores them. PSNR at quality 90 on these squares measured 30.2-34.0 dB in colour (chroma
is stored at half resolution, 4:2:0) and 37.9-41.6 dB in grayscale; the tests assert 28 and 35 dB.
"""

from __future__ import annotations

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image
from sklearn.datasets import load_sample_image

from cnnpipe.data.store import codec
from cnnpipe.data.loaders.transforms import AugmentConfig, FastTransform

COLOUR_DB, GRAY_DB = 28.0, 35.0
BOXES = [(0, 0, 427, 427), (106, 0, 533, 427), (213, 0, 640, 427), (100, 50, 300, 250)]


def photo_squares(size: int, channels: int = 3) -> np.ndarray:
    """(8, size, size, channels): four squares of each of scikit-learn's two photos, bicubic as prepare."""
    squares = []
    for name in ("china.jpg", "flower.jpg"):
        photo = Image.fromarray(load_sample_image(name))
        photo = photo if channels == 3 else photo.convert("L")
        squares += [np.asarray(photo.resize((size, size), Image.Resampling.BICUBIC, box=box)) for box in BOXES]
    return np.stack(squares).reshape(len(squares), size, size, channels)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(255.0**2 / np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)))


@pytest.mark.parametrize("size", [64, 128])
def test_round_trip_is_within_jpeg_tolerance(size):
    images = photo_squares(size)
    for image in images:
        back = codec.decode(codec.encode(image, 90), 3)
        assert back.shape == image.shape and back.dtype == np.uint8
        assert psnr(image, back) >= COLOUR_DB
    # quality buys fidelity with bytes, in order
    image = images[0]
    records = [codec.encode(image, q) for q in (50, 90, 95)]
    by_quality = [(len(r), psnr(image, codec.decode(r, 3))) for r in records]
    assert [b for b, _ in by_quality] == sorted(b for b, _ in by_quality)
    assert [p for _, p in by_quality] == sorted(p for _, p in by_quality)


def test_grayscale_stays_one_channel():
    images = photo_squares(64, channels=1)
    for image in images:
        data = codec.encode(image, 90)
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        assert (height, width, colorspace) == (64, 64, "Gray")  # one component in the file, not three
        back = codec.decode(data, 1)
        assert back.shape == (64, 64, 1)
        assert psnr(image, back) >= GRAY_DB
    colour = photo_squares(64)[0]
    assert len(codec.encode(images[0])) < len(codec.encode(colour))


def test_encoding_is_deterministic():
    # the same pixels and quality give the same bytes: a store grown week by week and one built at
    # once hold the same records, and DVC dedupes them
    image = photo_squares(32)[3]
    assert codec.encode(image.copy(), 90) == codec.encode(image, 90)
    assert codec.encode(image, 90) != codec.encode(image, 89)


def test_batch_decode_equals_per_image_decode_exactly():
    images = photo_squares(48)
    records = [codec.encode(im, q) for im, q in zip(images, [90, 50, 95, 75, 90, 10, 100, 90])]
    buffer, offsets = codec.pack(records)
    assert offsets[0] == 0 and offsets[-1] == len(buffer) == sum(map(len, records))
    single = np.stack([codec.decode(r, 3) for r in records])
    assert np.array_equal(codec.decode_batch(buffer, offsets, (48, 48, 3)), single)
    out = np.zeros_like(single)
    assert codec.decode_batch(buffer, offsets, (48, 48, 3), out=out) is out and np.array_equal(out, single)
    # a run of records inside a bigger buffer (a shard): offsets need not start at 0
    assert np.array_equal(codec.decode_batch(buffer, offsets[2:6], (48, 48, 3)), single[2:5])
    assert codec.decode_batch(buffer, offsets[:1], (48, 48, 3)).shape == (0, 48, 48, 3)
    assert codec.decode_batch(*codec.pack([]), (48, 48, 3)).shape == (0, 48, 48, 3)
    assert np.array_equal(codec.decode_batch(buffer.tobytes(), offsets, (48, 48, 3)), single)  # bytes read from a file


def test_batch_decode_names_the_record_that_fails():
    images = photo_squares(32)
    records = [codec.encode(im) for im in images[:3]]
    for bad, words in [(records[1][: len(records[1]) // 2], "do not decode"),
                       (codec.encode(photo_squares(40)[0]), "(32, 32, 3)"),
                       (b"not a jpeg at all", "do not decode")]:
        buffer, offsets = codec.pack([records[0], bad, records[2]])
        with pytest.raises(codec.RecordError, match=r"record 1 of the batch") as caught:
            codec.decode_batch(buffer, offsets, (32, 32, 3))
        assert caught.value.index == 1 and words in str(caught.value)
    smaller = codec.encode(photo_squares(24)[0])
    with pytest.raises(codec.RecordError, match=r"decoded to \(24, 24, 3\)"):
        codec.decode_batch(*codec.pack([smaller]), (32, 32, 3))
    with pytest.raises(ValueError, match="offsets must rise"):
        codec.decode_batch(*codec.pack(records)[:1], np.array([0, 50, 10]), (32, 32, 3))
    with pytest.raises(ValueError, match="1 or 3 channels"):
        codec.encode(np.zeros((8, 8, 4), np.uint8))


def test_quality_and_encoding_errors_name_the_param():
    with pytest.raises(ValueError, match=r"data.quality = 0 .*\[1, 100\]"):
        codec.encode(photo_squares(16)[0], 0)
    with pytest.raises(ValueError, match=r"data.quality = 90.5"):
        codec.check_quality(90.5)
    with pytest.raises(ValueError, match=r"data.encoding = 'png' .*raw \| jpeg \| auto"):
        codec.resolve_encoding("png", 32, 1)


# --------------------------------------------------------------------------- the GPU path
def test_device_batch_decode_on_the_cpu_matches_the_store_decoder():
    # torchvision's decode_jpeg on the CPU device runs the same batching as on CUDA; both it and
    # simplejpeg are libjpeg-turbo with the accurate IDCT and smooth upsampling, so the pixels agree
    for channels in (1, 3):
        images = photo_squares(40, channels)
        buffer, offsets = codec.pack([codec.encode(im) for im in images])
        frame = (40, 40, channels)
        on_device = codec.decode_batch_on(torch.from_numpy(buffer.copy()), torch.from_numpy(offsets), frame, "cpu")
        assert on_device.shape == (8, *frame) and on_device.dtype == torch.uint8
        assert np.array_equal(on_device.numpy(), codec.decode_batch(buffer, offsets, frame))
        assert codec.decode_batch_on(buffer, offsets[:1], frame, "cpu").shape == (0, *frame)


def test_device_batch_is_one_call_with_the_whole_list(monkeypatch):
    import torchvision.io

    calls = []

    def fake_decode_jpeg(inputs, mode, device):
        calls.append((inputs, mode, device))
        # (C, H, W) images whose pixels say which record they came from
        return [torch.full((1, 8, 8), int(t[0]), dtype=torch.uint8, device=device) for t in inputs]

    monkeypatch.setattr(torchvision.io, "decode_jpeg", fake_decode_jpeg)
    records = [bytes([10 + i]) * (3 + i) for i in range(5)]  # lengths 3..7: the offsets must be used
    buffer, offsets = codec.pack(records)
    batch = codec.decode_batch_on(buffer, offsets, (8, 8, 1), "cpu")
    assert len(calls) == 1  # one nvJPEG batch, not one call per image
    inputs, mode, device = calls[0]
    assert [bytes(t.numpy()) for t in inputs] == records
    assert all(t.dtype == torch.uint8 and t.device.type == "cpu" and t.dim() == 1 for t in inputs)
    assert mode == torchvision.io.ImageReadMode.GRAY and device == torch.device("cpu")
    assert batch.shape == (5, 8, 8, 1) and batch[:, 0, 0, 0].tolist() == [10, 11, 12, 13, 14]
    nchw = batch.permute(0, 3, 1, 2)  # what loaders.to_nchw does: back to the stacked tensor
    assert nchw.is_contiguous()
    # a record nvJPEG decodes to the wrong size is named
    monkeypatch.setattr(torchvision.io, "decode_jpeg", lambda inputs, mode, device: [
        torch.zeros((1, 8, 8) if i != 3 else (1, 8, 9), dtype=torch.uint8) for i, _ in enumerate(inputs)])
    with pytest.raises(codec.RecordError, match=r"record 3 of the batch: decoded to \(1, 8, 9\)"):
        codec.decode_batch_on(buffer, offsets, (8, 8, 1), "cpu")


@pytest.mark.parametrize("train", [False, True])
def test_device_batches_feed_the_fast_transform_unchanged(train):
    images = photo_squares(48)
    buffer, offsets = codec.pack([codec.encode(im) for im in images])
    aug = AugmentConfig(image_size=32)

    def transformed(batch: torch.Tensor) -> torch.Tensor:
        transform = FastTransform(aug, (0.5,) * 3, (0.25,) * 3, train=train, channels_last=True, seed=3)
        return transform(batch)

    from_workers = transformed(torch.from_numpy(codec.decode_batch(buffer, offsets, (48, 48, 3))))
    from_device = transformed(codec.decode_batch_on(buffer, offsets, (48, 48, 3), "cpu"))
    assert from_device.shape == (8, 3, 32, 32)
    torch.testing.assert_close(from_device, from_workers, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("channels", [1, 3])
def test_nvjpeg_batch_decode_on_cuda(channels):
    images = photo_squares(128, channels)
    buffer, offsets = codec.pack([codec.encode(im) for im in images])
    frame = (128, 128, channels)
    gpu = codec.decode_batch_on(torch.from_numpy(buffer.copy()).pin_memory(), offsets, frame, "cuda")
    assert gpu.device.type == "cuda" and gpu.shape == (8, *frame) and gpu.dtype == torch.uint8
    cpu = codec.decode_batch(buffer, offsets, frame)
    # nvJPEG's IDCT and upsampling are not libjpeg's: close, not equal
    for a, b in zip(gpu.cpu().numpy(), cpu):
        assert psnr(a, b) >= 40.0
    transform = FastTransform(AugmentConfig(image_size=224), (0.5,) * 3, (0.25,) * 3, train=True, channels_last=True,
                              seed=0)
    x = transform(gpu)
    assert x.shape == (8, channels, 224, 224) and x.is_cuda and torch.isfinite(x).all()


# --------------------------------------------------------------------------- auto
def test_auto_keeps_the_default_fashion_mnist_store_raw():
    choice = codec.auto_encoding(32, 1)
    assert choice.encoding == "raw" and "under 2x" in choice.reason
    assert codec.resolve_encoding("auto", 32, 1) == "raw"


def test_auto_stores_128px_photos_as_jpeg():
    choice = codec.auto_encoding(128, 3)
    assert choice.encoding == "jpeg" and choice.saving > 5
    assert codec.resolve_encoding("auto", 128, 3) == "jpeg"
    assert codec.resolve_encoding("raw", 128, 3) == "raw" and codec.resolve_encoding("jpeg", 32, 1) == "jpeg"


def test_auto_agrees_with_the_bytes_of_real_images():
    # the rule on bytes measured here rather than on the table: the photos at 128 px save far more
    # than 2x; Fashion-MNIST's own images at 32 px (when its package is installed) save less
    photos = photo_squares(128)
    jpeg_bytes = np.mean([len(codec.encode(im)) for im in photos])
    decode_img_s = codec.measured_costs(128, 3)[1]
    assert codec.choose_encoding(128, 3, jpeg_bytes=jpeg_bytes, decode_img_s=decode_img_s).encoding == "jpeg"
    from cnnpipe.data.sources import idx

    try:
        fmnist, _ = idx.load_split(idx.locate(), "test")
    except idx.DatasetMissing:
        pytest.skip("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")
    x = torch.nn.functional.interpolate(torch.from_numpy(np.array(fmnist[:500])).float()[:, None], size=(32, 32),
                                       mode="bilinear", antialias=True, align_corners=False)
    small = x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    fm_bytes = np.mean([len(codec.encode(im)) for im in small])
    choice = codec.choose_encoding(32, 1, jpeg_bytes=fm_bytes, decode_img_s=codec.measured_costs(32, 1)[1])
    assert choice.encoding == "raw" and 1.5 < choice.saving < 2


def test_choose_encoding_weighs_the_saving_and_the_decode_rate():
    def pick(**kw):
        return codec.choose_encoding(128, 3, **{"jpeg_bytes": 6000.0, "decode_img_s": 5000.0, **kw})

    assert pick().encoding == "jpeg"
    assert pick(jpeg_bytes=49152 / 1.9).encoding == "raw"  # saves under 2x
    slow = pick(decode_img_s=800.0)  # 8 cores x 800 = 6,400 img/s, under the 6,833 training needs
    assert slow.encoding == "raw" and "decode 6,400 img/s" in slow.reason
    assert pick(decode_img_s=800.0, loader_cores=16).encoding == "jpeg"


def test_measured_costs_interpolate_the_table():
    for channels, table in codec.MEASURED.items():
        for size, (jpeg_bytes, img_s) in table.items():
            assert codec.measured_costs(size, channels) == pytest.approx((jpeg_bytes, img_s))
        sizes = sorted(table)
        between = codec.measured_costs((sizes[2] + sizes[3]) // 2, channels)
        assert table[sizes[2]][0] < between[0] < table[sizes[3]][0]
        # bigger images: more bytes, fewer decodes a second, also past the table's ends
        assert codec.measured_costs(8, channels)[0] < table[sizes[0]][0]
        assert codec.measured_costs(512, channels)[1] < table[sizes[-1]][1]

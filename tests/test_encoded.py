"""The device-decode path: batches of JPEG records, decoded where training runs, feeding the same
on-device transform as the CPU path's uint8 batches. The batching is tested on the CPU (torchvision's
CPU decoder stands in for nvJPEG: the same call, the same pixels); the CUDA test runs where CUDA exists."""

import numpy as np
import pytest
import torch

from cnnpipe.config import DataConfig
from cnnpipe.data.encoded import EncodedBatch, build_device_decoded_loader, gather_records
from cnnpipe.data.loaders import AugmentConfig, build_train_loader
from cnnpipe.data.prepare import prepare
from cnnpipe.data.store import open_split
from test_jpeg_store import make_photos, psnr

LOADER = dict(batch_size=16, aug=AugmentConfig(24), mean=(0.5,) * 3, std=(0.25,) * 3, seed=3)


@pytest.fixture(scope="module")
def jpeg_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoded")
    make_photos(root / "catalog", 0, 90, side=36)
    cfg = DataConfig(source=str(root / "catalog"), stored_size=32, prepare_workers=1, shard_mb=0.02, encoding="jpeg")
    prepare(cfg, 0, root / "p", root / "r.json")
    return root / "p"


def test_a_batchs_records_are_the_stored_records_of_its_rows(jpeg_store):
    split = open_split(jpeg_store, "train")
    rows = np.array([len(split) - 1, 0, 5, 5])
    buffer, offsets = gather_records(split.images, rows)
    assert offsets[0] == 0 and offsets[-1] == len(buffer) and len(offsets) == len(rows) + 1
    batch = EncodedBatch(torch.from_numpy(buffer), torch.from_numpy(offsets)).to("cpu")
    assert len(batch) == 4 and batch.shape == (4,)
    from cnnpipe.data.codec import decode_batch
    assert np.array_equal(decode_batch(buffer, offsets, split.images.frame), split.images[rows])


@pytest.mark.parametrize("workers", [0, 1])
def test_device_decoded_batches_train_on_what_the_cpu_path_gives(jpeg_store, workers):
    split = open_split(jpeg_store, "train")
    cpu = build_train_loader(split, kind="fast", num_workers=workers, **LOADER)
    device = build_device_decoded_loader(split, num_workers=workers, **LOADER)
    assert len(device) == len(cpu) >= 3
    for (images, labels), (batch, their_labels) in zip(cpu, device):
        assert isinstance(batch, EncodedBatch) and torch.equal(labels, their_labels)
        moved = batch.to(torch.device("cpu"), non_blocking=True)  # what the engine does
        assert torch.equal(device.device_transform.decode(moved), images)  # the same pixels, same order
        assert torch.equal(device.device_transform(moved), cpu.device_transform(images))  # same crops after
    assert set(device.device_transform.state()) == set(cpu.device_transform.state())  # resume sees the transform


def test_only_a_jpeg_store_decodes_on_the_device(tmp_path):
    make_photos(tmp_path / "catalog", 0, 40, side=20)
    cfg = DataConfig(source=str(tmp_path / "catalog"), stored_size=16, prepare_workers=1, encoding="raw")
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    with pytest.raises(ValueError, match="JPEG store"):
        build_device_decoded_loader(open_split(tmp_path / "p", "train"), **{**LOADER, "batch_size": 4})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (nvJPEG)")
def test_nvjpeg_decoded_batches_match_the_cpu_path_on_cuda(jpeg_store):
    split = open_split(jpeg_store, "train")
    cpu = build_train_loader(split, kind="fast", **LOADER)
    device = build_device_decoded_loader(split, pin_memory=True, **LOADER)
    for (images, _), (batch, _) in zip(cpu, device):
        decoded = device.device_transform.decode(batch.to("cuda", non_blocking=True))
        assert decoded.device.type == "cuda" and decoded.shape == images.shape
        assert psnr(decoded.cpu().numpy(), images.numpy()) > 40  # nvJPEG's IDCT is not libjpeg's, nearly
        assert device.device_transform(batch.to("cuda")).device.type == "cuda"

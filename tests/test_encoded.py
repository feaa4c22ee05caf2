"""The device-decode path: batches of JPEG records, decoded where training runs, feeding the same
on-device transform as the CPU path's uint8 batches. The batching is tested on the CPU (torchvision's
CPU decoder stands in for nvJPEG: the same call, the same pixels); the CUDA test runs where CUDA exists."""

import numpy as np
import pytest
import torch

from cnnpipe.config import DataConfig
from cnnpipe.data.loaders.device import DeviceDecode, EncodedBatch, build_device_decoded_loader, gather_records
from cnnpipe.data.loaders.host import build_train_loader
from cnnpipe.data.loaders.transforms import AugmentConfig
from cnnpipe.data.prepare import prepare
from cnnpipe.data.store.shards import open_split
from cnnpipe.params import load_params, resolve
from cnnpipe.profile.decision import tuned_settings
from cnnpipe.profile.trials import Trial, candidates
from cnnpipe.train import trainer
from cnnpipe.train.distributed import DistInfo
from cnnpipe.train.parts import build_training
from cnnpipe.train.tuning import resolve_auto
from conftest import tiny_params, write_params
from test_jpeg_store import make_photos, psnr

CPU, CUDA = torch.device("cpu"), torch.device("cuda")

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
    from cnnpipe.data.store.codec import decode_batch
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


def store_config(tmp_path, variant="optimized", **train):
    """The tiny test params for the fixture's store (32 px colour), `train` applied."""
    params = tiny_params(**{"epochs": 1, "batch_size": 16, "min_steps": None, **train})
    params["data"].update(stored_size=32, image_size=24)
    return resolve(load_params(write_params(tmp_path / "params.yaml", params)), variant)


def test_train_decode_device_trains_from_the_stores_records(jpeg_store, tmp_path):
    """`train.decode: device` builds the loader whose workers only gather records; its batches decode
    to the CPU path's, and a run trains from them and says so in train.json."""
    cfg = resolve_auto(store_config(tmp_path, decode="device"), CPU)
    split = open_split(jpeg_store, "train")
    parts = build_training(cfg, DistInfo(), split)
    assert isinstance(parts.loader.device_transform, DeviceDecode)
    on_cpu = build_training(cfg.with_train(decode="cpu"), DistInfo(), split)
    assert not isinstance(on_cpu.loader.device_transform, DeviceDecode)
    (batch, labels), (images, cpu_labels) = next(iter(parts.loader)), next(iter(on_cpu.loader))
    assert isinstance(batch, EncodedBatch) and torch.equal(labels, cpu_labels)
    assert torch.equal(parts.loader.device_transform.decode(batch), images)
    summary = trainer.fit(cfg, DistInfo(), jpeg_store, tmp_path / "models", tmp_path / "train.json", tmp_path / "live")
    assert summary["decode"] == "device" and summary["epochs"] == 1  # (a raw store's say `none`)
    assert np.isfinite(summary["history"][0]["train_loss"])


def test_train_decode_device_needs_a_jpeg_store_and_the_fast_loader(jpeg_store, tmp_path):
    make_photos(tmp_path / "catalog", 0, 40, side=36)
    raw = DataConfig(source=str(tmp_path / "catalog"), stored_size=32, prepare_workers=1, encoding="raw")
    prepare(raw, 0, tmp_path / "p", tmp_path / "r.json")
    cfg = resolve_auto(store_config(tmp_path, decode="device"), CPU)
    with pytest.raises(ValueError, match=r"train.decode: device .* raw pixels \(data.encoding\)"):
        build_training(cfg, DistInfo(), open_split(tmp_path / "p", "train"))
    with pytest.raises(ValueError, match="train.decode: device .* train.loader is baseline"):
        build_training(cfg.with_train(loader="baseline"), DistInfo(), open_split(jpeg_store, "train"))
    with pytest.raises(ValueError, match="train.decode"):
        store_config(tmp_path, decode="gpu")


def test_the_profile_times_the_decodes_place_only_where_there_are_two(tmp_path):
    requested = store_config(tmp_path, amp="off")  # decode: auto (amp set: no CUDA to ask about bf16 here)
    cfg = resolve_auto(requested, CUDA)
    assert cfg.train.decode == "cpu"  # the default until measured

    def knobs(device, encoding, req=requested):
        return dict(candidates(resolve_auto(req, device), req, device, [], encoding))

    assert knobs(CUDA, "jpeg")["decode"] == {"decode": "device"}
    assert "decode" not in knobs(CUDA, "raw")  # nothing to decode
    assert "decode" not in knobs(CPU, "jpeg")  # one place to decode: the CPU
    assert "decode" not in knobs(CUDA, "jpeg", store_config(tmp_path, amp="off", decode="cpu"))  # params chose
    assert "decode" not in knobs(CUDA, "jpeg", store_config(tmp_path, amp="off", loader="baseline"))


def test_a_measured_device_decode_is_kept_only_with_the_fast_loader(tmp_path):
    requested = store_config(tmp_path, amp="off")
    current = resolve_auto(requested, CUDA)
    decode = Trial("decode", {"decode": "device"}, 1.3, (1.2, 1.4), win=True)
    assert tuned_settings(requested, current, [decode])["decode"] == "device"
    assert resolve_auto(requested, CUDA, {"decode": "device"}).train.decode == "device"
    baseline = Trial("loader", {"loader": "baseline"}, 1.4, (1.3, 1.5), win=True)
    assert tuned_settings(requested, current, [decode, baseline])["decode"] == "cpu"
    assert resolve_auto(requested, CUDA, {"decode": "device", "loader": "baseline"}).train.decode == "cpu"


def test_a_jpeg_split_is_sized_for_the_shuffle_by_its_records_not_its_pixels(jpeg_store):
    """The page cache holds the records: a JPEG split that fits in memory as records is shuffled whole
    even where its decoded pixels would not fit."""
    from cnnpipe.data.loaders.sampling import shuffle_plan

    split = open_split(jpeg_store, "train")
    records = int(gather_records(split.images, np.arange(len(split)))[1][-1])
    pixels = len(split) * int(np.prod(split.images.frame))
    assert split.images.stored_bytes() == records < pixels / 2
    assert shuffle_plan(split, 16, memory_bytes=2 * records + 2) == (None, 0)  # (raw would go shard-local)
    shards, window = shuffle_plan(split, 16, memory_bytes=records)
    assert np.array_equal(shards, split.images.shard_of_each()) and window >= 2


def test_a_jpeg_splits_offsets_are_read_once_however_many_loaders_are_built_on_it(jpeg_store, monkeypatch):
    """The profile builds a loader per trial from the one split it opened: the shuffle's sizing reads
    each shard's offsets the first time only (about 80 MB of them at 10M photos)."""
    from cnnpipe.data.store import shards as shards_module

    split = open_split(jpeg_store, "train")
    reads = []
    real = shards_module.read_offsets
    monkeypatch.setattr(shards_module, "read_offsets", lambda path: reads.append(path) or real(path))
    aug = AugmentConfig(image_size=split.images.frame[0])
    for _ in range(3):
        build_train_loader(split, kind="fast", batch_size=4, aug=aug, mean=(0.5,) * 3, std=(0.5,) * 3, seed=0)
    assert len(reads) == len(set(split.images.shard_of_each().tolist())) and len(set(reads)) == len(reads)

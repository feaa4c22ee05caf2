"""Loaders: DDP sharding, the batched GPU-style augmentation, the shared eval transform, and reading a
store of thousands of shards: bounded open files, a pinned store, small pickles, a shard-local shuffle."""

import hashlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cnnpipe.config import DataConfig
from cnnpipe.data.loaders.host import build_eval_loader, build_train_loader
from cnnpipe.data.loaders.sampling import ShardSampler
from cnnpipe.data.loaders.transforms import AugmentConfig, eval_transform, random_resized_crop
from cnnpipe.data.prepare import prepare_fashion_mnist
from cnnpipe.data.splits.draw import balanced_subset
from cnnpipe.data.store.shards import open_split, read_index


@pytest.fixture(scope="module")
def prepared(fake_fmnist, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    prepare_fashion_mnist(DataConfig(stored_size=32, image_size=32), 0, out, search_dirs=(fake_fmnist,))
    return out


@pytest.mark.parametrize("n, world", [(100, 2), (101, 2), (97, 3)])
def test_training_shards_are_disjoint_and_cover_the_epoch(n, world):
    shards = [ShardSampler(n, 8, shuffle=True, drop_last=True, seed=1, rank=r, world_size=world) for r in range(world)]
    for s in shards:
        s.set_epoch(3)
    parts = [set(s.shard().tolist()) for s in shards]
    assert all(len(p) == n // world for p in parts)
    assert not set.intersection(*parts)
    assert len(set.union(*parts)) == (n // world) * world  # at most world-1 left out per epoch
    assert len({len(list(s)) for s in shards}) == 1  # same number of steps on every rank


def test_eval_shards_cover_every_item_once():
    shards = [ShardSampler(101, 8, shuffle=False, drop_last=False, rank=r, world_size=2) for r in range(2)]
    seen = sorted(i for s in shards for batch in s for i in batch)
    assert seen == list(range(101))
    assert sum(len(s) for s in shards) == sum(len(list(s)) for s in shards)


def test_epochs_reshuffle_deterministically():
    s = ShardSampler(50, 5, shuffle=True, drop_last=True, seed=0)
    s.set_epoch(0)
    first = s.shard().copy()
    s.set_epoch(1)
    assert not np.array_equal(first, s.shard())
    s.set_epoch(0)
    assert np.array_equal(first, s.shard())


@pytest.mark.parametrize("kind", ["fast", "baseline"])
def test_train_loaders_yield_normalised_batches(prepared, kind):
    split = open_split(prepared, "train")
    aug = AugmentConfig(28, scale=(0.5, 1.0))
    loader = build_train_loader(split, kind=kind, batch_size=16, aug=aug, mean=(0.5,), std=(0.25,), seed=0,
                                channels_last=True)
    images, labels = next(iter(loader))
    x = loader.device_transform(images)
    assert x.shape == (16, 1, 28, 28) and x.dtype == torch.float32
    assert x.is_contiguous(memory_format=torch.channels_last)
    assert labels.dtype == torch.int64 and len(loader) == len(split) // 16
    assert -2.5 < x.mean().item() < 2.5 and x.min() >= (0 - 0.5) / 0.25 - 1e-4


def test_full_crop_without_flip_is_identity():
    x = torch.rand(4, 3, 16, 16)
    aug = AugmentConfig(16, scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=False)
    out = random_resized_crop(x, aug, torch.Generator().manual_seed(0))
    assert torch.allclose(out, x, atol=1e-5)


def test_eval_transform_is_deterministic_and_resizes(prepared):
    split = open_split(prepared, "test")
    batch = next(iter(build_eval_loader(split, batch_size=8)))[0]
    a = eval_transform(batch, 24, (0.5,), (0.25,))
    b = eval_transform(batch, 24, (0.5,), (0.25,))
    assert a.shape == (8, 1, 24, 24) and torch.equal(a, b)


def test_batch_larger_than_data_is_a_clear_error(prepared):
    split = open_split(prepared, "val")
    with pytest.raises(ValueError, match="train.batch_size"):
        build_train_loader(split, kind="fast", batch_size=10_000, aug=AugmentConfig(28), mean=(0.5,), std=(0.25,),
                           seed=0)


def test_balanced_subset_keeps_class_shares_and_is_fixed(prepared):
    """The budget's validation/parity subset: class proportions kept, the same items every time."""
    split = open_split(prepared, "train")
    subset = balanced_subset(split, 100)
    assert 95 <= len(subset) <= 105
    full_share = np.bincount(split.labels, minlength=10) / len(split)
    assert np.abs(np.bincount(subset.labels, minlength=10) / len(subset) - full_share).max() < 0.02
    again = balanced_subset(open_split(prepared, "train"), 100)
    assert np.array_equal(subset.labels, again.labels) and np.array_equal(subset.images, again.images)
    assert balanced_subset(split, None) is split and balanced_subset(split, 10**6) is split


# ---------------------------------------------------------------- at 10M images
def _store_of_shards(out: Path, n: int, rows_per_shard: int = 1) -> np.ndarray:
    """A store of `n` 4x4x3 images (image i filled with i % 251), `rows_per_shard` to a shard; returns
    the pixels in the train split's order."""
    from cnnpipe.data.store.writer import StoreWriter

    writer = StoreWriter(out, 4, 3, shard_mb=rows_per_shard * 48 / 2**20)
    for i in range(n):
        writer.add("train", np.full((4, 4, 3), i % 251, np.uint8), i % 3, hashlib.sha256(str(i).encode()).digest(),
                   {"source": f"{i}.png", "sha256": ""})
    writer.close(["a", "b", "c"], "synthetic", carved=[])
    return np.asarray(open_split(out, "train").images)


READ_ALL = """
import pickle, resource, sys
import numpy as np
from cnnpipe.data.loaders.host import _UInt8Batches
from cnnpipe.data.loaders.sampling import ShardSampler
from cnnpipe.data.store.shards import open_split
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
split = open_split(sys.argv[1], "train")
dataset = pickle.loads(pickle.dumps(_UInt8Batches(split)))  # as a spawned loader worker gets it
sampler = ShardSampler(len(split), 64, shuffle=True, drop_last=False, seed=0)
seen = np.zeros((len(split), 4, 4, 3), np.uint8)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for batch in sampler:
        seen[np.sort(batch)] = dataset[batch][0].numpy()
np.save(sys.argv[2], seen)
"""


def test_two_thousand_shards_are_read_under_a_limit_of_256_open_files(tmp_path):
    expected = _store_of_shards(tmp_path / "p", 2000)
    assert len(read_index(tmp_path / "p")["shards"]) == 2000
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    done = subprocess.run([sys.executable, "-c", READ_ALL, str(tmp_path / "p"), str(tmp_path / "seen.npy")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert np.array_equal(np.load(tmp_path / "seen.npy"), expected)


def test_a_loader_workers_pickle_is_small_whatever_the_split(tmp_path):
    from cnnpipe.data.loaders.host import _UInt8Batches

    _store_of_shards(tmp_path / "p", 20_000, rows_per_shard=1000)
    split = open_split(tmp_path / "p", "train")
    for dataset in (_UInt8Batches(split), _UInt8Batches(open_split(tmp_path / "p", "train", limit=15_000))):
        blob = pickle.dumps(dataset)
        assert len(blob) < 4096, len(blob)  # the row index alone is 160 kB, the labels as much again
        again = pickle.loads(blob)
        batch = [3, 17, 14_999, 9_000]
        assert all(torch.equal(a, b) for a, b in zip(again[batch], dataset[batch]))


def test_a_run_keeps_reading_the_store_it_started_with_while_an_update_compacts_it(tmp_path):
    from cnnpipe.data.loaders.host import _UInt8Batches
    from cnnpipe.data.prepare import prepare
    from conftest import colour_image, save_image

    root = tmp_path / "catalog"
    for i in range(200):
        save_image(root / ("a" if i % 2 else "b") / f"{i:03d}.png", colour_image(i, (12, 12)))
    cfg = DataConfig(source=str(root), stored_size=8, image_size=8, prepare_workers=1, shard_mb=0.01)
    prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    split = open_split(tmp_path / "p", "train")  # a training run starts
    worker_copy = pickle.dumps(_UInt8Batches(split))  # and hands its loader workers their dataset
    before = np.asarray(split.images[: len(split) // 2])
    for path in sorted(root.rglob("*.png"))[::3] + sorted(root.rglob("*.png"))[1::3]:
        path.unlink()  # two thirds of the catalog gone: most shards are compacted, and dropped
    report = prepare(cfg, 0, tmp_path / "p", tmp_path / "r.json")
    assert read_index(tmp_path / "p")["last_update"]["compacted_shards"] > 0
    assert report["splits"]["train"] < len(split)
    assert np.array_equal(np.asarray(split.images[: len(split) // 2]), before)  # maps it had, and...
    whole = np.asarray(split.images)  # ...shards it never mapped before the update
    dataset = pickle.loads(worker_copy)
    assert torch.equal(dataset[list(range(len(split)))][0], torch.from_numpy(whole))


def test_a_shard_local_shuffle_reads_few_shards_a_batch_and_every_item_once():
    shards = np.repeat(np.arange(100), 50)  # 100 shards of 50 items
    sampler = ShardSampler(len(shards), 32, shuffle=True, drop_last=False, seed=1, shards=shards, window=4)
    sampler.set_epoch(0)
    first = sampler.shard()
    assert sorted(first.tolist()) == list(range(len(shards)))
    touched = [len(np.unique(shards[batch])) for batch in sampler]
    assert max(touched) <= 8 and np.mean(touched) <= 5  # a window's shards, two at a window's edge
    full = ShardSampler(len(shards), 32, shuffle=True, drop_last=False, seed=1)
    assert np.mean([len(np.unique(shards[b])) for b in full]) > 20  # a full permutation: ~one shard an image
    sampler.set_epoch(1)
    assert not np.array_equal(sampler.shard(), first)


def test_the_shuffle_is_shard_local_only_for_a_split_larger_than_memory(tmp_path):
    from cnnpipe.data.loaders.sampling import shuffle_plan

    _store_of_shards(tmp_path / "p", 2000, rows_per_shard=100)
    split = open_split(tmp_path / "p", "train")
    assert shuffle_plan(split, 64) == (None, 0)  # 96 kB of pixels: a full permutation
    shards, window = shuffle_plan(split, 64, memory_bytes=100_000)  # as if the machine had 100 kB
    assert np.array_equal(shards, np.asarray(split.images.where[:, 0])) and window == 21

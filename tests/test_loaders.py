"""Loaders: DDP sharding, the batched GPU-style augmentation and the shared eval transform."""

import numpy as np
import pytest
import torch

from cnnpipe.config import DataConfig
from cnnpipe.data.loaders import (
    AugmentConfig,
    ShardSampler,
    build_eval_loader,
    build_train_loader,
    eval_transform,
    random_resized_crop,
)
from cnnpipe.data.prepare import prepare_fashion_mnist
from cnnpipe.data.split import balanced_subset
from cnnpipe.data.store import open_split


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

"""Which items each rank reads, batch by batch: a fresh permutation every epoch, sharded across ranks,
and a shard-local shuffle for stores larger than memory (WebDataset's and MDS's block shuffles)."""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import psutil
from torch.utils.data import Sampler

from cnnpipe.data.store.shards import PreparedSplit, ShardedImages


def shard_local_order(shards: np.ndarray, window: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation visiting the items' shards in a random order, `window` shards at a time, items
    shuffled within each window: a batch reads a few shards (WebDataset's and MDS's block shuffles)."""
    ids, inverse = np.unique(shards, return_inverse=True)
    rank = np.argsort(rng.permutation(len(ids)))  # each shard's place in a random order of the shards
    return np.lexsort((rng.random(len(shards)), rank[inverse.reshape(-1)] // max(1, window)))


class ShardSampler(Sampler[list[int]]):
    """Batches of indices for one rank: a fresh permutation each epoch, sharded across ranks.

    Training (`drop_last`) gives every rank the same number of full batches; evaluation keeps every
    item exactly once across ranks (shards may differ in length by one). `per_epoch` draws only the
    first that many items of each epoch's permutation: a fresh random subset every epoch. Given each
    item's shard (`shards`), the permutation is `shard_local_order`, for stores larger than memory.
    """

    def __init__(self, n: int, batch_size: int, *, shuffle: bool, drop_last: bool, seed: int = 0,
                 rank: int = 0, world_size: int = 1, per_epoch: int | None = None,
                 shards: np.ndarray | None = None, window: int = 8) -> None:
        self.total, self.batch_size, self.shuffle, self.drop_last = n, batch_size, shuffle, drop_last
        self.n = n if per_epoch is None else min(n, per_epoch)
        self.seed, self.rank, self.world_size, self.epoch = seed, rank, world_size, 0
        self.shards, self.window = shards, window

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def shard(self) -> np.ndarray:
        """This rank's indices for the current epoch."""
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch])
            if self.shards is None:
                order = rng.permutation(self.total)[: self.n]
            else:
                order = shard_local_order(self.shards, self.window, rng)[: self.n]
        else:
            order = np.arange(self.n)
        if self.drop_last:
            # Strided, so that step k of every rank together covers the same items that step k of a
            # single process with the global batch would: DDP then matches one process exactly.
            usable = (self.n // self.world_size) * self.world_size
            return order[:usable][self.rank :: self.world_size]
        return order[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[list[int]]:
        shard = self.shard()
        stop = len(shard) - len(shard) % self.batch_size if self.drop_last else len(shard)
        for start in range(0, stop, self.batch_size):
            yield shard[start : start + self.batch_size].tolist()

    def __len__(self) -> int:
        per_rank = self.n // self.world_size if self.drop_last else math.ceil((self.n - self.rank) / self.world_size)
        return per_rank // self.batch_size if self.drop_last else math.ceil(per_rank / self.batch_size)


def shuffle_plan(split: PreparedSplit, batch_size: int, world_size: int = 1,
                 memory_bytes: int | None = None) -> tuple[np.ndarray | None, int]:
    """(each item's shard, window) for a shard-local shuffle when the split's stored bytes (pixels,
    or a JPEG store's records) exceed half of `memory_bytes` (default: this machine's RAM), where a
    full permutation reads a page from the disk per image; (None, 0), a full permutation, otherwise.
    A window holds ~32 global batches."""
    if not isinstance(split.images, ShardedImages):
        return None, 0
    memory_bytes = memory_bytes if memory_bytes is not None else psutil.virtual_memory().total
    if split.images.stored_bytes() <= memory_bytes // 2:
        return None, 0
    shards = split.images.shard_of_each()
    per_shard = max(1, len(split) // max(1, len(np.unique(shards))))
    return shards, max(2, math.ceil(32 * batch_size * world_size / per_shard))

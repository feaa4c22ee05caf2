"""Batches of a JPEG store decoded on the training device: the loader hands over records, not pixels.

On the CPU path a JPEG store's rows are decoded by `ShardedImages` in the loader's workers. Here the
workers only gather each batch's records (`gather_records`: bytes copied out of the shards' maps, a
tenth of the pixels' size), the batch crosses to the trainer as an `EncodedBatch`, and
`DeviceDecode` decodes it where the batch is going, through `codec.decode_batch_on` (nvJPEG on CUDA,
one call for the whole list), before the fast loader's on-device crop, flip and normalise. The
engine is unchanged: it calls `.to(device)` on the batch and then the device transform, as for a
uint8 batch. DALI and FFCV decode on the device the same way for the same reason: it frees the CPU.

nvJPEG's pixels may differ from the CPU decoder's by a level here and there (`codec`), so this path
feeds training only; evaluation, the gate and predict decode on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from cnnpipe.data.store import codec
from cnnpipe.data.loaders.host import TrainLoader, check_shared_memory
from cnnpipe.data.loaders.sampling import ShardSampler, shuffle_plan
from cnnpipe.data.loaders.transforms import AugmentConfig, FastTransform
from cnnpipe.data.store.shards import PreparedSplit, ShardedImages


def gather_records(images: ShardedImages, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The JPEG records of rows `indices` of a JPEG store, back to back in that order: (flat uint8
    buffer, (N+1,) int64 offsets), `codec.pack`'s layout. Nothing is decoded."""
    if images.encoding != "jpeg":
        raise ValueError(f"decoding on the device needs a JPEG store; this one is {images.encoding}")
    where = images.where[np.asarray(indices, dtype=np.intp)]
    chunks = []
    for shard, row in where.tolist():
        records, offsets = images._map(shard)  # the LRU of maps `ShardedImages` keeps
        chunks.append(records[offsets[row] : offsets[row + 1]])
    offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum([len(c) for c in chunks], out=offsets[1:])
    buffer = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint8)
    return buffer, offsets


@dataclass
class EncodedBatch:
    """A batch of JPEG records on its way to `device`: the bytes stay in (pinned) host memory, which
    nvJPEG reads itself; `.to` only names where they will be decoded."""

    buffer: torch.Tensor   # (bytes,) uint8, on the CPU
    offsets: torch.Tensor  # (N+1,) int64
    device: torch.device = torch.device("cpu")

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def to(self, device: torch.device | str, non_blocking: bool = False) -> EncodedBatch:
        return EncodedBatch(self.buffer, self.offsets, torch.device(device))

    def pin_memory(self) -> EncodedBatch:
        """What the DataLoader's pinning thread calls: page-locked bytes, for nvJPEG's copy."""
        return EncodedBatch(self.buffer.pin_memory(), self.offsets, self.device)


class DeviceDecode:
    """A device transform that first decodes an `EncodedBatch` where it is headed (into the (N, H, W,
    C) uint8 layout of the fast loader's batches), then applies `transform`; a uint8 batch passes
    straight through. Everything else (`state`, `load_state`, ...) is `transform`'s."""

    def __init__(self, transform: Callable[[torch.Tensor], torch.Tensor], frame: tuple[int, int, int]) -> None:
        self.transform, self.frame = transform, tuple(frame)

    def decode(self, batch: EncodedBatch | torch.Tensor) -> torch.Tensor:
        if not isinstance(batch, EncodedBatch):
            return batch
        return codec.decode_batch_on(batch.buffer, batch.offsets, self.frame, batch.device)

    def __call__(self, batch: EncodedBatch | torch.Tensor) -> torch.Tensor:
        return self.transform(self.decode(batch))

    def __getattr__(self, name: str) -> Any:
        if name == "transform":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.transform, name)


class _EncodedBatches(Dataset):
    """dataset[list of indices] -> (EncodedBatch, labels), the rows sorted as `_UInt8Batches` sorts them."""

    def __init__(self, split: PreparedSplit) -> None:
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, indices: Sequence[int]) -> tuple[EncodedBatch, torch.Tensor]:
        order = np.sort(np.asarray(indices))
        buffer, offsets = gather_records(self.split.images, order)
        return (EncodedBatch(torch.from_numpy(buffer), torch.from_numpy(offsets)),
                torch.from_numpy(self.split.labels[order]))


def build_device_decoded_loader(split: PreparedSplit, *, batch_size: int, aug: AugmentConfig,
                                mean: Sequence[float], std: Sequence[float], seed: int, rank: int = 0,
                                world_size: int = 1, num_workers: int = 0, pin_memory: bool = False,
                                channels_last: bool = False, prefetch_factor: int = 2,
                                images_per_epoch: int | None = None, local_ranks: int = 1) -> TrainLoader:
    """The fast training loader of a JPEG store, its batches decoded on the training device: the same
    sampler (so the same images in the same batches) and the same device transform after the decode
    as `loaders.build_train_loader(kind="fast")`."""
    if not isinstance(split.images, ShardedImages) or split.images.encoding != "jpeg":
        raise ValueError("train.decode: device decodes a JPEG store's records on the training device, and this "
                         "store keeps raw pixels (data.encoding): set train.decode: auto or cpu, or "
                         "data.encoding: jpeg")
    pin_memory = pin_memory and torch.cuda.is_available()
    per_epoch = len(split) if images_per_epoch is None else min(len(split), images_per_epoch)
    if per_epoch // world_size < batch_size:
        raise ValueError(f"train.batch_size={batch_size} is larger than the {per_epoch // world_size} training "
                         "images per process and epoch")
    shards, window = shuffle_plan(split, batch_size, world_size)
    sampler = ShardSampler(len(split), batch_size, shuffle=True, drop_last=True, seed=seed, rank=rank,
                           world_size=world_size, per_epoch=images_per_epoch, shards=shards, window=window)
    # In /dev/shm a batch weighs its records: the pixels' size is a safe bound.
    check_shared_memory(num_workers, batch_size * int(np.prod(split.images.frame)), prefetch_factor, local_ranks)
    extra = {"persistent_workers": True, "prefetch_factor": prefetch_factor} if num_workers > 0 else {}
    loader = DataLoader(_EncodedBatches(split), sampler=sampler, batch_size=None, num_workers=num_workers,
                        pin_memory=pin_memory, **extra)
    transform = FastTransform(aug, mean, std, train=True, channels_last=channels_last, seed=seed, rank=rank)
    return TrainLoader(loader, sampler, DeviceDecode(transform, split.images.frame))

"""Training and evaluation loaders whose workers read the pixels on the host.

Two training loaders on purpose:
- `baseline`: the naive reference, per-sample PIL images through torchvision transforms.
- `fast`: whole uint8 batches gathered from the memory map (in workers if asked), copied as
  uint8 (4x fewer bytes than float), then cropped, flipped and normalised on the training device
  (`transforms.FastTransform`).

Both yield CPU batches; the device transform runs after the host-to-device copy. A JPEG store can
instead be decoded on the device (`device`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler

from cnnpipe.data.loaders.sampling import ShardSampler, shuffle_plan
from cnnpipe.data.loaders.transforms import AugmentConfig, FastTransform, baseline_transform, keep_layout
from cnnpipe.data.store.shards import PreparedSplit


Batch = tuple[torch.Tensor, torch.Tensor]


class _UInt8Batches(Dataset):
    """dataset[list of indices] → (uint8 NHWC batch, labels): one gather from the memory map."""

    def __init__(self, split: PreparedSplit) -> None:
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, indices: Sequence[int]) -> Batch:
        order = np.sort(np.asarray(indices))  # sequential reads from the memory map
        images = torch.from_numpy(np.ascontiguousarray(self.split.images[order]))
        labels = torch.from_numpy(self.split.labels[order])
        return images, labels


class PILDataset(Dataset):
    """The naive reference: one PIL image and one torchvision pipeline call per sample."""

    def __init__(self, split: PreparedSplit, transform) -> None:
        self.split, self.transform = split, transform

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        pixels = np.asarray(self.split.images[i])
        img = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)
        return self.transform(img), int(self.split.labels[i])


class _IndexBatches(Sampler[int]):
    """Flattens a ShardSampler into single indices, for the per-sample baseline DataLoader."""

    def __init__(self, batches: ShardSampler) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[int]:
        for batch in self.batches:
            yield from batch

    def __len__(self) -> int:
        return len(self.batches) * self.batches.batch_size


@dataclass
class TrainLoader:
    """A DataLoader plus the device-side transform the engine applies after the copy."""

    loader: DataLoader
    sampler: ShardSampler
    device_transform: object  # callable: CPU→device batch → model input

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.sampler)


SHM = Path("/dev/shm")


def check_shared_memory(num_workers: int, batch_bytes: int, prefetch_factor: int = 2, local_ranks: int = 1) -> None:
    """Loader workers hand their batches over in /dev/shm: fail before training, with what to do,
    when it cannot hold what they keep in flight (a container's default is 64 MB, and running out
    there is a bus error in a worker, not a message). `local_ranks`: the training processes on this
    node, each with `num_workers` workers of its own, all sharing the node's one /dev/shm.
    """
    if num_workers == 0 or not SHM.is_dir():
        return
    need = 2 * local_ranks * num_workers * prefetch_factor * batch_bytes  # in flight, plus the copies being freed
    free = shutil.disk_usage(SHM).free
    if free < need:
        who = f"{num_workers} loader workers" + (f" x {local_ranks} ranks on this node" if local_ranks > 1 else "")
        raise ValueError(f"{SHM} has {free / 2**20:,.0f} MB free; {who} need about "
                         f"{need / 2**20:,.0f} MB there for their batches. In Docker run with --ipc=host or "
                         f"--shm-size=8g (Kubernetes: an emptyDir with medium: Memory at /dev/shm), or set "
                         f"train.num_workers: 0")


def build_train_loader(split: PreparedSplit, *, kind: str, batch_size: int, aug: AugmentConfig,
                       mean: Sequence[float], std: Sequence[float], seed: int, rank: int = 0,
                       world_size: int = 1, num_workers: int = 0, pin_memory: bool = False,
                       channels_last: bool = False, prefetch_factor: int = 2,
                       images_per_epoch: int | None = None, local_ranks: int = 1) -> TrainLoader:
    """The training loader of `kind` (`baseline` or `fast`), sharded for this rank (one of
    `local_ranks` on this node, for the /dev/shm check)."""
    pin_memory = pin_memory and torch.cuda.is_available()  # pinning only helps host→GPU copies
    per_epoch = len(split) if images_per_epoch is None else min(len(split), images_per_epoch)
    if per_epoch // world_size < batch_size:
        raise ValueError(f"train.batch_size={batch_size} is larger than the {per_epoch // world_size} training "
                         f"images per process and epoch; lower train.batch_size, raise train.images_per_epoch "
                         f"(or run.budget_minutes) or add data")
    shards, window = shuffle_plan(split, batch_size, world_size)
    sampler = ShardSampler(len(split), batch_size, shuffle=True, drop_last=True, seed=seed, rank=rank,
                           world_size=world_size, per_epoch=images_per_epoch, shards=shards, window=window)
    extra = {"persistent_workers": True, "prefetch_factor": prefetch_factor} if num_workers > 0 else {}
    # What one batch weighs in /dev/shm: uint8 at the stored size (fast), float32 crops (baseline).
    stored = split.images.shape[1]
    batch_bytes = batch_size * split.channels * (stored**2 if kind == "fast" else 4 * aug.image_size**2)
    check_shared_memory(num_workers, batch_bytes, prefetch_factor, local_ranks)
    if kind == "fast":
        loader = DataLoader(_UInt8Batches(split), sampler=sampler, batch_size=None, num_workers=num_workers,
                            pin_memory=pin_memory, **extra)
        transform = FastTransform(aug, mean, std, train=True, channels_last=channels_last, seed=seed, rank=rank)
        return TrainLoader(loader, sampler, transform)
    if kind == "baseline":
        torch.manual_seed(seed * 1000 + rank)  # torchvision transforms draw from the global RNG
        dataset = PILDataset(split, baseline_transform(aug, mean, std))
        loader = DataLoader(dataset, batch_size=batch_size, sampler=_IndexBatches(sampler), num_workers=num_workers,
                            pin_memory=pin_memory, drop_last=True, **extra)
        return TrainLoader(loader, sampler, keep_layout(channels_last))
    raise ValueError(f"train.loader={kind!r}; allowed: baseline | fast")


def build_eval_loader(split: PreparedSplit, *, batch_size: int, rank: int = 0, world_size: int = 1,
                      num_workers: int = 0, pin_memory: bool | None = None) -> DataLoader:
    """Deterministic loader of uint8 batches; each item seen once across ranks.

    `pin_memory` None (the default) pins when CUDA is available (a copy from pageable memory blocks
    the host once per batch); False for a CPU-side consumer on a GPU machine.
    """
    pin_memory = torch.cuda.is_available() and pin_memory is not False
    sampler = ShardSampler(len(split), batch_size, shuffle=False, drop_last=False, rank=rank, world_size=world_size)
    return DataLoader(_UInt8Batches(split), sampler=sampler, batch_size=None, num_workers=num_workers,
                      pin_memory=pin_memory)

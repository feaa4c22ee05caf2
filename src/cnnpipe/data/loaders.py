"""Training and evaluation loaders over the prepared format.

Two loaders on purpose:
- `baseline`: the naive reference, per-sample PIL images through torchvision transforms.
- `fast`: whole uint8 batches gathered from the memory map (in workers if asked), copied as
  uint8 (4x fewer bytes than float), then cropped, flipped and normalised on the training device
  with two batched matmuls per batch (bilinear resampling is separable).

Both yield CPU batches; `device_transform` runs after the host→device copy, so the engine can time
data wait, copy and augmentation separately. Evaluation uses `eval_transform` for every variant
(and for prediction), so accuracies are comparable.
"""

from __future__ import annotations

import functools
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import psutil
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler

from cnnpipe.data.store import PreparedSplit, ShardedImages

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class AugmentConfig:
    """Random-resized-crop and flip settings shared by both loaders."""

    image_size: int
    scale: tuple[float, float] = (0.35, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: bool = True


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


# --------------------------------------------------------------------------- fast path
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


@functools.lru_cache(maxsize=32)
def mean_std_on(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The (1, C, 1, 1) mean and std in [0, 255] units on `device`, built once per device: building
    them per batch is two blocking host-to-device copies every step on a GPU."""
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1) * 255.0
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1) * 255.0
    return m.to(device), s.to(device)


def normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8/float NCHW in [0, 255] → float normalised by the model's mean/std."""
    m, s = mean_std_on(tuple(mean), tuple(std), x.device)
    return (x.float() - m) / s


def to_nchw(images: torch.Tensor) -> torch.Tensor:
    """uint8 NHWC → NCHW view; NHWC storage makes it channels_last for free."""
    return images.permute(0, 3, 1, 2)


def _interp_matrix(start: torch.Tensor, length: torch.Tensor, out: int, size: int) -> torch.Tensor:
    """(N, out, size) bilinear weights that resample source pixels [start, start+length) to `out`."""
    centres = torch.arange(out, dtype=torch.float32, device=start.device)
    src = (start[:, None] + (centres[None] + 0.5) * (length[:, None] / out) - 0.5).clamp(0, size - 1)
    low = src.floor()
    frac = src - low
    low = low.long()
    high = (low + 1).clamp(max=size - 1)
    weights = torch.zeros(start.shape[0], out, size, device=start.device)
    weights.scatter_add_(2, low[..., None], (1 - frac)[..., None])
    weights.scatter_add_(2, high[..., None], frac[..., None])
    return weights


@functools.lru_cache(maxsize=32)
def _crop_constants(aug: AugmentConfig, height: int, width: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(low, span) of (area, log ratio) and the (width, height) on `device`, built once, like `mean_std_on`."""
    low = torch.tensor([aug.scale[0], math.log(aug.ratio[0])])
    span = torch.tensor([aug.scale[1] - aug.scale[0], math.log(aug.ratio[1] / aug.ratio[0])])
    return low.to(device), span.to(device), torch.tensor([float(width), float(height)]).to(device)


def crop_params(n: int, aug: AugmentConfig, height: int, width: int,
                generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(x0, y0, w, h, flip) of `n` random-resized crops, in source pixels, from one draw of `generator`.

    Area uniform in `aug.scale` and aspect ratio log-uniform in `aug.ratio` (torchvision's draws,
    clamped to the image instead of retried), the crop placed uniformly, a fair coin for the flip.
    One (n, 5) draw, width and height as pairs: half the kernel launches of five separate draws.
    """
    u = torch.rand(n, 5, device=generator.device, generator=generator)
    low, span, size = _crop_constants(aug, height, width, generator.device)
    area, log_ratio = torch.addcmul(low, u[:, :2], span).unbind(1)
    ratio = log_ratio.exp()
    wh = torch.stack([area * ratio, area / ratio], 1).sqrt_().clamp_(max=1.0).mul_(size)  # crop size in pixels
    xy0 = u[:, 2:4] * (size - wh)
    return xy0[:, 0], xy0[:, 1], wh[:, 0], wh[:, 1], u[:, 4] < 0.5


def random_resized_crop(x: torch.Tensor, aug: AugmentConfig, generator: torch.Generator) -> torch.Tensor:
    """Per-sample random-resized crop + horizontal flip of a float NCHW batch.

    Bilinear resampling is separable, so each sample's crop, resize and flip is two small matrices
    (rows and columns) and the whole batch is two batched matmuls: ~3x faster than grid_sample on a
    CPU core, and the same code runs on the GPU.
    """
    n, _, height, width = x.shape
    x0, y0, w, h, flip = crop_params(n, aug, height, width, generator)
    if height == width:  # square (the prepared store's layout): both matrices from one call
        rows, cols = _interp_matrix(torch.cat([y0, x0]), torch.cat([h, w]), aug.image_size, height).chunk(2)
    else:
        rows = _interp_matrix(y0, h, aug.image_size, height)
        cols = _interp_matrix(x0, w, aug.image_size, width)
    if aug.hflip:
        cols = torch.where(flip[:, None, None], cols.flip(1), cols)
    rows, cols = rows.to(x.device), cols.to(x.device)
    return rows[:, None] @ x @ cols[:, None].transpose(-1, -2)


def eval_transform(images: torch.Tensor, image_size: int, mean: Sequence[float], std: Sequence[float],
                   channels_last: bool = False) -> torch.Tensor:
    """Deterministic evaluation/prediction transform: resize the stored square to `image_size`."""
    x = to_nchw(images).float()
    if x.shape[-1] != image_size:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", antialias=True, align_corners=False)
    x = normalize(x, mean, std)
    return x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


class FastTransform:
    """Device-side transform for fast-loader batches (after the uint8 copy)."""

    def __init__(self, aug: AugmentConfig, mean: Sequence[float], std: Sequence[float], *, train: bool,
                 channels_last: bool, seed: int, rank: int = 0) -> None:
        self.aug, self.mean, self.std, self.train = aug, mean, std, train
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.seed, self.rank = seed, rank
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed * 1000 + self.rank)
            self._generators[key] = g
        return self._generators[key]

    def state(self) -> dict[str, torch.Tensor]:
        """RNG states, for exact resume."""
        return {k: g.get_state() for k, g in self._generators.items()}

    def load_state(self, state: dict[str, torch.Tensor], device: torch.device) -> bool:
        """Restore the generator saved for a device of `device`'s type onto `device` (a GPU's state fits
        any GPU index); False, and nothing restored, when none was (a GPU run resumed on the CPU)."""
        same_kind = [value for key, value in state.items() if torch.device(key).type == device.type]
        if same_kind:
            self._generator(device).set_state(same_kind[0])
        return bool(same_kind)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if not self.train:
            channels_last = self.memory_format == torch.channels_last
            return eval_transform(images, self.aug.image_size, self.mean, self.std, channels_last)
        x = to_nchw(images).float()
        if self.aug.scale[0] >= 1.0:  # crop_scale_min 1.0: no crop, only resize (and flip)
            x = F.interpolate(x, size=(self.aug.image_size,) * 2, mode="bilinear", antialias=True, align_corners=False)
            if self.aug.hflip:
                flip = torch.rand(x.shape[0], device=x.device, generator=self._generator(x.device)) < 0.5
                x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        else:
            x = random_resized_crop(x, self.aug, self._generator(x.device))
        return normalize(x, self.mean, self.std).contiguous(memory_format=self.memory_format)


# --------------------------------------------------------------------------- baseline path
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


def baseline_transform(aug: AugmentConfig, mean: Sequence[float], std: Sequence[float]):
    """torchvision per-sample training transform (the classic ImageNet recipe)."""
    from torchvision import transforms as T

    return T.Compose([
        T.RandomResizedCrop(aug.image_size, scale=aug.scale, ratio=aug.ratio, antialias=True),
        T.RandomHorizontalFlip() if aug.hflip else T.Lambda(lambda im: im),
        T.ToTensor(),
        T.Normalize(mean, std),
    ])


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


def _keep_layout(channels_last: bool):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return lambda x: x.contiguous(memory_format=fmt)


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
        return TrainLoader(loader, sampler, _keep_layout(channels_last))
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

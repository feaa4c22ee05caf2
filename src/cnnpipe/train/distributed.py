"""Process-group setup that is a no-op on one process (torchrun sets the env vars otherwise)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: rank, world size and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_primary(self) -> bool:
        """Rank 0 alone writes metrics, logs and checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(preference: str, local_rank: int = 0) -> torch.device:
    """`auto` → the local CUDA device when there is one, else the CPU."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible; use `auto` or `cpu`")
    if preference in ("cuda", "auto") and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def under_torchrun() -> bool:
    """True inside a process started by torchrun (or any launcher that sets WORLD_SIZE)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_distributed(device_preference: str = "auto") -> DistInfo:
    """Join the process group when launched by torchrun; otherwise a single-process DistInfo."""
    if not under_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return DistInfo(device=resolve_device(device_preference))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(device_preference, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(minutes=30))
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device)


def cleanup() -> None:
    """Leave the process group (safe to call when none was joined)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _all_reduce(values: list[float], info: DistInfo, op: dist.ReduceOp) -> list[float]:
    if not info.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    """Sum a list of floats across ranks (identity on one process)."""
    return _all_reduce(values, info, dist.ReduceOp.SUM)


def all_reduce_max(values: list[float], info: DistInfo) -> list[float]:
    """Element-wise max across ranks (identity on one process)."""
    return _all_reduce(values, info, dist.ReduceOp.MAX)


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under DDP and torch.compile wrappers."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)

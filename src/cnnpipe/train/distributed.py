"""Process-group setup that is a no-op on one process (torchrun sets the env vars otherwise)."""

from __future__ import annotations

import datetime
import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class ConfigMismatch(ValueError):
    """The nodes of one job resolved different training settings."""


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: rank, world size and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    primary_rank: int = 0
    """The rank that writes metrics, logs and checkpoints: local rank 0 of node 0 (`train.node_rank`),
    where `dvc repro` runs. Not always global rank 0: the c10d rendezvous orders nodes by address."""

    @property
    def is_primary(self) -> bool:
        """This process alone writes metrics, logs and checkpoints."""
        return self.rank == self.primary_rank

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(preference: str, local_rank: int = 0) -> torch.device:
    """`auto` → the local CUDA device when there is one, else the CPU (with a warning when the
    machine has NVIDIA GPUs that this torch cannot use)."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible; use `auto` or `cpu`"
                           + (f" ({gpus_unusable_reason()})" if nvidia_gpus_present() else ""))
    if preference in ("cuda", "auto") and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if preference == "auto" and nvidia_gpus_present():
        warnings.warn(f"train.device=auto falls back to the CPU: {gpus_unusable_reason()}", stacklevel=2)
    return torch.device("cpu")


def nvidia_gpus_present() -> bool:
    """True when the kernel exposes NVIDIA GPUs (/dev/nvidia0...), whether or not torch can use them."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def gpus_unusable_reason() -> str:
    """Why torch sees no GPU on a machine that has them, in words a user can act on."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build; install a CUDA wheel of torch"
    return (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} and cannot use the GPUs "
            f"here: the NVIDIA driver is likely older than that CUDA needs (compare `nvidia-smi`), or "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')} hides them; set "
            "train.device=cpu to silence this")


def under_torchrun() -> bool:
    """True inside a process started by torchrun (or any launcher that sets WORLD_SIZE)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_distributed(device_preference: str = "auto", node: int = 0) -> DistInfo:
    """Join the process group when launched by torchrun; otherwise a single-process DistInfo.

    `node` is this machine's `train.node_rank`: local rank 0 of node 0 becomes the primary rank.
    """
    if not under_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return DistInfo(device=resolve_device(device_preference))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(device_preference, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # device_id binds the process group to this GPU: NCCL connects eagerly at init, and its
        # barriers and collectives never guess the device from the rank.
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(minutes=30),
                                device_id=device if device.type == "cuda" else None)
    info = DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device)
    where = all_gather_objects((node, local_rank, socket.gethostname()), info)
    nodes = sorted(n for n, local, _ in where if local == 0)  # one entry per node's agent
    if nodes != list(range(len(nodes))):
        hosts = ", ".join(sorted({f"{h}: train.node_rank={n}" for n, _, h in where}))
        raise ConfigMismatch(f"the nodes' train.node_rank values are {nodes}, not 0..{len(nodes) - 1} once each "
                             f"({hosts}): give each node its own --node-rank")
    primary = next(r for r, (n, local, _) in enumerate(where) if n == 0 and local == 0)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device, primary_rank=primary)


def local_world_size(info: DistInfo) -> int:
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE, else the whole world (one node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))


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


def all_gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's `obj`, in rank order (`[obj]` on one process)."""
    if not info.distributed:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """The primary rank's `obj` on every rank (the others pass anything, e.g. None)."""
    if not info.distributed:
        return obj
    box = [obj if info.is_primary else None]
    dist.broadcast_object_list(box, src=info.primary_rank)
    return box[0]


def check_same_settings(settings: dict[str, Any], info: DistInfo, node: int = 0) -> None:
    """Every rank exchanges its resolved settings; on any difference every rank raises ConfigMismatch
    naming the keys and each node's value (before any training step, so no rank waits on a
    collective the others never reach)."""
    if not info.distributed:
        return
    everyone = all_gather_objects((node, socket.gethostname(), settings), info)
    _, primary_host, reference = everyone[info.primary_rank]
    differ: dict[str, dict[str, Any]] = {}
    for node, host, theirs in everyone:
        for key in sorted(set(reference) | set(theirs)):
            if theirs.get(key) != reference.get(key):
                differ.setdefault(key, {})[f"node {node} ({host})"] = theirs.get(key)
    if differ:
        where = {key: {f"node 0 ({primary_host})": reference.get(key), **values} for key, values in differ.items()}
        lines = "; ".join(f"{key}: " + ", ".join(f"{v!r} on {n}" for n, v in values.items())
                          for key, values in where.items())
        raise ConfigMismatch(f"the nodes disagree on {', '.join(differ)} ({lines}). Every node must run the same "
                             "commit with the same params.yaml, metrics/profile/<variant>_tuned.yaml, "
                             "metrics/plan/budget.yaml and data/prepared (`git pull && dvc pull` on each node).")


def sync_buffers(model: torch.nn.Module, info: DistInfo) -> None:
    """Global rank 0's buffers (BatchNorm running statistics) on every rank.

    Each rank updates its running statistics from its own batches; DDP is built without its
    broadcast of them before every forward (`parts.step_context`), which training never reads
    (BatchNorm normalises training batches with their own statistics). Rank 0's statistics are the
    same either way: they only ever see rank 0's batches. Syncing once at the end of an epoch
    gives validation one set of statistics on every rank, and the checkpoint the ones training
    continues from, whichever node rank 0 lands on.
    """
    if info.distributed:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under DDP and torch.compile wrappers."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)

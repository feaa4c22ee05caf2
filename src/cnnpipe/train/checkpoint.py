"""Checkpoints: written atomically, read back with `weights_only=True` (no code runs on load)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cnnpipe.config import LAUNCH_ONLY, VariantConfig
from cnnpipe.files import atomic_path

# Keys that may change between a crash and its resume, or differ between nodes, without changing
# what training computes: how often it saves, the host's threads, loader workers and allocator, where it runs;
# the bounds of `epochs: auto`, which count only through the count they chose (train.epochs, by then).
RESUME_NEUTRAL = {("train", "checkpoint_every"), ("train", "threads"), ("train", "num_workers"),
                  ("train", "pin_memory"), ("train", "malloc"), ("train", "min_epochs"), ("train", "max_epochs"),
                  *(("train", key) for key in LAUNCH_ONLY)}


class UnsafeCheckpoint(RuntimeError):
    """The file needs arbitrary pickle globals to load: refused."""


class CorruptCheckpoint(RuntimeError):
    """The file is empty, truncated or not a checkpoint at all."""


def computed_settings(cfg: VariantConfig, data: str = "") -> dict[str, Any]:
    """Every setting that changes what training computes, flat (`train.lr`: 0.2), with the data's
    fingerprint: what a resume must match and what every node must agree on."""
    raw = cfg.to_dict()
    for section, key in RESUME_NEUTRAL:
        raw[section].pop(key, None)
    raw.pop("profile", None)
    flat = {"variant": raw.pop("variant"), "seed": raw.pop("seed"), "data_fingerprint": data}
    for section, values in raw.items():
        flat.update({f"{section}.{key}": value for key, value in values.items()})
    return flat


def fingerprint(cfg: VariantConfig, data: str = "") -> str:
    """Hash of `computed_settings`."""
    return hashlib.sha256(json.dumps(computed_settings(cfg, data), sort_keys=True, default=str).encode()
                          ).hexdigest()[:16]


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) checkpoint state: about the size of its file."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """torch.save to a temp file, fsync, rename: a crash never leaves a half-written checkpoint, and a
    full disk is one `DiskFull` naming the file and the space (the previous checkpoint stays intact)."""
    path = Path(path)
    survives = (f"The previous {path.name} is intact: free some space and rerun (`dvc repro`) to resume from it."
                if path.exists() else "Free some space and rerun.")
    with atomic_path(path, state_bytes(state), survives) as tmp, open(tmp, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())


def load(path: Path) -> dict[str, Any]:
    """Load a checkpoint with weights_only=True; a pickle that would run code is refused, a file that
    is not a checkpoint (empty, truncated) raises CorruptCheckpoint."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" not in str(exc):
            raise CorruptCheckpoint(f"{path}: not a readable checkpoint ({str(exc).splitlines()[0]})") from exc
        raise UnsafeCheckpoint(f"{path}: refused, it is not a plain weights checkpoint and loading it would run "
                               f"arbitrary code ({str(exc).splitlines()[0]}). Only load files you trust.") from exc
    except FileNotFoundError:
        raise
    except Exception as exc:  # torch.load on an empty, truncated or foreign file: EOFError, RuntimeError, KeyError..
        raise CorruptCheckpoint(f"{path}: not a readable checkpoint ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else 'empty'})") from exc
    if not isinstance(state, dict):
        raise CorruptCheckpoint(f"{path}: not a checkpoint (holds a {type(state).__name__}, not a mapping)")
    return state


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's Python, NumPy and torch RNG states (and its own GPU's, on CUDA) in
    weights_only-loadable types."""
    np_state = np.random.get_state()
    state = {
        "python": [list(random.getstate()[1]), random.getstate()[2]] + [random.getstate()[0]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore what `rng_state` saved. A GPU's state goes to this process's GPU, whichever index it
    has now; on a CPU-only resume it is dropped (CPU kernels draw from the CPU generator)."""
    internal, gauss, version = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if isinstance(cuda, list):  # older checkpoints: every visible GPU's state
        cuda = cuda[0] if cuda else None
    if cuda is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)

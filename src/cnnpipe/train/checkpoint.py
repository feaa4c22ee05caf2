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

from cnnpipe.config import VariantConfig
from cnnpipe.files import atomic_path

# Keys that may change between a crash and its resume without changing what training computes.
RESUME_NEUTRAL = {("train", "checkpoint_every"), ("train", "threads"), ("train", "num_workers"),
                  ("train", "pin_memory")}


class UnsafeCheckpoint(RuntimeError):
    """The file needs arbitrary pickle globals to load: refused."""


def data_fingerprint(prepared_dir: Path) -> str:
    """Hash of the prepared data set's identity: its index, training labels and per-image sha256s."""
    digest = hashlib.sha256()
    for name in ("index.json", "train_labels.npy", "train_meta.jsonl"):
        path = Path(prepared_dir) / name
        if path.exists():
            digest.update(name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def fingerprint(cfg: VariantConfig, data: str = "") -> str:
    """Hash of every setting that changes what training computes, and of the data it trains on."""
    raw = cfg.to_dict()
    for section, key in RESUME_NEUTRAL:
        raw[section].pop(key, None)
    raw.pop("profile", None)
    raw["data_fingerprint"] = data
    return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:16]


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
    """Load a checkpoint with weights_only=True; a pickle that would run code is refused."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpoint(f"{path}: refused, it is not a plain weights checkpoint and loading it would run "
                               f"arbitrary code ({str(exc).splitlines()[0]}). Only load files you trust.") from exc


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states in weights_only-loadable types."""
    np_state = np.random.get_state()
    state = {
        "python": [list(random.getstate()[1]), random.getstate()[2]] + [random.getstate()[0]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` saved."""
    internal, gauss, version = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

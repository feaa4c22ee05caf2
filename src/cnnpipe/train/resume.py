"""Resuming an unfinished run from its last.pt, on every rank."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cnnpipe.config import VariantConfig
from cnnpipe.train import checkpoint as ckpt
from cnnpipe.train.distributed import DistInfo, broadcast_object
from cnnpipe.train.parts import TrainingParts


@dataclass
class Progress:
    """Where a run stands: what a resume restores and every epoch extends."""

    start_epoch: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    best_top1: float = -1.0
    resumed_from: int | None = None
    stopped_early: dict[str, Any] | None = None
    """Set when validation stopped the run before its last epoch (`schedule.early_stop`)."""


def _read_last(last_path: Path, info: DistInfo, note: str) -> dict[str, Any] | None:
    """The primary rank's last.pt, on every rank (other nodes may have no copy on their disk).

    A file that is not a readable checkpoint (empty, truncated by a full disk or a copy) is set
    aside as `last.pt.corrupt` with a message, and training starts over, instead of the same
    traceback on every run.
    """
    state = None
    if info.is_primary and last_path.exists():
        try:
            state = ckpt.load(last_path)
        except ckpt.CorruptCheckpoint as exc:
            aside = last_path.with_name(last_path.name + ".corrupt")
            os.replace(last_path, aside)
            print(f"{note}{exc}; moved it to {aside} and training starts from epoch 1", file=sys.stderr)
    return broadcast_object(state, info)


def resume(cfg: VariantConfig, info: DistInfo, parts: TrainingParts, ema: torch.nn.Module | None,
           last_path: Path, fingerprint: str) -> Progress:
    """Restore an unfinished run from `last_path` (made under the same params and data) into `parts`,
    on every rank: each gets its own RNG states back."""
    note = f"train[{cfg.variant}]: "
    state = _read_last(last_path, info, note)
    if state is None:
        return Progress()
    if state.get("fingerprint") != fingerprint:
        if info.is_primary:
            print(f"{note}NOT resuming {last_path}: it was made under different params or data "
                  f"({state.get('fingerprint')} != {fingerprint}); starting from scratch", file=sys.stderr)
        return Progress()
    if state["epoch"] >= cfg.train.epochs or state.get("stopped_early"):
        # A finished run (or one early stop ended) that DVC asks to run again: an input (code, data,
        # -f) changed. Only an unfinished run is resumed; a finished one is never silently reused.
        if info.is_primary:
            print(f"{note}{last_path} is a finished run; training again from scratch", file=sys.stderr)
        return Progress()
    saved_groups = len(state["optimizer"]["param_groups"])
    if saved_groups != len(parts.optimizer.param_groups):  # another start: a backbone/head split or not
        if info.is_primary:
            print(f"{note}NOT resuming {last_path}: it was started from other weights (its optimizer has "
                  f"{saved_groups} parameter groups, this run's {len(parts.optimizer.param_groups)}: "
                  f"{parts.init.source}); starting from scratch", file=sys.stderr)
        return Progress()
    parts.model.load_state_dict(state["model"])
    chosen = {k: parts.optimizer.defaults.get(k) for k in ("fused", "foreach")}
    parts.optimizer.load_state_dict(state["optimizer"])
    for group in parts.optimizer.param_groups:  # a checkpoint's groups carry the flags it was saved with
        group.update(chosen)
    if parts.scaler is not None and state.get("scaler"):
        parts.scaler.load_state_dict(state["scaler"])
    if ema is not None and state.get("ema"):
        ema.load_state_dict(state["ema"])
    rngs, augment = state["rng"], state.get("augment_rng") or [{}]
    if isinstance(augment, dict):  # older checkpoints: the primary rank's only
        augment = [augment]
    # A rank beyond those saved (a checkpoint from an older, primary-only format) takes the first.
    ckpt.set_rng_state(rngs[info.rank] if info.rank < len(rngs) else rngs[0], info.device)
    mine = augment[info.rank] if info.rank < len(augment) else augment[0]
    if mine and hasattr(parts.loader.device_transform, "load_state"):
        if not parts.loader.device_transform.load_state(mine, info.device) and info.is_primary:
            print(f"{note}the augmentation RNG was saved on {', '.join(mine)}, not {info.device}: re-seeded",
                  file=sys.stderr)
    parts.init = type(parts.init)(**state["init"])
    if info.local_rank == 0:  # each node says where it resumed (the checkpoint came from the primary's disk)
        where = f"node {cfg.train.node_rank} " if info.distributed else ""
        print(f"{note}{where}resuming from {last_path} after epoch {state['epoch']}/{cfg.train.epochs}", flush=True)
    return Progress(state["epoch"], state["history"], state.get("best_top1", -1.0), state["epoch"])

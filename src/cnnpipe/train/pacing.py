"""last.pt and best.pt during training: what they hold and when they are written."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cnnpipe.config import VariantConfig
from cnnpipe.train import checkpoint as ckpt
from cnnpipe.train.distributed import DistInfo, all_gather_objects, broadcast_object, unwrap
from cnnpipe.train.parts import TrainingParts
from cnnpipe.train.resume import Progress

BEST_KEYS = ("model", "ema", "meta", "init", "epoch", "fingerprint")
"""What best.pt holds: the weights and what loading them needs, no optimizer or RNG state."""
CHECKPOINT_SHARE = 0.05
"""Checkpoints may take at most this share of training time: a due last.pt is skipped while the time
since the previous one is under 1/share times what that one took to write. ResNet-50's last.pt is
~285 MB, fsynced: nothing on a CPU epoch of a minute, but more than a whole epoch on an H200."""


@dataclass
class Pacer:
    """When the last checkpoint was written and how long it took; the best model not yet on disk."""

    last_write: float = field(default_factory=time.monotonic)
    write_s: float = 0.0
    pending_best: dict[str, Any] | None = None

    def due(self, every: int | str, epoch: int, final: bool) -> bool:
        """`every`: train.checkpoint_every (N epochs, or `auto`: paced by `CHECKPOINT_SHARE`)."""
        if final:
            return True
        if every == "auto":
            return time.monotonic() - self.last_write >= self.write_s / CHECKPOINT_SHARE
        return (epoch + 1) % every == 0


def save_checkpoints(cfg: VariantConfig, info: DistInfo, parts: TrainingParts, model: torch.nn.Module,
                     ema: torch.nn.Module | None, progress: Progress, fingerprint: str, epoch: int, improved: bool,
                     model_dir: Path, pacer: Pacer) -> None:
    """last.pt every `train.checkpoint_every` epochs (`auto`: paced by `CHECKPOINT_SHARE`) and at the end,
    with every rank's RNG states; best.pt when validation improved, written just before the next last.pt
    (so a resume from that last.pt always finds a best.pt). Called on every rank (the RNG states are gathered); the
    primary rank decides and writes."""
    final = epoch + 1 == cfg.train.epochs or progress.stopped_early is not None  # and a pending best.pt written
    due = broadcast_object(pacer.due(cfg.train.checkpoint_every, epoch, final), info)
    if due:
        augment = getattr(parts.loader.device_transform, "state", dict)()
        rngs = all_gather_objects((ckpt.rng_state(info.device), augment), info)
    if not info.is_primary:
        return
    state = {
        "fingerprint": fingerprint, "epoch": epoch + 1, "history": progress.history,
        "best_top1": progress.best_top1, "stopped_early": progress.stopped_early,
        "model": unwrap(model).state_dict(),
        "init": parts.init.to_dict(), "meta": _model_meta(cfg, parts.split, parts.mean, parts.std, parts.amp),
        "ema": ema.state_dict() if ema is not None else None,
    }
    if not due:
        if improved:  # a CPU copy until the next write: the weights move on with the next epoch
            pacer.pending_best = {k: _to_cpu(state[k]) for k in BEST_KEYS}
        return
    best = {k: state[k] for k in BEST_KEYS} if improved else pacer.pending_best
    t0 = time.monotonic()
    # best.pt first: a kill between the two writes then leaves the best weights on disk and an older
    # last.pt, whose resume replays the epoch (and rewrites best.pt); the other order lost them.
    if best is not None:
        ckpt.save_atomic(best, model_dir / "best.pt")
    ckpt.save_atomic({
        **state, "optimizer": parts.optimizer.state_dict(),
        "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
        "rng": [r for r, _ in rngs], "augment_rng": [a for _, a in rngs],
    }, model_dir / "last.pt")
    pacer.pending_best = None
    pacer.last_write, pacer.write_s = time.monotonic(), time.monotonic() - t0


def _model_meta(cfg: VariantConfig, split, mean, std, amp: str) -> dict[str, Any]:
    """What evaluate/predict need to rebuild the model and its input transform."""
    return {"model_name": cfg.model.name, "num_classes": split.num_classes, "in_chans": split.channels,
            "classes": split.classes, "mean": list(mean), "std": list(std), "image_size": cfg.data.image_size,
            "amp": amp, "channels_last": cfg.train.channels_last}


def _to_cpu(value: Any) -> Any:
    """`value` with every tensor in it copied to the CPU (state dicts, nested)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value

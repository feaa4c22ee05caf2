"""A trained model back from models/<variant>/best.pt: the weights, its meta and its input transform.

Shared by evaluate, export and predict, so that loading a model does not pull in the metrics code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import timm
import torch

from cnnpipe.data.loaders import eval_transform
from cnnpipe.train import checkpoint as ckpt


def ema_is_better(best: dict[str, Any], last: Path) -> bool:
    """True when the `best` checkpoint carries EMA weights that scored higher on validation than its
    raw weights. The scores come from the training history in `last`, at the epoch best was saved.
    """
    if not best.get("ema") or not last.exists():
        return False
    history = ckpt.load(last).get("history", [])
    epoch = best.get("epoch", 0)
    record = history[epoch - 1] if 0 < epoch <= len(history) else {}
    return record.get("val_top1_ema", -1.0) > record.get("val_top1", -1.0)


def load_trained(model_dir: Path, device: torch.device, use_ema: bool | None = None) -> tuple[torch.nn.Module, dict]:
    """Rebuild the model saved in `model_dir/best.pt` (weights_only) and return it with its meta.

    `use_ema=None` takes the EMA weights when they validated better (`ema_is_better`); the meta's
    `weights` key says which were loaded.
    """
    path = model_dir / "best.pt"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run `dvc repro train@{model_dir.name}` first")
    state = ckpt.load(path)
    meta = dict(state["meta"])
    if use_ema is None:
        use_ema = ema_is_better(state, model_dir / "last.pt")
    model = timm.create_model(meta["model_name"], pretrained=False, num_classes=meta["num_classes"],
                              in_chans=meta["in_chans"])
    use_ema = bool(use_ema and state.get("ema"))
    model.load_state_dict(state["ema"] if use_ema else state["model"])
    meta["weights"] = "ema" if use_ema else "model"
    meta["epoch"] = state.get("epoch")
    model.to(device).eval()
    if meta.get("channels_last"):
        model.to(memory_format=torch.channels_last)
    return model, meta


def make_transform(meta: dict[str, Any]):
    """The shared deterministic eval/predict transform for this model."""
    return lambda images: eval_transform(images, meta["image_size"], meta["mean"], meta["std"],
                                         meta.get("channels_last", False))

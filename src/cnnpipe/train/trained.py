"""A trained model back from models/<variant>/best.pt: the weights, its meta and its input transform.

Shared by evaluate, export and predict, so that loading a model does not pull in the metrics code.
The whole input recipe, from a raw photo on, is `recipe`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import timm
import torch

from cnnpipe.data.loaders.transforms import eval_transform
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


def missing_model_hint(model_dir: Path) -> str:
    """What to do when `model_dir/best.pt` is missing: a stage's output (models/<variant>) is made by
    its train stage or pulled; any other folder holds what someone put there (`release.fetch`)."""
    if model_dir.parent.name == "models" and model_dir.name:
        stage = "champion" if model_dir.name == "champion" else f"train@{model_dir.name}"
        return f"run `dvc repro {stage}` first (or `dvc pull {stage}` from a DVC remote that holds it)"
    return ("give a cnnpipe best.pt or the folder holding it (`models/<variant>` after `dvc repro`, or what "
            "`python -m cnnpipe.release.fetch` wrote)")


def trained_weights(model_dir: Path, use_ema: bool | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The state dict `model_dir/best.pt` serves (weights_only) and its meta.

    `use_ema=None` takes the EMA weights when they validated better (`ema_is_better`); the meta's
    `weights` key says which were taken, and `temperature` is the one fitted for them (1: none was).
    """
    path = model_dir / "best.pt"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: {missing_model_hint(model_dir)}")
    state = ckpt.load(path)
    meta = dict(state["meta"])
    if use_ema is None:  # the weights calibrate_best chose, saved with them: best.pt alone deploys
        use_ema = meta["serve"] == "ema" if "serve" in meta else ema_is_better(state, model_dir / "last.pt")
    use_ema = bool(use_ema and state.get("ema"))
    meta["weights"] = "ema" if use_ema else "model"
    meta["epoch"] = state.get("epoch")
    # The temperature fitted for these weights (`temperature.calibrate_best`); 1: none was.
    meta["temperature"] = float(meta.get("temperature", 1.0)) if meta.get("temperature_for") == meta["weights"] else 1.0
    return state["ema"] if use_ema else state["model"], meta


def load_trained(model_dir: Path, device: torch.device, use_ema: bool | None = None) -> tuple[torch.nn.Module, dict]:
    """Rebuild the model saved in `model_dir/best.pt` (`trained_weights`) and return it with its meta."""
    weights, meta = trained_weights(model_dir, use_ema)
    model = timm.create_model(meta["model_name"], pretrained=False, num_classes=meta["num_classes"],
                              in_chans=meta["in_chans"])
    model.load_state_dict(weights)
    model.to(device).eval()
    if meta.get("channels_last"):
        model.to(memory_format=torch.channels_last)
    return model, meta


class Calibrated(torch.nn.Module):
    """`model` whose logits are divided by its fitted temperature: softmax gives calibrated
    probabilities, the argmax is the model's own. What predict runs and what export writes."""

    def __init__(self, model: torch.nn.Module, temperature: float) -> None:
        super().__init__()
        self.model, self.temperature = model, float(temperature)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x) / self.temperature


def make_transform(meta: dict[str, Any]):
    """The shared deterministic eval/predict transform for this model."""
    return lambda images: eval_transform(images, meta["image_size"], meta["mean"], meta["std"],
                                         meta.get("channels_last", False))


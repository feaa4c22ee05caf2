"""Evaluate a trained checkpoint on the test split: accuracy, calibration, speed and memory."""

from __future__ import annotations

import csv
import statistics
import time
from pathlib import Path
from typing import Any

import timm
import torch

from . import checkpoint as ckpt
from .data.loaders import build_eval_loader, eval_transform
from .data.store import open_split
from .engine import predict
from .files import write_json
from .gallery import most_confident_mistakes, save_gallery
from .metrics import classification_summary
from .monitor import peak_mem_mb
from .precision import autocast


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


@torch.no_grad()
def inference_throughput(model: torch.nn.Module, meta: dict, device: torch.device, batch: int = 256,
                         steps: int = 5) -> float:
    """Images/s of the model alone on a synthetic batch: warm-up excluded, median of `steps`."""
    x = torch.zeros(batch, meta["in_chans"], meta["image_size"], meta["image_size"], device=device)
    if meta.get("channels_last"):
        x = x.contiguous(memory_format=torch.channels_last)
    times = []
    for i in range(steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with autocast(meta["amp"], device):
            model(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first call pays for allocation and kernel selection
            times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)


def evaluate(model_dir: Path, prepared_dir: Path, out_dir: Path, device: torch.device,
             max_images: int | None = None, gallery_size: int = 16) -> dict[str, Any]:
    """Write eval.json, classes.json, predictions.csv, calibration.csv and mistakes.png to `out_dir`."""
    model, meta = load_trained(model_dir, device)
    split = open_split(prepared_dir, "test", limit=max_images)
    loader = build_eval_loader(split, batch_size=256)
    t0 = time.perf_counter()
    logits, labels = predict(model, loader, make_transform(meta), device, meta["amp"])
    wall = time.perf_counter() - t0
    summary = classification_summary(logits, labels, meta["classes"])
    result = {
        "top1": summary["top1"], "top5": summary["top5"], "loss": summary["loss"], "ece": summary["ece"],
        "macro_f1": summary["macro_f1"], "mean_confidence": summary["mean_confidence"],
        "images": len(labels), "eval_throughput_img_s": len(labels) / wall,
        "model_throughput_img_s": inference_throughput(model, meta, device),
        "peak_mem_mb": peak_mem_mb(device), "device": device.type, "amp": meta["amp"],
        "weights": meta["weights"],
    }
    classes = meta["classes"]
    mistakes = most_confident_mistakes(logits, labels, gallery_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "classes.json", {
        "per_class": summary["per_class"], "confusion": summary["confusion"], "classes": classes,
        "most_confident_mistakes": [{"test_index": i, "actual": classes[a], "predicted": classes[p],
                                     "probability": q} for i, a, p, q in mistakes]})
    with open(out_dir / "predictions.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["actual", "predicted"])
        writer.writerows([classes[a], classes[p]] for a, p in summary["predictions"])
    with open(out_dir / "calibration.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(summary["calibration"][0]))
        writer.writeheader()
        writer.writerows(summary["calibration"])
    write_json(out_dir / "eval.json", result)
    save_gallery(out_dir / "mistakes.png", split.images, mistakes, classes,
                 title=f"{model_dir.name}: most confident mistakes on the test split")
    return result

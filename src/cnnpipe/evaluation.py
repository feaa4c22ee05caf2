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
from .metrics import classification_summary
from .monitor import peak_mem_mb
from .precision import autocast


def load_trained(model_dir: Path, device: torch.device, use_ema: bool = False) -> tuple[torch.nn.Module, dict]:
    """Rebuild the model saved in `model_dir/best.pt` (weights_only) and return it with its meta."""
    path = model_dir / "best.pt"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run `dvc repro train@{model_dir.name}` first")
    state = ckpt.load(path)
    meta = state["meta"]
    model = timm.create_model(meta["model_name"], pretrained=False, num_classes=meta["num_classes"],
                              in_chans=meta["in_chans"])
    weights = state["ema"] if use_ema and state.get("ema") else state["model"]
    model.load_state_dict(weights)
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
             max_images: int | None = None) -> dict[str, Any]:
    """Write eval.json, classes.json, predictions.csv and calibration.csv to `out_dir`."""
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
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "eval.json", result)
    write_json(out_dir / "classes.json", {"per_class": summary["per_class"], "confusion": summary["confusion"],
                                          "classes": meta["classes"]})
    classes = meta["classes"]
    with open(out_dir / "predictions.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["actual", "predicted"])
        writer.writerows([classes[a], classes[p]] for a, p in summary["predictions"])
    with open(out_dir / "calibration.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(summary["calibration"][0]))
        writer.writeheader()
        writer.writerows(summary["calibration"])
    return result

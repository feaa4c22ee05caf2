"""Classification metrics as pure functions of logits and labels."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import classification_report, confusion_matrix

from cnnpipe.train.engine import topk_correct


def topk_accuracy(logits: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    """Fraction of rows whose label is among the `k` highest logits."""
    return topk_correct(logits, labels, k) / len(labels) if len(labels) else 0.0


def calibration_bins(probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 15) -> list[dict[str, float]]:
    """Reliability-diagram bins: mean confidence, accuracy and count per confidence bin."""
    conf, pred = probs.max(dim=1)
    correct = (pred == labels).float()
    edges = torch.linspace(0, 1, n_bins + 1)
    bins = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        mask = (conf > lo) & (conf <= hi)
        n = int(mask.sum())
        bins.append({
            "bin_low": round(float(lo), 4), "bin_high": round(float(hi), 4), "count": n,
            "confidence": float(conf[mask].mean()) if n else 0.0,
            "accuracy": float(correct[mask].mean()) if n else 0.0,
        })
    return bins


def expected_calibration_error(bins: list[dict[str, float]]) -> float:
    """ECE: count-weighted mean |accuracy − confidence| over the bins."""
    total = sum(b["count"] for b in bins)
    if total == 0:
        return 0.0
    return sum(b["count"] * abs(b["accuracy"] - b["confidence"]) for b in bins) / total


def classification_summary(logits: torch.Tensor, labels: torch.Tensor, classes: list[str]) -> dict[str, Any]:
    """top-1/top-5, loss, ECE, per-class report and confusion matrix.

    Top-1 counts the same predictions the confusion matrix and predictions.csv hold (one argmax):
    under bf16, logits tie often enough that a separate `topk(1)` broke 2 ties in 10,000 the other way.
    """
    probs = F.softmax(logits.float(), dim=1)
    pred = probs.argmax(dim=1)
    top1_correct = int((pred == labels).sum())
    bins = calibration_bins(probs, labels)
    y_true, y_pred = labels.numpy(), pred.numpy()
    ids = list(range(len(classes)))
    report = classification_report(y_true, y_pred, labels=ids, target_names=classes, output_dict=True,
                                   zero_division=0)
    return {
        "top1": top1_correct / len(labels) if len(labels) else 0.0,
        "top1_correct": top1_correct,
        "top5": topk_accuracy(logits, labels, 5),
        "loss": F.cross_entropy(logits.float(), labels).item() if len(labels) else 0.0,
        "ece": expected_calibration_error(bins),
        "mean_confidence": float(probs.max(dim=1).values.mean()) if len(labels) else 0.0,
        "calibration": bins,
        "per_class": {c: {k: float(v) for k, v in report[c].items()} for c in classes},
        "macro_f1": float(report["macro avg"]["f1-score"]),
        "confusion": confusion_matrix(y_true, y_pred, labels=ids).tolist(),
        "predictions": np.stack([y_true, y_pred], axis=1).tolist(),
    }

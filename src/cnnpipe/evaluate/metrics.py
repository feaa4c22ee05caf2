"""Classification metrics as pure functions of logits and labels."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

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


def per_class_results(y_true: np.ndarray, y_pred: np.ndarray, classes: list[str]) -> list[dict[str, Any]]:
    """Precision, recall, F1 and support of every class, worst F1 first (ties: more images first).

    Counted with bincounts, so 10,000 classes cost what 10 do; a class never predicted has
    precision 0, as scikit-learn's `zero_division=0` gives."""
    k = len(classes)
    support = np.bincount(y_true, minlength=k)
    predicted = np.bincount(y_pred, minlength=k)
    hits = np.bincount(y_true[y_true == y_pred], minlength=k)
    precision = np.divide(hits, predicted, out=np.zeros(k), where=predicted > 0)
    recall = np.divide(hits, support, out=np.zeros(k), where=support > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros(k), where=precision + recall > 0)
    order = sorted(range(k), key=lambda i: (f1[i], -support[i], classes[i]))
    return [{"class": classes[i], "f1": float(f1[i]), "precision": float(precision[i]), "recall": float(recall[i]),
             "support": int(support[i])} for i in order]


def confusion_counts(y_true: np.ndarray, y_pred: np.ndarray, num_classes: int) -> list[tuple[int, int, int]]:
    """The confusion matrix's non-zero cells as (actual, predicted, count), row-major: at most one
    per test image, where the dense matrix of 1,000 classes has a million cells."""
    cells, counts = np.unique(y_true.astype(np.int64) * num_classes + y_pred, return_counts=True)
    return [(int(c // num_classes), int(c % num_classes), int(n)) for c, n in zip(cells, counts)]


def most_confused(cells: list[tuple[int, int, int]], classes: list[str], top: int) -> list[dict[str, Any]]:
    """The `top` largest off-diagonal cells: which class is taken for which, how often, and what share
    of the actual class that is (its row of the matrix: every test image of it)."""
    actual_total: dict[int, int] = {}
    for a, _, n in cells:
        actual_total[a] = actual_total.get(a, 0) + n
    off = sorted((c for c in cells if c[0] != c[1]), key=lambda c: (-c[2], c[0], c[1]))[:top]
    return [{"actual": classes[a], "predicted": classes[p], "count": n,
             "share_of_actual": n / actual_total[a]} for a, p, n in off]


def dense_confusion(cells: list[tuple[int, int, int]], num_classes: int) -> list[list[int]]:
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    for a, p, n in cells:
        matrix[a, p] = n
    return matrix.tolist()


def classification_summary(logits: torch.Tensor, labels: torch.Tensor, classes: list[str]) -> dict[str, Any]:
    """top-1/top-5, loss, ECE, per-class results and the confusion matrix's non-zero cells.

    Top-1 counts the same predictions the confusion matrix and predictions.csv hold (one argmax):
    under bf16, logits tie often enough that a separate `topk(1)` broke 2 ties in 10,000 the other way.
    """
    probs = F.softmax(logits.float(), dim=1)
    confidence, pred = probs.max(dim=1)
    top1_correct = int((pred == labels).sum())
    bins = calibration_bins(probs, labels)
    y_true, y_pred = labels.numpy(), pred.numpy()
    per_class = per_class_results(y_true, y_pred, classes)
    return {
        "top1": top1_correct / len(labels) if len(labels) else 0.0,
        "top1_correct": top1_correct,
        "top5": topk_accuracy(logits, labels, 5),
        "loss": F.cross_entropy(logits.float(), labels).item() if len(labels) else 0.0,
        "ece": expected_calibration_error(bins),
        "mean_confidence": float(confidence.mean()) if len(labels) else 0.0,
        "calibration": bins,
        "per_class": per_class,
        "macro_f1": float(np.mean([c["f1"] for c in per_class])) if per_class else 0.0,
        "confusion_cells": confusion_counts(y_true, y_pred, len(classes)),
        "predictions": y_pred,
        "confidence": confidence.numpy(),
    }

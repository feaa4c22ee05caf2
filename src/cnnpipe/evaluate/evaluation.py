"""Evaluate a trained checkpoint on the test split: accuracy, calibration, speed and memory."""

from __future__ import annotations

import csv
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from cnnpipe.data.splits.held_out import open_judged
from cnnpipe.data.loaders.host import build_eval_loader
from cnnpipe.data.store.shards import read_index, test_sources
from cnnpipe.evaluate.gallery import most_confident_mistakes, save_gallery
from cnnpipe.evaluate.metrics import (
    calibration_bins,
    classification_summary,
    dense_confusion,
    expected_calibration_error,
    most_confused,
)
from cnnpipe.evaluate.stats import SMALL_TEST, wilson_interval
from cnnpipe.files import write_json
from cnnpipe.malloc import keep_for_inference
from cnnpipe.monitor import peak_mem_mb
from cnnpipe.uptime import process_seconds
from cnnpipe.train.budget import EVAL_BATCH
from cnnpipe.train.engine import forward_times, predict, topk_correct
from cnnpipe.train.trained import load_trained, make_transform

MAX_INLINE_CLASSES = 30  # beyond this a dense matrix in git JSON is too big to read or diff
MOST_CONFUSED = 20
WORST_SHOWN = 20


def split_warnings(images: int, carved: list[str]) -> list[str]:
    """Why a top-1 on this test split may not separate two models: too few images, or carved from train."""
    warnings = []
    if images < SMALL_TEST:
        low, high = wilson_interval(images // 2, images)
        warnings.append(f"small test split: {images} images (under {SMALL_TEST}); a top-1 near 50% is only known "
                        f"to within {low:.0%}-{high:.0%}, so differences of several points are within chance")
    if "test" in carved:
        warnings.append("the test split was carved out of the training images (the source has no test/ folder): "
                        "it shares their collection process, so top-1 may be optimistic for new images")
    return warnings


def write_predictions(path: Path, summary: dict[str, Any], labels: list[int], classes: list[str],
                      sources: list[str]) -> None:
    """One row per test image: what it is, what the model said, how sure it was, and which file it
    came from (a DVC-tracked file: at a million test images it is tens of MB)."""
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["actual", "predicted", "confidence", "source"])
        for actual, predicted, confidence, source in zip(labels, summary["predictions"], summary["confidence"],
                                                          sources):
            writer.writerow([classes[actual], classes[predicted], f"{confidence:.4f}", source])


def write_class_results(out_dir: Path, summary: dict[str, Any], classes: list[str],
                        mistakes: list[tuple[int, int, int, float]]) -> None:
    """classes.json and classes.md (git: bounded at any class count) and confusion.csv (DVC: every
    non-zero cell). The dense matrix goes into classes.json only while it is small enough to read."""
    cells = summary["confusion_cells"]
    confused = most_confused(cells, classes, MOST_CONFUSED)
    write_json(out_dir / "classes.json", {
        "classes": classes,
        "per_class_worst_first": summary["per_class"],
        "most_confused": confused,
        "confusion": dense_confusion(cells, len(classes)) if len(classes) <= MAX_INLINE_CLASSES else None,
        "confusion_file": "confusion.csv",
        "most_confident_mistakes": [{"test_index": i, "actual": classes[a], "predicted": classes[p],
                                     "probability": q} for i, a, p, q in mistakes]})
    with open(out_dir / "confusion.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["actual", "predicted", "count"])
        writer.writerows((classes[a], classes[p], n) for a, p, n in cells)
    worst = summary["per_class"][:WORST_SHOWN]
    heading = ("Every class, weakest first" if len(worst) == len(classes)
               else f"The {len(worst)} weakest classes")
    lines = [f"# Per-class results on the test split ({len(classes)} classes)", "",
             f"## {heading} (lowest F1)", "",
             "| Class | F1 | Precision | Recall | Test images |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {_cell(c['class'])} | {c['f1']:.3f} | {c['precision']:.3f} | {c['recall']:.3f} | {c['support']} |"
              for c in worst]
    lines += ["", f"## The {len(confused)} most-confused pairs", "",
              "| Actual | Taken for | Images | Share of the actual class |", "|---|---|---:|---:|"]
    lines += [f"| {_cell(p['actual'])} | {_cell(p['predicted'])} | {p['count']} | {p['share_of_actual']:.1%} |"
              for p in confused]
    lines += ["", "Every class, worst first: `classes.json`. Every non-zero cell of the confusion matrix: "
              "`confusion.csv`; every test image: `predictions.csv` (both tracked by DVC).", ""]
    (out_dir / "classes.md").write_text("\n".join(lines), encoding="utf-8")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def evaluate(model_dir: Path, prepared_dir: Path, out_dir: Path, device: torch.device,
             max_images: int | None = None, gallery_size: int = 16, held_out: Path | None = None,
             batch_size: int = EVAL_BATCH) -> dict[str, Any]:
    """Write eval.json, classes.json, classes.md, confusion.csv, predictions.csv, calibration.csv (with
    the fitted temperature), calibration_raw.csv (without) and mistakes.png to `out_dir`; the test
    photos the delivery check's list `held_out` holds out, and those whose bytes were ever in a training
    split (a model may have memorised them: counted in `once_trained_on_left_out`), are left out
    (`data.splits.held_out.open_judged`). The test split and the model-only speed run at `batch_size`
    (the plan's `eval_batch`: the batch the profile timed, so the plan predicts what runs)."""
    allocator = keep_for_inference()  # as warm as the process the profile timed inference in
    model, meta = load_trained(model_dir, device)
    split, kept, memorised = open_judged(prepared_dir, "test", held_out, limit=max_images)
    loader = build_eval_loader(split, batch_size=batch_size)
    t0 = time.perf_counter()
    raw, labels = predict(model, loader, make_transform(meta), device, meta["amp"])
    wall = time.perf_counter() - t0
    logits = raw / meta["temperature"]  # what predict and the exports serve; the argmax is the same
    summary = classification_summary(logits, labels, meta["classes"])
    raw_bins = calibration_bins(torch.softmax(raw, dim=1), labels)
    n = len(labels)
    # 95% Wilson intervals: where the model's accuracy on new images of this kind may lie.
    top1_ci = wilson_interval(summary["top1_correct"], n)
    top5_ci = wilson_interval(topk_correct(logits, labels, 5), n)
    result = {
        "top1": summary["top1"], "top1_ci95_low": top1_ci[0], "top1_ci95_high": top1_ci[1],
        "top5": summary["top5"], "top5_ci95_low": top5_ci[0], "top5_ci95_high": top5_ci[1],
        "loss": summary["loss"], "ece": summary["ece"], "temperature": meta["temperature"],
        "ece_before_temperature": expected_calibration_error(raw_bins),
        "macro_f1": summary["macro_f1"], "mean_confidence": summary["mean_confidence"],
        "images": n, "eval_throughput_img_s": n / wall,
        "model_throughput_img_s": batch_size / statistics.median(forward_times(
            model, meta["in_chans"], meta["image_size"], bool(meta.get("channels_last")), meta["amp"], device,
            batch=batch_size)),
        "eval_batch": batch_size, "malloc": allocator,
        "peak_mem_mb": peak_mem_mb(device), "device": device.type, "amp": meta["amp"],
        "weights": meta["weights"],
        "warnings": split_warnings(n, read_index(prepared_dir).get("carved", [])),
        "once_trained_on_left_out": memorised,
    }
    if memorised:
        result["warnings"].append(f"{memorised} test image(s) were in a training split before (the split ledger): "
                                  "left out of these numbers, since a model may have memorised them")
    classes = meta["classes"]
    mistakes = most_confident_mistakes(logits, labels, gallery_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_class_results(out_dir, summary, classes, mistakes)
    sources = test_sources(prepared_dir, max_images)
    write_predictions(out_dir / "predictions.csv", summary, labels.tolist(), classes,
                      sources[:n] if kept is None else [sources[i] for i in kept])
    for name, bins in (("calibration.csv", summary["calibration"]), ("calibration_raw.csv", raw_bins)):
        with open(out_dir / name, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(bins[0]))
            writer.writeheader()
            writer.writerows(bins)
    result["stage_time_s"] = process_seconds()
    write_json(out_dir / "eval.json", result)
    save_gallery(out_dir / "mistakes.png", split.images, mistakes, classes,
                 title=f"{model_dir.name}: most confident mistakes on the test split")
    return result

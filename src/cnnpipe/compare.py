"""Baseline vs optimized: the side-by-side table users otherwise write by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# (key in the output, label, source file, key in source, format)
ROWS = (
    ("top1", "Top-1 (test)", "eval", "top1", "{:.2%}"),
    ("top5", "Top-5 (test)", "eval", "top5", "{:.2%}"),
    ("ece", "Calibration error (ECE)", "eval", "ece", "{:.4f}"),
    ("epoch_time_s", "Epoch time (s, median)", "train", "epoch_time_s", "{:.1f}"),
    ("train_time_s", "Training time (s)", "train", "train_time_s", "{:.0f}"),
    ("throughput_img_s", "Train throughput (img/s)", "train", "throughput_img_s", "{:.0f}"),
    ("data_wait_frac", "Data-wait fraction", "train", "data_wait_frac", "{:.1%}"),
    ("peak_mem_mb", "Peak memory (MB)", "train", "peak_mem_mb", "{:.0f}"),
    ("eval_throughput_img_s", "Inference (img/s, model only)", "eval", "model_throughput_img_s", "{:.0f}"),
)
SETTINGS = ("amp", "channels_last", "loader", "global_batch", "optimizer_steps", "images_per_epoch", "init", "device",
            "world_size")


def load_variant(metrics_dir: Path, variant: str) -> dict[str, dict[str, Any]]:
    """train.json and eval.json of one variant."""
    out = {}
    for kind in ("train", "eval"):
        path = metrics_dir / variant / f"{kind}.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: run `dvc repro` for {variant} first")
        out[kind] = json.loads(path.read_text())
    return out


def compare(base: dict[str, dict[str, Any]], opt: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Side-by-side values, the headline ratios and the settings that differ."""
    rows = {}
    for key, _, source, src_key, _ in ROWS:
        b, o = base[source].get(src_key), opt[source].get(src_key)
        rows[key] = {"baseline": b, "optimized": o,
                     "ratio": (o / b) if isinstance(b, (int, float)) and b and o is not None else None}
    return {
        "speedup_throughput": rows["throughput_img_s"]["ratio"],
        "speedup_epoch_time": (base["train"]["epoch_time_s"] / opt["train"]["epoch_time_s"]),
        "top1_delta": opt["eval"]["top1"] - base["eval"]["top1"],
        "rows": rows,
        "settings": {k: {"baseline": base["train"].get(k), "optimized": opt["train"].get(k)} for k in SETTINGS},
    }


def plan_vs_actual(plan: dict[str, Any], base: dict[str, dict[str, Any]],
                   opt: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The plan's predicted training time next to what train.json measured (wall time of the stage)."""
    rows = {}
    for variant, result in (("baseline", base), ("optimized", opt)):
        predicted = plan["predicted_s"].get(f"train@{variant}")
        actual = result["train"].get("wall_time_s")
        rows[f"train@{variant}"] = {"predicted_s": predicted, "actual_s": actual,
                                    "ratio": actual / predicted if predicted and actual else None}
    return {"budget_minutes": plan["budget_minutes"], "images_per_epoch": plan["images_per_epoch"],
            "fraction": plan["fraction"], "predicted_total_s": plan["predicted_total_s"], "stages": rows}


def _fmt(fmt: str, value: Any) -> str:
    return "n/a" if value is None else fmt.format(value)


def to_markdown(result: dict[str, Any]) -> str:
    """The same numbers as compare.json, as a Markdown table."""
    lines = ["# Baseline vs optimized", "",
             f"**{result['speedup_throughput']:.2f}x** training throughput, "
             f"**{result['speedup_epoch_time']:.2f}x** shorter epochs, "
             f"top-1 {result['top1_delta'] * 100:+.2f} points.", "",
             "| Metric | Baseline | Optimized | Optimized / baseline |", "| --- | ---: | ---: | ---: |"]
    for key, label, _, _, fmt in ROWS:
        row = result["rows"][key]
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        lines.append(f"| {label} | {_fmt(fmt, row['baseline'])} | {_fmt(fmt, row['optimized'])} | {ratio} |")
    lines += ["", "| Setting | Baseline | Optimized |", "| --- | --- | --- |"]
    for key, pair in result["settings"].items():
        lines.append(f"| {key} | {pair['baseline']} | {pair['optimized']} |")
    if result.get("plan"):
        plan = result["plan"]
        lines += ["", f"Time plan (budget {plan['budget_minutes']} min, {plan['images_per_epoch']} training images "
                  f"per epoch; metrics/plan/plan.md):", "", "| Stage | Predicted | Actual | Actual / predicted |",
                  "| --- | ---: | ---: | ---: |"]
        for name, row in plan["stages"].items():
            ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x"
            lines.append(f"| {name} | {_fmt('{:.0f} s', row['predicted_s'])} | {_fmt('{:.0f} s', row['actual_s'])} "
                         f"| {ratio} |")
    lines += ["", "Most confident mistakes on the test split: [baseline](baseline/mistakes.png) · "
              "[optimized](optimized/mistakes.png) (written by `evaluate`).",
              "", "Generated by `dvc repro compare` from metrics/<variant>/train.json and eval.json.", ""]
    return "\n".join(lines)

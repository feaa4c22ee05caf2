"""Baseline vs optimized: the side-by-side table users otherwise write by hand, with how sure each
difference is (accuracy: McNemar's exact test on the same test images; speed: per-epoch spread)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from cnnpipe.evaluate.stats import ALPHA, mcnemar_exact, median_iqr, paired_counts, ratio_range

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
SETTINGS = ("amp", "channels_last", "loader", "decode", "malloc", "global_batch", "optimizer_steps", "images_per_epoch",
            "init", "device", "world_size", "eval_batch")


def load_predictions(path: Path) -> dict[str, list[str]]:
    """predictions.csv as columns (`actual`, `predicted`), one row per test image in split order."""
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run `dvc repro evaluate@{path.parent.name}` first")
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    return {"actual": [r["actual"] for r in rows], "predicted": [r["predicted"] for r in rows]}


def load_variant(metrics_dir: Path, variant: str) -> dict[str, Any]:
    """train.json, eval.json and predictions.csv of one variant."""
    out: dict[str, Any] = {}
    for kind in ("train", "eval"):
        path = metrics_dir / variant / f"{kind}.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: run `dvc repro` for {variant} first")
        out[kind] = json.loads(path.read_text())
    out["predictions"] = load_predictions(metrics_dir / variant / "predictions.csv")
    export = metrics_dir / variant / "export.json"
    out["export"] = json.loads(export.read_text()) if export.exists() else {}
    return out


def paired_significance(base: dict[str, list[str]], opt: dict[str, list[str]]) -> dict[str, Any]:
    """McNemar's exact test of the top-1 difference on the same test images."""
    if base["actual"] != opt["actual"]:
        raise ValueError("the two predictions.csv files list different test labels: evaluate both variants "
                         "on the same prepared data (`dvc repro evaluate@baseline evaluate@optimized`)")
    counts = paired_counts(base["actual"], base["predicted"], opt["predicted"])
    p = mcnemar_exact(counts["only_a"], counts["only_b"])
    gain = counts["only_b"] - counts["only_a"]
    verdict = "no significant difference" if p >= ALPHA or gain == 0 else (
        "optimized is better" if gain > 0 else "baseline is better")
    return {"test_images": len(base["actual"]), "both_right": counts["both_right"],
            "only_baseline_right": counts["only_a"], "only_optimized_right": counts["only_b"],
            "both_wrong": counts["both_wrong"], "p_value": p, "alpha": ALPHA, "verdict": verdict}


def speed_spread(base_train: dict[str, Any], opt_train: dict[str, Any]) -> dict[str, Any]:
    """Per-epoch training throughput of both recipes: quartiles, and the ratio with a range."""
    epochs = {name: [h["throughput_img_s"] for h in t.get("history", []) if h.get("throughput_img_s")]
              for name, t in (("baseline", base_train), ("optimized", opt_train))}
    if not all(epochs.values()):
        return {}
    out: dict[str, Any] = {}
    for name, values in epochs.items():
        q1, median, q3 = median_iqr(values)
        out[name] = {"q1": q1, "median": median, "q3": q3, "epochs": len(values)}
    out.update(ratio_range(epochs["optimized"], epochs["baseline"]))
    return out


def compare(base: dict[str, Any], opt: dict[str, Any]) -> dict[str, Any]:
    """Side-by-side values, the headline ratios with their uncertainty, and the settings that differ."""
    rows = {}
    for key, _, source, src_key, _ in ROWS:
        b, o = base[source].get(src_key), opt[source].get(src_key)
        rows[key] = {"baseline": b, "optimized": o,
                     "ratio": (o / b) if isinstance(b, (int, float)) and b and o is not None else None}
    batches = (base["eval"].get("eval_batch"), opt["eval"].get("eval_batch"))
    if None not in batches and batches[0] != batches[1]:  # each at its profile's batch: not one measurement
        rows["eval_throughput_img_s"].update(ratio=None, ratio_note=f"n/a (batch {batches[0]} vs {batches[1]})")
    for k in (1, 5):
        for name, result in (("baseline", base), ("optimized", opt)):
            ci = (result["eval"].get(f"top{k}_ci95_low"), result["eval"].get(f"top{k}_ci95_high"))
            rows[f"top{k}"][f"{name}_ci95"] = list(ci) if None not in ci else None
    warnings = sorted({w for r in (base, opt) for w in r["eval"].get("warnings", [])})
    return {
        "speedup_throughput": rows["throughput_img_s"]["ratio"],
        "speedup_epoch_time": (base["train"]["epoch_time_s"] / opt["train"]["epoch_time_s"]),
        "top1_delta": opt["eval"]["top1"] - base["eval"]["top1"],
        "significance": paired_significance(base["predictions"], opt["predictions"]),
        "speed_spread": speed_spread(base["train"], opt["train"]),
        "warnings": warnings,
        "rows": rows,
        "settings": {k: {"baseline": base["train"].get(k), "optimized": opt["train"].get(k)} for k in SETTINGS},
        "starts": {"baseline": start_of(base["train"].get("init")), "optimized": start_of(opt["train"].get("init"))},
    }


def start_of(init: str | None) -> str:
    """What a train.json `init` (`random`, `<source>:<location>`) says the run started from."""
    if not init or init == "random":
        return "random init"
    source, _, where = init.partition(":")
    return f"the champion ({where})" if source == "champion" else f"pretrained weights ({where})"


def start_sentence(result: dict[str, Any]) -> str | None:
    """The headline when the recipes start from different weights: the top-1 gap is then not all the
    recipe's, and how to train the baseline from the same start; None when they start alike."""
    starts = result.get("starts") or {}
    base, opt = starts.get("baseline"), starts.get("optimized")
    if base is None or opt is None or base.split(" (")[0] == opt.split(" (")[0]:
        return None
    return (f"Starts: **the recipes start differently**, the baseline from {base}, the optimized from {opt}: part "
            "of the top-1 gap is the start's, not the recipe's. To separate them, train the baseline recipe from the "
            "same weights: `dvc exp run -S variants.baseline.model.pretrained=true` (it keeps its one LR for every "
            "layer, `pretrained_lr_scale: 1.0`).")


def plan_vs_actual(plan: dict[str, Any], base: dict[str, Any], opt: dict[str, Any]) -> dict[str, Any]:
    """Each stage's predicted time next to what it measured (`stage_time_s`: process start to end),
    and the share of the measured time that went into training."""
    measured_before = {**plan.get("spent_s", {}), **plan.get("profile_s", {})}  # before the plan: no prediction
    rows = {name: {"predicted_s": None, "actual_s": seconds, "ratio": None} for name, seconds in measured_before.items()}
    for variant, result in (("baseline", base), ("optimized", opt)):
        train = result["train"]
        measured = {"train": train.get("stage_time_s", train.get("wall_time_s")),
                    "evaluate": result["eval"].get("stage_time_s"),
                    "export": result.get("export", {}).get("stage_time_s")}
        for stage, actual in measured.items():
            predicted = plan["predicted_s"].get(f"{stage}@{variant}")
            rows[f"{stage}@{variant}"] = {"predicted_s": predicted, "actual_s": actual,
                                         "ratio": actual / predicted if predicted and actual else None}
    timed = [r["actual_s"] for r in rows.values() if r["actual_s"]]
    training = sum(r["actual_s"] or 0.0 for name, r in rows.items() if name.startswith("train@"))
    # the same stages' prediction (the measured ones as measured), and the rest of the whole run's
    predicted_rows = sum(r["predicted_s"] if r["predicted_s"] is not None else r["actual_s"] or 0.0
                         for r in rows.values())
    return {"budget_minutes": plan["budget_minutes"], "images_per_epoch": plan["images_per_epoch"],
            "fraction": plan["fraction"], "predicted_total_s": plan["predicted_total_s"],
            "predicted_rows_s": predicted_rows, "measured_total_s": sum(timed),
            "training_share": training / sum(timed) if timed else None, "stages": rows}


def _fmt(fmt: str, value: Any) -> str:
    return "n/a" if value is None else fmt.format(value)


def _quartiles(q: dict[str, float]) -> str:
    return f"{q['median']:.0f} [{q['q1']:.0f}-{q['q3']:.0f}]"


def _pvalue(p: float) -> str:
    return "p < 0.0001" if p < 1e-4 else f"p = {p:.2g}"


def accuracy_sentence(result: dict[str, Any]) -> str:
    """The headline on top-1: "better" only when McNemar's test backs it."""
    sig, delta = result["significance"], result["top1_delta"] * 100
    detail = (f"{_pvalue(sig['p_value'])}, McNemar's exact test on {sig['test_images']} test images: "
              f"{sig['only_optimized_right']} only the optimized model got right, "
              f"{sig['only_baseline_right']} only the baseline")
    if sig["verdict"] == "no significant difference":
        return f"Top-1: **no significant difference** ({delta:+.2f} points; {detail})."
    return f"Top-1: **{sig['verdict']}**, {delta:+.2f} points ({detail})."


def speed_sentence(result: dict[str, Any]) -> str:
    """The headline on training speed, with the range the per-epoch spread allows."""
    text = f"Training throughput: **{result['speedup_throughput']:.2f}x**"
    spread = result.get("speed_spread")
    if spread:
        text += (f" (per-epoch medians {spread['optimized']['median']:.0f} vs {spread['baseline']['median']:.0f} "
                 f"img/s, ratio {spread['ratio']:.2f}x, range {spread['low']:.2f}-{spread['high']:.2f}x from the "
                 f"interquartile ranges)")
        if spread["overlap"]:
            text += "; the two recipes' per-epoch ranges overlap, so the difference is within run-to-run spread"
    return text + f"; epochs {result['speedup_epoch_time']:.2f}x shorter."


def roofline_of(profile: dict[str, Any]) -> dict[str, Any] | None:
    """What a profile's roofline says of its recipe's step (`cnnpipe.profile.roofline`): the math it
    trains in, the share of that rate, of the bf16 rate and of the machine's limit (its faster matmul:
    `limit`) it reached, at what GFLOP/s, and the machine's measured matmul rates; None without one."""
    roof = profile.get("roofline")
    if not roof or roof.get("bf16_share") is None:
        return None
    peaks = roof.get("peaks") or {}
    keys = ("math", "math_share", "bf16_share", "limit", "limit_share", "achieved_gflops")
    return {k: roof.get(k) for k in keys} | {
        "bf16_peak_gflops": peaks.get("bf16_gflops"), "fp32_peak_gflops": peaks.get("fp32_gflops")}


def limit_sentence(result: dict[str, Any]) -> str | None:
    """Beside the speed ratio, how far each recipe's step is from this machine's limit, or None when a
    profile has none. The limit is the profiles' measured bf16 matmul rate, or the fp32 one where
    both profiles measured that faster (each profile's `limit`): each step is then set against its
    own profile's fp32 rate."""
    roof = result.get("roofline") or {}
    if not (roof.get("baseline") and roof.get("optimized")):
        return None
    fp32_limit = all(roof[name]["limit"] == "fp32" for name in ("baseline", "optimized"))

    def part(name: str) -> str:
        r = roof[name]
        math = {"off": "fp32", "fp16": "fp16"}.get(r["math"], r["math"])
        if fp32_limit:
            extra = "" if math == "fp32" else f", {r['bf16_share']:.0%} of its {math} rate"
            return f"{name} {r['limit_share']:.0%} ({r['achieved_gflops']:.0f} GFLOP/s{extra})"
        extra = "" if math == "bf16" else f", {r['math_share']:.0%} of its {math} rate"
        return f"{name} {r['bf16_share']:.0%} ({r['achieved_gflops']:.0f} GFLOP/s{extra})"

    opt = roof["optimized"]
    if fp32_limit:
        rates = f" ({opt['fp32_peak_gflops']:.0f} GFLOP/s; bf16 {opt['bf16_peak_gflops']:.0f})"
        which = "of the fp32 matmul rate the profile measured, this CPU's faster one"
    else:
        peak = opt.get("bf16_peak_gflops")
        rates, which = (f" ({peak:.0f} GFLOP/s)" if peak else ""), "of the bf16 matmul rate the profile measured"
    return (f"Share of this machine's limit: the profiled step reached {part('baseline')} and {part('optimized')} "
            f"{which}{rates}; metrics/profile/report.md names the ops that spend the rest.")


def _cell(fmt: str, row: dict[str, Any], name: str) -> str:
    value, ci = _fmt(fmt, row[name]), row.get(f"{name}_ci95")
    return f"{value} ({fmt.format(ci[0])}-{fmt.format(ci[1])})" if ci and row[name] is not None else value


def to_markdown(result: dict[str, Any]) -> str:
    """The same numbers as compare.json, as a Markdown table."""
    starts = start_sentence(result)
    limit = limit_sentence(result)
    lines = ["# Baseline vs optimized", "", accuracy_sentence(result), "", *([starts, ""] if starts else []),
             speed_sentence(result), "", *([limit, ""] if limit else [])]
    lines += [f"> **Warning:** {w}" for w in result.get("warnings", [])]
    if result.get("warnings"):
        lines.append("")
    lines += ["| Metric | Baseline | Optimized | Optimized / baseline |", "| --- | ---: | ---: | ---: |"]
    for key, label, _, _, fmt in ROWS:
        row = result["rows"][key]
        ratio = row.get("ratio_note", "n/a") if row["ratio"] is None else f"{row['ratio']:.2f}x"
        lines.append(f"| {label} | {_cell(fmt, row, 'baseline')} | {_cell(fmt, row, 'optimized')} | {ratio} |")
    spread = result.get("speed_spread")
    if spread:
        lines.append(f"| Train throughput per epoch (img/s, median [IQR]) | {_quartiles(spread['baseline'])} | "
                     f"{_quartiles(spread['optimized'])} | {spread['ratio']:.2f}x "
                     f"({spread['low']:.2f}-{spread['high']:.2f}) |")
    lines += ["", "Top-1/top-5 in brackets: 95% Wilson confidence intervals over the test images."]
    lines += ["", "| Setting | Baseline | Optimized |", "| --- | --- | --- |"]
    for key, pair in result["settings"].items():
        lines.append(f"| {key} | {pair['baseline']} | {pair['optimized']} |")
    if result.get("plan"):
        plan = result["plan"]
        share = plan.get("training_share")
        rows_s = plan.get("predicted_rows_s", plan["predicted_total_s"])
        lines += ["", f"Time plan (budget {plan['budget_minutes']} min, {plan['images_per_epoch']} training images "
                  f"per epoch; metrics/plan/plan.md). Training took **{_fmt('{:.0%}', share)}** of the stages' "
                  f"measured time. The stages below: {_fmt('{:.1f}', (plan.get('measured_total_s') or 0) / 60)} min "
                  f"measured, {rows_s / 60:.1f} min predicted; the whole run, with the other stages' start-ups and "
                  f"DVC's own work between stages: {plan['predicted_total_s'] / 60:.1f} min predicted.",
                  "", "| Stage | Predicted | Actual | Actual / predicted |", "| --- | ---: | ---: | ---: |"]
        for name, row in plan["stages"].items():
            ratio = row.get("ratio_note", "n/a") if row["ratio"] is None else f"{row['ratio']:.2f}x"
            predicted = "(measured)" if row["predicted_s"] is None else _fmt("{:.0f} s", row["predicted_s"])
            lines.append(f"| {name} | {predicted} | {_fmt('{:.0f} s', row['actual_s'])} | {ratio} |")
    lines += ["", "Most confident mistakes on the test split: [baseline](baseline/mistakes.png) · "
              "[optimized](optimized/mistakes.png) (written by `evaluate`).",
              "", "Generated by `dvc repro compare` from metrics/<variant>/train.json, eval.json and "
              "predictions.csv.", ""]
    return "\n".join(lines)

"""The data behind `dvc plots show`: one JSON file per chart in metrics/plots/, the recipes its series.

DVC names a chart's series after the fields it plots when one file holds them all, and otherwise
after the files, cut to the part that differs (`baseline/live/plots/metrics/val/top1.tsv`). So each
chart's data is one file whose fields are the recipe names, and the legend reads `baseline` and
`optimized`. A value a series lacks (a recipe that trained fewer epochs, a bin with too few images)
is null, which the charts' templates (.dvc/plots/recipes.json, reliability.json) leave out of the
line instead of breaking it there.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from cnnpipe.files import write_text

EPOCH_CHARTS = {"val_top1.json": "val_top1", "train_loss.json": "train_loss", "throughput.json": "throughput_img_s"}
"""metrics/plots/ file -> the key of train.json's per-epoch records it charts."""
MIN_BIN_IMAGES = 50
"""A reliability bin is drawn only when it holds at least this many test images: its accuracy is then
known to within 14 points either way (95%, at worst). Bins of a handful of images made the curve
spike; an empty bin was drawn at (0, 0)."""
PERFECT = "perfectly calibrated"
"""The diagonal a reliability diagram is read against: accuracy equal to confidence."""
RAW = "before temperature"


def epoch_chart(histories: dict[str, list[dict[str, Any]]], key: str) -> list[dict[str, Any]]:
    """One row per epoch (1-based): `epoch` and each recipe's `key`, None where a recipe has no such epoch."""
    by_epoch = {name: {int(r["epoch"]): r[key] for r in history} for name, history in histories.items()}
    epochs = sorted(set().union(*by_epoch.values())) if by_epoch else []
    return [{"epoch": e, **{name: values.get(e) for name, values in by_epoch.items()}} for e in epochs]


def reliability_chart(curves: dict[str, list[dict[str, Any]]],
                      min_images: int = MIN_BIN_IMAGES) -> list[dict[str, Any]]:
    """A reliability diagram's points: for each curve (`evaluate`'s calibration bins) and each bin of at
    least `min_images` images, a row with the bin's mean `confidence` (the x of every series), its
    `images` and the curve's accuracy under the curve's name (None under the others); then the two
    ends of the diagonal, `PERFECT`.

    dvc.yaml lets a chart take one x field per file, so the series share `confidence` and each row
    belongs to one series; the template draws each series through its own rows.
    """
    names = [*curves, PERFECT]
    rows = []
    for name, bins in curves.items():
        for b in bins:
            if int(b["count"]) >= min_images:
                rows.append({"confidence": float(b["confidence"]), "images": int(b["count"]),
                             **dict.fromkeys(names), name: float(b["accuracy"])})
    rows += [{"confidence": end, "images": None, **dict.fromkeys(names), PERFECT: end} for end in (0.0, 1.0)]
    return rows


def read_bins(path: Path) -> list[dict[str, Any]]:
    """`evaluate`'s calibration.csv (or calibration_raw.csv): one row per confidence bin."""
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run `dvc repro evaluate@{path.parent.name}` first")
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def write_plot_data(histories: dict[str, list[dict[str, Any]]], metrics_dir: Path, out_dir: Path,
                    raw_of: str = "optimized") -> list[Path]:
    """metrics/plots/: the per-epoch charts of `histories` (train.json's `history` per recipe) and the
    reliability diagram of each recipe's test predictions, with `raw_of`'s before its temperature too.
    Returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, key in EPOCH_CHARTS.items():
        _write(out_dir / name, epoch_chart(histories, key))
        written.append(out_dir / name)
    curves = {recipe: read_bins(metrics_dir / recipe / "calibration.csv") for recipe in histories}
    curves[f"{raw_of} {RAW}"] = read_bins(metrics_dir / raw_of / "calibration_raw.csv")
    _write(out_dir / "reliability.json", reliability_chart(curves))
    written.append(out_dir / "reliability.json")
    return written


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    """A chart's rows as a JSON list (DVC reads a list of records as its data points; null stays null)."""
    write_text(path, json.dumps(rows, indent=1) + "\n")

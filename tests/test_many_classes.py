"""A thousand classes: evaluate and compare keep what git tracks small and readable."""

import csv
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from cnnpipe.data.store.writer import StoreWriter
from cnnpipe.evaluate.evaluation import evaluate
from cnnpipe.params import load_params, resolve
from cnnpipe.train import trainer
from cnnpipe.train.distributed import DistInfo
from conftest import ROOT, tiny_params, write_params

CLASSES = 1000
PER_SPLIT = {"train": 2, "val": 1, "test": 3}


def make_store(out: Path) -> list[str]:
    """A prepared store of 1,000 classes, a few 16 px images each."""
    rng = np.random.default_rng(0)
    classes = [f"sku-family {i:04d} | {'shoes' if i % 2 else 'bags'}" for i in range(CLASSES)]
    writer = StoreWriter(out, 16, 1, shard_mb=1)
    for split, per in PER_SPLIT.items():
        for label in range(CLASSES):
            for j in range(per):
                name = f"{split}/{label}/{j}.png"
                writer.add(split, rng.integers(0, 255, (16, 16, 1), dtype=np.uint8), label,
                           hashlib.sha256(name.encode()).digest(), {"source": name})
    writer.close(classes, "synthetic", carved=[])
    return classes


def git_tracked_outputs(metrics: Path) -> list[Path]:
    """The evaluate and compare outputs dvc.yaml leaves to git (`cache: false`), for both variants."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    paths = []
    for name in ("evaluate", "compare"):
        stage = stages[name].get("do", stages[name])
        for kind in ("outs", "metrics", "plots"):
            for entry in stage.get(kind, []):
                (path, opts), = entry.items() if isinstance(entry, dict) else ((entry, {}),)
                if opts.get("cache", True) is False:
                    for variant in ("baseline", "optimized") if "${key}" in path else ("",):
                        paths.append(metrics / Path(path.replace("${key}", variant)).relative_to("metrics"))
    return [f for p in paths for f in (sorted(p.rglob("*")) if p.is_dir() else [p]) if not f.is_dir()]


def test_a_thousand_classes_keep_every_git_tracked_output_under_a_megabyte(tmp_path):
    classes = make_store(tmp_path / "prepared")
    params = tiny_params(epochs=1, lr=0.01, amp="off")
    params["data"].update(image_size=16, stored_size=16)
    cfg = resolve(load_params(write_params(tmp_path / "params.yaml", params)), "optimized")
    trainer.fit(cfg, DistInfo(), tmp_path / "prepared", tmp_path / "models", tmp_path / "train.json", tmp_path / "live")
    metrics = tmp_path / "metrics"
    for variant in ("baseline", "optimized"):
        evaluate(tmp_path / "models", tmp_path / "prepared", metrics / variant, torch.device("cpu"))
        shutil.copy(tmp_path / "train.json", metrics / variant / "train.json")
    subprocess.run([sys.executable, str(ROOT / "stages" / "compare.py"), "--metrics", str(metrics)],
                   check=True, capture_output=True, text=True)

    tracked = git_tracked_outputs(metrics)
    assert {p.name for p in tracked} >= {"eval.json", "classes.json", "classes.md", "calibration.csv",
                                         "mistakes.png", "compare.json", "compare.md", "reliability.json"}
    sizes = {str(p.relative_to(metrics)): p.stat().st_size for p in tracked}
    assert all(size < 1_000_000 for size in sizes.values()), sizes

    result = json.loads((metrics / "optimized" / "classes.json").read_text())
    assert result["confusion"] is None and result["confusion_file"] == "confusion.csv"
    worst = result["per_class_worst_first"]
    assert len(worst) == CLASSES and [c["f1"] for c in worst] == sorted(c["f1"] for c in worst)
    # The images are noise, unrelated to their labels: 3,000 test images in 1,000 classes cannot all be
    # right (chance is 0.1%), whatever the model learned, so there are confused pairs to list.
    assert 0 < len(result["most_confused"]) <= 20
    counts = [p["count"] for p in result["most_confused"]]
    assert counts == sorted(counts, reverse=True)
    assert all(p["actual"] != p["predicted"] for p in result["most_confused"])
    md = (metrics / "optimized" / "classes.md").read_text()
    assert "## The 20 weakest classes" in md and "\\| shoes" in md  # a | in a class name stays in its cell

    with open(metrics / "optimized" / "confusion.csv", newline="") as fh:  # the full matrix, DVC-tracked
        cells = list(csv.DictReader(fh))
    assert sum(int(c["count"]) for c in cells) == CLASSES * PER_SPLIT["test"]
    with open(metrics / "optimized" / "predictions.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == CLASSES * PER_SPLIT["test"]
    assert all(r["actual"] == classes[int(r["source"].split("/")[1])] for r in rows)  # each row its own file
    assert {r["actual"] for r in rows} == set(classes)


def test_a_few_classes_still_get_the_matrix_inline(tmp_path):
    from cnnpipe.evaluate.evaluation import write_class_results
    from cnnpipe.evaluate.metrics import classification_summary

    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    labels = torch.tensor([0, 1, 1, 2])
    summary = classification_summary(logits, labels, ["a", "b", "c"])
    write_class_results(tmp_path, summary, ["a", "b", "c"], [])
    result = json.loads((tmp_path / "classes.json").read_text())
    assert result["confusion"] == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    assert result["most_confused"] == [{"actual": "b", "predicted": "a", "count": 1, "share_of_actual": 0.5}]
    assert result["per_class_worst_first"][0]["class"] == "b"  # F1 2/3 against 2/3 for a: b has more images
    assert summary["macro_f1"] == pytest.approx(np.mean([2 / 3, 2 / 3, 1.0]))

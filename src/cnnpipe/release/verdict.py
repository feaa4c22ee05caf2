"""The gate stage's work: both models' answers on today's test split, the decision, gate.json and gate.md.

The champion is evaluated here, on today's test split (stable: last week's test photos are still in
it, plus the new ones); its classes are matched to today's by name, so a class it never saw counts
as its error. The challenger's answers are evaluate's predictions.csv for the same images.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cnnpipe.config import ReleaseConfig
from cnnpipe.data.loaders import build_eval_loader
from cnnpipe.data.store import open_split, test_sources
from cnnpipe.files import CHAMPION_FILE, write_json
from cnnpipe.release.gate import GateRules, class_changes, decide, paired_counts
from cnnpipe.train.engine import predict
from cnnpipe.train.trained import load_trained, make_transform


def champion_answers(champion: Path, prepared_dir: Path, classes: list[str],
                     device: torch.device) -> tuple[np.ndarray, list[str]]:
    """The champion's prediction for every test image, as an index into today's `classes` (-1: a
    class today's data no longer has), and the classes it knows."""
    model, meta = load_trained(champion, device)
    split = open_split(prepared_dir, "test")
    if split.channels != meta["in_chans"]:
        raise ValueError(f"{champion}: the champion reads {meta['in_chans']} channel(s), the data has {split.channels}")
    logits, _ = predict(model, build_eval_loader(split, batch_size=256), make_transform(meta), device, meta["amp"])
    today = {name: i for i, name in enumerate(classes)}
    to_today = np.array([today.get(name, -1) for name in meta["classes"]], dtype=np.int64)
    return to_today[logits.argmax(1).numpy()], list(meta["classes"])


def challenger_answers(predictions: Path, prepared_dir: Path, classes: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(labels, predictions) as indices into `classes`, from evaluate's predictions.csv, checked to be
    the test split's images in its order."""
    with open(predictions, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    sources = test_sources(prepared_dir)
    if [r["source"] for r in rows] != sources:
        raise ValueError(f"{predictions} is not for today's test split ({len(rows)} rows, {len(sources)} test images): "
                         "rerun `dvc repro evaluate@optimized`")
    index = {name: i for i, name in enumerate(classes)}
    return (np.array([index[r["actual"]] for r in rows], dtype=np.int64),
            np.array([index[r["predicted"]] for r in rows], dtype=np.int64))


def run_gate(cfg: ReleaseConfig, champion: Path, challenger: Path, prepared_dir: Path, out_dir: Path,
             device: torch.device) -> dict[str, Any]:
    """Judge the challenger (evaluate's outputs in `challenger`) against the champion stage's output
    in `champion`; write gate.json and gate.md to `out_dir`."""
    classes = list(json.loads((prepared_dir / "index.json").read_text())["classes"])
    labels, ours = challenger_answers(challenger / "predictions.csv", prepared_dir, classes)
    metrics = json.loads((challenger / "eval.json").read_text())
    about = json.loads((champion / CHAMPION_FILE).read_text()) if (champion / CHAMPION_FILE).exists() else {}
    rules = GateRules(cfg.margin, cfg.min_support, cfg.max_class_drop, dict(cfg.floors))
    if (champion / "best.pt").exists():
        theirs, their_classes = champion_answers(champion, prepared_dir, classes, device)
        changes = class_changes(labels, theirs, ours, classes, their_classes)
        new_classes = [c.name for c in changes if c.champion_recall is None]
        verdict = decide(rules, metrics, paired_counts(theirs == labels, ours == labels), changes, new_classes)
    else:
        verdict = decide(rules, metrics, None, [], [])
    verdict["champion"] = about or None
    verdict["rules"] = {"margin": cfg.margin, "min_support": cfg.min_support, "max_class_drop": cfg.max_class_drop,
                        "floors": dict(cfg.floors), "stage": cfg.stage, "artifact": cfg.artifact}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "gate.json", verdict)
    (out_dir / "gate.md").write_text(render(verdict), encoding="utf-8")
    return verdict


def render(verdict: dict[str, Any]) -> str:
    """gate.md: the verdict first, then every reason, then the worst classes."""
    champion = verdict.get("champion") or {}
    who = (f"{champion.get('artifact', 'the model')} {champion['version']} (in `{champion.get('stage', 'prod')}`)"
           if champion.get("version") else "no champion yet")
    lines = [f"# Gate: {'BLESSED' if verdict['blessed'] else 'REFUSED'}", "",
             f"Challenger: this commit's optimized model. Champion: {who}.", ""]
    lines += [f"- {reason}" for reason in verdict["reasons"]]
    if verdict.get("worst_classes"):
        lines += ["", "| Class | Test images | Champion recall | Challenger recall | Change |", "|---|---:|---:|---:|---:|"]
        for c in verdict["worst_classes"]:
            before = "new" if c["champion_recall"] is None else f"{c['champion_recall']:.1%}"
            lines.append(f"| {c['class'].replace('|', chr(92) + '|')} | {c['support']} | {before} | "
                         f"{c['challenger_recall']:.1%} | {-c['drop']:+.1%} |")
    lines += ["", "Promote a blessed model with `python -m cnnpipe.promote` (it refuses a refused one).", ""]
    return "\n".join(lines)

"""The delivery check: this week's new photos against the champion, before any training.

A supplier who files one product type under another's folder is the loop's most common bad week.
The model in production already knows what those photos are: for each photo new since the previous
store (`store.new_rows`, every split), the champion's calibrated answer (softmax of its logits over
its fitted temperature, so "80% sure" means what it says). Per (given label a, predicted class b),
the confident disagreements k among the n new photos filed under a are set against the champion's
own confident a -> b count m among the N_a old test photos of a (so a class it usually confuses is
not flagged). The p-value is P(X >= k) where X is what an honest delivery would show: binomial in n
at the champion's rate, that rate uncertain as the test split leaves it (Beta(m + 1, N_a - m + 1),
the uniform prior's posterior: X is beta-binomial, and its mean rate (m + 1) / (N_a + 2) is the
`expected` share reported). A small test split thus asks for more evidence, instead of flagging
honest weeks whenever it happened to see few confusions. A pair is flagged when that p-value
survives Holm over every pair at `release.delivery.alpha`, with at least `min_images` such photos
making at least `min_share` of n. The idea is confident learning's (Northcutt et al. 2021;
cleanlab's label-issue finder), with a reference rate and a family-wise test in place of its
per-class thresholds, so that an honest week is rarely flagged whatever the class count.

The flagged photos (those of a flagged pair the champion was confident about) are listed by file;
under `policy: hold_out` their lines say so and training, evaluation and the gate leave them out
(`data.held_out`). Nothing is removed from the store, the catalog or the split ledger.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.stats import betabinom

from cnnpipe.data.held_out import subset
from cnnpipe.data.meta import in_folder, split_meta
from cnnpipe.data.store import PreparedSplit, SPLITS, new_rows, open_split, read_index
from cnnpipe.files import CHAMPION_FILE, write_json
from cnnpipe.release.stats import holm
from cnnpipe.release.verdict import logit_batches
from cnnpipe.release_config import DeliveryConfig, ReleaseConfig
from cnnpipe.train.recipe import STORE_KEYS, recipe_differences, recipe_of, store_recipe
from cnnpipe.train.trained import load_trained

FIRST_FILES = 100  # how many flagged files delivery.json names (the list file has them all)
LIST_COLUMNS = ["source", "sha256", "split", "given", "predicted", "confidence", "held_out"]


def calibrated_answers(model: torch.nn.Module, meta: dict[str, Any], split: PreparedSplit,
                       device: torch.device) -> tuple[np.ndarray, np.ndarray]:
    """The model's class and calibrated confidence (softmax of logits / its temperature) per image."""
    pred, conf = [], []
    for logits in logit_batches(model, meta, split, device):
        top = torch.softmax(logits / meta["temperature"], dim=1).max(1)
        pred.append(top.indices.cpu().numpy())
        conf.append(top.values.cpu().numpy())
    if not pred:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    return np.concatenate(pred).astype(np.int64), np.concatenate(conf)


def flag_pairs(given: np.ndarray, pred: np.ndarray, conf: np.ndarray, ref_given: np.ndarray,
               ref_pred: np.ndarray, ref_conf: np.ndarray, classes: list[str], checked: np.ndarray,
               cfg: DeliveryConfig) -> tuple[list[dict[str, Any]], np.ndarray]:
    """Every (given, predicted) pair's counts and test among the new photos (`given`, the champion's
    `pred` and `conf`, predictions in today's class indices, -1 for a class gone), against the
    reference (old test photos); `checked` masks the given classes the champion knows. Returns the
    pairs with k > 0, most significant first, and the mask of new photos in a flagged pair."""
    c = len(classes)
    sure = (conf >= cfg.confidence) & (pred >= 0)
    ref_sure = (ref_conf >= cfg.confidence) & (ref_pred >= 0)
    k = np.zeros((c, c), np.int64)
    np.add.at(k, (given[sure], pred[sure]), 1)
    m = np.zeros((c, c), np.int64)
    np.add.at(m, (ref_given[ref_sure], ref_pred[ref_sure]), 1)
    n = np.bincount(given, minlength=c)
    n_ref = np.bincount(ref_given, minlength=c)
    a, b = np.nonzero(~np.eye(c, dtype=bool) & checked[:, None] & (n > 0)[:, None])
    p0 = (m[a, b] + 1) / (n_ref[a] + 2)
    p = betabinom.sf(k[a, b] - 1, n[a], m[a, b] + 1, n_ref[a] - m[a, b] + 1)  # P(X >= k): 1 for k = 0
    p_holm = holm(p)
    share = k[a, b] / n[a]
    flagged = (p_holm <= cfg.alpha) & (k[a, b] >= cfg.min_images) & (share >= cfg.min_share)
    pairs = [{"given": classes[i], "predicted": classes[j], "images": int(k[i, j]), "of": int(n[i]),
              "share": float(s), "expected": float(e), "test_images": int(n_ref[i]), "p": float(q),
              "p_holm": float(h), "flagged": bool(f)}
             for i, j, s, e, q, h, f in zip(a, b, share, p0, p, p_holm, flagged) if k[i, j] > 0]
    pairs.sort(key=lambda r: (not r["flagged"], r["p"], -r["images"]))
    in_flagged = np.zeros((c, c), bool)
    in_flagged[a[flagged], b[flagged]] = True
    photos = sure & in_flagged[given, np.where(pred >= 0, pred, 0)]
    return pairs, photos


def _sources(prepared_dir: Path, split: str, rows: np.ndarray) -> list[dict[str, Any]]:
    """Source path and sha256 of the given rows of `split` (their meta lines, `data.meta`)."""
    return [{"source": meta.get("source"), "sha256": meta.get("sha256")}
            for meta in split_meta(in_folder(prepared_dir), split, rows)]


def _passes(about: dict[str, Any], cfg: DeliveryConfig, reason: str, new: int = 0) -> dict[str, Any]:
    return {"checked": False, "reason": reason, "flagged": False, "policy": cfg.policy,
            "champion": about.get("version"), "new_images": new, "flagged_images": 0, "pairs": [], "files": []}


def check_delivery(prepared_dir: Path, champion_dir: Path, cfg: ReleaseConfig,
                   device: torch.device) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Check the store's new photos against the champion in `champion_dir` (the champion stage's
    output). Returns the report (delivery.json) and the flagged photos, one dict per file."""
    rules = cfg.delivery
    index = read_index(prepared_dir)
    classes = list(index["classes"])
    about_path = Path(champion_dir) / CHAMPION_FILE
    about = json.loads(about_path.read_text()) if about_path.exists() else {}
    if not (Path(champion_dir) / "best.pt").exists():
        return _passes(about, rules, "no champion yet: nothing to check the new photos against"), []
    marks = {s: new_rows(prepared_dir, s) for s in SPLITS if s in index["splits"]}
    if any(v is None for v in marks.values()):
        return _passes(about, rules, "the store predates new-photo marks: rerun `dvc repro prepare`"), []
    new_total = int(sum(v.sum() for v in marks.values()))
    model, meta = load_trained(Path(champion_dir), device)
    other = recipe_differences(recipe_of(meta), store_recipe(index), STORE_KEYS)
    if other:
        return _passes(about, rules, f"the champion was trained on other inputs than this store ({'; '.join(other)}): "
                       "its answers on these pixels mean nothing", new_total), []
    # The champion's class index -> today's (renamed classes followed; a class gone: -1).
    today = {name: i for i, name in enumerate(classes)}
    to_today = np.array([today.get(cfg.renamed.get(name, name), -1) for name in meta["classes"]], np.int64)
    checked = np.zeros(len(classes), bool)
    checked[to_today[to_today >= 0]] = True

    given, pred, conf, split_of, row_of = [], [], [], [], []  # per new photo, splits in SPLITS order
    for number, (split, new) in enumerate(marks.items()):
        rows = np.flatnonzero(new)
        if len(rows):
            opened = open_split(prepared_dir, split)
            p, c = calibrated_answers(model, meta, subset(opened, rows), device)
            given.append(np.asarray(opened.labels[rows]))
            pred.append(to_today[p])
            conf.append(c)
            split_of.append(np.full(len(rows), number))
            row_of.append(rows)
    test = open_split(prepared_dir, "test")
    old = np.flatnonzero(~marks["test"])
    ref_pred, ref_conf = calibrated_answers(model, meta, subset(test, old), device)
    cat = (lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype))
    given_all, pred_all, conf_all = cat(given, np.int64), cat(pred, np.int64), cat(conf, np.float32)
    split_all, row_all = cat(split_of, np.int64), cat(row_of, np.int64)
    pairs, photos = flag_pairs(given_all, pred_all, conf_all, np.asarray(test.labels[old]), to_today[ref_pred],
                               ref_conf, classes, checked, rules)

    chosen = np.flatnonzero(photos)
    files: list[dict[str, Any]] = []
    for number, split in enumerate(marks):
        mine = chosen[split_all[chosen] == number]
        for i, src in zip(mine.tolist(), _sources(prepared_dir, split, row_all[mine])):
            files.append({**src, "split": split, "given": classes[given_all[i]],
                          "predicted": classes[pred_all[i]], "confidence": round(float(conf_all[i]), 4),
                          "held_out": rules.policy == "hold_out"})
    files.sort(key=lambda f: (f["given"], f["predicted"], -f["confidence"]))
    flagged_pairs = [r for r in pairs if r["flagged"]]
    report = {"checked": True, "reason": None, "flagged": bool(flagged_pairs), "policy": rules.policy,
              "champion": about.get("version"), "new_images": new_total,
              "checked_images": int(checked[given_all].sum()),
              "test_images": len(old), "unknown_to_champion": [classes[i] for i in np.flatnonzero(~checked)],
              "confident_disagreements": int(sum(r["images"] for r in pairs)),
              "flagged_images": len(files), "pairs": flagged_pairs,
              "closest_pairs": [r for r in pairs if not r["flagged"]][:5],
              "rules": {"confidence": rules.confidence, "alpha": rules.alpha, "min_images": rules.min_images,
                        "min_share": rules.min_share, "temperature": meta["temperature"]},
              "files": [f["source"] for f in files[:FIRST_FILES]]}
    return report, files


def write_delivery(report: dict[str, Any], files: list[dict[str, Any]], metrics_path: Path, list_path: Path) -> None:
    """delivery.json (the report, naming the list) and the list of flagged photos: a CSV with a header
    row, one row per photo (never an empty file: DVC warns about those), for a spreadsheet or a script."""
    list_path.parent.mkdir(parents=True, exist_ok=True)
    temp = list_path.with_name(f".{list_path.name}.tmp")
    with open(temp, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=LIST_COLUMNS)
        writer.writeheader()
        writer.writerows({**f, "held_out": "true" if f["held_out"] else "false"} for f in files)
    temp.replace(list_path)
    write_json(metrics_path, {**report, "list": str(list_path)})


def p_text(p: float) -> str:
    """'= 3.1e-05', or '< 1e-300' where the p-value underflows to 0."""
    return "< 1e-300" if p < 1e-300 else f"= {p:.2g}"


def summary(report: dict[str, Any]) -> list[str]:
    """The report in a few lines: what the stage prints and the gate repeats."""
    if not report["checked"]:
        return [f"not checked: {report['reason']}"]
    head = (f"{report['new_images']} new photos checked against champion {report['champion']}: "
            f"{report['flagged_images']} flagged in {len(report['pairs'])} pair(s)")
    lines = [head]
    for r in report["pairs"]:
        lines.append(f"{r['images']} of {r['of']} new '{r['given']}' photos look like '{r['predicted']}' "
                     f"({r['share']:.0%}; {r['expected']:.1%} expected from the champion's test split; "
                     f"Holm p {p_text(r['p_holm'])})")
    return lines

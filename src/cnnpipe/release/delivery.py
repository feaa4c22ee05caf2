"""The delivery check: this week's new photos against the champion, before any training.

A supplier who files one product type under another's folder is the loop's most common bad week.
The model in production already knows what those photos are: for each photo its data did not hold
(the ledger's arrival segment, `<split>_arrived.npy`, at or after the store generation the champion
records: so a second prepare in the week checks the same photos; a champion older than those marks:
new since the previous store), every split, the champion's calibrated answer (softmax of its logits over
its fitted temperature, so "80% sure" means what it says). A photo filed under a that the
champion is confident is another class is a confident disagreement. The test runs in two stages:

1. per given class a: the k confident disagreements among the n new photos filed under a are set
   against the champion's own confident disagreements m among the N_a old test photos of a (so a
   class it usually gets wrong is not flagged). The p-value is P(X >= k) where X is what an honest
   delivery would show: binomial in n at the champion's rate, that rate uncertain as the test split
   leaves it (Beta(m + a0, N_a - m + b0): X is beta-binomial, and its mean rate is the `expected`
   share reported). The prior (a0, b0) is fitted across the classes (`pooled_prior`, empirical
   Bayes): at 20 test photos a class, the other classes pin down what a class's rate can be, where a
   uniform prior left it so loose that ten misfiled photos among twenty honest ones never stood out.
   A small test split still asks for more evidence, and a class the champion usually gets wrong
   keeps its own rate.
   Holm over the classes a flag could reach (checked, at least `min_images` new photos) at
   `release.delivery.alpha`, with at least `min_images` disagreements making `min_share` of n;
2. inside each flagged class: the same test per (a, predicted b) pair, against the champion's a -> b
   rate, Holm over the class's C - 1 pairs, with the same floors.

An honest week can be flagged only through stage 1, so at most `alpha` of honest weeks are, whatever
the class count; at 1,000 classes, ten photos all filed wrong in one class face a correction for
1,000 classes, where a test over every pair faced one for 999,000 (bench/delivery_check.py measures
both). This is a hierarchical (gatekeeping) procedure: family-wise control over the classes, and a
pair is named only inside a class that failed. The idea is confident learning's (Northcutt et al.
2021; cleanlab's label-issue finder), with a reference rate and family-wise tests in place of its
per-class thresholds.

The flagged photos (every new photo of a flagged class: the delivery is held whole, not only the
photos the champion is sure of) are listed by file; under `policy: hold_out` (the default) their lines say so and
training, evaluation and the gate leave them out (`data.splits.held_out`); the next prepare records the hold in the
split ledger, and every later week lists the photos still held (`status: held`) until their label changes or a
person clears them in `data/delivery/cleared.csv` (`data.splits.holds`; a cleared photo is listed, never held).
Nothing is removed from the store, the catalog or the split ledger.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cnnpipe.data.splits.held_out import read_cleared, store_mark, subset
from cnnpipe.data.splits.holds import LIST_COLUMNS, among
from cnnpipe.data.store.meta import in_folder, split_keys, split_meta
from cnnpipe.data.store.shards import PreparedSplit, SPLITS, new_rows, open_split, read_index
from cnnpipe.files import CHAMPION_FILE, write_json
from cnnpipe.release.flagging import flag_pairs
from cnnpipe.release.verdict import logit_batches
from cnnpipe.release_config import DeliveryConfig, ReleaseConfig
from cnnpipe.train.recipe import STORE_KEYS, recipe_differences, recipe_of, store_recipe
from cnnpipe.train.trained import load_trained

FIRST_FILES = 100  # how many flagged files delivery.json names (the list file has them all)


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


def _sources(prepared_dir: Path, split: str, rows: np.ndarray) -> list[dict[str, Any]]:
    """Source path and sha256 of the given rows of `split` (their meta lines, `data.store.meta`)."""
    return [{"source": meta.get("source"), "sha256": meta.get("sha256")}
            for meta in split_meta(in_folder(prepared_dir), split, rows)]


def _passes(about: dict[str, Any], cfg: DeliveryConfig, reason: str, new: int = 0,
            unchecked: int = 0) -> dict[str, Any]:
    """A report of a check that did not run: `unchecked` new photos it should have checked (promote
    asks before such a week reaches production: a check switched off is not a check passed)."""
    return {"checked": False, "reason": reason, "flagged": False, "policy": cfg.policy,
            "champion": about.get("version"), "new_images": new, "flagged_images": 0, "pairs": [], "files": [],
            "unchecked": unchecked}


def new_to_champion(prepared_dir: Path, splits: list[str], meta: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Per split, which photos the champion's data did not hold: arrived at or after the generation of
    the store it was trained on; for a champion or a store older than those records, new since the
    previous store (None where the store has no marks at all). With what they are new since."""
    generation = meta.get("data_generation")
    arrived = {s: store_mark(prepared_dir, s, "arrived") for s in splits}
    if generation is not None and all(a is not None for a in arrived.values()):
        return {s: a >= generation for s, a in arrived.items()}, f"the champion's data (store generation {generation})"
    return {s: new_rows(prepared_dir, s) for s in splits}, "the previous store (the champion predates arrival marks)"


def _held_files(prepared_dir: Path, split: str, rows: np.ndarray, classes: list[str]) -> list[dict[str, Any]]:
    """The list rows (status `held`) of `rows` of `split`: held from an earlier check, not flagged by this one."""
    labels = np.load(Path(prepared_dir) / f"{split}_labels.npy", mmap_mode="r")[rows].tolist()
    return [{**src, "split": split, "given": classes[label], "predicted": "", "confidence": "", "held_out": True,
             "status": "held"} for src, label in zip(_sources(prepared_dir, split, rows), labels)]


def carried_holds(prepared_dir: Path, splits: list[str], classes: list[str],
                  flagged: set[tuple[str, int]]) -> list[dict[str, Any]]:
    """The photos the ledger still holds (the store's `<split>_held.npy`) that this check did not flag
    again: listed each week, held whatever the policy, until cleared or relabelled."""
    files = []
    for split in splits:
        held = store_mark(prepared_dir, split, "held")
        rows = np.array([r for r in np.flatnonzero(held) if (split, int(r)) not in flagged] if held is not None else [],
                        np.int64)
        if len(rows):
            files += _held_files(prepared_dir, split, rows, classes)
    return files


def listed_before(prepared_dir: Path, splits: list[str], classes: list[str],
                  previous: dict[str, str]) -> list[dict[str, Any]]:
    """The photos the last check of this same store held (`previous`: sha256 -> the label held under)
    that are still filed under that label: held again. A rerun of the check alone (another champion
    after a promote or a rollback, a `dvc repro delivery`) no longer finds them new, and without this
    their hold would end before any prepare recorded it."""
    if not previous:
        return []
    wanted = np.frombuffer(b"".join(bytes.fromhex(h) for h in previous), dtype="S32")
    files = []
    for split in splits:
        keys = split_keys(in_folder(prepared_dir), split)
        if keys is None:
            continue
        labels = np.load(Path(prepared_dir) / f"{split}_labels.npy", mmap_mode="r")
        rows = [r for r in np.flatnonzero(among(keys["sha256"], wanted)).tolist()
                if previous[keys["sha256"][r : r + 1].tobytes().hex()] == classes[int(labels[r])]]
        if rows:
            files += _held_files(prepared_dir, split, np.array(rows, np.int64), classes)
    return files


def check_delivery(prepared_dir: Path, champion_dir: Path, cfg: ReleaseConfig, device: torch.device,
                   cleared: Path | None = None, previous: dict[str, str] | None = None,
                   ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Check the store's photos new to the champion in `champion_dir` (the champion stage's output);
    list the photos the ledger still holds, those the last check of this store held (`previous`,
    sha256 -> label: `data.splits.holds.last_list`) and, as cleared, the flagged ones whose sha256 the
    committed file `cleared` lists. Returns the report (delivery.json) and the listed photos, one dict
    per file."""
    report, files = _check(prepared_dir, champion_dir, cfg, device)
    index = read_index(prepared_dir)
    raw = read_cleared(cleared).tobytes()  # (not .tolist(): numpy drops a digest's trailing zero bytes)
    done = {raw[k : k + 32].hex() for k in range(0, len(raw), 32)}
    for f in files:
        if f["sha256"] in done:
            f.update(held_out=False, status="cleared")
    flagged = {(f["split"], f.pop("row")) for f in files}
    splits = [s for s in SPLITS if s in index["splits"]]
    files += carried_holds(prepared_dir, splits, list(index["classes"]), flagged)
    listed = {f["sha256"] for f in files}
    files += [f for f in listed_before(prepared_dir, splits, list(index["classes"]), previous or {})
              if f["sha256"] not in listed and f["sha256"] not in done]
    status = Counter(f["status"] for f in files)
    report.update(held_from_earlier_weeks=status["held"], cleared=status["cleared"],
                  open_flags=status["flagged"] + status["held"],
                  held_out_images=sum(f["held_out"] for f in files if f["status"] != "cleared"),
                  files=[f["source"] for f in files if f["status"] != "cleared"][:FIRST_FILES])
    return report, files


def _check(prepared_dir: Path, champion_dir: Path, cfg: ReleaseConfig,
           device: torch.device) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rules = cfg.delivery
    index = read_index(prepared_dir)
    classes = list(index["classes"])
    about_path = Path(champion_dir) / CHAMPION_FILE
    about = json.loads(about_path.read_text()) if about_path.exists() else {}
    if not (Path(champion_dir) / "best.pt").exists():
        return _passes(about, rules, "no champion yet: nothing to check the new photos against"), []
    model, meta = load_trained(Path(champion_dir), device)
    marks, since = new_to_champion(prepared_dir, [s for s in SPLITS if s in index["splits"]], meta)
    if any(v is None for v in marks.values()):
        return _passes(about, rules, "the store predates new-photo marks: rerun `dvc repro prepare`"), []
    new_total = int(sum(v.sum() for v in marks.values()))
    other = recipe_differences(recipe_of(meta), store_recipe(index), STORE_KEYS)
    if other:
        return _passes(about, rules, f"the champion was trained on other inputs than this store ({'; '.join(other)}): "
                       "its answers on these pixels mean nothing", new_total, unchecked=new_total), []
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
    # The reference: test photos the champion's data held, less those held out (their labels are in
    # doubt) and those once in a training split (it may have memorised them).
    leave = np.array(marks["test"], bool)
    for doubtful in (store_mark(prepared_dir, "test", "held"), store_mark(prepared_dir, "test", "trained")):
        leave |= doubtful if doubtful is not None else False
    old = np.flatnonzero(~leave)
    ref_pred, ref_conf = calibrated_answers(model, meta, subset(test, old), device)
    cat = (lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype))
    given_all, pred_all, conf_all = cat(given, np.int64), cat(pred, np.int64), cat(conf, np.float32)
    split_all, row_all = cat(split_of, np.int64), cat(row_of, np.int64)
    pairs, photos, class_rows = flag_pairs(given_all, pred_all, conf_all, np.asarray(test.labels[old]),
                                           to_today[ref_pred], ref_conf, classes, checked, rules)

    chosen = np.flatnonzero(photos)
    files: list[dict[str, Any]] = []
    for number, split in enumerate(marks):
        mine = chosen[split_all[chosen] == number]
        for i, src in zip(mine.tolist(), _sources(prepared_dir, split, row_all[mine])):
            files.append({**src, "split": split, "given": classes[given_all[i]],
                          "predicted": classes[pred_all[i]], "confidence": round(float(conf_all[i]), 4),
                          "held_out": rules.policy == "hold_out", "status": "flagged", "row": int(row_all[i])})
    files.sort(key=lambda f: (f["given"], f["predicted"], -f["confidence"]))
    flagged_pairs = [r for r in pairs if r["flagged"]]
    report = {"checked": True, "reason": None, "flagged": bool(flagged_pairs), "policy": rules.policy,
              "champion": about.get("version"), "new_images": new_total, "new_since": since,
              "checked_images": int(checked[given_all].sum()),
              "test_images": len(old), "unknown_to_champion": [classes[i] for i in np.flatnonzero(~checked)],
              "confident_disagreements": int(sum(r["images"] for r in pairs)),
              "flagged_images": len(files), "classes": [r for r in class_rows if r["flagged"]], "pairs": flagged_pairs,
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
        writer.writerows({**{k: f.get(k, "") for k in LIST_COLUMNS}, "held_out": "true" if f["held_out"] else "false"}
                         for f in files)
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
            f"{report['flagged_images']} flagged in {len(report.get('classes', []))} class(es), "
            f"{len(report['pairs'])} pair(s)")
    lines = [head]
    for r in report["pairs"]:
        lines.append(f"{r['images']} of {r['of']} new '{r['given']}' photos look like '{r['predicted']}' "
                     f"({r['share']:.0%}; {r['expected']:.1%} expected from the champion's test split; "
                     f"Holm p {p_text(r['p_holm'])})")
    return lines

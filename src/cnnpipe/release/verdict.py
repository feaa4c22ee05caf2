"""The gate stage's work: both models' answers on today's test split, `gate.judge`, gate.json and gate.md.

Both models run here, on the same stored test images, each through its own input recipe (its input
size and normalisation; the stored squares are today's store's, so the champion's recipe must have
the same decode, stored size and channels, or it cannot be judged on these pixels). The
challenger's answers come out twice: its argmax over all of today's classes, and over the classes
the champion knows (`challenger_pred_known`: like for like). Its floors use evaluate's eval.json.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cnnpipe.release_config import ReleaseConfig
from cnnpipe.data.splits.held_out import open_compared
from cnnpipe.data.loaders.host import build_eval_loader
from cnnpipe.data.store.shards import PreparedSplit, read_index
from cnnpipe.files import ANCHOR_DIR, CHAMPION_FILE, file_sha256, write_json
from cnnpipe.release.gate import GateRules, class_map, judge
from cnnpipe.release.looks import anchor_sha256, look_at_anchor
from cnnpipe.release.render import render
from cnnpipe.release.slices import slice_masks, week_relabels
from cnnpipe.train.precision import autocast
from cnnpipe.train.recipe import STORE_KEYS, recipe_differences, recipe_of, store_recipe
from cnnpipe.train.trained import load_trained, make_transform


@torch.no_grad()
def logit_batches(model: torch.nn.Module, meta: dict[str, Any], split: PreparedSplit, device: torch.device,
                  batch_size: int = 256) -> Iterator[torch.Tensor]:
    """The model's float logits on `split`, batch by batch in its order, through its input recipe."""
    model.eval()
    transform = make_transform(meta)
    for images, _ in build_eval_loader(split, batch_size=batch_size):
        with autocast(meta["amp"], device):
            logits = model(transform(images.to(device, non_blocking=True)))
        yield logits.float()


@torch.no_grad()
def answers(model: torch.nn.Module, meta: dict[str, Any], split: PreparedSplit, device: torch.device,
            among: np.ndarray | None = None, batch_size: int = 256) -> tuple[np.ndarray, np.ndarray | None]:
    """The model's argmax per test image, and with `among` (a mask over its classes) its argmax among
    those classes alone. Argmaxes are taken batch by batch: no N x classes logits kept."""
    top, top_among = [], []
    masked = None if among is None else torch.as_tensor(~among, device=device)
    for logits in logit_batches(model, meta, split, device, batch_size):
        top.append(logits.argmax(1))
        if masked is not None:
            top_among.append(logits.masked_fill(masked, float("-inf")).argmax(1))
    pred = torch.cat(top).cpu().numpy() if top else np.zeros(0, np.int64)
    known = (torch.cat(top_among).cpu().numpy() if top_among else np.zeros(0, np.int64)) if among is not None else None
    return pred, known


def anchor_answers(champion: Path, about: dict[str, Any], split: PreparedSplit, store: dict[str, Any],
                   device: torch.device) -> dict[str, Any]:
    """`judge`'s anchor arguments: the anchor's answers on today's test images when champion.json
    records another model than the champion (fetched into `champion`/anchor/best.pt), else the champion
    as anchor. A recorded anchor whose file is missing is an error, never the champion in its place:
    the drift would then restart from a model that was never shown within the margin."""
    anchor = about.get("anchor") or {}
    if anchor.get("same_as_champion", True):
        return {"anchor_name": f"the champion {about.get('version')}: {anchor.get('why', 'no anchor recorded')}"}
    weights = champion / ANCHOR_DIR / "best.pt"
    if not weights.exists():
        raise FileNotFoundError(
            f"{champion / CHAMPION_FILE} records the drift budget's anchor {anchor.get('version')} (commit "
            f"{str(anchor.get('commit'))[:12]}, sha256 {str(anchor.get('sha256'))[:12]}), but {weights} is missing: "
            "the drift cannot be measured from it, and the champion is not a stand-in. Fetch it again with "
            f"`dvc repro champion` (or `dvc pull {champion}`); the anchor moves only when a promoted model is "
            "shown within the margin of it")
    model, meta = load_trained(champion / ANCHOR_DIR, device)
    other_pixels = recipe_differences(recipe_of(meta), store, STORE_KEYS)
    if other_pixels:
        raise ValueError(f"the drift budget's anchor {anchor.get('version')} was trained on other inputs than today's "
                         f"store ({'; '.join(other_pixels)}): its drift cannot be measured on these pixels; keep "
                         "data.stored_size, or promote a model shown within the margin of one on these pixels")
    pred, _ = answers(model, meta, split, device)
    return {"anchor_pred": pred, "anchor_classes": meta["classes"], "anchor_name": anchor["why"]}


def next_anchor(verdict: dict[str, Any], about: dict[str, Any]) -> dict[str, Any]:
    """The anchor the weeks after this one are measured against, if this challenger is promoted: itself
    when it is the first model or was shown within the margin of the anchor, else today's anchor."""
    if verdict.get("first_model") or (verdict.get("drift") or {}).get("new_anchor"):
        return {"self": True}
    anchor = about.get("anchor") or {k: about.get(k) for k in ("commit", "version", "path", "sha256")}
    return {k: anchor.get(k) for k in ("commit", "version", "path", "sha256")}


def run_gate(cfg: ReleaseConfig, champion: Path, challenger: Path, challenger_metrics: Path, prepared_dir: Path,
             out_dir: Path, device: torch.device, data_report: Path | None = None, *,
             delivery: Path | None = None, held_out: Path | None = None) -> dict[str, Any]:
    """Judge the challenger (`challenger`/best.pt, its eval.json in `challenger_metrics`) against the
    champion stage's output in `champion`; write gate.json and gate.md to `out_dir`. The slices and the
    week's relabels (from prepare's `data_report`) are reported beside the verdict, and the delivery
    check's flags when its report `delivery` exists; the test photos its list `held_out` holds out,
    and those whose bytes were ever in a training split (a model may have memorised them), are left
    out of both models' test, and so are those filed under another label than the ledger knew
    (`data.splits.held_out.open_compared`), the last two counted in the verdict. Which look at the
    drift anchor this is comes from the verdicts git holds beside `out_dir`/gate.json (`looks`)."""
    index = read_index(prepared_dir)
    classes, store = list(index["classes"]), store_recipe(index)
    split, kept, left_out = open_compared(prepared_dir, "test", held_out)
    memorised = left_out["trained"]
    metrics = json.loads((challenger_metrics / "eval.json").read_text())
    about = json.loads((champion / CHAMPION_FILE).read_text()) if (champion / CHAMPION_FILE).exists() else {}
    rules = GateRules.from_config(cfg)
    model, meta = load_trained(challenger, device)
    challenger_sha256 = file_sha256(challenger / "best.pt")
    stale = recipe_differences(recipe_of(meta), store, STORE_KEYS)
    if stale:
        raise ValueError(f"{challenger}/best.pt was trained on another store than {prepared_dir} ({'; '.join(stale)}): "
                         "rerun `dvc repro train@optimized`")
    if list(meta["classes"]) != classes:
        raise ValueError(f"{challenger}/best.pt knows other classes than {prepared_dir}: rerun `dvc repro train@optimized`")
    notes: list[str] = []
    if not (champion / "best.pt").exists():
        ours, _ = answers(model, meta, split, device)
        verdict = judge(split.labels, None, ours, classes, [], rules, metrics=metrics)
    else:
        their_model, their_meta = load_trained(champion, device)
        theirs = recipe_of(their_meta)
        other_pixels = recipe_differences(theirs, store, STORE_KEYS)
        if theirs["stored_size"] is None:
            notes.append("the champion's checkpoint predates input recipes: judged on today's store as it is")
        known = class_map(classes, their_meta["classes"], rules.renamed).known
        ours, ours_known = answers(model, meta, split, device, among=known)
        if other_pixels:
            verdict = judge(split.labels, None, ours, classes, [], rules, metrics=metrics)
            verdict.update(blessed=False, first_model=False, reasons=verdict["reasons"][1:] + [
                f"the champion was trained on other inputs than today's store ({'; '.join(other_pixels)}): it cannot "
                "be judged on these pixels, so the challenger cannot be shown as good; keep data.stored_size, or "
                "promote with --override after comparing them yourself"])
        else:
            their_pred, _ = answers(their_model, their_meta, split, device)
            anchor = anchor_answers(champion, about, split, store, device)
            looked = look_at_anchor(out_dir / "gate.json", anchor_sha256(about), challenger_sha256) \
                if anchor_sha256(about) else {"look": None, "counted_from": "champion.json records no sha256"}
            verdict = judge(split.labels, their_pred, ours, classes, their_meta["classes"], rules, ours_known,
                            metrics=metrics, slices=slice_masks(prepared_dir, kept), anchor_look=looked.pop("look"),
                            **anchor)
            verdict["drift"]["looks_counted"] = looked
    verdict["anchor_next"] = next_anchor(verdict, about)
    verdict["relabels"], relabelled = week_relabels(data_report, index, cfg.max_relabel_share)
    if memorised:
        notes.append(f"{memorised} test image(s) were in a training split before (the split ledger): a model may "
                     "have learned them, so they are left out of the comparison")
    if left_out["relabelled"]:
        notes.append(f"{left_out['relabelled']} test image(s) are filed under another label than the split ledger "
                     "knew: the champion learnt the old one, so they are left out of the comparison")
    verdict["warnings"] = verdict.get("warnings", []) + notes + relabelled
    verdict["champion"] = about or None
    verdict["challenger"] = {"model": str(challenger / "best.pt"), "sha256": challenger_sha256,
                             "input": recipe_of(meta), "test_images": len(split),
                             "test_images_once_trained_on": memorised,
                             "test_images_relabelled": left_out["relabelled"]}
    verdict["rules"] = {"margin": cfg.margin, "confidence": rules.confidence, "power": rules.power,
                        "class_confidence": rules.class_confidence,
                        "min_support": cfg.min_support, "max_class_drop": cfg.max_class_drop,
                        "too_small": cfg.too_small, "new_class_min_recall": cfg.new_class_min_recall,
                        "max_to_new_class": cfg.max_to_new_class, "renamed": dict(cfg.renamed),
                        "drift_budget": cfg.drift_budget, "drift_confidence": cfg.drift_confidence,
                        "drift_weeks": cfg.drift_weeks, "drift_error": cfg.drift_error,
                        "max_relabel_share": cfg.max_relabel_share,
                        "floors": dict(cfg.floors), "stage": cfg.stage, "artifact": cfg.artifact}
    if delivery is not None and delivery.exists():  # the week's flags, repeated (not a reason to refuse)
        checked = json.loads(delivery.read_text())
        verdict["delivery"] = {k: checked.get(k) for k in ("checked", "reason", "flagged", "policy", "new_images",
                                                            "new_since", "flagged_images", "pairs", "list",
                                                            "held_from_earlier_weeks", "cleared", "open_flags",
                                                            "held_out_images", "unchecked")}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "gate.json", verdict)
    (out_dir / "gate.md").write_text(render(verdict), encoding="utf-8")
    return verdict

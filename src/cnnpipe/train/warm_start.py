"""Warm start: this week's challenger starts from the model in production (`model.init: champion`).

timm's `--initial-checkpoint` loads a checkpoint whole; a catalog's classes change from week to week,
so here the classifier's rows follow the class names (`models.warm_start`), through
`release.renamed` for a renamed class. The champion stage hands that mapping over in champion.json
(`warm_start`), with `release.warm_start_across_recipes`: a champion trained on other inputs
(another stored size, input size, channels or normalisation) is refused unless that is true, since
its weights would start from features of pixels this run never shows. The optimizer state and the
LR schedule start fresh: the recipe's schedule, from the champion's weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import timm
import torch

from cnnpipe.config import VariantConfig
from cnnpipe.files import CHAMPION_FILE, file_sha256
from cnnpipe.models import InitInfo, create_model, model_mean_std, warm_start
from cnnpipe.train.recipe import input_recipe, recipe_differences, recipe_of
from cnnpipe.train.trained import trained_weights


def from_champion(cfg: VariantConfig, classes: list[str], channels: int,
                  champion: Path | None) -> tuple[torch.nn.Module, InitInfo]:
    """The champion's weights in a model for `classes`; with no champion in `champion` yet, the
    `pretrained` start, saying so in its init record."""
    if champion is None or not (champion / "best.pt").exists():
        model, init = create_model(cfg.model, len(classes), channels)
        note = "model.init: champion, but no champion in production yet"
        return model, dataclasses.replace(init, location=f"{init.location} ({note})" if init.location else note)
    weights, meta = trained_weights(champion)
    if meta["model_name"] != cfg.model.name or meta["in_chans"] != channels:
        raise ValueError(f"model.init: champion, but the champion is a {meta['model_name']} on {meta['in_chans']} "
                         f"channel(s) and this run trains a {cfg.model.name} on {channels}: set model.init: pretrained")
    about = json.loads((champion / CHAMPION_FILE).read_text()) if (champion / CHAMPION_FILE).exists() else {}
    handover = about.get("warm_start") or {}
    extra = {"drop_path_rate": cfg.model.drop_path} if cfg.model.drop_path else {}
    model = timm.create_model(cfg.model.name, pretrained=False, num_classes=len(classes), in_chans=channels, **extra)
    ours = input_recipe(cfg.data, channels, *model_mean_std(model, channels))
    differences = recipe_differences(recipe_of(meta), ours)
    if differences and not handover.get("across_recipes", False):
        raise ValueError("model.init: champion, but the champion was trained on other inputs than this run "
                         f"({'; '.join(differences)}): its features were learnt on pixels this run never shows. "
                         "Keep the champion's data.stored_size and data.image_size, set model.init: pretrained, "
                         "or allow it with release.warm_start_across_recipes: true")
    mapped = warm_start(model, weights, meta["classes"], classes, handover.get("renamed") or {})
    renames = ", ".join(f"{old} -> {new}" for old, new in mapped["renamed"].items())
    where = (f"{about.get('version', 'unversioned')} ({str(about.get('commit', ''))[:12]}); new classes: "
             f"{', '.join(mapped['new']) or 'none'}; removed: {', '.join(mapped['removed']) or 'none'}"
             + (f"; renamed: {renames}" if renames else "")
             + (f"; across input recipes ({'; '.join(differences)})" if differences else ""))
    return model, InitInfo("champion", where, file_sha256(champion / "best.pt"))

"""Warm start: this week's challenger starts from the model in production (`model.init: champion`).

timm's `--initial-checkpoint` loads a checkpoint whole; a catalog's classes change from week to week,
so here the classifier's rows follow the class names (`models.warm_start`). The optimizer state and
the LR schedule start fresh: the recipe's schedule, from the champion's weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import timm
import torch

from cnnpipe.config import ModelConfig
from cnnpipe.files import CHAMPION_FILE, file_sha256
from cnnpipe.models import InitInfo, create_model, warm_start
from cnnpipe.train.trained import trained_weights


def from_champion(cfg: ModelConfig, classes: list[str], channels: int,
                  champion: Path | None) -> tuple[torch.nn.Module, InitInfo]:
    """The champion's weights in a model for `classes`; with no champion in `champion` yet, the
    `pretrained` start, saying so in its init record."""
    if champion is None or not (champion / "best.pt").exists():
        model, init = create_model(cfg, len(classes), channels)
        note = "model.init: champion, but no champion in production yet"
        return model, dataclasses.replace(init, location=f"{init.location} ({note})" if init.location else note)
    weights, meta = trained_weights(champion)
    if meta["model_name"] != cfg.name or meta["in_chans"] != channels:
        raise ValueError(f"model.init: champion, but the champion is a {meta['model_name']} on {meta['in_chans']} "
                         f"channel(s) and this run trains a {cfg.name} on {channels}: set model.init: pretrained")
    extra = {"drop_path_rate": cfg.drop_path} if cfg.drop_path else {}
    model = timm.create_model(cfg.name, pretrained=False, num_classes=len(classes), in_chans=channels, **extra)
    mapped = warm_start(model, weights, meta["classes"], classes)
    about = json.loads((champion / CHAMPION_FILE).read_text()) if (champion / CHAMPION_FILE).exists() else {}
    where = (f"{about.get('version', 'unversioned')} ({str(about.get('commit', ''))[:12]}); new classes: "
             f"{', '.join(mapped['new']) or 'none'}; removed: {', '.join(mapped['removed']) or 'none'}")
    return model, InitInfo("champion", where, file_sha256(champion / "best.pt"))

"""The `release:` section of ``params.yaml``: which model is in production and what a challenger must do
to replace it. Kept apart from `cnnpipe.config` so each file stays one screenful of sections."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from cnnpipe.config import reject


@dataclass(frozen=True)
class DeliveryConfig:
    """`release.delivery:` the check of a week's new photos against the champion before training
    (`cnnpipe.release.delivery`; docs/weekly-loop.md has its measured precision and recall)."""

    policy: Literal["report", "hold_out", "stop"] = "hold_out"
    """What a flag does: `hold_out` (the default: fail closed) lists the photos and keeps them out of
    training, validation and the test split until their label changes or a person clears them
    (`data/delivery/cleared.csv`; nothing is deleted); `report` only lists them and trains on; `stop`
    fails the delivery stage, so training does not start, naming the list's file. Whatever the
    policy, promote asks for `--accept-flagged` while flagged photos are open."""
    confidence: float = 0.8
    """A new photo counts as a disagreement when the champion's calibrated probability of another
    class is at least this."""
    alpha: float = 0.01
    """Family-wise error rate of the check: Holm over the given classes, then over the (given, predicted)
    pairs inside each flagged class (`cnnpipe.release.flagging.flag_pairs`)."""
    min_images: int = 5
    """A pair is flagged only with at least this many confident disagreements."""
    min_share: float = 0.05
    """... and only when they are at least this share of the new photos filed under the given class."""

    def __post_init__(self) -> None:
        if self.policy not in ("report", "hold_out", "stop"):
            reject("release.delivery.policy", self.policy, "report | hold_out | stop")
        if not 0.0 < self.confidence <= 1.0:
            reject("release.delivery.confidence", self.confidence, "a probability in (0, 1], e.g. 0.8")
        if not 0.0 < self.alpha < 1.0:
            reject("release.delivery.alpha", self.alpha, "a probability in (0, 1), e.g. 0.01")
        if not (isinstance(self.min_images, int) and self.min_images >= 1):
            reject("release.delivery.min_images", self.min_images, "an integer >= 1")
        if not 0.0 <= self.min_share <= 1.0:
            reject("release.delivery.min_share", self.min_share, "a share in [0, 1], e.g. 0.05")


@dataclass(frozen=True)
class ReleaseConfig:
    """`release:` section: which model is in production, and what a challenger must do to replace it
    (docs/weekly-loop.md has the operating characteristics of these defaults)."""

    artifact: str = "fashion-classifier"
    """The model's name under `artifacts:` in dvc.yaml: what GTO registers and assigns."""
    stage: str = "prod"
    """The GTO stage whose model is the champion."""
    remote: str | None = "origin"
    """The git remote whose tags say what is in production: the champion stage and promote fetch them
    first and refuse when local and remote tags disagree; promote pushes its tags there. A repository
    without this remote uses its local tags; null: local tags only, on purpose."""
    margin: float = 0.01
    """Non-inferiority margin on top-1, on the images of the classes the champion knows: the
    challenger may be at worst this much below the champion (one-sided 95% lower bound)."""
    min_support: int = 20
    """Classes with fewer test images are listed but not judged by the per-class rules."""
    max_class_drop: float = 0.05
    """A class fails when it lost recall beyond doubt (Holm-adjusted exact test) and by more than this."""
    too_small: Literal["bless", "refuse"] = "bless"
    """What the loop does when the test set is too small to judge the margin: `bless` with the warning
    in gate.md (a small catalog can still ship; a clear regression is still refused), or `refuse`. The
    same choice on a set too small for the drift bound's spent error (`drift_error`) to pass even a
    challenger that answers as the anchor does: `bless` judges its drift at `drift_confidence`."""
    new_class_min_recall: float = 0.5
    """A new class fails when its recall is below this beyond doubt."""
    max_to_new_class: float = 0.25
    """The most of an old class's test images the challenger may now call any new class."""
    drift_budget: float = 0.03
    """The most top-1 the challenger may lose against the anchor (the last model shown within `margin`
    of the anchor before it and no worse than it), on today's test set: a run of weeks too small to
    judge, each a small loss, is refused once their sum is beyond this (a one-sided lower bound). Also
    the widest margin a week too small to judge is judged at."""
    drift_confidence: float = 0.8
    """The one-sided confidence of the week's bound on a test set too small to show `drift_budget` at
    95% (a larger set uses 95%). The drift's own bound spends `drift_error` instead."""
    drift_weeks: int = 12
    """The weeks (looks) the drift bound's error is spent over: each week's bound against the anchor is
    one-sided at 1 - drift_error / drift_weeks. A retry of a refused week is another look."""
    drift_error: float = 0.1
    """The most chance, over `drift_weeks` looks at one anchor, that a challenger beyond `drift_budget`
    passes the drift bound: a loop that retries every refused week still ships a model within the
    budget in at least 1 - drift_error of its runs (docs/weekly-loop.md has the simulated rates)."""
    renamed: dict[str, str] = field(default_factory=dict)
    """Classes renamed since the champion, {old: new}: compared as one class by the gate, and the
    warm start keeps the old class's classifier row for the new name."""
    max_relabel_share: float = 0.05
    """A class whose images the week relabelled (bytes the split ledger knew under it, now under another
    label) beyond this share gets a warning in gate.md: look at the delivery before its numbers."""
    warm_start_across_recipes: bool = False
    """Let `model.init: champion` start from a champion whose input recipe (stored size, channels,
    input size, normalisation) differs from this run's; refused by default."""
    floors: dict[str, float] = field(default_factory=lambda: {"top1": 0.5})
    """Lowest allowed values of the challenger's own eval.json metrics (top1, top5, macro_f1, ...)."""
    delivery: DeliveryConfig = field(default_factory=DeliveryConfig)
    """The delivery check before training (`DeliveryConfig`)."""

    def __post_init__(self) -> None:
        for key in ("artifact", "stage"):
            value = getattr(self, key)
            if not (isinstance(value, str) and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", value)):
                reject(f"release.{key}", value, "a GTO name: lowercase letters, digits and dashes")
        if self.remote is not None and not (isinstance(self.remote, str) and self.remote.strip()):
            reject("release.remote", self.remote, "a git remote's name (e.g. origin), or null for local tags only")
        if not 0.0 <= self.margin < 1.0:
            reject("release.margin", self.margin, "a share of top-1 in [0, 1), e.g. 0.01 for one point")
        if not (isinstance(self.min_support, int) and self.min_support >= 1):
            reject("release.min_support", self.min_support, "an integer >= 1")
        if not 0.0 <= self.max_class_drop <= 1.0:
            reject("release.max_class_drop", self.max_class_drop, "a share of recall in [0, 1]")
        if self.too_small not in ("bless", "refuse"):
            reject("release.too_small", self.too_small, "bless | refuse")
        if not 0.0 <= self.new_class_min_recall <= 1.0:
            reject("release.new_class_min_recall", self.new_class_min_recall, "a recall in [0, 1]")
        if not 0.0 <= self.max_to_new_class <= 1.0:
            reject("release.max_to_new_class", self.max_to_new_class, "a share of a class's test images in [0, 1]")
        if not self.margin <= self.drift_budget < 1.0:
            reject("release.drift_budget", self.drift_budget, f"a share of top-1 in [release.margin={self.margin}, 1)")
        if not 0.5 <= self.drift_confidence < 1.0:
            reject("release.drift_confidence", self.drift_confidence, "a one-sided confidence in [0.5, 1), e.g. 0.8")
        if not (isinstance(self.drift_weeks, int) and self.drift_weeks >= 1):
            reject("release.drift_weeks", self.drift_weeks, "an integer >= 1, e.g. 12")
        if not 0.0 < self.drift_error < 0.5:
            reject("release.drift_error", self.drift_error, "a probability in (0, 0.5), e.g. 0.1")
        if not 0.0 <= self.max_relabel_share <= 1.0:
            reject("release.max_relabel_share", self.max_relabel_share, "a share of a class's images in [0, 1]")
        if not (isinstance(self.renamed, dict) and all(isinstance(k, str) and isinstance(v, str) and k != v
                                                        for k, v in self.renamed.items())):
            reject("release.renamed", self.renamed, "a mapping of old class name to new class name, e.g. {tshirt: t-shirt}")
        if len(set(self.renamed.values())) != len(self.renamed):
            reject("release.renamed", self.renamed, "each new name once")
        if not isinstance(self.warm_start_across_recipes, bool):
            reject("release.warm_start_across_recipes", self.warm_start_across_recipes, "true | false")
        if not isinstance(self.floors, dict) or not all(isinstance(v, (int, float)) for v in self.floors.values()):
            reject("release.floors", self.floors, "a mapping of eval.json metric to its lowest allowed value")

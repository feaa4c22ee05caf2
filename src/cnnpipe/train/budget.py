"""The plan's choice (metrics/plan/budget.yaml, the only part of the plan that `train` depends on):
the epochs of `train.epochs: auto` and the images per epoch; the batch a run of that length trains
at (`train.min_steps`); and the batches each variant's validation, evaluation and export check run at.

Kept apart from `plan.py` so that refining a prediction retrains nothing unless it changes a choice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cnnpipe.config import VariantConfig
from cnnpipe.files import read_yaml_mapping
from cnnpipe.train.schedule import batch_for_split, choose_batch

EVAL_BATCH = 256
"""The batch validation, calibration, `evaluate` and export's parity check run at where the plan names
none (a run outside `dvc repro`), and the one the profile times inference at when its box has room."""


def read_budget(path: Path | None) -> dict[str, Any]:
    """metrics/plan/budget.yaml (empty when absent: no budget applies)."""
    return read_yaml_mapping(path, "expected `fraction` and `images_per_epoch`; rerun `dvc repro plan`")


def apply_budget(cfg: VariantConfig, budget: dict[str, Any]) -> VariantConfig:
    """`cfg` with the plan's epochs when train.epochs is `auto`, and the budget's training and
    validation images per epoch where they are lower than what the params ask for."""
    changes: dict[str, Any] = {}
    if cfg.train.epochs == "auto" and budget.get("epochs") is not None:
        changes["epochs"] = _count(budget["epochs"], "epochs", "a count of epochs")
    for key in ("images_per_epoch", "val_images"):
        cap, current = budget.get(key), getattr(cfg.train, key)
        if cap is not None:
            changes[key] = cap if current is None else min(current, cap)
    return cfg.with_train(**changes)


def epochs_to_train(cfg: VariantConfig) -> tuple[VariantConfig, str]:
    """`cfg` with a number of epochs, and a note when `auto` had no plan's choice to take (a run
    outside `dvc repro`, or a budget.yaml from before `auto`): it trains the floor, train.min_epochs."""
    if cfg.train.epochs != "auto":
        return cfg, ""
    return (cfg.with_train(epochs=cfg.train.min_epochs),
            f"train.epochs: auto without the plan's choice (metrics/plan/budget.yaml `epochs`): training "
            f"train.min_epochs={cfg.train.min_epochs}")


def eval_batch(budget: dict[str, Any], variant: str) -> int:
    """The batch `variant` validates and evaluates at: the one its profile timed inference at
    (budget.yaml `eval_batch`), so that the plan's prediction of both is of the batch they run at.
    On a CPU at 128 px a ResNet-50 infers 1.3-1.7x more images/s at batch 16 or 32 than at 256, and
    at 32 px 0.3-0.5x as many (`bench/inference_batch.py`): a timing at one batch does not carry to another."""
    return planned_batch(budget, "eval_batch", variant)


def export_batch(budget: dict[str, Any], variant: str) -> int:
    """The batch export's parity check runs at: the one the profile timed fp32 CPU inference at
    (budget.yaml `export_batch`), for the same reason as `eval_batch`."""
    return planned_batch(budget, "export_batch", variant)


def planned_batch(budget: dict[str, Any], key: str, variant: str) -> int:
    """budget.yaml's `key` for `variant`; `EVAL_BATCH` where the plan names none (no plan, or one from
    before it carried the key)."""
    batches = budget.get(key)
    if batches is not None and not isinstance(batches, dict):
        raise ValueError(f"budget.yaml: `{key}` = {batches!r} is not a mapping of variants to batch sizes; "
                         "rerun `dvc repro plan`")
    if not batches or variant not in batches:
        return EVAL_BATCH
    return _count(batches[variant], f"{key}.{variant}", "a batch size")


def _count(value: Any, key: str, what: str) -> int:
    """budget.yaml's `key` when it is an integer >= 1 (not a bool, which is an int to Python)."""
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"budget.yaml: `{key}` = {value!r} is not {what}; rerun `dvc repro plan`")
    return value


def fit_batch_to_steps(cfg: VariantConfig, n_train: int, world_size: int) -> tuple[VariantConfig, str]:
    """`cfg` with the batch `train.min_steps` asks for, given the images each epoch draws (of `n_train`),
    and why it differs from train.batch_size ('' when it does not: `schedule.choose_batch`)."""
    t = cfg.train
    images = n_train if t.images_per_epoch is None else min(n_train, t.images_per_epoch)
    batch, why = choose_batch(t.batch_size, t.min_steps, images, t.epochs, world_size, t.accum_steps)
    return (cfg, "") if batch == t.batch_size else (cfg.with_train(batch_size=batch), why)


def fit_batch_to_split(cfg: VariantConfig, n_train: int, world_size: int) -> VariantConfig:
    """`cfg` at the batch one epoch of `n_train` images fills on every process: what the profile
    measures when a small catalog holds fewer images than `train.batch_size` (training halves to the
    same one, as it cannot take a single step at the larger: `schedule.batch_for_split`)."""
    t = cfg.train
    images = n_train if t.images_per_epoch is None else min(n_train, t.images_per_epoch)
    batch = batch_for_split(t.batch_size, images, world_size, t.accum_steps)
    return cfg if batch == t.batch_size else cfg.with_train(batch_size=batch)

"""`auto` params: resolved from the profile's measured winners, or from sensible defaults.

The profile stage writes `metrics/profile/<variant>_tuned.yaml` holding a value for each knob that
the variant's params leave at `auto` (and nothing else, so a variant with explicit settings gets an
empty, stable file), plus `at_batch` when a smaller batch that `train.min_steps` may pick measured a
different winner. Training reads it; without it the defaults below apply.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from cnnpipe import malloc
from cnnpipe.config import DataConfig, VariantConfig
from cnnpipe.files import read_yaml_mapping
from cnnpipe.train.precision import resolve_amp

GPU_IMAGE_SIZE = 224
"""`data.image_size: auto` on a GPU: ResNet-50's own input size, upsampled on the device from the
store. At the store's 32 px an H200 trains Fashion-MNIST launch-bound (~2 s an epoch, the GPU idle
between kernels), which shows none of what the recipes differ in; at 224 px the input pipeline, AMP
and channels_last decide the speed (on an H200: the batched loader 1.83x over per-sample PIL,
channels_last 1.93x in bf16; docs/benchmarks.md)."""

TUNABLE = ("amp", "channels_last", "loader", "num_workers", "pin_memory", "compile", "decode", "malloc")


def auto_knobs(cfg: VariantConfig) -> list[str]:
    """The tunable train.* keys this variant leaves at `auto`."""
    return [k for k in TUNABLE if getattr(cfg.train, k) == "auto"]


def default_for(knob: str, device: torch.device) -> Any:
    """What `auto` means when no measurement is available."""
    if knob == "amp":  # (asks the device: only when amp is the knob)
        return resolve_amp("auto", device)
    defaults = {"channels_last": True, "loader": "fast", "num_workers": 0, "pin_memory": True, "compile": "off",
                "decode": "cpu", "malloc": "system"}  # (malloc: `keep` only where the profile measured it win)
    return defaults[knob]


def decode_for_loader(decode: str, loader: str) -> str:
    """`train.decode` as it can run with `loader`: the device decode feeds the fast loader's device
    transform only, so with another loader a measured `device` becomes `cpu`."""
    return "cpu" if decode == "device" and loader != "fast" else decode


def read_tuned(path: Path | None) -> dict[str, Any]:
    """The tuned values file (empty when absent)."""
    return read_yaml_mapping(path, "expected a mapping of train keys to values; rerun `dvc repro profile`")


def image_size_for(data: DataConfig, device: torch.device, model_name: str | None = None) -> int:
    """`data.image_size`, with `auto` resolved: the stored size on a CPU; on a GPU the input size of
    the model's pretrained config (its weights' own: 224 for ResNet-50 and EfficientNet-Lite0), else
    `GPU_IMAGE_SIZE`, never below the stored size."""
    if data.image_size != "auto":
        return data.image_size
    if device.type == "cpu":
        return data.stored_size
    import timm

    pretrained = timm.models.get_pretrained_cfg(model_name) if model_name else None
    size = getattr(pretrained, "input_size", None)
    return max(data.stored_size, int(size[-1]) if size else GPU_IMAGE_SIZE)


def resolve_auto(cfg: VariantConfig, device: torch.device, tuned: dict[str, Any] | None = None) -> VariantConfig:
    """`cfg` with every `auto` knob replaced (and `data.image_size`): the tuned value when given,
    else the default.

    `tuned["at_batch"][B]` holds values the profile measured to win at per-process batch B (one
    `train.min_steps` may halve to); they apply when `cfg` trains at B.
    """
    tuned = tuned or {}
    changes = {k: tuned.get(k, default_for(k, device)) for k in auto_knobs(cfg)}
    at_batch = (tuned.get("at_batch") or {}).get(cfg.train.batch_size, {})
    changes.update({k: v for k, v in at_batch.items() if k in changes})
    if "amp" in changes:
        changes["amp"] = resolve_amp(changes["amp"], device)
    if changes.get("malloc") == "keep" and not malloc.available():  # tuned on another host
        changes["malloc"] = "system"
    if "decode" in changes:
        changes["decode"] = decode_for_loader(changes["decode"], changes.get("loader", cfg.train.loader))
    data = dataclasses.replace(cfg.data, image_size=image_size_for(cfg.data, device, cfg.model.name))
    return dataclasses.replace(cfg.with_train(**changes), data=data)

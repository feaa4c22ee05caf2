"""The parts of a training run, built once from a resolved config: the model, optimizer, LR schedule,
scaler and this rank's loader (`TrainingParts`), and the step's context with DDP, compile and mixup
applied. `fit` (trainer) and the profiler build them; resume, pacing and report read them."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from timm.data import Mixup
from timm.optim import create_optimizer_v2
from torch.nn.parallel import DistributedDataParallel

from cnnpipe.config import VariantConfig
from cnnpipe.data.loaders.device import build_device_decoded_loader
from cnnpipe.data.loaders.host import TrainLoader, build_train_loader
from cnnpipe.data.loaders.transforms import AugmentConfig
from cnnpipe.data.store.shards import PreparedSplit
from cnnpipe.hardware import usable_cores
from cnnpipe.models import InitInfo, create_model, model_mean_std
from cnnpipe.train.distributed import DistInfo, local_world_size
from cnnpipe.train.engine import StepContext
from cnnpipe.train.precision import grad_scaler, resolve_amp, use_cudnn_autotuner
from cnnpipe.train.schedule import LrSchedule, backbone_lr_scale
from cnnpipe.train.warm_start import from_champion
from cnnpipe.weights import classifier_prefix


def seed_everything(seed: int, rank: int = 0) -> None:
    """Same seed everywhere; ranks differ so their augmentations differ."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)


def set_threads(cfg: VariantConfig, info: DistInfo) -> int:
    """Intra-op threads: `train.threads`, else the usable cores shared evenly by the local processes.

    More threads than cores (e.g. torch's default under a restricted affinity mask) makes every
    convolution wait on oversubscribed cores.
    """
    threads = cfg.train.threads or max(1, usable_cores() // max(1, local_world_size(info)))
    torch.set_num_threads(threads)
    return threads


def build_model(cfg: VariantConfig, classes: list[str], channels: int, device: torch.device,
                champion: Path | None = None):
    """Model on `device` in the configured memory format, with its init record: from the champion in
    `champion` (its best.pt) when `model.init: champion` and there is one, else `create_model`."""
    model, init = (from_champion(cfg, classes, channels, champion) if cfg.model.init == "champion"
                   else create_model(cfg.model, len(classes), channels))
    model.to(device)
    if cfg.train.channels_last:
        model.to(memory_format=torch.channels_last)
    return model, init


def build_optimizer(model: torch.nn.Module, cfg: VariantConfig, lr: float,
                    device: torch.device) -> torch.optim.Optimizer:
    """timm's optimizer factory at the schedule's first LR: no weight decay on norms and biases.

    On CUDA the update is one fused kernel per parameter group, and it takes fp16's found-inf flag
    from the GradScaler on the device (no host sync per step); elsewhere the multi-tensor (foreach)
    update. timm passes both flags on to torch's SGD and AdamW.
    """
    t = cfg.train
    name = "adamw" if t.optimizer == "adamw" else ("sgd" if t.nesterov else "momentum")
    kwargs: dict[str, Any] = {"momentum": t.momentum} if t.optimizer == "sgd" else {}
    if device.type == "cuda":
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = True
    return create_optimizer_v2(model, opt=name, lr=lr, weight_decay=t.weight_decay, **kwargs)


def split_head_lr(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                  backbone_scale: float) -> torch.optim.Optimizer:
    """`optimizer` with each parameter group split in two: the backbone's parameters at
    `backbone_scale` of the schedule's LR, the classifier's at the full LR (`lr_scale`, the key
    timm's schedulers and our step read). Scale 1: `optimizer` itself, untouched."""
    if backbone_scale == 1.0:
        return optimizer
    prefix = classifier_prefix(model) + "."
    head = {id(p) for n, p in model.named_parameters() if n.startswith(prefix)}
    groups = []
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        for params, scale in (([p for p in group["params"] if id(p) not in head], backbone_scale),
                              ([p for p in group["params"] if id(p) in head], 1.0)):
            if params:
                groups.append({**settings, "params": params, "lr_scale": scale, "lr": settings["lr"] * scale})
    # The groups swapped in place (no step taken yet, so no state to carry): rebuilding the optimizer
    # from its `defaults` fails where those hold a key its constructor does not take (AdamW's
    # `decoupled_weight_decay`).
    optimizer.param_groups.clear()
    for group in groups:
        optimizer.add_param_group(group)
    return optimizer


def decode_place(cfg: VariantConfig, split: PreparedSplit) -> str:
    """Where this run decodes its images, as train.json says it: `train.decode`, or `none` (a raw store)."""
    return cfg.train.decode if split.encoding == "jpeg" else "none"


def build_loader(cfg: VariantConfig, info: DistInfo, split: PreparedSplit, aug: AugmentConfig,
                 mean: tuple[float, ...], std: tuple[float, ...]) -> TrainLoader:
    """This rank's training loader: `train.loader`'s, or with `train.decode: device` the fast loader
    whose workers only gather a JPEG store's records, decoded on the training device."""
    t = cfg.train
    common = dict(batch_size=t.batch_size, aug=aug, mean=mean, std=std, seed=cfg.seed, rank=info.rank,
                  world_size=info.world_size, num_workers=t.num_workers, pin_memory=t.pin_memory,
                  channels_last=t.channels_last, images_per_epoch=t.images_per_epoch,
                  local_ranks=local_world_size(info))
    if t.decode != "device":
        return build_train_loader(split, kind=t.loader, **common)
    if t.loader != "fast":
        raise ValueError(f"train.decode: device feeds the fast loader's device transform, and train.loader is "
                         f"{t.loader}: set train.loader: fast (or auto), or train.decode: cpu")
    return build_device_decoded_loader(split, **common)


@dataclass
class TrainingParts:
    """What a training step needs, built once from a config (used by `fit` and the profiler)."""

    split: PreparedSplit
    model: torch.nn.Module
    init: InitInfo
    mean: tuple[float, ...]
    std: tuple[float, ...]
    amp: str
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    aug: AugmentConfig
    loader: TrainLoader
    global_batch: int
    steps_per_epoch: int
    schedule: LrSchedule


def build_training(cfg: VariantConfig, info: DistInfo, split: PreparedSplit,
                   champion: Path | None = None) -> TrainingParts:
    """Model, LR schedule, optimizer, scaler and this rank's training loader for a resolved config."""
    t = cfg.train
    model, init = build_model(cfg, split.classes, split.channels, info.device, champion)
    mean, std = model_mean_std(model, split.channels)
    amp = resolve_amp(t.amp, info.device)
    aug = AugmentConfig(cfg.data.image_size, scale=(t.crop_scale_min, 1.0), hflip=t.hflip)
    loader = build_loader(cfg, info, split, aug, mean, std)
    if len(loader) < t.accum_steps:
        raise ValueError(f"train.accum_steps={t.accum_steps} exceeds the {len(loader)} batches per epoch")
    global_batch = t.batch_size * info.world_size * t.accum_steps
    steps_per_epoch = len(loader) // t.accum_steps
    schedule = LrSchedule.for_run(t, len(split), global_batch, steps_per_epoch * t.epoch_count)
    optimizer = split_head_lr(build_optimizer(model, cfg, schedule(0), info.device), model,
                              backbone_lr_scale(t, init.source))
    return TrainingParts(split, model, init, mean, std, amp, optimizer, grad_scaler(amp, info.device), aug, loader,
                         global_batch, steps_per_epoch, schedule)


def step_context(cfg: VariantConfig, parts: TrainingParts, info: DistInfo, lr_for_step: Callable[[int], float],
                 ema: torch.nn.Module | None = None) -> tuple[StepContext, torch.nn.Module]:
    """The step's context (DDP, compile and mixup applied) and the model to evaluate and save.

    With SyncBN the returned model is the converted one; it shares parameters with `parts.model`.
    """
    t = cfg.train
    use_cudnn_autotuner(info.device)
    model = parts.model
    train_model: torch.nn.Module = model
    if info.distributed:
        if t.sync_bn:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        train_model = distributed_model(model, info, static_graph=t.accum_steps == 1)
    if t.compile != "off":
        train_model = torch.compile(train_model, mode=None if t.compile == "default" else t.compile)
    mixup = None
    if t.mixup_alpha or t.cutmix_alpha:
        mixup = Mixup(mixup_alpha=t.mixup_alpha, cutmix_alpha=t.cutmix_alpha, label_smoothing=t.label_smoothing,
                      num_classes=parts.split.num_classes)
    ctx = StepContext(train_model, parts.optimizer, info.device, parts.amp, t.label_smoothing, parts.scaler,
                      t.grad_clip, lr_for_step, ema, mixup, t.accum_steps)
    return ctx, model


def distributed_model(model: torch.nn.Module, info: DistInfo, static_graph: bool) -> DistributedDataParallel:
    """`model` under DDP, set up for many GPUs on a node.

    - No buffer broadcast before every forward (`forward_sync_buffers`, the newer name of
      `broadcast_buffers`): BatchNorm's running statistics are synced once per epoch by
      `sync_buffers`, before validation and checkpoints, and training never reads them.
    - Gradients are views into the all-reduce buckets: no copy in and out, less memory.
    - A static graph (the same parameters used every step) lets DDP skip its per-step bookkeeping.
      Only without gradient accumulation: a static graph assumes every step reduces the same
      buckets, which `no_sync` breaks. With torch.compile it works (torch's own
      `test_ddp_compile_static_graph` checks gradient parity).
    """
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False,
                                   gradient_as_bucket_view=True, static_graph=static_graph)

"""`fit`: builds the parts of a training run (model, optimizer, schedule, loader, DDP) and runs its
epoch loop; resuming (`resume`), checkpoints (`pacing`) and reporting (`report`) live apart."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from timm.data import Mixup
from timm.optim import create_optimizer_v2
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from cnnpipe.config import VariantConfig
from cnnpipe.data.loaders import AugmentConfig, FastTransform, TrainLoader, build_eval_loader, build_train_loader
from cnnpipe.data.split import balanced_subset
from cnnpipe.data.store import PreparedSplit, data_fingerprint, open_split
from cnnpipe.files import file_sha256, write_json
from cnnpipe.hardware import usable_cores
from cnnpipe.models import InitInfo, create_model, model_mean_std
from cnnpipe.monitor import GpuUtilSampler, process_seconds
from cnnpipe.train import checkpoint as ckpt
from cnnpipe.train.budget import epochs_to_train, fit_batch_to_steps
from cnnpipe.train.distributed import DistInfo, check_same_settings, local_world_size, sync_buffers, unwrap
from cnnpipe.train.ema import ModelEma, decay_for_run
from cnnpipe.train.engine import StepContext, evaluate_top1, train_one_epoch
from cnnpipe.train.pacing import Pacer, save_checkpoints
from cnnpipe.train.precision import grad_scaler, resolve_amp, use_cudnn_autotuner
from cnnpipe.train.report import Live, announce, batch_note, epoch_record, report_epoch, run_summary
from cnnpipe.train.resume import resume
from cnnpipe.train.schedule import LrSchedule, early_stop
from cnnpipe.train.temperature import calibrate_best
from cnnpipe.train.tuning import resolve_auto
from cnnpipe.train.warm_start import from_champion


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
    model, init = (from_champion(cfg.model, classes, channels, champion) if cfg.model.init == "champion"
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
    loader = build_train_loader(
        split, kind=t.loader, batch_size=t.batch_size, aug=aug, mean=mean, std=std, seed=cfg.seed,
        rank=info.rank, world_size=info.world_size, num_workers=t.num_workers, pin_memory=t.pin_memory,
        channels_last=t.channels_last, images_per_epoch=t.images_per_epoch, local_ranks=local_world_size(info))
    if len(loader) < t.accum_steps:
        raise ValueError(f"train.accum_steps={t.accum_steps} exceeds the {len(loader)} batches per epoch")
    global_batch = t.batch_size * info.world_size * t.accum_steps
    steps_per_epoch = len(loader) // t.accum_steps
    schedule = LrSchedule.for_run(t, len(split), global_batch, steps_per_epoch * t.epoch_count)
    optimizer = build_optimizer(model, cfg, schedule(0), info.device)
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


def fit(cfg: VariantConfig, info: DistInfo, prepared_dir: Path, model_dir: Path, metrics_path: Path,
        live_dir: Path, tuned: dict[str, Any] | None = None,
        epoch_hook: Callable[[torch.nn.Module], dict[str, float]] | None = None,
        champion: Path | None = None) -> dict[str, Any] | None:
    """Train `cfg.variant`; resume from `model_dir/last.pt` when it was made under the same params.

    `tuned` holds the profile's measured values for knobs the params leave at `auto`. `epoch_hook`
    (benchmarks) is called with the model after each epoch's validation, outside the timed epoch;
    what it returns joins that epoch's record.
    """
    t_start = time.perf_counter()
    train_split = open_split(prepared_dir, "train")
    cfg, epochs_note = epochs_to_train(cfg)  # `auto` arrives as the plan's count (apply_budget)
    if epochs_note and info.is_primary:
        print(f"train[{cfg.variant}]: {epochs_note}", flush=True)
    requested_batch = cfg.train.batch_size
    cfg = fit_batch_to_steps(cfg, len(train_split), info.world_size)
    cfg = resolve_auto(cfg, info.device, tuned)  # after the batch: the profile may have tuned knobs per batch
    note = batch_note(cfg, requested_batch)
    data_id = data_fingerprint(prepared_dir)
    if cfg.model.init == "champion" and champion is not None and (champion / "best.pt").exists():
        data_id += ":" + file_sha256(champion / "best.pt")[:16]  # a resume must start from the same champion
    # Before anything else: nodes that resolved different settings (or hold different data) would
    # disagree on the number of steps and wait on each other's collectives until a timeout.
    check_same_settings(ckpt.computed_settings(cfg, data_id), info, cfg.train.node_rank)
    cfg = _workers_fit_cores(cfg, info)
    seed_everything(cfg.seed, info.rank)
    threads = set_threads(cfg, info)
    t = cfg.train
    if t.sync_bn and info.distributed and info.device.type != "cuda":
        raise ValueError("train.sync_bn=true needs CUDA: PyTorch's SyncBatchNorm runs on GPUs only; "
                         "set train.sync_bn: false for CPU training")
    parts = build_training(cfg, info, train_split, champion)
    ema = ModelEma(parts.model, decay_for_run(t.ema_decay, parts.schedule.total_steps)) if t.ema_decay else None
    val_split = balanced_subset(open_split(prepared_dir, "val"), t.val_images, cfg.seed)
    val_loader = build_eval_loader(val_split, batch_size=max(t.batch_size, 256), rank=info.rank,
                                   world_size=info.world_size)
    val_transform = FastTransform(parts.aug, parts.mean, parts.std, train=False, channels_last=t.channels_last,
                                  seed=cfg.seed)
    fingerprint = ckpt.fingerprint(cfg, data_id)
    progress = resume(cfg, info, parts, ema, model_dir / "last.pt", fingerprint)
    ctx, model = step_context(cfg, parts, info, parts.schedule, ema)
    live = Live(live_dir if info.is_primary else None, resume=bool(progress.resumed_from))
    gpu = GpuUtilSampler(info.device)
    pacer = Pacer()
    announce(cfg, info, parts, threads, note)
    for epoch in range(progress.start_epoch, t.epochs):
        parts.loader.set_epoch(epoch)
        # A live bar with ETA on rank 0 in a terminal; plain per-epoch lines otherwise (CI, logs).
        batches = tqdm(parts.loader, total=len(parts.loader), desc=f"{cfg.variant} epoch {epoch + 1}/{t.epochs}",
                       unit="step", leave=False, disable=None if info.is_primary else True)
        stats = train_one_epoch(ctx, batches, parts.loader.device_transform, epoch * parts.steps_per_epoch)
        sync_buffers(unwrap(model), info)
        if ema is not None:
            sync_buffers(ema.module, info)
        val = evaluate_top1(unwrap(model), val_loader, val_transform, info, parts.amp)
        record = epoch_record(epoch, stats, val, info)
        if ema is not None:
            record["val_top1_ema"] = evaluate_top1(ema.module, val_loader, val_transform, info, parts.amp)["top1"]
        if epoch_hook is not None:
            record.update(epoch_hook(unwrap(model)))
        progress.history.append(record)
        improved = record["val_top1"] > progress.best_top1
        progress.best_top1 = max(progress.best_top1, record["val_top1"])
        report_epoch(cfg, info, live, epoch, record)
        if epoch + 1 < t.epochs:  # every rank decides alike: validation top-1 is reduced over all of them
            progress.stopped_early = early_stop(progress.history, t.patience)
        save_checkpoints(cfg, info, parts, model, ema, progress, fingerprint, epoch, improved, model_dir, pacer)
        if progress.stopped_early:
            if info.is_primary:
                print(f"train[{cfg.variant}]: early stop after epoch {epoch + 1}/{t.epochs}: "
                      f"{progress.stopped_early['reason']}; best.pt holds epoch "
                      f"{progress.stopped_early['best_epoch']}", flush=True)
            break
    gpu_util = gpu.stop()
    live.end()
    if not info.is_primary:
        return None
    summary = run_summary(cfg, progress.history, parts.init, info, parts.amp, parts.global_batch,
                          parts.schedule.peak_lr, threads, progress.resumed_from, gpu_util,
                          time.perf_counter() - t_start)
    summary.update(epochs_planned=t.epochs, stopped_early=progress.stopped_early,
                   ema_decay=ema.decay if ema is not None else None,
                   optimizer_steps=parts.schedule.total_steps, batch_note=note, val_images=len(val_split),
                   calibration=calibrate_best(model_dir, val_split, info.device), stage_time_s=process_seconds())
    write_json(metrics_path, summary)
    write_json(model_dir / "config.json", cfg.to_dict())
    return summary


def _workers_fit_cores(cfg: VariantConfig, info: DistInfo) -> VariantConfig:
    """Loader workers per rank within this node's cores: the profile tunes `num_workers` for one
    process, and N ranks each starting that many would oversubscribe the node."""
    local = local_world_size(info)
    if local <= 1 or cfg.train.num_workers == 0:
        return cfg
    fits = max(0, usable_cores() // local - 1)  # a core per rank stays with its training step
    if cfg.train.num_workers <= fits:
        return cfg
    if info.is_primary:
        print(f"train[{cfg.variant}]: num_workers {cfg.train.num_workers} -> {fits} per rank "
              f"({usable_cores()} cores, {local} ranks on this node)", flush=True)
    return cfg.with_train(num_workers=fits)

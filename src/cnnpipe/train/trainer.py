"""`fit`: wires config, data, model, optimizer, schedule and checkpoints into a training run."""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from timm.data import Mixup
from timm.optim import create_optimizer_v2
from timm.utils import ModelEmaV3
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from cnnpipe.config import VariantConfig
from cnnpipe.data.loaders import AugmentConfig, FastTransform, TrainLoader, build_eval_loader, build_train_loader
from cnnpipe.data.split import balanced_subset
from cnnpipe.data.store import PreparedSplit, data_fingerprint, open_split
from cnnpipe.files import write_json
from cnnpipe.hardware import cpu_report, usable_cores
from cnnpipe.models import InitInfo, create_model, file_sha256, model_mean_std
from cnnpipe.monitor import GpuUtilSampler, peak_mem_mb, process_seconds
from cnnpipe.train import checkpoint as ckpt
from cnnpipe.train.budget import fit_batch_to_steps
from cnnpipe.train.distributed import (
    DistInfo,
    all_gather_objects,
    all_reduce_max,
    all_reduce_sum,
    broadcast_object,
    check_same_settings,
    sync_buffers,
    unwrap,
)
from cnnpipe.train.engine import StepContext, evaluate_top1, train_one_epoch
from cnnpipe.train.precision import grad_scaler, math_mode, resolve_amp, use_cudnn_autotuner
from cnnpipe.train.schedule import LrSchedule
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
    local = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    threads = cfg.train.threads or max(1, usable_cores() // max(1, local))
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


def build_optimizer(model: torch.nn.Module, cfg: VariantConfig, lr: float) -> torch.optim.Optimizer:
    """timm's optimizer factory at the schedule's first LR: no weight decay on norms and biases."""
    t = cfg.train
    name = "adamw" if t.optimizer == "adamw" else ("sgd" if t.nesterov else "momentum")
    kwargs = {"momentum": t.momentum} if t.optimizer == "sgd" else {}
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
        channels_last=t.channels_last, images_per_epoch=t.images_per_epoch)
    if len(loader) < t.accum_steps:
        raise ValueError(f"train.accum_steps={t.accum_steps} exceeds the {len(loader)} batches per epoch")
    global_batch = t.batch_size * info.world_size * t.accum_steps
    steps_per_epoch = len(loader) // t.accum_steps
    schedule = LrSchedule.for_run(t, len(split), global_batch, steps_per_epoch * t.epochs)
    optimizer = build_optimizer(model, cfg, schedule(0))
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
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        train_model = DistributedDataParallel(model, device_ids=device_ids)
    if t.compile != "off":
        train_model = torch.compile(train_model, mode=None if t.compile == "default" else t.compile)
    mixup = None
    if t.mixup_alpha or t.cutmix_alpha:
        mixup = Mixup(mixup_alpha=t.mixup_alpha, cutmix_alpha=t.cutmix_alpha, label_smoothing=t.label_smoothing,
                      num_classes=parts.split.num_classes)
    ctx = StepContext(train_model, parts.optimizer, info.device, parts.amp, t.label_smoothing, parts.scaler,
                      t.grad_clip, lr_for_step, ema, mixup, t.accum_steps)
    return ctx, model


class _Live:
    """dvclive on rank 0 only; a no-op elsewhere."""

    def __init__(self, directory: Path | None, resume: bool) -> None:
        self.live = None
        if directory is not None:
            from dvclive import Live

            self.live = Live(str(directory), resume=resume, save_dvc_exp=False, dvcyaml=None, report=None)

    def log(self, epoch: int, values: dict[str, float]) -> None:
        if self.live is None:
            return
        self.live.step = epoch
        for key, value in values.items():
            self.live.log_metric(key, value)
        self.live.next_step()

    def end(self) -> None:
        if self.live is not None:
            self.live.end()


@dataclass
class _Progress:
    """Where a run stands: what a resume restores and every epoch extends."""

    start_epoch: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    best_top1: float = -1.0
    resumed_from: int | None = None


def _read_last(last_path: Path, info: DistInfo, note: str) -> dict[str, Any] | None:
    """The primary rank's last.pt, on every rank (other nodes may have no copy on their disk).

    A file that is not a readable checkpoint (empty, truncated by a full disk or a copy) is set
    aside as `last.pt.corrupt` with a message, and training starts over, instead of the same
    traceback on every run.
    """
    state = None
    if info.is_primary and last_path.exists():
        try:
            state = ckpt.load(last_path)
        except ckpt.CorruptCheckpoint as exc:
            aside = last_path.with_name(last_path.name + ".corrupt")
            os.replace(last_path, aside)
            print(f"{note}{exc}; moved it to {aside} and training starts from epoch 1", file=sys.stderr)
    return broadcast_object(state, info)


def _resume(cfg: VariantConfig, info: DistInfo, parts: TrainingParts, ema: torch.nn.Module | None,
            last_path: Path, fingerprint: str) -> _Progress:
    """Restore an unfinished run from `last_path` (made under the same params and data) into `parts`,
    on every rank: each gets its own RNG states back."""
    note = f"train[{cfg.variant}]: "
    state = _read_last(last_path, info, note)
    if state is None:
        return _Progress()
    if state.get("fingerprint") != fingerprint:
        if info.is_primary:
            print(f"{note}NOT resuming {last_path}: it was made under different params or data "
                  f"({state.get('fingerprint')} != {fingerprint}); starting from scratch", file=sys.stderr)
        return _Progress()
    if state["epoch"] >= cfg.train.epochs:
        # A finished run that DVC asks to run again: an input (code, data, -f) changed. Only an
        # unfinished run is resumed; a finished one is never silently reused.
        if info.is_primary:
            print(f"{note}{last_path} is a finished run; training again from scratch", file=sys.stderr)
        return _Progress()
    parts.model.load_state_dict(state["model"])
    parts.optimizer.load_state_dict(state["optimizer"])
    if parts.scaler is not None and state.get("scaler"):
        parts.scaler.load_state_dict(state["scaler"])
    if ema is not None and state.get("ema"):
        ema.load_state_dict(state["ema"])
    rngs, augment = state["rng"], state.get("augment_rng") or [{}]
    if isinstance(augment, dict):  # older checkpoints: the primary rank's only
        augment = [augment]
    # A rank beyond those saved (a checkpoint from an older, primary-only format) takes the first.
    ckpt.set_rng_state(rngs[info.rank] if info.rank < len(rngs) else rngs[0], info.device)
    mine = augment[info.rank] if info.rank < len(augment) else augment[0]
    if mine and hasattr(parts.loader.device_transform, "load_state"):
        if not parts.loader.device_transform.load_state(mine, info.device) and info.is_primary:
            print(f"{note}the augmentation RNG was saved on {', '.join(mine)}, not {info.device}: re-seeded",
                  file=sys.stderr)
    parts.init = type(parts.init)(**state["init"])
    if info.local_rank == 0:  # each node says where it resumed (the checkpoint came from the primary's disk)
        where = f"node {cfg.train.node_rank} " if info.distributed else ""
        print(f"{note}{where}resuming from {last_path} after epoch {state['epoch']}/{cfg.train.epochs}", flush=True)
    return _Progress(state["epoch"], state["history"], state.get("best_top1", -1.0), state["epoch"])


BEST_KEYS = ("model", "ema", "meta", "init", "epoch", "fingerprint")
"""What best.pt holds: the weights and what loading them needs, no optimizer or RNG state."""
CHECKPOINT_SHARE = 0.05
"""Checkpoints may take at most this share of training time: a due last.pt is skipped while the time
since the previous one is under 1/share times what that one took to write. ResNet-50's last.pt is
~285 MB, fsynced: nothing on a CPU epoch of a minute, but more than a whole epoch on an H200."""


@dataclass
class _Pacer:
    """When the last checkpoint was written and how long it took; the best model not yet on disk."""

    last_write: float = field(default_factory=time.monotonic)
    write_s: float = 0.0
    pending_best: dict[str, Any] | None = None

    def due(self, every: int | str, epoch: int, final: bool) -> bool:
        """`every`: train.checkpoint_every (N epochs, or `auto`: paced by `CHECKPOINT_SHARE`)."""
        if final:
            return True
        if every == "auto":
            return time.monotonic() - self.last_write >= self.write_s / CHECKPOINT_SHARE
        return (epoch + 1) % every == 0


def _save_checkpoints(cfg: VariantConfig, info: DistInfo, parts: TrainingParts, model: torch.nn.Module,
                      ema: torch.nn.Module | None, progress: _Progress, fingerprint: str, epoch: int, improved: bool,
                      model_dir: Path, pacer: _Pacer) -> None:
    """last.pt every `train.checkpoint_every` epochs (`auto`: paced by `CHECKPOINT_SHARE`) and at the end,
    with every rank's RNG states; best.pt when validation improved, written with the next last.pt
    (so the two always agree on disk). Called on every rank (the RNG states are gathered); the
    primary rank decides and writes."""
    final = epoch + 1 == cfg.train.epochs
    due = broadcast_object(pacer.due(cfg.train.checkpoint_every, epoch, final), info)
    if due:
        augment = getattr(parts.loader.device_transform, "state", dict)()
        rngs = all_gather_objects((ckpt.rng_state(info.device), augment), info)
    if not info.is_primary:
        return
    state = {
        "fingerprint": fingerprint, "epoch": epoch + 1, "history": progress.history,
        "best_top1": progress.best_top1, "model": unwrap(model).state_dict(),
        "init": parts.init.to_dict(), "meta": _model_meta(cfg, parts.split, parts.mean, parts.std, parts.amp),
        "ema": ema.state_dict() if ema is not None else None,
    }
    if not due:
        if improved:  # a CPU copy until the next write: the weights move on with the next epoch
            pacer.pending_best = {k: _to_cpu(state[k]) for k in BEST_KEYS}
        return
    best = {k: state[k] for k in BEST_KEYS} if improved else pacer.pending_best
    t0 = time.monotonic()
    ckpt.save_atomic({
        **state, "optimizer": parts.optimizer.state_dict(),
        "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
        "rng": [r for r, _ in rngs], "augment_rng": [a for _, a in rngs],
    }, model_dir / "last.pt")
    if best is not None:
        ckpt.save_atomic(best, model_dir / "best.pt")
    pacer.pending_best = None
    pacer.last_write, pacer.write_s = time.monotonic(), time.monotonic() - t0


def _to_cpu(value: Any) -> Any:
    """`value` with every tensor in it copied to the CPU (state dicts, nested)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


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
    requested_batch = cfg.train.batch_size
    cfg = fit_batch_to_steps(cfg, len(train_split), info.world_size)
    cfg = resolve_auto(cfg, info.device, tuned)  # after the batch: the profile may have tuned knobs per batch
    batch_note = _batch_note(cfg, requested_batch)
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
    ema = ModelEmaV3(parts.model, decay=t.ema_decay) if t.ema_decay else None
    val_split = balanced_subset(open_split(prepared_dir, "val"), t.val_images, cfg.seed)
    val_loader = build_eval_loader(val_split, batch_size=max(t.batch_size, 256), rank=info.rank,
                                   world_size=info.world_size)
    val_transform = FastTransform(parts.aug, parts.mean, parts.std, train=False, channels_last=t.channels_last,
                                  seed=cfg.seed)
    fingerprint = ckpt.fingerprint(cfg, data_id)
    progress = _resume(cfg, info, parts, ema, model_dir / "last.pt", fingerprint)
    ctx, model = step_context(cfg, parts, info, parts.schedule, ema)
    live = _Live(live_dir if info.is_primary else None, resume=bool(progress.resumed_from))
    gpu = GpuUtilSampler(info.device)
    pacer = _Pacer()
    if info.is_primary:
        print(f"train[{cfg.variant}]: {cfg.model.name} init={parts.init.source} device={info.device} "
              f"x{info.world_size} image_size={cfg.data.image_size} amp={parts.amp} channels_last={t.channels_last} "
              f"compile={t.compile} "
              f"loader={t.loader} batch={parts.global_batch}{f' ({batch_note})' if batch_note else ''} "
              f"peak_lr={parts.schedule.peak_lr:.4g} images/epoch={parts.loader.sampler.n} "
              f"steps/epoch={parts.steps_per_epoch} threads={threads}", flush=True)
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
        record = _epoch_record(epoch, stats, val, info)
        if ema is not None:
            record["val_top1_ema"] = evaluate_top1(ema.module, val_loader, val_transform, info, parts.amp)["top1"]
        if epoch_hook is not None:
            record.update(epoch_hook(unwrap(model)))
        progress.history.append(record)
        improved = record["val_top1"] > progress.best_top1
        progress.best_top1 = max(progress.best_top1, record["val_top1"])
        if info.is_primary:
            live.log(epoch, {"train/loss": record["train_loss"], "val/top1": record["val_top1"],
                             "val/loss": record["val_loss"], "lr": record["lr"],
                             "epoch_time_s": record["epoch_time_s"], "throughput_img_s": record["throughput_img_s"],
                             "data_wait_frac": record["data_wait_frac"]})
            print(f"train[{cfg.variant}] epoch {epoch + 1}/{t.epochs} loss={record['train_loss']:.4f} "
                  f"val_top1={record['val_top1']:.4f} time={record['epoch_time_s']:.1f}s "
                  f"{record['throughput_img_s']:.0f} img/s data_wait={record['data_wait_frac']:.1%}", flush=True)
        _save_checkpoints(cfg, info, parts, model, ema, progress, fingerprint, epoch, improved, model_dir, pacer)
    gpu_util = gpu.stop()
    live.end()
    if not info.is_primary:
        return None
    summary = _summary(cfg, progress.history, parts.init, info, parts.amp, parts.global_batch,
                       parts.schedule.peak_lr, threads, progress.resumed_from, gpu_util, time.perf_counter() - t_start)
    summary.update(optimizer_steps=parts.schedule.total_steps, batch_note=batch_note, val_images=len(val_split),
                   calibration=calibrate_best(model_dir, val_split, info.device), stage_time_s=process_seconds())
    write_json(metrics_path, summary)
    write_json(model_dir / "config.json", cfg.to_dict())
    return summary


def _workers_fit_cores(cfg: VariantConfig, info: DistInfo) -> VariantConfig:
    """Loader workers per rank within this node's cores: the profile tunes `num_workers` for one
    process, and N ranks each starting that many would oversubscribe the node."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    if local <= 1 or cfg.train.num_workers == 0:
        return cfg
    fits = max(0, usable_cores() // local - 1)  # a core per rank stays with its training step
    if cfg.train.num_workers <= fits:
        return cfg
    if info.is_primary:
        print(f"train[{cfg.variant}]: num_workers {cfg.train.num_workers} -> {fits} per rank "
              f"({usable_cores()} cores, {local} ranks on this node)", flush=True)
    return cfg.with_train(num_workers=fits)


def _batch_note(cfg: VariantConfig, requested_batch: int) -> str:
    """Why the batch differs from train.batch_size, for the log line and train.json ('' when it doesn't)."""
    if cfg.train.batch_size == requested_batch:
        return ""
    return f"train.batch_size {requested_batch} halved to reach train.min_steps={cfg.train.min_steps}"


def _model_meta(cfg: VariantConfig, split, mean, std, amp: str) -> dict[str, Any]:
    """What evaluate/predict need to rebuild the model and its input transform."""
    return {"model_name": cfg.model.name, "num_classes": split.num_classes, "in_chans": split.channels,
            "classes": split.classes, "mean": list(mean), "std": list(std), "image_size": cfg.data.image_size,
            "amp": amp, "channels_last": cfg.train.channels_last}


def _epoch_record(epoch: int, stats, val: dict[str, float], info: DistInfo) -> dict[str, float]:
    """Per-epoch numbers reduced over ranks: images summed, time the slowest rank's."""
    images, loss_sum, wait = all_reduce_sum([stats.images, stats.loss * stats.images, stats.data_wait_s], info)
    (time_s,) = all_reduce_max([stats.time_s], info)
    return {
        "epoch": epoch + 1,
        "train_loss": loss_sum / max(images, 1),
        "val_top1": val["top1"],
        "val_top5": val["top5"],
        "val_loss": val["loss"],
        "lr": stats.lr_last,
        "epoch_time_s": time_s,
        "throughput_img_s": images / time_s if time_s else 0.0,
        "data_wait_frac": (wait / info.world_size) / time_s if time_s else 0.0,
        "step_time_median_s": statistics.median(stats.step_times) if stats.step_times else 0.0,
    }


def _summary(cfg: VariantConfig, history: list[dict], init, info: DistInfo, amp: str, global_batch: int,
             peak_lr: float, threads: int, resumed_from: int | None, gpu_util: float | None,
             wall_s: float) -> dict[str, Any]:
    epoch_times = [h["epoch_time_s"] for h in history]
    last = history[-1]
    return {
        "variant": cfg.variant,
        "epochs": len(history),
        "epoch_time_s": statistics.median(epoch_times),
        "train_time_s": sum(epoch_times),
        "throughput_img_s": statistics.median(h["throughput_img_s"] for h in history),
        "data_wait_frac": statistics.median(h["data_wait_frac"] for h in history),
        "peak_mem_mb": peak_mem_mb(info.device),
        "gpu_util": gpu_util,
        "device": str(info.device.type),
        "world_size": info.world_size,
        "threads_per_process": threads,
        "cpu": cpu_report(),
        "images_per_epoch": cfg.train.images_per_epoch,
        "init": init.source if init.source == "random" else f"{init.source}:{init.location}",
        "init_sha256": init.sha256,
        "image_size": cfg.data.image_size,
        "amp": amp,
        "math": math_mode(amp, info.device),
        "channels_last": cfg.train.channels_last,
        "compile": cfg.train.compile,
        "loader": cfg.train.loader,
        "global_batch": global_batch,
        "peak_lr": peak_lr,
        "final_train_loss": last["train_loss"],
        "final_val_top1": last["val_top1"],
        "best_val_top1": max(h["val_top1"] for h in history),
        "resumed_from_epoch": resumed_from,
        "wall_time_s": wall_s,
        "history": history,
    }

"""What a training run tells: the start line, per-epoch records (dvclive and the log) and train.json's
summary. Rank 0 alone logs and prints; the per-epoch numbers are reduced over every rank."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from cnnpipe.config import VariantConfig
from cnnpipe.hardware import cpu_report
from cnnpipe.monitor import peak_mem_mb
from cnnpipe.train.distributed import DistInfo, all_reduce_max, all_reduce_sum
from cnnpipe.train.parts import TrainingParts, decode_place
from cnnpipe.train.precision import math_mode
from cnnpipe.train.schedule import backbone_lr_scale

LIVE_KEYS = {"train/loss": "train_loss", "val/top1": "val_top1", "val/loss": "val_loss", "lr": "lr",
             "epoch_time_s": "epoch_time_s", "throughput_img_s": "throughput_img_s",
             "data_wait_frac": "data_wait_frac"}
"""dvclive metric name -> the epoch record's key it plots."""


class Live:
    """dvclive on rank 0 only; a no-op elsewhere."""

    def __init__(self, directory: Path | None, resume: bool) -> None:
        self.live = None
        if directory is not None:
            from dvclive import Live as DvcLive

            self.live = DvcLive(str(directory), resume=resume, save_dvc_exp=False, dvcyaml=None, report=None)

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


def announce(cfg: VariantConfig, info: DistInfo, parts: TrainingParts, threads: int, note: str) -> None:
    """The run's one start line: model, device, precision, loader, batch and schedule (rank 0)."""
    if not info.is_primary:
        return
    t = cfg.train
    print(f"train[{cfg.variant}]: {cfg.model.name} init={parts.init.source} device={info.device} "
          f"x{info.world_size} image_size={cfg.data.image_size} amp={parts.amp} channels_last={t.channels_last} "
          f"compile={t.compile} epochs={t.epochs} loader={t.loader} decode={decode_place(cfg, parts.split)} "
          f"malloc={t.malloc} batch={parts.global_batch}{f' ({note})' if note else ''} "
          f"peak_lr={parts.schedule.peak_lr:.4g}{_backbone_note(cfg, parts)} images/epoch={parts.loader.sampler.n} "
          f"steps/epoch={parts.steps_per_epoch} threads={threads}", flush=True)


def _backbone_note(cfg: VariantConfig, parts: TrainingParts) -> str:
    scale = backbone_lr_scale(cfg.train, parts.init.source)
    return "" if scale == 1.0 else f" (backbone x{scale:g}: {parts.init.source} start)"


def epoch_record(epoch: int, stats, val: dict[str, float], info: DistInfo) -> dict[str, float]:
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


def report_epoch(cfg: VariantConfig, info: DistInfo, live: Live, epoch: int, record: dict[str, float]) -> None:
    """One epoch's record to dvclive and the log (rank 0)."""
    if not info.is_primary:
        return
    live.log(epoch, {name: record[key] for name, key in LIVE_KEYS.items()})
    print(f"train[{cfg.variant}] epoch {epoch + 1}/{cfg.train.epochs} loss={record['train_loss']:.4f} "
          f"val_top1={record['val_top1']:.4f} time={record['epoch_time_s']:.1f}s "
          f"{record['throughput_img_s']:.0f} img/s data_wait={record['data_wait_frac']:.1%}", flush=True)


def run_summary(cfg: VariantConfig, history: list[dict], init, info: DistInfo, amp: str, global_batch: int,
                peak_lr: float, threads: int, resumed_from: int | None, gpu_util: float | None,
                wall_s: float) -> dict[str, Any]:
    """train.json's numbers: medians over the epochs, the final and best accuracy, and the run's settings."""
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
        # how a weights file was named onto the model and how many of its backbone tensors it gave (all of
        # them: parameters and running statistics), the BatchNorm counters it had, and the checkpoint entry
        "init_tensors": None if init.loaded is None else {
            "mapping": init.mapping, "loaded": init.loaded, "backbone": init.backbone, "classifier": init.classifier,
            "counters_loaded": init.counters_loaded, "counters": init.counters, "entry": init.entry},
        "image_size": cfg.data.image_size,
        "amp": amp,
        "math": math_mode(amp, info.device),
        "channels_last": cfg.train.channels_last,
        "compile": cfg.train.compile,
        "loader": cfg.train.loader,
        "malloc": cfg.train.malloc,
        "global_batch": global_batch,
        "peak_lr": peak_lr,
        "backbone_lr_scale": backbone_lr_scale(cfg.train, init.source),  # of peak_lr (schedule.backbone_lr_scale)
        "final_train_loss": last["train_loss"],
        "final_val_top1": last["val_top1"],
        "best_val_top1": max(h["val_top1"] for h in history),
        "resumed_from_epoch": resumed_from,
        "wall_time_s": wall_s,
        "history": history,
    }

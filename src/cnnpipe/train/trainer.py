"""`fit`: a training run's epoch loop over the parts `parts.build_training` builds; resuming (`resume`),
checkpoints (`pacing`) and reporting (`report`) live apart."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from cnnpipe.config import VariantConfig
from cnnpipe.data.splits.held_out import held_out_digest, open_kept
from cnnpipe.data.loaders.host import build_eval_loader
from cnnpipe.data.loaders.transforms import FastTransform
from cnnpipe.data.splits.draw import balanced_subset
from cnnpipe.data.store.shards import data_fingerprint, read_index
from cnnpipe.files import file_sha256, write_json
from cnnpipe.hardware import usable_cores
from cnnpipe.malloc import use_malloc
from cnnpipe.monitor import GpuUtilSampler
from cnnpipe.uptime import process_seconds
from cnnpipe.train import checkpoint as ckpt
from cnnpipe.train.budget import EVAL_BATCH, epochs_to_train, fit_batch_to_steps
from cnnpipe.train.distributed import DistInfo, check_same_settings, local_world_size, sync_buffers, unwrap
from cnnpipe.train.ema import ModelEma, decay_for_run
from cnnpipe.train.engine import evaluate_top1, train_one_epoch
from cnnpipe.train.pacing import Pacer, save_checkpoints
from cnnpipe.train.parts import build_training, decode_place, seed_everything, set_threads, step_context
from cnnpipe.train.recipe import input_recipe
from cnnpipe.train.report import Live, announce, epoch_record, report_epoch, run_summary
from cnnpipe.train.resume import resume
from cnnpipe.train.schedule import early_stop
from cnnpipe.train.temperature import calibrate_best
from cnnpipe.train.tuning import resolve_auto


def fit(cfg: VariantConfig, info: DistInfo, prepared_dir: Path, model_dir: Path, metrics_path: Path,
        live_dir: Path, tuned: dict[str, Any] | None = None,
        epoch_hook: Callable[[torch.nn.Module], dict[str, float]] | None = None,
        champion: Path | None = None, held_out: Path | None = None, eval_batch: int = EVAL_BATCH,
        ) -> dict[str, Any] | None:
    """Train `cfg.variant`; resume from `model_dir/last.pt` when it was made under the same params.

    `tuned` holds the profile's measured values for knobs the params leave at `auto`. `epoch_hook`
    (benchmarks) is called with the model after each epoch's validation, outside the timed epoch;
    what it returns joins that epoch's record. `held_out`: the delivery check's list; the training
    and validation photos it holds out are left out (`data.splits.held_out`). `eval_batch`: the
    per-process batch of validation and of the temperature's fit (the plan's, `budget.eval_batch`).
    """
    t_start = time.perf_counter()
    train_split, _ = open_kept(prepared_dir, "train", held_out)
    val_kept, _ = open_kept(prepared_dir, "val", held_out)
    cfg, epochs_note = epochs_to_train(cfg)  # `auto` arrives as the plan's count (apply_budget)
    if epochs_note and info.is_primary:
        print(f"train[{cfg.variant}]: {epochs_note}", flush=True)
    cfg, note = fit_batch_to_steps(cfg, len(train_split), info.world_size)
    cfg = resolve_auto(cfg, info.device, tuned)  # after the batch: the profile may have tuned knobs per batch
    data_id = data_fingerprint(prepared_dir)
    held = held_out_digest(prepared_dir, held_out, ("train", "val"))
    if held:  # other photos than the store's splits: another run, never resumed from this one's last.pt
        data_id += ":held-out:" + held
    if cfg.model.init == "champion" and champion is not None and (champion / "best.pt").exists():
        data_id += ":" + file_sha256(champion / "best.pt")[:16]  # a resume must start from the same champion
    # Before anything else: nodes that resolved different settings (or hold different data) would
    # disagree on the number of steps and wait on each other's collectives until a timeout.
    # The validation batch too: a node whose budget.yaml names another is one that missed `git pull`.
    check_same_settings({**ckpt.computed_settings(cfg, data_id), "eval_batch": eval_batch}, info,
                        cfg.train.node_rank)
    use_malloc(cfg.train.malloc)  # before the model and the loader's workers (forked ones inherit it)
    cfg = _workers_fit_cores(cfg, info)
    seed_everything(cfg.seed, info.rank)
    threads = set_threads(cfg, info)
    t = cfg.train
    if t.sync_bn and info.distributed and info.device.type != "cuda":
        raise ValueError("train.sync_bn=true needs CUDA: PyTorch's SyncBatchNorm runs on GPUs only; "
                         "set train.sync_bn: false for CPU training")
    parts = build_training(cfg, info, train_split, champion)
    ema = ModelEma(parts.model, decay_for_run(t.ema_decay, parts.schedule.total_steps)) if t.ema_decay else None
    val_split = balanced_subset(val_kept, t.val_images, cfg.seed)
    val_loader = build_eval_loader(val_split, batch_size=eval_batch, rank=info.rank, world_size=info.world_size)
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
    recipe = input_recipe(cfg.data, train_split.channels, parts.mean, parts.std)  # what serving must apply
    summary.update(decode=decode_place(cfg, train_split), epochs_planned=t.epochs,
                   stopped_early=progress.stopped_early,
                   ema_decay=ema.decay if ema is not None else None,
                   optimizer_steps=parts.schedule.total_steps, batch_note=note, val_images=len(val_split),
                   eval_batch=eval_batch,
                   calibration=calibrate_best(model_dir, val_kept, info.device, recipe,
                                              read_index(prepared_dir).get("generation"), eval_batch),
                   stage_time_s=process_seconds())
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

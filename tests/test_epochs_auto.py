"""`train.epochs: auto` in training: the plan's count reaches the run, its schedule, EMA and resume;
early stop on validation (the plan's side: tests/test_plan.py)."""

import json

import pytest
import torch
import yaml

from cnnpipe.data.store.shards import open_split
from cnnpipe.params import load_params, resolve
from cnnpipe.profile.run import profile_variant
from cnnpipe.train import engine, pacing, trainer
from cnnpipe.train.budget import apply_budget, fit_batch_to_split
from cnnpipe.train.distributed import DistInfo
from cnnpipe.train.ema import decay_for_run
from cnnpipe.train.schedule import LrSchedule, early_stop
from conftest import Stage, tiny_params, write_params


def auto_config(tmp_path, budget: dict | None = None, **train):
    """The optimized recipe with `epochs: auto` (floor 2), with the plan's `budget` applied."""
    params = tiny_params(**{"epochs": "auto", "min_epochs": 2, "max_epochs": 50, **train})
    cfg = resolve(load_params(write_params(tmp_path / "params.yaml", params)), "optimized")
    return apply_budget(cfg, budget or {})


def fit(cfg, prepared, out, **kwargs):
    return trainer.fit(cfg, DistInfo(), prepared, out / "models", out / "train.json", out / "live", **kwargs)


def test_the_schedule_and_the_ema_span_the_chosen_epoch_count(tmp_path, prepared):
    """The plan chose 3 epochs: the LR decays over exactly their steps, to its floor at the last one;
    warm-up and the EMA's horizon are sized by that run's length; train.json says the count."""
    cfg = auto_config(tmp_path, {"epochs": 3}, ema_decay=0.998)
    summary = fit(cfg, prepared, tmp_path)
    steps_per_epoch = len(open_split(prepared, "train")) // 32
    assert summary["epochs"] == summary["epochs_planned"] == 3 and summary["stopped_early"] is None
    assert summary["optimizer_steps"] == 3 * steps_per_epoch
    schedule = LrSchedule.for_run(cfg.train, len(open_split(prepared, "train")), 32, 3 * steps_per_epoch)
    for epoch, record in enumerate(summary["history"], start=1):  # each epoch's last step's LR
        assert record["lr"] == pytest.approx(schedule(epoch * steps_per_epoch - 1))
    assert schedule(schedule.total_steps) == pytest.approx(0.0)  # the cosine floor, one step past the last
    assert summary["history"][-1]["lr"] < 0.01 * schedule.peak_lr  # ...which the last step all but reaches
    assert 0 < schedule.warmup_steps <= schedule.total_steps // 2
    # 0.998 would average over ~500 steps, ten times this run: the EMA follows the run's length.
    assert summary["ema_decay"] == pytest.approx(decay_for_run(0.998, 3 * steps_per_epoch))
    assert summary["ema_decay"] == pytest.approx(1 - 5 / 48)  # 16 steps an epoch: the run spans 5 horizons
    assert decay_for_run(0.998, 100_000) == 0.998 and decay_for_run(0.9, 1) == 0.0


def test_a_resume_of_an_auto_run_keeps_its_epoch_count(tmp_path, prepared, monkeypatch, capsys):
    """Killed in epoch 2 of the 3 the plan chose, rerun with the same plan: it resumes after epoch 1 and
    ends at epoch 3 (with auto's bounds edited meanwhile); a checkpoint made for another count is not
    resumed (the count is part of what a resume checks)."""
    real = engine.train_one_epoch
    calls = {"n": 0}

    def dies_in_second_epoch(ctx, batches, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed in epoch 2")
        return real(ctx, batches, *args, **kwargs)

    monkeypatch.setattr(trainer, "train_one_epoch", dies_in_second_epoch)
    with pytest.raises(KeyboardInterrupt):
        fit(auto_config(tmp_path, {"epochs": 3}), prepared, tmp_path)
    last = torch.load(tmp_path / "models" / "last.pt", weights_only=True)
    assert last["epoch"] == 1
    monkeypatch.setattr(trainer, "train_one_epoch", real)
    summary = fit(auto_config(tmp_path, {"epochs": 3}, max_epochs=40), prepared, tmp_path)
    assert summary["resumed_from_epoch"] == 1 and summary["epochs_planned"] == 3
    assert [h["epoch"] for h in summary["history"]] == [1, 2, 3]
    assert "resuming from" in capsys.readouterr().out
    # The same run cut short again, and a plan that now chooses 4 epochs: a fresh run of 4.
    torch.save(last, tmp_path / "models" / "last.pt")
    again = fit(auto_config(tmp_path, {"epochs": 4}), prepared, tmp_path)
    assert again["resumed_from_epoch"] is None and again["epochs_planned"] == again["epochs"] == 4
    assert "NOT resuming" in capsys.readouterr().err


def test_auto_without_the_plan_s_choice_trains_the_floor(tmp_path, prepared, capsys):
    summary = fit(auto_config(tmp_path, {}), prepared, tmp_path)
    assert summary["epochs"] == summary["epochs_planned"] == 2
    assert "training train.min_epochs=2" in capsys.readouterr().out


def test_early_stop_rule():
    history = [{"val_top1": v} for v in (0.5, 0.9, 0.6, 0.9, 0.7)]
    assert early_stop(history, None) is None and early_stop([], 1) is None
    assert early_stop(history[:4], 3) is None  # epochs 3 and 4 brought nothing better: 2 of 3
    stop = early_stop(history, 3)  # a tie (epoch 4) is no improvement
    assert stop["after_epoch"] == 5 and stop["best_epoch"] == 2 and stop["best_val_top1"] == 0.9
    assert "for 3 epochs (train.patience=3)" in stop["reason"]
    assert early_stop(history + [{"val_top1": 0.91}], 3) is None  # improved at the last epoch


def test_early_stop_keeps_the_best_epoch_in_best_pt_and_says_why(tmp_path, prepared, monkeypatch, capsys):
    """Validation peaks at epoch 2 of 6 and then fails to improve for 2 epochs: training stops after
    epoch 4, with the best weights in best.pt even when checkpoint pacing had not written them yet;
    train.json and last.pt say when and why; a rerun does not resume a stopped run."""
    scores = iter([0.5, 0.9, 0.6, 0.7, 0.8, 0.95])
    monkeypatch.setattr(trainer, "evaluate_top1", lambda *a, **k: dict.fromkeys(("top1", "top5"), next(scores))
                        | {"loss": 1.0})
    monkeypatch.setattr(pacing, "CHECKPOINT_SHARE", 1e-9)  # after the first write, none until the last
    snapshots = []

    def hook(model):
        snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return {}

    cfg = auto_config(tmp_path, {"epochs": 6}, patience=2, checkpoint_every="auto")
    summary = fit(cfg, prepared, tmp_path, epoch_hook=hook)
    assert summary["epochs"] == 4 and summary["epochs_planned"] == 6 and len(snapshots) == 4
    stop = summary["stopped_early"]
    assert stop["after_epoch"] == 4 and stop["best_epoch"] == 2 and "train.patience=2" in stop["reason"]
    assert json.loads((tmp_path / "train.json").read_text())["stopped_early"] == stop
    assert "early stop after epoch 4/6" in capsys.readouterr().out
    best = torch.load(tmp_path / "models" / "best.pt", weights_only=True)
    last = torch.load(tmp_path / "models" / "last.pt", weights_only=True)
    assert best["epoch"] == 2 and last["epoch"] == 4 and last["stopped_early"] == stop
    assert all(torch.equal(best["model"][k], snapshots[1][k]) for k in snapshots[1])
    scores = iter([0.5] * 6)  # (a rerun's scores: it stops again after epoch 3)
    rerun = fit(cfg, prepared, tmp_path)
    assert rerun["resumed_from_epoch"] is None and "is a finished run" in capsys.readouterr().err


def test_a_catalog_smaller_than_the_batch_is_profiled_at_the_batch_training_halves_to(tmp_path, prepared):
    """212 photos and the optimized recipe's batch 256: no step fits an epoch, so training halves the
    batch; the profile measures the largest halving that fits instead of failing."""
    cfg = auto_config(tmp_path, {}, batch_size=256, min_steps=300)
    assert fit_batch_to_split(cfg, 212, 1).train.batch_size == 128
    assert fit_batch_to_split(cfg, 212, 2).train.batch_size == 64  # 106 images per process
    assert fit_batch_to_split(cfg, 100, 1).train.batch_size == 64  # none fits: the smallest, the loader says so
    assert fit_batch_to_split(cfg, 54_000, 1) is cfg
    assert fit_batch_to_split(cfg.with_train(images_per_epoch=200), 54_000, 1).train.batch_size == 128
    assert fit_batch_to_split(cfg, 45, 1).train.batch_size == 32  # under 64 only as far as one step needs
    fixed = cfg.with_train(min_steps=None)
    assert fit_batch_to_split(fixed, 54_000, 1) is fixed
    assert fit_batch_to_split(fixed, 212, 1).train.batch_size == 128  # whatever min_steps: training halves too
    n_train = len(open_split(prepared, "train"))
    big = auto_config(tmp_path, {}, batch_size=1024, min_steps=300)
    result = profile_variant(big, DistInfo(), prepared, tmp_path / "logs", False, time_box_s=20.0)
    assert n_train < 1024 and result["recipe_batch_size"] == 512 <= n_train


@pytest.mark.slow
def test_the_plan_stage_s_count_reaches_train_json(tmp_path, prepared, stage: Stage):
    """stages/plan.py, then stages/train.py, as dvc.yaml runs them: the plan prints the count it fitted
    (here the ceiling: a tiny model on 20 minutes), budget.yaml carries it, train.json trained it."""
    write_params(tmp_path / "params.yaml", tiny_params(epochs="auto", min_epochs=2, max_epochs=3))
    profiles = tmp_path / "metrics" / "profile"
    profiles.mkdir(parents=True)
    for variant in ("baseline", "optimized"):
        (profiles / f"{variant}.json").write_text(json.dumps(
            {"throughput_img_s": 2000.0, "inference_img_s": 8000.0, "stage_time_s": 20.0, "startup_s": 5.0}))

    def printed(*args: str) -> str:
        code, err, out = stage(tmp_path, *args, "--data", str(prepared))
        assert code == 0, err[-3000:]
        return out

    assert "Epochs: **3** (train.epochs: auto, 2 to 3)" in printed("plan.py")
    assert yaml.safe_load((tmp_path / "metrics" / "plan" / "budget.yaml").read_text())["epochs"] == 3
    assert "epochs=3" in printed("train.py", "optimized")
    train = json.loads((tmp_path / "metrics" / "optimized" / "train.json").read_text())
    assert train["epochs"] == train["epochs_planned"] == 3

"""The training engine on the CPU with a tiny timm model and tiny synthetic data."""

import errno
import json
import math
import os

import pytest
import timm
import torch
from safetensors.torch import save_file

from cnnpipe import malloc
from cnnpipe.config import ModelConfig
from cnnpipe.data.prepare import prepare_fashion_mnist
from cnnpipe.files import DiskFull
from cnnpipe.models import WeightsUnavailable, create_model
from cnnpipe.params import load_params, resolve
from cnnpipe.train import checkpoint as ckpt
from cnnpipe.train import engine, pacing, temperature, trainer
from cnnpipe.train.distributed import DistInfo
from cnnpipe.train.schedule import lr_at, warmup_steps
from conftest import eval_loader_batches, tiny_params, write_params


def run_config(tmp_path, variant="optimized", **train):
    return resolve(load_params(write_params(tmp_path / "params.yaml", tiny_params(**train))), variant)


def fit(cfg, prepared, out):
    return trainer.fit(cfg, DistInfo(), prepared, out / "models", out / "train.json", out / "live")


@pytest.mark.parametrize("variant", ["baseline", "optimized"])
def test_fit_writes_checkpoints_and_the_metrics_contract(tmp_path, prepared, variant):
    summary = fit(run_config(tmp_path, variant), prepared, tmp_path)
    for key in ("epochs", "epoch_time_s", "throughput_img_s", "data_wait_frac", "peak_mem_mb", "device",
                "world_size", "init", "gpu_util"):
        assert key in summary
    assert summary["epochs"] == 2 and summary["init"] == "random" and summary["world_size"] == 1
    assert summary["decode"] == "none"  # a raw store: nothing decoded, wherever train.decode says
    assert json.loads((tmp_path / "train.json").read_text())["epochs"] == 2
    assert (tmp_path / "models" / "last.pt").exists() and (tmp_path / "models" / "best.pt").exists()
    assert (tmp_path / "live" / "plots" / "metrics" / "val" / "top1.tsv").exists()
    # A property of any run, not of what this one learned: every epoch's loss is a finite positive number.
    assert all(math.isfinite(h["train_loss"]) and h["train_loss"] > 0 for h in summary["history"])


def test_min_steps_halves_the_batch_of_a_short_run(tmp_path, prepared):
    # 2 epochs of 256 images at batch 128 are 4 steps; min_steps 8 halves the batch to 64 (LR with it).
    cfg = run_config(tmp_path, batch_size=128, images_per_epoch=256, min_steps=8)
    summary = fit(cfg, prepared, tmp_path)
    assert summary["global_batch"] == 64 and summary["optimizer_steps"] == 8
    assert summary["peak_lr"] == pytest.approx(0.2 * 64 / 256)
    assert "halved" in summary["batch_note"] and "train.min_steps=8" in summary["batch_note"]
    (tmp_path / "plain").mkdir()
    plain = fit(run_config(tmp_path / "plain", batch_size=128, images_per_epoch=256, min_steps=None), prepared,
                tmp_path / "plain")
    assert plain["global_batch"] == 128 and plain["optimizer_steps"] == 4 and plain["batch_note"] == ""


def test_validation_and_the_temperature_run_at_the_plan_s_eval_batch(tmp_path, prepared, monkeypatch):
    """`eval_batch` (budget.yaml's, the batch the profile timed inference at) reaches both loaders
    over the validation split, and train.json names it."""
    batches = eval_loader_batches(monkeypatch, trainer, temperature)
    agreed = []  # what every node must agree on before a step (one process here: nothing to exchange)
    monkeypatch.setattr(trainer, "check_same_settings", lambda settings, *a: agreed.append(settings))
    cfg = run_config(tmp_path, epochs=1, images_per_epoch=64)
    summary = trainer.fit(cfg, DistInfo(), prepared, tmp_path / "models", tmp_path / "train.json", tmp_path / "live",
                          eval_batch=16)
    assert batches == [16, 16] and summary["eval_batch"] == 16 and agreed[0]["eval_batch"] == 16


@pytest.mark.skipif(not malloc.available(), reason="a tuned `keep` trains at system where glibc's mallopt is not")
@pytest.mark.parametrize("asked, tuned, runs", [("auto", None, "system"), ("auto", {"malloc": "keep"}, "keep"),
                                                 ("system", {"malloc": "keep"}, "system")])
def test_training_runs_under_the_allocator_its_params_or_profile_chose(tmp_path, prepared, monkeypatch,
                                                                     asked, tuned, runs):
    """`train.malloc` as resolved (the profile's winner for `auto`, else glibc's defaults) is set before
    the first step, and train.json names it."""
    chosen = []
    monkeypatch.setattr(trainer, "use_malloc", chosen.append)
    cfg = run_config(tmp_path, epochs=1, images_per_epoch=32, malloc=asked)
    summary = trainer.fit(cfg, DistInfo(), prepared, tmp_path / "models", tmp_path / "train.json", tmp_path / "live",
                          tuned=tuned)
    assert chosen == [runs] and summary["malloc"] == runs


def test_an_epoch_smaller_than_one_batch_trains_at_the_halving_that_fills_one_step(tmp_path, prepared):
    # 40 images an epoch (a small folder of photos) at the baseline's fixed batch 64: no step would fit;
    # the batch halves to 32, one step an epoch, whatever min_steps (here none).
    summary = fit(run_config(tmp_path, batch_size=64, images_per_epoch=40, min_steps=None), prepared, tmp_path)
    assert summary["global_batch"] == 32 and summary["optimizer_steps"] == 2
    assert "halved to 32: an epoch holds fewer images than one batch" in summary["batch_note"], summary["batch_note"]


def test_training_learns_the_synthetic_task(tmp_path, prepared):
    """The synthetic classes are a bright 8x5 block at one of ten places on faint noise: far apart.
    Over 6 epochs the best on 64 validation images was 0.94-1.0 on four seeds, and every epoch from
    the 2nd scored at least 0.70; by chance (p = 0.1) 33 or more of 64 right has a probability
    under 1e-15. The bound says "it learned", with a wide margin either way."""
    summary = fit(run_config(tmp_path, epochs=6), prepared, tmp_path)
    assert summary["best_val_top1"] > 0.5


def test_kill_and_resume_equals_uninterrupted(tmp_path, prepared, monkeypatch):
    cfg = run_config(tmp_path)
    fit(cfg, prepared, tmp_path / "straight")
    straight = torch.load(tmp_path / "straight" / "models" / "last.pt", weights_only=True)

    real = engine.train_one_epoch
    calls = {"n": 0, "steps": 0}

    def dies_in_second_epoch(ctx, batches, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] < 2:
            return real(ctx, batches, *args, **kwargs)

        def three_steps_then_killed():  # mid-epoch: the model has moved past last.pt when it dies
            for i, batch in enumerate(batches):
                if i == 3:
                    raise KeyboardInterrupt("killed mid-epoch")
                calls["steps"] += 1
                yield batch

        return real(ctx, three_steps_then_killed(), *args, **kwargs)

    monkeypatch.setattr(trainer, "train_one_epoch", dies_in_second_epoch)
    with pytest.raises(KeyboardInterrupt):
        fit(cfg, prepared, tmp_path / "resumed")
    assert calls["steps"] == 3  # three optimizer steps of epoch 2 ran, and are lost with the process
    assert torch.load(tmp_path / "resumed" / "models" / "last.pt", weights_only=True)["epoch"] == 1
    monkeypatch.setattr(trainer, "train_one_epoch", real)
    summary = fit(cfg, prepared, tmp_path / "resumed")
    assert summary["resumed_from_epoch"] == 1 and summary["epochs"] == 2
    resumed = torch.load(tmp_path / "resumed" / "models" / "last.pt", weights_only=True)
    for name, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name


def test_checkpoint_from_other_params_is_not_resumed(tmp_path, prepared, capsys):
    fit(run_config(tmp_path, epochs=1), prepared, tmp_path)
    summary = fit(run_config(tmp_path, epochs=1, lr=0.05), prepared, tmp_path)
    assert summary["resumed_from_epoch"] is None
    assert "NOT resuming" in capsys.readouterr().err


def test_schedule_warmup_peak_and_end():
    kw = dict(total_steps=100, peak_lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(55, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(100, **kw) == pytest.approx(0.1)
    assert lr_at(50, total_steps=100, peak_lr=0.3, kind="constant") == 0.3


def test_warmup_counts_images_not_budget_shortened_epochs():
    # 0.3 passes over 54,000 images at batch 256: 63 steps, whatever an epoch draws.
    assert warmup_steps(0.3, 54_000, 256, total_steps=844) == 63
    assert warmup_steps(0.3, 54_000, 256, total_steps=208) == 63  # 1/4 of the split per epoch
    assert warmup_steps(0.3, 54_000, 256, total_steps=52) == 26  # never more than half the run
    assert warmup_steps(0.0, 54_000, 256, total_steps=52) == 0


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_local_weights_load_through_timm_with_a_resized_head(tmp_path, suffix):
    source = timm.create_model("test_resnet", num_classes=7)
    path = tmp_path / f"weights{suffix}"
    if suffix == ".safetensors":
        save_file(source.state_dict(), str(path))
    else:
        torch.save({"model": source.state_dict()}, path)
    model, init = create_model(ModelConfig(name="test_resnet", pretrained="true", weights_file=str(path)),
                               num_classes=3, in_chans=3)
    assert init.source == "file" and len(init.sha256) == 64
    assert model.get_classifier().out_features == 3
    loaded, saved = model.state_dict(), source.state_dict()
    body = [k for k in saved if not k.startswith(("fc.", "head."))]
    assert all(torch.equal(loaded[k], saved[k]) for k in body)
    # One input channel: timm folds the RGB filters of the first conv into one.
    grey, _ = create_model(ModelConfig(name="test_resnet", pretrained="auto", weights_file=str(path)), 3, 1)
    first = next(k for k in body if k.endswith("weight") and saved[k].dim() == 4)
    assert torch.allclose(grey.state_dict()[first], saved[first].sum(dim=1, keepdim=True))


def test_pretrained_true_offline_fails_fast_with_a_remedy(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # nor this machine's torch hub cache
    with pytest.raises(WeightsUnavailable) as err:  # offline (conftest): no hub to wait on
        create_model(ModelConfig(name="resnet18", pretrained="true"), 10, 3)
    assert "model.weights_file" in str(err.value) and "not reachable" in str(err.value)
    import cnnpipe.models

    monkeypatch.setattr(cnnpipe.models, "_SAID_RANDOM", set())
    with caplog.at_level("WARNING", logger="cnnpipe.models"):
        for _ in range(3):  # the profile builds a model per trial: one warning, not three
            _, init = create_model(ModelConfig(name="resnet18", pretrained="auto"), 10, 3)
    assert init.source == "random"
    assert sum("RANDOM" in r.getMessage() for r in caplog.records) == 1


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned-by-checkpoint",))


def test_hostile_pickle_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"model": _Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ckpt.UnsafeCheckpoint, match="refused"):
        ckpt.load(tmp_path / "evil.pt")
    assert not (tmp_path / "pwned-by-checkpoint").exists()


def test_nan_loss_stops_with_a_clear_error(tmp_path, prepared, monkeypatch):
    cfg = run_config(tmp_path)
    original = torch.nn.functional.cross_entropy

    def poisoned(*args, **kwargs):
        return original(*args, **kwargs) * float("nan")

    monkeypatch.setattr(engine.F, "cross_entropy", poisoned)
    with pytest.raises(engine.NonFiniteLoss, match="loss is nan"):
        fit(cfg, prepared, tmp_path)


def test_gradient_accumulation_matches_the_larger_batch(tmp_path, prepared):
    """2 micro-batches of 16 = one batch of 32, on a BatchNorm-free model without random crops."""
    weights = []
    for name, train in (("big", dict(batch_size=32)), ("accum", dict(batch_size=16, accum_steps=2))):
        params = tiny_params(amp="off", crop_scale_min=1.0, hflip=False, epochs=1, **train)
        params["model"]["name"] = "test_nfnet"
        cfg = resolve(load_params(write_params(tmp_path / f"{name}.yaml", params)), "optimized")
        summary = fit(cfg, prepared, tmp_path / name)
        assert summary["global_batch"] == 32
        weights.append(torch.load(tmp_path / name / "models" / "last.pt", weights_only=True)["model"])
    for key in weights[0]:
        assert torch.allclose(weights[0][key], weights[1][key], rtol=1e-4, atol=1e-6), key


def test_mixup_cutmix_and_ema_train(tmp_path, prepared):
    cfg = run_config(tmp_path, mixup_alpha=0.2, cutmix_alpha=1.0, ema_decay=0.9)
    summary = fit(cfg, prepared, tmp_path)
    assert math.isfinite(summary["final_train_loss"])
    assert "val_top1_ema" in summary["history"][-1]


def test_finished_run_or_changed_data_is_never_reused(tmp_path, prepared, capsys, fake_fmnist):
    cfg = run_config(tmp_path, epochs=1)
    fit(cfg, prepared, tmp_path)
    summary = fit(cfg, prepared, tmp_path)  # e.g. `dvc repro -f`, or a code change upstream
    assert summary["resumed_from_epoch"] is None
    assert "finished run" in capsys.readouterr().err
    # An unfinished run, then the data changes under it (another seed: another split): not resumed.
    two = run_config(tmp_path, epochs=2)
    (tmp_path / "models" / "last.pt").unlink()
    real = engine.train_one_epoch
    calls = {"n": 0}

    def dies_in_second_epoch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer, "train_one_epoch", dies_in_second_epoch)
        with pytest.raises(KeyboardInterrupt):
            fit(two, prepared, tmp_path)
    assert ckpt.load(tmp_path / "models" / "last.pt")["epoch"] == 1
    other = tmp_path / "other-data"
    other.mkdir()
    prepare_fashion_mnist(resolve(tiny_params(), "optimized").data, 1, other, search_dirs=(fake_fmnist,))
    capsys.readouterr()
    summary = fit(two, other, tmp_path)
    assert summary["resumed_from_epoch"] is None and summary["epochs"] == 2
    assert "made under different params or data" in capsys.readouterr().err


@pytest.mark.parametrize("channels_last", [True, False])
def test_forward_times_runs_the_model_alone_in_eval_mode_and_restores_its_mode(channels_last):
    """What evaluate reports and the profile gives the plan: eval mode (BatchNorm's running stats
    untouched), the recipe's layout reaching the model, one untimed first call."""
    model = timm.create_model("test_resnet", num_classes=3)
    model.train()
    seen = []

    def record(module, args):
        x = args[0]
        seen.append((module.training, tuple(x.shape), x.is_contiguous(memory_format=torch.channels_last)))

    model.register_forward_pre_hook(record)
    stats = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    times = engine.forward_times(model, 3, 16, channels_last, "off", torch.device("cpu"), batch=4, calls=3)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert seen == [(False, (4, 3, 16, 16), channels_last)] * 4
    assert model.training
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in stats.items())


class _FillsUp:
    """A file that takes `room` bytes, then fails like a full disk (errno 28)."""

    def __init__(self, path, room: int):
        self.fh, self.room = open(path, "wb"), room

    def write(self, data) -> int:
        if self.fh.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.fh.write(data)

    def __getattr__(self, name):
        return getattr(self.fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()


def test_a_full_disk_is_one_clear_message_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """torch.save into a disk that fills up: one DiskFull naming the file and the space, no .tmp left,
    the previous checkpoint intact."""
    state = {"model": {"w": torch.ones(256, 256)}, "epoch": 1}
    path = tmp_path / "last.pt"
    ckpt.save_atomic(state, path)
    before = path.read_bytes()
    monkeypatch.setattr(ckpt, "open", lambda p, mode: _FillsUp(p, room=4096), raising=False)
    with pytest.raises(DiskFull) as err:
        ckpt.save_atomic({**state, "epoch": 2}, path)
    message = str(err.value)
    assert str(path) in message and "disk is full" in message
    assert f"needs about {ckpt.state_bytes(state) / 2**10:,.1f} KB" in message and "free on" in message
    assert "previous last.pt is intact" in message and "rerun" in message
    assert err.value.__cause__ is None and err.value.__suppress_context__  # one message, not two tracebacks
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"] and path.read_bytes() == before


def test_other_write_errors_pass_through_and_leave_no_temp_file(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt.torch, "save", lambda *a: (_ for _ in ()).throw(RuntimeError("not a disk problem")))
    with pytest.raises(RuntimeError, match="not a disk problem"):
        ckpt.save_atomic({"epoch": 1}, tmp_path / "last.pt")
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_writing_a_metrics_file(tmp_path, monkeypatch):
    from cnnpipe import files

    target = tmp_path / "train.json"
    files.write_json(target, {"a": 1})
    monkeypatch.setattr(files.Path, "write_bytes", lambda self, data: (_ for _ in ()).throw(
        OSError(errno.EDQUOT, "Disk quota exceeded")))
    with pytest.raises(DiskFull, match=r"train.json: the disk is full .* previous train.json is unchanged"):
        files.write_json(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 1} and not (tmp_path / "train.json.tmp").exists()


@pytest.mark.parametrize("damage", ["empty", "truncated", "not a checkpoint"])
def test_an_unreadable_last_pt_is_set_aside_and_training_starts_over(tmp_path, prepared, capsys, damage):
    """A last.pt cut short (a full disk, a killed copy) used to fail every `dvc repro` with the same
    traceback until someone found the file; now it is moved aside with a message naming it."""
    cfg = run_config(tmp_path, epochs=1)
    fit(cfg, prepared, tmp_path / "whole")
    good = (tmp_path / "whole" / "models" / "last.pt").read_bytes()
    last = tmp_path / "models" / "last.pt"
    last.parent.mkdir(parents=True)
    last.write_bytes({"empty": b"", "truncated": good[: len(good) // 2], "not a checkpoint": b"hello"}[damage])
    summary = fit(cfg, prepared, tmp_path)
    err = capsys.readouterr().err
    assert f"{last}: not a readable checkpoint" in err and "last.pt.corrupt" in err and "starts from epoch 1" in err
    assert summary["epochs"] == 1 and summary["resumed_from_epoch"] is None
    assert (tmp_path / "models" / "last.pt.corrupt").exists() and ckpt.load(last)["epoch"] == 1


def test_a_hostile_pickle_is_still_refused_not_set_aside(tmp_path):
    class Hostile:
        def __reduce__(self):
            return (print, ("this ran",))

    path = tmp_path / "last.pt"
    torch.save({"model": Hostile()}, path, pickle_protocol=2, _use_new_zipfile_serialization=True)
    with pytest.raises(ckpt.UnsafeCheckpoint):
        ckpt.load(path)
    assert path.exists()


def test_paced_checkpoints_still_keep_the_best_epochs_weights(tmp_path, prepared, monkeypatch):
    """`checkpoint_every: auto` skips writes on a fast device; the best epoch's weights must still
    reach best.pt when its epoch was not written (epoch 2 of 4 here: only 1 and 4 are)."""
    import torch

    scores = iter([0.5, 0.9, 0.6, 0.7])
    monkeypatch.setattr(trainer, "evaluate_top1", lambda *a, **k: dict.fromkeys(("top1", "top5"), next(scores))
                        | {"loss": 1.0})
    monkeypatch.setattr(pacing, "CHECKPOINT_SHARE", 1e-9)  # after the first write, none until the last
    snapshots = []

    def hook(model):
        snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return {}

    cfg = run_config(tmp_path, epochs=4, checkpoint_every="auto")
    trainer.fit(cfg, DistInfo(), prepared, tmp_path / "models", tmp_path / "train.json", tmp_path / "live",
                epoch_hook=hook)
    best = torch.load(tmp_path / "models" / "best.pt", weights_only=True)
    last = torch.load(tmp_path / "models" / "last.pt", weights_only=True)
    assert best["epoch"] == 2 and last["epoch"] == 4
    assert all(torch.equal(best["model"][k], snapshots[1][k]) for k in snapshots[1])
    assert not all(torch.equal(best["model"][k], snapshots[3][k]) for k in snapshots[3])

"""Eight GPUs on one node, without them: the schedule at world size 8, the optimizer's kernels, the
node's /dev/shm, the launcher's command line and a failure that must not be retried."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest
import torch

from cnnpipe.data.loaders import host
from cnnpipe.data.store.shards import open_split
from cnnpipe.params import resolve
from cnnpipe.plan.plan import Recipe
from cnnpipe.train import launch, parts
from cnnpipe.train.budget import fit_batch_to_steps
from cnnpipe.train.distributed import DistInfo, local_world_size
from cnnpipe.train.launch import torchrun_command
from cnnpipe.train.schedule import LrSchedule, batch_for_steps, steps_per_run
from cnnpipe.train.tuning import resolve_auto
from conftest import tiny_params

FMNIST_TRAIN = 53_979
"""Fashion-MNIST's training split as `prepare` cuts it (the rest is validation)."""


def config(**train):
    return resolve(tiny_params(**train), "optimized")


def test_eight_gpus_on_the_whole_split_take_enough_steps_to_warm_up():
    """8 x 256 on every image takes 26 steps per epoch (104 in 4 epochs, 8 of them warm-up): the
    batch halves to 64 per GPU, as it would for a budget-shortened epoch."""
    cfg = config(batch_size=256, epochs=4, lr=0.2, warmup_epochs=0.3, schedule="cosine", min_steps=300)
    batch = fit_batch_to_steps(cfg, FMNIST_TRAIN, world_size=8)[0].train.batch_size
    assert batch == batch_for_steps(256, 300, FMNIST_TRAIN, 4, world_size=8) == 64
    steps = steps_per_run(FMNIST_TRAIN, 4, batch, world_size=8)
    schedule = LrSchedule.for_run(cfg.train, FMNIST_TRAIN, batch * 8, steps)
    assert steps >= 300 and schedule.total_steps == steps
    assert schedule.warmup_steps >= 30
    assert schedule.peak_lr == pytest.approx(0.2 * 512 / 256)
    # The plan predicts the same batch for the same run.
    recipe = Recipe("optimized", 4, 2048, 1.0, 1.0, 0.0, batch_size=256, world_size=8, min_steps=300)
    assert recipe.batch_for(FMNIST_TRAIN) == 64
    # One process on the whole split already has its steps: its batch stays.
    assert batch_for_steps(256, 300, FMNIST_TRAIN, 4, world_size=1) == 256


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_optimizer_is_fused_on_cuda_and_foreach_elsewhere(optimizer):
    cfg = config(optimizer=optimizer)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    # The flags are what is checked: the model stays on the CPU (torch builds a fused optimizer there too).
    on_cuda = parts.build_optimizer(model, cfg, 0.1, torch.device("cuda", 0))
    assert on_cuda.defaults["fused"] is True and not on_cuda.defaults["foreach"]
    on_cpu = parts.build_optimizer(model, cfg, 0.1, torch.device("cpu"))
    assert on_cpu.defaults["foreach"] is True and not on_cpu.defaults["fused"]
    assert type(on_cpu) is (torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD)
    assert [g["weight_decay"] for g in on_cpu.param_groups] == [0.0, cfg.train.weight_decay]  # timm's groups


def test_local_world_size_is_torchruns_else_the_whole_world(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_world_size(DistInfo(world_size=4)) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert local_world_size(DistInfo(rank=9, world_size=16)) == 8


def fake_shm(monkeypatch, tmp_path, free_mb: int) -> None:
    monkeypatch.setattr(host, "SHM", tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(free_mb << 20, 0, free_mb << 20))


def test_dev_shm_is_sized_for_every_rank_on_the_node(monkeypatch, tmp_path):
    # 4 workers x 2 batches of 1 MB in flight, doubled while freed: 16 MB per rank.
    fake_shm(monkeypatch, tmp_path, free_mb=64)
    host.check_shared_memory(num_workers=4, batch_bytes=1 << 20, local_ranks=4)  # 64 MB: fits
    with pytest.raises(ValueError) as err:
        host.check_shared_memory(num_workers=4, batch_bytes=1 << 20, local_ranks=8)
    assert "64 MB free" in str(err.value) and "4 loader workers x 8 ranks on this node need about 128 MB" in str(
        err.value)


def test_the_trainer_sizes_dev_shm_for_torchruns_local_ranks(monkeypatch, tmp_path, prepared):
    split = open_split(prepared, "train")
    cfg = resolve_auto(config(loader="fast"), torch.device("cpu")).with_train(num_workers=2)
    one_rank = 2 * 2 * 2 * cfg.train.batch_size * split.channels * split.images.shape[1] ** 2
    fake_shm(monkeypatch, tmp_path, free_mb=-(-2 * one_rank // 2**20))  # two ranks' worth, rounded up
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    parts.build_training(cfg, DistInfo(), split)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="x 8 ranks on this node"):
        parts.build_training(cfg, DistInfo(), split)


def test_torchrun_command_has_no_empty_arguments():
    remote = config(nnodes=2, rdzv_endpoint="10.0.0.1:29400").train
    loopback = config(nnodes=2, rdzv_endpoint="127.0.0.1:29400").train
    for t in (remote, loopback, config(nproc=8).train):
        cmd = torchrun_command(t, "stages/train.py", ["optimized"], run_id="x")
        assert all(cmd) and cmd[-2:] == ["stages/train.py", "optimized"]
    assert "--local_addr=127.0.0.1" in torchrun_command(loopback, "s.py", [], run_id="x")
    assert not any("local_addr" in c for c in torchrun_command(remote, "s.py", [], run_id="x"))


def test_gpu_workers_are_bound_to_their_numa_node_where_numactl_exists(monkeypatch):
    import cnnpipe.train.launch as launch

    eight = config(nproc=8).train
    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launch.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert "--numa-binding=node" in torchrun_command(eight, "s.py", [], run_id="x")
    assert "--numa-binding=node" not in torchrun_command(config(nproc=8, device="cpu").train, "s.py", [], run_id="x")
    monkeypatch.setattr(launch.shutil, "which", lambda name: None)  # torchrun binds through numactl
    assert "--numa-binding=node" not in torchrun_command(eight, "s.py", [], run_id="x")
    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: False)
    assert "--numa-binding=node" not in torchrun_command(eight, "s.py", [], run_id="x")


def test_a_failure_no_restart_can_fix_ends_the_group_cleanly_and_leaves_one_message(monkeypatch, tmp_path, capsys):
    stop = tmp_path / "no-restart"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(launch.NO_RESTART_FILE, str(stop))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launch.stop_without_restart("the nodes disagree") == 0 and not stop.exists()  # local rank 0 writes
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert launch.stop_without_restart("the nodes disagree") == 0
    assert stop.read_text() == "the nodes disagree\n" and capsys.readouterr().err == ""
    monkeypatch.delenv(launch.NO_RESTART_FILE)  # torchrun started by hand: no launcher reads a file
    assert launch.stop_without_restart("the nodes disagree") == 2
    assert "the nodes disagree" in capsys.readouterr().err

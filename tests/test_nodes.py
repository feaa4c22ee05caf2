"""The multi-node rules without processes: what nodes must agree on, launch, resume, resources, plan."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest
import torch

from cnnpipe.config import LAUNCH_ONLY
from cnnpipe.data.loaders import host
from cnnpipe.data.loaders.transforms import AugmentConfig, FastTransform
from cnnpipe.params import resolve
from cnnpipe.plan.scaling import CPU_SHARED_CORES, DDP_EFFICIENCY, world_scaling
from cnnpipe.train import checkpoint as ckpt
from cnnpipe.train import distributed, trainer
from cnnpipe.train.distributed import ConfigMismatch, DistInfo
from cnnpipe.train.launch import torchrun_command
from conftest import tiny_params


def config(**train):
    return resolve(tiny_params(**train), "optimized")


def test_launch_only_keys_leave_the_fingerprint_and_the_world_size_does_not():
    base = ckpt.fingerprint(config(nnodes=2), "data")
    for key, value in {"node_rank": 1, "rdzv_endpoint": "10.0.0.9:29500", "max_restarts": 0,
                       "join_timeout_s": 5, "threads": 3, "num_workers": 2}.items():
        assert ckpt.fingerprint(config(nnodes=2, **{key: value}), "data") == base, key
    assert set(LAUNCH_ONLY) <= {k for _, k in ckpt.RESUME_NEUTRAL}
    assert ckpt.fingerprint(config(nnodes=2, lr=0.1), "data") != base
    assert ckpt.fingerprint(config(nnodes=2, nproc=2), "data") != base  # another global batch
    assert ckpt.fingerprint(config(nnodes=2), "other data") != base


def test_every_node_names_each_key_the_nodes_disagree_on(monkeypatch):
    mine = ckpt.computed_settings(config(nnodes=2), "abc")
    theirs = {**ckpt.computed_settings(config(nnodes=2, lr=0.1), "abc"), "data_fingerprint": "def"}
    gathered = [(0, "gpu01", mine), (1, "gpu02", theirs)]
    monkeypatch.setattr(distributed, "all_gather_objects", lambda obj, info: gathered)
    info = DistInfo(rank=1, world_size=2)
    with pytest.raises(ConfigMismatch) as err:
        distributed.check_same_settings(theirs, info, node=1)
    message = str(err.value)
    assert "disagree on data_fingerprint, train.lr" in message
    assert "0.2 on node 0 (gpu01), 0.1 on node 1 (gpu02)" in message and "dvc pull" in message
    gathered[1] = (1, "gpu02", mine)
    distributed.check_same_settings(mine, info, node=1)  # agreeing nodes pass


def test_the_primary_rank_is_node_zeros_first_process_wherever_the_rendezvous_put_it():
    assert DistInfo(rank=3, world_size=4, primary_rank=3).is_primary
    assert not DistInfo(rank=0, world_size=4, primary_rank=3).is_primary


def test_torchrun_uses_c10d_with_restarts_and_a_join_timeout_across_nodes():
    t = config(nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400", max_restarts=2, join_timeout_s=60).train
    cmd = torchrun_command(t, "stages/train.py", ["optimized"], run_id="cnnpipe-optimized")
    assert "--rdzv_backend=c10d" in cmd and "--rdzv_endpoint=10.0.0.1:29400" in cmd
    assert "--max_restarts=2" in cmd and "--rdzv_id=cnnpipe-optimized" in cmd
    assert "--rdzv_conf=join_timeout=60,is_host=false" in cmd and not any("local_addr" in c for c in cmd)
    one = torchrun_command(config(nproc=2).train, "stages/train.py", [], run_id="x")
    assert "--standalone" in one and "--max_restarts=3" in one


def test_a_small_dev_shm_stops_before_training_with_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setattr(host, "SHM", tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 20, 0, 64 << 20))
    with pytest.raises(ValueError) as err:
        host.check_shared_memory(num_workers=4, batch_bytes=256 * 3 * 224 * 224 * 4)
    assert all(s in str(err.value) for s in ("64 MB free", "--ipc=host", "--shm-size", "train.num_workers: 0"))
    host.check_shared_memory(num_workers=0, batch_bytes=10**12)  # no workers, nothing in /dev/shm
    host.check_shared_memory(num_workers=2, batch_bytes=1 << 20)  # fits


def test_loader_workers_per_rank_fit_the_node(monkeypatch):
    monkeypatch.setattr(trainer, "usable_cores", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = config(num_workers=6)
    assert trainer._workers_fit_cores(cfg, DistInfo(rank=0, world_size=8)).train.num_workers == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert trainer._workers_fit_cores(cfg, DistInfo()).train.num_workers == 6


def test_the_plan_scales_the_profiled_speed_to_the_world_size():
    assert world_scaling("cpu", 1, 1) == (1.0, "one process")
    factor, how = world_scaling("cpu", 2, 1)
    assert factor == CPU_SHARED_CORES and "share each node's cores" in how
    factor, how = world_scaling("cuda", 8, 2)
    assert factor == pytest.approx(8 * DDP_EFFICIENCY * 2 * DDP_EFFICIENCY) and "8 GPUs x 2 node(s)" in how


def test_gpu_rng_states_go_to_this_gpu_or_are_dropped_on_a_cpu():
    state = ckpt.rng_state(torch.device("cpu"))
    assert "cuda" not in state
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    saved = ckpt.rng_state()
    ckpt.set_rng_state({**saved, "cuda": torch.zeros(16, dtype=torch.uint8)}, torch.device("cpu"))
    assert torch.equal(torch.rand(3), expected)  # the GPU state was dropped, the CPU one restored
    ckpt.set_rng_state({**saved, "cuda": [torch.zeros(16, dtype=torch.uint8)] * 8}, torch.device("cpu"))


def test_the_augmentation_rng_of_a_gpu_run_is_reseeded_on_a_cpu():
    transform = FastTransform(AugmentConfig(28), (0.5,), (0.25,), train=True, channels_last=False,
                                      seed=0)
    cpu_state = torch.Generator().get_state()
    assert transform.load_state({"cpu": cpu_state}, torch.device("cpu"))
    assert not transform.load_state({"cuda:3": cpu_state}, torch.device("cpu"))

"""CUDA-only checks: skipped (never silently passed) on machines without a GPU."""

import statistics

import pytest
import torch

from cnnpipe.data.store.shards import open_split
from cnnpipe.monitor import GpuUtilSampler
from cnnpipe.params import load_params, resolve
from cnnpipe.profile.box import TraceSteps
from cnnpipe.profile.diagnosis import Facts, diagnose
from cnnpipe.profile.measure import build_setup, timed_steps, trace_window
from cnnpipe.profile.run import profile_variant
from cnnpipe.train.distributed import DistInfo
from cnnpipe.train.precision import grad_scaler, resolve_amp
from conftest import tiny_params, write_params

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def cuda_config(tmp_path, **train):
    params = tiny_params(device="cuda", pin_memory=True, **train)
    return resolve(load_params(write_params(tmp_path / "params.yaml", params)), "optimized")


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_and_channels_last_train_on_cuda(tmp_path, prepared, amp):
    info = DistInfo(device=torch.device("cuda", 0))
    s = build_setup(cuda_config(tmp_path, amp=amp, channels_last=True), info, open_split(prepared, "train"))
    assert (grad_scaler(amp, info.device) is not None) == (amp == "fp16")
    times, totals, _, _ = timed_steps(s, warmup=2, steps=3)
    assert all(t > 0 for t in times) and totals["forward"] > 0
    assert next(s.ctx.model.parameters()).device.type == "cuda"


def test_auto_amp_on_cuda_prefers_bf16_on_ampere_or_newer():
    major, _ = torch.cuda.get_device_capability()
    assert resolve_amp("auto", torch.device("cuda", 0)) == ("bf16" if major >= 8 else "fp16")


def test_profile_on_cuda_reports_memory_headroom_busy_time_and_tensor_cores(tmp_path, prepared):
    info = DistInfo(device=torch.device("cuda", 0))
    result = profile_variant(cuda_config(tmp_path, amp="bf16"), info, prepared, tmp_path / "trace", False)
    assert 0 < result["memory_frac"] < 1
    assert 0 < result["gpu_busy_frac"] <= 1
    assert result["tensor_core_frac"] is not None and result["tensor_core_frac"] > 0.5  # bf16 convs use them


def test_item_every_step_is_host_sync_on_cuda(tmp_path, prepared):
    """The scenario the CPU can only count: here each `.item()` drains the GPU's launch queue."""
    from test_profile import ItemEveryStep

    info = DistInfo(device=torch.device("cuda", 0))
    s = build_setup(cuda_config(tmp_path, amp="bf16"), info, open_split(prepared, "train"))
    s.ctx.model = ItemEveryStep(s.ctx.model)
    step_s = statistics.median(timed_steps(s, warmup=1, steps=3)[0])
    traced = trace_window(s, tmp_path / "trace", "synced", TraceSteps(1, 2, 4), step_s)
    assert traced["host_syncs_per_step"] >= 1
    facts = Facts(fractions={"forward": 0.5, "backward": 0.5}, device="cuda", amp="bf16", channels_last=True,
                  host_syncs_per_step=traced["host_syncs_per_step"], utilization=traced["gpu_busy_frac"])
    assert traced["gpu_busy_frac"] < 0.9 and diagnose(facts)[0] == "host_sync"  # a tiny model leaves it idle


def test_nvml_utilisation_is_sampled():
    sampler = GpuUtilSampler(torch.device("cuda", 0), interval_s=0.05)
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(50):
        x = x @ x
        x = x / x.norm()
    torch.cuda.synchronize()
    util = sampler.stop()
    assert util is None or 0 <= util <= 100

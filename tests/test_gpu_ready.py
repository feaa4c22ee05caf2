"""What would be wrong on CUDA, shown on the CPU: the trials' clock, timing without waits, one
all-reduce per accumulation window, per-device constants, NVML by UUID, and the device facts."""

import socket
import sys
import types
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cnnpipe.data.loaders.transforms import AugmentConfig, FastTransform, mean_std_on
from cnnpipe.data.store.shards import open_split
from cnnpipe.params import load_params, resolve
from cnnpipe.plan.plan import EXPORT_S, Recipe, recipe_from_profile, stage_seconds
from cnnpipe.profile import clock as clock_mod
from cnnpipe.profile.clock import MIN_WINDOW_S, SHARE_OF_TRAINING, TrialClock, block_steps, trial_window
from cnnpipe.profile.run import profile_variant
from cnnpipe.profile.trials import candidates
from cnnpipe.train import distributed as distributed_mod
from cnnpipe.train import precision
from cnnpipe.train.distributed import DistInfo
from cnnpipe.train.engine import StepContext, forward_times, micro_step
from cnnpipe.train.schedule import batch_for_steps
from cnnpipe.train.pacing import Pacer
from conftest import tiny_params, write_params


def config(tmp_path, variant="optimized", **train):
    return resolve(load_params(write_params(tmp_path / "params.yaml", tiny_params(**train))), variant)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------------------------------- the trials' clock
def test_the_trial_window_is_the_budgets_rest_or_a_fifth_of_the_training_never_under_the_floor():
    assert trial_window(None, 5.0) is None  # no budget: no window
    assert trial_window(60.0, 3000.0) == 60.0  # the budget's rest binds
    assert trial_window(600.0, 1000.0) == pytest.approx(SHARE_OF_TRAINING * 1000.0)
    # a training of seconds (an H200 on the default data) still gets the floor for its trials
    assert trial_window(600.0, 10.0) == MIN_WINDOW_S
    assert trial_window(-5.0, 1000.0) == 0.0  # the box is already spent


def test_a_trial_starts_only_when_one_as_long_as_the_longest_still_fits():
    now = FakeClock()
    clock = TrialClock(30.0, block=2, trial_s=10.0, now=now)
    assert not clock.out_of_time()  # 0 + 10 <= 30
    with clock.timing():
        now.t += 14.0  # longer than estimated: the next one is expected to take as long
    assert clock.trial_s == 14.0 and not clock.out_of_time()  # 14 + 14 <= 30
    with clock.timing():
        now.t += 5.0
    assert clock.trial_s == 14.0 and clock.out_of_time()  # 19 + 14 > 30: the stage ends in its box
    assert not TrialClock(None, now=now).out_of_time()


def test_blocks_are_sized_by_time_not_step_count():
    assert block_steps(1.0, 2) == 2  # a CPU step: two steps already last long enough
    assert block_steps(0.012, 2) == 34  # an H200 step at 32 px: two would last 25 ms, inside its jitter
    assert block_steps(0.012, 2) * 0.012 >= clock_mod.MIN_BLOCK_S


def test_a_slow_start_leaves_the_trials_their_window(monkeypatch, tmp_path, prepared):
    """The window counts from the end of the base measurement: a start-up that took 500 s (imports on
    a cold disk, on a fake clock here) no longer spends the trials' time, and a training of seconds
    still has its recommended trials measured."""
    import cnnpipe.profile.run as run_mod

    monkeypatch.setattr(run_mod, "process_seconds", lambda: 500.0)
    result = profile_variant(config(tmp_path), DistInfo(), prepared, tmp_path / "logs", True, time_box_s=1000.0)
    assert result["trial_window_s"] >= MIN_WINDOW_S
    assert any(t["speedup"] for t in result["trials"])
    assert result["startup_s"] == 500.0 and result["export_img_s"] > 0  # the plan's per-machine constants
    spent = profile_variant(config(tmp_path), DistInfo(), prepared, tmp_path / "logs2", True, time_box_s=400.0)
    assert spent["trial_window_s"] == 0.0 and not any(t["speedup"] for t in spent["trials"])
    assert spent["smaller_batches"] or spent["throughput_img_s"] > 0  # what the plan needs is still measured


def test_the_diagnosis_picks_are_tried_first_and_cuda_tries_cuda_graphs(tmp_path):
    from cnnpipe.train.tuning import resolve_auto

    params = tiny_params()
    params["train"]["compile"] = "auto"
    requested = resolve(load_params(write_params(tmp_path / "auto_compile.yaml", params)), "optimized")
    current = resolve_auto(requested, torch.device("cpu"))
    order = [k for k, _ in candidates(current, requested, torch.device("cpu"), ["loader", "amp"])]
    assert order[:2] == ["loader", "amp"]  # an input-bound step: the loader before the compute knobs
    compile_on = {"cuda": [], "cpu": []}
    for kind in compile_on:
        compile_on[kind] = [c["compile"] for k, c in candidates(current, requested, torch.device(kind), set())
                            if k == "compile"]
    assert compile_on == {"cuda": ["default", "reduce-overhead"], "cpu": ["default"]}


# ---------------------------------------------------------------------------------------- timing without waits
def test_timed_steps_wait_for_the_device_once_not_per_region(monkeypatch, tmp_path, prepared):
    """Region timers used to wait for the GPU before and after every region (~12 waits a step),
    serialising host and device; now the waits are one before the window and one to read it."""
    import cnnpipe.profile.measure as measure_mod
    import cnnpipe.train.engine as engine_mod
    from cnnpipe.profile.measure import build_setup, timed_steps

    waits = []
    monkeypatch.setattr(measure_mod, "sync_device", lambda d: waits.append(d))
    monkeypatch.setattr(engine_mod, "sync_device", lambda d: waits.append(d))
    s = build_setup(config(tmp_path), DistInfo(), open_split(prepared, "train"))
    times, totals, _, _ = timed_steps(s, warmup=1, steps=4)
    assert len(times) == 4 and totals["forward"] > 0
    assert len(waits) <= 2


def test_inference_is_timed_on_random_images_not_zeros():
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(x.abs().sum().item())
            return x.mean(dim=(2, 3))

    forward_times(Probe(), 3, 8, False, "off", torch.device("cpu"), batch=4, calls=1)
    assert seen and all(v > 0 for v in seen)


def test_mean_and_std_reach_the_device_once_not_every_batch():
    """Built per batch they are two blocking host-to-device copies every GPU step, which the
    diagnosis then reported as host syncs in the user's code."""
    mean_std_on.cache_clear()
    transform = FastTransform(AugmentConfig(16), (0.5,), (0.25,), train=True, channels_last=False, seed=0)
    images = torch.randint(0, 255, (4, 16, 16, 1), dtype=torch.uint8)
    for _ in range(5):
        transform(images)
    assert mean_std_on.cache_info().misses == 1 and mean_std_on.cache_info().hits == 4


# ---------------------------------------------------------------------------------------- one all-reduce per window
def _count_allreduces(rank: int, port: int, accum: int, queue) -> None:
    try:
        queue.put((rank, _all_reduces(rank, port, accum)))
    except Exception as exc:  # the test reads it instead of waiting for a count that never comes
        queue.put((rank, repr(exc)))


def _all_reduces(rank: int, port: int, accum: int) -> int:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3)))
    calls = []

    def hook(state, bucket):
        calls.append(1)
        return allreduce_hook(state, bucket)

    model.register_comm_hook(dist.group.WORLD, hook)
    ctx = StepContext(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), "off",
                      accum_steps=accum)
    for step in range(2):
        for micro in range(accum):
            images, labels = torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,))
            micro_step(ctx, images, labels, lambda x: x, step, micro == 0, micro == accum - 1)
    dist.destroy_process_group()
    return len(calls)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("accum", [1, 2])
def test_gradient_accumulation_all_reduces_once_per_optimizer_step(accum):
    """DDP arms its all-reduce in the forward pass, so `no_sync` must cover forward and backward of
    every micro-batch but the window's last; covering the backward alone all-reduced them all."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_count_allreduces, args=(r, port, accum, queue)) for r in range(2)]
    for p in procs:
        p.start()
    counts = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert counts == {0: 2, 1: 2}  # one bucket, two optimizer steps: two all-reduces whatever `accum`


# ---------------------------------------------------------------------------------------- per-device facts
def test_emulated_bf16_is_not_fast_bf16(monkeypatch):
    """torch.cuda.is_bf16_supported() says yes on a T4 or V100 (emulated, slower than fp16)."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert precision.resolve_amp("auto", cuda) == "fp16"
    assert precision.math_mode("off", cuda) == "fp32"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert precision.resolve_amp("auto", cuda) == "bf16"
    assert "TF32" in precision.math_mode("off", cuda)  # an Ampere+ "fp32" baseline, said as it runs


def test_the_cudnn_autotuner_is_on_for_cuda_only(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    precision.use_cudnn_autotuner(torch.device("cpu"))
    assert torch.backends.cudnn.benchmark is False
    precision.use_cudnn_autotuner(torch.device("cuda", 0))
    assert torch.backends.cudnn.benchmark is True


def test_device_auto_says_why_it_falls_back_when_gpus_are_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(distributed_mod, "nvidia_gpus_present", lambda: True)
    with pytest.warns(UserWarning, match="falls back to the CPU"):
        assert distributed_mod.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="cannot use the GPUs|CPU-only build"):
        distributed_mod.resolve_device("cuda")
    monkeypatch.setattr(distributed_mod, "nvidia_gpus_present", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert distributed_mod.resolve_device("auto") == torch.device("cpu")  # a plain CPU machine: silent


def test_gpu_utilisation_reads_the_gpu_torch_uses_under_cuda_visible_devices(monkeypatch):
    """CUDA_VISIBLE_DEVICES=3 makes NVML's GPU 3 torch's cuda:0: the sampler must find it by UUID."""
    from cnnpipe import monitor

    asked = []
    fake = types.ModuleType("pynvml")
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetHandleByIndex = lambda i: asked.append(("index", i)) or f"gpu{i}"
    fake.nvmlDeviceGetHandleByUUID = lambda u: asked.append(("uuid", u)) or "gpu3"
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=77 if h == "gpu3" else 5)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    props = types.SimpleNamespace(uuid="5f1c2a9e-0000-4000-8000-000000000003")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    sampler = monitor.GpuUtilSampler(torch.device("cuda", 0), interval_s=0.01)
    import time

    time.sleep(0.1)
    assert sampler.stop() == 77
    assert asked == [("uuid", "GPU-5f1c2a9e-0000-4000-8000-000000000003")]


def test_the_plan_takes_start_up_and_export_speed_from_the_devices_profile(tmp_path):
    """A GPU's profile measures its own start-up and the CPU fp32 speed export checks at; the plan
    no longer predicts export's CPU parity check at the GPU's inference speed."""
    cfg = config(tmp_path)
    profile = {"throughput_img_s": 5000.0, "inference_img_s": 20000.0, "stage_time_s": 40.0, "device": "cuda",
               "amp": "bf16", "startup_s": 20.0, "export_img_s": 100.0}
    r = recipe_from_profile(cfg, profile)
    stages = stage_seconds(r, 1000, 100, 1000, 1000)
    assert stages["export@optimized"] == pytest.approx(3 * 1000 / 100.0 + EXPORT_S + 20.0)
    assert stages["evaluate@optimized"] == pytest.approx(1000 / 20000 + 6 * 256 / 20000 + 20.0)
    old = Recipe("optimized", 1, 32, 5000.0, 20000.0, 40.0)  # a profile from before: the stated constants
    assert stage_seconds(old, 1000, 100, 1000, 1000)["export@optimized"] < 20


def test_min_steps_halves_the_per_gpu_batch_whatever_the_epoch_draws():
    """Eight GPUs at batch 256 would take ~27 steps per epoch of Fashion-MNIST: the per-GPU batch is
    halved to reach train.min_steps, as a budget-shortened epoch's is."""
    assert batch_for_steps(256, 300, 54_000, 4, world_size=8) == 64
    assert batch_for_steps(256, 300, 6_750, 4, world_size=1) == 64
    assert batch_for_steps(256, 300, 54_000, 4, world_size=1) == 256  # 840 steps: kept


def test_auto_checkpoints_are_paced_to_a_small_share_of_training(monkeypatch):
    import cnnpipe.train.pacing as pacing

    now = FakeClock()
    monkeypatch.setattr(pacing.time, "monotonic", now)
    pacer = Pacer(last_write=now.t)
    assert pacer.due("auto", 0, final=False)  # nothing written yet
    pacer.last_write, pacer.write_s = now.t, 1.0  # a 1 s write (285 MB, fsynced)
    now.t += 2.0  # a 2 s epoch on a GPU
    assert not pacer.due("auto", 1, final=False) and pacer.due("auto", 1, final=True)
    now.t += 1.0 / pacing.CHECKPOINT_SHARE
    assert pacer.due("auto", 2, final=False)
    assert pacer.due(1, 1, final=False) and not pacer.due(2, 0, final=False)  # every N epochs: as asked


# ---------------------------------------------------------------------------------------- the GPU workload
def test_image_size_auto_is_the_store_on_a_cpu_and_the_models_own_size_on_a_gpu(monkeypatch, tmp_path):
    """At the store's 32 px an H200 is launch-bound and shows none of the recipes' differences."""
    from cnnpipe.config import DataConfig
    from cnnpipe.train.tuning import GPU_IMAGE_SIZE, image_size_for, resolve_auto

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert image_size_for(DataConfig(stored_size=32), cpu) == 32
    assert image_size_for(DataConfig(stored_size=32), cuda) == GPU_IMAGE_SIZE == 224
    assert image_size_for(DataConfig(stored_size=512), cuda) == 512  # a bigger store is used as it is
    assert image_size_for(DataConfig(image_size=28, stored_size=32), cuda) == 28  # explicit values stand
    params = tiny_params()
    params["data"]["image_size"] = "auto"
    cfg = resolve(load_params(write_params(tmp_path / "auto.yaml", params)), "optimized")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert resolve_auto(cfg, cuda).data.image_size == 160  # test_resnet's pretrained input size
    assert resolve_auto(cfg, cpu).data.image_size == cfg.data.stored_size
    assert image_size_for(DataConfig(stored_size=32), cuda, "resnet50") == 224  # the model's own input size
    assert image_size_for(DataConfig(stored_size=32), cuda, "vit_base_patch16_384") == 384


def test_a_store_smaller_than_the_model_input_is_upsampled_per_batch(tmp_path, prepared):
    """The fast loader upsamples on the device, the baseline's PIL path per sample: both train."""
    import dataclasses

    from cnnpipe.profile.measure import build_setup, timed_steps

    for variant in ("optimized", "baseline"):
        cfg = config(tmp_path, variant)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, image_size=2 * cfg.data.stored_size))
        s = build_setup(cfg, DistInfo(), open_split(prepared, "train"))
        images, _ = s.next_batch()
        x = s.loader.device_transform(images)
        assert x.shape[-2:] == (2 * cfg.data.stored_size,) * 2
        times, _, _, _ = timed_steps(s, warmup=0, steps=1)
        assert times[0] > 0

"""The profiler: scenarios with a known bottleneck, the trace, and the real TensorBoard plugin."""

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from cnnpipe.config import load_params, resolve
from cnnpipe.data.loaders import TrainLoader, ShardSampler
from cnnpipe.data.prepare import prepare_fashion_mnist
from cnnpipe.diagnosis import Facts, diagnose
from cnnpipe.distributed import DistInfo
from cnnpipe.profiling import build_setup, fractions, profile_variant, timed_steps
from cnnpipe.profile_report import write_report

from conftest import tiny_params, write_params


@pytest.fixture(scope="module")
def prepared(fake_fmnist, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    prepare_fashion_mnist(resolve(tiny_params(), "optimized").data, 0, out, search_dirs=(fake_fmnist,))
    return out


def config(tmp_path, variant="optimized", model=None, **train):
    params = tiny_params(**train)
    if model:
        params["model"]["name"] = model
    return resolve(load_params(write_params(tmp_path / "params.yaml", params)), variant)


def label_of(cfg, prepared, setup_hook=None, batch_gain=None):
    s = build_setup(cfg, DistInfo(), prepared)
    if setup_hook:
        setup_hook(s)
    _, totals, util = timed_steps(s, warmup=1, steps=3)
    t = s.cfg.train
    facts = Facts(fractions=fractions(totals), amp=s.amp, channels_last=t.channels_last, loader=t.loader,
                  batch_size=t.batch_size, utilization=util, batch_gain=batch_gain)
    return diagnose(facts)[0], fractions(totals)


class SleepyDataset(Dataset):
    """A data set that takes 20 ms per sample: the classic input-bound pipeline."""

    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        time.sleep(0.02)
        return torch.zeros(28, 28, 1, dtype=torch.uint8), 0


def test_sleeping_dataset_is_input_bound(tmp_path, prepared):
    def slow_loader(s):
        sampler = ShardSampler(10_000, 16, shuffle=False, drop_last=True)
        s.loader = TrainLoader(DataLoader(SleepyDataset(), batch_size=16), sampler, s.loader.device_transform)
        s._iter = None

    label, fr = label_of(config(tmp_path, batch_size=16), prepared, slow_loader)
    assert label == "input" and fr["data_wait"] > 0.5


def test_fast_loader_fp32_model_is_compute_bound(tmp_path, prepared):
    label, fr = label_of(config(tmp_path, model="resnet18", amp="off", batch_size=32), prepared)
    assert label == "compute"
    assert fr["forward"] + fr["backward"] + fr["optimizer"] > 0.8


def test_tiny_batch_on_a_large_model_is_small_batch(tmp_path, prepared):
    cfg = config(tmp_path, model="resnet18", batch_size=2)
    s1 = build_setup(cfg, DistInfo(), prepared)
    t1 = min(timed_steps(s1, 1, 3)[0])
    cfg2 = config(tmp_path, model="resnet18", batch_size=4)
    t2 = min(timed_steps(build_setup(cfg2, DistInfo(), prepared), 1, 3)[0])
    gain = (4 / t2) / (2 / t1)
    label, _ = label_of(cfg, prepared, batch_gain=gain)
    assert gain > 1.15 and label == "small_batch"


def test_profile_variant_writes_a_trace_and_a_complete_breakdown(tmp_path, prepared):
    result = profile_variant(config(tmp_path), DistInfo(), prepared, tmp_path / "logs" / "optimized", True)
    assert sum(result["fractions"].values()) == pytest.approx(1.0)
    traces = list((tmp_path / "logs" / "optimized").glob("*.pt.trace.json"))
    assert len(traces) == 1 and traces[0].name.startswith("optimized_rank0")
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"forward", "backward", "optimizer", "data_wait"} <= names
    assert any(n and n.startswith("ProfilerStep#") for n in names)
    assert {t["knob"] for t in result["trials"]} == {"amp", "channels_last", "batch_size", "loader", "num_workers"}
    assert set(result["tuned"]) == {"amp", "channels_last", "loader", "num_workers"}  # the `auto` knobs
    (tmp_path / "m").mkdir()
    result.pop("tuned")
    (tmp_path / "m" / "optimized.json").write_text(json.dumps(result))
    report = write_report(tmp_path / "m", ["optimized"]).read_text()
    assert "bottleneck" in report and (tmp_path / "m" / "breakdown.png").stat().st_size > 1000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def test_tensorboard_profiler_plugin_lists_the_run(tmp_path, prepared):
    logdir = tmp_path / "logs"
    profile_variant(config(tmp_path), DistInfo(), prepared, logdir / "optimized", False)
    port = _free_port()
    tb = Path(sys.executable).with_name("tensorboard")
    proc = subprocess.Popen([str(tb), "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler"
    try:
        deadline = time.monotonic() + 120
        runs = {"runs": [], "loading": True}
        while time.monotonic() < deadline:
            try:
                runs = _get(f"{base}/runs")
                if "optimized" in runs["runs"] and not runs["loading"]:
                    break
            except OSError:
                pass
            time.sleep(1)
        assert "optimized" in runs["runs"], runs
        views = _get(f"{base}/views?run=optimized")
        assert "Overview" in views
        workers = _get(f"{base}/workers?run=optimized&view=Overview")
        assert any(w.startswith("optimized_rank0") for w in workers)
    finally:
        proc.terminate()
        proc.wait(timeout=20)

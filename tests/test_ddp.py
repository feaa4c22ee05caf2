"""DDP through the real torchrun: 2 processes on one node, and 2 nodes on 127.0.0.1 (gloo, CPU)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, tiny_params, write_params

pytestmark = pytest.mark.slow
TRAIN = str(ROOT / "stages" / "train.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deterministic_params(**train):
    """A BatchNorm-free model, fp32, no random crops: 1 process and 2 must then agree."""
    params = tiny_params(amp="off", crop_scale_min=1.0, hflip=False, epochs=1, **train)
    params["model"]["name"] = "test_nfnet"
    return params


def train(tmp_path: Path, name: str, params: dict, prepared: Path, extra_env=None, args=()) -> subprocess.Popen:
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    param_file = write_params(out / "params.yaml", params)
    env = dict(os.environ, OMP_NUM_THREADS="1", **(extra_env or {}))
    return subprocess.Popen([sys.executable, TRAIN, "optimized", "--params", str(param_file), "--data", str(prepared),
                             "--models", str(out / "models"), "--metrics", str(out / "metrics"), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-4000:]
    return output


def test_two_processes_match_one_at_the_same_global_batch(tmp_path, prepared):
    finish(train(tmp_path, "one", deterministic_params(batch_size=32), prepared))
    two = finish(train(tmp_path, "two", deterministic_params(batch_size=16, nproc=2), prepared))
    assert "torch.distributed.run" in two and "x2" in two
    m1 = json.loads((tmp_path / "one" / "metrics" / "optimized" / "train.json").read_text())
    m2 = json.loads((tmp_path / "two" / "metrics" / "optimized" / "train.json").read_text())
    assert m2["world_size"] == 2 and m2["global_batch"] == m1["global_batch"] == 32
    assert m2["history"][0]["train_loss"] == pytest.approx(m1["history"][0]["train_loss"], rel=1e-4)
    w1 = torch.load(tmp_path / "one" / "models" / "optimized" / "last.pt", weights_only=True)["model"]
    w2 = torch.load(tmp_path / "two" / "models" / "optimized" / "last.pt", weights_only=True)["model"]
    for key in w1:
        assert torch.allclose(w1[key], w2[key], rtol=1e-3, atol=1e-5), key


def test_two_node_rendezvous_on_loopback_writes_one_set_of_outputs(tmp_path, prepared):
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    params = deterministic_params(batch_size=16, nnodes=2, node_rank=0, rdzv_endpoint=endpoint)
    procs.append(train(tmp_path, "node0", params, prepared))
    # node 1 shares params.yaml and takes its rank from the command line, as under SLURM
    procs.append(train(tmp_path, "node1", params, prepared, args=("--node-rank", "1")))
    outputs = [finish(p) for p in procs]
    assert "--nnodes=2" in outputs[0]
    summary = json.loads((tmp_path / "node0" / "metrics" / "optimized" / "train.json").read_text())
    assert summary["world_size"] == 2
    assert not (tmp_path / "node1" / "metrics" / "optimized" / "train.json").exists()
    assert not (tmp_path / "node1" / "models" / "optimized" / "last.pt").exists()


def test_sync_batchnorm_on_cpu_is_a_clear_error(tmp_path, prepared):
    # max_restarts 0: every worker fails alike, and each of torchrun's 3 restarts (the shipped
    # train.max_restarts) would start two workers to print the same error (~20 s of the test's ~30).
    params = tiny_params(batch_size=16, nproc=2, sync_bn=True, epochs=1, max_restarts=0)
    proc = train(tmp_path, "syncbn", params, prepared)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "train.sync_bn=true needs CUDA" in output


DDP_PROBE = """
import json, sys
from pathlib import Path

import torch

from cnnpipe.data.store.shards import open_split
from cnnpipe.params import load_params, resolve
from cnnpipe.train.distributed import cleanup, init_distributed
from cnnpipe.train.parts import build_training, step_context
from cnnpipe.train.tuning import resolve_auto

params, prepared, out = sys.argv[1:]
info = init_distributed("cpu")
cfg = resolve_auto(resolve(load_params(params), "optimized"), info.device)
parts = build_training(cfg, info, open_split(Path(prepared), "train"))
ctx, _ = step_context(cfg, parts, info, parts.schedule)
ddp = ctx.model
torch.manual_seed(info.rank)  # each rank its own input: equal gradients then prove the all-reduce
x = torch.randn(4, parts.split.channels, cfg.data.image_size, cfg.data.image_size)
for _ in range(2):  # two steps: the static graph is recorded on the first and used on the second
    ddp(x).sum().backward()
grads = torch.cat([p.grad.flatten() for p in ddp.parameters()])
Path(out, f"rank{info.rank}.json").write_text(json.dumps({
    "type": type(ddp).__name__, "broadcast_buffers": ddp.broadcast_buffers,
    "gradient_as_bucket_view": ddp.gradient_as_bucket_view, "static_graph": ddp.static_graph,
    "grad_sum": grads.sum().item()}))
cleanup()
"""


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_ddp_is_built_for_many_gpus_by_step_context(tmp_path, prepared, accum_steps):
    """No buffer broadcast per forward, gradients as bucket views, a static graph where gradient
    accumulation (no_sync) does not rule it out; as `step_context` builds it on 2 gloo processes."""
    script = tmp_path / "probe.py"
    script.write_text(DDP_PROBE)
    params = write_params(tmp_path / "params.yaml", deterministic_params(batch_size=16, accum_steps=accum_steps))
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))  # torchrun's torchelastic_* folder: here
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script), str(params), str(prepared), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for flags in ranks:
        assert flags["type"] == "DistributedDataParallel"
        assert flags["broadcast_buffers"] is False and flags["gradient_as_bucket_view"] is True
        assert flags["static_graph"] is (accum_steps == 1)
    assert ranks[0]["grad_sum"] == pytest.approx(ranks[1]["grad_sum"])  # gradients still all-reduced

"""Two nodes on 127.0.0.1, as docs/distributed.md runs them: two checkouts (separate working trees,
so separate disks), one torchrun agent each, the c10d rendezvous, the same command on both."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import ROOT, tiny_params, write_params

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_params(**train) -> dict:
    """The tiny test model at 28 px, random crops and flips (so every rank's RNG state matters on
    resume), fp32. The kills wait for a checkpoint (`paused_at_checkpoint`), not for a slow model."""
    return tiny_params(**{"amp": "off", "batch_size": 16, "epochs": 4, "nnodes": 2, **train})


def checkout(root: Path, params: dict, prepared: Path) -> Path:
    """A node's working tree: the stage scripts, its own params.yaml and its own copy of the data
    (what `git clone` + `dvc pull` give a node)."""
    root.mkdir(parents=True)
    shutil.copytree(ROOT / "stages", root / "stages")
    shutil.copytree(prepared, root / "data" / "prepared")
    write_params(root / "params.yaml", params)
    return root


def start(tree: Path, node: int, port: int, pause: Path | None = None) -> subprocess.Popen:
    """The documented command for node `node`, run from its checkout; with `pause`, the run's first
    last.pt is followed by a pause (tests/child_hooks: `pause`/paused appears, and the run waits for
    `pause`/resume), where a test kills it."""
    log = open(tree / f"node{node}.log", "a")
    tmp = tree / "tmp"  # a killed launcher cannot remove its temp folder: let it be in the test's
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp))
    if pause:
        env["CNNPIPE_TEST_PAUSE_AT_CHECKPOINT"] = str(pause)
    return subprocess.Popen([sys.executable, "stages/train.py", "optimized", "--node-rank", str(node),
                             "--rdzv-endpoint", f"127.0.0.1:{port}"], cwd=tree, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a node's launcher, torchrun agent and workers (the workers have sessions of their own),
    as a power cut would."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)


def wait_all(procs: list[subprocess.Popen], timeout: float = 600) -> list[int]:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
    return [p.returncode for p in procs]


def wait_for_checkpoint(path: Path, procs: list[subprocess.Popen], tree: Path) -> None:
    """Until `path` exists (the signal to act on); a hang guard, not a speed check: a job that ends
    first, or nothing after 10 minutes, fails with the node's log."""
    give_up = time.monotonic() + 600
    while not path.exists():
        if any(p.poll() is not None for p in procs) or time.monotonic() > give_up:
            pytest.fail(f"no checkpoint at {path}:\n{log(tree, 0)[-3000:]}")
        time.sleep(0.02)


def log(tree: Path, node: int) -> str:
    return (tree / f"node{node}.log").read_text()


def weights(tree: Path) -> dict[str, torch.Tensor]:
    return torch.load(tree / "models" / "optimized" / "last.pt", weights_only=True)["model"]


def test_killed_on_both_nodes_both_resume_at_the_same_epoch_and_match_an_uninterrupted_run(tmp_path, prepared):
    params = node_params()
    straight = [checkout(tmp_path / f"straight{k}", params, prepared) for k in (0, 1)]
    port = free_port()
    assert wait_all([start(tree, k, port) for k, tree in enumerate(straight)]) == [0, 0]

    nodes = [checkout(tmp_path / f"node{k}", params, prepared) for k in (0, 1)]
    port = free_port()
    procs = [start(tree, k, port, pause=tmp_path) for k, tree in enumerate(nodes)]
    last = nodes[0] / "models" / "optimized" / "last.pt"
    wait_for_checkpoint(tmp_path / "paused", procs, nodes[0])  # the signal to kill on: the first checkpoint
    for p in procs:
        kill_tree(p)
    saved = torch.load(last, weights_only=True)["epoch"]
    assert saved == 1 == int((tmp_path / "paused").read_text())
    assert not (nodes[1] / "models").exists()  # only node 0's disk holds the checkpoint

    port = free_port()
    assert wait_all([start(tree, k, port) for k, tree in enumerate(nodes)]) == [0, 0], log(nodes[0], 0)[-3000:]
    for k in (0, 1):  # every node says where it resumed
        assert f"node {k} resuming from" in log(nodes[k], k) and f"after epoch {saved}/4" in log(nodes[k], k)
    summary = json.loads((nodes[0] / "metrics" / "optimized" / "train.json").read_text())
    assert summary["world_size"] == 2 and summary["epochs"] == 4 and summary["resumed_from_epoch"] == saved
    reference, resumed = weights(straight[0]), weights(nodes[0])
    for name, tensor in reference.items():
        assert torch.equal(tensor, resumed[name]), name


def test_nodes_with_different_params_both_stop_before_training_naming_the_key(tmp_path, prepared):
    trees = [checkout(tmp_path / "node0", node_params(), prepared),
             checkout(tmp_path / "node1", node_params(lr=0.1), prepared)]
    port = free_port()
    # Not a speed check: a guard against the hang this replaces (a collective waiting 30 minutes);
    # generous, so only that hang, never a loaded machine, reaches it.
    codes = wait_all([start(tree, k, port) for k, tree in enumerate(trees)], timeout=600)
    assert all(code != 0 for code in codes)
    for k, tree in enumerate(trees):
        out = log(tree, k)
        assert "the nodes disagree on train.lr" in out and "0.1 on node 1" in out, out[-3000:]
        # Once: no restart (train.max_restarts is 3) repeats a failure that no restart can fix.
        assert out.count("the nodes disagree") == 1 and "failed (exitcode" not in out, out[-3000:]
    assert not (trees[0] / "models" / "optimized" / "last.pt").exists()


def test_a_worker_killed_mid_epoch_restarts_and_the_job_finishes_every_epoch(tmp_path, prepared):
    params = node_params(nnodes=1, nproc=2, epochs=6, max_restarts=1)
    tree = checkout(tmp_path / "node0", params, prepared)
    proc = start(tree, 0, free_port(), pause=tmp_path)
    wait_for_checkpoint(tmp_path / "paused", [proc], tree)  # rank 0 waits there: the job cannot end first
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if any("train.py" in part for part in p.cmdline()) and "LOCAL_RANK" in p.environ()]
    assert len(workers) == 2
    workers[1].kill()
    (tmp_path / "resume").touch()  # rank 0 goes on, finds rank 1 gone; the restarted pair does not pause
    assert wait_all([proc]) == [0], log(tree, 0)[-3000:]
    summary = json.loads((tree / "metrics" / "optimized" / "train.json").read_text())
    assert summary["epochs"] == 6 and [h["epoch"] for h in summary["history"]] == list(range(1, 7))
    assert summary["resumed_from_epoch"] is not None and summary["resumed_from_epoch"] < 6


def test_a_node_that_never_joins_fails_node_0_after_the_join_timeout(tmp_path, prepared):
    tree = checkout(tmp_path / "node0", node_params(join_timeout_s=5), prepared)
    proc = start(tree, 0, free_port())  # node 1 is never started
    assert wait_all([proc], timeout=300) != [0]  # a hang guard: torchrun's own default would wait 600 s
    out = log(tree, 0)
    assert "RendezvousTimeoutError" in out, out[-3000:]
    assert "not every node joined" in out and "train.join_timeout_s=5" in out

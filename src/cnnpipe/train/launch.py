"""Relaunch a stage under torchrun when the params ask for more than one process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from cnnpipe.config import TrainConfig
from cnnpipe.train.distributed import under_torchrun

NO_RESTART_FILE = "CNNPIPE_NO_RESTART_FILE"
"""Environment variable naming the file where a worker leaves a failure no restart can fix; set by
`relaunch` for the workers it starts."""


def needs_torchrun(t: TrainConfig) -> bool:
    """True when this process should hand over to torchrun instead of training itself."""
    return (t.nproc > 1 or t.nnodes > 1) and not under_torchrun()


def torchrun_command(t: TrainConfig, script: str, args: list[str], run_id: str) -> list[str]:
    """The torchrun command line for `script`.

    One node: `--standalone`. Several: the c10d rendezvous at `train.rdzv_endpoint` (hosted by node
    0's agent), which every node joins with the same `run_id`; node 0 fails after
    `train.join_timeout_s` if a node never comes. Both restart the whole worker group up to
    `train.max_restarts` times after a worker dies; the restarted workers resume from last.pt (a
    failure no restart can fix ends the group at once: `stop_without_restart`).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={t.nproc}",
           f"--max_restarts={t.max_restarts}"]
    if numa_binding_possible(t):
        cmd += ["--numa-binding=node"]
    if t.nnodes == 1:
        cmd += ["--standalone"]
    else:
        host = t.rdzv_endpoint.rpartition(":")[0]
        cmd += [f"--nnodes={t.nnodes}", f"--node_rank={t.node_rank}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={t.rdzv_endpoint}", f"--rdzv_id={run_id}",
                f"--rdzv_conf=join_timeout={t.join_timeout_s},is_host={str(t.node_rank == 0).lower()}"]
        if host in ("127.0.0.1", "localhost"):
            # Nodes on one machine (tests, a laptop): workers must be reached on loopback, not on
            # the address the hostname resolves to.
            cmd += [f"--local_addr={host}"]
    return [*cmd, script, *args]


def numa_binding_possible(t: TrainConfig) -> bool:
    """Bind each GPU's worker to the CPUs of that GPU's NUMA node (torchrun `--numa-binding=node`):
    on a multi-socket 8-GPU server a worker on the far socket copies every batch across the socket
    link. Only for several GPU workers, and where `numactl`, which torchrun runs it through, exists."""
    gpus = t.device != "cpu" and torch.cuda.is_available()
    return gpus and t.nproc > 1 and shutil.which("numactl") is not None


def relaunch(t: TrainConfig, script: str, args: list[str], run_id: str) -> int:
    """Run the stage under torchrun and return its exit code, with a hint for the failures it can name."""
    cmd = torchrun_command(t, script, args, run_id)
    print("launching:", " ".join(cmd), flush=True)
    with tempfile.TemporaryDirectory(prefix="cnnpipe-launch-") as tmp:
        stop_file = Path(tmp) / "no-restart"
        # Workers get a TCPStore of their own rather than sharing the rendezvous store with the agent:
        # shared, a restarted group on several nodes found the previous round's addresses there and
        # failed to connect (torch 2.14, seen on one node and on two on 127.0.0.1): restarts never recovered.
        # TMPDIR: torchrun's agent makes a torchelastic_* folder in the temp folder and leaves it
        # there; in ours, it goes with ours.
        code = subprocess.call(cmd, env=dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", TMPDIR=tmp,
                                             **{NO_RESTART_FILE: str(stop_file)}))
        if stop_file.exists():
            print(stop_file.read_text(), file=sys.stderr)
            return 2
    if code and t.nnodes > 1:
        print(f"train: torchrun exited with {code} on node {t.node_rank} of {t.nnodes}. If the log above shows a "
              f"RendezvousTimeoutError, not every node joined {t.rdzv_endpoint} within train.join_timeout_s="
              f"{t.join_timeout_s}: start the same command on every node (see docs/distributed.md).",
              file=sys.stderr)
    return code


def stop_without_restart(message: str) -> int:
    """A worker's exit code for a failure that every rank raises together and no restart can fix
    (the nodes' settings disagree: `distributed.check_same_settings`).

    torchrun restarts a failed worker group up to `train.max_restarts` times and has no notion of a
    failure not worth retrying: each round would fail the same way. Under `relaunch`, local rank 0
    leaves `message` in the file it named and every worker exits 0, so the group ends at once; the
    launcher then prints the message and fails. Only for failures on every rank: a worker that
    exits 0 while others wait in a collective would leave them waiting. Elsewhere (torchrun started
    by hand, one process) the message is printed and the code is 2, as for other clear errors.
    """
    stop_file = os.environ.get(NO_RESTART_FILE)
    if stop_file is None or not under_torchrun():
        print(message, file=sys.stderr)
        return 2
    if os.environ.get("LOCAL_RANK", "0") == "0":  # one message per node
        Path(stop_file).write_text(message + "\n")
    return 0

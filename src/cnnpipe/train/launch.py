"""Relaunch a stage under torchrun when the params ask for more than one process."""

from __future__ import annotations

import os
import subprocess
import sys

from cnnpipe.config import TrainConfig
from cnnpipe.train.distributed import under_torchrun


def needs_torchrun(t: TrainConfig) -> bool:
    """True when this process should hand over to torchrun instead of training itself."""
    return (t.nproc > 1 or t.nnodes > 1) and not under_torchrun()


def torchrun_command(t: TrainConfig, script: str, args: list[str], run_id: str) -> list[str]:
    """The torchrun command line for `script`.

    One node: `--standalone`. Several: the c10d rendezvous at `train.rdzv_endpoint` (hosted by node
    0's agent), which every node joins with the same `run_id`; node 0 fails after
    `train.join_timeout_s` if a node never comes. Both restart the whole worker group up to
    `train.max_restarts` times after a worker dies; the restarted workers resume from last.pt.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={t.nproc}",
           f"--max_restarts={t.max_restarts}"]
    if t.nnodes == 1:
        cmd += ["--standalone"]
    else:
        host = t.rdzv_endpoint.rpartition(":")[0]
        cmd += [f"--nnodes={t.nnodes}", f"--node_rank={t.node_rank}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={t.rdzv_endpoint}", f"--rdzv_id={run_id}",
                f"--rdzv_conf=join_timeout={t.join_timeout_s},is_host={str(t.node_rank == 0).lower()}",
                # Nodes on one machine (tests, a laptop): workers must be reached on loopback, not on
                # the address the hostname resolves to.
                f"--local_addr={host}" if host in ("127.0.0.1", "localhost") else ""]
    return [c for c in cmd if c] + [script, *args]


def relaunch(t: TrainConfig, script: str, args: list[str], run_id: str) -> int:
    """Run the stage under torchrun and return its exit code, with a hint for the failures it can name."""
    cmd = torchrun_command(t, script, args, run_id)
    print("launching:", " ".join(cmd), flush=True)
    # Workers get a TCPStore of their own rather than sharing the rendezvous store with the agent:
    # shared, a restarted group on several nodes found the previous round's addresses there and
    # failed to connect (torch 2.14, seen on one node and on two on 127.0.0.1): restarts never recovered.
    code = subprocess.call(cmd, env=dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    if code and t.nnodes > 1:
        print(f"train: torchrun exited with {code} on node {t.node_rank} of {t.nnodes}. If the log above shows a "
              f"RendezvousTimeoutError, not every node joined {t.rdzv_endpoint} within train.join_timeout_s="
              f"{t.join_timeout_s}: start the same command on every node (see docs/distributed.md).",
              file=sys.stderr)
    return code

"""Relaunch a stage under torchrun when the params ask for more than one process."""

from __future__ import annotations

import subprocess
import sys

from cnnpipe.config import TrainConfig
from cnnpipe.train.distributed import under_torchrun


def needs_torchrun(t: TrainConfig) -> bool:
    """True when this process should hand over to torchrun instead of training itself."""
    return (t.nproc > 1 or t.nnodes > 1) and not under_torchrun()


def torchrun_command(t: TrainConfig, script: str, args: list[str]) -> list[str]:
    """The torchrun command line for `script`: standalone on one node, static rendezvous otherwise."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={t.nproc}"]
    if t.nnodes == 1:
        cmd += ["--standalone"]
    else:
        host, _, port = t.rdzv_endpoint.rpartition(":")
        cmd += [f"--nnodes={t.nnodes}", f"--node_rank={t.node_rank}", f"--master_addr={host}",
                f"--master_port={port}"]
    return cmd + [script, *args]


def relaunch(t: TrainConfig, script: str, args: list[str]) -> int:
    """Run the stage under torchrun and return its exit code."""
    cmd = torchrun_command(t, script, args)
    print("launching:", " ".join(cmd), flush=True)
    return subprocess.call(cmd)

"""How the profiled single process's speed scales to the job's processes and nodes (the plan's
prediction for `train.nproc` x `train.nnodes`)."""

from __future__ import annotations

DDP_EFFICIENCY = 0.9
"""Throughput per added GPU, or per added node, under DDP: stated, not measured here. The article's
8-GPU run gave 7.2x (0.9); `bench/scaling.py` measures it on a real cluster."""
CPU_SHARED_CORES = 0.85
"""N training processes on one CPU node share the cores the profile's single process used, and
all-reduce ResNet-50's 100 MB of gradients every step over loopback: the node trains at about this
times one process's speed at the same per-process batch (measured 0.85: 2 processes of 1 thread at
170 img/s vs 1 of 2 threads at 200, global batch 128, 32 px, Intel Xeon with AMX:
`python bench/scaling.py --epochs 2`; a 2-process training then ran at 172 img/s where this predicts 170)."""


def world_scaling(device: str, nproc: int, nnodes: int) -> tuple[float, str]:
    """(speed factor over the profiled single process, how it was reckoned) for `nproc` x `nnodes`."""
    if nproc * nnodes == 1:
        return 1.0, "one process"
    nodes = nnodes * (DDP_EFFICIENCY if nnodes > 1 else 1.0)
    if device == "cuda":
        factor = nproc * (DDP_EFFICIENCY if nproc > 1 else 1.0) * nodes
        return factor, (f"{nproc} GPUs x {nnodes} node(s), {DDP_EFFICIENCY} per added GPU and node (stated): "
                        f"{factor:.2f}x the profiled GPU")
    factor = (CPU_SHARED_CORES if nproc > 1 else 1.0) * nodes
    return factor, (f"{nproc} processes share each node's cores ({CPU_SHARED_CORES} of one process's speed, "
                    f"measured), {nnodes} node(s){f' at {DDP_EFFICIENCY} each (stated)' if nnodes > 1 else ''}: "
                    f"{factor:.2f}x the profiled process")

"""Bottleneck rules as pure functions of measured facts.

Each rule looks at numbers from an un-profiled timed run and returns a recommendation carrying
the evidence that triggered it. Thresholds follow the usual practice (PyTorch's performance
tuning guide, the TensorBoard profiler plugin's advice) and are tested at their edges.
"""

from __future__ import annotations

import resource
from dataclasses import asdict, dataclass, field
from typing import Any

BOTTLENECKS = ("input", "compute", "host_sync", "page_faults", "small_batch", "memory", "communication")

INPUT_WAIT_FRAC = 0.05
COMM_FRAC = 0.10
SYNC_FRAC = 0.05
MEMORY_FRAC = 0.90
LOW_UTIL = 0.50
BATCH_GAIN = 1.15  # throughput at 2x batch / at 1x batch above which the batch is "small"
SYNC_COUNT = 1.0  # host syncs per step from which a CUDA step drains its launch queue every step...
BUSY_FRAC = 0.90  # ...and the GPU busy fraction below which that drain shows as idle time
TENSOR_CORE_FRAC = 0.5  # share of matrix-kernel time on Tensor Cores below which AMP is advised
KERNEL_FRAC = 0.05  # share of the step's CPU time in the kernel (faulting pages in) from which malloc is advised
PAGE = resource.getpagesize()  # bytes a minor page fault maps (the evidence's GB a step; huge pages: more)


@dataclass(frozen=True)
class Facts:
    """What the profile measured for one variant."""

    fractions: dict[str, float]  # region → fraction of step time (sums to 1)
    device: str = "cpu"
    amp: str = "off"
    channels_last: bool = False
    loader: str = "fast"
    num_workers: int = 0
    batch_size: int = 64
    utilization: float | None = None  # GPU busy fraction, or CPU utilisation of the cores we use
    memory_frac: float | None = None  # peak memory / device memory
    batch_gain: float | None = None  # throughput(best_batch) / throughput(batch_size), when measured
    best_batch: int | None = None  # the largest batch whose doubling still paid, when measured
    host_syncs_per_step: float | None = None  # device→host reads (.item(), .cpu(), `if t:`) per step
    tensor_core_frac: float | None = None  # CUDA: share of matrix-kernel time in Tensor Core kernels
    malloc: str = "system"  # train.malloc as profiled
    kernel_frac: float | None = None  # share of the process's CPU time in the kernel over the timed steps
    page_faults_per_step: float | None = None  # minor page faults a step (the process's, loader workers apart)


@dataclass(frozen=True)
class Recommendation:
    """One suggested change, why, and what it should gain."""

    bottleneck: str
    action: str
    evidence: dict[str, Any] = field(default_factory=dict)
    expected_gain: str = ""
    knob: str | None = None
    """The train.* key a trial can measure for this recommendation."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fraction_rule(f: Facts, region: str, threshold: float, bottleneck: str, action: str,
                   knob: str | None = None, when: str = "") -> Recommendation | None:
    """Fires when `region` takes more than `threshold` of the step; the gain is the bound if it vanished."""
    share = f.fractions.get(region, 0.0)
    if share <= threshold:
        return None
    return Recommendation(bottleneck, action, {f"{region}_frac": round(share, 4), "threshold": threshold},
                          f"up to {1 / (1 - share):.2f}x{when}", knob)


def _input(f: Facts) -> Recommendation | None:
    if f.loader == "baseline":
        return _fraction_rule(f, "data_wait", INPUT_WAIT_FRAC, "input",
                              "switch to the fast batched loader (train.loader: fast), or raise train.num_workers",
                              "loader",
                              " step time if the wait is hidden")
    return _fraction_rule(f, "data_wait", INPUT_WAIT_FRAC, "input",
                          f"raise train.num_workers (now {f.num_workers}) and enable pin_memory", "num_workers",
                          " step time if the wait is hidden")


def _communication(f: Facts) -> Recommendation | None:
    return _fraction_rule(f, "communication", COMM_FRAC, "communication",
                          "accumulate gradients or raise the per-process batch / DDP bucket size",
                          when=" if communication overlaps compute")


_SYNC_ACTION = "remove per-step .item()/.cpu()/`if tensor:` calls; log accumulated tensors every N steps"


def _host_sync(f: Facts) -> Recommendation | None:
    """Time spent waiting in sync points, or (CUDA) a sync every step while the GPU idles.

    On the CPU ops run synchronously: a `.item()` costs about a microsecond and drains nothing,
    so there only measured time can name this bottleneck; the count is reported as evidence.
    """
    timed = _fraction_rule(f, "sync", SYNC_FRAC, "host_sync", _SYNC_ACTION)
    if timed is not None or f.device != "cuda":
        return timed
    n, busy = f.host_syncs_per_step, f.utilization
    if n is None or n < SYNC_COUNT or (busy is not None and busy >= BUSY_FRAC):
        return None
    evidence = {"host_syncs_per_step": round(n, 2), "threshold": SYNC_COUNT}
    if busy is not None:
        evidence["gpu_busy_frac"] = round(busy, 4)
    return Recommendation("host_sync", _SYNC_ACTION, evidence,
                          "the GPU stops idling while the host waits at each sync")


def _memory(f: Facts) -> Recommendation | None:
    if f.memory_frac is None or f.memory_frac <= MEMORY_FRAC:
        return None
    action = "enable AMP (train.amp: bf16)" if f.amp == "off" else "enable activation checkpointing or lower the batch"
    return Recommendation("memory", action, {"memory_frac": round(f.memory_frac, 4), "threshold": MEMORY_FRAC},
                          "headroom to avoid OOM and allocator thrashing", "amp" if f.amp == "off" else None)


def _page_faults(f: Facts) -> Recommendation | None:
    """The kernel's share of a CPU step: glibc unmaps the step's large blocks on free and the next step
    faults every page of them in again, zeroed (`cnnpipe.malloc`). `kernel_frac` is None where glibc's
    mallopt is not there to set (the profile leaves it out)."""
    if f.device != "cpu" or f.malloc != "system" or f.kernel_frac is None or f.kernel_frac <= KERNEL_FRAC:
        return None
    evidence: dict[str, Any] = {"kernel_frac": round(f.kernel_frac, 4), "threshold": KERNEL_FRAC}
    faulted = ""
    if f.page_faults_per_step is not None:
        evidence["page_faults_per_step"] = round(f.page_faults_per_step)
        faulted = f", faulting in {f.page_faults_per_step * PAGE / 1e9:.2f} GB of pages a step"
    return Recommendation("page_faults", f"keep freed memory in the process (train.malloc: keep): the kernel "
                          f"takes {f.kernel_frac:.0%} of the step's CPU time{faulted}", evidence,
                          f"about {1 / (1 - f.kernel_frac):.2f}x from the kernel's time (the trial measures it)",
                          "malloc")


def _small_batch(f: Facts) -> Recommendation | None:
    low_util = f.utilization is not None and f.utilization < LOW_UTIL
    gains = f.batch_gain is not None and f.batch_gain > BATCH_GAIN
    if not (low_util or gains):
        return None
    evidence: dict[str, Any] = {"batch_size": f.batch_size}
    if f.utilization is not None:
        evidence["utilization"] = round(f.utilization, 4)
    target = f.best_batch or 2 * f.batch_size
    if f.batch_gain is not None:
        evidence[f"throughput_gain_at_batch_{target}"] = round(f.batch_gain, 3)
    return Recommendation("small_batch", f"raise train.batch_size (now {f.batch_size}, measured best {target}) "
                          "and scale the LR with it", evidence,
                          f"{f.batch_gain:.2f}x measured at batch {target}" if f.batch_gain else "", "batch_size")


def _compute(f: Facts) -> list[Recommendation]:
    """Compute-bound advice: cheaper math first (AMP), then memory layout."""
    recs = []
    compute = sum(f.fractions.get(k, 0.0) for k in ("forward", "backward", "optimizer"))
    off_tc = f.tensor_core_frac is not None and f.tensor_core_frac < TENSOR_CORE_FRAC
    if f.amp == "off" or off_tc:
        evidence: dict[str, Any] = {"compute_frac": round(compute, 4), "amp": f.amp}
        if f.tensor_core_frac is not None:
            evidence["tensor_core_frac"] = round(f.tensor_core_frac, 4)
        recs.append(Recommendation("compute", "enable mixed precision (train.amp: bf16, or fp16 on older GPUs)",
                                   evidence, "matrix work on bf16 units / Tensor Cores", "amp"))
    if not f.channels_last:
        recs.append(Recommendation("compute", "use channels_last memory format (train.channels_last: true)",
                                   {"compute_frac": round(compute, 4), "channels_last": False},
                                   "faster convolutions in oneDNN/cuDNN", "channels_last"))
    return recs


def diagnose(f: Facts) -> tuple[str, list[Recommendation]]:
    """The dominant bottleneck label and every recommendation that fired, most urgent first."""
    ordered = [_input(f), _communication(f), _host_sync(f), _page_faults(f), _memory(f), _small_batch(f)]
    recs = [r for r in ordered if r is not None]
    compute_recs = _compute(f)
    label = recs[0].bottleneck if recs else "compute"
    return label, recs + compute_recs

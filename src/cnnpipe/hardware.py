"""What this machine's CPU can do, read once: the facts that decide precision, threads and budgets.

CPUs of the same cloud "kind" differ by 4x on ResNet-50: one with AVX512-BF16/AMX runs bf16 faster
than fp32, one without (e.g. AMD Zen 3) runs bf16 ~10x slower. So nothing here is assumed from the
machine's name; the flags come from /proc/cpuinfo and the usable cores from the affinity mask.
"""

from __future__ import annotations

import functools
import os
import platform

import torch

# Flags that change which kernels oneDNN picks for convolutions and matmuls.
FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")
FAST_BF16 = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo; Python's guess off Linux."""
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features"):  # x86, ARM
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def usable_cores() -> int:
    """Cores this process may run on (the affinity mask: taskset, cgroups, SLURM), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 dot products (oneDNN then runs bf16 convolutions fast)."""
    return any(f in _cpuinfo()[1] for f in FAST_BF16)


def cpu_report() -> dict[str, object]:
    """The CPU facts written to train.json and the plan: model, usable cores, the relevant flags."""
    model, flags = _cpuinfo()
    return {
        "model": model,
        "usable_cores": usable_cores(),
        "features": [f for f in FEATURES if f in flags],
        "fast_bf16": cpu_has_fast_bf16(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


LABEL_ENV = "CNNPIPE_MACHINE_LABEL"
"""Set it to tell apart machines that look alike here (same CPU and GPU, different memory or
interconnect): its value is part of the fingerprint, so a new label reruns the profiles."""


def machine_fingerprint() -> dict[str, object]:
    """The facts that decide training speed, and nothing that changes between runs on one machine.

    The profile and the plan depend on this (the `machine` stage writes it), so a workspace moved to
    another machine re-measures before it trains with tuned values from the old one.
    """
    cuda = torch.cuda.is_available()
    return {
        "cpu": cpu_report(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "label": os.environ.get(LABEL_ENV, ""),
    }

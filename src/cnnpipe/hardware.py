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

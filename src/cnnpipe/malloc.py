"""Whether freed memory stays in the process: `train.malloc`.

glibc's malloc serves a block over its mmap threshold (128 KiB at start, rising with what is freed to
at most 32 MiB) from a fresh mapping and unmaps it on free, and gives the top of its heap back once
more than twice that is free there. A training step frees its activations and gradients, tens to
hundreds of MiB, and allocates them again in the next step: every page of them is faulted in and
zeroed by the kernel again, every step. On the 2-core AMD EPYC that was 1.2 million page faults and
a quarter of the CPU time of a ResNet-50 fp32 step at 128 px, batch 64; keeping the memory made the
step 1.35x faster (`python bench/malloc.py`).

`keep` raises both thresholds (`mallopt`, at run time: no preloaded allocator, no environment set
before the interpreter starts) so freed blocks stay with the process for the next step; the process
keeps its peak footprint instead of returning it between steps. `system` leaves glibc's defaults.
Processes forked afterwards (loader workers) inherit the setting.
"""

from __future__ import annotations

import ctypes
import os
import resource
from dataclasses import dataclass

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""mallopt's parameter numbers (glibc's malloc.h)."""
KEEP_MMAP_THRESHOLD = 1 << 30
"""Blocks up to 1 GiB come from the heap; larger ones (rare: a batch of 256 at 224 px is 0.8 GiB a
feature map at most) are still mapped, as before."""
KEEP_TRIM_THRESHOLD = (1 << 31) - 1
"""The most a C int holds: the heap's free top is never given back."""
SYSTEM_MMAP_THRESHOLD = 32 << 20
"""What `system` returns to after `keep` in one process (the profile's A/B blocks): glibc's dynamic
threshold at its cap, where a step that frees blocks of 32 MiB and more takes it. A step whose
largest block is smaller leaves glibc's own lower, so this side of a trial is, if anything, faster
than a fresh process's `system`: the gain measured is a floor."""
SYSTEM_TRIM_THRESHOLD = 2 * SYSTEM_MMAP_THRESHOLD
"""glibc's rule: twice the dynamic mmap threshold."""


class MallocUnavailable(ValueError):
    """`keep` asked for where the C library is not glibc (no `mallopt` to set)."""


def available() -> bool:
    """True with glibc, whose `mallopt` `keep` sets (musl and macOS have none)."""
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        return False


_current: str | None = None
"""What this process was set to (None: never set: glibc's defaults, untouched)."""


def use_malloc(mode: str) -> None:
    """Set this process's allocator to `mode` (`keep` or `system`); a no-op when it already is.

    `system` in a process never set leaves glibc alone; after `keep` it sets glibc's thresholds at
    their dynamic cap (`SYSTEM_MMAP_THRESHOLD`), as near to a fresh process as `mallopt` can go.
    """
    global _current
    if mode not in ("keep", "system"):
        raise ValueError(f"train.malloc: {mode!r} is not `keep`, `system` or `auto`")
    if mode == (_current or "system"):
        return
    if not available():
        raise MallocUnavailable("train.malloc: keep needs glibc's mallopt, which this system's C library "
                                "lacks; set train.malloc: system (or auto)")
    libc = ctypes.CDLL(None)
    mmap_at, trim_at = ((KEEP_MMAP_THRESHOLD, KEEP_TRIM_THRESHOLD) if mode == "keep"
                        else (SYSTEM_MMAP_THRESHOLD, SYSTEM_TRIM_THRESHOLD))
    if not (libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(mmap_at)) and
            libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(trim_at))):
        raise MallocUnavailable(f"train.malloc: glibc refused mallopt's thresholds for `{mode}`; "
                                "set train.malloc: system")
    _current = mode


def keep_for_inference() -> str:
    """`keep` where glibc is the C library, else nothing to set; returns the setting.

    For cnnpipe's own passes over the test split (evaluate, export's parity check), whatever the
    recipe trained with: the profile times inference in a process that has trained for a while, where
    glibc's own thresholds have risen; a fresh process at glibc's defaults ran the same ResNet-50
    0.77x as fast at 128 px, batch 16, on the 2-core AMD EPYC, one with `keep` 0.97x.
    """
    if available():
        use_malloc("keep")
    return current()


def current() -> str:
    """This process's allocator setting (`system` until `use_malloc` changed it)."""
    return _current or "system"


@dataclass(frozen=True)
class KernelTime:
    """Page faults and the kernel's share of this process's CPU time since `since()`."""

    faults: int
    kernel_s: float
    user_s: float

    @classmethod
    def since(cls, start: resource.struct_rusage) -> KernelTime:
        now = resource.getrusage(resource.RUSAGE_SELF)
        return cls(now.ru_minflt - start.ru_minflt, now.ru_stime - start.ru_stime, now.ru_utime - start.ru_utime)

    @property
    def kernel_frac(self) -> float:
        """The kernel's share of the CPU time (faulting pages in and zeroing them, above all)."""
        total = self.kernel_s + self.user_s
        return self.kernel_s / total if total > 0 else 0.0


def usage() -> resource.struct_rusage:
    """This process's resource usage now: the start of a `KernelTime.since`."""
    return resource.getrusage(resource.RUSAGE_SELF)

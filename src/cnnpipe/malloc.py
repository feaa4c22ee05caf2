"""Whether freed memory stays in the process: `train.malloc`.

glibc's malloc serves a block over its mmap threshold (128 KiB at start, rising with what is freed to
at most 32 MiB) from a fresh mapping and unmaps it on free, and gives the top of its heap back once
more than twice that is free there. A training step frees its activations and gradients, tens to
hundreds of MiB, and allocates them again in the next step: every page of them is faulted in and
zeroed by the kernel again, every step. On the 2-core AMD EPYC that was 1.1 million page faults and
24% of the CPU time of a ResNet-50 fp32 step at 128 px, batch 64; keeping the memory made the step
1.45x (1.37-1.53x) faster, and a bf16 one 1.17x; at 32 px, 1.00x and 1.03x (`python bench/malloc.py`).

`keep` raises both thresholds (`mallopt`, at run time: no preloaded allocator, no environment set
before the interpreter starts) so freed blocks stay with the process for the next step; the process
keeps its peak footprint instead of returning it between steps. `system` leaves glibc's defaults.
Loader workers started by fork inherit the setting; spawned ones start at glibc's defaults (they
hold a batch, not the model's activations).
"""

from __future__ import annotations

import ctypes
import os
import resource
from dataclasses import dataclass

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""mallopt's parameter numbers (glibc's malloc.h)."""
KEEP_MMAP_THRESHOLD = 1 << 30
"""Blocks up to 1 GiB come from the main thread's heap (where PyTorch allocates a step's tensors);
larger ones (a batch of 256 at 224 px is 0.8 GiB a feature map at most) are still mapped, as before.
Other threads' arenas grow in heaps of 64 MiB, so a larger block of theirs is mapped whatever this says."""
CAPPED_MMAP_THRESHOLD = 32 << 20
"""The most glibc before 2.35 accepts (half its 64 MiB arena heap): `keep` falls back to it there,
which keeps every block up to 32 MiB (and the heap's whole top) in the process."""
KEEP_TRIM_THRESHOLD = (1 << 31) - 1
"""The most a C int holds: the heap's free top is never given back."""
SYSTEM_MMAP_THRESHOLD = CAPPED_MMAP_THRESHOLD
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
    mallopt = _libc().mallopt
    if mode == "keep":
        mmap_set = any(mallopt(M_MMAP_THRESHOLD, ctypes.c_int(at))
                       for at in (KEEP_MMAP_THRESHOLD, CAPPED_MMAP_THRESHOLD))  # (glibc < 2.35: the second)
        trim_set = mallopt(M_TRIM_THRESHOLD, ctypes.c_int(KEEP_TRIM_THRESHOLD))
    else:
        mmap_set = mallopt(M_MMAP_THRESHOLD, ctypes.c_int(SYSTEM_MMAP_THRESHOLD))
        trim_set = mallopt(M_TRIM_THRESHOLD, ctypes.c_int(SYSTEM_TRIM_THRESHOLD))
    if not (mmap_set and trim_set):
        raise MallocUnavailable(f"train.malloc: glibc refused mallopt's thresholds for `{mode}`; "
                                "set train.malloc: system")
    _current = mode


def _libc() -> ctypes.CDLL:
    """The process's C library (glibc, `available()` said so)."""
    return ctypes.CDLL(None)


def keep_for_inference() -> str:
    """`keep` where glibc takes it (else glibc's defaults, never an error); returns the setting.

    For the profile's inference timings and cnnpipe's own passes over the test split (evaluate,
    export's parity check), whatever `train.malloc` says: they hold one model and one batch, and the
    plan predicts the fresh processes of evaluate and export from the profile's timings, taken in a
    process that has trained for a while. A fresh process at glibc's defaults inferred 0.80-0.85x as fast
    as that one (ResNet-50, 128 px, batch 16: `python bench/malloc.py`, its second table), one at `keep`
    0.96-0.99x.
    """
    if available():
        try:
            use_malloc("keep")
        except MallocUnavailable:
            pass  # (this glibc refused: its defaults stay)
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
    def cpu_s(self) -> float:
        """The process's CPU seconds, in the kernel and out of it."""
        return self.kernel_s + self.user_s

    @property
    def kernel_frac(self) -> float:
        """The kernel's share of the CPU time (faulting pages in and zeroing them, above all)."""
        return self.kernel_s / self.cpu_s if self.cpu_s > 0 else 0.0


def usage() -> resource.struct_rusage:
    """This process's resource usage now: the start of a `KernelTime.since`."""
    return resource.getrusage(resource.RUSAGE_SELF)

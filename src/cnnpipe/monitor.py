"""Resource readings for train.json: peak memory and GPU utilisation."""

from __future__ import annotations

import resource
import threading
import time

import psutil
import torch


def process_seconds() -> float:
    """Wall seconds since this process started, imports included: what a stage costs the run."""
    return time.time() - psutil.Process().create_time()


def peak_mem_mb(device: torch.device) -> float:
    """CUDA max allocated on a GPU; the process's peak resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class GpuUtilSampler:
    """Samples NVML GPU utilisation in a background thread; `mean()` is None on the CPU."""

    def __init__(self, device: torch.device, interval_s: float = 0.5) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self._nvml = pynvml
        except Exception:  # NVML missing or not permitted: report null rather than guess
            self._handle = None
            return
        self._interval = interval_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.samples.append(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)

    def stop(self) -> float | None:
        """Stop sampling; mean utilisation in percent, or None when nothing was sampled."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        return sum(self.samples) / len(self.samples) if self.samples else None

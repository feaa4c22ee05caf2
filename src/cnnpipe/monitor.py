"""Resource readings for train.json: peak memory and GPU utilisation."""

from __future__ import annotations

import resource
import threading
import warnings

import torch


def peak_mem_mb(device: torch.device) -> float:
    """On a GPU the peak memory PyTorch's caching allocator reserved since `reset_peak_memory` (what
    runs out, and about what nvidia-smi shows; allocated memory is lower); on the CPU the process's
    peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak on a GPU (the CPU's resident-set peak cannot be reset)."""
    if device.type == "cuda" and torch.cuda.is_initialized():  # (before CUDA starts there is no peak to reset)
        torch.cuda.reset_peak_memory_stats(device)


def nvml_handle(nvml, device: torch.device):
    """The NVML handle of the GPU torch calls `device`, found by its UUID (else its PCI bus id).

    Never by index: torch counts the GPUs that CUDA_VISIBLE_DEVICES leaves (and in its order), NVML
    counts every GPU of the machine, so `cuda:0` under CUDA_VISIBLE_DEVICES=3 is NVML's GPU 3.
    """
    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:
        return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    return nvml.nvmlDeviceGetHandleByPciBusId(bus_id)


class GpuUtilSampler:
    """Samples NVML GPU utilisation in a background thread; `stop()` is None on the CPU."""

    def __init__(self, device: torch.device, interval_s: float = 0.5) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml  # nvidia-ml-py, a declared dependency

            pynvml.nvmlInit()
            self._handle = nvml_handle(pynvml, device)
            self._nvml = pynvml
        except Exception as exc:  # NVML missing or not permitted: report null rather than guess
            warnings.warn(f"GPU utilisation not sampled (NVML: {type(exc).__name__}: {exc})", stacklevel=2)
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

"""Mixed precision as one autocast context and one optional GradScaler."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

from cnnpipe.hardware import cpu_has_fast_bf16


def gpu_has_native_bf16(device: torch.device) -> bool:
    """True on Ampere and later (compute capability 8.0+). `torch.cuda.is_bf16_supported()` also says
    yes on older GPUs, where bf16 is emulated and slower than fp16."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def resolve_amp(amp: str, device: torch.device) -> str:
    """`auto` → bf16 where it is fast (CPUs with AVX512-BF16/AMX, Ampere+ GPUs), fp16 on older GPUs."""
    if amp != "auto":
        return amp  # explicit choices stand (CPU fp16 is slow on most CPUs, but it was asked for)
    if device.type == "cuda":
        return "bf16" if gpu_has_native_bf16(device) else "fp16"
    return "bf16" if cpu_has_fast_bf16() else "off"


def math_mode(amp: str, device: torch.device) -> str:
    """The arithmetic a recipe really runs, in words, for the reports. On Ampere+ GPUs "fp32" runs its
    convolutions in TF32 (cuDNN's default, which PyTorch keeps; matmuls stay fp32 unless
    `torch.backends.cuda.matmul.allow_tf32` is set), so a baseline's fp32 is faster than fp32 would be."""
    if amp != "off":
        return f"{amp} autocast (fp32 weights and reductions)"
    if device.type != "cuda" or not gpu_has_native_bf16(device):
        return "fp32"
    conv = "TF32" if torch.backends.cudnn.allow_tf32 else "fp32"
    matmul = "TF32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    return f"fp32 weights; convolutions in {conv} (cuDNN default), matmuls in {matmul}"


def autocast(amp: str, device: torch.device) -> ContextManager:
    """The autocast context for `amp` (off → a null context)."""
    if amp == "off":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(amp: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16 only: bf16 has fp32's range and needs no loss scaling."""
    if amp != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


def use_cudnn_autotuner(device: torch.device) -> None:
    """On CUDA, let cuDNN time its convolution algorithms for each new input shape and keep the
    fastest (`cudnn.benchmark`): training repeats one shape thousands of times, so the few slow first
    steps pay back many times over. Off by default in PyTorch; meaningless on the CPU."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True

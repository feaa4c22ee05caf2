"""Mixed precision as one autocast context and one optional GradScaler."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

from cnnpipe.hardware import cpu_has_fast_bf16


def resolve_amp(amp: str, device: torch.device) -> str:
    """`auto` → bf16 where it is fast (CPUs with AVX512-BF16/AMX, Ampere+ GPUs), fp16 on older GPUs."""
    if amp != "auto":
        return amp  # explicit choices stand (CPU fp16 is slow on most CPUs, but it was asked for)
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_has_fast_bf16() else "off"


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

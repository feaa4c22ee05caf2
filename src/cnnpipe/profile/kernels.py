"""Reading a CUDA trace: which matrix kernels ran on Tensor Cores, and how busy the GPU was.

Kernel names are the only portable evidence of the math units used: cuBLAS/cuDNN/CUTLASS name
Tensor Core kernels after their MMA shape or instruction (`h1688gemm`, `s16816gemm`, `xmma`,
`wgmma`, `tensorop`) or their reduced input type (`bf16`, `f16`, `tf32`), while FP32 SIMT kernels
read `sgemm`/`implicit_convolve_sgemm`.
"""

from __future__ import annotations

import re

MATRIX = re.compile(r"gemm|gemv|conv|xmma|cutlass|wgrad|dgrad|fprop|matmul", re.IGNORECASE)
TENSOR_CORE = re.compile(r"hmma|xmma|wgmma|gmma|tensorop|tf32|bf16|f16|[hsi]\d{3,5}gemm|_1688|_16816|_884",
                         re.IGNORECASE)


def is_matrix_kernel(name: str) -> bool:
    """GEMM or convolution work (what Tensor Cores can run)."""
    return bool(MATRIX.search(name))


def is_tensor_core_kernel(name: str) -> bool:
    """A matrix kernel whose name says it runs on Tensor Cores."""
    return is_matrix_kernel(name) and bool(TENSOR_CORE.search(name))


def tensor_core_share(kernels: list[tuple[str, float]]) -> float | None:
    """Share of matrix-kernel time spent in Tensor Core kernels; None when no matrix kernel ran."""
    matrix = [(n, t) for n, t in kernels if is_matrix_kernel(n)]
    total = sum(t for _, t in matrix)
    if not matrix or total <= 0:
        return None
    return sum(t for n, t in matrix if is_tensor_core_kernel(n)) / total


def busy_fraction(kernels: list[tuple[str, float]], wall_us: float) -> float | None:
    """Kernel time over wall time (one stream, so kernels do not overlap), capped at 1."""
    if wall_us <= 0 or not kernels:
        return None
    return min(1.0, sum(t for _, t in kernels) / wall_us)

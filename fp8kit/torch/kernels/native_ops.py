"""Native CPU kernels as ``torch.library`` custom ops, for graphs traced by ``torch.compile``.

A traced graph cannot call ctypes on fake tensors, so a kernel whose numbers differ from any
torch-op composition (:func:`fp8kit.torch.kernels.small_fp8_gemm`'s accumulation order,
:func:`fp8kit.torch.kernels.cast_error_sums`' summation order) runs there as an opaque op:
compiled and eager calls then give the same bits (docs/decisions/0236-small-cpu-fp8-gemm.md,
0256-native-cast-error-sums.md).
"""

from __future__ import annotations

import torch

from fp8kit.torch.kernels import native
from fp8kit.torch.kernels._library import define_op

__all__ = ["cast_error_sums_op", "fp8_gemm_fake", "small_fp8_gemm_op"]


def _small_fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`fp8kit.torch.native.small_fp8_gemm` (arguments checked by the caller)."""
    return native.small_fp8_gemm(a, b, a_scale, b_scale, out_dtype, bias)


def fp8_gemm_fake(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The output of an FP8 GEMM op ``(a, b, a_scale, b_scale, out_dtype, bias)`` while a graph
    is traced: a contiguous ``(M, N)`` tensor of ``out_dtype``."""
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


small_fp8_gemm_op = define_op(
    "small_fp8_gemm",
    "(Tensor a, Tensor b, Tensor a_scale, Tensor b_scale, ScalarType out_dtype, Tensor? bias)"
    " -> Tensor",
    _small_fp8_gemm,
    fp8_gemm_fake,
)
"""``fp8kit::small_fp8_gemm(a, b, a_scale, b_scale, out_dtype, bias)``: the native small GEMM
as one op of a compiled graph."""


def _cast_error_sums(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, fmax: float
) -> torch.Tensor:
    """:func:`fp8kit.torch.native.cast_error_sums` (arguments checked by the caller)."""
    return native.cast_error_sums(x, q, scale, scale_inv, fmax)


def _cast_error_sums_fake(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, fmax: float
) -> torch.Tensor:
    return x.new_empty((4,), dtype=torch.float64)


cast_error_sums_op = define_op(
    "cast_error_sums",
    "(Tensor x, Tensor q, Tensor scale, Tensor scale_inv, float fmax) -> Tensor",
    _cast_error_sums,
    _cast_error_sums_fake,
)
"""``fp8kit::cast_error_sums(x, q, scale, scale_inv, fmax)``: the native error sums as one op of
a compiled graph."""

"""Fused one-pass FP8 cast kernels: ``(x, scale) -> (fp8 data, amax)`` in one read of ``x``.

- CPU: a C++ library (``fp8_cast.cpp``: AVX-512F, AVX2 or scalar loops chosen at run time,
  parallel over cores with ``at::parallel_reduce``), compiled on first use with
  :func:`torch.utils.cpp_extension.load`, cached on disk and called through ctypes
  (see :mod:`._native`).
- CUDA: a Triton kernel (:mod:`.triton_cast`) with the same algorithm, when ``triton`` imports.

The C++ library also holds the way back, FP8 -> float32 / bfloat16 (:func:`dequantize_fp8`,
used by :func:`fp8kit.torch.quantization.dequantize` and the CPU ``"dequant"`` GEMM backend), and
the amax-only pass :func:`native_amax` (used by
:func:`fp8kit.torch.quantization.nan_ignoring_amax`).

The cast kernels match :func:`fp8kit.torch.quantization.cast_to_fp8_reference` bit for bit;
:func:`fp8kit.torch.quantization.cast_to_fp8` picks the kernel and falls back to the pure-torch
reference for anything they do not cover. Set ``FP8KIT_DISABLE_NATIVE=1`` to never build or use
the C++ kernel.
"""

from __future__ import annotations

import warnings

import torch

from fp8kit.formats import FP8Format
from fp8kit.torch.kernels._native import (
    ISA_AUTO,
    ISA_AVX2,
    ISA_AVX512,
    ISA_SCALAR,
    NativeKernelWarning,
    cache_dir,
    load_native,
    native_amax,
    native_available,
    native_build_error,
    native_cast,
    native_cast_transpose,
    native_dequantize,
    native_isa,
    native_isa_level,
)

__all__ = [
    "ISA_AUTO",
    "ISA_AVX2",
    "ISA_AVX512",
    "ISA_SCALAR",
    "NativeKernelWarning",
    "cache_dir",
    "cast_to_fp8_transpose",
    "dequantize_fp8",
    "load_native",
    "native_amax",
    "native_available",
    "native_build_error",
    "native_cast",
    "native_cast_transpose",
    "native_dequantize",
    "native_isa",
    "native_isa_level",
    "triton_available",
    "try_triton_cast",
]

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_available() -> bool:
    """True when ``triton`` can be imported (the CUDA kernels need it)."""
    from fp8kit.torch.kernels import triton_cast

    return triton_cast.triton_available()


_triton_failed: list[str] = []  # the first Triton failure in this process, if any


def try_triton_cast(
    x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Cast a CUDA tensor with the Triton kernel; None when triton is missing or failed before.

    A failure (e.g. no GPU compiler) emits one :class:`NativeKernelWarning` and disables the
    Triton path for the rest of the process, so callers fall back to the pure-torch cast.
    """
    if _triton_failed or not triton_available():
        return None
    from fp8kit.torch.kernels.triton_cast import triton_cast

    try:
        return triton_cast(x, scale, fmt)
    except Exception as exc:  # compile / launch failure: use the torch path from now on
        _triton_failed.append(f"{type(exc).__name__}: {exc}")
        warnings.warn(
            "fp8kit: the Triton FP8 cast kernel failed, so fp8kit uses its pure-torch cast "
            f"for CUDA tensors (same results). Reason: {_triton_failed[0][-2000:]}",
            NativeKernelWarning,
            stacklevel=3,
        )
        return None


def cast_to_fp8_transpose(
    x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor and also produce its transpose, in one read when a kernel exists.

    wgrad needs ``x^T`` and ``dY^T`` as row-major FP8; this writes both layouts at once.

    Args:
        x: float32 / bfloat16 / float16 tensor of shape ``(M, N)``.
        scale: float32 tensor with one element on ``x``'s device.
        fmt: target format.

    Returns:
        ``(data, data_t, amax)``: FP8 ``(M, N)`` and ``(N, M)`` row-major tensors with
        ``data_t == data.t()``, and the float32 0-d ``max |x|`` (NaN ignored), all equal to
        ``cast_to_fp8_reference`` bit for bit.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a 2-D tensor, got {shape}")
    if x.dtype in _INPUT_DTYPES and _scale_ok(x, scale):
        if x.device.type == "cpu" and load_native() is not None:
            return native_cast_transpose(x, scale, fmt)
        if x.device.type == "cuda" and triton_available():
            from fp8kit.torch.kernels.triton_cast import triton_cast_transpose

            return triton_cast_transpose(x, scale, fmt)
    from fp8kit.torch.quantization import cast_to_fp8_reference

    data, amax = cast_to_fp8_reference(x, scale, fmt)
    return data.contiguous(), data.t().contiguous(), amax


def _scale_ok(x: torch.Tensor, scale: torch.Tensor) -> bool:
    return (
        isinstance(scale, torch.Tensor)
        and scale.dtype == torch.float32
        and scale.numel() == 1
        and scale.device == x.device
    )


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_fp8(
    data: torch.Tensor, scale: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``data.to(torch.float32) * scale`` (or the exact ``data.to(torch.float32)`` when ``scale``
    is None), cast to ``dtype``: the native kernel where it applies, torch otherwise.

    The kernel runs for CPU ``float8_e4m3fn`` / ``float8_e5m2`` data with no scale or a float32
    CPU scale of one element and at most ``data.dim()`` dimensions (so the result has
    ``data.shape``) that needs no autograd, outside ``torch.compile`` tracing. Either way the
    values are the same bit for bit (NaN stays NaN): one float32 multiply; a bfloat16 ``dtype``
    rounds the float32 result to nearest even (the kernel writes it directly), a float16 one is
    torch's cast of the kernel's float32 result.

    Args:
        data: FP8 tensor, any shape and strides.
        scale: None, or the float32 factor (``scale_inv``), a tensor with one element.
        dtype: ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``.

    Returns:
        Tensor of ``dtype`` and ``data``'s shape, laid out as torch's elementwise result.
    """
    if _dequant_native_ok(data, scale, dtype):
        if dtype == torch.float16:
            return native_dequantize(data, scale).to(torch.float16)
        return native_dequantize(data, scale, dtype)
    out = data.to(torch.float32)
    if scale is not None:
        out = out * scale
    return out if dtype == torch.float32 else out.to(dtype)


def _dequant_native_ok(data: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> bool:
    if not (
        isinstance(data, torch.Tensor)
        and data.device.type == "cpu"
        and data.dtype in _FP8_DTYPES
        and dtype in _INPUT_DTYPES
    ):
        return False
    if scale is not None and not (
        _scale_ok(data, scale)
        and scale.dim() <= data.dim()  # broadcasting keeps data's shape
        and not (scale.requires_grad and torch.is_grad_enabled())  # torch's result has a grad_fn
    ):
        return False
    return not torch.compiler.is_compiling() and load_native() is not None

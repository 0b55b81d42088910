"""FP8 kernels for PyTorch: casts (with transpose, amax, scale_inv and dbias in one read of the
input), current scaling, the delayed-scaling update event, the amax pass, dequantization, the
CPU GEMM's epilogue, a one-call small FP8 GEMM and a cast's error sums (the inspector's).

The API lives in :mod:`.dispatch`, which picks a backend per call:

- CPU: a C++ library (``fp8_cast.cpp``: AVX-512F, AVX2 or scalar loops chosen at run time,
  parallel over cores with ATen's OpenMP), compiled on first use with
  :func:`torch.utils.cpp_extension.load`, cached on disk and called through ctypes
  (:mod:`._native`, :mod:`.native`). ``FP8KIT_DISABLE_NATIVE=1`` never builds or uses it.
- CUDA: Triton kernels (:mod:`.triton_cast`, :mod:`.triton_update`) when ``triton`` imports.
- Anything else: the pure-torch reference (:mod:`.reference`), which every kernel matches bit
  for bit, except a ``dbias``: float32 column sums whose order differs per backend, each
  within float32 summation error of the exact sum (``tests/torch/test_kernels.py``).

This package imports nothing from the rest of :mod:`fp8kit.torch` (only torch, triton when
present, and :mod:`fp8kit.formats`). ``docs/decisions/0210-kernel-api-and-dispatch.md`` records
the API, the dispatch rules and the kernel counts; ``0200-native-cast-kernel.md`` the CPU
kernels.
"""

from __future__ import annotations

from fp8kit.torch.kernels._common import CastResult
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
from fp8kit.torch.kernels.dispatch import (
    BACKENDS,
    backend_for,
    cast_error_sums,
    cast_fp8,
    cast_fp8_current,
    cast_to_fp8_transpose,
    compute_amax,
    delayed_update_,
    dequantize_fp8,
    gemm_epilogue,
    prepare_cast,
    prepare_delayed_update,
    small_fp8_gemm,
    small_fp8_gemm_unchecked,
    triton_available,
    triton_error,
    try_triton_cast,
)

__all__ = [
    "BACKENDS",
    "ISA_AUTO",
    "ISA_AVX2",
    "ISA_AVX512",
    "ISA_SCALAR",
    "CastResult",
    "NativeKernelWarning",
    "backend_for",
    "cache_dir",
    "cast_error_sums",
    "cast_fp8",
    "cast_fp8_current",
    "cast_to_fp8_transpose",
    "compute_amax",
    "delayed_update_",
    "dequantize_fp8",
    "gemm_epilogue",
    "load_native",
    "native_amax",
    "native_available",
    "native_build_error",
    "native_cast",
    "native_cast_transpose",
    "native_dequantize",
    "native_isa",
    "native_isa_level",
    "prepare_cast",
    "prepare_delayed_update",
    "small_fp8_gemm",
    "small_fp8_gemm_unchecked",
    "triton_available",
    "triton_error",
    "try_triton_cast",
]

"""FP8 quantization written with ``keras.ops`` (docs/semantics.md section 2), for every Keras
backend.

``q = saturate(rne(float32(x) * scale))`` in the target FP8 type (``|x * scale| > fmax`` and
``+-inf`` map to ``+-fmax``), NaN stays NaN, ``scale_inv = 1 / scale`` (float32), and the
recorded amax is ``max |x|`` of the unscaled input with NaN ignored (0 for an all-NaN tensor).
The FP8 bytes are those of ``fp8kit.torch`` and ``fp8kit.jax`` with two platform facts, both
recorded in ``docs/decisions/0602-keras-numerics-parity.md``:

* TensorFlow (eager and XLA) flushes float32 subnormal inputs to zero, like XLA in JAX.
* TensorFlow encodes an E5M2 NaN as ``S.11111.10`` (PyTorch: ``S.11111.11``) and cannot bitcast
  FP8 tensors, so the bytes of NaN elements of E5M2 tensors differ there (both are NaN).
  On the JAX and torch backends NaNs are rewritten to PyTorch's encoding.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from fp8kit.formats import E4M3, E5M2, FP8Format
from fp8kit.keras.scaling import compute_scale

__all__ = [
    "FP8_DTYPE_NAMES",
    "cast_to_fp8",
    "current_scale",
    "dequantize",
    "nan_ignoring_amax",
]

FP8_DTYPE_NAMES = (E4M3.name, E5M2.name)
"""Keras dtype names of the two FP8 encodings (``"float8_e4m3fn"``, ``"float8_e5m2"``)."""


def nan_ignoring_amax(x: Any) -> Any:
    """``max |x|`` over all elements with NaN ignored, as a float32 0-d tensor (0 if none)."""
    a = ops.abs(ops.cast(x, "float32"))
    a = ops.where(ops.isnan(a), ops.zeros_like(a), a)
    return ops.max(a, initial=0.0)


def _canonical_nan(data: Any, scaled: Any, fmt: FP8Format) -> Any:
    """E5M2 NaN bytes as PyTorch writes them (``S.11111.11``) where the backend can bitcast."""
    if fmt is not E5M2 or keras.backend.backend() == "tensorflow":
        return data  # E4M3 NaN is the same everywhere; TF cannot bitcast FP8 (module doc)
    bits = ops.view(data, "uint8")
    bits = ops.where(ops.isnan(scaled), ops.bitwise_or(bits, ops.cast(1, "uint8")), bits)
    return ops.view(bits, fmt.name)


def cast_to_fp8(x: Any, scale: Any, fmt: FP8Format) -> Any:
    """Scale ``x`` by ``scale`` (float32 0-d), saturate to ``+-fmax`` and round into ``fmt``.

    Args:
        x: high-precision tensor, any shape.
        scale: float32 0-d tensor.
        fmt: target FP8 format.

    Returns:
        FP8 tensor of ``x.shape`` (dtype ``fmt.name``).
    """
    scaled = ops.multiply(ops.cast(x, "float32"), scale)
    clipped = ops.clip(scaled, -fmt.max, fmt.max)  # +-inf -> +-fmax
    clipped = ops.where(ops.isnan(scaled), scaled, clipped)  # NaN stays NaN on every backend
    if keras.backend.backend() == "tensorflow":
        clipped = _on_fp8_grid(clipped, fmt)
    return _canonical_nan(ops.cast(clipped, fmt.name), scaled, fmt)


def _on_fp8_grid(v: Any, fmt: FP8Format) -> Any:
    """``v`` (float32, ``|v| <= fmax`` or NaN) rounded to ``fmt``'s values, to nearest even, in
    float32, so that the cast to FP8 after it is exact.

    TensorFlow's XLA on the CPU (TF 2.21) rounds a float32 -> FP8 convert that it fuses into a
    matrix-vector product (one output unit, or one row) through float16 first: twice, so ties
    of the second rounding go the wrong way (0.84355807 became 0.875 in E4M3, not 0.8125).
    Values already on the FP8 grid are exact in float16 too. The rounding is by powers of two
    and ``round`` (half to even), all exact: ``round(v / q) * q`` with ``q`` the spacing of
    ``fmt`` at ``v``'s binade, ``2**(max(e, emin) - mantissa_bits)`` (docs/decisions/0267).
    """
    bits = ops.view(v, "int32")
    biased = ops.bitwise_and(ops.right_shift(bits, 23), 0xFF)  # float32 exponent field
    emin = 1 - fmt.bias  # exponent of the smallest normal FP8 value
    q = ops.maximum(biased, emin + 127) - fmt.mantissa_bits  # biased exponent of the spacing
    inverse = ops.view(ops.left_shift(254 - q, 23), "float32")  # 2**-(q - 127)
    spacing = ops.view(ops.left_shift(q, 23), "float32")  # 2**(q - 127)
    return ops.multiply(ops.round(ops.multiply(v, inverse)), spacing)


def dequantize(data: Any, scale_inv: Any) -> Any:
    """``float32(data) * scale_inv``: the pattern XLA rewrites into an FP8 GEMM operand."""
    return ops.multiply(ops.cast(data, "float32"), scale_inv)


def current_scale(amax: Any, fmt: FP8Format, power_2_scale: bool = False) -> Any:
    """Current-scaling factor ``fmax / amax`` (float32), 1 where amax is 0 or not finite."""
    return compute_scale(amax, ops.ones_like(amax), fmt.max, 0, power_2_scale)

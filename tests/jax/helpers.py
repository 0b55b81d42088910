"""Shared test helpers: numpy references for the FP8 GEMM and small utilities.

The references build on ``tests/reference.py`` (bit-layout FP8 rounding, scalar update rule) and
float64 numpy math; nothing here calls fp8kit.jax.
"""

from __future__ import annotations

import numpy as np

from fp8kit.formats import FP8Format
from tests.reference import quantize_reference

TINY = float(np.finfo(np.float32).tiny)  # 2**-126: XLA on CPU flushes float32 values below this


def bits(x: object) -> np.ndarray:
    """The raw bytes of an FP8 array (JAX, numpy/ml_dtypes) as uint8."""
    return np.asarray(x).view(np.uint8)


def qdq_reference(x: np.ndarray, scale: float, fmt: FP8Format) -> tuple[np.ndarray, float]:
    """Dequantized float64 values of ``quantize(x, scale)`` and the amax (reference.py)."""
    q, amax = quantize_reference(x, scale, fmt)
    inv = float(np.float32(1.0) / np.float32(scale))
    return q * inv, amax


def random_fp8_friendly(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0):
    """float32 normals spread over several binades (no float32 subnormals)."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-4, 4, shape)) * scale
    return x.astype(np.float32)


def edge_values(fmt: FP8Format) -> np.ndarray:
    """0, +-fmax and its neighbours, infinities, NaN, FP8 subnormals and rounding ties."""
    sub = fmt.min_subnormal
    vals = [
        0.0,
        -0.0,
        fmt.max,
        -fmt.max,
        fmt.max * 1.0625,
        np.nextafter(np.float32(fmt.max), np.float32(np.inf)),
        np.inf,
        -np.inf,
        np.nan,
        -np.nan,
        sub,
        -sub,
        sub / 2,  # tie between 0 and the smallest subnormal: rounds to even (0)
        sub * 1.5,  # tie: rounds to even (2 * sub)
        sub * 0.75,
        fmt.min_normal,
        fmt.min_normal * (1 - 2.0**-fmt.mantissa_bits / 2),  # tie at the normal boundary
        3.0 * 2.0**-10,
        1e-4,
        1.0 + 2.0 ** -(fmt.mantissa_bits + 1),  # tie: stays 1
        1.0 + 3 * 2.0 ** -(fmt.mantissa_bits + 1),  # tie: rounds up to even
    ]
    return np.array(vals, np.float32)

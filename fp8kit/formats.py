"""Facts about the two FP8 encodings, shared by every frontend.

Pure Python: no framework import. Each frontend maps :attr:`FP8Format.name` to its own dtype
(``torch.float8_e4m3fn``, ``jnp.float8_e4m3fn``, ...).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class FP8Format:
    """One FP8 encoding.

    Attributes:
        name: dtype name shared by PyTorch, JAX and ml_dtypes (``"float8_e4m3fn"``).
        exponent_bits / mantissa_bits: field widths (sign bit not counted).
        bias: exponent bias.
        max: largest finite value (``fmax``).
        min_normal: smallest positive normal value.
        min_subnormal: smallest positive subnormal value.
        has_inf: whether the encoding has infinities (E5M2 does, E4M3 "fn" does not).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float
    min_normal: float
    min_subnormal: float
    has_inf: bool

    def __str__(self) -> str:
        return self.name


E4M3 = FP8Format(
    name="float8_e4m3fn",
    exponent_bits=4,
    mantissa_bits=3,
    bias=7,
    max=448.0,
    min_normal=2.0**-6,
    min_subnormal=2.0**-9,
    has_inf=False,
)

E5M2 = FP8Format(
    name="float8_e5m2",
    exponent_bits=5,
    mantissa_bits=2,
    bias=15,
    max=57344.0,
    min_normal=2.0**-14,
    min_subnormal=2.0**-16,
    has_inf=True,
)

FORMATS_BY_NAME: dict[str, FP8Format] = {f.name: f for f in (E4M3, E5M2)}

FLOAT32_MAX = 3.4028234663852886e38
"""Largest finite float32 (``FLT_MAX``): the cap for a scale that would overflow."""

FLOAT32_MIN_NORMAL = 2.0**-126
"""Smallest positive normal float32: the smallest scale whose reciprocal is a finite float32."""


def float32_round(value: float) -> float:
    """``value`` rounded to the nearest float32 (ties to even; +-inf beyond the float32 range)."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:  # rounds past FLT_MAX
        return math.copysign(math.inf, value)


def scale_numerator(fmax: float, margin: float) -> float:
    """``float32(fmax * 2**-margin)``, the dividend of the default scale rule (SPEC section 3):
    the product in float64, rounded once to float32. inf where it leaves the float32 range (the
    rule then caps the scale at FLT_MAX), 0 where it underflows."""
    try:
        product = fmax * 2.0**-margin
    except OverflowError:  # 2**-margin beyond float64
        product = math.inf
    return float32_round(product)


def check_scale_number(scale: float, name: str = "scale") -> float:
    """Validate a quantization scale given as a Python number; return it as a float.

    A usable scale is positive, finite and a normal float32, so that ``float32(scale)`` and
    ``scale_inv = 1 / scale`` are both finite and non-zero: ``2**-126 <= scale <= FLT_MAX``.
    Zero, negative, NaN and infinite scales (and ones that overflow or underflow float32) raise
    ``ValueError``. Scales held in tensors are not checked here: reading one would cost a
    device-to-host copy on every call.
    """
    try:
        value = float(scale)
    except OverflowError:  # an int too large for a float
        value = math.inf
    if not FLOAT32_MIN_NORMAL <= value <= FLOAT32_MAX:  # also False for NaN
        raise ValueError(
            f"{name} must be a finite number from 2**-126 to {FLOAT32_MAX!r} (a positive normal "
            f"float32, so that it and its reciprocal are finite), got {scale!r}"
        )
    return value


def format_by_name(name: str) -> FP8Format:
    """Return the :class:`FP8Format` called ``name`` (``"float8_e4m3fn"`` or ``"float8_e5m2"``)."""
    try:
        return FORMATS_BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"fp8_dtype must be one of {sorted(FORMATS_BY_NAME)}, got {name!r}"
        ) from None

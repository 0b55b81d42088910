"""Facts about the two FP8 encodings, shared by every frontend.

Pure Python: no framework import. Each frontend maps :attr:`FP8Format.name` to its own dtype
(``torch.float8_e4m3fn``, ``jnp.float8_e4m3fn``, ...).
"""

from __future__ import annotations

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


def format_by_name(name: str) -> FP8Format:
    """Return the :class:`FP8Format` called ``name`` (``"float8_e4m3fn"`` or ``"float8_e5m2"``)."""
    try:
        return FORMATS_BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"fp8_dtype must be one of {sorted(FORMATS_BY_NAME)}, got {name!r}"
        ) from None

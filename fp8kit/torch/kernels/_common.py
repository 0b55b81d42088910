"""What every backend of :mod:`fp8kit.torch.kernels` shares: the result type, the per-(format,
input dtype) constants and the resolved parameters of an update event.

Everything here is computed once (at import or once per distinct update configuration), so the
per-call path of a kernel is dictionary lookups and attribute reads. See
``docs/decisions/0210-kernel-api-and-dispatch.md``.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import torch

from fp8kit.formats import E4M3, E5M2, FLOAT32_MAX, FP8Format, float32_round, scale_numerator

__all__ = [
    "ALGOS",
    "FLOAT32_MAX",
    "FP8_DTYPES",
    "INPUT_DTYPES",
    "CastResult",
    "CastSpec",
    "UpdateConfig",
    "cast_spec",
    "current_config",
    "dense",
    "empty",
    "float32_round",
    "split_float32",
    "update_config",
]

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The high-precision dtypes the cast kernels read (ids 0, 1, 2 in the kernels)."""
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The FP8 dtypes the cast kernels write (format ids 0, 1 in the kernels)."""
ALGOS = ("max", "most_recent")
"""The amax algorithms :func:`~fp8kit.torch.kernels.delayed_update_` runs (ids 0, 1)."""


class CastResult(NamedTuple):
    """What one cast call returns (fields are None where the call did not ask for them).

    Attributes:
        data: FP8 tensor of ``x.shape``, row-major (contiguous).
        data_t: with ``transpose=True`` (2-D ``x`` of shape ``(M, N)``): the ``(N, M)``
            row-major transpose of ``data``, else None.
        amax: float32 0-d tensor ``max |x|`` with NaN ignored (0 for an all-NaN tensor); None
            when the call folded the amax into ``amax_out`` instead.
        scale_inv: a new float32 0-d tensor, the correctly rounded ``1 / scale`` of the scale
            the data was cast with.
        dbias: with ``dbias=True`` (2-D ``x`` of shape ``(M, N)``): ``(N,)`` in ``x.dtype``,
            the float32 column sums of ``x`` (the bias gradient when ``x`` is ``dY``) rounded
            to ``x.dtype``; else None.
    """

    data: torch.Tensor
    data_t: torch.Tensor | None
    amax: torch.Tensor | None
    scale_inv: torch.Tensor
    dbias: torch.Tensor | None


class CastSpec:
    """Constants of one (FP8 format, input dtype) pair, built once (see :data:`_SPECS`).

    Attributes:
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        fmt: the :class:`~fp8kit.formats.FP8Format`.
        fmt_id: 0 (E4M3fn) or 1 (E5M2), the kernels' format code.
        fmax: largest finite value of the format (Python float, exact in float32).
        in_dtype: the input dtype (float32, bfloat16 or float16).
        in_id: 0 / 1 / 2, the kernels' input dtype code.
        current_rules: the current-scaling :class:`UpdateConfig` without and with
            ``power_2_scale`` (index by the bool).
    """

    __slots__ = ("current_rules", "fmax", "fmt", "fmt_id", "fp8_dtype", "in_dtype", "in_id")

    def __init__(self, fmt: FP8Format, fp8_dtype: torch.dtype, in_dtype: torch.dtype) -> None:
        self.fmt = fmt
        self.fp8_dtype = fp8_dtype
        self.fmt_id = FP8_DTYPES.index(fp8_dtype)
        self.fmax = float(fmt.max)
        self.in_dtype = in_dtype
        self.in_id = INPUT_DTYPES.index(in_dtype)
        self.current_rules: tuple[UpdateConfig, UpdateConfig] = ()  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"CastSpec({self.fmt.name}, {self.in_dtype})"


_FORMATS = {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}
# Keyed by (fp8 dtype or FP8Format, input dtype): one dict lookup per call resolves both.
_SPECS: dict[tuple[object, torch.dtype], CastSpec] = {}
for _fp8, _fmt in _FORMATS.items():
    for _in in INPUT_DTYPES:
        _SPECS[(_fp8, _in)] = _SPECS[(_fmt, _in)] = CastSpec(_fmt, _fp8, _in)


def cast_spec(fp8_dtype: object, x: object) -> CastSpec:
    """The :class:`CastSpec` of ``(fp8_dtype, x.dtype)``; a clear error for anything else.

    Args:
        fp8_dtype: ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (or the
            :class:`~fp8kit.formats.FP8Format` ``E4M3`` / ``E5M2``).
        x: the tensor to cast (float32, bfloat16 or float16).
    """
    spec = _SPECS.get((fp8_dtype, getattr(x, "dtype", None)))
    if spec is not None:
        return spec
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(
            f"x must have dtype torch.float32, torch.bfloat16 or torch.float16, got {x.dtype}"
        )
    raise TypeError(
        "fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2 (or fp8kit.formats.E4M3 / "
        f"E5M2), got {fp8_dtype!r}"
    )


def empty(
    shape: torch.Size, dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)`` in the form torch parses fastest:
    sizes as separate ints (a ``torch.Size`` or tuple argument costs about twice as much;
    ``size=()`` for a 0-d tensor). docs/performance.md, "Host time per call"."""
    if shape:
        return torch.empty(*shape, dtype=dtype, device=device)
    return torch.empty(size=(), dtype=dtype, device=device)


def split_float32(value: float) -> tuple[int, int]:
    """``(e, m)`` with ``value = (1 + m / 2**23) * 2**e`` for a positive normal float32 value.

    The power-of-two scale rule compares an amax's 23 mantissa bits with ``m`` (see
    ``docs/decisions/0210-kernel-api-and-dispatch.md``, "power-of-two scales").
    """
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return ((bits >> 23) & 0xFF) - 127, bits & 0x7FFFFF


class UpdateConfig(NamedTuple):
    """The resolved constants of one delayed-scaling update rule (docs/semantics.md section 3).

    Attributes:
        fmax: largest finite value of the format (positive normal float32).
        margin: the recipe's margin (int or float).
        interval: recompute the scale at events ``1, 1 + interval, ...`` (int >= 1).
        algo_id: 0 = ``"max"`` (window maximum), 1 = ``"most_recent"``.
        power_2_scale: scales are powers of two.
        numerator: ``float32(fmax * 2**-margin)``, the dividend of the default rule.
        fmax_exp / fmax_mant: :func:`split_float32` of ``fmax`` (power-of-two rule).
        margin_int: the integer margin of the power-of-two rule, clamped to +-1024 (beyond that
            every scale is already 2**127 or 0).
    """

    fmax: float
    margin: float
    interval: int
    algo_id: int
    power_2_scale: bool
    numerator: float
    fmax_exp: int
    fmax_mant: int
    margin_int: int


_UPDATE_CONFIGS: dict[tuple[object, ...], UpdateConfig] = {}


def update_config(
    fmax: float, margin: float, interval: int, algo: str, power_2_scale: bool
) -> UpdateConfig:
    """Validate and resolve the update rule's parameters (cached: one dict lookup when seen)."""
    # Types in the key: True == 1 and 0 == False hash alike, and only the valid one is cached.
    key = (fmax, margin, interval, algo, power_2_scale, type(margin), type(interval))
    key += (type(power_2_scale), type(fmax))
    config = _UPDATE_CONFIGS.get(key)
    if config is not None:
        return config
    if isinstance(fmax, bool) or not isinstance(fmax, (int, float)):
        raise TypeError(f"fmax must be a float, got {fmax!r}")
    fmax = float(fmax)
    if not (math.isfinite(fmax) and fmax > 0 and float32_round(fmax) == fmax):
        raise ValueError(
            f"fmax must be a positive finite float32 value (448.0 or 57344.0), got {fmax!r}"
        )
    if split_float32(fmax)[0] < -126:
        raise ValueError(f"fmax must be a normal float32 value, got {fmax!r}")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)):
        raise TypeError(f"margin must be a finite int or float, got {margin!r}")
    if not math.isfinite(margin):
        raise TypeError(f"margin must be a finite int or float, got {margin!r}")
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"interval must be an int >= 1, got {interval!r}")
    if algo not in ALGOS:
        raise ValueError(
            f"algo must be one of {ALGOS} (callable algorithms run in torch, outside the "
            f"kernels), got {algo!r}"
        )
    if not isinstance(power_2_scale, bool):
        raise TypeError(f"power_2_scale must be a bool, got {power_2_scale!r}")
    if power_2_scale and margin != int(margin):
        raise ValueError(f"power_2_scale=True needs an integer margin, got {margin!r}")
    fmax_exp, fmax_mant = split_float32(fmax)
    config = UpdateConfig(
        fmax=fmax,
        margin=margin,
        interval=interval,
        algo_id=ALGOS.index(algo),
        power_2_scale=power_2_scale,
        numerator=scale_numerator(fmax, margin),
        fmax_exp=fmax_exp,
        fmax_mant=fmax_mant,
        margin_int=max(-1024, min(1024, int(margin))) if power_2_scale else 0,
    )
    _UPDATE_CONFIGS[key] = config
    return config


def current_config(fmax: float, power_2_scale: bool) -> UpdateConfig:
    """The rule of current scaling: ``fmax / amax`` (margin 0), power of two if asked."""
    return update_config(fmax, 0, 1, "max", power_2_scale)


for _spec in _SPECS.values():
    _spec.current_rules = (current_config(_spec.fmax, False), current_config(_spec.fmax, True))


def dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` as row-major memory a kernel can walk through its pointer (a copy only when it is
    not already); a lazily negated view (``torch._neg_view``, or the imaginary part of a
    conjugated complex tensor) is materialised, since its memory holds the values before
    negation."""
    if x.is_neg():
        x = x.resolve_neg()
    return x if x.is_contiguous() else x.contiguous()

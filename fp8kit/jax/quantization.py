"""FP8 quantization in JAX: :class:`Float8Array`, :func:`quantize`, :func:`dequantize`.

Numerics (docs/semantics.md section 2), identical to ``fp8kit.torch``:
``q = saturate(rne(float32(x) * scale))`` in the target FP8 type (``|x * scale| > fmax`` and
``+-inf`` map to ``+-fmax``), NaN stays NaN, ``scale_inv = 1 / scale`` (float32, correctly rounded),
and the recorded amax is ``max |x|`` of the unscaled input with NaN ignored (0 for an empty or
all-NaN array).

Three platform facts (``docs/decisions/0102-jax-numerics-parity.md``; the excess precision is
decision 0247 and docs/jax.md, "Dtypes"):

* NaN bytes: XLA encodes an E5M2 NaN as ``S.11111.10``; PyTorch (and fp8kit) use ``S.11111.11``.
  :func:`cast_to_fp8` rewrites E5M2 NaNs so both frontends produce the same bytes.
* XLA may keep a bfloat16 / float16 result in float32 inside one compiled program
  (``--xla_allow_excess_precision``, on by default), so a cast in the same program as the op
  that produced its input would read the unrounded value. :func:`stored` rounds the input to
  its own dtype first (exact on a stored array), so the cast and the amax read the tensor as
  PyTorch and TensorFlow hold it.
* XLA on CPU flushes float32 subnormals (``|x| < 2**-126``) to zero inside computations, so such
  inputs quantize to 0 and record amax 0. Every FP8 value is a normal float32, so this never
  touches an FP8 result that PyTorch would produce from normal float32 inputs.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8kit.formats import E4M3, E5M2, FORMATS_BY_NAME, FP8Format, check_scale_number
from fp8kit.jax.scaling import compute_scale

__all__ = [
    "Float8Array",
    "as_scale",
    "cast_to_fp8",
    "check_high_precision",
    "current_scale",
    "dequantize",
    "fp8_format_of",
    "high_precision_dtype",
    "jnp_dtype_of",
    "master_weight",
    "nan_ignoring_amax",
    "quantize",
    "quantize_current",
    "stored",
]

_JNP_DTYPES: dict[str, Any] = {
    E4M3.name: jnp.float8_e4m3fn,
    E5M2.name: jnp.float8_e5m2,
}
_ALLOWED = "jnp.float8_e4m3fn, jnp.float8_e5m2 (or an fp8kit.formats.FP8Format, or their names)"


def jnp_dtype_of(fmt: FP8Format) -> Any:
    """The JAX dtype of an FP8 format (``jnp.float8_e4m3fn`` / ``jnp.float8_e5m2``)."""
    return _JNP_DTYPES[fmt.name]


def fp8_format_of(dtype: Any, name: str = "fp8_dtype") -> FP8Format:
    """Map a JAX/numpy FP8 dtype, its name, or an :class:`FP8Format` to the format."""
    if isinstance(dtype, FP8Format):
        return dtype
    if isinstance(dtype, str):
        if dtype in FORMATS_BY_NAME:
            return FORMATS_BY_NAME[dtype]
        raise TypeError(f"{name} must be one of {_ALLOWED}, got {dtype!r}")
    try:
        key = np.dtype(dtype).name
    except TypeError:
        raise TypeError(f"{name} must be one of {_ALLOWED}, got {dtype!r}") from None
    if key not in FORMATS_BY_NAME:
        raise TypeError(f"{name} must be one of {_ALLOWED}, got {dtype!r}")
    return FORMATS_BY_NAME[key]


def check_high_precision(x: Any, name: str = "x") -> jax.Array:
    """Return ``x`` as a JAX array, raising a TypeError unless it has a non-FP8 float dtype."""
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name} must be a JAX or numpy array, got {type(x).__name__}")
    dt = np.dtype(x.dtype)
    if not jnp.issubdtype(dt, jnp.floating) or dt.itemsize < 2:  # FP8 / FP4 formats
        raise TypeError(
            f"{name} must have a high-precision float dtype (float16, bfloat16, float32, "
            f"float64), got {dt}"
        )
    return jnp.asarray(x)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Float8Array:
    """FP8 data with the float32 factor that turns it back into real values (a pytree).

    Attributes:
        data: the FP8 payload (``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``), any shape.
        scale_inv: float32 0-d array; real value = ``data * scale_inv``.
        amax: float32 0-d array, ``max |x|`` of the high-precision input (None if unknown).
    """

    data: jax.Array
    scale_inv: jax.Array
    amax: jax.Array | None = None

    @property
    def fp8_format(self) -> FP8Format:
        return fp8_format_of(self.data.dtype, "data.dtype")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        """Real values ``data * scale_inv`` (computed in float32, then cast to ``dtype``)."""
        return dequantize(self, dtype)

    @property
    def T(self) -> Float8Array:
        """The transposed 2-D array (same scale)."""
        return Float8Array(self.data.T, self.scale_inv, self.amax)


def high_precision_dtype(dtype: Any, name: str = "dtype") -> np.dtype:
    """``dtype`` as a numpy dtype if it is a high-precision float (float32, bfloat16, float16;
    float64 too, for programs with ``jax_enable_x64``); else a TypeError naming ``name``."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating) or dt.name in FORMATS_BY_NAME:
        raise TypeError(
            f"{name} must be a high-precision float dtype (float32, bfloat16, float16; float64 "
            f"with jax_enable_x64), got {dtype!r}"
        )
    return dt


def dequantize(t: Float8Array, dtype: Any = jnp.float32) -> jax.Array:
    """``t.data * t.scale_inv`` in float32, cast to ``dtype`` (a high-precision float dtype)."""
    if not isinstance(t, Float8Array):
        raise TypeError(f"t must be a Float8Array, got {type(t).__name__}")
    dt = high_precision_dtype(dtype)
    out = t.data.astype(jnp.float32) * t.scale_inv
    return out if dt == np.float32 else out.astype(dt)


def stored(x: jax.Array) -> jax.Array:
    """``x`` rounded to its own dtype: the identity on a materialised array, and the rounding
    XLA may skip inside a compiled program for a bfloat16 / float16 result (excess precision).

    ``lax.reduce_precision`` to the dtype's own precision is what XLA keeps through its pass
    that removes convert pairs (it drops such no-op roundings only after that pass), so the
    FP8 cast and amax of ``x`` read the value a separately computed ``x`` would hold."""
    if x.dtype == jnp.bfloat16 or x.dtype == jnp.float16:
        info = jnp.finfo(x.dtype)
        return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return x


def master_weight(param: jax.Array, promoted: jax.Array) -> jax.Array:
    """The weight an FP8 layer quantizes: its parameter ``param`` itself where the layer's
    compute dtype (``promoted``, Flax's ``promote_dtype`` of it) would round it, as
    fp8kit.torch under ``torch.autocast`` and fp8kit.keras under a mixed policy quantize the
    float32 master weight; ``promoted`` where that is exact (a wider compute dtype). The weight
    gradient then comes back in the parameter's dtype (docs/jax.md, "Dtypes")."""
    if jnp.promote_types(param.dtype, promoted.dtype) == promoted.dtype:
        return promoted
    return param


@jax.jit
def nan_ignoring_amax(x: jax.Array) -> jax.Array:
    """``max |x|`` over all elements with NaN ignored, as a float32 0-d array (0 if none);
    ``x`` as stored (:func:`stored`)."""
    return _amax_of_stored(stored(x))


def _amax_of_stored(x: jax.Array) -> jax.Array:
    """:func:`nan_ignoring_amax` of an ``x`` that :func:`stored` has rounded already."""
    a = jnp.abs(x)
    a = jnp.where(jnp.isnan(a), jnp.zeros((), a.dtype), a)
    return jnp.max(a, initial=jnp.zeros((), a.dtype)).astype(jnp.float32)


def _canonical_nan(data: jax.Array, scaled: jax.Array, fmt: FP8Format) -> jax.Array:
    """Rewrite XLA's E5M2 NaN (``S.11111.10``) to ``S.11111.11``, the encoding PyTorch uses."""
    if fmt is not E5M2:
        return data  # E4M3 has a single NaN per sign (S.1111.111); XLA and PyTorch agree
    bits = jax.lax.bitcast_convert_type(data, jnp.uint8)
    bits = jnp.where(jnp.isnan(scaled), bits | jnp.uint8(1), bits)
    return jax.lax.bitcast_convert_type(bits, data.dtype)


@partial(jax.jit, static_argnums=2)
def cast_to_fp8(x: jax.Array, scale: jax.Array, fmt: FP8Format) -> tuple[jax.Array, jax.Array]:
    """Scale, saturate and round ``x`` into ``fmt``; also return ``max |x|`` (NaN ignored).

    Args:
        x: high-precision array, any shape, read as stored (:func:`stored`).
        scale: float32 0-d array (the quantization scale).
        fmt: target FP8 format.

    Returns:
        ``(data, amax)``: FP8 array of ``x.shape`` and a float32 0-d array.
    """
    x = stored(x)
    scaled = x.astype(jnp.float32) * jnp.asarray(scale, jnp.float32).reshape(())
    scaled = jnp.clip(scaled, -fmt.max, fmt.max)  # saturate; +-inf -> +-fmax; NaN stays NaN
    data = _canonical_nan(scaled.astype(jnp_dtype_of(fmt)), scaled, fmt)
    return data, _amax_of_stored(x)


def as_scale(scale: Any, name: str = "scale") -> jax.Array:
    """``scale`` as a float32 0-d array: a Python number checked by
    :func:`~fp8kit.formats.check_scale_number`, or a float32 one-element array (not read on the
    host, so not range-checked). ``name`` is the argument named in errors."""
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):  # numpy scalars too
        return jnp.asarray(check_scale_number(scale, name), jnp.float32)
    if not isinstance(scale, (jax.Array, np.ndarray)):
        raise TypeError(
            f"{name} must be a number or a float32 array with one element, got "
            f"{type(scale).__name__}"
        )
    if scale.dtype != jnp.float32 or scale.size != 1:
        raise TypeError(
            f"{name} must be a float32 array with one element, got dtype {scale.dtype} and "
            f"shape {tuple(scale.shape)}"
        )
    return jnp.asarray(scale).reshape(())


def quantize(x: Any, scale: Any, fp8_dtype: Any, scale_inv: jax.Array | None = None) -> Float8Array:
    """Quantize ``x`` with a given (delayed) ``scale``; one read of ``x`` yields data and amax.

    Args:
        x: float32 / bfloat16 / float16 array, any shape.
        scale: float or float32 one-element array, the factor ``x`` is multiplied by before the
            cast (``fmax / amax`` for delayed scaling; a divide-by scale such as seed 001's
            ``amax / fmax`` is ``scale_inv``, docs/semantics.md section 7). A Python number
            must lie in ``[2**-126, FLT_MAX]`` (ValueError otherwise); an array scale is not
            checked (it may be traced).
        fp8_dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2`` (or the format / its name).
        scale_inv: optional precomputed ``1 / scale`` (float32, one element).
    """
    x = check_high_precision(x)
    fmt = fp8_format_of(fp8_dtype)
    s = as_scale(scale)
    data, amax = cast_to_fp8(x, s, fmt)
    inv = jnp.reciprocal(s) if scale_inv is None else as_scale(scale_inv, "scale_inv")
    return Float8Array(data, inv, amax)


@partial(jax.jit, static_argnums=(1, 2))
def current_scale(amax: jax.Array, fmt: FP8Format, power_2_scale: bool = False) -> jax.Array:
    """Current-scaling factor ``fmax / amax`` (float32), 1 where amax is 0 or not finite."""
    return compute_scale(amax, jnp.ones_like(amax), fmt.max, 0, power_2_scale)


def quantize_current(x: Any, fp8_dtype: Any, power_2_scale: bool = False) -> Float8Array:
    """Current scaling: quantize ``x`` with ``fmax / max|x|`` (two reads of ``x``)."""
    if not isinstance(power_2_scale, bool):
        raise TypeError(f"power_2_scale must be a bool, got {power_2_scale!r}")
    x = check_high_precision(x)
    fmt = fp8_format_of(fp8_dtype)
    amax = nan_ignoring_amax(x)
    scale = current_scale(amax, fmt, power_2_scale)
    data, _ = cast_to_fp8(x, scale, fmt)
    return Float8Array(data, jnp.reciprocal(scale), amax)

"""FP8 GEMMs in the form XLA's GPU compiler runs as cuBLASLt FP8 GEMMs (docs/jax.md, "Lowering").

:func:`scaled_dot_general` multiplies two FP8 arrays with ``lax.dot_general`` (FP8 operands,
float32 accumulation, the result written in the requested dtype) and applies the product of the
two ``scale_inv`` factors as one scalar multiply of the result: the form XLA's GPU GEMM rewriter
turns into one ``__cublas$lt$matmul$f8`` call with the factor folded into the GEMM
(``docs/decisions/0110-jax-fp8-gemm-lowering.md``); on a CPU XLA converts the FP8 operands to
float32 (every FP8 value and every product of two is exact there) and runs a float32 GEMM.

:func:`fp8_matmul` is the low-level API of docs/semantics.md section 7 (seed 001) on top of it.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8kit.formats import E4M3, E5M2, FP8Format
from fp8kit.jax.quantization import (
    Float8Array,
    as_scale,
    cast_to_fp8,
    check_high_precision,
    fp8_format_of,
    high_precision_dtype,
)
from fp8kit.matmul_args import ACTIVATIONS, check_matmul_args

__all__ = [
    "ACTIVATIONS",
    "GEMM_ALIGNMENT",
    "fp8_matmul",
    "gemm_dtype",
    "pad_contraction",
    "scaled_dot_general",
]

GEMM_ALIGNMENT = 16
"""cuBLASLt FP8 GEMMs need every dimension a multiple of 16; contractions are padded to it."""

DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], ...]]


def gemm_dtype(compute_dtype: Any) -> np.dtype:
    """The dtype an FP8 GEMM writes for a result wanted in ``compute_dtype``.

    float32 and bfloat16 are written directly. float16 results are written as float32 and
    converted after the scale is applied: the unscaled sums of FP8 products (up to
    ``57344 * 448 * K``) overflow float16, and typical scale products underflow it.
    """
    dt = np.dtype(compute_dtype)
    return np.dtype(jnp.float32) if dt == np.dtype(jnp.float16) else dt


def pad_contraction(
    a: jax.Array, b: jax.Array, contracting: tuple[tuple[int, ...], tuple[int, ...]]
) -> tuple[jax.Array, jax.Array]:
    """Zero-pad one contracted axis of ``a`` and the matching axis of ``b`` so the contraction
    length (the product of the contracted sizes) is a multiple of :data:`GEMM_ALIGNMENT`.

    Of the contracted axes, the one giving the shortest padded contraction is padded (the last
    on a tie). Exact: the padded positions hold FP8 zeros and add nothing to any sum. Returns
    the operands unchanged when the contraction is already aligned (the usual case).
    """
    a_axes, b_axes = contracting
    sizes = [a.shape[d] for d in a_axes]
    b_sizes = [b.shape[d] for d in b_axes]
    if sizes != b_sizes:
        raise TypeError(
            "the contracted dimensions must have the same sizes, got "
            f"{tuple(sizes)} of shape {tuple(a.shape)} and {tuple(b_sizes)} of shape "
            f"{tuple(b.shape)}"
        )
    total = math.prod(sizes)
    if not sizes or total % GEMM_ALIGNMENT == 0:  # no contraction (an outer product): as is
        return a, b
    best: tuple[int, int, int] | None = None  # (padded length, position in a_axes, new size)
    for i, size in enumerate(sizes):
        others = total // size
        step = GEMM_ALIGNMENT // math.gcd(GEMM_ALIGNMENT, others)
        new = -(-size // step) * step
        if best is None or others * new <= best[0]:
            best = (others * new, i, new)
    assert best is not None
    _, i, new = best

    def pad(x: jax.Array, axis: int) -> jax.Array:
        widths = [(0, 0, 0)] * x.ndim
        widths[axis] = (0, new - x.shape[axis], 0)
        return lax.pad(x, jnp.zeros((), x.dtype), widths)

    return pad(a, a_axes[i]), pad(b, b_axes[i])


def _fp8_operand(x: Any, name: str) -> jax.Array:
    if not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be a JAX array of an FP8 dtype, got {type(x).__name__}")
    fp8_format_of(x.dtype, f"{name}.dtype")  # raises a TypeError naming the allowed dtypes
    return x


def scaled_dot_general(
    a: jax.Array,
    a_scale_inv: jax.Array,
    b: jax.Array,
    b_scale_inv: jax.Array,
    dimension_numbers: DimensionNumbers,
    out_dtype: Any,
) -> jax.Array:
    """``lax.dot_general(a, b) * (a_scale_inv * b_scale_inv)``: one FP8 GEMM.

    Args:
        a, b: FP8 arrays (``float8_e4m3fn`` / ``float8_e5m2``, not both E5M2: cuBLASLt has no
            E5M2 x E5M2 GEMM), any shapes ``dimension_numbers`` accepts.
        a_scale_inv, b_scale_inv: float32 0-d arrays; real value = FP8 value * scale_inv.
        dimension_numbers: as for ``jax.lax.dot_general``.
        out_dtype: dtype of the result (use :func:`gemm_dtype` of the compute dtype).

    Returns:
        The product in ``out_dtype``: products of FP8 values (exact) accumulated in float32
        (``Precision.HIGHEST``: no reduced-precision "fast accumulation" on GPUs), written in
        ``out_dtype``, then multiplied by the float32 factor ``a_scale_inv * b_scale_inv``
        rounded to ``out_dtype``. On GPUs XLA applies the factor inside the GEMM before the
        single rounding to ``out_dtype``.
    """
    a = _fp8_operand(a, "a")
    b = _fp8_operand(b, "b")
    if fp8_format_of(a.dtype) is E5M2 and fp8_format_of(b.dtype) is E5M2:
        raise ValueError(
            "a and b are both float8_e5m2: FP8 GEMMs take E4M3 x E4M3, E4M3 x E5M2 or "
            "E5M2 x E4M3 (cuBLASLt has no E5M2 x E5M2 GEMM)"
        )
    (lc, rc), batch = dimension_numbers
    a, b = pad_contraction(a, b, (tuple(lc), tuple(rc)))
    y = lax.dot_general(
        a,
        b,
        ((tuple(lc), tuple(rc)), batch),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=out_dtype,
    )
    factor = jnp.asarray(a_scale_inv, jnp.float32).reshape(()) * jnp.asarray(
        b_scale_inv, jnp.float32
    ).reshape(())
    return y * factor.astype(y.dtype)


def _apply_activation(y: jax.Array, activation: str | None) -> jax.Array:
    if activation is None:
        return y
    if activation == "relu":
        return jax.nn.relu(y)
    if activation == "gelu":
        return jax.nn.gelu(y, approximate=False)
    return jax.nn.gelu(y, approximate=True)


def fp8_matmul(
    a: Float8Array,
    b: Float8Array,
    *,
    out_dtype: Any = jnp.float32,
    bias: jax.Array | None = None,
    activation: str | None = None,
    out_scale: Any = None,
    out_fp8_dtype: Any = None,
) -> jax.Array | Float8Array:
    """``activation(a @ b + bias)``, optionally quantized to FP8 with a delayed output scale.

    The GEMM is :func:`scaled_dot_general` with a float32 result (an FP8 GEMM on GPUs); the
    bias, the activation and an FP8 output's quantization run in float32 after it, as in
    ``fp8kit.torch.fp8_matmul``.

    Args:
        a: ``(M, K)`` :class:`Float8Array`; b: ``(K, N)`` :class:`Float8Array` (not both E5M2).
        out_dtype: dtype of a high-precision result (float32, bfloat16, float16).
        bias: ``(N,)`` vector or ``(M, N)`` matrix, added in float32 after the GEMM.
        activation: None, ``"relu"``, ``"gelu"`` or ``"gelu_tanh"``, applied after the bias.
        out_scale: if given (float or float32 scalar array), the result is quantized with this
            (delayed) scale and returned as a :class:`Float8Array` whose ``amax`` is the
            high-precision result's amax: the value to record for the next step's scale.
        out_fp8_dtype: FP8 dtype of a quantized result (default ``jnp.float8_e4m3fn``).

    Returns:
        ``(M, N)`` array of ``out_dtype``, or a :class:`Float8Array` when ``out_scale`` is set.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Float8Array):
            raise TypeError(f"{name} must be a Float8Array, got {type(t).__name__}")
        inv = t.scale_inv
        if (
            not isinstance(inv, (jax.Array, np.ndarray))
            or inv.dtype != jnp.float32
            or inv.size != 1
        ):
            raise TypeError(
                f"{name}.scale_inv must be a float32 array with one element, got {inv!r}"
            )
    out_dtype = high_precision_dtype(out_dtype, "out_dtype")
    if out_scale is not None and out_dtype != np.float32:
        raise ValueError(
            f"out_dtype={out_dtype} is for a high-precision result; with out_scale the result is "
            "FP8 (choose its dtype with out_fp8_dtype)"
        )
    m, n = check_matmul_args(
        a.shape, b.shape, activation, out_scale is not None, out_fp8_dtype is not None
    )
    if bias is not None:
        bias = check_high_precision(bias, "bias")
        if tuple(bias.shape) not in ((n,), (m, n)):
            raise ValueError(f"bias must have shape ({n},) or ({m}, {n}), got {bias.shape}")
    if out_scale is None:
        return _matmul(a, b, bias, activation, out_dtype, None, None)
    fmt = E4M3 if out_fp8_dtype is None else fp8_format_of(out_fp8_dtype, "out_fp8_dtype")
    return _matmul(a, b, bias, activation, out_dtype, as_scale(out_scale, "out_scale"), fmt)


# Jitted, so a call run op by op gives the bits of the same call inside a jitted step (XLA may
# fuse the scale and the bias into one multiply-add), as the layers' jitted rules do.
@partial(jax.jit, static_argnums=(3, 4, 6))
def _matmul(
    a: Float8Array,
    b: Float8Array,
    bias: jax.Array | None,
    activation: str | None,
    out_dtype: np.dtype,
    scale: jax.Array | None,
    fmt: FP8Format | None,
) -> jax.Array | Float8Array:
    """:func:`fp8_matmul` of checked arguments (``scale``/``fmt`` None: high precision)."""
    y = scaled_dot_general(
        a.data, a.scale_inv, b.data, b.scale_inv, (((1,), (0,)), ((), ())), jnp.float32
    )
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    y = _apply_activation(y, activation)
    if scale is None or fmt is None:
        return y.astype(out_dtype)
    data, amax = cast_to_fp8(y, scale, fmt)
    return Float8Array(data, jnp.reciprocal(scale), amax)

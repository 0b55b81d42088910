"""Low-level FP8 matmul (SPEC section 7, seed 001): two :class:`Float8Array` in, high precision
or FP8 out.

The product is computed from dequantized float32 operands (``convert(q) * scale_inv``), the
pattern XLA rewrites into an FP8 GEMM (with fused bias / ReLU and a fused output amax) on GPUs
that have one. Every FP8 value and every product of two is exact in float32, so on a CPU this is
the FP8 GEMM up to the order of the float32 accumulation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fp8kit.formats import E4M3
from fp8kit.jax.quantization import (
    Float8Array,
    cast_to_fp8,
    dequantize,
    fp8_format_of,
)
from fp8kit.matmul_args import ACTIVATIONS, check_matmul_args

__all__ = ["ACTIVATIONS", "fp8_matmul"]


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

    Args:
        a: ``(M, K)`` :class:`Float8Array`; b: ``(K, N)`` :class:`Float8Array`.
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
    m, n = check_matmul_args(
        a.shape, b.shape, activation, out_scale is not None, out_fp8_dtype is not None
    )
    y = lax.dot_general(
        dequantize(a),
        dequantize(b),
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    if bias is not None:
        if not hasattr(bias, "shape") or tuple(bias.shape) not in ((n,), (m, n)):
            got = tuple(bias.shape) if hasattr(bias, "shape") else type(bias).__name__
            raise ValueError(f"bias must have shape ({n},) or ({m}, {n}), got {got}")
        y = y + bias.astype(jnp.float32)
    y = _apply_activation(y, activation)
    if out_scale is None:
        return y.astype(out_dtype)
    fmt = E4M3 if out_fp8_dtype is None else fp8_format_of(out_fp8_dtype, "out_fp8_dtype")
    scale = jnp.asarray(out_scale, jnp.float32).reshape(())
    data, amax = cast_to_fp8(y, scale, fmt)
    return Float8Array(data, jnp.reciprocal(scale), amax)

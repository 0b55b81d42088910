"""The FP8 GEMM (fp8kit.jax.gemm): scaled_dot_general against a float64 numpy reference for every
operand layout the layers use, exact zero padding of unaligned contractions, the dtype rules,
and refused operands."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8kit.jax as f8
from fp8kit.formats import E4M3 as E4M3_FORMAT
from fp8kit.jax.gemm import GEMM_ALIGNMENT, gemm_dtype, pad_contraction, scaled_dot_general
from tests.jax.helpers import bits
from tests.reference import quantize_reference

ROOT = Path(__file__).resolve().parents[2]

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def random_fp8(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    """Uniformly random FP8 bit patterns (subnormals, +-max included), non-finite ones -> 0."""
    data = rng.integers(0, 256, shape, dtype=np.uint8).view(np.dtype(dtype))
    return np.where(np.isfinite(data.astype(np.float32)), data, np.zeros((), dtype))


def dot_reference(a: np.ndarray, b: np.ndarray, dims) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``dot_general`` (and the same over |a|, |b| for error bounds), from numpy."""
    (lc, rc), (lb, rb) = dims
    la = [d for d in range(a.ndim) if d not in lc and d not in lb]
    ra = [d for d in range(b.ndim) if d not in rc and d not in rb]
    a2 = np.transpose(a.astype(np.float64), [*lb, *la, *lc])
    b2 = np.transpose(b.astype(np.float64), [*rb, *rc, *ra])
    nb = int(np.prod([a.shape[d] for d in lb]))
    k = int(np.prod([a.shape[d] for d in lc]))
    a3 = a2.reshape(nb, -1, k)
    b3 = b2.reshape(nb, k, -1)
    shape = [a.shape[d] for d in lb] + [a.shape[d] for d in la] + [b.shape[d] for d in ra]
    return (a3 @ b3).reshape(shape), (np.abs(a3) @ np.abs(b3)).reshape(shape)


# (lhs shape, rhs shape, dimension numbers, lhs dtype, rhs dtype): fprop, dgrad, wgrad layouts,
# two contracted axes, a batch axis; every contraction here is unaligned (not a multiple of 16)
CASES = {
    "fprop": ((20, 40), (40, 12), (((1,), (0,)), ((), ())), E4M3, E4M3),
    "dgrad": ((20, 12), (40, 12), (((1,), (1,)), ((), ())), E5M2, E4M3),
    "wgrad": ((20, 40), (20, 12), (((0,), (0,)), ((), ())), E4M3, E5M2),
    "two_axes": ((2, 3, 5, 8), (5, 8, 6), (((2, 3), (0, 1)), ((), ())), E4M3, E4M3),
    "batched": ((2, 12, 40), (2, 40, 24), (((2,), (1,)), ((0,), (0,))), E4M3, E4M3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_scaled_dot_general_matches_float64(rng, case) -> None:
    a_shape, b_shape, dims, a_dt, b_dt = CASES[case]
    a, b = random_fp8(rng, a_shape, a_dt), random_fp8(rng, b_shape, b_dt)
    sa, sb = np.float32(rng.uniform(1e-3, 1.0)), np.float32(rng.uniform(1e-3, 1.0))
    exact, bound = dot_reference(a, b, dims)
    factor = np.float64(np.float32(sa) * np.float32(sb))  # the one float32 product it applies
    y = np.asarray(scaled_dot_general(a, sa, b, sb, dims, jnp.float32), np.float64)
    k = int(np.prod([a.shape[d] for d in dims[0][0]]))
    # float32 accumulation of exact products, then one scaling: within (K + 2) float32 ulps
    np.testing.assert_array_less(np.abs(y - exact * factor), (k + 2) * 2.0**-24 * bound * factor)
    assert y.shape == exact.shape
    # bfloat16 result: the unscaled sum and the factor rounded to bfloat16, then the product
    yb = scaled_dot_general(a, sa, b, sb, dims, jnp.bfloat16)
    assert yb.dtype == jnp.bfloat16
    err = np.abs(np.asarray(yb, np.float64) - exact * factor)
    np.testing.assert_array_less(err, 3 * 2.0**-8 * bound * factor + 1e-30)


def test_padding_is_exact_zeros_and_minimal(rng) -> None:
    a, b = random_fp8(rng, (3, 5, 8), E4M3), random_fp8(rng, (5, 8, 4), E4M3)
    pa, pb = pad_contraction(jnp.asarray(a), jnp.asarray(b), ((1, 2), (0, 1)))
    # 5 x 8 = 40 -> 48: padding the 5 to 6 is shorter than padding the 8 to 16 (80)
    assert pa.shape == (3, 6, 8) and pb.shape == (6, 8, 4)
    np.testing.assert_array_equal(bits(pa)[:, :5], bits(a))
    np.testing.assert_array_equal(bits(pb)[:5], bits(b))
    assert not bits(pa)[:, 5:].any() and not bits(pb)[5:].any()  # FP8 zero is the zero byte
    x, w = jnp.asarray(random_fp8(rng, (4, 7), E4M3)), jnp.asarray(random_fp8(rng, (7, 2), E4M3))
    px, pw = pad_contraction(x, w, ((1,), (0,)))
    assert px.shape == (4, GEMM_ALIGNMENT) and pw.shape == (GEMM_ALIGNMENT, 2)
    aligned = jnp.asarray(random_fp8(rng, (4, 32), E4M3))
    assert pad_contraction(aligned, aligned.T, ((1,), (0,)))[0] is aligned


def test_refused_operands() -> None:
    e5 = jnp.zeros((16, 16), E5M2)
    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        scaled_dot_general(e5, 1.0, e5, 1.0, (((1,), (0,)), ((), ())), jnp.float32)
    with pytest.raises(TypeError, match=r"a\.dtype must be one of"):
        scaled_dot_general(jnp.zeros((16, 16)), 1.0, e5, 1.0, (((1,), (0,)), ((), ())), "f4")
    a = f8.quantize(jnp.ones((16, 16)), 1.0, E5M2)
    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        f8.fp8_matmul(a, a)
    e4 = jnp.zeros((4, 10), E4M3)
    with pytest.raises(TypeError, match=r"contracted dimensions must have the same sizes, got"):
        scaled_dot_general(e4, 1.0, jnp.zeros((16, 8), E4M3), 1.0, (((1,), (0,)), ((), ())), "f4")
    b = f8.quantize(jnp.ones((16, 8)), 1.0, E4M3)
    q = f8.quantize(jnp.ones((4, 16)), 1.0, E4M3)
    for dtype in (jnp.int32, "bf16"):
        with pytest.raises(TypeError, match="out_dtype must be a high-precision float dtype"):
            f8.fp8_matmul(q, b, out_dtype=dtype)
    with pytest.raises(ValueError, match="with out_scale the result is FP8"):
        f8.fp8_matmul(q, b, out_dtype=jnp.bfloat16, out_scale=1.0)
    for scale in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises((ValueError, TypeError), match=r"^out_scale must be a (finite )?number"):
            f8.fp8_matmul(q, b, out_scale=scale)
    # a bias of another kind was cast silently (a complex one lost its imaginary part)
    for bias in (jnp.ones(8, jnp.int32), jnp.ones(8, bool), jnp.ones(8, jnp.complex64), b.data[0]):
        with pytest.raises(TypeError, match="bias must have a high-precision float dtype"):
            f8.fp8_matmul(q, b, bias=bias)
    wide = f8.Float8Array(q.data, jnp.ones(2, jnp.float32))
    with pytest.raises(TypeError, match=r"a\.scale_inv must be a float32 array with one element"):
        f8.fp8_matmul(wide, b)


_EAGER_VS_JIT = """
import jax, jax.numpy as jnp, numpy as np
import fp8kit.jax as f8
rng = np.random.default_rng(7)
e4m3 = jnp.float8_e4m3fn
a = f8.quantize(jnp.asarray(rng.standard_normal((8, 32)) * 3, jnp.float32), 448 / 9, e4m3)
b = f8.quantize(jnp.asarray(rng.standard_normal((32, 16)), jnp.float32), 448 / 3, e4m3)
bias = jnp.asarray(rng.standard_normal(16), jnp.float32)
for kw in ({}, {"out_scale": 2.5}, {"activation": "gelu", "out_scale": 2.5}):
    matmul = lambda a, b, bias: f8.fp8_matmul(a, b, bias=bias, **kw)
    eager, jitted = matmul(a, b, bias), jax.jit(matmul)(a, b, bias)
    for x, y in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(kw))
"""


def test_fp8_matmul_gives_the_bits_of_a_jitted_step() -> None:
    """Run op by op, the bias add after the scale multiply rounded twice where a jitted call
    (XLA fuses them into one multiply-add) rounds once: the FP8 output's amax, the next step's
    delayed scale, came out different eager and jitted. XLA contracts only at its default
    optimisation level, which these tests lower (conftest.py), so the check runs in a process
    of its own at that level."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    env = dict(os.environ, XLA_FLAGS=" ".join(f for f in flags if "optimization_level" not in f))
    done = subprocess.run(
        [sys.executable, "-c", _EAGER_VS_JIT],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_gemm_dtype() -> None:
    assert gemm_dtype(jnp.bfloat16) == jnp.bfloat16 and gemm_dtype(jnp.float32) == jnp.float32
    assert gemm_dtype(jnp.float16) == jnp.float32  # see the float16 test below


def test_float16_layer_does_not_overflow_in_the_gemm() -> None:
    """Scaled FP8 values (448 = E4M3 max) whose unscaled sum, 448 * 448 * 64 = 1.3e7, is past
    float16's 65504 while the real result, 1.75 * 1.75 * 64 = 196, is not."""
    meta = f8.init_meta(1, f8.DelayedScaling(amax_history_len=2))
    scale = jnp.full((3,), 256.0, jnp.float32)
    meta = replace(meta, forward=replace(meta.forward, scale=scale))
    x = jnp.full((16, 64), 1.75, jnp.float16)
    y = f8.dot_general(x, x.T, (((1,), (0,)), ((), ())), meta)
    assert y.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.full((16, 16), 196.0))


def test_fp8_matmul_matches_float64_with_bias_and_relu(rng) -> None:
    a = f8.quantize(jnp.asarray(rng.standard_normal((24, 40)), jnp.float32), 64.0, E4M3)
    b = f8.quantize(jnp.asarray(rng.standard_normal((40, 8)), jnp.float32), 32.0, E4M3)
    bias = rng.standard_normal(8).astype(np.float32)
    y = f8.fp8_matmul(a, b, bias=jnp.asarray(bias), activation="relu", out_dtype=jnp.bfloat16)
    exact, bound = dot_reference(np.asarray(a.data), np.asarray(b.data), (((1,), (0,)), ((), ())))
    want = np.maximum(exact / 64 / 32 + bias, 0)
    assert y.dtype == jnp.bfloat16
    err = np.abs(np.asarray(y, np.float64) - want)
    np.testing.assert_array_less(err, 2.0**-8 * (bound / 2048 + np.abs(bias)) + 1e-30)
    f32 = jax.jit(lambda a, b: f8.fp8_matmul(a, b))(a, b)
    np.testing.assert_allclose(np.asarray(f32), exact / 2048, rtol=1e-6, atol=1e-6)


def test_padding_ties_pad_the_last_contracted_axis(rng) -> None:
    # 3 x 3 = 9: padding either 3 to 16 gives 48, so the last contracted axis is padded
    a, b = random_fp8(rng, (2, 3, 3), E4M3), random_fp8(rng, (3, 3, 4), E4M3)
    pa, pb = pad_contraction(jnp.asarray(a), jnp.asarray(b), ((1, 2), (0, 1)))
    assert pa.shape == (2, 3, GEMM_ALIGNMENT) and pb.shape == (3, GEMM_ALIGNMENT, 4)
    np.testing.assert_array_equal(bits(pa)[:, :, :3], bits(a))
    np.testing.assert_array_equal(bits(pb)[:, :3], bits(b))
    assert not bits(pa)[:, :, 3:].any() and not bits(pb)[:, 3:].any()


def test_fp8_matmul_fp8_output_against_float64(rng) -> None:
    """``out_scale`` given: the data are the float32 result quantized with that scale, the
    ``scale_inv`` is its float32 reciprocal (so ``dequantize`` gives the result back to E4M3
    precision) and ``amax`` the high-precision result's amax."""
    a = f8.quantize(jnp.asarray(rng.standard_normal((16, 32)), jnp.float32), 64.0, E4M3)
    b = f8.quantize(jnp.asarray(rng.standard_normal((32, 8)), jnp.float32), 32.0, E4M3)
    out_scale = 4.0
    c = f8.fp8_matmul(a, b, out_scale=out_scale)
    exact, _ = dot_reference(np.asarray(a.data), np.asarray(b.data), (((1,), (0,)), ((), ())))
    # the float32 result it quantizes: the same GEMM without out_scale, against float64
    y32 = np.asarray(f8.fp8_matmul(a, b))
    np.testing.assert_allclose(y32, exact / 2048, rtol=1e-6, atol=1e-6)
    assert np.asarray(c.scale_inv) == np.float32(1) / np.float32(out_scale)
    assert float(c.amax) == np.abs(y32).max()
    want, _ = quantize_reference(y32, out_scale, E4M3_FORMAT)
    np.testing.assert_array_equal(np.asarray(c.data, np.float64), want)
    np.testing.assert_array_equal(np.asarray(c.dequantize(), np.float64), want / out_scale)

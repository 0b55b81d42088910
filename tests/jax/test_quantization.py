"""docs/semantics.md section 2 through fp8kit.jax: quantize / dequantize / current scaling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8kit.jax as f8
from fp8kit.formats import E4M3, E5M2
from tests.jax.helpers import TINY, bits, edge_values, random_fp8_friendly
from tests.reference import fp8_round, quantize_reference

FORMATS = [(E4M3, jnp.float8_e4m3fn), (E5M2, jnp.float8_e5m2)]


def _values(q: f8.Float8Array) -> np.ndarray:
    return np.asarray(q.data).astype(np.float64)


def _assert_same_values(got: np.ndarray, want: np.ndarray) -> None:
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok], want[ok])
    # signed zeros too
    np.testing.assert_array_equal(np.signbit(got[ok]), np.signbit(want[ok]))


def test_spec10_11_e4m3_and_e5m2_casts_at_scale_one() -> None:
    x = np.array([300, 1000, -17, 0.3, 1e-4, 3 * 2.0**-10], np.float32)
    q = f8.quantize(x, 1.0, jnp.float8_e4m3fn)
    np.testing.assert_array_equal(_values(q), [288, 448, -16, 0.3125, 0, 2.0**-8])
    y = np.array([1e-5, 5e-6, 60000, 3.3], np.float32)
    q = f8.quantize(y, 1.0, jnp.float8_e5m2)
    np.testing.assert_array_equal(_values(q), [2.0**-16, 0, 57344, 3.5])


def test_spec10_12_scale_and_dequantize() -> None:
    scale = np.float32(448.0) / np.float32(3.0)
    q = f8.quantize(np.array([1, -3, 2, 0.1], np.float32), jnp.asarray(scale), "float8_e4m3fn")
    np.testing.assert_array_equal(_values(q), [144, -448, 288, 15])
    np.testing.assert_array_equal(
        np.asarray(q.dequantize()),
        np.array([0.96428573, -3, 1.9285715, 0.10044643], np.float32),
    )
    assert float(q.amax) == 3.0
    assert np.asarray(q.scale_inv) == np.float32(1) / scale  # one correctly rounded division


@pytest.mark.parametrize("fmt,dtype", FORMATS)
def test_random_inputs_match_reference(rng: np.random.Generator, fmt, dtype) -> None:
    x = random_fp8_friendly(rng, (64, 33))
    for scale in (1.0, float(rng.uniform(0.01, 300)), fmt.max / float(np.abs(x).max())):
        q = jax.jit(lambda a, s: f8.quantize(a, s, dtype))(x, jnp.float32(scale))
        want, amax = quantize_reference(x, scale, fmt)
        _assert_same_values(_values(q), want)
        assert float(q.amax) == amax
        assert q.data.dtype == dtype and q.data.shape == x.shape


@pytest.mark.parametrize("fmt,dtype", FORMATS)
def test_edge_values(fmt, dtype) -> None:
    x = edge_values(fmt)
    for scale in (1.0, 0.5, 2.0):
        q = f8.quantize(x, scale, dtype)
        want, amax = quantize_reference(x, scale, fmt)
        _assert_same_values(_values(q), want)
        assert float(q.amax) == amax == np.inf  # the inf element; NaN is ignored
    # saturation: |x * scale| > fmax and +-inf map to +-fmax, never to inf/NaN
    q = f8.quantize(np.array([np.inf, -np.inf, 1e30, -1e30], np.float32), 1.0, dtype)
    np.testing.assert_array_equal(_values(q), [fmt.max, -fmt.max, fmt.max, -fmt.max])


@pytest.mark.parametrize("fmt,dtype", FORMATS)
def test_every_fp8_value_round_trips_and_ties_go_to_even(fmt, dtype) -> None:
    every = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    finite = np.unique(every[np.isfinite(every)])
    q = f8.quantize(finite, 1.0, dtype)
    np.testing.assert_array_equal(_values(q), finite)
    mids = ((finite[1:].astype(np.float64) + finite[:-1]) / 2).astype(np.float32)
    mids = mids[mids.astype(np.float64) == (finite[1:].astype(np.float64) + finite[:-1]) / 2]
    q = f8.quantize(mids, 1.0, dtype)
    np.testing.assert_array_equal(_values(q), fp8_round(mids, fmt))


def test_nan_bytes_are_canonical() -> None:
    x = np.array([np.nan, -np.nan, 1.0], np.float32)
    e4 = bits(f8.quantize(x, 1.0, jnp.float8_e4m3fn).data)
    e5 = bits(f8.quantize(x, 1.0, jnp.float8_e5m2).data)
    assert e4[:2].tolist() == [0x7F, 0xFF]
    assert e5[:2].tolist() == [0x7F, 0xFF]  # XLA alone would give 0x7E / 0xFE
    assert np.isnan(np.array(e5[:2]).view(ml_dtypes.float8_e5m2).astype(np.float32)).all()


def test_all_nan_and_empty_record_zero_amax() -> None:
    assert float(f8.quantize(np.full((3,), np.nan, np.float32), 1.0, E4M3).amax) == 0.0
    assert float(f8.quantize(np.zeros((0, 4), np.float32), 1.0, E4M3).amax) == 0.0


def test_float32_subnormal_inputs_are_flushed_by_xla() -> None:
    """A documented platform fact (docs/decisions/0102): XLA CPU flushes float32 subnormals."""
    x = np.array([TINY / 4, -TINY / 8, 0.5], np.float32)
    q = f8.quantize(x, 2.0**100, jnp.float8_e4m3fn)
    np.testing.assert_array_equal(_values(q), [0.0, -0.0, 448.0])
    tiny_only = f8.quantize(np.array([TINY / 4], np.float32) * np.ones(8, np.float32), 1.0, E4M3)
    assert float(tiny_only.amax) == 0.0  # the slot then counts as "did not run" (zero-skip)


def test_bfloat16_and_float16_inputs(rng: np.random.Generator) -> None:
    x32 = random_fp8_friendly(rng, (17, 5))
    for dt in (jnp.bfloat16, jnp.float16):
        x = jnp.asarray(x32).astype(dt)
        q = f8.quantize(x, 3.0, jnp.float8_e4m3fn)
        want, amax = quantize_reference(np.asarray(x.astype(jnp.float32)), 3.0, E4M3)
        _assert_same_values(_values(q), want)
        assert float(q.amax) == amax
        assert q.dequantize(dt).dtype == dt


@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_a_half_precision_result_of_the_same_program_is_cast_as_stored(
    rng: np.random.Generator, dt
) -> None:
    """XLA may keep a bfloat16 / float16 result in float32 within one compiled program
    (``--xla_allow_excess_precision``, on by default); the cast and its amax must read the
    stored (rounded) tensor, as the same cast of a materialised array does (SPEC section 2)."""
    x = jnp.asarray(rng.uniform(-2, 2, (64, 64)), dt)

    def activation(a: jax.Array) -> jax.Array:
        return jnp.tanh(a) * jnp.asarray(3.1, dt)

    for fmt, dtype in FORMATS:
        for cast in (f8.quantize, lambda a, s, d: f8.quantize_current(a, d)):
            fused = jax.jit(lambda a, c=cast, d=dtype: c(activation(a), 37.0, d))(x)
            stored = activation(x)  # op by op: every result is materialised in dt
            want = cast(stored, 37.0, dtype)
            assert np.array_equal(bits(fused.data), bits(want.data)), (fmt, cast)
            assert float(fused.amax) == float(want.amax) == float(jnp.abs(stored).max())


def test_quantize_current_uses_fmax_over_own_amax(rng: np.random.Generator) -> None:
    x = random_fp8_friendly(rng, (40,))
    amax = float(np.abs(x).max())
    scale = float(np.float32(448.0) / np.float32(amax))
    q = f8.quantize_current(x, jnp.float8_e4m3fn)
    want, _ = quantize_reference(x, scale, E4M3)
    _assert_same_values(_values(q), want)
    assert float(np.abs(_values(q)).max()) == 448.0
    p2 = f8.quantize_current(x, jnp.float8_e5m2, power_2_scale=True)
    inv = float(p2.scale_inv)
    assert inv == 2.0 ** round(np.log2(inv)) and 57344 / 2 < amax / inv <= 57344
    zero = f8.quantize_current(np.zeros(4, np.float32), E4M3)
    assert float(zero.scale_inv) == 1.0  # unusable amax keeps scale 1


def test_pytree_and_transpose(rng: np.random.Generator) -> None:
    q = f8.quantize(random_fp8_friendly(rng, (3, 5)), 2.0, E5M2)
    leaves, treedef = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 3
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    np.testing.assert_array_equal(bits(again.data), bits(q.data))
    assert q.T.shape == (5, 3) and q.fp8_format is E5M2
    jitted = jax.jit(lambda t: t.dequantize())(q)
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(q.dequantize()))


def test_bad_inputs_name_the_parameter() -> None:
    x = np.ones(3, np.float32)
    with pytest.raises(TypeError, match="fp8_dtype"):
        f8.quantize(x, 1.0, jnp.float16)
    with pytest.raises(TypeError, match="fp8_dtype"):
        f8.quantize(x, 1.0, "float8_e4m3")
    with pytest.raises(
        TypeError, match=r"dtype \(float16, bfloat16, float32, float64\), got int32"
    ):
        f8.quantize(np.ones(3, np.int32), 1.0, E4M3)
    for low in (jnp.float8_e4m3fn, jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz, jnp.float4_e2m1fn):
        with pytest.raises(TypeError, match="x must have a high-precision float dtype"):
            f8.quantize(jnp.ones(3, low), 1.0, E4M3)
    with pytest.raises(TypeError, match="scale"):
        f8.quantize(x, jnp.ones(2, jnp.float32), E4M3)
    with pytest.raises(TypeError, match="scale"):
        f8.quantize(x, "1", E4M3)
    with pytest.raises(TypeError, match="dtype must be"):
        f8.dequantize(f8.quantize(x, 1.0, E4M3), jnp.int8)


def test_a_numpy_scalar_scale_is_a_number() -> None:
    """``np.float32(0.25)`` was refused as "not a float" although it is one (and checked as one)."""
    assert float(f8.quantize(np.ones(3, np.float32), np.float32(0.25), E4M3).scale_inv) == 4.0
    with pytest.raises(ValueError, match="scale must be a finite number"):
        f8.quantize(np.ones(3, np.float32), np.float32(0.0), E4M3)


@pytest.mark.parametrize(
    "scale", [0.0, -1.0, -2, float("nan"), float("inf"), 1e39, 1e-39], ids=repr
)
def test_zero_negative_or_non_finite_float_scale_is_refused(scale: float) -> None:
    with pytest.raises(ValueError) as info:
        f8.quantize(np.ones(3, np.float32), scale, E4M3)
    assert str(info.value) == (
        "scale must be a finite number from 2**-126 to 3.4028234663852886e+38 (a positive normal "
        f"float32, so that it and its reciprocal are finite), got {scale!r}"
    )
    q = f8.quantize(np.ones(3, np.float32), 2.0**-126, E5M2)  # the smallest allowed scale
    assert np.isfinite(float(q.scale_inv)) and np.isfinite(np.asarray(q.dequantize())).all()

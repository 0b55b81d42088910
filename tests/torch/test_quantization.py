"""docs/semantics.md section 2: quantize / dequantize / current scaling against the numpy
reference."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

import fp8kit.torch as f8
from fp8kit.formats import E4M3, E5M2, FP8Format
from tests.reference import current_scale_reference, fp8_round, quantize_reference

FORMATS = [(torch.float8_e4m3fn, E4M3), (torch.float8_e5m2, E5M2)]


def _values(q: f8.Float8Tensor) -> np.ndarray:
    return q.data.to(torch.float64).numpy()


def test_spec_worked_number_11_cast_values() -> None:
    e4 = f8.quantize(torch.tensor([300.0, 1000.0, -17.0, 0.3, 1e-4, 3 * 2**-10]), 1.0, E4M3)
    assert _values(e4).tolist() == [288.0, 448.0, -16.0, 0.3125, 0.0, 2**-8]
    e5 = f8.quantize(torch.tensor([1e-5, 5e-6, 60000.0, 3.3]), 1.0, torch.float8_e5m2)
    assert _values(e5).tolist() == [2**-16, 0.0, 57344.0, 3.5]


def test_spec_worked_number_12_scaled_cast_and_dequantize() -> None:
    scale = torch.tensor(448.0 / 3.0)
    q = f8.quantize(torch.tensor([1.0, -3.0, 2.0, 0.1]), scale, torch.float8_e4m3fn)
    assert _values(q).tolist() == [144.0, -448.0, 288.0, 15.0]
    expected = np.array([0.96428573, -3.0, 1.9285715, 0.10044643], np.float32)
    np.testing.assert_array_equal(q.dequantize().numpy(), expected)
    assert q.amax.item() == 3.0
    assert q.scale_inv.dtype == torch.float32 and q.scale_inv.dim() == 0
    assert q.scale_inv.item() == np.float32(1.0) / np.float32(scale.item())


@pytest.mark.parametrize(("dtype", "fmt"), FORMATS)
@pytest.mark.parametrize("scale", [1.0, 448.0 / 3.0, 2.0**-7, 12345.678])
def test_random_values_match_reference(dtype: torch.dtype, fmt: FP8Format, scale: float) -> None:
    # A fixed seed per case (str hashes change between processes: a failure must reproduce).
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype} {scale!r}".encode()))
    x = torch.randn(4099, generator=gen) * torch.exp2(torch.randint(-12, 12, (4099,)).float())
    q = f8.quantize(x, scale, dtype)
    ref, amax = quantize_reference(x.numpy(), scale, fmt)
    np.testing.assert_array_equal(_values(q), ref)
    assert q.amax.item() == amax


@pytest.mark.parametrize(("dtype", "fmt"), FORMATS)
def test_edge_values(dtype: torch.dtype, fmt: FP8Format) -> None:
    fmax, sub = fmt.max, fmt.min_subnormal
    # Midpoints between neighbours exercise ties-to-even; values past fmax saturate.
    edges = [0.0, -0.0, sub, -sub, sub / 2, sub * 0.51, sub * 1.5, fmt.min_normal, fmax, -fmax]
    edges += [fmax * 1.01, -fmax * 1.5, 3.4e38, math.inf, -math.inf, 1 + 2**-4, 1 + 3 * 2**-4]
    x = torch.tensor(edges, dtype=torch.float32)
    q = f8.quantize(x, 1.0, dtype)
    ref, _ = quantize_reference(x.numpy(), 1.0, fmt)
    np.testing.assert_array_equal(_values(q), ref)
    assert _values(q)[-4:-2].tolist() == [fmax, -fmax]  # +-inf saturate
    assert q.amax.item() == math.inf


@pytest.mark.parametrize(("dtype", "fmt"), FORMATS)
def test_nan_stays_nan_and_is_ignored_by_amax(dtype: torch.dtype, fmt: FP8Format) -> None:
    x = torch.tensor([1.0, math.nan, -7.0, math.nan])
    q = f8.quantize(x, 2.0, dtype)
    v = _values(q)
    assert math.isnan(v[1]) and math.isnan(v[3])
    assert v[0] == 2.0 and v[2] == -14.0
    assert q.amax.item() == 7.0
    all_nan = f8.quantize(torch.full((5,), math.nan), 1.0, dtype)
    assert all_nan.amax.item() == 0.0
    empty = f8.quantize(torch.zeros(0, 3), 1.0, dtype)
    assert empty.data.shape == (0, 3) and empty.amax.item() == 0.0


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("dtype", "fmt"), FORMATS)
def test_low_precision_inputs(in_dtype: torch.dtype, dtype: torch.dtype, fmt: FP8Format) -> None:
    x = (torch.randn(1000) * 50).to(in_dtype)
    q = f8.quantize(x, 3.0, dtype)
    ref, amax = quantize_reference(x.to(torch.float32).numpy(), 3.0, fmt)
    np.testing.assert_array_equal(_values(q), ref)
    assert q.amax.item() == amax
    assert q.data.shape == x.shape


def test_every_bfloat16_bit_pattern_matches_reference() -> None:
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    for dtype, fmt in FORMATS:
        q = f8.quantize(x, 1.0, dtype)
        ref = fp8_round(x.to(torch.float64).numpy(), fmt)
        got = _values(q)
        both_nan = np.isnan(got) & np.isnan(ref)
        np.testing.assert_array_equal(got[~both_nan], ref[~both_nan])
        assert (np.isnan(got) == np.isnan(ref)).all()


def test_dequantize_dtypes_and_transpose() -> None:
    x = torch.randn(32, 48)
    q = f8.quantize(x, 8.0, torch.float8_e4m3fn)
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert q.t().shape == (48, 32)
    torch.testing.assert_close(q.t().dequantize(), q.dequantize().t(), rtol=0, atol=0)
    rel = (q.dequantize() - x).norm() / x.norm()
    assert rel < 2**-4  # E4M3 keeps 3 mantissa bits: relative error per element <= 2^-4


@pytest.mark.parametrize(("dtype", "fmt"), FORMATS)
def test_current_scaling_uses_the_tensors_own_amax(dtype: torch.dtype, fmt: FP8Format) -> None:
    x = torch.randn(513) * 0.01
    q = f8.quantize_current(x, dtype)
    amax = np.float32(np.abs(x.numpy()).max())
    scale = np.float32(fmt.max) / amax
    ref, _ = quantize_reference(x.numpy(), float(scale), fmt)
    np.testing.assert_array_equal(_values(q), ref)
    assert q.scale_inv.item() == np.float32(1.0) / scale
    assert np.abs(_values(q)).max() == fmt.max  # the largest element lands exactly on fmax
    zeros = f8.quantize_current(torch.zeros(4), dtype)
    assert zeros.scale_inv.item() == 1.0


def test_bad_input_messages() -> None:
    x = torch.randn(4)
    with pytest.raises(TypeError, match=r"fp8_dtype must be one of"):
        f8.quantize(x, 1.0, torch.float16)
    with pytest.raises(TypeError, match="x must have dtype"):
        f8.quantize(torch.arange(4), 1.0, torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="scale must be a float32 tensor"):
        f8.quantize(x, torch.tensor([1.0, 2.0]), torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="scale must be a number or a float32 tensor, got str"):
        f8.quantize(x, "2", torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="dtype must be"):
        f8.quantize(x, 1.0, torch.float8_e4m3fn).dequantize(torch.int8)
    with pytest.raises(ValueError, match=r"one device"):
        f8.quantize(x, torch.tensor(1.0, device="meta"), torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="scale_inv must be a float32 tensor"):
        f8.quantize(x, 2.0, torch.float8_e4m3fn, scale_inv=torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match=r"^scale_inv must be a finite number"):
        f8.quantize(x, 2.0, torch.float8_e4m3fn, scale_inv=0.0)
    assert f8.quantize(x, 2.0, torch.float8_e4m3fn, scale_inv=0.5).scale_inv.item() == 0.5
    # Not bools: a truthy string asked for power-of-two scales.
    for flag in ("power_2_scale", "transpose"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool, got 'no'"):
            f8.quantize_current(x.view(2, 2), torch.float8_e4m3fn, **{flag: "no"})


def test_dequantize_checks_its_float8_tensor() -> None:
    """Data that is not FP8 and a scale_inv that is not one float32 element were multiplied
    anyway (a (1, 1, 1) scale_inv changed the result's shape)."""
    q = f8.quantize(torch.randn(4, 16), 2.0, torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"t\.data's dtype must be one of"):
        f8.dequantize(f8.Float8Tensor(torch.tensor([1, 2, 3]), torch.tensor(0.5)))
    for bad in (torch.tensor([1.0, 100.0]), torch.tensor(0.5, dtype=torch.float64)):
        with pytest.raises(TypeError, match=r"t\.scale_inv must be a float32 tensor with one"):
            f8.Float8Tensor(q.data[:, :2], bad).dequantize()
    nested = f8.Float8Tensor(q.data, torch.tensor([[[0.5]]]))
    assert torch.equal(nested.dequantize(), q.data.float() * 0.5)


def test_a_numpy_scalar_scale_is_a_number() -> None:
    """``np.float32(0.25)`` was refused as "not a float" although it is one (and checked as one)."""
    assert float(f8.quantize(torch.ones(4), np.float32(0.25), torch.float8_e4m3fn).scale_inv) == 4.0
    with pytest.raises(ValueError, match="scale must be a finite number"):
        f8.quantize(torch.ones(4), np.float32(0.0), torch.float8_e4m3fn)


BAD_SCALES = [0, 0.0, -0.0, -1.0, -3, math.nan, math.inf, -math.inf, 1e39, 1e-39, 2.0**-127]


@pytest.mark.parametrize("scale", BAD_SCALES, ids=repr)
def test_zero_negative_or_non_finite_float_scale_is_refused(scale: float) -> None:
    """Scale 0 used to give all-NaN dequantized data: a Python-number scale is checked first."""
    with pytest.raises(ValueError) as info:
        f8.quantize(torch.ones(4), scale, torch.float8_e4m3fn)
    assert str(info.value) == (
        "scale must be a finite number from 2**-126 to 3.4028234663852886e+38 (a positive normal "
        f"float32, so that it and its reciprocal are finite), got {scale!r}"
    )


def test_float_scales_at_the_ends_of_the_allowed_range() -> None:
    x = torch.tensor([1.0, -2.0, 0.0])
    for scale in (2.0**-126, 3.4028234663852886e38, 10**38):
        q = f8.quantize(x, scale, torch.float8_e5m2)
        inv = q.scale_inv.item()
        assert math.isfinite(inv) and inv > 0
        assert torch.isfinite(q.dequantize()).all()
    with pytest.raises(ValueError, match=r"^scale must be a finite number from 2\*\*-126"):
        f8.quantize(x, 10**400, torch.float8_e4m3fn)  # too large even for a Python float


def test_tensor_scale_is_not_read_on_the_host() -> None:
    """A tensor scale stays on its device: its value is the caller's responsibility."""
    q = f8.quantize(torch.ones(2), torch.tensor(0.0), torch.float8_e4m3fn)
    assert q.scale_inv.item() == math.inf  # not checked (documented), unlike a float scale


def test_quantize_current_power_2_scale_is_spec_worked_number_9():
    """Kills Z02 (quantization.py `current_scale`: power_2_scale dropped). SPEC 10.9: amax 3 ->
    128; amax 0.001 -> 262144 (SPEC 1, Float8CurrentScaling's power_2_scale)."""
    for amax, expected in ((3.0, 128.0), (0.001, 262144.0)):
        x = torch.tensor([amax, -amax / 2, 0.0], dtype=torch.float32)
        q = f8.quantize_current(x, torch.float8_e4m3fn, power_2_scale=True)
        assert current_scale_reference(np.float32(amax), E4M3.max, True) == expected
        assert q.scale_inv.item() == 1.0 / expected
        want = fp8_round(x.double().numpy() * expected, E4M3)
        np.testing.assert_array_equal(q.data.double().numpy(), want)


def test_quantize_current_ignores_nan_in_its_amax():
    """Kills Z03 (quantization.py `nan_ignoring_amax`: `x.abs().max()` on the CPU path, NaN
    propagating). SPEC 2 / 9: NaN elements never enter the amax; the scale stays finite and
    the other elements are cast with fmax / max|finite x|."""
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.tensor([1.0, float("nan"), -3.0, 0.5], dtype=dtype)
        q = f8.quantize_current(x, torch.float8_e4m3fn)
        assert q.amax.item() == 3.0
        scale = np.float32(E4M3.max) / np.float32(3.0)
        assert q.scale_inv.item() == np.float32(1.0) / scale
        data = q.data.float().numpy()
        assert np.isnan(data[1])
        want = fp8_round(np.array([1.0, -3.0, 0.5], np.float32) * scale, E4M3)
        np.testing.assert_array_equal(data[[0, 2, 3]], want)

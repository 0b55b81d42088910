"""The fused FP8 cast kernels (fp8kit.torch.kernels) against the pure-torch reference, bit for bit.

Every native result is compared with ``cast_to_fp8_reference`` on the FP8 bit patterns, the amax
bits (against a pure-torch amax: ``nan_ignoring_amax`` itself now runs the amax kernel), dtype,
shape, strides and device, for every loop of the C++ kernel the CPU has (scalar, AVX2, AVX-512).
The dequantize kernel (FP8 -> float32 / bfloat16) is compared with ``data.to(torch.float32) *
scale`` the same way, and with values decoded from the formats' bit layouts.
The reference itself is checked against the independent numpy model in ``tests/reference.py``.
The Triton kernel is checked the same way under ``TRITON_INTERPRET=1`` (in a subprocess, since
the interpreter is chosen when the kernel is defined).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8kit.formats import E4M3, E5M2, FP8Format
from fp8kit.recipe import DelayedScaling
from fp8kit.torch import kernels
from fp8kit.torch.kernels import _native, dispatch, native, triton_cast
from fp8kit.torch.kernels._common import cast_spec as _spec
from fp8kit.torch.quantization import (
    Float8Tensor,
    cast_to_fp8,
    cast_to_fp8_reference,
    dequantize,
    nan_ignoring_amax,
    quantize_current,
    torch_dtype_of,
)
from tests.reference import new_scale_reference, quantize_reference

REPO = Path(__file__).resolve().parents[2]
FORMATS = [E4M3, E5M2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FLT_MAX = 3.4028234663852886e38
# scales: identity, a typical delayed scale, huge (almost everything saturates), tiny (almost
# everything flushes to 0 or lands in the FP8 subnormals), a non-power-of-two below one
SCALES = [1.0, 448.0 / 3.0, 3.0e38, 2.0**-30, 0.7]

NATIVE_DISABLED = os.environ.get("FP8KIT_DISABLE_NATIVE", "").strip().lower() in (
    "1",
    "true",
    "yes",
    "on",
)


def _compiler_present() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None


ISA_NAMES = {kernels.ISA_SCALAR: "scalar", kernels.ISA_AVX2: "avx2", kernels.ISA_AVX512: "avx512"}


@pytest.fixture
def isas() -> list[int]:
    """Every loop of the C++ kernel that this CPU can run (scalar always); each test checks all
    of them against one reference result."""
    if not kernels.native_available():
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")
    return [isa for isa in ISA_NAMES if isa <= kernels.native_isa_level()]


def _scale(s: float) -> torch.Tensor:
    return torch.tensor(s, dtype=torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def assert_same(
    got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, torch.Tensor], what: str = ""
) -> None:
    """``got = (data, amax)`` equals the reference bit for bit, with dtype, shape and strides."""
    data, amax = got[0], got[-1]
    ref_data, ref_amax = want
    assert data.dtype == ref_data.dtype, what
    assert data.shape == ref_data.shape, what
    assert data.stride() == ref_data.stride(), what
    assert data.device == ref_data.device, what
    bad = (_bits(data) != _bits(ref_data)).nonzero()
    if bad.numel():
        i = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what}: {bad.shape[0]} FP8 codes differ, first at {i}: "
            f"got 0x{int(_bits(data)[i]):02x}, want 0x{int(_bits(ref_data)[i]):02x}"
        )
    assert amax.dtype == torch.float32 and amax.dim() == 0 and amax.device == ref_amax.device
    assert int(_bits(amax.reshape(1))) == int(_bits(ref_amax.reshape(1))), (
        f"{what}: amax {amax.item()} != {ref_amax.item()}"
    )


def _torch_amax(x: torch.Tensor) -> torch.Tensor:
    """The pure-torch NaN-ignoring amax (``nan_ignoring_amax``'s fallback), the amax reference."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32)
    a = x.abs()
    return torch.where(torch.isnan(a), 0.0, a).amax().to(torch.float32)


def _reference(
    x: torch.Tensor, s: torch.Tensor, fmt: FP8Format
) -> tuple[torch.Tensor, torch.Tensor]:
    return cast_to_fp8_reference(x, s, fmt)[0], _torch_amax(x)


def _check_native(
    x: torch.Tensor, scale: float, fmt: FP8Format, isas: list[int], what: str = ""
) -> None:
    s = _scale(scale)
    want = _reference(x, s, fmt)
    for isa in isas:
        got = kernels.native_cast(x, s, fmt, isa)
        assert_same(got, want, f"{what} {fmt} scale={scale} isa={ISA_NAMES[isa]}")


# ---------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------


def test_native_kernel_builds_on_this_machine() -> None:
    """CI relies on this: where a C++ compiler exists, the kernel must build (never a skip)."""
    if NATIVE_DISABLED:
        pytest.skip("FP8KIT_DISABLE_NATIVE is set")
    if not _compiler_present():
        pytest.skip("no C++ compiler on PATH: fp8kit runs its pure-torch cast here")
    assert kernels.native_available(), f"native build failed: {kernels.native_build_error()}"
    assert kernels.native_build_error() is None
    assert kernels.native_isa() in ("avx512", "avx2", "scalar")
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = set(cpuinfo.read_text().split())
        if "avx512f" in flags:
            assert kernels.native_isa() == "avx512"
        elif {"avx2", "fma", "f16c"} <= flags:
            assert kernels.native_isa() == "avx2"


def test_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FP8KIT_CACHE_DIR", str(tmp_path))
    d = kernels.cache_dir()
    assert d.parent == tmp_path / "native"
    assert f"torch{torch.__version__}" in d.name
    monkeypatch.delenv("FP8KIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernels.cache_dir().parent == tmp_path / "xdg" / "fp8kit" / "native"


@pytest.fixture
def fresh_native_state(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """A not-yet-loaded kernel state for this test; the process's real state comes back after."""
    from fp8kit.torch.kernels import _native

    state: dict[str, object] = {"loaded": False, "lib": None, "error": None}
    monkeypatch.setattr(_native, "_state", state)
    return state


def _fallback_cast_is_correct() -> None:
    x = torch.randn(1000) * 100
    data, amax = cast_to_fp8(x, _scale(2.0), E4M3)
    ref, ref_amax = cast_to_fp8_reference(x, _scale(2.0), E4M3)
    assert torch.equal(data.view(torch.uint8), ref.view(torch.uint8))
    assert amax.item() == ref_amax.item() == _torch_amax(x).item()
    # ... and both are right: the independent numpy model of tests/reference.py
    want, want_amax = quantize_reference(x.numpy(), 2.0, E4M3)
    np.testing.assert_array_equal(data.to(torch.float64).numpy(), want)
    assert amax.item() == want_amax
    assert nan_ignoring_amax(x).item() == ref_amax.item()
    q = Float8Tensor(data, _scale(0.7))
    for dtype in DTYPES:
        assert torch.equal(dequantize(q, dtype), (data.float() * 0.7).to(dtype))
    assert torch.equal(kernels.dequantize_fp8(data.t()), data.t().float())


def test_disable_env_uses_torch_path_silently(
    fresh_native_state: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FP8KIT_DISABLE_NATIVE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all when disabled on purpose
        for _ in range(2):
            _fallback_cast_is_correct()
    assert not kernels.native_available()
    assert kernels.native_build_error() == "disabled by FP8KIT_DISABLE_NATIVE"


def test_failed_build_warns_once_and_falls_back(
    fresh_native_state: dict[str, object], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A real failing build: cpp_extension with a compiler that does not exist, empty cache."""
    monkeypatch.setenv("FP8KIT_DISABLE_NATIVE", "0")
    monkeypatch.setenv("FP8KIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _fallback_cast_is_correct()
    ours = [w for w in caught if issubclass(w.category, kernels.NativeKernelWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "pure-torch" in str(ours[0].message)
    assert not kernels.native_available()
    assert kernels.native_build_error()


def _start_python(code: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


# ---------------------------------------------------------------------------------------------
# Bit-exact against the reference
# ---------------------------------------------------------------------------------------------


def _all_16bit_patterns(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_all_16bit_patterns(isas: list[int], fmt: FP8Format, dtype: torch.dtype) -> None:
    x = _all_16bit_patterns(dtype)
    for s in SCALES:
        _check_native(x, s, fmt, isas, f"{dtype}")
        _check_native(x.float(), s, fmt, isas, f"{dtype} widened to float32")


def _float32_edge_values(fmt: FP8Format) -> torch.Tensor:
    """Zeros, subnormals, FP8 boundaries, every FP8 value, every midpoint (RNE ties) and its
    float32 neighbours, values just above fmax, +-inf, NaNs, FLT_MAX."""
    f32 = np.float32
    codes = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8)
    fp8 = codes.view(torch.float8_e4m3fn if fmt is E4M3 else torch.float8_e5m2).float().numpy()
    fp8 = np.unique(fp8[np.isfinite(fp8) & (fp8 >= 0)]).astype(np.float32)
    mids = ((fp8[:-1].astype(np.float64) + fp8[1:]) / 2).astype(np.float32)
    near = np.concatenate([mids, fp8])
    up = np.nextafter(near, f32(np.inf))
    down = np.nextafter(near, f32(0))
    special = np.array(
        [
            0.0,
            1e-45,  # smallest float32 subnormal
            1.1754942e-38,  # largest float32 subnormal
            1.1754944e-38,  # FLT_MIN
            fmt.min_subnormal / 2,
            fmt.min_subnormal * 0.75,
            fmt.min_normal,
            fmt.max,
            fmt.max * (1 + 2.0**-5),
            fmt.max * 1.5,
            fmt.max * 2,
            float(np.nextafter(f32(fmt.max), f32(np.inf))),
            FLT_MAX,
            np.inf,
        ],
        dtype=np.float32,
    )
    pos = np.concatenate([special, near, up, down]).astype(np.float32)
    vals = np.concatenate([pos, -pos])
    bits = vals.view(np.uint32)
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF], np.uint32)
    return torch.from_numpy(np.concatenate([bits, nans]).view(np.float32).copy())


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_float32_edge_values(isas: list[int], fmt: FP8Format) -> None:
    x = _float32_edge_values(fmt)
    for s in [*SCALES, 0.5, 2.0]:
        _check_native(x, s, fmt, isas, "edge")
        # every position of the vector loop and its scalar tail sees every value
        for shift in (1, 13, 31):
            _check_native(torch.roll(x, shift), s, fmt, isas, f"edge rolled {shift}")


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_random_float32_bit_patterns(isas: list[int], fmt: FP8Format) -> None:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randint(-(2**31), 2**31, (1 << 18,), dtype=torch.int64, generator=gen)
    x = x.to(torch.int32).view(torch.float32)
    for s in (1.0, 448.0 / 3.0, 2.0**40, 2.0**-40):
        _check_native(x, s, fmt, isas, "random bits")


SIZES = [1, 2, 7, 8, 31, 32, 33, 63, 1023, 4097, 32769, 65537, 300_001]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_tensors_of_odd_sizes(isas: list[int], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    for n in SIZES:
        x = (torch.randn(n, generator=gen) * 50).to(dtype)
        for fmt in FORMATS:
            _check_native(x, 448.0 / 3.0, fmt, isas, f"n={n}")
            _check_native(x, fmt.max / 50.0, fmt, isas, f"n={n}")
            # offset by one element: unaligned source and destination
            _check_native(x[1:], 3.0, fmt, isas, f"n={n} offset 1")


def test_large_tensor_streaming_path(isas: list[int]) -> None:
    """Above 8 MiB of output the AVX2 loop uses streaming stores after an aligning head."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn((8 << 20) + 37, generator=gen) * 100).to(torch.bfloat16)
    x[123_456] = float("nan")
    x[7_000_001] = float("-inf")
    _check_native(x[5:], 2.0, E4M3, isas, "large")
    _check_native(x, 500.0, E5M2, isas, "large")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs_keep_torch_layout(isas: list[int], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    base = (torch.randn(6, 40, 33, generator=gen) * 30).to(dtype)
    views = {
        "slice": base[:, ::2],
        "transpose": base.transpose(1, 2),
        "permute": base.permute(2, 0, 1),
        "sliced permute": base[::2].permute(2, 0, 1),
        "expand": base[:, :1].expand(6, 40, 33),
        "narrow": base[1:4, 3:30, 5:],
        "0-d": base[2, 3, 4],
        "column": base[0, :, 7],
        "lazily negated": torch._neg_view(base),  # the kernel must see the negated values
    }
    for name, v in views.items():
        for fmt in FORMATS:
            _check_native(v, 448.0 / 3.0, fmt, isas, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_and_all_nan(isas: list[int], dtype: torch.dtype) -> None:
    for fmt in FORMATS:
        for shape in [(0,), (3, 0), (0, 5, 2)]:
            _check_native(torch.empty(shape, dtype=dtype), 1.0, fmt, isas, f"empty {shape}")
        nan = torch.full((37,), float("nan"), dtype=dtype)
        _check_native(nan, 1.0, fmt, isas, "all NaN")
        for isa in isas:
            assert kernels.native_cast(nan, _scale(1.0), fmt, isa)[1].item() == 0.0
        _check_native(torch.tensor([-0.0, 0.0], dtype=dtype), 1.0, fmt, isas, "zeros")


def test_spec_worked_numbers_through_cast_to_fp8() -> None:
    """docs/semantics.md sections 10.11 / 10.12 through the dispatching entry point."""
    e4, _ = cast_to_fp8(
        torch.tensor([300.0, 1000.0, -17.0, 0.3, 1e-4, 3 * 2**-10]), _scale(1.0), E4M3
    )
    assert e4.float().tolist() == [288.0, 448.0, -16.0, 0.3125, 0.0, 2**-8]
    e5, _ = cast_to_fp8(torch.tensor([1e-5, 5e-6, 60000.0, 3.3]), _scale(1.0), E5M2)
    assert e5.float().tolist() == [2**-16, 0.0, 57344.0, 3.5]
    q, amax = cast_to_fp8(torch.tensor([1.0, -3.0, 2.0, 0.1]), _scale(448.0 / 3.0), E4M3)
    assert q.float().tolist() == [144.0, -448.0, 288.0, 15.0]
    assert amax.item() == 3.0


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_against_independent_numpy_reference(fmt: FP8Format, dtype: torch.dtype) -> None:
    """cast_to_fp8 (native where built) against tests/reference.py, written from
    docs/semantics.md."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(1500, generator=gen) * torch.logspace(-6, 6, 1500)).to(dtype)
    x[17] = float("inf")
    x[18] = float("nan")
    for scale in (1.0, 448.0 / 3.0, 1e-3):
        data, amax = cast_to_fp8(x, _scale(scale), fmt)
        want, want_amax = quantize_reference(x.float().numpy(), scale, fmt)
        got = data.to(torch.float64).numpy()
        np.testing.assert_array_equal(got, want)
        assert amax.item() == want_amax


def _edge_values_in(dtype: torch.dtype, fmt: FP8Format) -> torch.Tensor:
    """The float32 edge values of ``fmt`` in ``dtype``, plus (16-bit dtypes) each value's two
    neighbours in ``dtype``: FP8 values and midpoints are exact in bfloat16 and float16, their
    float32 neighbours are not, so the values just off a tie are rebuilt in the narrow type."""
    x = _float32_edge_values(fmt).to(dtype)
    if dtype == torch.float32:
        return x
    finite = x[torch.isfinite(x)].view(torch.int16)
    up = (finite.to(torch.int32) + 1).to(torch.int16).view(dtype)
    down = (finite.to(torch.int32) - 1).to(torch.int16).view(dtype)
    return torch.cat([x, up, down])


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_fallback_against_independent_numpy_reference(
    fmt: FP8Format, dtype: torch.dtype
) -> None:
    """``cast_to_fp8_reference`` (the pure-torch fallback every machine without the native
    kernel runs) against tests/reference.py, on every machine: zeros of both signs, float32 and
    FP8 subnormals, every FP8 value and midpoint (ties to even) and their neighbours, +-fmax and
    beyond, +-inf, NaNs."""
    x = _edge_values_in(dtype, fmt)
    for scale in (1.0, 0.5, 2.0, 448.0 / 3.0, 2.0**-30, 3.0e38):
        data, amax = cast_to_fp8_reference(x, _scale(scale), fmt)
        want, want_amax = quantize_reference(x.float().numpy(), scale, fmt)
        got = data.to(torch.float64).numpy()
        what = f"{dtype} scale={scale}"
        np.testing.assert_array_equal(got, want, err_msg=what)  # NaN where NaN, values equal
        same_sign = np.signbit(got) == np.signbit(want)
        assert same_sign[~np.isnan(want)].all(), what  # -0 stays -0
        assert amax.item() == want_amax, what


_NAN_BITS = {  # a positive and a negative NaN with payloads, as each input dtype's raw bits
    torch.float32: (torch.int32, [0x7FC00001, -0x003FFFFF]),
    torch.bfloat16: (torch.int16, [0x7FC1, -0x003F]),
    torch.float16: (torch.int16, [0x7E01, -0x01FF]),
}


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_codes_keep_the_input_sign_anywhere_in_the_tensor(
    isas: list[int], fmt: FP8Format, dtype: torch.dtype
) -> None:
    """A NaN's code is ``sign | 0x7F`` from the input's own sign bit, at every position: torch's
    float16 -> float32 conversion drops the sign after its 8-wide vector loop, so NaNs sit inside
    and after it (11 elements; the expectation is read from the bits, not from a conversion)."""
    int_dtype, (pos, neg) = _NAN_BITS[dtype]
    bits = torch.tensor([neg, 1, pos, 2, 3, 4, 5, 6, 7, neg, pos], dtype=torch.int32)
    x = bits.to(int_dtype).view(dtype)
    is_nan = torch.tensor([True, False, True] + [False] * 6 + [True, True])
    want_codes = torch.tensor([0xFF, 0x7F, 0xFF, 0x7F], dtype=torch.uint8)
    got = [("reference", cast_to_fp8_reference(x, _scale(0.5), fmt)[0])]
    got += [(ISA_NAMES[isa], kernels.native_cast(x, _scale(0.5), fmt, isa)[0]) for isa in isas]
    for name, data in got:
        assert torch.equal(data.view(torch.uint8)[is_nan], want_codes), (name, dtype, fmt)


# ---------------------------------------------------------------------------------------------
# Dispatch and errors
# ---------------------------------------------------------------------------------------------


def test_cast_to_fp8_dispatches_to_native(monkeypatch: pytest.MonkeyPatch) -> None:
    if not kernels.native_available():
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")
    calls: list[torch.dtype] = []
    real = kernels.native_cast

    def spy(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> tuple:
        calls.append(x.dtype)
        return real(x, scale, fmt)

    monkeypatch.setattr(kernels, "native_cast", spy)
    x = torch.randn(100)
    for dtype in DTYPES:
        assert_same(
            cast_to_fp8(x.to(dtype), _scale(2.0), E4M3),
            _reference(x.to(dtype), _scale(2.0), E4M3),
        )
    assert calls == DTYPES
    # a float64 scale is not the kernel's contract: the reference handles it
    d, _ = cast_to_fp8(x, torch.tensor(2.0, dtype=torch.float64), E4M3)
    assert calls == DTYPES
    assert torch.equal(
        d.view(torch.uint8), cast_to_fp8_reference(x, _scale(2.0), E4M3)[0].view(torch.uint8)
    )


def test_native_errors_name_the_parameter() -> None:
    if not kernels.native_available():
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")
    x = torch.randn(4)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        kernels.native_cast(x.double(), _scale(1.0), E4M3)
    with pytest.raises(TypeError, match="scale must be a float32 CPU tensor with one element"):
        kernels.native_cast(x, torch.ones(2), E4M3)
    with pytest.raises(TypeError, match="fmt must be"):
        kernels.native_cast(x, _scale(1.0), "e4m3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="isa must be"):
        kernels.native_cast(x, _scale(1.0), E4M3, 7)
    if kernels.native_isa_level() < kernels.ISA_AVX512:
        with pytest.raises(RuntimeError, match="not supported by this CPU"):
            kernels.native_cast(x, _scale(1.0), E4M3, kernels.ISA_AVX512)
    with pytest.raises(ValueError, match="x must be 2-D"):
        kernels.native_cast_transpose(x, _scale(1.0), E4M3)
    with pytest.raises(ValueError, match="x must be a 2-D tensor"):
        kernels.cast_to_fp8_transpose(x, _scale(1.0), E4M3)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        kernels.native_amax(x.to(torch.int32))


def test_c_entry_points_validate_their_arguments() -> None:
    """The C ABI checks codes before touching any pointer (status codes, never a crash)."""
    lib = kernels.load_native()
    if lib is None:
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")
    assert lib.cast(0, 9, 0, 0, 0, 0, 0, 0) == 1  # bad input dtype
    assert lib.cast(0, 0, 0, 0, 0, 5, 0, 0) == 2  # bad format
    assert lib.cast(0, 0, 0, 0, 0, 0, 9, 0) == 3  # bad isa
    if lib.best_isa() < kernels.ISA_AVX512:
        assert lib.cast(0, 0, 0, 0, 0, 0, kernels.ISA_AVX512, 0) == 4  # isa not on this CPU
    assert lib.cast(0, 0, 0, -1, 0, 0, 0, 0) == 5  # negative size
    assert lib.cast_transpose(0, 0, 0, 0, -1, 3, 0, 0, 0, 0) == 5
    assert lib.amax(0, 3, 0, 0, 0) == 1
    assert lib.dequant(0, 5, 0, 0, 0, 0, 0) == 2  # bad format
    assert lib.dequant(0, 0, 0, 2, 0, 0, 0) == 1  # bad output dtype (float16 is not offered)
    assert lib.dequant(0, 0, 0, 0, 0, 0, 9) == 3  # bad isa
    assert lib.dequant(0, 0, 0, 0, -1, 0, 0) == 5  # negative size
    assert lib.dequant(0, 1, 0, 1, 0, 0, 0) == 0  # nothing to do: no pointer is touched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_amax_matches_torch(isas: list[int], dtype: torch.dtype) -> None:
    """The amax-only kernel (current scaling's first read) equals torch's NaN-ignoring amax,
    and nan_ignoring_amax (which now runs it) too."""
    gen = torch.Generator().manual_seed(9)
    cases = [
        _all_16bit_patterns(torch.bfloat16).to(dtype),
        torch.full((45,), float("nan"), dtype=dtype),
        torch.empty(0, dtype=dtype),
        torch.tensor([-0.0], dtype=dtype),
        (torch.randn(40, 33, generator=gen) * 7).to(dtype).t(),
        (torch.randn(100_003, generator=gen) * 7).to(dtype)[1:],
    ]
    cases[-1][50_000] = float("-inf")
    cases[-1][60_000] = float("nan")
    for x in cases:
        want = _torch_amax(x)
        for isa in [*isas, None]:
            got = nan_ignoring_amax(x) if isa is None else kernels.native_amax(x, isa)
            assert got.dtype == torch.float32 and got.dim() == 0
            assert int(_bits(got.reshape(1))) == int(_bits(want.reshape(1))), (isa, got, want)


# ---------------------------------------------------------------------------------------------
# Cast + transpose
# ---------------------------------------------------------------------------------------------

TRANSPOSE_SHAPES = [
    (1, 1),
    (3, 5),
    (32, 32),
    (64, 96),
    (33, 65),
    (100, 31),
    (96, 4097),  # more columns than one band chunk (4096)
    (40, 8221),
    (257, 64),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cast_transpose_native(isas: list[int], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(21)
    for m, n in TRANSPOSE_SHAPES:
        x = (torch.randn(m, n, generator=gen) * 100).to(dtype)
        x.view(-1)[:: max(1, x.numel() // 5)] = float("nan")
        for fmt in FORMATS:
            s = _scale(fmt.max / 300.0)
            want = _reference(x, s, fmt)
            want_t = _bits(want[0]).t()
            for isa in isas:
                what = f"transpose {m}x{n} {fmt} isa={ISA_NAMES[isa]}"
                data, data_t, amax = kernels.native_cast_transpose(x, s, fmt, isa)
                assert_same((data, amax), want, what)
                assert data_t.shape == (n, m) and data_t.is_contiguous(), what
                assert torch.equal(_bits(data_t), want_t), what


def test_cast_transpose_large_streaming_path(isas: list[int]) -> None:
    """>= 8 MiB with both sides multiples of 64: band buffer + streaming stores."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(1024, 8256, generator=gen) * 100).to(torch.bfloat16)
    x[700, 8000] = float("nan")
    s = _scale(2.0)
    want = _reference(x, s, E4M3)
    want_t = _bits(want[0]).t()
    for isa in isas:
        data, data_t, amax = kernels.native_cast_transpose(x, s, E4M3, isa)
        assert_same((data, amax), want, f"large transpose isa={ISA_NAMES[isa]}")
        assert torch.equal(_bits(data_t), want_t), ISA_NAMES[isa]


def test_cast_to_fp8_transpose_any_input() -> None:
    """The public entry: non-contiguous and empty inputs, and the reference fallback."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(70, 50, generator=gen) * 10
    cases = [x, x.t(), x[::3, 1:], torch.empty(0, 4), x.to(torch.float64)]
    for v in cases:
        s = _scale(4.0)
        data, data_t, amax = kernels.cast_to_fp8_transpose(v, s, E5M2)
        if v.dtype == torch.float64:
            want = _reference(v, s, E5M2)  # no kernel for float64 inputs
            want = (want[0].contiguous(), want[1])
        else:
            want = _reference(v.contiguous(), s, E5M2)
        assert_same((data, amax), want, f"{tuple(v.shape)}")
        assert data_t.is_contiguous() and torch.equal(_bits(data_t), _bits(want[0]).t())


# ---------------------------------------------------------------------------------------------
# Dequantize: FP8 -> float32 / bfloat16
# ---------------------------------------------------------------------------------------------

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
# scale_inv values: none (the exact upcast), 1, typical (1 / (448/3)), non-power-of-two, tiny
# (float32 subnormal results and underflow to 0), huge (overflow to inf), the smallest subnormal,
# zero, negative, inf and NaN
DEQUANT_SCALES: list[float | None] = [
    None,
    1.0,
    3.0 / 448.0,
    0.7,
    2.0**-130,
    3.0e38,
    1e-45,
    0.0,
    -2.5,
    math.inf,
    math.nan,
]


def _all_codes(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)


def _dequant_reference(
    data: torch.Tensor, scale: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    out = data.to(torch.float32)
    if scale is not None:
        out = out * scale
    return out.to(out_dtype)


def assert_same_values(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Equal bit for bit where ``want`` is a number; NaN exactly where ``want`` is NaN; same
    dtype, shape and strides."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert got.stride() == want.stride(), (what, got.stride(), want.stride())
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN positions differ"
    ints = torch.int32 if got.element_size() == 4 else torch.int16
    gb, wb = got.view(ints), want.view(ints)
    bad = ((gb != wb) & ~nan).nonzero()
    if bad.numel():
        i = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what}: {bad.shape[0]} values differ, first at {i}: got {got[i].item()!r} "
            f"(0x{int(gb[i]) & 0xFFFFFFFF:x}), "
            f"want {want[i].item()!r} (0x{int(wb[i]) & 0xFFFFFFFF:x})"
        )


def _check_dequant(
    data: torch.Tensor, scale: float | None, isas: list[int], what: str = ""
) -> None:
    s = None if scale is None else _scale(scale)
    for out_dtype in (torch.float32, torch.bfloat16):
        want = _dequant_reference(data, s, out_dtype)
        for isa in isas:
            got = kernels.native_dequantize(data, s, out_dtype, isa)
            assert_same_values(
                got, want, f"{what} {data.dtype} scale={scale} -> {out_dtype} {ISA_NAMES[isa]}"
            )


def _decode_from_bit_layout(code: int, fmt: FP8Format) -> float:
    """The value of an FP8 code from its sign / exponent / mantissa fields (docs/semantics.md
    section 1)."""
    sign = -1.0 if code & 0x80 else 1.0
    exp = (code >> fmt.mantissa_bits) & ((1 << (7 - fmt.mantissa_bits)) - 1)
    mant = code & ((1 << fmt.mantissa_bits) - 1)
    top = (1 << (7 - fmt.mantissa_bits)) - 1
    if fmt is E4M3 and code & 0x7F == 0x7F:
        return math.nan
    if fmt is E5M2 and exp == top:
        return math.nan if mant else sign * math.inf
    if exp == 0:
        return sign * mant * 2.0 ** (1 - fmt.bias - fmt.mantissa_bits)
    return sign * (1 + mant / 2**fmt.mantissa_bits) * 2.0 ** (exp - fmt.bias)


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
def test_dequantize_all_codes(isas: list[int], fp8: torch.dtype) -> None:
    """Every code at every position of the vector loops and their tails, every scale."""
    codes = _all_codes(fp8)
    fmt = E4M3 if fp8 == torch.float8_e4m3fn else E5M2
    want = np.array([_decode_from_bit_layout(c, fmt) for c in range(256)])
    for isa in isas:
        got = kernels.native_dequantize(codes, None, torch.float32, isa)
        np.testing.assert_array_equal(got.double().numpy(), want)  # NaN == NaN here
        # unscaled, even the NaN bits are torch's (0x7FF00000 with the sign for E4M3fn)
        assert torch.equal(got.view(torch.int32), codes.float().view(torch.int32))
        got16 = kernels.native_dequantize(codes, None, torch.bfloat16, isa)
        np.testing.assert_array_equal(got16.double().numpy(), want)  # exact in bfloat16
    x = codes.repeat(3)
    for scale in DEQUANT_SCALES:
        for shift in (0, 1, 13, 31):
            _check_dequant(torch.roll(x.view(torch.uint8), shift).view(fp8), scale, isas, "codes")
        _check_dequant(x[5:-2], scale, isas, "codes offset 5")


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
def test_dequantize_random_layouts_and_sizes(isas: list[int], fp8: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(31)

    def codes(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(fp8)

    for n in SIZES:
        x = codes(n)
        _check_dequant(x, None, isas, f"n={n}")
        _check_dequant(x[1:], 0.7, isas, f"n={n} offset 1")
    base = codes(6, 40, 33)
    views = {
        "2-D contiguous": codes(257, 31),
        "2-D column-major (a transposed contiguous tensor)": codes(96, 65).t(),
        "column-major, both sides odd": codes(33, 1031).t(),
        "permute": base.permute(2, 0, 1),
        "slice (not dense)": base[:, ::2],
        "narrow (not dense)": base[1:4, 3:30, 5:],
        "expand": base[:, :1].expand(6, 40, 33),
        "0-d": base[2, 3, 4],
        "column": base[0, :, 7],
    }
    for name, v in views.items():
        for scale in (None, 3.0 / 448.0):
            _check_dequant(v, scale, isas, name)
    for shape in [(0,), (3, 0), (0, 5, 2)]:
        _check_dequant(torch.empty(shape, dtype=fp8), 0.5, isas, f"empty {shape}")


def test_dequantize_large_streaming_path(isas: list[int]) -> None:
    """Outputs of 32 MiB and more: scalar head to a 64-byte boundary, streaming stores, tail."""
    gen = torch.Generator().manual_seed(8)
    raw = torch.randint(0, 256, ((8 << 20) + 41,), dtype=torch.uint8, generator=gen)
    x = raw.view(torch.float8_e5m2)[3:]  # unaligned source, head of 3 floats
    s = _scale(0.7)
    want = x.float() * s
    for isa in isas:
        assert_same_values(
            kernels.native_dequantize(x, s, torch.float32, isa), want, f"{ISA_NAMES[isa]}"
        )
    # bfloat16 output streams from 16M elements: check it against the float32 result rounded
    big = raw.repeat(2).view(torch.float8_e4m3fn)[1:]
    f32 = kernels.native_dequantize(big, s)
    assert_same_values(f32[::4097].contiguous(), big[::4097].float() * s, "float32 sample")
    want16 = f32.to(torch.bfloat16)
    for isa in isas:
        got = kernels.native_dequantize(big, s, torch.bfloat16, isa)
        assert_same_values(got, want16, f"bf16 {ISA_NAMES[isa]}")


def test_dequantize_wiring(monkeypatch: pytest.MonkeyPatch) -> None:
    """quantization.dequantize and kernels.dequantize_fp8 use the kernel where it applies (same
    results as torch), and torch where it does not."""
    if not kernels.native_available():
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")
    calls: list[torch.dtype] = []
    real = native.dequantize

    def spy(data: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(data.dtype)
        return real(data, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "dequantize", spy)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(70, 48, generator=gen) * 100
    for fp8 in FP8_DTYPES:
        data = x.to(fp8)
        for t in (Float8Tensor(data, _scale(0.3)), Float8Tensor(data.t(), _scale(2.0**-7))):
            for dtype in DTYPES:
                calls.clear()
                want = (t.data.to(torch.float32) * t.scale_inv).to(dtype)
                assert_same_values(dequantize(t, dtype), want, f"{fp8} -> {dtype}")
                assert_same_values(t.dequantize(dtype), want, f"{fp8} -> {dtype}")
                assert calls == [fp8, fp8]
        calls.clear()
        assert torch.equal(kernels.dequantize_fp8(data), data.float())
        assert calls == [fp8]
    data = x.to(torch.float8_e4m3fn)
    calls.clear()
    t = Float8Tensor(data, torch.tensor(0.5, requires_grad=True))  # a scale that needs a gradient
    got, want = dequantize(t), t.data.to(torch.float32) * t.scale_inv
    assert calls == [] and torch.equal(got, want) and got.requires_grad  # torch, differentiable
    # a one-element scale with more dims than the data does not change the data's shape, and a
    # scale that is not float32 is refused (Float8Tensor's contract; both were multiplied)
    t = Float8Tensor(data[3, 4], torch.tensor([[0.5]]))
    assert dequantize(t).shape == () and dequantize(t) == data[3, 4].float() * 0.5
    with pytest.raises(TypeError, match=r"t\.scale_inv must be a float32 tensor"):
        dequantize(Float8Tensor(data, torch.tensor(0.5, dtype=torch.float64)))
    # a one-element scale of shape (1,) broadcasts to data's shape: still the kernel
    calls.clear()
    t = Float8Tensor(data, torch.tensor([0.5]))
    assert_same_values(dequantize(t), data.float() * t.scale_inv, "scale of shape (1,)")
    assert calls == [torch.float8_e4m3fn]


def test_dequantize_fp8_refuses_arguments_outside_its_contract() -> None:
    """FP8 data, a float32 / bfloat16 / float16 dtype and a one-element float32 scale that
    keeps data's shape, else an error naming the parameter (FP8 bytes viewed as uint8 came
    back as integers, an int dtype truncated, a (3,) scale broadcast per element)."""
    data = torch.tensor([0.3125, -1.75, 2.25]).to(torch.float8_e4m3fn)
    half = torch.tensor(0.5)
    with pytest.raises(TypeError, match=r"data must be a torch\.float8_e4m3fn or .*torch\.uint8"):
        kernels.dequantize_fp8(data.view(torch.uint8), half)
    for dtype in (torch.int32, torch.float64, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match=r"dtype must be torch\.float32, .*got torch\."):
            kernels.dequantize_fp8(data, half, dtype)
    for scale in (torch.full((1, 1), 0.5), torch.full((3,), 0.5), half.double(), 0.5):
        with pytest.raises(TypeError, match=r"scale must be None or a torch\.float32 tensor"):
            kernels.dequantize_fp8(data, scale)  # type: ignore[arg-type]
    for scale in (None, half, torch.full((1,), 0.5)):  # the contract's forms still work
        want = data.float() * (1.0 if scale is None else 0.5)
        assert torch.equal(kernels.dequantize_fp8(data, scale), want)


def test_dequant_mm_unchanged_and_uses_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The "dequant" CPU GEMM backend gives exactly the old result (torch upcasts) for both
    operand layouts and formats, with the upcasts in the kernel."""
    from fp8kit.torch import gemm

    if not kernels.native_available():
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")
    calls: list[tuple[int, ...]] = []
    real = native.dequantize

    def spy(data: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(data.stride())
        return real(data, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "dequantize", spy)
    gen = torch.Generator().manual_seed(13)
    m, k, n = 128, 96, 96
    assert m * k * n > gemm.SMALL_GEMM_MACS  # the torch.mm route, not the one-call small GEMM
    for fa, fb in (
        (torch.float8_e4m3fn, torch.float8_e4m3fn),
        (torch.float8_e5m2, torch.float8_e4m3fn),
    ):
        a = Float8Tensor((torch.randn(m, k, generator=gen) * 30).to(fa), _scale(0.37))
        b = Float8Tensor((torch.randn(n, k, generator=gen) * 30).to(fb).t(), _scale(3.0 / 448))
        for out_dtype in DTYPES:
            calls.clear()
            got = gemm._dequant_mm(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype, None)
            acc = a.data.to(torch.float32) @ b.data.to(torch.float32)
            want = acc.mul_(a.scale_inv * b.scale_inv).to(out_dtype)
            assert torch.equal(got, want), (fa, fb, out_dtype)
            assert got.dtype == out_dtype
            assert calls == [(k, 1), (1, k)]  # row-major A, column-major B, no copies
        assert torch.equal(
            gemm.scaled_mm(a, b),
            gemm._dequant_mm(a.data, b.data, a.scale_inv, b.scale_inv, torch.float32, None),
        )


def _epilogue_reference(
    acc: np.ndarray, factor: np.float32, bias: np.ndarray | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """The GEMM epilogue written from its definition in numpy float32 arithmetic: one multiply,
    one add of the bias (none without one), one rounding (numpy's for float16, torch's
    conversion of the float32 value for bfloat16)."""
    with np.errstate(over="ignore", invalid="ignore"):
        v = acc * factor
        if bias is not None:
            v = v + bias.astype(np.float32)
        if out_dtype == torch.float16:
            return torch.from_numpy(v.astype(np.float16))
    return torch.from_numpy(v).to(out_dtype)


def _epilogue_cases(gen: torch.Generator) -> torch.Tensor:
    acc = torch.randn(37, 53, generator=gen) * 3e3
    edge = [0.0, -0.0, 1e-45, -1e-40, 2.0**-130, 448.0, -57344.0, 3e38, -3e38, 65504.0]
    edge += [float("inf"), float("-inf"), float("nan")]
    acc[0, : len(edge)] = torch.tensor(edge)
    acc[1] = torch.randn(53, generator=gen) * 1e-38  # float32 subnormals after the scale
    return acc


@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias_dtype", [None, *DTYPES], ids=str)
def test_gemm_epilogue_against_numpy(
    out_dtype: torch.dtype, bias_dtype: torch.dtype | None
) -> None:
    """Native and torch epilogues give the same bits as float32 numpy math (NaN as NaN) for
    random accumulators and edge values: signed zeros, subnormals, FP8 and float16 limits,
    overflow past the output's range, +-inf, NaN."""
    gen = torch.Generator().manual_seed(21)
    acc = _epilogue_cases(gen)
    a_scale, b_scale = torch.tensor(3.7e-2), torch.tensor([2.0**-9 * 1.3])
    bias = None
    if bias_dtype is not None:
        bias = (torch.randn(53, generator=gen) * 50).to(bias_dtype)
        bias[:3] = torch.tensor([-0.0, 0.0, float("nan")])
    factor = np.float32(a_scale.numpy()) * np.float32(b_scale.numpy()[0])
    want = _epilogue_reference(
        acc.numpy(), factor, None if bias is None else bias.float().numpy(), out_dtype
    )
    backends = ["reference"] + (["native"] if kernels.native_available() else [])
    for backend in backends:
        got = kernels.gemm_epilogue(
            acc.clone(), a_scale, b_scale, out_dtype, bias=bias, backend=backend
        )
        assert got.dtype == out_dtype and got.shape == acc.shape
        assert_same_values(got, want, f"{backend}: bias {bias_dtype} -> {out_dtype}")


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of their width (NaN payloads and -0 compared exactly)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no bias", "bias"])
def test_gemm_epilogue_every_loop_gives_the_same_bits(
    out_dtype: torch.dtype, with_bias: bool
) -> None:
    """The scalar, AVX2 and AVX-512 epilogues (each one this CPU runs) write the same bytes for
    accumulators of random bit patterns (NaNs with every payload, subnormals, infinities), rows
    whose length leaves a tail for each loop, and a scale product that pushes values across the
    output's overflow and subnormal limits; the scalar loop matches numpy float32 math."""
    if not kernels.native_available():
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")
    gen = torch.Generator().manual_seed(22)
    bits = torch.randint(-(2**31), 2**31, (29, 71), generator=gen, dtype=torch.int64)
    acc = bits.to(torch.int32).view(torch.float32)
    acc[:9] = torch.randn(9, 71, generator=gen) * torch.logspace(-44, 38, 71)  # every decade
    bias = None
    if with_bias:
        bias = (torch.randn(71, generator=gen) * 1e3).to(out_dtype)
        bias[:2] = torch.tensor([-0.0, float("nan")])
    for scale in (torch.tensor(1.0), torch.tensor(3.1e-5)):
        one = torch.ones(())
        want = native.gemm_epilogue(acc.clone(), scale, one, out_dtype, bias, kernels.ISA_SCALAR)
        ref = _epilogue_reference(
            acc.numpy(), np.float32(scale), None if bias is None else bias.float().numpy(),
            out_dtype,
        )  # fmt: skip
        assert_same_values(want, ref, f"scalar loop, scale {scale.item()}")
        for isa in range(kernels.ISA_AVX2, kernels.native_isa_level() + 1):
            got = native.gemm_epilogue(acc.clone(), scale, one, out_dtype, bias, isa)
            same = _raw(got) == _raw(want)
            assert bool(same.all()), (isa, scale.item(), acc.flatten()[~same.flatten()][:4])


def test_gemm_epilogue_reuses_a_float32_accumulator() -> None:
    if not kernels.native_available():
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")
    acc, one = torch.ones(16, 32), torch.ones(())
    assert kernels.gemm_epilogue(acc, one, one, torch.float32, bias=torch.ones(32)) is acc
    assert torch.equal(acc, torch.full((16, 32), 2.0))


def test_gemm_epilogue_errors_name_the_parameter() -> None:
    acc, one = torch.zeros(4, 8), torch.ones(())
    with pytest.raises(TypeError, match="acc must be a contiguous float32"):
        kernels.gemm_epilogue(acc.t(), one, one, torch.float32)
    with pytest.raises(TypeError, match="acc must be a contiguous float32"):
        kernels.gemm_epilogue(acc.double(), one, one, torch.float32)
    with pytest.raises(TypeError, match=r"b_scale must be a torch\.float32 tensor with one"):
        kernels.gemm_epilogue(acc, one, torch.ones(2), torch.float32)
    with pytest.raises(TypeError, match=r"out_dtype must be torch\.float32, torch\.bfloat16"):
        kernels.gemm_epilogue(acc, one, one, torch.float64)
    with pytest.raises(TypeError, match=r"bias must be None or .* of shape \(8,\)"):
        kernels.gemm_epilogue(acc, one, one, torch.float32, bias=torch.zeros(4))
    with pytest.raises(ValueError, match="gemm_epilogue has no Triton kernel"):
        kernels.gemm_epilogue(acc, one, one, torch.float32, backend="triton")


def test_native_dequantize_errors() -> None:
    if not kernels.native_available():
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")
    d = torch.zeros(4, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"data must be torch\.float8_e4m3fn or torch\.float8_e5m2"):
        kernels.native_dequantize(torch.zeros(4))
    with pytest.raises(TypeError, match=r"out_dtype must be torch\.float32 or torch\.bfloat16"):
        kernels.native_dequantize(d, None, torch.float16)
    with pytest.raises(TypeError, match="scale must be a float32 CPU tensor with one element"):
        kernels.native_dequantize(d, torch.ones(2))
    with pytest.raises(ValueError, match="isa must be"):
        kernels.native_dequantize(d, None, torch.float32, 7)
    with pytest.raises(TypeError, match="data must be a CPU tensor"):
        kernels.native_dequantize([1.0, 2.0])  # type: ignore[arg-type]
    if kernels.native_isa_level() < kernels.ISA_AVX512:
        with pytest.raises(RuntimeError, match="not supported by this CPU"):
            kernels.native_dequantize(d, None, torch.float32, kernels.ISA_AVX512)


def test_nan_ignoring_amax_wiring(monkeypatch: pytest.MonkeyPatch) -> None:
    """nan_ignoring_amax runs the amax kernel for CPU float tensors and torch otherwise; the
    same float32 0-d value either way (NaN ignored, 0 for empty or all-NaN tensors)."""
    if not kernels.native_available():
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")
    calls: list[torch.dtype] = []
    real = kernels.native_amax

    def spy(x: torch.Tensor, *args: int) -> torch.Tensor:
        calls.append(x.dtype)
        return real(x, *args)

    monkeypatch.setattr(kernels, "native_amax", spy)
    gen = torch.Generator().manual_seed(14)
    for dtype in DTYPES:
        x = (torch.randn(33, 70, generator=gen) * 9).to(dtype)
        x[3, 5] = float("nan")
        for v in (x, x.t(), x[:, ::3], torch.empty(0, 3, dtype=dtype), x[:0]):
            got = nan_ignoring_amax(v)
            want = _torch_amax(v)
            assert got.dtype == torch.float32 and got.dim() == 0
            assert int(_bits(got.reshape(1))) == int(_bits(want.reshape(1)))
        assert nan_ignoring_amax(torch.full((9,), float("nan"), dtype=dtype)).item() == 0.0
    assert calls == [d for d in DTYPES for _ in range(6)]
    calls.clear()
    assert nan_ignoring_amax(torch.tensor([3, -7])).item() == 7.0  # integers: torch
    assert nan_ignoring_amax(torch.tensor([1.5, -2.0], dtype=torch.float64)).item() == 2.0
    assert calls == []


# ---------------------------------------------------------------------------------------------
# The kernel API (cast_fp8, cast_fp8_current, compute_amax) on every backend
# ---------------------------------------------------------------------------------------------
# One deterministic list of cases runs through each backend: native and reference in this
# process, Triton under TRITON_INTERPRET=1 in a subprocess (the interpreter is chosen when the
# kernels are defined) that saves its results for this process to check. Every result is
# checked against tests/reference.py (numpy, written from docs/semantics.md) and, for the FP8 bits,
# the torch reference; see docs/decisions/0210-kernel-api-and-dispatch.md for the API.

API_SCALES = [1.0, 448.0 / 3.0, 3.0e38, 2.0**-30, 0.7]
U32 = 2.0**-24  # float32 unit roundoff
# Cases up to this size are compared with tests/reference.py's per-element FP8 rounding (a
# Python loop); larger ones with the torch reference (itself checked against it above).
_NUMPY_LIMIT = 8192


@dataclass
class CastCase:
    """One call of the API. ``kind``: "cast" (cast_fp8), "current" (cast_fp8_current) or
    "amax" (compute_amax). ``fold``: None, or "element" / "slice": amax_out is a 0-d / (1,)
    view of one entry of a (6, 4) staging buffer's column, holding ``fold_init`` before."""

    name: str
    kind: str
    x: torch.Tensor
    fmt: FP8Format = E4M3
    scale: float = 1.0
    transpose: bool = False
    dbias: bool = False
    fold: str | None = None
    fold_init: float = 0.0
    count: int | None = None
    power_2: bool = False


def _api_inputs(fmt: FP8Format, dtype: torch.dtype) -> torch.Tensor:
    """Edge values (zeros, subnormals, every FP8 value and midpoint and their neighbours,
    +-fmax, above fmax, +-inf, NaNs) in ``dtype``, and for 16-bit dtypes every 29th pattern."""
    edge = _float32_edge_values(fmt).to(dtype)
    if dtype == torch.float32:
        return edge
    return torch.cat([edge, _all_16bit_patterns(dtype)[::29]])


def _long_input(dtype: torch.dtype) -> torch.Tensor:
    """5 blocks of the 1-D kernel and a tail (the interpreter's grid walks several per program)."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(5 * 4096 + 77, generator=gen) * 100
    x[::997] = float("nan")
    x[5] = float("inf")
    return x.to(dtype)


def _matrix(m: int, n: int, dtype: torch.dtype, seed: int, specials: bool = True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=gen) * torch.logspace(-3, 3, n)[None, :]
    if specials and x.numel() > 8:
        flat = x.view(-1)
        flat[3] = 0.0
        flat[5] = -0.0
        flat[-2] = 1e-41 if dtype == torch.float32 else 1e-6
    return x.to(dtype)


def _dbias_pairs(dtype: torch.dtype) -> torch.Tensor:
    """Two rows whose float32 column sums are exact, so dbias must equal torch's rounding of
    them: random pairs with close exponents, round-to-even ties, and the dtype's overflow."""
    gen = torch.Generator().manual_seed(17)
    exponents = torch.randint(-3, 4, (2, 256), generator=gen).float()
    a = (torch.rand(256, generator=gen) + 0.5) * torch.exp2(exponents[0])
    b = (torch.rand(256, generator=gen) - 0.5) * torch.exp2(exponents[1])
    a, b = a.to(dtype), b.to(dtype)
    mant = 8 if dtype == torch.bfloat16 else 11
    a[:4] = 1.0  # 1 + half an ulp (tie, to even: 1), 1 + 1.5 ulp (tie, up), exact, negative
    b[:4] = torch.tensor([2.0**-mant, 3 * 2.0**-mant, 2.0 ** -(mant - 1), -0.75])
    big = torch.finfo(dtype).max
    a[4], b[4] = big, big  # overflow to inf
    return torch.stack([a, b])


@functools.cache
def api_cases() -> tuple[CastCase, ...]:
    """The cases every backend runs (deterministic; sized for the Triton interpreter)."""
    cases: list[CastCase] = []
    for fmt in FORMATS:
        for dtype in DTYPES:
            x = _api_inputs(fmt, dtype)
            # the slow test below runs every 16-bit pattern at every scale
            for s in API_SCALES if dtype == torch.float32 else API_SCALES[::2]:
                cases.append(CastCase(f"edge {fmt} {dtype} scale={s}", "cast", x, fmt, s))
        dtype = DTYPES[FORMATS.index(fmt)]
        cases.append(CastCase(f"long {fmt} {dtype}", "cast", _long_input(dtype), fmt, 0.7))
    # one row / column, odd, whole 64 x 64 tiles, and (with the interpreter's 1-SM grid) several
    # row tiles per program, ragged and whole
    shapes = [(1, 77), (77, 1), (33, 65), (64, 128), (130, 200), (192, 256)]
    for i, (m, n) in enumerate(shapes):
        dtype = DTYPES[i % 3]
        fmt = FORMATS[i % 2]
        x = _matrix(m, n, dtype, seed=i)
        if x.numel() > 20:
            x.view(-1)[11] = float("nan")
            x.view(-1)[13] = float("-inf")
        s = fmt.max / 1000.0
        cases.append(
            CastCase(f"T+dbias {m}x{n} {dtype}", "cast", x, fmt, s, True, True, "element", 0.5)
        )
        if i in (2, 4):
            y = _matrix(m, n, dtype, i)
            cases += [
                CastCase(f"T {m}x{n} {dtype}", "cast", x, fmt, s, transpose=True),
                CastCase(f"dbias {m}x{n} {dtype}", "cast", y, fmt, s, dbias=True, fold="slice"),
            ]
    base = _matrix(70, 130, torch.bfloat16, seed=9)
    cases += [
        CastCase("non-contiguous 1-D", "cast", base[:, ::3], E4M3, 3.0),
        CastCase("non-contiguous T+dbias", "cast", base.t(), E5M2, 3.0, True, True),
        CastCase("3-D", "cast", base.reshape(7, 10, 130), E4M3, 3.0, fold="slice", fold_init=1e30),
        CastCase("fold keeps larger", "cast", base, E4M3, 3.0, fold="element", fold_init=1e30),
        CastCase(
            "0-d", "cast", torch.tensor(-300.0, dtype=torch.bfloat16), E4M3, 3.0, fold="slice"
        ),
        # a lazily negated view: its memory holds the values before negation
        CastCase("lazily negated", "cast", torch._neg_view(base[:2]), E4M3, 3.0),
        CastCase("lazily negated T", "cast", torch._neg_view(base), E5M2, 3.0, True, True),
    ]
    for dtype in (torch.bfloat16, torch.float16):
        pairs = _dbias_pairs(dtype)
        cases.append(CastCase(f"dbias exact pairs {dtype}", "cast", pairs, E5M2, 1.0, dbias=True))
    x = _matrix(96, 64, torch.bfloat16, seed=3)
    for count in (0, 2):
        name = f"first step count={count}"
        cases += [
            CastCase(name, "cast", x, E4M3, 3.0, True, False, "element", 0.0, count),
            CastCase(f"first step 1-D count={count}", "cast", x.view(-1), E5M2, 5.0, count=count),
        ]
    cases.append(CastCase("first step zeros", "cast", torch.zeros(40, 64), E4M3, 3.0, count=0))
    currents = {
        "random bf16": _matrix(96, 64, torch.bfloat16, seed=4),
        "random f32 1-D": _matrix(1, 9000, torch.float32, seed=5).view(-1),
        "random f16": _matrix(33, 65, torch.float16, seed=6),
        "zeros": torch.zeros(33, 65),
        "all NaN": torch.full((35,), float("nan"), dtype=torch.bfloat16),
        "with inf": torch.tensor([1.0, float("inf"), -3.0, 2.0]),
        "subnormal amax": torch.tensor([1e-40, -1e-41, 0.0, 3e-42]),
        "huge amax": torch.tensor([3e38, -1.0, 2.0, 5.0]),
        "bf16 subnormal amax": torch.tensor([1e-39, 0.0], dtype=torch.bfloat16),
        "0-d": torch.tensor(-7.25),
    }
    for name, cx in currents.items():
        random = name.startswith("random")
        for fmt in FORMATS if random else [E4M3]:
            # p2 matters where the ratio is finite and not capped
            for p2 in (False, True) if random or "amax" in name else (False,):
                two_d = cx.dim() == 2
                cases.append(
                    CastCase(
                        f"current {name} {fmt} p2={p2}",
                        "current",
                        cx,
                        fmt,
                        transpose=two_d,
                        dbias=two_d and random,
                        power_2=p2,
                    )
                )
    nan_mix = _matrix(50, 41, torch.float16, seed=8)
    nan_mix[::7, ::5] = float("nan")
    cases += [
        CastCase("amax mixed", "amax", nan_mix),
        CastCase("amax non-contiguous", "amax", nan_mix.t()),
        CastCase("amax all NaN", "amax", torch.full((9000,), float("nan"))),
        CastCase(
            "amax fold", "amax", _api_inputs(E5M2, torch.bfloat16), fold="slice", fold_init=2.0
        ),
        CastCase("amax fold keeps", "amax", nan_mix, fold="element", fold_init=1e30),
    ]
    return tuple(cases)


def run_case(case: CastCase, backend: str, device: str = "cpu") -> dict[str, torch.Tensor | None]:
    """One API call on ``backend`` with its tensors on ``device``; everything it returned, and
    the staging buffer after, on the CPU."""
    x = case.x if device == "cpu" else case.x.to(device)
    staging = torch.zeros(6, 4, device=device)
    staging[3, 1] = case.fold_init
    amax_out = None
    if case.fold == "element":
        amax_out = staging[:, 1][3]
    elif case.fold == "slice":
        amax_out = staging[3:4, 1]
    if case.kind == "amax":
        a = kernels.compute_amax(x, amax_out=amax_out, backend=backend)
        got = {"amax": a, "staging": staging}
    elif case.kind == "current":
        r = kernels.cast_fp8_current(
            x,
            case.fmt,
            power_2_scale=case.power_2,
            transpose=case.transpose,
            dbias=case.dbias,
            backend=backend,
        )
        got = {**r._asdict(), "staging": staging}
    else:
        count = None if case.count is None else torch.tensor([case.count], device=device)
        r = kernels.cast_fp8(
            x,
            torch.tensor(case.scale, device=device),
            case.fmt,
            transpose=case.transpose,
            amax_out=amax_out,
            dbias=case.dbias,
            first_step_current=count,
            backend=backend,
        )
        got = {**r._asdict(), "staging": staging}
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in got.items()}


def run_all_cases(
    backend: str, path: str | None = None, device: str = "cpu"
) -> list[dict[str, torch.Tensor | None]]:
    results = [run_case(case, backend, device) for case in api_cases()]
    if path is not None:
        torch.save(results, path)
    return results


def _f32_bits(v: float | torch.Tensor) -> int:
    if isinstance(v, torch.Tensor):
        return int(v.reshape(1).view(torch.int32).item())
    return struct.unpack("<i", struct.pack("<f", v))[0]


def _expected_scale(case: CastCase, amax: float) -> float:
    """The float32 scale the case's data must have been cast with (tests/reference.py)."""
    if case.kind == "current":
        return new_scale_reference(
            amax, 1.0, case.fmt.max, DelayedScaling(power_2_scale=case.power_2)
        )
    if case.count == 0:
        return new_scale_reference(amax, 1.0, case.fmt.max, DelayedScaling())
    return float(np.float32(case.scale))


def _check_dbias(x: torch.Tensor, got: torch.Tensor, what: str) -> None:
    """dbias against float64 column sums: float32 summation in any order is within
    gamma_M * sum|x| (gamma_M = M u / (1 - M u)), then one rounding to x.dtype."""
    assert got.dtype == x.dtype and got.shape == (x.shape[1],), what
    x64 = x.double()
    m = x.shape[0]
    exact = x64.sum(0)
    gamma = m * U32 / (1 - m * U32)
    bound = gamma * x64.abs().sum(0) + 1e-300
    unit = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[x.dtype]
    tiny = {torch.float32: 0.0, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}[x.dtype]
    big = torch.finfo(x.dtype).max
    g = got.double()
    for j in range(x.shape[1]):
        col = x64[:, j]
        if torch.isnan(col).any() or ((col == math.inf).any() and (col == -math.inf).any()):
            assert math.isnan(g[j]), (what, j)
        elif torch.isinf(col).any():
            assert g[j] == col[torch.isinf(col)][0], (what, j)
        elif abs(exact[j]) + bound[j] > big and math.isinf(g[j]):
            assert math.copysign(1, g[j]) == math.copysign(1, exact[j]), (what, j)
        else:
            err = abs(g[j] - exact[j])
            limit = bound[j] + unit * (abs(exact[j]) + bound[j]) + tiny
            assert err <= limit, f"{what}: column {j}: |{g[j]} - {exact[j]}| = {err} > {limit}"


@functools.cache
def _numpy_expected(index: int) -> tuple[np.ndarray, float, float]:
    """(FP8 values, amax, scale) of case ``index`` from tests/reference.py."""
    case = api_cases()[index]
    with np.errstate(all="ignore"):
        return _numpy_case(case)


def _numpy_case(case: CastCase) -> tuple[np.ndarray | None, float, float]:
    x32 = case.x.float().numpy()
    finite = np.abs(x32[~np.isnan(x32)])
    amax = float(finite.max()) if finite.size else 0.0
    scale = _expected_scale(case, amax) if case.kind != "amax" else 1.0
    values = None  # large cases: their bits are checked against the torch reference only
    if case.kind != "amax" and case.x.numel() <= _NUMPY_LIMIT:
        values = quantize_reference(x32, scale, case.fmt)[0]
    return values, amax, scale


def check_case(index: int, got: dict[str, torch.Tensor | None], backend: str) -> None:
    case = api_cases()[index]
    what = f"{backend}: {case.name}"
    values, amax, scale = _numpy_expected(index)
    staging = got["staging"]
    want_staging = torch.zeros(6, 4)
    want_staging[3, 1] = case.fold_init
    if case.fold is not None:
        want_staging[3, 1] = float(max(np.float32(case.fold_init), np.float32(amax)))
        assert got["amax"] is None, what
    else:
        assert got["amax"] is not None and got["amax"].dtype == torch.float32, what
        assert got["amax"].dim() == 0, what
        assert _f32_bits(got["amax"]) == _f32_bits(amax), f"{what}: amax {got['amax']} != {amax}"
    assert torch.equal(staging.view(torch.int32), want_staging.view(torch.int32)), (what, staging)
    if case.kind == "amax":
        return
    data = got["data"]
    assert data.dtype == torch_dtype_of(case.fmt) and data.shape == case.x.shape, what
    assert data.is_contiguous(), what
    if values is not None:
        np.testing.assert_array_equal(data.double().numpy(), values, err_msg=what)
    # the bits too (signed zeros, NaN codes): the torch reference, itself checked against numpy
    ref = cast_to_fp8_reference(case.x, torch.tensor(scale), case.fmt)[0].contiguous()
    assert torch.equal(data.view(torch.uint8), ref.view(torch.uint8)), what
    assert got["scale_inv"].dtype == torch.float32 and got["scale_inv"].dim() == 0, what
    want_inv = np.float32(1.0) / np.float32(scale)
    assert _f32_bits(got["scale_inv"]) == _f32_bits(float(want_inv)), (
        what,
        got["scale_inv"],
        want_inv,
    )
    if case.transpose:
        data_t = got["data_t"]
        assert data_t.shape == (case.x.shape[1], case.x.shape[0]) and data_t.is_contiguous(), what
        assert torch.equal(data_t.view(torch.uint8), data.view(torch.uint8).t()), what
    else:
        assert got["data_t"] is None, what
    if case.dbias:
        if case.name.startswith("dbias exact pairs"):
            want = (case.x[0].float() + case.x[1].float()).to(case.x.dtype)
            assert torch.equal(got["dbias"].view(torch.int16), want.view(torch.int16)), what
        _check_dbias(case.x, got["dbias"], what)
    else:
        assert got["dbias"] is None, what


def _check_all(results: list[dict[str, torch.Tensor | None]], backend: str) -> None:
    assert len(results) == len(api_cases())
    for i, got in enumerate(results):
        check_case(i, got, backend)


def test_api_native() -> None:
    if not kernels.native_available():
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")
    _check_all(run_all_cases("native"), "native")


def test_api_reference() -> None:
    _check_all(run_all_cases("reference"), "reference")


@functools.cache
def triton_results() -> tuple[list, list]:
    """The cast cases here and the update cases of test_update_kernel.py run through the Triton
    kernels under TRITON_INTERPRET=1, in one subprocess (its start-up is most of the cost)."""
    tmp = Path(tempfile.mkdtemp(prefix="fp8kit-triton-"))
    try:
        code = f"""
            from tests.torch import test_kernels, test_update_kernel
            test_kernels.run_all_cases("triton", {str(tmp / "cast.pt")!r})
            test_update_kernel.run_all_cases("triton", {str(tmp / "update.pt")!r})
            print("TRITON_OK")
        """
        rc, out, err = _finish(_start_python(code, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore"))
        assert rc == 0 and "TRITON_OK" in out, out + err
        return torch.load(tmp / "cast.pt"), torch.load(tmp / "update.pt")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_api_triton_under_interpreter() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (optional: pip install -c constraints.txt triton)")
    _check_all(triton_results()[0], "triton")


def test_api_current_equals_quantize_current() -> None:
    """cast_fp8_current is bit for bit today's quantize_current (data, data_t, scale_inv, amax)."""
    gen = torch.Generator().manual_seed(10)
    x = (torch.randn(48, 80, generator=gen) * 7).to(torch.bfloat16)
    x[3, 4] = float("nan")
    for backend in ("native", "reference"):
        if backend == "native" and not kernels.native_available():
            continue
        for fmt in FORMATS:
            for p2 in (False, True):
                want = quantize_current(x, fmt, power_2_scale=p2, transpose=True)
                got = kernels.cast_fp8_current(
                    x, fmt, power_2_scale=p2, transpose=True, backend=backend
                )
                assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
                assert torch.equal(got.data_t.view(torch.uint8), want.data_t.view(torch.uint8))
                assert _f32_bits(got.scale_inv) == _f32_bits(want.scale_inv)
                assert _f32_bits(got.amax) == _f32_bits(want.amax)


def test_api_dispatch_picks_native_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """backend=None runs the native library for CPU tensors (and the reference where it does
    not apply); the results are the same either way."""
    x = _matrix(33, 65, torch.bfloat16, seed=2)
    s = torch.tensor(3.0)
    want = kernels.cast_fp8(x, s, E4M3, transpose=True, dbias=True, backend="reference")
    expected = "native" if kernels.native_available() else "reference"
    assert kernels.backend_for(x) == expected
    calls: list[str] = []
    from fp8kit.torch.kernels import native, reference

    for name, module in (("native", native), ("reference", reference)):
        real = module.cast
        monkeypatch.setattr(module, "cast", lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    got = kernels.cast_fp8(x, s, E4M3, transpose=True, dbias=True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(
            a.view(torch.uint8) if a.element_size() == 1 else a,
            b.view(torch.uint8) if b.element_size() == 1 else b,
        )
    assert calls == [expected]
    calls.clear()
    kernels.cast_fp8(x[:0], s, E4M3)  # empty: the reference
    assert calls == ["reference"]


def test_api_native_call_runs_no_aten_op_but_allocations() -> None:
    """The CPU hot path: a native cast (or GEMM epilogue) is its output allocations and one
    ctypes call; the update event is no aten op at all (the CPU gate counts aten ops per step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if not kernels.native_available():
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    x = _matrix(64, 32, torch.bfloat16, seed=1)
    s = torch.tensor(2.0)
    staging = torch.zeros(4, 3)
    slot = staging[0, 1]
    count = torch.zeros(3, dtype=torch.int64)
    first = count[1]
    acc, b = torch.zeros(64, 32), torch.zeros(32, dtype=torch.bfloat16)
    calls = {
        "cast": (lambda: kernels.cast_fp8(x, s, E4M3, amax_out=slot), 2),
        "cast T dbias": (
            lambda: kernels.cast_fp8(x, s, E4M3, transpose=True, amax_out=slot, dbias=True),
            4,
        ),
        "first step": (
            lambda: kernels.cast_fp8(x, s, E4M3, amax_out=slot, first_step_current=first),
            2,
        ),
        "current T": (lambda: kernels.cast_fp8_current(x, E4M3, transpose=True), 4),
        "amax": (lambda: kernels.compute_amax(x, amax_out=slot), 0),
        "update": (
            lambda: kernels.delayed_update_(
                staging, torch.ones(3), torch.ones(3), count, fmax=448.0
            ),
            0,
        ),
        "epilogue float32": (lambda: kernels.gemm_epilogue(acc, s, s, torch.float32), 0),
        "epilogue bf16": (lambda: kernels.gemm_epilogue(acc, s, s, torch.bfloat16, bias=b), 1),
    }
    for name, (fn, empties) in calls.items():
        with Ops() as ops:
            fn()
        ours = [n for n in ops.names if n != "ones.default"]  # the test's own arguments
        assert ours == ["empty.memory_format"] * empties, (name, ops.names)


def test_api_errors_name_the_parameter() -> None:
    x = torch.randn(4, 6)
    s = torch.tensor(1.0)
    with pytest.raises(TypeError, match="fp8_dtype must be"):
        kernels.cast_fp8(x, s, torch.float16)
    with pytest.raises(TypeError, match="x must have dtype"):
        kernels.cast_fp8(x.double(), s, E4M3)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        kernels.cast_fp8([1.0], s, E4M3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"scale must be a torch\.float32 tensor with one element"):
        kernels.cast_fp8(x, torch.ones(2), E4M3)
    with pytest.raises(TypeError, match="scale must be"):
        kernels.cast_fp8(x, s.double(), E4M3)
    with pytest.raises(TypeError, match="amax_out must be"):
        kernels.cast_fp8(x, s, E4M3, amax_out=torch.zeros(2))
    with pytest.raises(TypeError, match=r"first_step_current must be a torch\.int64"):
        kernels.cast_fp8(x, s, E4M3, first_step_current=torch.zeros(1))
    with pytest.raises(ValueError, match="transpose=True needs a 2-D x"):
        kernels.cast_fp8(x.view(-1), s, E4M3, transpose=True)
    with pytest.raises(ValueError, match="dbias=True needs a 2-D x"):
        kernels.cast_fp8_current(x.view(2, 2, 6), E4M3, dbias=True)
    with pytest.raises(TypeError, match="power_2_scale must be a bool"):
        kernels.cast_fp8_current(x, E4M3, power_2_scale=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend must be None or one of"):
        kernels.cast_fp8(x, s, E4M3, backend="cuda")
    with pytest.raises(TypeError, match="x must be a float32, bfloat16 or float16 tensor"):
        kernels.compute_amax(x.int())
    # Tensors on another device (meta here): the native kernel would read a null pointer,
    # or skip the amax fold.
    meta = torch.device("meta")
    with pytest.raises(TypeError, match=r"scale must be .* on x's device \(cpu\), got .* on meta"):
        kernels.cast_fp8(x, s.to(meta), E4M3)
    with pytest.raises(TypeError, match=r"amax_out must be .* on x's device"):
        kernels.cast_fp8(x, s, E4M3, amax_out=torch.zeros((), device=meta))
    with pytest.raises(ValueError, match=r"backend='native' runs on CPU tensors only, got x on"):
        kernels.cast_fp8(x.to(meta), s.to(meta), E4M3, backend="native")
    if torch.cuda.is_available():
        with pytest.raises(TypeError, match=r"scale must be .* on x's device"):
            kernels.cast_fp8(x, s.cuda(), E4M3)


# ---------------------------------------------------------------------------------------------
# Triton: exhaustive bit patterns under the interpreter (slow), and the lowering for Hopper
# ---------------------------------------------------------------------------------------------

_TRITON_CHECK = """
    import torch
    from fp8kit.formats import E4M3, E5M2
    from fp8kit.torch.kernels import triton_cast as tc
    from fp8kit.torch.kernels.reference import cast_to_fp8_reference as ref
    from tests.torch.test_kernels import _all_16bit_patterns, _float32_edge_values

    def same(got, want, what):
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)), what
        assert got[0].dtype == want[0].dtype and got[0].stride() == want[0].stride(), what
        assert got[-1].dtype == torch.float32 and got[-1].dim() == 0, what
        assert got[-1].view(torch.int32).item() == want[-1].view(torch.int32).item(), what

    n = 0
    for dtype in (torch.bfloat16, torch.float16):
        x = _all_16bit_patterns(dtype)
        for fmt in (E4M3, E5M2):
            for s in (1.0, 448.0 / 3.0, 3.0e38, 2.0**-30, 0.7):
                st = torch.tensor(s)
                same(tc.triton_cast(x, st, fmt), ref(x, st, fmt), (dtype, fmt, s)); n += 1
    for fmt in (E4M3, E5M2):
        x = _float32_edge_values(fmt)
        for s in (1.0, 0.7, 2.0**-30):
            st = torch.tensor(s)
            same(tc.triton_cast(x, st, fmt), ref(x, st, fmt), (fmt, s)); n += 1
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(40, 33, generator=gen) * 100
    for v in (base.t(), base[::2], torch.empty(0, 3)):
        same(tc.triton_cast(v, torch.tensor(3.0), E5M2), ref(v, torch.tensor(3.0), E5M2), "view")
        n += 1
    for m, k in ((1, 1), (33, 65), (64, 32)):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16) * 50
        d, dt, a = tc.triton_cast_transpose(x, torch.tensor(2.0), E4M3)
        want = ref(x, torch.tensor(2.0), E4M3)
        same((d, a), want, (m, k))
        assert torch.equal(dt.view(torch.uint8), want[0].view(torch.uint8).t())
        n += 1
    print("TRITON_OK", n)
"""


@pytest.mark.slow
def test_triton_kernel_bit_exact_under_interpreter() -> None:
    """Every bfloat16 / float16 bit pattern through the older entry points (cast_to_fp8 and
    cast_to_fp8_transpose run them on CUDA)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (optional: pip install -c constraints.txt triton)")
    rc, out, err = _finish(
        _start_python(_TRITON_CHECK, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    )
    assert rc == 0, out + err
    assert "TRITON_OK" in out


_TRITON_HW_WIRING_CHECK = """
    import torch
    from fp8kit.formats import E4M3, E5M2
    from fp8kit.torch.kernels import triton_cast as tc
    from fp8kit.torch.kernels.reference import cast_to_fp8_reference as ref

    # the hardware-conversion variant (sm_89+) on the CPU: the interpreter's float8 conversion
    # is exact for values already on the FP8 grid, so every code, +-0 and signed NaNs check the
    # code around the conversion (the NaN fix, byte packing, transpose, amax) bit for bit
    tc.set_hardware_conversion(torch.device("cpu"), True)
    n = 0
    for fmt, fp8 in ((E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)):
        grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
        grid = grid[torch.isfinite(grid)]
        nans = torch.tensor([0x7FC00000, -0x00400000, 0x7F800001, -1], dtype=torch.int32)
        values = torch.cat([grid, nans.view(torch.float32), torch.tensor([0.0, -0.0])])
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for s in (1.0, 8.0, 0.25):
                x = (values / s).to(dtype)  # exact: powers of two (float16 overflows to inf)
                x = x[~torch.isinf(x)]  # +-inf saturate in cvt.rn.satfinite, not here
                st = torch.tensor(s)
                data, amax = tc.triton_cast(x, st, fmt)
                want, want_amax = ref(x, st, fmt)
                assert torch.equal(data.view(torch.uint8), want.view(torch.uint8)), (fmt, dtype, s)
                assert amax.view(torch.int32).item() == want_amax.view(torch.int32).item()
                cols = 8
                rows = -(-x.numel() // cols)
                x2 = torch.cat([x, x[: rows * cols - x.numel()]]).reshape(rows, cols)
                d, dt, a = tc.triton_cast_transpose(x2, st, fmt)
                w, wa = ref(x2, st, fmt)
                assert torch.equal(d.view(torch.uint8), w.view(torch.uint8)), (fmt, dtype, s)
                assert torch.equal(dt.view(torch.uint8), w.view(torch.uint8).t()), (fmt, dtype, s)
                assert a.view(torch.int32).item() == wa.view(torch.int32).item()
                n += 1
    print("TRITON_HW_OK", n)
"""


@pytest.mark.slow
def test_triton_hardware_conversion_variant_wiring_under_interpreter() -> None:
    """The kernels' hardware-conversion variant (what sm_89+ GPUs run) on every FP8 grid value,
    +-0 and signed NaNs from float32 / bfloat16 / float16 inputs. Rounding and saturation are
    the GPU's ``cvt.rn.satfinite`` there; ``test_triton_on_the_gpu_matches_the_model`` checks
    them against the model on a GPU."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (optional: pip install -c constraints.txt triton)")
    rc, out, err = _finish(
        _start_python(_TRITON_HW_WIRING_CHECK, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    )
    assert rc == 0, out + err
    assert "TRITON_HW_OK" in out


def use_triton_conversion(conversion: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the Triton casts on this CUDA device convert with ``conversion`` ("hardware":
    ``cvt.rn.satfinite``, sm_89+; "software": integer arithmetic) until the test ends."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if conversion == "hardware" and not triton_cast._hardware_conversion_possible(props):
        pytest.skip("no one-rounding FP8 conversion for this GPU with this Triton (ADR 0253)")
    device = torch.device("cuda", torch.cuda.current_device())
    triton_cast._device_facts(torch.empty(0, device=device))  # the device's default entry
    cache = triton_cast._device_facts_cache
    monkeypatch.setitem(cache, device.index, cache[device.index])  # restored after the test
    triton_cast.set_hardware_conversion(device, conversion == "hardware")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("conversion", ["hardware", "software"])
def test_triton_on_the_gpu_every_16bit_pattern(
    conversion: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every bfloat16 / float16 bit pattern and the float32 edge values (ties, neighbours,
    beyond fmax, +-inf, NaNs) at several scales through the Triton casts on the GPU, plain and
    transposed, bit for bit against the reference (run on the CPU)."""
    use_triton_conversion(conversion, monkeypatch)
    inputs = [_all_16bit_patterns(d) for d in (torch.bfloat16, torch.float16)]
    inputs += [_float32_edge_values(fmt) for fmt in FORMATS]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the torch path fails the test
        for x in inputs:
            for fmt in FORMATS:
                for s in (1.0, 448.0 / 3.0, 3.0e38, 2.0**-30, 0.7):
                    want, want_amax = cast_to_fp8_reference(x, _scale(s), fmt)
                    fp8 = want.dtype
                    rows = x.reshape(-1, 64 if x.numel() % 64 == 0 else 1)  # whole tiles, ragged
                    cuda, scale = rows.cuda(), _scale(s).cuda()
                    r = kernels.cast_fp8(cuda.view(-1), scale, fp8, backend="triton")
                    t = kernels.cast_fp8(cuda, scale, fp8, transpose=True, backend="triton")
                    what = (x.dtype, fmt, s, conversion)
                    codes = want.view(torch.uint8)
                    assert torch.equal(r.data.cpu().view(torch.uint8), codes), what
                    assert torch.equal(r.amax.cpu(), want_amax), what
                    assert torch.equal(t.data.cpu().view(torch.uint8).view(-1), codes), what
                    assert torch.equal(t.data_t.cpu(), t.data.cpu().t().contiguous()), what


def test_one_rounding_conversion_is_read_from_the_ptx() -> None:
    """The direct float32 -> FP8 instruction of the format, and no FP8 conversion through
    float16 (two roundings: what Triton 3.2 and 3.6 compile for sm_89; ADR 0253)."""
    direct = "cvt.rn.satfinite.e4m3x2.f32 %rs1, %r2, %r3;"
    through_f16 = "cvt.rn.f16x2.f32 %r4, %r2, %r3;\ncvt.rn.satfinite.e4m3x2.f16x2 %rs1, %r4;"
    assert triton_cast.converts_in_one_rounding(direct, 0)
    assert not triton_cast.converts_in_one_rounding(direct, 1)  # E5M2 wants e5m2x2
    assert not triton_cast.converts_in_one_rounding(through_f16, 0)
    assert not triton_cast.converts_in_one_rounding(direct + "\n" + through_f16, 0)
    assert not triton_cast.converts_in_one_rounding("", 0)


@pytest.mark.slow
def test_hardware_conversion_is_used_where_triton_lowers_it_in_one_rounding() -> None:
    """The per-capability probe (compiled, no GPU needed) agrees with the transposing kernel
    compiled for that GPU: sm_90 converts directly with every Triton fp8kit supports; sm_89
    does with the pinned Triton (3.9), not with 3.2 or 3.6 (checked by hand, ADR 0253)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (optional: pip install -c constraints.txt triton)")
    sig = dict(
        x_ptr="*bf16", scale_ptr="*fp32", count_ptr="*i64", partial_ptr="*fp32",
        out_ptr="*fp8e4nv", out_t_ptr="*fp8e4nv", amax_ptr="*fp32", scale_inv_ptr="*fp32",
        dbias_ptr="*fp32", m="i32", n="i32", tiles_per_program="i32", n_partials="i32",
    )  # fmt: skip
    for capability in ((8, 9), (9, 0)):
        kernel_direct = True
        for fmt_id in (0, 1):
            consts = dict(
                FMT=fmt_id, IN=1, MODE=0, POW2=False, HW=True, TRANSPOSE=True, DBIAS=True,
                EVEN=True, BM=64, BN=64, P_BLOCK=16,
            )  # fmt: skip
            asm = triton_cast.compile_for_target(
                triton_cast._cast_2d_kernel, capability, {**sig, **consts}, consts, warps=4
            )
            kernel_direct &= triton_cast.converts_in_one_rounding(asm["ptx"], fmt_id)
        assert triton_cast._hardware_conversion_lowers(capability) == kernel_direct, capability
    assert triton_cast._hardware_conversion_lowers((9, 0))


_HW_SWITCH_CHECK = """
    import importlib, os
    from fp8kit.torch.kernels import triton_cast as tc
    for value in ("", "off", "ON", "nope"):
        os.environ["FP8KIT_TRITON_HW_CVT"] = value
        try:
            print(repr(value), importlib.reload(tc)._HW_CVT_ENABLED)
        except ValueError as exc:
            print(repr(value), "ValueError", exc)
"""


def test_hardware_conversion_switch_is_read_at_import() -> None:
    """FP8KIT_TRITON_HW_CVT: on unless set off (the words of FP8KIT_DISABLE_NATIVE); any other
    value raises at the import (the first CUDA cast), naming the variable."""
    rc, out, err = _finish(_start_python(_HW_SWITCH_CHECK))
    assert rc == 0, out + err
    lines = out.splitlines()
    assert lines[:3] == ["'' True", "'off' False", "'ON' True"], out
    assert lines[3].startswith("'nope' ValueError FP8KIT_TRITON_HW_CVT must be one of"), out


_GPU_CONVERSION_SOURCE = """
#include <cstddef>
#include "cuda_fp8.h"
extern "C" void hw_cvt(const float* x, unsigned char* e4m3, unsigned char* e5m2, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    e4m3[i] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E4M3);
    e5m2[i] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E5M2);
  }
}
"""


def _cuda_include_dir() -> Path | None:
    """A CUDA toolkit include folder with ``cuda_fp8.h`` (and the ``nv/target`` it needs)."""
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    for root in filter(None, roots):
        include = Path(root) / "include"
        if (include / "cuda_fp8.h").exists() and (include / "nv" / "target").exists():
            return include
    return None


def test_gpu_fp8_conversion_contract_matches_the_reference(tmp_path: Path) -> None:
    """What the Triton casts run on sm_89+ (``cvt.rn.satfinite.{e4m3,e5m2}x2.f32``, ADR 0253) as
    NVIDIA's ``cuda_fp8.h`` specifies it for the host (the header emits that instruction on
    sm_89+ and this code elsewhere), against fp8kit's conversion on every bfloat16 pattern with
    six tails of the low 16 bits (ties, neighbours) and 2^20 random float32 patterns: equal but
    for NaN, which the hardware makes the canonical 0x7F and the kernels give the input's sign.
    Needs a CUDA toolkit's headers; all 2^32 patterns were compared once (ADR 0253)."""
    include = _cuda_include_dir()
    if include is None or not _compiler_present():
        pytest.skip("needs a C++ compiler and a CUDA toolkit's include folder (cuda_fp8.h)")
    source = tmp_path / "hw_cvt.cpp"
    source.write_text(_GPU_CONVERSION_SOURCE)
    library = tmp_path / "hw_cvt.so"
    cxx = os.environ.get("CXX", "c++")
    subprocess.run(
        [cxx, "-O2", "-shared", "-fPIC", f"-I{include}", str(source), "-o", str(library)],
        check=True,
        capture_output=True,
    )
    hw_cvt = ctypes.CDLL(str(library)).hw_cvt
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    tails = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    rng = np.random.default_rng(0)
    random = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([(high[:, None] | tails[None, :]).ravel(), random])
    x = torch.from_numpy(bits.view(np.float32))
    codes = {fmt: np.empty(bits.size, np.uint8) for fmt in FORMATS}
    hw_cvt(
        ctypes.c_void_p(x.data_ptr()),
        ctypes.c_void_p(codes[E4M3].ctypes.data),
        ctypes.c_void_p(codes[E5M2].ctypes.data),
        ctypes.c_size_t(bits.size),
    )
    nan = torch.isnan(x).numpy()
    for fmt in FORMATS:
        want = cast_to_fp8_reference(x, _scale(1.0), fmt)[0].view(torch.uint8).numpy()
        got = codes[fmt]
        diff = np.nonzero((got != want) & ~nan)[0]
        assert diff.size == 0, (fmt, [hex(b) for b in bits[diff[:5]]], got[diff[:5]])
        assert (got[nan] == 0x7F).all(), fmt  # the canonical NaN, whatever the input's sign


@pytest.mark.slow
def test_triton_kernels_lower_for_hopper() -> None:
    """Compile the cast kernels for sm_90 (no GPU needed; ``benchmarks/kernel_census.py``) and
    check the code: 16-byte loads and stores, one atomic per program, IEEE divisions, no FMA and
    no flush-to-zero, NaN-ignoring maxima, the hardware FP8 conversion where asked for, and the
    main loop's SASS instructions per element (25-29 with the integer conversion, when the casts
    were issue-bound on the H200; ADR 0253)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (optional: pip install -c constraints.txt triton)")
    code = "from benchmarks.kernel_census import main; main(['--json'])"
    rc, out, err = _finish(_start_python(code, PYTHONWARNINGS="ignore"))
    if rc != 0 and ("ptxas" in err or "nvdisasm" in err):
        pytest.skip(f"no ptxas / nvdisasm for sm_90 here: {err[-300:]}")
    assert rc == 0, out + err
    rows = json.loads(out)
    assert len(rows) == 12, rows  # 2 inputs x 2 conversions x 3 kernels
    budget = {"cast+amax": 11.0, "cast+transpose+amax": 15.0, "cast+transpose+dbias+amax": 15.0}
    by_key = {(r["input"], r["variant"], r["conversion"]): r for r in rows}
    for row in rows:
        assert row["v4 loads"] >= 4, row  # 16 bfloat16 per thread: 2 x 16 bytes, twice
        assert row["v4 stores"] >= 2, row
        assert row["atomics"] == 1, row
        assert row["div.rn"] == 1, row
        assert row["nan max"] == 0, row
        assert row["bad"] == [], row
        assert row["one-rounding cvt"] == (row["conversion"] == "hardware"), row
        if row["conversion"] == "hardware":
            integer = by_key[(row["input"], row["variant"], "integer")]["sass per element"]
            assert row["sass per element"] <= budget[row["variant"]], row
            assert row["sass per element"] < 0.7 * integer, (row, integer)


def test_triton_failure_warns_once_then_runs_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Triton kernel that raises (no GPU compiler, a launch error) is reported once; the call
    is redone in torch and later calls go straight to torch (dispatch.py's CUDA rule, driven
    here with CPU tensors and a Triton backend that fails)."""
    from fp8kit.torch.kernels import reference

    attempts: list[str] = []

    class BrokenTriton:
        def cast(self, *args: object) -> None:
            attempts.append("cast")
            raise RuntimeError("ptxas not found")

    def cuda_rule(x: torch.Tensor) -> tuple[str, object]:  # what _auto does for CUDA tensors
        triton_backend = dispatch._load_triton()
        return ("triton", triton_backend) if triton_backend else ("reference", reference)

    monkeypatch.setattr(dispatch, "_triton_state", {"backend": BrokenTriton(), "error": None})
    monkeypatch.setattr(dispatch, "_auto", cuda_rule)
    assert kernels.triton_error() is None
    x = _matrix(33, 65, torch.bfloat16, seed=1)
    s = torch.tensor(2.0)
    want = reference.cast(x, s, _spec(E4M3, x), True, None, True, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            got = kernels.cast_fp8(x, s, E4M3, transpose=True, dbias=True)
            assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
            assert torch.equal(got.dbias, want.dbias) and torch.equal(got.amax, want.amax)
    ours = [w for w in caught if issubclass(w.category, kernels.NativeKernelWarning)]
    assert len(ours) == 1 and "ptxas not found" in str(ours[0].message)
    assert attempts == ["cast"]
    assert not kernels.triton_available()
    assert kernels.triton_error() == "RuntimeError: ptxas not found"  # what benchmarks report


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_kernels_leave_autograd_alone(backend: str) -> None:
    """An input that requires grad: the kernels' outputs do not, and the amax entry they fold
    into (a view of an FP8 state's history) stays out of the autograd graph (the reference
    backend pulled the history into it, through ``clamp_``)."""
    if backend == "native" and not kernels.native_available():
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")
    x = torch.randn(16, 32, requires_grad=True)
    history = torch.zeros(4, 3)
    s = torch.tensor(2.0)
    r = kernels.cast_fp8(x, s, E4M3, transpose=True, amax_out=history[0, :1], backend=backend)
    assert history.grad_fn is None and not history.requires_grad
    c = kernels.cast_fp8_current(x, E5M2, transpose=True, dbias=True, backend=backend)
    a = kernels.compute_amax(x, backend=backend)
    kernels.compute_amax(x, amax_out=history[0, 1:2], backend=backend)
    assert history.grad_fn is None and not history.requires_grad
    outputs = [*r, *c, a]
    assert not any(isinstance(t, torch.Tensor) and t.requires_grad for t in outputs)


def test_disable_native_variable_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8KIT_DISABLE_NATIVE=y (or any unknown value) used to leave the kernels on silently."""
    for value, disabled in (("1", True), (" On ", True), ("0", False), ("off", False)):
        monkeypatch.setenv("FP8KIT_DISABLE_NATIVE", value)
        assert _native._disabled_by_env() is disabled, value
    monkeypatch.setenv("FP8KIT_DISABLE_NATIVE", "y")
    with pytest.raises(ValueError, match=r"FP8KIT_DISABLE_NATIVE must be one of .* got 'y'"):
        _native._disabled_by_env()

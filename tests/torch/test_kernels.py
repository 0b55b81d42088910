"""The fused FP8 cast kernels (fp8kit.torch.kernels) against the pure-torch reference, bit for bit.

Every native result is compared with ``cast_to_fp8_reference`` on the FP8 bit patterns, the amax
bits, dtype, shape, strides and device, for both the scalar and the AVX2 loop of the C++ kernel.
The reference itself is checked against the independent numpy model in ``tests/reference.py``.
The Triton kernel is checked the same way under ``TRITON_INTERPRET=1`` (in a subprocess, since
the interpreter is chosen when the kernel is defined).
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8kit.formats import E4M3, E5M2, FP8Format
from fp8kit.torch import kernels
from fp8kit.torch.quantization import cast_to_fp8, cast_to_fp8_reference
from tests.reference import quantize_reference

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


def _check_native(
    x: torch.Tensor, scale: float, fmt: FP8Format, isas: list[int], what: str = ""
) -> None:
    s = _scale(scale)
    want = cast_to_fp8_reference(x, s, fmt)
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
    assert amax.item() == ref_amax.item()


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
    """SPEC 10.11 / 10.12 through the dispatching entry point."""
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
    """cast_to_fp8 (native where built) against tests/reference.py, written from the SPEC."""
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
            cast_to_fp8_reference(x.to(dtype), _scale(2.0), E4M3),
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_amax_matches_torch(isas: list[int], dtype: torch.dtype) -> None:
    """The amax-only kernel (current scaling's first read) equals nan_ignoring_amax."""
    from fp8kit.torch.quantization import nan_ignoring_amax

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
        want = nan_ignoring_amax(x)
        for isa in isas:
            got = kernels.native_amax(x, isa)
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
            want = cast_to_fp8_reference(x, s, fmt)
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
    want = cast_to_fp8_reference(x, s, E4M3)
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
            want = cast_to_fp8_reference(v, s, E5M2)  # no kernel for float64 inputs
            want = (want[0].contiguous(), want[1])
        else:
            want = cast_to_fp8_reference(v.contiguous(), s, E5M2)
        assert_same((data, amax), want, f"{tuple(v.shape)}")
        assert data_t.is_contiguous() and torch.equal(_bits(data_t), _bits(want[0]).t())


# ---------------------------------------------------------------------------------------------
# Triton (interpreter on the CPU)
# ---------------------------------------------------------------------------------------------

_TRITON_CHECK = """
    import math
    import torch
    from fp8kit.formats import E4M3, E5M2
    from fp8kit.torch.kernels import triton_cast as tc
    from fp8kit.torch.quantization import cast_to_fp8_reference as ref
    from tests.torch.test_kernels import _all_16bit_patterns, _float32_edge_values

    def same(got, want, what):
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)), what
        assert got[0].dtype == want[0].dtype and got[0].stride() == want[0].stride(), what
        assert got[-1].dtype == torch.float32 and got[-1].dim() == 0, what
        assert got[-1].view(torch.int32).item() == want[-1].view(torch.int32).item(), what

    n = 0
    tc._BLOCK = 1 << 16  # one program per call: the interpreter's cost is per program
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
    tc._BLOCK = 1024  # the production block size, with masked tails
    gen = torch.Generator().manual_seed(0)
    for size in (1, 7, 1023, 4097):
        x = torch.randn(size, generator=gen) * 100
        same(tc.triton_cast(x, torch.tensor(3.0), E4M3), ref(x, torch.tensor(3.0), E4M3), size)
        n += 1
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
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (optional: pip install -c constraints.txt triton)")
    rc, out, err = _finish(
        _start_python(_TRITON_CHECK, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    )
    assert rc == 0, out + err
    assert "TRITON_OK" in out


def test_triton_format_constants_match_formats() -> None:
    """The Triton kernel's integer constants describe the same conversion as the C++ ones."""
    from fp8kit.torch.kernels.triton_cast import _format_constants

    e4 = _format_constants(E4M3)
    assert e4["FMAX_BITS"] == struct.unpack("<I", struct.pack("<f", 448.0))[0]
    assert e4["MIN_NORMAL_BITS"] == struct.unpack("<I", struct.pack("<f", 2.0**-6))[0]
    assert e4["SHIFT"] == 20 and e4["MAGIC"] == 2.0**14
    e5 = _format_constants(E5M2)
    assert e5["FMAX_BITS"] == struct.unpack("<I", struct.pack("<f", 57344.0))[0]
    assert e5["MIN_NORMAL_BITS"] == struct.unpack("<I", struct.pack("<f", 2.0**-14))[0]
    assert e5["SHIFT"] == 21 and e5["MAGIC"] == 2.0**7
    assert math.isclose(e5["MAGIC_BITS"], struct.unpack("<I", struct.pack("<f", 128.0))[0])

"""kernels.cast_error_sums (the inspector's per-cast counts and energies): native and torch
backends against numpy arithmetic written from the definitions, on random inputs with edge
values, any strides, and sizes that cross the native kernel's chunks and threads."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8kit.formats import E4M3, E5M2
from fp8kit.torch import kernels
from fp8kit.torch.kernels import dispatch, native

FORMATS = {torch.float8_e4m3fn: E4M3.max, torch.float8_e5m2: E5M2.max}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("native", "reference")


def _needs(backend: str) -> None:
    if backend == "native" and not kernels.native_available():
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")


def numpy_error_sums(
    x: torch.Tensor, q: torch.Tensor, scale: float, scale_inv: float, fmax: float
) -> tuple[int, int, float, float]:
    """The definitions, element by element: float32 ``|x| * scale > fmax`` and ``q *
    scale_inv``, exact float64 squares of float32 values, sums rounded once (``math.fsum``)."""
    xf = x.to(torch.float32).reshape(-1).numpy()
    qf = q.to(torch.float32).reshape(-1).numpy()
    s, s_inv = np.float32(scale), np.float32(scale_inv)
    with np.errstate(over="ignore", invalid="ignore"):
        saturated = int(np.count_nonzero(np.abs(xf) * s > np.float32(fmax)))
        deq = (qf * s_inv).astype(np.float32)
    flushed = int(np.count_nonzero((xf != 0) & (qf == 0)))
    finite = np.isfinite(xf)
    xd, dd = xf[finite].astype(np.float64), deq[finite].astype(np.float64)
    signal = math.fsum((xd * xd).tolist())
    noise = math.fsum(((xd - dd) ** 2).tolist())
    return saturated, flushed, signal, noise


def edge_input(n: int, dtype: torch.dtype, scale: float, fmax: float, seed: int) -> torch.Tensor:
    """Normal values over many octaves, with zeros, float32 subnormals, values at and around
    ``+-fmax / scale``, infinities and NaN scattered in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 12, (n,), generator=g))
    edges = torch.tensor(
        [0.0, -0.0, 1e-40, -1e-41, fmax / scale, -fmax / scale, 1.01 * fmax / scale,
         -0.999 * fmax / scale, math.inf, -math.inf, math.nan, 2.0**-20 / scale],
        dtype=torch.float32,
    )  # fmt: skip
    where = torch.randint(0, n, (4 * len(edges),), generator=g)
    x[where] = edges.repeat(4)
    return x.to(dtype)


def _assert_matches(got: torch.Tensor, want: tuple[int, int, float, float]) -> None:
    assert got.dtype == torch.float64 and got.shape == (4,)
    saturated, flushed, signal, noise = got.tolist()
    assert (saturated, flushed) == (float(want[0]), float(want[1]))
    assert signal == pytest.approx(want[2], rel=1e-12, abs=0.0, nan_ok=True)
    assert noise == pytest.approx(want[3], rel=1e-12, abs=0.0, nan_ok=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", list(FORMATS))
@pytest.mark.parametrize("scale", [1.0, 0.37, 1024.0, 2.0**-30])
def test_a_real_cast_matches_the_definitions(
    backend: str, dtype: torch.dtype, fp8: torch.dtype, scale: float
) -> None:
    _needs(backend)
    fmax = FORMATS[fp8]
    x = edge_input(3000, dtype, scale, fmax, seed=int(scale * 1e3) % 97).reshape(1000, 3).t()
    s = torch.tensor(scale)
    cast = kernels.cast_fp8(x, s, fp8)
    got = kernels.cast_error_sums(x, cast.data, s, cast.scale_inv, fmax, backend=backend)
    _assert_matches(got, numpy_error_sums(x, cast.data, scale, cast.scale_inv.item(), fmax))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", list(FORMATS))
def test_any_fp8_codes_match_the_definitions(backend: str, fp8: torch.dtype) -> None:
    """q need not be x's cast: every code (NaN, +-0, subnormals, +-fmax) against any x."""
    _needs(backend)
    g = torch.Generator().manual_seed(5)
    x = edge_input(4096, torch.float32, 1.0, FORMATS[fp8], seed=6)
    codes = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    s, s_inv = torch.tensor(3.0), torch.tensor(1 / 3.0)
    q = codes.view(fp8)
    got = kernels.cast_error_sums(x, q, s, s_inv, FORMATS[fp8], backend=backend)
    _assert_matches(got, numpy_error_sums(x, q, 3.0, s_inv.item(), FORMATS[fp8]))
    assert math.isnan(got[3].item())  # a NaN (or, in E5M2, infinite) code against a finite x
    q = torch.where(q.to(torch.float32).isfinite(), codes, 0).to(torch.uint8).view(fp8)
    got = kernels.cast_error_sums(x, q, s, s_inv, FORMATS[fp8], backend=backend)
    _assert_matches(got, numpy_error_sums(x, q, 3.0, s_inv.item(), FORMATS[fp8]))
    assert math.isfinite(got[3].item()) and got[1].item() > 0


def test_the_native_sums_do_not_depend_on_threads_loops_or_strides() -> None:
    """A size over many chunks with a ragged tail: same bits with 1 and 2 threads, from every
    loop this CPU has (scalar, AVX2), and for a transposed view as for its contiguous copy;
    counts and sums still match the definitions."""
    _needs("native")
    x = edge_input(1031 * 613, torch.bfloat16, 2.0, E4M3.max, seed=7).reshape(1031, 613)
    s = torch.tensor(2.0)
    cast = kernels.cast_fp8(x, s, torch.float8_e4m3fn)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.cast_error_sums(x, cast.data, s, cast.scale_inv, E4M3.max)
        torch.set_num_threads(2)
        two = kernels.cast_error_sums(x, cast.data, s, cast.scale_inv, E4M3.max)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for isa in range(kernels.ISA_SCALAR, kernels.native_isa_level() + 1):  # every loop here
        looped = native.cast_error_sums(x, cast.data, s, cast.scale_inv, E4M3.max, isa)
        assert torch.equal(looped, one), f"isa {isa}"
    xt, qt = x.t().contiguous().t(), cast.data.t().contiguous().t()
    assert not xt.is_contiguous()
    strided = kernels.cast_error_sums(xt, qt, s, cast.scale_inv, E4M3.max)
    assert torch.equal(strided, one)
    _assert_matches(one, numpy_error_sums(x, cast.data, 2.0, cast.scale_inv.item(), E4M3.max))


def test_an_empty_cast_sums_to_zero() -> None:
    for backend in BACKENDS:
        _needs(backend)
        x, q = torch.empty(0, 8), torch.empty(0, 8, dtype=torch.float8_e5m2)
        got = kernels.cast_error_sums(x, q, torch.tensor(1.0), torch.tensor(1.0), E5M2.max,
                                      backend=backend)  # fmt: skip
        assert got.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_the_cpu_runs_one_native_call(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs("native")
    calls = []
    real = native.cast_error_sums
    monkeypatch.setattr(native, "cast_error_sums", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(64, 32)
    cast = kernels.cast_fp8(x, torch.tensor(1.0), torch.float8_e4m3fn)
    kernels.cast_error_sums(x, cast.data, torch.tensor(1.0), cast.scale_inv, E4M3.max)
    assert calls == [1]


def test_bad_arguments_name_the_parameter() -> None:
    x = torch.randn(4, 4)
    q = x.to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    with pytest.raises(TypeError, match=r"x must be a torch\.float32"):
        kernels.cast_error_sums(x.double(), q, one, one, 448.0)
    with pytest.raises(TypeError, match=r"q must be a torch\.float8_e4m3fn"):
        kernels.cast_error_sums(x, q.reshape(2, 8), one, one, 448.0)
    with pytest.raises(TypeError, match="q must be"):
        kernels.cast_error_sums(x, x, one, one, 448.0)
    with pytest.raises(TypeError, match=r"scale must be a torch\.float32 tensor with one element"):
        kernels.cast_error_sums(x, q, one.double(), one, 448.0)
    with pytest.raises(TypeError, match="scale_inv must be"):
        kernels.cast_error_sums(x, q, one, torch.ones(2), 448.0)
    for fmax in (0.0, -1.0, math.inf, math.nan, True, "448"):
        with pytest.raises(ValueError, match="fmax must be a positive finite number"):
            kernels.cast_error_sums(x, q, one, one, fmax)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend must be None, 'native' or 'reference'"):
        kernels.cast_error_sums(x, q, one, one, 448.0, backend="triton")
    # any real number is an fmax, numpy's included
    want = kernels.cast_error_sums(x, q, one, one, 448.0)
    assert torch.equal(kernels.cast_error_sums(x, q, one, one, np.float32(448)), want)
    assert torch.equal(kernels.cast_error_sums(x, q, one, one, 448), want)


def test_backend_native_names_why_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forced native backend: a non-CPU tensor is the call's error, reported first; without
    the library the error says why it is missing (it used to be an AttributeError)."""
    monkeypatch.setattr(dispatch, "load_native", lambda: None)
    monkeypatch.setattr(dispatch, "native_build_error", lambda: "no C++ compiler here")
    x = torch.randn(4, 4)
    q = x.to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    meta = torch.device("meta")
    with pytest.raises(ValueError, match="backend='native' needs CPU tensors, got x on meta"):
        kernels.cast_error_sums(
            x.to(meta), q.to(meta), one.to(meta), one.to(meta), 448.0, backend="native"
        )
    unavailable = r"native library is unavailable \(no C\+\+ compiler here\)"
    with pytest.raises(RuntimeError, match=unavailable):
        kernels.cast_error_sums(x, q, one, one, 448.0, backend="native")
    with pytest.raises(RuntimeError, match=unavailable):
        kernels.small_fp8_gemm(q, q.t(), one, one, torch.float32, backend="native")

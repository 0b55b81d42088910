"""The cuBLASLt ``_scaled_mm`` contract, enforced on the CPU, and the low-level fp8_matmul."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fp8kit.torch as f8
from fp8kit.formats import E4M3, E5M2, FP8Format
from fp8kit.torch import gemm
from fp8kit.torch.gemm import Fp8GemmContractError
from tests.reference import fp8_round
from tests.torch.matmul_reference import activation64, assert_fp8_matmul_output


@pytest.fixture(params=["dequant", "scaled_mm"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    before = gemm.cpu_gemm_backend()
    gemm.set_cpu_gemm_backend(request.param)
    yield request.param
    gemm.set_cpu_gemm_backend(before)


def _fp8(x: torch.Tensor, dtype=torch.float8_e4m3fn, scale: float = 1.0) -> f8.Float8Tensor:
    return f8.quantize(x, scale, dtype)


def _ref(t: f8.Float8Tensor) -> np.ndarray:
    return t.data.to(torch.float64).numpy() * t.scale_inv.item()


def test_scaled_mm_matches_exact_product(backend: str) -> None:
    torch.manual_seed(0)
    a = _fp8(torch.randn(32, 64), scale=4.0)
    b = _fp8(torch.randn(48, 64), torch.float8_e5m2, scale=0.5).t()  # column-major (64, 48)
    out = f8.scaled_mm(a, b)
    expected = _ref(a) @ _ref(b)
    np.testing.assert_allclose(out.double().numpy(), expected, rtol=1e-6, atol=1e-6)
    assert f8.scaled_mm(a, b, torch.bfloat16).dtype == torch.bfloat16


def test_scaled_mm_ignores_an_active_torch_autocast(backend: str) -> None:
    """Inside ``torch.autocast("cpu", bfloat16)`` the FP8 GEMM still accumulates the exact FP8
    products in float32 (cuBLASLt's GEMM is not autocast's): the same bits as outside."""
    torch.manual_seed(1)
    a = _fp8(torch.randn(32, 64), scale=4.0)
    b = _fp8(torch.randn(48, 64), scale=0.5).t()
    bias = torch.randn(48, dtype=torch.bfloat16)
    for out_dtype, b_arg in ((torch.float32, None), (torch.bfloat16, bias)):
        outside = f8.scaled_mm(a, b, out_dtype, bias=b_arg)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = f8.scaled_mm(a, b, out_dtype, bias=b_arg)
        assert inside.dtype == out_dtype
        assert torch.equal(inside.view(torch.uint8), outside.view(torch.uint8))
    np.testing.assert_allclose(
        f8.scaled_mm(a, b).double().numpy(), _ref(a) @ _ref(b), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize(
    ("a_shape", "b_shape", "words"),
    [((8, 32), (32, 16), "M=8"), ((16, 24), (24, 16), "K=24"), ((16, 32), (32, 40), "N=40")],
)
def test_dims_must_be_multiples_of_16(a_shape, b_shape, words) -> None:
    a = _fp8(torch.randn(*a_shape))
    b = _fp8(torch.randn(*reversed(b_shape))).t()
    with pytest.raises(Fp8GemmContractError, match=words):
        f8.scaled_mm(a, b)


def test_layout_dtype_and_scale_rules() -> None:
    a = _fp8(torch.randn(16, 32))
    b_col = _fp8(torch.randn(16, 32)).t()
    with pytest.raises(Fp8GemmContractError, match="a must be row-major"):
        f8.scaled_mm(_fp8(torch.randn(32, 16)).t(), b_col)  # a column-major (16, 32)
    with pytest.raises(Fp8GemmContractError, match="b must be column-major"):
        f8.scaled_mm(a, _fp8(torch.randn(32, 16)))
    e5 = torch.float8_e5m2
    with pytest.raises(Fp8GemmContractError, match="E5M2 x E5M2"):
        f8.scaled_mm(_fp8(torch.randn(16, 32), e5), _fp8(torch.randn(16, 32), e5).t())
    bad_scale = f8.Float8Tensor(a.data, torch.tensor([1.0, 1.0]))
    with pytest.raises(Fp8GemmContractError, match="scale_inv must be a float32"):
        f8.scaled_mm(bad_scale, b_col)
    half_scale = f8.Float8Tensor(a.data, torch.tensor(1.0, dtype=torch.float16))
    with pytest.raises(Fp8GemmContractError, match="float32"):
        f8.scaled_mm(half_scale, b_col)
    with pytest.raises(Fp8GemmContractError, match="inner dimensions"):
        f8.scaled_mm(a, _fp8(torch.randn(16, 48)).t())
    with pytest.raises(TypeError, match="out_dtype"):
        f8.scaled_mm(a, b_col, torch.int32)
    with pytest.raises(TypeError, match="use_fast_accum must be a bool"):
        f8.scaled_mm(a, b_col, use_fast_accum="yes")  # type: ignore[arg-type]
    # A bias on another device (meta here, CUDA on a GPU machine) was dropped without a word.
    meta_bias = torch.zeros(16, dtype=torch.bfloat16, device="meta")
    with pytest.raises(Fp8GemmContractError, match="bias is on meta, a and b on cpu"):
        f8.scaled_mm(a, b_col, torch.bfloat16, bias=meta_bias)
    assert issubclass(Fp8GemmContractError, ValueError)


def test_backend_choice_is_validated() -> None:
    with pytest.raises(ValueError, match="'dequant', 'scaled_mm'"):
        gemm.set_cpu_gemm_backend("fast")


@pytest.mark.parametrize(("m", "k", "n"), [(7, 5, 3), (16, 16, 16), (33, 70, 17)])
def test_fp8_matmul_pads_any_shape_exactly(backend: str, m: int, k: int, n: int) -> None:
    torch.manual_seed(m)
    a = _fp8(torch.randn(m, k), scale=2.0)
    b = _fp8(torch.randn(k, n), torch.float8_e5m2)  # row-major: fp8_matmul fixes the layout
    out = f8.fp8_matmul(a, b)
    assert out.shape == (m, n) and out.dtype == torch.float32
    np.testing.assert_allclose(out.double().numpy(), _ref(a) @ _ref(b), rtol=1e-6, atol=1e-6)


def test_fp8_matmul_bias_activation_and_fp8_output(backend: str) -> None:
    torch.manual_seed(1)
    a, b = _fp8(torch.randn(16, 32)), _fp8(torch.randn(32, 48))
    exact = torch.from_numpy(_ref(a) @ _ref(b)).float()
    vec, mat = torch.randn(48), torch.randn(16, 48)
    torch.testing.assert_close(f8.fp8_matmul(a, b, bias=vec), exact + vec)
    torch.testing.assert_close(f8.fp8_matmul(a, b, bias=mat), exact + mat)
    torch.testing.assert_close(
        f8.fp8_matmul(a, b, bias=vec, activation="relu"), torch.relu(exact + vec)
    )
    torch.testing.assert_close(f8.fp8_matmul(a, b, activation="gelu"), F.gelu(exact))
    torch.testing.assert_close(
        f8.fp8_matmul(a, b, activation="gelu_tanh"), F.gelu(exact, approximate="tanh")
    )
    assert f8.fp8_matmul(a, b, out_dtype=torch.bfloat16).dtype == torch.bfloat16

    # FP8 output without an activation: bias only, then no bias into E5M2
    out_scale = torch.tensor(448.0 / 20.0)
    q = f8.fp8_matmul(a, b, bias=vec, out_scale=out_scale)
    assert isinstance(q, f8.Float8Tensor) and q.dtype == torch.float8_e4m3fn
    assert_fp8_matmul_output(q, a, b, vec, None, out_scale.item(), E4M3)
    q5 = f8.fp8_matmul(a, b, out_scale=1.0, out_fp8_dtype=torch.float8_e5m2)
    assert_fp8_matmul_output(q5, a, b, None, None, 1.0, E5M2)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize(
    ("out_fp8_dtype", "fmt"), [(torch.float8_e4m3fn, E4M3), (torch.float8_e5m2, E5M2)], ids=str
)
def test_fp8_matmul_activation_with_fp8_output(
    backend: str, activation: str, out_fp8_dtype: torch.dtype, fmt: FP8Format
) -> None:
    """Bias, activation and the FP8 output together: every FP8 code and the returned amax
    against float64 math (the combination the low-level example runs every step)."""
    gen = torch.Generator().manual_seed(11)
    a = _fp8(torch.randn(24, 40, generator=gen) * 3, scale=16.0)
    b = _fp8(torch.randn(40, 20, generator=gen), torch.float8_e5m2, scale=0.5)
    bias = torch.randn(20, generator=gen)
    # The largest |pre-activation| is negative, so an amax taken before the activation (or an
    # activation skipped) shows in the amax as well as in the codes.
    exact = _ref(a) @ _ref(b)
    bias[3] = -(float(np.abs(exact).max()) + 8.0)
    # A non-power-of-two scale for which the largest outputs land near fmax (some saturate).
    post = activation64(exact + bias.double().numpy(), activation)
    out_scale = fmt.max / (0.9 * float(np.abs(post).max()))
    q = f8.fp8_matmul(
        a, b, bias=bias, activation=activation, out_scale=out_scale, out_fp8_dtype=out_fp8_dtype
    )
    assert isinstance(q, f8.Float8Tensor) and q.dtype == out_fp8_dtype
    assert_fp8_matmul_output(q, a, b, bias, activation, out_scale, fmt)


def test_fp8_matmul_bad_input() -> None:
    a, b = _fp8(torch.randn(16, 32)), _fp8(torch.randn(32, 16))
    with pytest.raises(TypeError, match="b must be a Float8Tensor"):
        f8.fp8_matmul(a, torch.randn(32, 16))
    with pytest.raises(ValueError, match="inner sizes differ"):
        f8.fp8_matmul(a, a)
    with pytest.raises(ValueError, match="bias must be a tensor of shape"):
        f8.fp8_matmul(a, b, bias=torch.randn(15))
    # An integer or float64 bias was converted to float32 without a word; another device's
    # failed inside torch without naming the bias.
    for bias in (torch.ones(16, dtype=torch.int64), torch.ones(16, dtype=torch.float64)):
        with pytest.raises(TypeError, match=r"bias must be a torch\.float32, torch\.bfloat16"):
            f8.fp8_matmul(a, b, bias=bias)
    with pytest.raises(TypeError, match=r"bias must be .* on cpu, got torch\.float32 on meta"):
        f8.fp8_matmul(a, b, bias=torch.ones(16, device="meta"))
    with pytest.raises(ValueError, match="activation must be None or one of"):
        f8.fp8_matmul(a, b, activation="swish")
    with pytest.raises(ValueError, match="out_fp8_dtype is given"):
        f8.fp8_matmul(a, b, out_fp8_dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="out_fp8_dtype must be one of"):
        f8.fp8_matmul(a, b, out_scale=1.0, out_fp8_dtype=torch.float16)
    for dtype in (torch.int32, torch.float64, "bf16"):
        with pytest.raises(TypeError, match=r"out_dtype must be torch\.float32, torch\.bfloat16"):
            f8.fp8_matmul(a, b, out_dtype=dtype)
    with pytest.raises(ValueError, match="with out_scale the result is FP8"):
        f8.fp8_matmul(a, b, out_dtype=torch.bfloat16, out_scale=1.0)
    for scale in (0.0, -2.0, math.nan, math.inf, True):
        with pytest.raises((ValueError, TypeError), match=r"^out_scale must be a (finite )?number"):
            f8.fp8_matmul(a, b, out_scale=scale)
    with pytest.raises(TypeError, match=r"a.data's dtype must be one of"):
        f8.fp8_matmul(f8.Float8Tensor(torch.randn(16, 32), a.scale_inv), b)
    with pytest.raises(TypeError, match=r"b.scale_inv must be a float32 tensor"):
        f8.fp8_matmul(a, f8.Float8Tensor(b.data, 1.0))  # type: ignore[arg-type]
    with pytest.raises(Fp8GemmContractError, match="must be positive, got K=0"):
        f8.scaled_mm(_fp8(torch.randn(16, 0)), _fp8(torch.randn(16, 0)).t())
    with pytest.raises(Fp8GemmContractError, match=r"a.data must be torch.float8_e4m3fn"):
        f8.scaled_mm(f8.Float8Tensor(torch.randn(16, 32), a.scale_inv), b)
    # A plain tensor was named by its .data dtype, a float scale_inv failed with AttributeError.
    with pytest.raises(TypeError, match=r"^a must be a Float8Tensor, got Tensor"):
        f8.scaled_mm(torch.randn(16, 32), b)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^b.scale_inv must be a float32 tensor .* got float"):
        f8.scaled_mm(a, f8.Float8Tensor(b.data, 1.0))  # type: ignore[arg-type]


@pytest.mark.parametrize(("m", "k", "n"), [(0, 32, 16), (8, 0, 16), (8, 32, 0), (0, 0, 0)])
def test_fp8_matmul_of_empty_operands_is_torch_mm_s(m: int, k: int, n: int) -> None:
    """Empty sizes raised the GEMM contract's error; ``torch.mm`` gives an empty product (a sum
    over K = 0 is 0), then bias, activation and the optional FP8 output follow as usual."""
    a, b = _fp8(torch.randn(m, k)), _fp8(torch.randn(k, n))
    bias = torch.linspace(-1.0, 1.0, n)
    y = f8.fp8_matmul(a, b, bias=bias, activation="relu", out_dtype=torch.bfloat16)
    want = torch.relu(torch.mm(torch.zeros(m, k), torch.zeros(k, n)) + bias)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want.to(torch.bfloat16))
    q = f8.fp8_matmul(a, b, bias=bias, activation="relu", out_scale=2.0)
    assert q.data.shape == (m, n) and q.data.dtype == torch.float8_e4m3fn
    assert torch.equal(q.data.float(), (want * 2).to(torch.float8_e4m3fn).float())
    assert float(q.amax) == (float(want.abs().max()) if want.numel() else 0.0)


def test_linear_is_backend_independent(backend: str) -> None:
    """Both CPU backends produce the same Linear numbers (up to float32 accumulation order)."""
    torch.manual_seed(2)
    layer = f8.Linear(32, 48)
    x = torch.randn(16, 32, requires_grad=True)
    with f8.autocast():
        y = layer(x)
    y.backward(torch.randn(16, 48))
    wq = fp8_round(layer.weight.detach().double().numpy(), E4M3)
    xq = fp8_round(x.detach().double().numpy(), E4M3)
    expected = xq @ wq.T + layer.bias.detach().double().numpy()
    np.testing.assert_allclose(y.detach().double().numpy(), expected, rtol=1e-5, atol=1e-5)

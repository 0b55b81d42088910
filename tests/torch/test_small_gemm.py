"""The one-call small FP8 GEMM (``kernels.small_fp8_gemm``) against float32 numpy arithmetic
written from its definition: products summed over k in order from +0, then the GEMM epilogue
(docs/decisions/0236-small-cpu-fp8-gemm.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8kit.formats import E4M3, E5M2, FP8Format
from fp8kit.torch import gemm, kernels
from fp8kit.torch.kernels import ISA_AVX2, ISA_AVX512, ISA_SCALAR, native
from tests.reference import fp8_round
from tests.torch.test_kernels import _epilogue_reference, assert_same_values

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_TORCH_FP8 = {E4M3.name: torch.float8_e4m3fn, E5M2.name: torch.float8_e5m2}
_NATIVE = kernels.native_available()
needs_native = pytest.mark.skipif(not _NATIVE, reason="native kernel unavailable")


def _operand(rows: int, cols: int, fmt: FP8Format, rng: np.random.Generator) -> np.ndarray:
    """float64 values on the FP8 grid of ``fmt``: random magnitudes over the whole range, with
    the edge codes (signed zeros, smallest subnormal, +-fmax, NaN and, for E5M2, +-inf) on the
    first row."""
    v = rng.standard_normal((rows, cols)) * np.exp2(rng.integers(-14, 9, (rows, cols)))
    v = fp8_round(v, fmt)
    edge = [0.0, -0.0, fmt.min_subnormal, -fmt.min_subnormal, fmt.max, -fmt.max, np.nan]
    if fmt is E5M2:
        edge += [np.inf, -np.inf]
    if rows:
        n = min(cols, len(edge))
        v[0, :n] = edge[:n]
    return v


def _to_fp8(v: np.ndarray, fmt: FP8Format) -> torch.Tensor:
    return torch.from_numpy(v).to(_TORCH_FP8[fmt.name])  # exact: every value is on the grid


def _numpy_small_gemm(
    a: np.ndarray, b: np.ndarray, factor: np.float32, bias: np.ndarray | None, out: torch.dtype
) -> torch.Tensor:
    """acc = sum over k in order of float32 products from +0, then the epilogue."""
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    acc = np.zeros((a.shape[0], b.shape[1]), dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for k in range(a.shape[1]):
            acc = acc + np.outer(a32[:, k], b32[k, :]).astype(np.float32)
    want = _epilogue_reference(acc, factor, bias, out)
    # row-major strides for empty results too (numpy gives an empty array strides of 0)
    return torch.empty(want.shape, dtype=want.dtype).copy_(want)


def _isas() -> list[int]:
    """Every native loop this CPU runs; none without the native library."""
    if not _NATIVE:
        return []
    level = kernels.native_isa_level()
    return [isa for isa in (ISA_SCALAR, ISA_AVX2, ISA_AVX512) if isa <= level]


# Shapes: below / across the 4 x 16 register block, empty sums (k = 0), empty outputs.
SHAPES = [(1, 1, 1), (5, 7, 3), (4, 16, 16), (9, 33, 21), (32, 32, 32), (3, 0, 5), (0, 4, 6)]


@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "formats", [(E4M3, E4M3), (E5M2, E4M3), (E5M2, E5M2)], ids=lambda f: f"{f[0].name}x{f[1].name}"
)
def test_small_fp8_gemm_against_numpy(
    out_dtype: torch.dtype, bias_dtype: torch.dtype | None, formats: tuple[FP8Format, ...]
) -> None:
    """Every backend (and every native loop) gives the numpy bits, NaN as NaN, for random
    operands with edge codes, both operand layouts (B also given as its transpose), every
    output and bias dtype."""
    fa, fb = formats
    rng = np.random.default_rng(7)
    a_scale, b_scale = torch.tensor(3.7e-2), torch.tensor([2.0**-9 * 1.3])
    factor = np.float32(a_scale.numpy()) * np.float32(b_scale.numpy()[0])
    for m, k, n in SHAPES:
        a, b = _operand(m, k, fa, rng), _operand(k, n, fb, rng)
        bias = None
        if bias_dtype is not None:
            bias = (torch.from_numpy(rng.standard_normal(n) * 50)).to(bias_dtype)
        want = _numpy_small_gemm(
            a, b, factor, None if bias is None else bias.float().numpy(), out_dtype
        )
        # A row-major and column-major; B column-major (the GEMM layout) and row-major.
        a_layouts = [_to_fp8(a, fa), _to_fp8(a.T.copy(), fa).t()]
        b_layouts = [_to_fp8(b.T.copy(), fb).t(), _to_fp8(b, fb)]
        for a_t in a_layouts:
            for b_t in b_layouts:
                what = f"{(m, k, n)} {fa.name}x{fb.name} bias {bias_dtype} -> {out_dtype}"
                got = kernels.small_fp8_gemm(
                    a_t, b_t, a_scale, b_scale, out_dtype, bias=bias, backend="reference"
                )
                assert_same_values(got, want, f"reference {what}")
                for isa in _isas():
                    got = native.small_fp8_gemm(a_t, b_t, a_scale, b_scale, out_dtype, bias, isa)
                    assert_same_values(got, want, f"native isa {isa} {what}")
                    # B given as its transpose (N, K), read through its strides
                    got = native.small_fp8_gemm(
                        a_t, b_t.t(), a_scale, b_scale, out_dtype, bias, isa, b_transposed=True
                    )
                    assert_same_values(got, want, f"native isa {isa} B^T {what}")


@needs_native
def test_linear_sized_gemms_take_the_small_gemm_below_the_threshold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CPU dequant GEMM is one small-GEMM call up to SMALL_GEMM_MACS multiply-adds and
    torch.mm above, with B given column-major (fp8_gemm) or as its row-major transpose
    (fp8_gemm_bias_t, the modules' hot path); all give what their definitions say."""
    calls: list[tuple[int, int, int, bool]] = []
    real = native.small_fp8_gemm

    def spy(a: torch.Tensor, b: torch.Tensor, *args: object, b_transposed: bool = False):  # type: ignore[no-untyped-def]
        n = b.shape[0] if b_transposed else b.shape[1]
        calls.append((a.shape[0], a.shape[1], n, b_transposed))
        return real(a, b, *args, b_transposed=b_transposed)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "small_fp8_gemm", spy)
    rng = np.random.default_rng(3)
    one, scale = torch.tensor(1.0), torch.tensor(0.25)
    small, large = (64, 128, 128), (64, 128, 129)
    assert small[0] * small[1] * small[2] == gemm.SMALL_GEMM_MACS
    for m, k, n in (small, large):
        a = _to_fp8(fp8_round(rng.standard_normal((m, k)), E4M3), E4M3)
        b_t = _to_fp8(fp8_round(rng.standard_normal((n, k)), E4M3), E4M3)
        bias = torch.from_numpy(rng.standard_normal(n)).float()
        want = a.float().double() @ b_t.float().double().t()
        got = gemm.fp8_gemm(a, b_t.t(), one, one, torch.float32)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)
        got_t = gemm.fp8_gemm_bias_t(a, b_t, one, scale, torch.float32, bias)
        torch.testing.assert_close(
            got_t.double(), want * 0.25 + bias.double(), rtol=1e-6, atol=1e-5
        )
    assert calls == [(*small, False), (*small, True)]


@needs_native
def test_small_fp8_gemm_is_one_allocation() -> None:
    """On the CPU the call (checked or not) is its output allocation and one ctypes call: no
    other aten op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    a = torch.ones(8, 16, dtype=torch.float8_e4m3fn)
    b = torch.ones(4, 16, dtype=torch.float8_e4m3fn).t()
    s, bias = torch.ones(()), torch.zeros(4, dtype=torch.bfloat16)
    with Ops() as ops:
        checked = kernels.small_fp8_gemm(a, b, s, s, torch.bfloat16, bias=bias)
    assert ops.names == ["empty.memory_format"]
    with Ops() as ops:
        unchecked = kernels.small_fp8_gemm_unchecked(a, b, s, s, torch.bfloat16, bias)
    assert ops.names == ["empty.memory_format"]
    assert torch.equal(checked, unchecked) and torch.equal(checked, torch.full((8, 4), 16.0))


@needs_native
def test_a_traced_small_gemm_runs_the_native_op() -> None:
    """Inside a torch.compile trace the GEMM is the ``fp8kit::small_fp8_gemm`` op (the native
    kernel at run time), so compiled and eager GEMMs give the same bits."""
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: object) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    a = _to_fp8(fp8_round(np.random.default_rng(5).standard_normal((24, 40)) * 9, E4M3), E4M3)
    b = _to_fp8(fp8_round(np.random.default_rng(6).standard_normal((40, 16)) * 9, E4M3), E4M3)
    s = torch.tensor(0.75)

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return gemm.fp8_gemm(a, b, s, s, torch.bfloat16)

    torch._dynamo.reset()
    got = torch.compile(f, backend=capture, fullgraph=True)(a, b)
    targets = [node.target for g in graphs for node in g.graph.nodes]
    assert torch.ops.fp8kit.small_fp8_gemm.default in targets
    assert torch.equal(got.view(torch.int16), f(a, b).view(torch.int16))


def test_small_fp8_gemm_errors_name_the_parameter() -> None:
    a = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    b = torch.zeros(8, 3, dtype=torch.float8_e5m2)
    one = torch.ones(())
    with pytest.raises(TypeError, match=r"a must be a 2-D torch\.float8_e4m3fn"):
        kernels.small_fp8_gemm(a.float(), b, one, one, torch.float32)
    with pytest.raises(TypeError, match=r"b must be a 2-D torch\.float8_e4m3fn"):
        kernels.small_fp8_gemm(a, b[None], one, one, torch.float32)
    with pytest.raises(ValueError, match=r"b must be \(K, N\) with K = a\.shape\[1\] = 8"):
        kernels.small_fp8_gemm(a, b[:5], one, one, torch.float32)
    with pytest.raises(TypeError, match=r"a_scale must be a torch\.float32 tensor with one"):
        kernels.small_fp8_gemm(a, b, torch.ones(2), one, torch.float32)
    with pytest.raises(TypeError, match=r"out_dtype must be torch\.float32, torch\.bfloat16"):
        kernels.small_fp8_gemm(a, b, one, one, torch.float64)
    with pytest.raises(TypeError, match=r"bias must be None or .* of shape \(3,\)"):
        kernels.small_fp8_gemm(a, b, one, one, torch.float32, bias=torch.zeros(4))
    with pytest.raises(ValueError, match="small_fp8_gemm has no 'triton' kernel"):
        kernels.small_fp8_gemm(a, b, one, one, torch.float32, backend="triton")

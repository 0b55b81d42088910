"""The CPU FP8 GEMM's reused float32 buffers (fp8kit.torch.workspace, docs/decisions/0259): the
GEMM stops allocating its temporaries, its results keep their bits whatever the buffers held
before, and ``kernels.dequantize_fp8(out=...)`` checks the buffer it writes into."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8kit.torch import gemm, kernels, workspace

ALLOCATIONS = ("aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default")


class _OpLog(TorchDispatchMode):
    """Counts the aten ops called while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def allocations(self) -> int:
        return sum(self.ops[name] for name in ALLOCATIONS)


@pytest.fixture(autouse=True)
def _fresh_buffers() -> Iterator[None]:
    workspace.clear()
    yield
    workspace.clear()


def _operands(m: int, k: int, n: int, seed: int, a_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Random FP8 A (m, k) row-major and B^T (n, k) row-major of every finite code, and the two
    dequantization factors."""
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=gen) * 30).to(a_dtype)
    b_t = (torch.randn(n, k, generator=gen) * 30).to(torch.float8_e4m3fn)
    return a, b_t, torch.tensor(0.37), torch.tensor(2.0**-5)


def _gemm(a: torch.Tensor, b_t: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
          out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    return gemm.fp8_gemm_bias_t(a, b_t, sa, sb, out_dtype, bias)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _needs_dequant_route(m: int, k: int, n: int) -> None:
    if gemm.cpu_gemm_backend() != "dequant":
        pytest.skip("the CPU GEMM backend is not 'dequant' (FP8KIT_CPU_GEMM)")
    assert m * k * n > gemm.SMALL_GEMM_MACS  # the upcast + torch.mm route, not the small kernel


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_steady_cpu_gemm_allocates_only_its_result(out_dtype: torch.dtype) -> None:
    """The second GEMM of a shape allocates nothing but its result: the two upcast operands (and
    a 16-bit output's float32 accumulator) are this thread's kept buffers. Before them, the GEMM
    allocated both upcasts at every call."""
    if not kernels.native_available():  # the torch fallbacks allocate inside their ops
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")
    m, k, n = 128, 256, 64
    _needs_dequant_route(m, k, n)
    a, b_t, sa, sb = _operands(m, k, n, 1, torch.float8_e4m3fn)
    bias = torch.randn(n).to(out_dtype)
    _gemm(a, b_t, sa, sb, out_dtype, bias)
    with _OpLog() as log:
        _gemm(a, b_t, sa, sb, out_dtype, bias)
    assert log.ops["aten.mm.default"] + log.ops["aten.mm.out"] == 1, log.ops
    # float32: mm allocates the result inside its kernel (the epilogue then runs in place);
    # 16-bit: the epilogue allocates the result
    assert log.allocations == (0 if out_dtype is torch.float32 else 1), log.ops


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("a_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_results_keep_their_bits_whatever_the_buffers_held(
    out_dtype: torch.dtype, a_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GEMMs of growing and shrinking shapes through the kept buffers give, bit for bit, what
    the same GEMMs give with fresh allocations, and match float64 numpy math to float32
    accuracy (so no stale value of an earlier, larger GEMM leaks into a smaller one)."""
    shapes = [(96, 512, 64), (200, 300, 40), (64, 256, 128), (256, 512, 96)]
    for m, k, n in shapes:
        _needs_dequant_route(m, k, n)
    runs = []
    for seed, (m, k, n) in enumerate(shapes):
        a, b_t, sa, sb = _operands(m, k, n, 10 + seed, a_dtype)
        bias = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 4).to(out_dtype)
        runs.append((a, b_t, sa, sb, bias, _gemm(a, b_t, sa, sb, out_dtype, bias)))
    monkeypatch.setattr(workspace, "MAX_ELEMENTS", 0)  # every request allocates afresh
    for a, b_t, sa, sb, bias, got in runs:
        fresh = _gemm(a, b_t, sa, sb, out_dtype, bias)
        assert got.dtype == out_dtype and torch.equal(_raw(got), _raw(fresh)), a.shape
        a64 = a.to(torch.float64).numpy() * float(sa)
        b64 = b_t.to(torch.float64).numpy().T * float(sb)
        want = a64 @ b64 + bias.to(torch.float64).numpy()
        scale = np.abs(a64) @ np.abs(b64) + np.abs(bias.to(torch.float64).numpy())
        eps = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
        err = np.abs(got.to(torch.float64).numpy() - want)
        assert (err <= eps[out_dtype] * scale + 1e-30).all(), float((err / scale).max())


def test_a_buffer_first_made_in_inference_mode_serves_training_gemms() -> None:
    """The first GEMM of a thread under torch.inference_mode makes ordinary buffers: a later
    GEMM outside inference mode writes into them (an inference tensor would refuse)."""
    m, k, n = 128, 256, 64
    _needs_dequant_route(m, k, n)
    a, b_t, sa, sb = _operands(m, k, n, 3, torch.float8_e4m3fn)
    with torch.inference_mode():
        first = _gemm(a, b_t, sa, sb, torch.bfloat16, None)
    again = _gemm(a, b_t, sa, sb, torch.bfloat16, None)
    assert torch.equal(_raw(first), _raw(again))


def test_buffers_are_per_thread_capped_and_cleared(monkeypatch: pytest.MonkeyPatch) -> None:
    mine = workspace.view("a", (8, 4), (4, 1))
    assert mine is not None and mine.dtype == torch.float32 and mine.shape == (8, 4)
    assert workspace.view("a", (4, 8), (1, 4)).data_ptr() == mine.data_ptr()  # reused
    theirs: list[torch.Tensor | None] = []
    worker = threading.Thread(target=lambda: theirs.append(workspace.view("a", (8, 4), (4, 1))))
    worker.start()
    worker.join()
    assert theirs[0] is not None and theirs[0].data_ptr() != mine.data_ptr()
    monkeypatch.setattr(workspace, "MAX_ELEMENTS", 31)
    assert workspace.view("b", (8, 4), (4, 1)) is None  # 32 elements: allocate instead
    workspace.clear()
    assert workspace.view("a", (2, 2), (2, 1)).data_ptr() != mine.data_ptr()
    with pytest.raises(ValueError, match=r"role must be one of \('a', 'b', 'acc'\), got 'c'"):
        workspace.view("c", (2, 2), (2, 1))


def test_dequantize_into_out_is_the_allocating_result() -> None:
    gen = torch.Generator().manual_seed(5)
    data = (torch.randn(24, 40, generator=gen) * 100).to(torch.float8_e5m2)
    scale = torch.tensor(0.75)
    for d in (data, data.t()):  # row-major and transposed
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            out = torch.empty_like(d, dtype=dtype)
            got = kernels.dequantize_fp8(d, scale, dtype, out=out)
            assert got is out
            assert torch.equal(_raw(out), _raw(kernels.dequantize_fp8(d, scale, dtype)))


def test_dequantize_out_errors_name_the_parameter() -> None:
    data = torch.zeros(4, 6).to(torch.float8_e4m3fn)
    msg = r"out must be a torch.float32 tensor on cpu of shape \(4, 6\) and strides \(6, 1\)"
    with pytest.raises(ValueError, match=msg):
        kernels.dequantize_fp8(data, out=torch.empty(4, 6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=msg + r".*got .*strides \(1, 4\)"):
        kernels.dequantize_fp8(data, out=torch.empty(6, 4).t())
    with pytest.raises(ValueError, match=msg + r".*requires_grad=True"):
        kernels.dequantize_fp8(data, out=torch.empty(4, 6, requires_grad=True))
    with pytest.raises(ValueError, match="out must be None: data is not dense"):
        kernels.dequantize_fp8(data[:, ::2], out=torch.empty(4, 3))

"""FP8 GEMMs through ``torch._scaled_mm`` with the CUDA contract enforced on every device.

cuBLASLt (Ada/Hopper) accepts ``_scaled_mm(A, B)`` only with A row-major, B column-major, every
dimension a multiple of 16, float32 scale tensors with one element, and not both operands E5M2.
The CPU kernel accepts more; :func:`scaled_mm` refuses what a GPU would refuse so CPU tests
catch it. :func:`fp8_matmul` is the convenient entry: it fixes layouts and pads (exactly, with
zeros) before calling :func:`scaled_mm`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from fp8kit.matmul_args import ACTIVATIONS, check_matmul_args
from fp8kit.torch import kernels, workspace
from fp8kit.torch.kernels._library import define_op
from fp8kit.torch.kernels.native_ops import fp8_gemm_fake
from fp8kit.torch.quantization import (
    HIGH_PRECISION_DTYPES,
    Float8Tensor,
    as_scale_tensor,
    cast_to_fp8,
    check_float8_tensor,
    fp8_format_of,
)

__all__ = [
    "ACTIVATIONS",
    "CPU_GEMM_BACKENDS",
    "GEMM_ALIGNMENT",
    "SMALL_GEMM_MACS",
    "Fp8GemmContractError",
    "check_bias_contract",
    "cpu_gemm_backend",
    "cublaslt_fuses_bias",
    "fp8_gemm",
    "fp8_gemm_bias",
    "fp8_gemm_bias_t",
    "fp8_matmul",
    "pad_to_alignment",
    "scaled_mm",
    "set_cpu_gemm_backend",
]

GEMM_ALIGNMENT = 16
FUSED_BIAS_DTYPES = (torch.bfloat16, torch.float16)  # output dtypes cuBLASLt adds a bias to


class Fp8GemmContractError(ValueError):
    """Raised for operands that ``torch._scaled_mm`` would reject on a CUDA device."""


def _is_row_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) == max(t.shape[1], 1)


def _is_column_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(0) == 1 and t.stride(1) == max(t.shape[0], 1)


def _check_scale(name: str, scale: torch.Tensor, device: torch.device) -> None:
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise Fp8GemmContractError(
            f"{name}.scale_inv must be a float32 tensor with one element, "
            f"got dtype {scale.dtype} and shape {tuple(scale.shape)}"
        )
    if scale.device != device:
        raise Fp8GemmContractError(f"{name}.scale_inv is on {scale.device}, data on {device}")


def check_gemm_contract(a: Float8Tensor, b: Float8Tensor) -> None:
    """Raise :class:`Fp8GemmContractError` unless ``a @ b`` meets the cuBLASLt contract (a
    TypeError for an operand that is not a :class:`Float8Tensor` or whose ``scale_inv`` is not a
    tensor)."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Float8Tensor):
            raise TypeError(f"{name} must be a Float8Tensor, got {type(t).__name__}")
        if not isinstance(t.scale_inv, torch.Tensor):
            raise TypeError(
                f"{name}.scale_inv must be a float32 tensor with one element, got "
                f"{type(t.scale_inv).__name__}"
            )
        if t.data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise Fp8GemmContractError(
                f"{name}.data must be torch.float8_e4m3fn or torch.float8_e5m2, got {t.data.dtype}"
            )
    if a.data.dim() != 2 or b.data.dim() != 2:
        raise Fp8GemmContractError(
            f"a and b must be 2-D, got a.shape={tuple(a.shape)}, b.shape={tuple(b.shape)}"
        )
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise Fp8GemmContractError(f"inner dimensions differ: a is {m}x{k}, b is {k2}x{n}")
    empty = [f"{nm}={v}" for nm, v in (("M", m), ("K", k), ("N", n)) if v == 0]
    if empty:
        raise Fp8GemmContractError(f"every GEMM dimension must be positive, got {', '.join(empty)}")
    bad = [f"{nm}={v}" for nm, v in (("M", m), ("K", k), ("N", n)) if v % GEMM_ALIGNMENT]
    if bad:
        raise Fp8GemmContractError(
            f"every GEMM dimension must be a multiple of {GEMM_ALIGNMENT}, got {', '.join(bad)} "
            "(pad with zeros: fp8_matmul and f8.Linear do this for you)"
        )
    if not _is_row_major(a.data):
        raise Fp8GemmContractError(
            f"a must be row-major (contiguous), got strides {a.data.stride()}"
        )
    if not _is_column_major(b.data):
        raise Fp8GemmContractError(
            f"b must be column-major (b.t() contiguous), got strides {b.data.stride()}"
        )
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise Fp8GemmContractError("E5M2 x E5M2 is not supported by cuBLASLt: make one side E4M3")
    if a.device != b.device:
        raise Fp8GemmContractError(f"a is on {a.device}, b on {b.device}: use one device")
    _check_scale("a", a.scale_inv, a.device)
    _check_scale("b", b.scale_inv, b.device)


def check_bias_contract(
    bias: torch.Tensor, n: int, out_dtype: torch.dtype, device: torch.device
) -> None:
    """Raise :class:`Fp8GemmContractError` unless cuBLASLt can fuse ``bias`` into the GEMM.

    cuBLASLt adds a bias only to a bfloat16 / float16 output, from a bias of the output's dtype
    (``torch._scaled_mm`` refuses a bias with a float32 output), on the operands' ``device``.
    """
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be None or a tensor, got {type(bias).__name__}")
    if bias.shape != (n,):
        raise Fp8GemmContractError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    if bias.device != device:
        raise Fp8GemmContractError(f"bias is on {bias.device}, a and b on {device}")
    if not cublaslt_fuses_bias(out_dtype, bias):
        raise Fp8GemmContractError(
            f"a fused bias needs out_dtype bfloat16 or float16 and a bias of that dtype, got "
            f"out_dtype={out_dtype} and bias dtype {bias.dtype} (add a float32 bias after the GEMM)"
        )


def scaled_mm(
    a: Float8Tensor,
    b: Float8Tensor,
    out_dtype: torch.dtype = torch.float32,
    *,
    bias: torch.Tensor | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``(a.data @ b.data) * a.scale_inv * b.scale_inv (+ bias)`` with float32 accumulation.

    Args:
        a: ``(M, K)`` row-major FP8 operand.
        b: ``(K, N)`` column-major FP8 operand.
        out_dtype: float32, bfloat16 or float16.
        bias: ``(N,)`` bias fused into the GEMM's epilogue (out_dtype bfloat16 / float16 and a
            bias of that dtype only, as cuBLASLt; see :func:`check_bias_contract`).
        use_fast_accum: cuBLASLt's fast FP8 accumulation (CUDA only; CPU GEMMs are exact).

    Returns:
        ``(M, N)`` tensor of ``out_dtype``.
    """
    check_gemm_contract(a, b)
    if not isinstance(use_fast_accum, bool):
        raise TypeError(f"use_fast_accum must be a bool, got {use_fast_accum!r}")
    if out_dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"out_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {out_dtype}"
        )
    if bias is not None:
        check_bias_contract(bias, b.shape[1], out_dtype, a.device)
    return fp8_gemm(
        a.data, b.data, a.scale_inv, b.scale_inv, out_dtype, bias=bias, fast_accum=use_fast_accum
    )


def fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    bias: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """The unchecked GEMM behind :func:`scaled_mm`, for callers that meet the contract by
    construction (the modules' hot path): one ``torch._scaled_mm`` on CUDA.

    Args:
        a: FP8 ``(M, K)`` row-major; b: FP8 ``(K, N)`` column-major.
        a_scale_inv, b_scale_inv: float32 one-element tensors (dequantization factors).
        out_dtype: dtype of the result; bias: ``(N,)`` of ``out_dtype`` (bfloat16 / float16
            output only) or None; fast_accum: cuBLASLt fast accumulation.

    Returns:
        ``(M, N)`` tensor of ``out_dtype``.
    """
    a_scale_inv, b_scale_inv = _scalar(a_scale_inv), _scalar(b_scale_inv)
    if a.is_cpu:
        if cpu_gemm_backend() == "dequant":
            return _dequant_mm(a, b, a_scale_inv, b_scale_inv, out_dtype, bias)
        # torch's CPU _scaled_mm multiplies the dequantized operands with an mm that
        # torch.autocast would run in its dtype; cuBLASLt's FP8 GEMM is not autocast's.
        # Entered only when one is on (the context costs microseconds per GEMM); inside it
        # this call takes the _scaled_mm below.
        if torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):
                return fp8_gemm(a, b, a_scale_inv, b_scale_inv, out_dtype, bias=bias,
                                fast_accum=fast_accum)  # fmt: skip
    return torch._scaled_mm(
        a,
        b,
        scale_a=a_scale_inv,
        scale_b=b_scale_inv,
        bias=bias,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


def fp8_gemm_bias(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """:func:`fp8_gemm` with a bias of any float dtype, rounded once to ``out_dtype``.

    The bias is fused where the GEMM can add it: always in the CPU's dequant GEMM (its epilogue,
    :func:`fp8kit.torch.kernels.gemm_epilogue`), in cuBLASLt for a bias of the bfloat16 /
    float16 output's dtype. Otherwise the GEMM writes float32, the bias is added in float32 and
    the sum is rounded once: the same numbers as the fused CPU epilogue.
    """
    if a.is_cpu and cpu_gemm_backend() == "dequant":  # its epilogue adds any bias
        return _dequant_mm(a, b, _scalar(a_scale_inv), _scalar(b_scale_inv), out_dtype, bias)
    if bias is None or cublaslt_fuses_bias(out_dtype, bias):
        return fp8_gemm(a, b, a_scale_inv, b_scale_inv, out_dtype, bias=bias, fast_accum=fast_accum)
    y = fp8_gemm(a, b, a_scale_inv, b_scale_inv, torch.float32, fast_accum=fast_accum)
    y = y + bias  # out of place: docs/decisions/0249 (torch 2.11 compiled autograd.Function)
    return y if out_dtype == torch.float32 else y.to(out_dtype)


def fp8_gemm_bias_t(
    a: torch.Tensor,
    b_t: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """:func:`fp8_gemm_bias` with B given transposed: ``a @ b_t.T``, ``b_t`` the row-major
    ``(N, K)`` FP8 tensor whose ``.t()`` is the column-major B (the layout the modules keep: FP8
    W, W^T and x^T). The CPU's dequant GEMM reads ``b_t`` as it is, one view op fewer per GEMM
    on the modules' hot path; elsewhere this is ``fp8_gemm_bias(a, b_t.t(), ...)``."""
    if a.is_cpu and cpu_gemm_backend() == "dequant":
        sa, sb = _scalar(a_scale_inv), _scalar(b_scale_inv)
        return _dequant_mm(a, b_t, sa, sb, out_dtype, bias, b_transposed=True)
    return fp8_gemm_bias(a, b_t.t(), a_scale_inv, b_scale_inv, out_dtype, bias, fast_accum)


def cublaslt_fuses_bias(out_dtype: torch.dtype, bias: torch.Tensor) -> bool:
    """Whether ``torch._scaled_mm`` can add ``bias`` in its epilogue: a bfloat16 / float16
    output and a bias of that dtype (:func:`check_bias_contract`)."""
    return out_dtype in FUSED_BIAS_DTYPES and bias.dtype == out_dtype


def _scalar(t: torch.Tensor) -> torch.Tensor:
    """A one-element tensor as 0-d; the casts' scale_inv already is (no view op then)."""
    return t if t.dim() == 0 else t.reshape(())


def _dequant_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    b_transposed: bool = False,
) -> torch.Tensor:
    """The same GEMM as ``_scaled_mm`` from exactly upcast operands: every FP8 value and every
    product of two FP8 values is exact in float32, so only the float32 accumulation order can
    differ from ``_scaled_mm``.

    The upcasts (``data.to(torch.float32)``, unscaled, same layout: B stays column-major) run in
    the native kernel where it is built (:func:`fp8kit.torch.kernels.dequantize_fp8`, the same
    bits, 4-15x faster than torch's conversion on this CPU); the epilogue
    (:func:`fp8kit.torch.kernels.gemm_epilogue`, one native pass) applies the scale_inv product,
    adds the bias (any float dtype) in float32 and rounds once to ``out_dtype``.

    A GEMM of at most :data:`SMALL_GEMM_MACS` multiply-adds is one native call instead
    (:func:`fp8kit.torch.kernels.small_fp8_gemm`: decode, sum over k in order, same epilogue),
    where the native library is built; its last bits may differ from ``torch.mm``'s.

    ``b_transposed``: ``b`` holds ``B^T`` (:func:`fp8_gemm_bias_t`)."""
    n = b.shape[0] if b_transposed else b.shape[1]
    if a.shape[0] * a.shape[1] * n <= SMALL_GEMM_MACS and kernels.native_available():
        return kernels.small_fp8_gemm_unchecked(
            a, b, a_scale_inv, b_scale_inv, out_dtype, bias, b_transposed
        )
    b = b.t() if b_transposed else b
    if torch.compiler.is_compiling():  # one opaque op: Inductor would drop the bias's rounding
        # no autograd through it, as through the native kernels in eager
        bias = None if bias is None else bias.detach()
        return _upcast_mm_op(a, b, a_scale_inv, b_scale_inv, out_dtype, bias)
    return _upcast_mm(a, b, a_scale_inv, b_scale_inv, out_dtype, bias)


def _upcast_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`_dequant_mm`'s route for GEMMs above :data:`SMALL_GEMM_MACS`: exact upcasts,
    ``torch.mm``, the native epilogue (float32 products under ``torch.autocast`` too). The
    upcasts, and the float32 accumulator of a 16-bit output, live in this thread's reused
    buffers (:mod:`fp8kit.torch.workspace`) when they fit there."""
    a32 = kernels.dequantize_fp8(a, out=workspace.view("a", a.shape, a.stride()))
    b32 = kernels.dequantize_fp8(b, out=workspace.view("b", b.shape, b.stride()))
    m, n = a.shape[0], b.shape[1]
    # a float32 result is the accumulator itself (the epilogue runs in place): never a buffer
    acc = None if out_dtype is torch.float32 else workspace.view("acc", (m, n), (n, 1))
    if torch.is_autocast_enabled(a.device.type):  # entering the context costs ~5 us
        with torch.autocast(a.device.type, enabled=False):
            acc = torch.mm(a32, b32, out=acc)
    else:
        acc = torch.mm(a32, b32, out=acc)
    return kernels.gemm_epilogue(acc, a_scale_inv, b_scale_inv, out_dtype, bias=bias)


_upcast_mm_op = define_op(
    "upcast_fp8_gemm",
    "(Tensor a, Tensor b, Tensor a_scale_inv, Tensor b_scale_inv, ScalarType out_dtype, "
    "Tensor? bias) -> Tensor",
    _upcast_mm,
    fp8_gemm_fake,
)
"""``fp8kit::upcast_fp8_gemm``: :func:`_upcast_mm` as one op of a compiled graph. Traced as
torch ops, Inductor fused a bfloat16 bias's rounding (``torch.autocast``'s cast) into the
float32 add and other roundings into their neighbours, so a compiled step's bits parted from
eager's (docs/decisions/0268-audits-twenty-fourth-session.md)."""


SMALL_GEMM_MACS = 1 << 20
"""The largest CPU FP8 GEMM (M * N * K multiply-adds) that runs as one native call
(:func:`fp8kit.torch.kernels.small_fp8_gemm`); larger ones use ``torch.mm``. A fixed number, not
a per-machine measurement, so a shape's bits do not depend on the CPU. Where the two cost the
same on the development CPUs: docs/decisions/0236-small-cpu-fp8-gemm.md."""

CPU_GEMM_BACKENDS = ("dequant", "scaled_mm")
# Read at import, so a graph torch.compile traces finds the backend set (choosing it while
# tracing made the first compiled step recompile); a value not in CPU_GEMM_BACKENDS is kept out
# until the first CPU GEMM, which raises naming it.
_ENV_CPU_BACKEND = os.environ.get("FP8KIT_CPU_GEMM", "dequant")
_cpu_backend: list[str] = [_ENV_CPU_BACKEND] if _ENV_CPU_BACKEND in CPU_GEMM_BACKENDS else []


def cpu_gemm_backend() -> str:
    """The CPU FP8 GEMM backend: ``"dequant"`` (default) or ``"scaled_mm"``.

    Set with :func:`set_cpu_gemm_backend` or the ``FP8KIT_CPU_GEMM`` environment variable.
    See docs/decisions/0001-cpu-fp8-gemm-backend.md for why the default is not ``_scaled_mm``.
    """
    if not _cpu_backend:
        set_cpu_gemm_backend(_ENV_CPU_BACKEND)  # raises: the variable holds no backend
    return _cpu_backend[0]


def set_cpu_gemm_backend(name: str) -> None:
    """Choose the CPU FP8 GEMM backend (``"dequant"`` or ``"scaled_mm"``) for this process."""
    if name not in CPU_GEMM_BACKENDS:
        raise ValueError(
            f"CPU GEMM backend (FP8KIT_CPU_GEMM) must be one of {list(CPU_GEMM_BACKENDS)}, "
            f"got {name!r}"
        )
    _cpu_backend[:] = [name]


def _round_up(v: int) -> int:
    return -(-v // GEMM_ALIGNMENT) * GEMM_ALIGNMENT


def pad_to_alignment(data: torch.Tensor) -> torch.Tensor:
    """Zero-pad a 2-D FP8 tensor so both dimensions are multiples of 16 (returns a new tensor
    only when padding is needed). FP8 zero is the all-zero byte in both formats."""
    rows, cols = data.shape
    pr, pc = _round_up(rows) - rows, _round_up(cols) - cols
    if pr == 0 and pc == 0:
        return data
    return F.pad(data, (0, pc, 0, pr))


def as_row_major(t: Float8Tensor) -> Float8Tensor:
    """``t`` padded and laid out row-major (copies only what it must)."""
    data = pad_to_alignment(t.data)
    if not _is_row_major(data):
        data = data.contiguous()
    return Float8Tensor(data, t.scale_inv, t.amax)


def as_column_major(t: Float8Tensor) -> Float8Tensor:
    """``t`` padded and laid out column-major (copies only what it must)."""
    data = pad_to_alignment(t.data)
    if not _is_column_major(data):
        data = data.t().contiguous().t()
    return Float8Tensor(data, t.scale_inv, t.amax)


def padded_mm(
    a: Float8Tensor,
    b: Float8Tensor,
    out_dtype: torch.dtype,
    *,
    bias: torch.Tensor | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``a @ b (+ bias)`` for any shapes and layouts: pad to the contract, multiply, slice back.

    ``bias`` ``(N,)`` follows :func:`scaled_mm`'s rule (zero-padded to the padded N)."""
    m, n = a.shape[0], b.shape[1]
    a_p, b_p = as_row_major(a), as_column_major(b)
    if bias is not None and b_p.shape[1] != n:
        bias = F.pad(bias, (0, b_p.shape[1] - n))
    out = scaled_mm(a_p, b_p, out_dtype, bias=bias, use_fast_accum=use_fast_accum)
    if out.shape != (m, n):
        # A copy, never a view of the padded result: a layer's output must accept in-place ops
        # (``nn.ReLU(inplace=True)``), which autograd refuses on views made inside a Function.
        out = out[:m, :n].clone(memory_format=torch.contiguous_format)
    return out


def _apply_activation(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation == "relu":
        return torch.relu(y)
    if activation == "gelu":
        return F.gelu(y)
    return F.gelu(y, approximate="tanh")  # "gelu_tanh" (validated by check_matmul_args)


def fp8_matmul(
    a: Float8Tensor,
    b: Float8Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_scale: torch.Tensor | float | None = None,
    out_fp8_dtype: torch.dtype | None = None,
) -> torch.Tensor | Float8Tensor:
    """``activation(a @ b + bias)``, optionally quantized to FP8 with a delayed output scale.

    Args:
        a: ``(M, K)`` :class:`Float8Tensor`; b: ``(K, N)`` :class:`Float8Tensor` (any layout,
            any sizes: padded exactly to the GEMM contract internally).
        out_dtype: dtype of a high-precision result (float32, bfloat16, float16).
        bias: ``(N,)`` vector or ``(M, N)`` matrix, added in float32 after the GEMM.
        activation: None, ``"relu"``, ``"gelu"`` or ``"gelu_tanh"``, applied after the bias.
        out_scale: if given, the result is quantized with this (delayed) scale and returned as a
            :class:`Float8Tensor` whose ``amax`` is the high-precision result's amax, the value
            to record for the next step's scale.
        out_fp8_dtype: FP8 dtype of a quantized result (default ``torch.float8_e4m3fn``).

    Returns:
        ``(M, N)`` tensor of ``out_dtype``, or a :class:`Float8Tensor` when ``out_scale`` is set.
    """
    check_float8_tensor(a, "a")
    check_float8_tensor(b, "b")
    if out_dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"out_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {out_dtype!r}"
        )
    if out_scale is not None and out_dtype != torch.float32:
        raise ValueError(
            f"out_dtype={out_dtype} is for a high-precision result; with out_scale the result is "
            "FP8 (choose its dtype with out_fp8_dtype)"
        )
    m, n = check_matmul_args(
        a.shape, b.shape, activation, out_scale is not None, out_fp8_dtype is not None
    )
    if m and n and a.shape[1]:
        y = padded_mm(a, b, torch.float32)
    else:  # an empty product (as torch.mm: a sum over K = 0 is 0); no GEMM has empty sizes
        y = torch.zeros(m, n, dtype=torch.float32, device=a.data.device)
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape not in ((n,), (m, n)):
            raise ValueError(
                f"bias must be a tensor of shape ({n},) or ({m}, {n}), got "
                f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}"
            )
        if bias.dtype not in HIGH_PRECISION_DTYPES or bias.device != y.device:
            raise TypeError(
                f"bias must be a torch.float32, torch.bfloat16 or torch.float16 tensor on "
                f"{y.device}, got {bias.dtype} on {bias.device}"
            )
        y = y + bias.to(torch.float32)
    y = _apply_activation(y, activation)
    if out_scale is None:
        return y if out_dtype == torch.float32 else y.to(out_dtype)
    fmt = fp8_format_of(
        torch.float8_e4m3fn if out_fp8_dtype is None else out_fp8_dtype, "out_fp8_dtype"
    )
    scale = as_scale_tensor(out_scale, y.device, "out_scale")
    data, amax = cast_to_fp8(y, scale, fmt)
    return Float8Tensor(data, torch.reciprocal(scale), amax)

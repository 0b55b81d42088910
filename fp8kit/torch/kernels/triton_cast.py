"""Triton FP8 cast kernels for CUDA tensors (the GPU twin of ``fp8_cast.cpp``).

Same numerics as :func:`fp8kit.torch.quantization.cast_to_fp8_reference` (SPEC section 2), and the
same algorithm as the C++ kernel: one float32 multiply ``x * scale``, then the float32 -> FP8
conversion done with integer arithmetic on the float32 bits (saturation by an integer min, round
to nearest even for normals by adding half an ulp minus one plus the lowest kept bit, subnormals
by a float32 add of a magic power of two). The kernel never uses Triton's float8 types, so its
results do not depend on a GPU's conversion instructions, and Triton's interpreter
(``TRITON_INTERPRET=1``, NumPy on the CPU) runs it unchanged, which is how the tests check it
bit for bit on machines without a GPU.

One program handles ``BLOCK`` elements: it writes their FP8 codes and a partial amax (NaN
ignored); the partials are reduced with ``torch.amax`` (deterministic, no atomics).

``triton`` is optional: :func:`triton_available` is False when it cannot be imported, and
fp8kit then casts CUDA tensors with the pure-torch path.
"""

from __future__ import annotations

import torch

from fp8kit.formats import E4M3, E5M2, FP8Format

try:  # optional dependency
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

__all__ = ["triton_available", "triton_cast", "triton_cast_transpose"]

_BLOCK = 1024
_TILE = 32
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_available() -> bool:
    """True when ``triton`` imports (a GPU is still needed unless ``TRITON_INTERPRET=1``)."""
    return triton is not None


def _format_constants(fmt: FP8Format) -> dict[str, int | float]:
    """Integer constants of the bit-level float32 -> ``fmt`` conversion (see the C++ source)."""
    if fmt.name not in (E4M3.name, E5M2.name):
        raise TypeError(f"fmt must be fp8kit.formats.E4M3 or E5M2, got {fmt!r}")
    shift = 23 - fmt.mantissa_bits
    rebias = (127 - fmt.bias) << 23
    half_minus_one = (1 << (shift - 1)) - 1
    fmax_bits = int(torch.tensor(fmt.max, dtype=torch.float32).view(torch.int32).item())
    magic_exp = 127 + 23 + 1 - fmt.bias - fmt.mantissa_bits
    return {
        "FMAX_BITS": fmax_bits,
        "MIN_NORMAL_BITS": (127 + 1 - fmt.bias) << 23,
        # a + half_minus_one - rebias, as an unsigned 32-bit constant (wraps like the C++ code)
        "ADD_BITS": (half_minus_one - rebias) % (1 << 32),
        "SHIFT": shift,
        "MAGIC": float(2.0 ** (magic_exp - 127)),
        "MAGIC_BITS": magic_exp << 23,
    }


if triton is not None:

    @triton.jit
    def _encode(
        x,
        scale,
        FMAX_BITS: tl.constexpr,
        MIN_NORMAL_BITS: tl.constexpr,
        ADD_BITS: tl.constexpr,
        SHIFT: tl.constexpr,
        MAGIC: tl.constexpr,
        MAGIC_BITS: tl.constexpr,
    ):
        """float32 block -> uint8 FP8 codes (saturating, round to nearest even, NaN kept)."""
        b = (x * scale).to(tl.uint32, bitcast=True)
        sign = (b >> 24) & 0x80
        a = b & 0x7FFFFFFF
        is_nan = a > 0x7F800000
        a = tl.minimum(a, FMAX_BITS)  # saturate, +-inf included (NaN handled by is_nan)
        normal = (a + ADD_BITS + ((a >> SHIFT) & 1)) >> SHIFT
        sub = (a.to(tl.float32, bitcast=True) + MAGIC).to(tl.uint32, bitcast=True) - MAGIC_BITS
        code = tl.where(a < MIN_NORMAL_BITS, sub, normal)
        code = tl.where(is_nan, 0x7F, code)
        return (code | sign).to(tl.uint8)

    @triton.jit
    def _to_float32(raw, BF16_BITS: tl.constexpr):
        """Widen a loaded block to float32; bfloat16 arrives as its int16 bits (see _launch)."""
        if BF16_BITS:
            return (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(
                tl.float32, bitcast=True
            )
        else:
            return raw.to(tl.float32)

    @triton.jit
    def _cast_kernel(
        x_ptr,
        scale_ptr,
        out_ptr,
        partial_ptr,
        n,
        FMAX_BITS: tl.constexpr,
        MIN_NORMAL_BITS: tl.constexpr,
        ADD_BITS: tl.constexpr,
        SHIFT: tl.constexpr,
        MAGIC: tl.constexpr,
        MAGIC_BITS: tl.constexpr,
        BF16_BITS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = _to_float32(tl.load(x_ptr + offs, mask=mask, other=0), BF16_BITS)
        scale = tl.load(scale_ptr)
        ax = tl.abs(x)
        ax = tl.where(ax == ax, ax, 0.0)  # NaN never enters the amax
        tl.store(partial_ptr + pid, tl.max(ax, axis=0))
        code = _encode(x, scale, FMAX_BITS, MIN_NORMAL_BITS, ADD_BITS, SHIFT, MAGIC, MAGIC_BITS)
        tl.store(out_ptr + offs, code, mask=mask)

    @triton.jit
    def _cast_transpose_kernel(
        x_ptr,
        scale_ptr,
        out_ptr,
        out_t_ptr,
        partial_ptr,
        m,
        n,
        FMAX_BITS: tl.constexpr,
        MIN_NORMAL_BITS: tl.constexpr,
        ADD_BITS: tl.constexpr,
        SHIFT: tl.constexpr,
        MAGIC: tl.constexpr,
        MAGIC_BITS: tl.constexpr,
        BF16_BITS: tl.constexpr,
        TILE: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m.to(tl.int64) * TILE + tl.arange(0, TILE)
        cols = pid_n.to(tl.int64) * TILE + tl.arange(0, TILE)
        mask = (rows[:, None] < m) & (cols[None, :] < n)
        x = tl.load(x_ptr + rows[:, None] * n + cols[None, :], mask=mask, other=0)
        x = _to_float32(x, BF16_BITS)
        scale = tl.load(scale_ptr)
        ax = tl.abs(x)
        ax = tl.where(ax == ax, ax, 0.0)
        tl.store(
            partial_ptr + pid_m * tl.num_programs(1) + pid_n, tl.max(tl.max(ax, axis=1), axis=0)
        )
        code = _encode(x, scale, FMAX_BITS, MIN_NORMAL_BITS, ADD_BITS, SHIFT, MAGIC, MAGIC_BITS)
        tl.store(out_ptr + rows[:, None] * n + cols[None, :], code, mask=mask)
        code_t = tl.trans(code)
        mask_t = (cols[:, None] < n) & (rows[None, :] < m)
        tl.store(out_t_ptr + cols[:, None] * m + rows[None, :], code_t, mask=mask_t)


def _check(x: torch.Tensor, scale: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("triton is not installed: pip install triton (see constraints.txt)")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise TypeError(
            f"scale must be a float32 tensor with one element, got {scale.dtype} "
            f"with {scale.numel()} elements"
        )
    if scale.device != x.device:
        raise ValueError(f"scale is on {scale.device} but x is on {x.device}")


def _is_bf16(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16


def _raw(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 goes in as its int16 bits: the kernel widens it with a shift (exact everywhere;
    the interpreter's own bfloat16 conversion flushes subnormals)."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _fp8_dtype(fmt: FP8Format) -> torch.dtype:
    return torch.float8_e4m3fn if fmt.name == E4M3.name else torch.float8_e5m2


def triton_cast(
    x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-pass FP8 cast with Triton: ``(data, amax)`` exactly as ``cast_to_fp8_reference``.

    Args:
        x: float32 / bfloat16 / float16 tensor (CUDA; CPU under ``TRITON_INTERPRET=1``).
        scale: float32 one-element tensor on ``x``'s device.
        fmt: target format.

    Returns:
        ``data`` (FP8, ``x.shape``, laid out like ``torch.empty_like(x)``) and ``amax`` (float32
        0-d, ``max |x|`` with NaN ignored, 0 when empty or all NaN).
    """
    _check(x, scale)
    consts = _format_constants(fmt)
    out = torch.empty_like(x, dtype=torch.uint8)
    src = x
    if x.stride() != out.stride():  # not dense in empty_like's layout: densify in that layout
        src = torch.empty_like(x)
        src.copy_(x)
    n = x.numel()
    if n == 0:
        return out.view(_fp8_dtype(fmt)), torch.zeros((), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, _BLOCK),)
    partial = torch.empty(grid[0], dtype=torch.float32, device=x.device)
    _cast_kernel[grid](
        _raw(src), scale.reshape(1), out, partial, n, **consts, BF16_BITS=_is_bf16(x), BLOCK=_BLOCK
    )
    return out.view(_fp8_dtype(fmt)), partial.amax()


def triton_cast_transpose(
    x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-pass FP8 cast of a 2-D tensor also writing the transposed copy, with Triton.

    Args:
        x: float32 / bfloat16 / float16 tensor of shape ``(M, N)``.
        scale: float32 one-element tensor on ``x``'s device.
        fmt: target format.

    Returns:
        ``(data, data_t, amax)``: row-major FP8 ``(M, N)`` and ``(N, M)``, float32 0-d amax.
    """
    _check(x, scale)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    consts = _format_constants(fmt)
    m, n = x.shape
    src = x.contiguous()
    out = torch.empty((m, n), dtype=torch.uint8, device=x.device)
    out_t = torch.empty((n, m), dtype=torch.uint8, device=x.device)
    dtype = _fp8_dtype(fmt)
    if m == 0 or n == 0:
        amax = torch.zeros((), dtype=torch.float32, device=x.device)
        return out.view(dtype), out_t.view(dtype), amax
    grid = (triton.cdiv(m, _TILE), triton.cdiv(n, _TILE))
    partial = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x.device)
    _cast_transpose_kernel[grid](
        _raw(src),
        scale.reshape(1),
        out,
        out_t,
        partial,
        m,
        n,
        **consts,
        BF16_BITS=_is_bf16(x),
        TILE=_TILE,
    )
    return out.view(dtype), out_t.view(dtype), partial.amax()

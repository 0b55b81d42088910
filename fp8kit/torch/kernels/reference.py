"""Pure-torch FP8 kernels: the definition the native and Triton kernels match bit for bit, and the
backend for everything they do not cover (other devices, ``torch.compile`` tracing, a kernel that
failed to build or launch).

Numerics (docs/semantics.md section 2): ``q = saturate(rne(float32(x) * scale))`` with NaN kept,
amax = ``max |x|`` of the unscaled input with NaN ignored; scales follow the delayed-scaling rule of
docs/semantics.md section 3 (:func:`compute_scale`). Nothing here reads a device value into Python,
so these functions never synchronise with a GPU.

The backend functions (:func:`cast`, :func:`cast_current`, :func:`amax`,
:func:`delayed_update`, :func:`gemm_epilogue`) take arguments already checked by
:mod:`.dispatch`; call the public functions of :mod:`fp8kit.torch.kernels` instead.
"""

from __future__ import annotations

import math

import torch

from fp8kit.formats import FLOAT32_MAX, FP8Format, scale_numerator
from fp8kit.torch.kernels._common import CastResult, CastSpec, UpdateConfig

__all__ = [
    "amax",
    "cast",
    "cast_current",
    "cast_error_sums",
    "cast_to_fp8_reference",
    "column_sums",
    "compute_scale",
    "count_events",
    "delayed_update",
    "gemm_epilogue",
    "nan_ignoring_amax",
    "roll_history",
    "small_fp8_gemm",
]

_POW2_CAP_EXPONENT = 127  # largest power of two in float32
_FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def nan_ignoring_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over all elements with NaN ignored, as a float32 0-d tensor (0 if none)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    a = x.abs()
    if x.is_floating_point():
        a = torch.where(torch.isnan(a), 0.0, a)
    return a.amax().to(torch.float32)


def cast_to_fp8_reference(
    x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale, saturate and round ``x`` into ``fmt``; the definition every kernel matches.

    ``float32(x) * scale`` (one float32 multiply), clamp to ``+-fmt.max`` (saturate, inf included,
    NaN kept), torch's round-to-nearest-even cast; amax = NaN-ignoring ``max |x|``. Two or more
    passes over ``x``.

    Args:
        x: float32 / bfloat16 / float16 tensor, any shape.
        scale: float32 tensor with one element (the quantization scale).
        fmt: target FP8 format.

    Returns:
        ``(data, amax)``: FP8 tensor of ``x.shape`` (laid out like ``torch.empty_like(x)``) and a
        float32 0-d tensor.
    """
    wide = x.to(torch.float32)
    # a NaN keeps its input's sign: a GPU multiply returns the canonical (positive) NaN, and
    # torch's float16 -> float32 conversion returns it for the elements after its vector loop
    nan = torch.where(x.signbit(), -math.nan, math.nan)
    scaled = torch.where(wide.isnan(), nan, wide * scale.reshape(()))
    scaled.clamp_(-fmt.max, fmt.max)  # saturate; +-inf -> +-fmax; NaN stays NaN
    return scaled.to(_FP8_DTYPES[fmt.name]), nan_ignoring_amax(x)


def compute_scale(
    amax: torch.Tensor,
    old_scale: torch.Tensor,
    fmax: float,
    margin: float = 0,
    power_2_scale: bool = False,
) -> torch.Tensor:
    """``fmax / amax / 2**margin`` per element, keeping ``old_scale`` where amax is 0 or not finite.

    Args:
        amax: float32 tensor ``(n,)`` (or 0-d) of absolute maxima.
        old_scale: float32 tensor of the same shape, returned where the amax is unusable.
        fmax: largest finite value of the target FP8 format.
        margin: the scale is divided by ``2**margin``.
        power_2_scale: round the scale down to ``2**(floor(log2(fmax / amax)) - margin)``.

    Returns:
        float32 tensor of ``amax``'s shape; never NaN, inf or 0 where ``old_scale`` is not
        (unless the margin itself pushes ``fmax * 2**-margin`` out of the float32 range).
        An overflowing ratio is capped at FLT_MAX (``2**127`` in power-of-two mode). The
        numerator is made on the device with a fill (never a host-to-device copy).
    """
    usable = torch.isfinite(amax) & (amax > 0)
    safe_amax = torch.where(usable, amax, 1.0)
    if power_2_scale:
        a64 = safe_amax.to(torch.float64)
        exponent = torch.floor(torch.log2(fmax / a64))
        # log2 may round across an integer: fix so that 2**e * amax <= fmax < 2**(e+1) * amax.
        exponent = torch.where(torch.ldexp(a64, exponent) > fmax, exponent - 1, exponent)
        exponent = torch.where(torch.ldexp(a64, exponent + 1) <= fmax, exponent + 1, exponent)
        exponent = torch.clamp(exponent - margin, max=_POW2_CAP_EXPONENT)
        scale = torch.exp2(exponent).to(torch.float32)
    else:
        numerator = torch.full_like(safe_amax, scale_numerator(fmax, margin))
        scale = numerator / safe_amax  # float32 / float32: one correctly rounded division
        scale = torch.where(torch.isinf(scale), FLOAT32_MAX, scale)
    return torch.where(usable, scale, old_scale)


def roll_history(history: torch.Tensor, current: torch.Tensor, run: torch.Tensor) -> torch.Tensor:
    """The history after an event: ``[0, H[2], ..., H[L-1], current]`` where ``run``, unchanged
    elsewhere (``[0]`` when ``L == 1``).

    Args:
        history: float32 ``(L, N)``.
        current: float32 ``(N,)``, the event's staging values.
        run: bool ``(N,)``, the columns that roll.
    """
    rolled = torch.roll(history, shifts=-1, dims=0)
    rolled[-1] = current
    rolled[0].zero_()  # not "= 0.0": that builds a tensor from host data on every call
    return torch.where(run, rolled, history)


def count_events(
    counts: torch.Tensor, run: torch.Tensor, interval: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts + run, recompute)``: one more event where ``run``, and whether that event is one
    of ``1, 1 + interval, ...`` (the events that compute a new scale)."""
    new_counts = counts + run.to(counts.dtype)
    return new_counts, run & ((new_counts - 1) % interval == 0)


# ---------------------------------------------------------------------------------------------
# Backend functions (arguments checked by dispatch.py)


def _cast_data(x: torch.Tensor, scale: torch.Tensor, spec: CastSpec) -> torch.Tensor:
    scaled = x.to(torch.float32) * scale
    scaled.clamp_(-spec.fmax, spec.fmax)
    return scaled.to(spec.fp8_dtype).contiguous()


def _current_scale(a: torch.Tensor, fmax: float, power_2_scale: bool) -> torch.Tensor:
    return compute_scale(a, torch.ones_like(a), fmax, 0, power_2_scale)


def column_sums(x: torch.Tensor) -> torch.Tensor:
    """The bias gradient of a 2-D ``x`` (M, N): its float32 column sums rounded once to
    ``x.dtype``, shape (N,) (docs/semantics.md section 4)."""
    return x.to(torch.float32).sum(dim=0).to(x.dtype)


def _finish(
    x: torch.Tensor,
    scale: torch.Tensor,
    a: torch.Tensor,
    spec: CastSpec,
    transpose: bool,
    amax_out: torch.Tensor | None,
    dbias: bool,
) -> CastResult:
    data = _cast_data(x, scale, spec)
    data_t = data.t().contiguous() if transpose else None
    bias = column_sums(x) if dbias else None
    if amax_out is not None:
        amax_out.clamp_(min=a)
        a = None
    return CastResult(data, data_t, a, torch.reciprocal(scale), bias)


def cast(
    x: torch.Tensor,
    scale: torch.Tensor,
    spec: CastSpec,
    transpose: bool,
    amax_out: torch.Tensor | None,
    dbias: bool,
    first_step_count: torch.Tensor | None,
) -> CastResult:
    """:func:`fp8kit.torch.kernels.cast_fp8` in torch ops."""
    x = x.detach()  # a kernel, as the others: nothing it writes joins x's autograd graph
    a = nan_ignoring_amax(x)
    s = scale.reshape(())
    if first_step_count is not None:
        current = _current_scale(a, spec.fmax, False)
        s = torch.where(first_step_count.reshape(()) == 0, current, s)
    return _finish(x, s, a, spec, transpose, amax_out, dbias)


def cast_current(
    x: torch.Tensor, spec: CastSpec, power_2_scale: bool, transpose: bool, dbias: bool
) -> CastResult:
    """:func:`fp8kit.torch.kernels.cast_fp8_current` in torch ops."""
    x = x.detach()
    a = nan_ignoring_amax(x)
    return _finish(x, _current_scale(a, spec.fmax, power_2_scale), a, spec, transpose, None, dbias)


def amax(x: torch.Tensor, amax_out: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`fp8kit.torch.kernels.compute_amax` in torch ops."""
    a = nan_ignoring_amax(x.detach())
    if amax_out is None:
        return a
    amax_out.clamp_(min=a)
    return None


def delayed_update(
    history: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    count: torch.Tensor,
    config: UpdateConfig,
    ran: torch.Tensor | None,
    staging: torch.Tensor | None,
    nonfinite_count: torch.Tensor | None,
) -> None:
    """:func:`fp8kit.torch.kernels.delayed_update_` in torch ops (in place)."""
    current = history[0] if staging is None else staging
    if ran is not None:
        current = torch.where(ran, current, 0.0)
    run = current != 0
    if config.algo_id == 0 and history.shape[0] > 1:
        # NaN ignored (docs/semantics.md section 3): fmax takes the other operand; an all-NaN
        # window gives -inf, which keeps the scale.
        completed = history[1:].nan_to_num(-torch.inf, torch.inf).amax(dim=0)
        window_amax = torch.fmax(completed, current)
    else:
        window_amax = current
    new_history = roll_history(history, current, run)
    new_count, recompute = count_events(count, run, config.interval)
    fresh = compute_scale(window_amax, scale, config.fmax, config.margin, config.power_2_scale)
    new_scale = torch.where(recompute, fresh, scale)
    if nonfinite_count is not None:
        nonfinite_count.add_((run & torch.isposinf(current)).to(nonfinite_count.dtype))
    history.copy_(new_history)
    count.copy_(new_count)
    scale.copy_(new_scale)
    torch.reciprocal(new_scale, out=scale_inv)


def gemm_epilogue(
    acc: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`fp8kit.torch.kernels.gemm_epilogue` in torch ops, out of place: this runs inside
    compiled FP8 GEMMs, and torch 2.11's compiler gives a zero gradient to an autograd.Function
    output changed in place (docs/decisions/0249)."""
    out = acc * (a_scale * b_scale).reshape(())
    if bias is not None:
        out = out + bias
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def small_fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`fp8kit.torch.kernels.small_fp8_gemm` in torch ops: the float32 sum over k taken
    one k at a time (each product is exact, each step one rounded add), then the epilogue."""
    af, bf = a.to(torch.float32), b.to(torch.float32)
    acc = torch.zeros((a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
    for k in range(a.shape[1]):
        acc.add_(af[:, k : k + 1] * bf[k : k + 1, :])
    return gemm_epilogue(acc, a_scale, b_scale, out_dtype, bias)


def cast_error_sums(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, fmax: float
) -> torch.Tensor:
    """:func:`fp8kit.torch.kernels.cast_error_sums` in torch ops: float32 ``x`` and
    ``q * scale_inv`` (as ``Float8Tensor.dequantize()``), float64 squares and sums."""
    xf = x.detach().reshape(-1).to(torch.float32)
    qf = q.reshape(-1).to(torch.float32)
    s = scale.reshape(()).to(torch.float32)
    saturated = (xf.abs().mul_(s) > fmax).sum()  # |x| * s == |x * s| in float32
    flushed = ((xf != 0) & (qf == 0)).sum()
    finite = torch.isfinite(xf)
    signal_part = torch.where(finite, xf, 0.0).to(torch.float64)
    deq = torch.where(finite, qf.mul_(scale_inv.reshape(()).to(torch.float32)), 0.0)
    signal = signal_part.square().sum()
    noise = signal_part.sub_(deq.to(torch.float64)).square_().sum()
    return torch.stack([p.to(torch.float64) for p in (saturated, flushed, signal, noise)])

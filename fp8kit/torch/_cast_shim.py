"""TEMPORARY stand-in for the fused kernel API (replaced by fp8kit.torch.kernels at merge)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fp8kit.torch.quantization import (
    current_scale,
    fp8_format_of,
    nan_ignoring_amax,
    quantize_with_scale,
)


class CastResult(NamedTuple):
    data: torch.Tensor
    data_t: torch.Tensor | None
    amax: torch.Tensor | None
    scale_inv: torch.Tensor
    dbias: torch.Tensor | None


def cast_fp8(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    transpose: bool = False,
    amax_out: torch.Tensor | None = None,
    dbias: bool = False,
    first_step_current: torch.Tensor | None = None,
) -> CastResult:
    fmt = fp8_format_of(fp8_dtype)
    if first_step_current is not None:
        cur = current_scale(nan_ignoring_amax(x), fmt)
        scale = torch.where(first_step_current.reshape(()) > 0, scale.reshape(()), cur)
    scale_inv = torch.reciprocal(scale.reshape(()))
    q = quantize_with_scale(x, scale.reshape(()), fmt, scale_inv, transpose)
    if amax_out is not None:
        amax_out.clamp_(min=q.amax)
    db = x.to(torch.float32).sum(0).to(x.dtype) if dbias else None
    return CastResult(q.data, q.data_t, q.amax, scale_inv, db)


def cast_fp8_current(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    power_2_scale: bool = False,
    transpose: bool = False,
    dbias: bool = False,
) -> CastResult:
    fmt = fp8_format_of(fp8_dtype)
    amax = nan_ignoring_amax(x)
    scale = current_scale(amax, fmt, power_2_scale)
    scale_inv = torch.reciprocal(scale)
    q = quantize_with_scale(x, scale, fmt, scale_inv, transpose)
    db = x.to(torch.float32).sum(0).to(x.dtype) if dbias else None
    return CastResult(q.data, q.data_t, amax, scale_inv, db)


def delayed_update_(
    history: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    count: torch.Tensor,
    *,
    fmax: float,
    margin: float,
    interval: int,
    algo: str,
    power_2_scale: bool,
    ran: torch.Tensor | None = None,
    nonfinite_count: torch.Tensor | None = None,
) -> None:
    from fp8kit.recipe import DelayedScaling
    from fp8kit.torch.scaling import update_scaling_state

    recipe = DelayedScaling(
        margin=margin, interval=interval, amax_compute_algo=algo, power_2_scale=power_2_scale,
        amax_history_len=history.shape[0],
    )
    kept = None
    if ran is not None:
        kept = history[0].clone()
        history[0] = torch.where(ran, history[0], 0.0)
    if nonfinite_count is not None:
        nonfinite_count.add_(torch.isinf(history[0]).to(nonfinite_count.dtype))
    h, s, c = update_scaling_state(history, scale, count, recipe, fmax)
    if kept is not None:
        h[0] = torch.where(ran, h[0], kept)
    history.copy_(h)
    scale.copy_(s)
    count.copy_(c)
    torch.reciprocal(s, out=scale_inv)

"""The delayed-scaling update rule (SPEC section 3) as pure functions on torch tensors.

Every function here takes tensors and returns new tensors; nothing owns state. The functions work
on a whole stacked buffer ``(L, N)`` of many modules at once with a fixed number of tensor ops.
"""

from __future__ import annotations

import torch

from fp8kit.formats import FLOAT32_MAX
from fp8kit.recipe import DelayedScaling

__all__ = ["compute_scale", "new_scale", "update_scaling_state"]

_POW2_CAP_EXPONENT = 127  # largest power of two in float32

_constants: dict[tuple[float, torch.device], torch.Tensor] = {}


def _constant(value: float, device: torch.device) -> torch.Tensor:
    """A float32 0-d tensor holding ``value`` on ``device``, made once per (value, device).

    ``torch.tensor(value, device=cuda)`` inside a step is a host-to-device copy from pageable
    memory, which blocks the host; a cached constant costs nothing after the first call.
    """
    key = (value, device)
    t = _constants.get(key)
    if t is None:
        t = _constants[key] = torch.tensor(value, dtype=torch.float32, device=device)
    return t


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
        float32 tensor of ``amax``'s shape; never NaN, inf or 0 where ``old_scale`` is not.
        An overflowing ratio is capped at FLT_MAX (``2**127`` in power-of-two mode).
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
        numerator = _constant(fmax * 2.0 ** (-margin), amax.device)
        scale = numerator / safe_amax  # float32 / float32: one correctly rounded division
        scale = torch.where(torch.isinf(scale), FLOAT32_MAX, scale)
    return torch.where(usable, scale, old_scale)


def new_scale(
    amax: torch.Tensor, old_scale: torch.Tensor, fmax: float, recipe: DelayedScaling
) -> torch.Tensor:
    """The recipe's scale for ``amax``: default rule, power of two, or the user's callable.

    A user callable's result is checked for shape; where it is not finite or not positive, the
    old scale is kept (a bad value must not poison the scale forever).
    """
    if recipe.scaling_factor_compute_algo is None:
        return compute_scale(amax, old_scale, fmax, recipe.margin, recipe.power_2_scale)
    fmax_t = _constant(fmax, amax.device)
    result = recipe.scaling_factor_compute_algo(amax, old_scale, fmax_t, recipe)
    result = _checked_callable_output("scaling_factor_compute_algo", result, amax)
    return torch.where(torch.isfinite(result) & (result > 0), result, old_scale)


def _checked_callable_output(name: str, result: object, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"{name} must return a torch.Tensor, got {type(result).__name__}")
    if result.shape != like.shape:
        try:
            result = torch.broadcast_to(result, like.shape)
        except RuntimeError:
            raise ValueError(
                f"{name} must return a tensor of shape {tuple(like.shape)}, "
                f"got {tuple(result.shape)}"
            ) from None
    return result.to(torch.float32)


def window_amax(history: torch.Tensor, recipe: DelayedScaling) -> torch.Tensor:
    """The amax each slot's new scale is computed from; ``history[0]`` holds the current amax."""
    algo = recipe.amax_compute_algo
    if algo == "max":
        return torch.amax(history, dim=0)
    if algo == "most_recent":
        return history[0]
    result = algo(history.clone())
    return _checked_callable_output("amax_compute_algo", result, history[0])


def update_scaling_state(
    history: torch.Tensor,
    scale: torch.Tensor,
    counts: torch.Tensor,
    recipe: DelayedScaling,
    fmax: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One update event for every slot of a stacked state.

    Args:
        history: float32 ``(L, N)``; row 0 is the staging row (current amax, 0 = slot did not run).
        scale: float32 ``(N,)`` current scales.
        counts: int64 ``(N,)`` number of non-skipped events so far per slot.
        recipe: the delayed-scaling recipe (algorithm, margin, interval, ...).
        fmax: largest finite value of the FP8 format these slots quantize into.

    Returns:
        ``(history, scale, counts)`` after the event, as new tensors. Slots whose staging value is
        0 are unchanged. Others roll (``[0, H[2], ..., H[L-1], current]``), count one event, and
        get a new scale at events ``1, 1 + interval, ...``.
    """
    current = history[0]
    ran = current != 0
    amax = window_amax(history, recipe)
    rolled = torch.roll(history, shifts=-1, dims=0)
    rolled[0].zero_()
    new_history = torch.where(ran, rolled, history)
    new_counts = counts + ran.to(counts.dtype)
    recompute = ran & ((new_counts - 1) % recipe.interval == 0)
    new_scales = torch.where(recompute, new_scale(amax, scale, fmax, recipe), scale)
    return new_history, new_scales, new_counts

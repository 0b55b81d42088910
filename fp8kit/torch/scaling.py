"""The delayed-scaling update rule (docs/semantics.md section 3) as pure functions on torch tensors.

Every function here takes tensors and returns new tensors; nothing owns state. The functions work
on a whole stacked buffer ``(L, N)`` of many modules at once with a fixed number of tensor ops.
The scale rule, the roll and the count live with the kernels' torch reference
(:mod:`fp8kit.torch.kernels.reference`); this module adds the recipe's callables.
"""

from __future__ import annotations

import torch

from fp8kit.recipe import CALLABLE_SHAPE_HINT, DelayedScaling
from fp8kit.torch.kernels.reference import compute_scale, count_events, roll_history

__all__ = ["compute_scale", "new_scale", "update_scaling_state"]


def new_scale(
    amax: torch.Tensor, old_scale: torch.Tensor, fmax: float, recipe: DelayedScaling
) -> torch.Tensor:
    """The recipe's scale for ``amax``: default rule, power of two, or the user's callable.

    A user callable's result is checked for shape; where it is not finite or not positive, the
    old scale is kept (a bad value must not poison the scale forever).
    """
    if recipe.scaling_factor_compute_algo is None:
        return compute_scale(amax, old_scale, fmax, recipe.margin, recipe.power_2_scale)
    fmax_t = amax.new_full((), fmax)  # 0-d, filled on the device (no host-to-device copy)
    result = recipe.scaling_factor_compute_algo(amax, old_scale, fmax_t, recipe)
    result = _checked_callable_output("scaling_factor_compute_algo", result, amax)
    return torch.where(torch.isfinite(result) & (result > 0), result, old_scale)


def _checked_callable_output(name: str, result: object, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"{name} must return a torch.Tensor, got {type(result).__name__}")
    if result.shape != like.shape:
        raise ValueError(
            f"{name} must return a tensor of shape {tuple(like.shape)}, got "
            f"{tuple(result.shape)} ({CALLABLE_SHAPE_HINT})"
        )
    return result.to(torch.float32)


def window_amax(history: torch.Tensor, recipe: DelayedScaling) -> torch.Tensor:
    """The amax each slot's new scale is computed from; ``history[0]`` holds the current amax."""
    algo = recipe.amax_compute_algo
    if algo == "max":
        # NaN entries ignored (docs/semantics.md section 3; one can arrive only with a loaded or
        # edited history); a column of NaN alone stays NaN, as fp8kit.jax's nanmax leaves it
        amax = history.nan_to_num(-torch.inf, torch.inf).amax(dim=0)
        return torch.where(history.isnan().all(dim=0), torch.nan, amax)
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
    new_history = roll_history(history, current, ran)
    new_counts, recompute = count_events(counts, ran, recipe.interval)
    new_scales = torch.where(recompute, new_scale(amax, scale, fmax, recipe), scale)
    return new_history, new_scales, new_counts

"""Quantize a tensor into one slot of a module's scaling state (docs/semantics.md section 3).

Delayed scaling uses the slot's stored scale and folds the amax into the staging row inside the
casting kernel; current scaling computes the scale from the tensor itself on the device. Nothing
here reads a device value on the host (docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fp8kit.torch.kernels import cast_fp8_current, prepare_cast
from fp8kit.torch.plan import RecipePlan
from fp8kit.torch.quantization import Float8Tensor
from fp8kit.torch.state import ScalingState

__all__ = ["quantize_slot"]

# Numerics observer (fp8kit.torch.inspect): None unless an Inspector is attached, so the cost of
# the hook when off is one ``is not None`` test per cast. Called as
# ``_observer(x, q, recipe, state, slot, fmt)`` right after every slot cast.
_observer: Callable[..., None] | None = None


def quantize_slot(
    x: torch.Tensor,
    plan: RecipePlan,
    state: ScalingState,
    slot: int,
    backward: bool,
    transpose: bool = False,
    dbias: bool = False,
) -> tuple[Float8Tensor, torch.Tensor | None]:
    """Quantize ``x`` for ``state``'s ``slot`` in one pass; (delayed) fold its amax into staging.

    Args:
        x: high-precision tensor (2-D when ``transpose`` or ``dbias``).
        plan: the active recipe's plan.
        state: the forward or backward scaling state of the module.
        slot: index into ``state``'s slots.
        backward: True for a gradient (backward format), False for activations and weights.
        transpose: also write ``data_t``, the row-major transpose, in the same pass.
        dbias: also return the column sums of ``x`` (the bias gradient, ``x.dtype``).

    Returns:
        ``(q, dbias)``: the FP8 tensor (its ``scale_inv`` a fresh tensor, safe to keep across the
        next update event) and the bias gradient or None.
    """
    if backward:
        dtype, fmt = plan.backward_dtype, plan.backward_format
    else:
        dtype, fmt = plan.forward_dtype, plan.forward_format
    observer = _observer
    if not plan.delayed:
        r = cast_fp8_current(
            x, dtype, power_2_scale=plan.power_2_scale, transpose=transpose, dbias=dbias
        )
    else:
        fold = observer is None  # an observer needs the amax itself
        key = (dtype, fold, plan.first_step_current)
        derived = state.slot_derived(slot)
        cast = derived.get(key)
        if cast is None:  # once per slot, key and buffer set: checks and addresses bound
            scale, staging, count = state.slot_views(slot)
            cast = derived[key] = prepare_cast(
                scale,
                dtype,
                amax_out=staging if fold else None,
                first_step_current=count if plan.first_step_current else None,
            )
        r = cast(x, transpose, dbias)
        if not fold:
            state.record_amax(slot, r.amax)  # type: ignore[arg-type]
    q = Float8Tensor(r.data, r.scale_inv, r.amax, r.data_t)
    if observer is not None:
        observer(x, q, plan.recipe, state, slot, fmt)
    return q, r.dbias

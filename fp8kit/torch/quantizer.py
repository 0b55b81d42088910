"""Quantize a tensor into one slot of a module's scaling state under the active recipe.

This is where a recipe meets a module: delayed scaling uses the slot's stored scale and records
the amax into the staging row; current scaling computes the scale from the tensor itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fp8kit.formats import FP8Format
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Recipe
from fp8kit.torch.autocast import register_forward_state, schedule_backward_update
from fp8kit.torch.quantization import Float8Tensor, cast_to_fp8, quantize_current
from fp8kit.torch.state import FP8Meta, ScalingState

__all__ = ["FP8Run", "quantize_slot"]

# Numerics observer (fp8kit.torch.inspect): None unless an Inspector is attached, so the cost of
# the hook when off is one ``is not None`` test per cast. Called as
# ``_observer(x, q, recipe, state, slot, fmt)`` right after every slot cast.
_observer: Callable[..., None] | None = None


def quantize_slot(
    x: torch.Tensor,
    recipe: Recipe,
    state: ScalingState,
    slot: int,
    fmt: FP8Format,
    record: bool = True,
) -> Float8Tensor:
    """Quantize ``x`` for ``state``'s ``slot`` and (delayed scaling) record its amax.

    Args:
        x: high-precision tensor, any shape.
        recipe: the active recipe.
        state: the forward or backward scaling state of the module.
        slot: index into ``state``'s slots.
        fmt: FP8 format of this slot under the recipe.
        record: fold the amax into the staging row (False for a reused cached weight).
    """
    if isinstance(recipe, Float8CurrentScaling):
        q = quantize_current(x, fmt, recipe.power_2_scale)
    else:
        if recipe.first_step_scaling == "current" and not state.slot_has_history(slot):
            q = quantize_current(x, fmt)
        else:
            data, amax = cast_to_fp8(x, state.scale[slot], fmt)
            # A copy, not a view: the state's scale_inv changes in place at the next update
            # event, while this tensor may live on (saved for backward, cached weight).
            q = Float8Tensor(data, state.scale_inv[slot].clone(), amax)
        if record:
            state.record_amax(slot, q.amax)
    if _observer is not None:
        _observer(x, q, recipe, state, slot, fmt)
    return q


@dataclass
class FP8Run:
    """Everything one FP8 forward call of a module needs: recipe, group and the module's meta."""

    recipe: Recipe
    group: Any
    meta: FP8Meta
    training: bool  # grad mode at the module call: forward states roll only when training

    @property
    def delayed(self) -> bool:
        return isinstance(self.recipe, DelayedScaling)

    @property
    def forward_format(self) -> FP8Format:
        return self.recipe.fp8_format.forward

    @property
    def backward_format(self) -> FP8Format:
        return self.recipe.fp8_format.backward

    @property
    def override(self) -> tuple[bool, bool, bool]:
        """(fprop, dgrad, wgrad): True runs that GEMM in high precision."""
        return self.recipe.override_linear_precision

    def quantize_forward(self, x: torch.Tensor, slot: int, record: bool = True) -> Float8Tensor:
        q = quantize_slot(x, self.recipe, self.meta.forward, slot, self.forward_format, record)
        if record and self.delayed and self.training:
            register_forward_state(self.meta.forward, self.recipe, self.group)  # type: ignore[arg-type]
        return q

    def quantize_backward(self, x: torch.Tensor, slot: int) -> Float8Tensor:
        q = quantize_slot(x, self.recipe, self.meta.backward, slot, self.backward_format)
        if self.delayed:
            schedule_backward_update(self.meta.backward, self.recipe, self.group)  # type: ignore[arg-type]
        return q

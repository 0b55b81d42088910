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
from fp8kit.slots import FwdSlot, fwd_slot
from fp8kit.torch.autocast import register_forward_state, schedule_backward_update
from fp8kit.torch.quantization import Float8Tensor, quantize_current, quantize_with_scale
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
    transpose: bool = False,
) -> Float8Tensor:
    """Quantize ``x`` for ``state``'s ``slot`` and (delayed scaling) record its amax.

    Args:
        x: high-precision tensor, any shape.
        recipe: the active recipe.
        state: the forward or backward scaling state of the module.
        slot: index into ``state``'s slots.
        fmt: FP8 format of this slot under the recipe.
        record: fold the amax into the staging row (False for a reused cached weight).
        transpose: (2-D ``x``) also write ``data_t``, the row-major transpose, in the same pass.
    """
    if isinstance(recipe, Float8CurrentScaling):
        q = quantize_current(x, fmt, recipe.power_2_scale, transpose)
    else:
        if recipe.first_step_scaling == "current" and not state.slot_has_history(slot):
            q = quantize_current(x, fmt, transpose=transpose)
        else:
            # scale_inv is a copy, not a view: the state's scale_inv changes in place at the next
            # update event, while this tensor may live on (saved for backward, cached weight).
            scale_inv = state.scale_inv[slot].clone()
            q = quantize_with_scale(x, state.scale[slot], fmt, scale_inv, transpose)
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
    def fp8_gemms(self) -> tuple[bool, bool, bool]:
        """(fprop, dgrad, wgrad): True where that GEMM runs in FP8 (not overridden)."""
        fprop, dgrad, wgrad = self.recipe.override_linear_precision
        return not fprop, not dgrad, not wgrad

    def quantize_weight(self, weight: torch.Tensor, gemm: int) -> Float8Tensor | None:
        """The FP8 weight of GEMM ``gemm`` (None if no GEMM uses it), with the row-major
        transpose dgrad needs written in the same pass."""
        fprop, dgrad, _ = self.fp8_gemms
        if not (fprop or dgrad):
            return None
        return self.quantize_forward(weight, fwd_slot(gemm, FwdSlot.WEIGHT), transpose=dgrad)

    def quantize_forward(
        self, x: torch.Tensor, slot: int, record: bool = True, transpose: bool = False
    ) -> Float8Tensor:
        state, fmt = self.meta.forward, self.forward_format
        q = quantize_slot(x, self.recipe, state, slot, fmt, record, transpose)
        if record and self.delayed and self.training:
            register_forward_state(self.meta.forward, self.recipe, self.group)  # type: ignore[arg-type]
        return q

    def quantize_backward(
        self, x: torch.Tensor, slot: int, transpose: bool = False
    ) -> Float8Tensor:
        state, fmt = self.meta.backward, self.backward_format
        q = quantize_slot(x, self.recipe, state, slot, fmt, transpose=transpose)
        if self.delayed:
            schedule_backward_update(self.meta.backward, self.recipe, self.group)  # type: ignore[arg-type]
        return q

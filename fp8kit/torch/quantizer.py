"""Quantize a tensor into one slot of a module's scaling state under the active recipe.

This is where a recipe meets a module: delayed scaling uses the slot's stored scale and folds the
amax into the staging row inside the casting kernel; current scaling computes the scale from the
tensor itself on the device. Nothing here reads a device value on the host (docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fp8kit.formats import FP8Format
from fp8kit.recipe import DelayedScaling, Recipe
from fp8kit.slots import FwdSlot, fwd_slot
from fp8kit.torch.autocast import register_forward_state, schedule_backward_update
from fp8kit.torch.kernels import cast_fp8, cast_fp8_current
from fp8kit.torch.quantization import Float8Tensor, nan_ignoring_amax, torch_dtype_of
from fp8kit.torch.state import FP8Meta, ScalingState

__all__ = ["FP8Run", "RecipePlan", "plan_for", "quantize_slot"]

# Numerics observer (fp8kit.torch.inspect): None unless an Inspector is attached, so the cost of
# the hook when off is one ``is not None`` test per cast. Called as
# ``_observer(x, q, recipe, state, slot, fmt)`` right after every slot cast.
_observer: Callable[..., None] | None = None


@dataclass(frozen=True)
class RecipePlan:
    """What a module call needs to know of a recipe, computed once per recipe (:func:`plan_for`).

    Attributes:
        recipe: the recipe itself.
        delayed: True for :class:`DelayedScaling`, False for :class:`Float8CurrentScaling`.
        forward_format / backward_format: FP8 formats of activations+weights / gradients.
        forward_dtype / backward_dtype: the matching torch float8 dtypes.
        fp8_gemms: (fprop, dgrad, wgrad), True where that GEMM runs in FP8.
        fast_accum: (fprop, dgrad, wgrad) cuBLASLt fast accumulation flags.
        first_step_current: delayed scaling with ``first_step_scaling="current"``.
        power_2_scale: the recipe's power-of-two flag (current scaling uses it per cast).
    """

    recipe: Recipe
    delayed: bool
    forward_format: FP8Format
    backward_format: FP8Format
    forward_dtype: torch.dtype
    backward_dtype: torch.dtype
    fp8_gemms: tuple[bool, bool, bool]
    fast_accum: tuple[bool, bool, bool]
    first_step_current: bool
    power_2_scale: bool


_plans: dict[Recipe, RecipePlan] = {}


def plan_for(recipe: Recipe) -> RecipePlan:
    """The :class:`RecipePlan` of ``recipe`` (cached: recipes are frozen and hashable)."""
    plan = _plans.get(recipe)
    if plan is None:
        fmt = recipe.fp8_format
        fprop, dgrad, wgrad = recipe.override_linear_precision
        delayed = isinstance(recipe, DelayedScaling)
        plan = _plans[recipe] = RecipePlan(
            recipe=recipe,
            delayed=delayed,
            forward_format=fmt.forward,
            backward_format=fmt.backward,
            forward_dtype=torch_dtype_of(fmt.forward),
            backward_dtype=torch_dtype_of(fmt.backward),
            fp8_gemms=(not fprop, not dgrad, not wgrad),
            fast_accum=recipe.fast_accumulation,
            first_step_current=delayed and recipe.first_step_scaling == "current",  # type: ignore[union-attr]
            power_2_scale=recipe.power_2_scale,
        )
    return plan


def quantize_slot(
    x: torch.Tensor,
    plan: RecipePlan,
    state: ScalingState,
    slot: int,
    backward: bool,
    record: bool = True,
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
        record: fold the amax into the staging row (False for a reused cached weight).
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
        scale, staging, count = state.slot_views(slot)
        fold = record and observer is None  # an observer needs the amax itself
        r = cast_fp8(
            x,
            scale,
            dtype,
            transpose=transpose,
            amax_out=staging if fold else None,
            dbias=dbias,
            first_step_current=count if plan.first_step_current else None,
        )
        if record and not fold:
            state.record_amax(slot, r.amax)  # type: ignore[arg-type]
    q = Float8Tensor(r.data, r.scale_inv, r.amax, r.data_t)
    if observer is not None:
        observer(x, q, plan.recipe, state, slot, fmt)
    return q, r.dbias


@dataclass
class FP8Run:
    """Everything one FP8 forward call of a module needs: recipe plan, group and the module's meta.

    ``training``: grad mode (or calibration) at the module call: forward states roll only then.
    ``fp8``: False in a calibration-only region: GEMMs run in high precision and the module only
    records amaxes (:meth:`record_forward`).
    """

    plan: RecipePlan
    group: Any
    meta: FP8Meta
    training: bool
    fp8: bool = True

    @property
    def recipe(self) -> Recipe:
        return self.plan.recipe

    @property
    def delayed(self) -> bool:
        return self.plan.delayed

    @property
    def forward_format(self) -> FP8Format:
        return self.plan.forward_format

    @property
    def backward_format(self) -> FP8Format:
        return self.plan.backward_format

    @property
    def fp8_gemms(self) -> tuple[bool, bool, bool]:
        """(fprop, dgrad, wgrad): True where that GEMM runs in FP8 (not overridden)."""
        return self.plan.fp8_gemms

    def quantize_weight(self, weight: torch.Tensor, gemm: int) -> Float8Tensor | None:
        """The FP8 weight of GEMM ``gemm`` (None if no GEMM uses it), with the row-major
        transpose dgrad needs written in the same pass."""
        fprop, dgrad, _ = self.plan.fp8_gemms
        if not (fprop or dgrad):
            return None
        return self.quantize_forward(weight, fwd_slot(gemm, FwdSlot.WEIGHT), transpose=dgrad)

    def quantize_forward(
        self, x: torch.Tensor, slot: int, record: bool = True, transpose: bool = False
    ) -> Float8Tensor:
        """Quantize an activation or weight into forward ``slot`` (see :func:`quantize_slot`)."""
        q, _ = quantize_slot(x, self.plan, self.meta.forward, slot, False, record, transpose)
        if record and self.plan.delayed and self.training:
            register_forward_state(self.meta.forward, self.plan.recipe, self.group)  # type: ignore[arg-type]
        return q

    def record_forward(self, x: torch.Tensor, slot: int) -> None:
        """Fold ``max |x|`` (NaN ignored) into forward ``slot``'s staging entry, no cast."""
        self.meta.forward.record_amax(slot, nan_ignoring_amax(x.detach()))
        if self.plan.delayed and self.training:
            register_forward_state(self.meta.forward, self.plan.recipe, self.group)  # type: ignore[arg-type]

    def quantize_backward(
        self, x: torch.Tensor, slot: int, transpose: bool = False, dbias: bool = False
    ) -> tuple[Float8Tensor, torch.Tensor | None]:
        """Quantize a gradient into backward ``slot``; returns ``(q, dbias or None)``."""
        out = quantize_slot(x, self.plan, self.meta.backward, slot, True, True, transpose, dbias)
        if self.plan.delayed:
            schedule_backward_update(self.meta.backward, self.plan.recipe, self.group)  # type: ignore[arg-type]
        return out

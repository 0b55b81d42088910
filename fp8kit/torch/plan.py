"""What a module call needs to know of a recipe, worked out once per recipe (docs/semantics.md
section 2).

The autocast computes the plan when it is entered, so a module call (and a graph traced by
``torch.compile``) reads plain attributes instead of looking the recipe up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8kit.formats import FP8Format
from fp8kit.recipe import DelayedScaling, Recipe
from fp8kit.torch.quantization import torch_dtype_of

__all__ = ["RecipePlan", "plan_for"]


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

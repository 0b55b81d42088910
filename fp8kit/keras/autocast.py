"""``fp8kit.keras.autocast``: construction-time defaults for FP8 layers.

A Keras layer's recipe is part of its config (saved in ``.keras`` files) and of the traced step
(``tf.function`` / XLA bake it in), so it is fixed when the layer is constructed: the layer's
``recipe=`` argument, else the innermost :func:`autocast` active at construction, else
``DelayedScaling()``. Changing the autocast later never changes an existing layer (see
``docs/decisions/0600-keras-frontend.md``).
"""

from __future__ import annotations

import contextlib
import numbers
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Recipe
from fp8kit.unset import UNSET

__all__ = ["AutocastDefaults", "autocast", "check_recipe", "check_steps_apply", "resolve"]


def check_recipe(recipe: Any, name: str = "recipe") -> Recipe | None:
    """Return ``recipe`` if it is None or an fp8kit recipe, else raise a TypeError."""
    if recipe is not None and not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError(
            f"{name} must be None (high precision) or an fp8kit.recipe.DelayedScaling / "
            f"Float8CurrentScaling, got {type(recipe).__name__}"
        )
    return recipe


def check_accumulation_steps(steps: Any) -> int:
    """Return ``steps`` as an int if it is an integer >= 1 (``np.int64`` included, as Keras
    optimizers accept), else raise."""
    if isinstance(steps, (bool, np.bool_)) or not isinstance(steps, numbers.Integral):
        raise TypeError(f"gradient_accumulation_steps must be an int >= 1, got {steps!r}")
    steps = int(steps)
    if steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {steps}")
    return steps


def check_steps_apply(recipe: Recipe | None, steps: int) -> None:
    """Refuse ``steps > 1`` with a recipe that has no update events to space out
    (:class:`Float8CurrentScaling`): the setting would be silently ignored
    (docs/decisions/0261-keras-accumulation-steps-need-delayed-scaling.md)."""
    if steps > 1 and isinstance(recipe, Float8CurrentScaling):
        raise ValueError(
            f"gradient_accumulation_steps={steps} has no effect with Float8CurrentScaling: it "
            "scales every tensor by its own amax and has no update events to space out. Leave "
            "gradient_accumulation_steps at 1, or use DelayedScaling"
        )


@dataclass(frozen=True)
class AutocastDefaults:
    """What the innermost active :func:`autocast` says about layers constructed now."""

    enabled: bool
    recipe: Recipe
    gradient_accumulation_steps: int


_local = threading.local()


def _stack() -> list[AutocastDefaults]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


@contextlib.contextmanager
def autocast(
    enabled: bool = True,
    recipe: Recipe | None = None,
    *,
    gradient_accumulation_steps: int = 1,
) -> Iterator[AutocastDefaults]:
    """Make FP8 layers constructed inside this block default to ``recipe``.

    Args:
        enabled: False makes layers constructed inside default to high precision (a layer's
            own ``recipe=`` still applies).
        recipe: DelayedScaling or Float8CurrentScaling; None means ``DelayedScaling()``.
        gradient_accumulation_steps: backward passes per update event (match the optimizer's
            ``gradient_accumulation_steps``); the amaxes in between combine with max.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    chosen = check_recipe(DelayedScaling() if recipe is None else recipe)
    assert chosen is not None
    steps = check_accumulation_steps(gradient_accumulation_steps)
    check_steps_apply(chosen, steps)
    frame = AutocastDefaults(enabled=enabled, recipe=chosen, gradient_accumulation_steps=steps)
    stack = _stack()
    stack.append(frame)
    try:
        yield frame
    finally:
        stack.pop()


def resolve(recipe: Any, steps: Any) -> tuple[Recipe | None, int]:
    """A layer's ``(recipe, gradient_accumulation_steps)`` from its arguments and the autocast."""
    stack = _stack()
    frame = stack[-1] if stack else None
    if recipe is UNSET and frame is None:
        recipe = DelayedScaling()
    elif recipe is UNSET:
        recipe = frame.recipe if frame.enabled else None
    chosen = check_recipe(recipe)
    if steps is UNSET:
        # an autocast's count applies to the layers it can apply to: a current-scaling layer in
        # a delayed-scaling block has no events to space out
        inherit = frame is not None and not isinstance(chosen, Float8CurrentScaling)
        steps = frame.gradient_accumulation_steps if inherit else 1
    steps = check_accumulation_steps(steps)
    check_steps_apply(chosen, steps)
    return chosen, steps

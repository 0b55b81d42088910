"""``fp8kit.jax.autocast``: construction-time defaults for FP8 modules.

In JAX the recipe must be static (part of every ``jax.jit`` cache key), so this context manager
never changes what an already-traced function computes. It only supplies defaults to FP8 modules
(:class:`fp8kit.jax.linen.Dense`, ``DenseGeneral``, :class:`fp8kit.jax.nnx.Linear`) *constructed*
inside it: their ``recipe`` (or None when ``enabled=False``) and ``amax_reduction_axes``. The
FP8 state a module creates then carries its recipe as static pytree metadata, and every later
call uses that recipe (see ``docs/decisions/0103-jax-static-recipe.md``). The active autocast
is part of every ``jax.jit`` cache key, so a function that constructs modules while traced (a
jitted Flax ``init``) traces again under another autocast.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax

from fp8kit.jax.meta import _check_axes, check_recipe
from fp8kit.recipe import DelayedScaling, Recipe
from fp8kit.unset import UNSET

__all__ = ["AutocastDefaults", "autocast", "current_defaults"]


@dataclass(frozen=True)
class AutocastDefaults:
    """What the innermost active :func:`autocast` says about modules constructed now."""

    enabled: bool
    recipe: Recipe
    amax_reduction_axes: Any  # tuple[str, ...] | None, or UNSET when the autocast gives none


_local = threading.local()
# The innermost autocast, as part of every jax.jit cache key: a module constructed while a
# function is traced (Flax clones modules inside a jitted ``init`` / ``apply``; an ``nnx.jit``
# factory builds them) reads the autocast then, so a later call under another autocast must
# trace again rather than reuse the first trace's recipe (docs/jax.md, "Where the recipe comes
# from").
_JIT_KEY = jax.make_user_context(default_value=None)


def _stack() -> list[AutocastDefaults]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def current_defaults() -> AutocastDefaults | None:
    """The innermost active autocast's defaults, or None outside any autocast."""
    stack = _stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def autocast(
    enabled: bool = True,
    recipe: Recipe | None = None,
    *,
    amax_reduction_axes: Any = UNSET,
) -> Iterator[AutocastDefaults]:
    """Make FP8 modules constructed inside this block default to ``recipe``.

    Args:
        enabled: False makes modules constructed inside default to high precision.
        recipe: DelayedScaling or Float8CurrentScaling; None means ``DelayedScaling()``.
        amax_reduction_axes: default mesh axes for the amax all-reduce under ``shard_map``
            (None = every axis the amax varies over); left out, a module keeps the axes its FP8
            state was created with (docs/jax.md, "Distribution").
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    frame = AutocastDefaults(
        enabled=enabled,
        recipe=check_recipe(DelayedScaling() if recipe is None else recipe),
        amax_reduction_axes=(
            UNSET if amax_reduction_axes is UNSET else _check_axes(amax_reduction_axes)
        ),
    )
    stack = _stack()
    stack.append(frame)
    try:
        with _JIT_KEY(frame):
            yield frame
    finally:
        stack.pop()


def resolve_defaults(recipe: Any, axes: Any) -> tuple[Any, Any]:
    """Fill UNSET ``recipe`` / ``axes`` from the innermost autocast (left UNSET outside one)."""
    frame = current_defaults()
    if frame is not None:
        if recipe is UNSET:
            recipe = frame.recipe if frame.enabled else None
        if axes is UNSET:
            axes = frame.amax_reduction_axes
    if recipe is not UNSET and recipe is not None:
        check_recipe(recipe)
    if axes is not UNSET:
        axes = _check_axes(axes)
    return recipe, axes

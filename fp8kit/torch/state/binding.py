"""Binding a recipe to FP8 state: the one place where a history gets the recipe's length.

A module is built with a default history length; the first call under a recipe (and
:func:`fp8kit.torch.init_fp8_state`, and an event for a member state bound otherwise) binds
the state to the recipe: the history is resized to ``recipe.amax_history_len`` (with a warning if
it held values, docs/semantics.md section 6) and the recipe is recorded for checkpoints.
"""

from __future__ import annotations

from fp8kit.recipe import DelayedScaling
from fp8kit.torch.state.buffers import FP8Meta, ScalingState

__all__ = ["bind_history_len", "bind_recipe", "bind_state_if_needed"]

# recipe.to_dict() of each recipe bound by a compiled call, made once (compared by identity).
_recipe_data: dict[DelayedScaling, dict[str, object]] = {}


def bind_history_len(state: ScalingState, recipe: DelayedScaling, why: str = "") -> None:
    """Give ``state`` ``recipe.amax_history_len`` history rows (no-op when it has them)."""
    length = recipe.amax_history_len
    if state.history_len != length:
        state.set_history_len(length, why or f"recipe amax_history_len={length}")


def bind_recipe(meta: FP8Meta, recipe: DelayedScaling, why: str = "") -> None:
    """Bind both states of ``meta`` to ``recipe``: history length and recorded recipe data."""
    data = recipe.to_dict()
    for state in (meta.forward, meta.backward):
        bind_history_len(state, recipe, why)
        state.recipe_data = data


def bind_state_if_needed(state: ScalingState, recipe: DelayedScaling) -> None:
    """Bind ``state`` to ``recipe`` unless it is bound already: the check of a compiled module
    call, whose graph cannot bind before it runs (docs/decisions/0233-torch-compile.md), and of
    an update event for its members (a state loaded with another length, or bound to another
    recipe by a call that did not train, since it last ran under the event's recipe).

    Costs an identity test and a shape read when nothing is to do.
    """
    data = _recipe_data.get(recipe)
    if data is None:
        data = _recipe_data[recipe] = recipe.to_dict()
    if state.recipe_data is data and state.history_len == recipe.amax_history_len:
        return
    bind_history_len(state, recipe)
    state.recipe_data = data

"""``f8.autocast``: where FP8 is on, and when delayed-scaling states are updated (SPEC 3, 8).

Forward states that ran (with grad enabled) inside the outermost enabled autocast are updated
together when it exits, if grad mode is on at that moment. Backward states are updated together
once per backward pass, from an autograd-engine callback that runs after the last backward node.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Recipe
from fp8kit.torch.state import ScalingState
from fp8kit.torch.update import update_states

__all__ = ["autocast", "current_recipe", "is_fp8_enabled"]


@dataclass
class _PendingUpdate:
    """States waiting for one update event under one (recipe, group)."""

    recipe: DelayedScaling
    group: Any
    states: dict[int, ScalingState] = field(default_factory=dict)

    def run(self, fmax: float) -> None:
        states = list(self.states.values())
        lengths = {s.history_len for s in states}
        if len(lengths) > 1:  # pragma: no cover - modules are resized before they record
            raise RuntimeError(f"fp8kit: states under one recipe have history lengths {lengths}")
        update_states(states, self.recipe, fmax, self.group)


def _add_pending(
    pending: dict[tuple[DelayedScaling, int], _PendingUpdate],
    state: ScalingState,
    recipe: DelayedScaling,
    group: Any,
) -> None:
    key = (recipe, id(group))
    entry = pending.get(key)
    if entry is None:
        entry = pending[key] = _PendingUpdate(recipe, group)
    entry.states.setdefault(id(state), state)


@dataclass
class _Frame:
    enabled: bool
    recipe: Recipe
    group: Any
    owns_updates: bool
    forward_pending: dict[tuple[DelayedScaling, int], _PendingUpdate] = field(default_factory=dict)


_local = threading.local()


def _stack() -> list[_Frame]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _active_frame() -> _Frame | None:
    stack = _stack()
    if stack and stack[-1].enabled:
        return stack[-1]
    return None


def is_fp8_enabled() -> bool:
    """Whether code running now is inside an enabled ``f8.autocast``."""
    return _active_frame() is not None


def current_recipe() -> Recipe | None:
    """The recipe of the innermost enabled autocast, or None outside FP8 regions."""
    frame = _active_frame()
    return frame.recipe if frame is not None else None


def current_group() -> Any:
    """The amax reduction group of the innermost enabled autocast (None = WORLD)."""
    frame = _active_frame()
    return frame.group if frame is not None else None


def register_forward_state(state: ScalingState, recipe: DelayedScaling, group: Any) -> None:
    """Queue ``state`` for the forward update at the exit of the outermost enabled autocast.

    Call it only for quantizations made with grad mode on (the module decides): under
    ``torch.no_grad()`` the staging row keeps accumulating and nothing rolls.
    """
    for frame in _stack():
        if frame.owns_updates:
            _add_pending(frame.forward_pending, state, recipe, group)
            return


class autocast(contextlib.ContextDecorator):
    """Run FP8-capable modules in FP8 inside this context.

    Args:
        enabled: False runs the modules in high precision (a nested ``enabled=False`` switches FP8
            off for its body).
        recipe: :class:`~fp8kit.recipe.DelayedScaling` (default ``DelayedScaling()``) or
            :class:`~fp8kit.recipe.Float8CurrentScaling`.
        amax_reduction_group: ``torch.distributed`` process group whose ranks share amaxes when
            ``recipe.reduce_amax`` is set (None = WORLD).

    At the exit of the outermost enabled autocast, if grad mode is on, the forward states of all
    modules that ran are updated in one batched operation per (recipe, group). If the body raises,
    no update runs: what was recorded stays staged and joins the next update event.
    """

    def __init__(
        self,
        enabled: bool = True,
        recipe: Recipe | None = None,
        amax_reduction_group: Any = None,
    ) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {enabled!r}")
        if recipe is None:
            recipe = DelayedScaling()
        if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
            raise TypeError(
                "recipe must be None, a fp8kit.recipe.DelayedScaling or a "
                f"fp8kit.recipe.Float8CurrentScaling, got {type(recipe).__name__}"
            )
        self.enabled = enabled
        self.recipe = recipe
        self.group = amax_reduction_group
        self._frames: list[_Frame] = []

    def __enter__(self) -> autocast:
        stack = _stack()
        owns = self.enabled and not any(f.owns_updates for f in stack)
        frame = _Frame(self.enabled, self.recipe, self.group, owns)
        stack.append(frame)
        self._frames.append(frame)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        frame = self._frames.pop()
        stack = _stack()
        if not stack or stack[-1] is not frame:
            raise RuntimeError("fp8kit.torch.autocast contexts were exited out of order")
        stack.pop()
        if frame.owns_updates and exc_type is None and torch.is_grad_enabled():
            for pending in frame.forward_pending.values():
                pending.run(pending.recipe.fp8_format.forward.max)


# ---------------------------------------------------------------------------------------------
# Backward updates: one per backward pass, after the last FP8 backward node has run.

_backward_lock = threading.Lock()
_backward_pending: dict[tuple[DelayedScaling, int], _PendingUpdate] = {}
_backward_callback_queued = False


def _flush_backward_updates() -> None:
    global _backward_callback_queued
    with _backward_lock:
        pending = list(_backward_pending.values())
        _backward_pending.clear()
        _backward_callback_queued = False
    for entry in pending:
        entry.run(entry.recipe.fp8_format.backward.max)


def schedule_backward_update(state: ScalingState, recipe: DelayedScaling, group: Any) -> None:
    """Queue ``state`` for the backward update that runs when this backward pass ends."""
    global _backward_callback_queued
    with _backward_lock:
        _add_pending(_backward_pending, state, recipe, group)
        if _backward_callback_queued:
            return
        _backward_callback_queued = True
    try:
        torch.autograd.Variable._execution_engine.queue_callback(_flush_backward_updates)
    except RuntimeError:
        # Not inside the autograd engine (a backward called by hand): update right away.
        _flush_backward_updates()

"""Update events: one batched update of many modules' scaling states (SPEC sections 3 and 5).

An event concatenates the histories of its states into one ``(L, N)`` buffer, runs the update
rule once on it and copies the results back with one ``_foreach_copy_`` per tensor kind: the
number of tensor ops does not depend on how many modules there are.

Which states take part:

* Without amax reduction (one process, ``reduce_amax=False``, or a one-rank group): the states
  that ran since the last event, in the order they first quantized.
* With amax reduction: every state ever registered under the event's (recipe, group, direction),
  kept in a persistent :class:`StateRegistry` in order of first registration (weak references, so
  dead modules drop out). States that did not run on this rank contribute staging 0; after the one
  MAX all-reduce the zero-skip rule rolls a state on every rank if any rank ran it and skips it on
  every rank if none did. All ranks therefore hold identical histories and scales.

The reduction buffer is ``[staging row (N) | changed flag, fingerprint, -fingerprint]``. Its size is
that of the last layout all ranks agreed on, so ranks never reduce buffers of different sizes. A
rank whose registry changed since then (a new module, a dead one) sends zeros with the flag set;
every rank sees the flag, compares layouts (:func:`~fp8kit.torch.distributed.check_layout`) and
reduces again over the new layout. The fingerprint pair (MAX of ``f`` and of ``-f``) detects ranks
reducing different layouts of equal size.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from fp8kit.recipe import DelayedScaling
from fp8kit.torch import distributed
from fp8kit.torch.distributed import Layout
from fp8kit.torch.scaling import update_scaling_state
from fp8kit.torch.state import ScalingState

__all__ = ["DIRECTIONS", "StateRegistry", "registry_for", "update_states"]

DIRECTIONS = ("forward", "backward")
_TRAILER = 3  # changed flag, fingerprint, -fingerprint


def update_states(
    states: Sequence[ScalingState],
    recipe: DelayedScaling,
    fmax: float,
    group: Any = None,
    *,
    direction: str = "forward",
) -> None:
    """Run one update event of ``direction`` under ``(recipe, group)``.

    Args:
        states: the states that ran since the last event (each recorded its amaxes into its
            staging row), in the order they first quantized.
        recipe: the delayed-scaling recipe they ran under.
        fmax: largest finite value of the format these states quantize into.
        group: ``torch.distributed`` group for the amax reduction (None = WORLD).
        direction: ``"forward"`` or ``"backward"``; with reduction, selects the registry.

    With amax reduction active (see :func:`~fp8kit.torch.distributed.reduction_active`) every rank
    of ``group`` must call this at the same event, even with no ``states``.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if distributed.reduction_active(recipe, group):
        registry_for(recipe, group, direction).run_event(states, fmax)
        return
    if not states:
        return
    lengths = {s.history_len for s in states}
    if len(lengths) > 1:
        raise RuntimeError(f"fp8kit: states under one recipe have history lengths {lengths}")
    with torch.no_grad():
        stacked = torch.cat([s.amax_history for s in states], dim=1)
        _update_stacked(states, stacked, recipe, fmax)


def _update_stacked(
    states: Sequence[ScalingState],
    stacked: torch.Tensor,
    recipe: DelayedScaling,
    fmax: float,
    kept_staging: torch.Tensor | None = None,
    histories: list[torch.Tensor] | None = None,
) -> None:
    """Apply the update rule to ``stacked`` and write the results back into ``states``.

    Args:
        states: the states ``stacked`` was concatenated from.
        stacked: float32 ``(L, N)``; row 0 is the event's staging row (after any reduction).
        kept_staging: float32 ``(N,)`` staging to leave in place where the event's staging is 0
            (a state's own leftover, e.g. from a ``no_grad`` forward, when it did not run).
        histories: ``[s.amax_history for s in states]`` if the caller has it already.
    """
    if histories is None:
        histories = [s.amax_history for s in states]
    scales = [s.scale for s in states]
    counts = [s.update_count for s in states]
    sizes = [s.num_slots for s in states]
    new_history, new_scale, new_count = update_scaling_state(
        stacked, torch.cat(scales), torch.cat(counts), recipe, fmax
    )
    if kept_staging is not None:
        new_history[0] = torch.where(stacked[0] == 0, kept_staging, new_history[0])
    new_inv = torch.reciprocal(new_scale)
    torch._foreach_copy_(histories, new_history.split(sizes, dim=1))
    torch._foreach_copy_(scales, new_scale.split(sizes))
    torch._foreach_copy_(counts, new_count.split(sizes))
    torch._foreach_copy_([s.scale_inv for s in states], new_inv.split(sizes))


# ---------------------------------------------------------------------------------------------
# Persistent registries (amax reduction on)

_lock = threading.Lock()
_registries: dict[tuple[DelayedScaling, int, str], StateRegistry] = {}
# Each state belongs to at most one registry: the (recipe, group) it last ran under.
_owner: weakref.WeakKeyDictionary[ScalingState, StateRegistry] = weakref.WeakKeyDictionary()


def registry_for(recipe: DelayedScaling, group: Any, direction: str) -> StateRegistry:
    """The persistent registry of ``(recipe, group, direction)`` (created on first use)."""
    key = (recipe, id(group), direction)
    with _lock:
        registry = _registries.get(key)
        if registry is None:
            registry = _registries[key] = StateRegistry(recipe, group, direction)
        return registry


class StateRegistry:
    """The states reduced together under one (recipe, group, direction), in a fixed order.

    States are appended when they first take part in an event and leave when they die (weak
    references) or move to another (recipe, group). Any such change sets a flag that makes the
    next event re-check the layout across ranks.
    """

    def __init__(self, recipe: DelayedScaling, group: Any, direction: str) -> None:
        self.recipe = recipe
        self.group = group  # held strongly: its id() is part of the registry key
        self.direction = direction
        self._refs: list[weakref.ref[ScalingState]] = []
        self._index: dict[int, weakref.ref[ScalingState]] = {}
        self._changed = True
        self._verified: Layout | None = None  # the layout every rank last agreed on
        self._verified_pg: Any = None  # the process group object it was agreed over

    def register(self, state: ScalingState) -> None:
        """Append ``state`` unless present; take it from the registry it belonged to before."""
        ref = self._index.get(id(state))
        if ref is not None and ref() is state:
            return
        previous = _owner.get(state)
        if previous is not None and previous is not self:
            previous.discard(state)
        ref = weakref.ref(state)
        self._refs.append(ref)
        self._index[id(state)] = ref
        _owner[state] = self
        self._changed = True

    def discard(self, state: ScalingState) -> None:
        """Remove ``state`` (it now runs under another recipe or group)."""
        ref = self._index.get(id(state))
        if ref is None or ref() is not state:
            return
        del self._index[id(state)]
        self._refs = [r for r in self._refs if r is not ref]
        self._changed = True

    def states(self) -> list[ScalingState]:
        """The live registered states in order (dropping dead ones, which marks a change)."""
        alive = []
        for ref in self._refs:
            state = ref()
            if state is not None:
                alive.append(state)
        if len(alive) != len(self._refs):
            self._refs = [ref for ref in self._refs if ref() is not None]
            self._index = {k: r for k, r in self._index.items() if r() is not None}
            self._changed = True
        return alive

    def _layout(self, states: Sequence[ScalingState]) -> Layout:
        return Layout.of(self.direction, self.recipe, [s.num_slots for s in states])

    def _verify(self, states: Sequence[ScalingState], device: torch.device, pg: Any) -> Layout:
        layout = self._layout(states)
        distributed.check_layout(
            layout, self.group, distributed.collective_device(self.group, device)
        )
        self._verified, self._verified_pg, self._changed = layout, pg, False
        return layout

    def _reduce(
        self, staging: torch.Tensor | None, layout: Layout, device: torch.device
    ) -> tuple[torch.Tensor, bool]:
        """One MAX all-reduce of a staging row laid out as ``layout``.

        Args:
            staging: float32 ``(layout.num_slots,)``, or None for a rank whose registry changed
                since ``layout`` was agreed: it sends zeros and the changed flag (the event is
                reduced again once the new layout is checked).

        Returns:
            The reduced staging row and whether any rank flagged a changed registry.
        """
        fp = float(layout.fingerprint)
        trailer = torch.tensor([1.0 if staging is None else 0.0, fp, -fp], device=device)
        if staging is None:
            buffer = torch.cat([torch.zeros(layout.num_slots, device=device), trailer])
        else:
            buffer = torch.cat([staging, trailer])
        distributed.all_reduce_max(buffer, self.group, self.direction)
        flag, high, neg_low = buffer[-_TRAILER:].tolist()
        if high != fp or -neg_low != fp:
            distributed.raise_event_mismatch(layout, self.group)
        return buffer[:-_TRAILER], flag > 0

    def run_event(self, ran: Sequence[ScalingState], fmax: float) -> None:
        """Register ``ran`` (the states that ran on this rank), reduce and update all states.

        Every rank of the group must call this at the same event.
        """
        for state in ran:
            self.register(state)
        states = self.states()
        length = self.recipe.amax_history_len
        histories = [s.amax_history for s in states]
        for i, history in enumerate(histories):
            if history.shape[0] != length:  # loaded with another L and not run since
                states[i].set_history_len(length, f"recipe amax_history_len={length}")
                histories[i] = states[i].amax_history
        if histories:
            device = histories[0].device
        else:  # nothing registered here: still take part (the layout check names this rank)
            device = distributed.collective_device(self.group, torch.device("cpu"))
        pg = distributed.resolve_group(self.group)
        with torch.no_grad():
            if histories:
                stacked = torch.cat(histories, dim=1)
            else:
                stacked = torch.zeros(length, 0, device=device)
            local = stacked[0]
            if len(ran) < len(states):  # the others contribute 0 (their own staging is kept)
                ran_ids = {id(s) for s in ran}
                ran_slots = [id(s) in ran_ids for s in states for _ in range(s.num_slots)]
                staging = torch.where(torch.tensor(ran_slots, device=device), local, 0.0)
            else:
                staging = local
            if self._verified is None or self._verified_pg is not pg:
                reduced, _ = self._reduce(staging, self._verify(states, device, pg), device)
            else:
                reduced, flagged = self._reduce(
                    None if self._changed else staging, self._verified, device
                )
                if flagged:
                    reduced, _ = self._reduce(staging, self._verify(states, device, pg), device)
            if not states:
                return
            kept = local.clone() if staging is not local else None
            stacked[0] = reduced
            _update_stacked(states, stacked, self.recipe, fmax, kept, histories)

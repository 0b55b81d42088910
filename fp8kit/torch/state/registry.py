"""Update events: one batched update of many modules' scaling states (docs/semantics.md
sections 3 and 5).

Every (recipe, group, direction, device, pool partition) has a persistent :class:`StateRegistry`
(the partition is 0 except for CUDA-graphed states, which keep a pool of their own): the states that
ever took part in its events, in order of first registration (weak references, so dead modules
drop out), stored side by side in one :class:`~fp8kit.torch.state.pool.StatePool` whose columns
the modules' buffers view. Membership is kept here (a state holds no pointer to its registry).
An event runs the update rule once on the whole pool: a fixed number of tensor ops
and no per-module gather or scatter, whatever the number of modules.

Which states an event rolls: those that ran since the last event. Registered states that did not
run contribute staging 0 and are skipped by the zero-skip rule; their own staging (e.g. from a
``no_grad`` forward) stays in place for a later event.

With amax reduction (``torch.distributed``, ``reduce_amax=True``, more than one rank) the event's
staging row is all-reduced with MAX first. After that, the zero-skip rule rolls a state on every
rank if any rank ran it and skips it on every rank if none did, so all ranks hold identical
histories and scales. The reduction buffer is ``[staging row (N) | padding | changed flag,
fingerprint, -fingerprint]``, the padding being ``N / 2`` zeros in a backward buffer (so forward
and backward buffers of the same modules have one length: ``Layout.padding``). Its size is that
of the last layout all ranks agreed on, so ranks never reduce buffers of different sizes. A rank
whose registry changed since then (a new module, a dead one) sends zeros with the flag set; every
rank sees the flag, compares layouts (:func:`~fp8kit.torch.distributed.check_layout`) and
reduces again over the new layout. The fingerprint pair (MAX of ``f`` and of ``-f``) detects
ranks reducing different layouts of equal size.
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
from fp8kit.torch.state.apply import NonfiniteWatch, apply_update, prepared_update
from fp8kit.torch.state.binding import bind_state_if_needed
from fp8kit.torch.state.buffers import ScalingState, buffer_generation
from fp8kit.torch.state.pool import StatePool

__all__ = [
    "CONCURRENT_EVENTS",
    "DIRECTIONS",
    "StateRegistry",
    "pool_states",
    "registry_for",
    "update_states",
]

DIRECTIONS = ("forward", "backward")
_TRAILER = 3  # changed flag, fingerprint, -fingerprint


def _weakly(obj: Any) -> Any:
    """A function of no arguments returning ``obj``: a weak reference where ``obj`` takes one
    (process groups do), else a strong one."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


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
        direction: ``"forward"`` or ``"backward"``.

    With amax reduction active (see :func:`~fp8kit.torch.distributed.reduction_active`) every rank
    of ``group`` must call this at the same event, even with no ``states``.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    key = (recipe, id(group), direction)
    ids = tuple(map(id, states))
    last = _last_events.get(key)
    if (
        last is not None
        and last[0] == ids
        and last[1] == buffer_generation()
        and last[2].epoch == last[3]
    ):
        # The same live states as last time (the registry's membership did not change, so no id
        # was reused), none moved or resized: one registry, every state already a member.
        last[2].run_event(states, fmax, registered=True)
        return
    by_place: dict[tuple[torch.device, int] | None, list[ScalingState]] = {}
    for state in states:
        by_place.setdefault((state.device, state.pool_partition), []).append(state)
    # Each device (and pool partition) has its own registry: a pool lives on one device. One
    # with a registry but no state this time still runs its event: with reduction it is a
    # collective.
    for place in _registry_places(recipe, group, direction):
        by_place.setdefault(place, [])
    if not by_place:
        by_place[None] = []  # nothing anywhere: still take part
    # One collective per place with reduction: every rank takes the places in the same order,
    # whichever of its modules ran first.
    plan = [
        (registry_for(recipe, group, direction, *(place or (None, 0))), by_place[place])
        for place in sorted(by_place, key=_place_order)
    ]
    for registry, ran in plan:
        registry.run_event(ran, fmax)
    if len(plan) == 1:  # the common case (one device) is the one worth a fast path
        _last_events[key] = (ids, buffer_generation(), plan[0][0], plan[0][0].epoch)
    else:
        _last_events.pop(key, None)


# ---------------------------------------------------------------------------------------------
# Persistent registries

_lock = threading.Lock()
# Per (recipe, group id, direction): the ids of the states of the last single-device event, the
# buffer generation after it, its registry and that registry's membership epoch, so a repeated
# event skips the grouping by device and the registration. Only ids are kept: no module is held.
_last_events: dict[
    tuple[DelayedScaling, int, str], tuple[tuple[int, ...], int, StateRegistry, int]
] = {}
# Which registry each state belongs to (a state joins at most one per direction, device).
_membership: weakref.WeakKeyDictionary[ScalingState, StateRegistry] = weakref.WeakKeyDictionary()
_registries: dict[
    tuple[DelayedScaling, int, str, tuple[torch.device, int] | None], StateRegistry
] = {}


def registry_for(
    recipe: DelayedScaling,
    group: Any,
    direction: str,
    device: torch.device | None = None,
    partition: int = 0,
) -> StateRegistry:
    """The persistent registry of ``(recipe, group, direction, device, partition)`` (created on
    first use).

    ``device`` None is the registry of a rank that has no state of this recipe on any device;
    ``partition`` is :attr:`ScalingState.pool_partition` of its members.
    """
    key = (recipe, id(group), direction, None if device is None else (device, partition))
    with _lock:
        registry = _registries.get(key)
        if registry is None:
            registry = _registries[key] = StateRegistry(recipe, group, direction, device, partition)
        return registry


def pool_states(
    states: Sequence[ScalingState], recipe: DelayedScaling, group: Any, direction: str
) -> None:
    """Make ``states`` members of their registries and lay out the pools now.

    An update event does this on its own; calling it first fixes the buffers' addresses before
    something keeps them (a CUDA graph capture), as long as membership does not change after.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    by_place: dict[tuple[torch.device, int], list[ScalingState]] = {}
    for state in states:
        by_place.setdefault((state.device, state.pool_partition), []).append(state)
    for (device, partition), members in by_place.items():
        registry = registry_for(recipe, group, direction, device, partition)
        for state in members:
            registry.register(state)
        registry._sync_pool()


def _place_order(place: tuple[torch.device, int] | None) -> tuple[str, int, int]:
    if place is None:
        return ("", -1, -1)
    device, partition = place
    return (device.type, -1 if device.index is None else device.index, partition)


def _registry_places(
    recipe: DelayedScaling, group: Any, direction: str
) -> list[tuple[torch.device, int]]:
    """(device, partition) pairs with a registry of ``(recipe, group, direction)`` holding
    states."""
    with _lock:
        return [
            key[3]
            for key, registry in _registries.items()
            if key[0] == recipe
            and key[1] == id(group)
            and key[2] == direction
            and key[3] is not None
            and registry.has_states()
        ]


CONCURRENT_EVENTS = (
    "fp8kit: two threads ran FP8 update events of the same (recipe, amax reduction group) at "
    "once. FP8 state updates are process-wide, so FP8 training on several threads of one "
    "process at once is not supported (it crashed, or silently gave other numbers than the same "
    "trainings run one after the other): train each model in its own process, or one at a time "
    '(docs/te_modules.md, "One training at a time per process")'
)


class StateRegistry:
    """The states updated (and reduced) together under one (recipe, group, direction, device).

    States are appended when they first take part in an event and leave when they die (weak
    references) or move to another (recipe, group, device). Any such change makes the next event
    rebuild the pool and, with reduction, re-check the layout across ranks. In the steady state an
    event costs O(1) Python work plus one dictionary look-up per state that ran.
    """

    def __init__(
        self,
        recipe: DelayedScaling,
        group: Any,
        direction: str,
        device: torch.device | None,
        partition: int = 0,
    ) -> None:
        self.recipe = recipe
        self.group = group  # held strongly: its id() is part of the registry key
        self.direction = direction
        self.device = device
        self.partition = partition
        self.epoch = 0  # bumped at every membership change (join, leave, death)
        self._refs: list[weakref.ref[ScalingState]] = []
        self._num_live = 0
        self._membership_changed = True  # the pool must be rebuilt
        self._changed = True  # the layout must be re-checked across ranks
        self._verified: Layout | None = None  # the layout every rank last agreed on
        # The process group it was agreed over, held weakly: a group kept alive past
        # destroy_process_group() is freed by gloo's threads at interpreter exit, which
        # aborted about one run in fifteen
        # (docs/decisions/0265-weak-process-group-and-distributed-audit.md).
        self._verified_pg: Any = None
        # The reduction trailers of the verified layout, by (changed flag, device).
        self._trailers: dict[tuple[bool, torch.device], torch.Tensor] = {}
        # The verified layout's reduction buffer by device, with its staging-row and trailer
        # views: the same tensors every event, so the update kernel is bound to the row once.
        self._buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.pool = StatePool()
        self._nonfinite = NonfiniteWatch()
        self._in_event = threading.Lock()  # held during an event: a second thread is refused

    def _on_death(self, _ref: weakref.ref[ScalingState]) -> None:
        self._num_live -= 1
        self._membership_changed = self._changed = True
        self.epoch += 1

    def register(self, state: ScalingState) -> None:
        """Append ``state`` unless present; take it from the registry it belonged to before."""
        previous = _membership.get(state)
        if previous is self:
            return
        if previous is not None:
            previous.discard(state)
        self._refs.append(weakref.ref(state, self._on_death))
        self._num_live += 1
        _membership[state] = self
        self._membership_changed = self._changed = True
        self.epoch += 1

    def discard(self, state: ScalingState) -> None:
        """Remove ``state`` (it now runs under another recipe or group)."""
        kept = [r for r in self._refs if r() is not state]
        if len(kept) != len(self._refs):
            self._refs = kept
            self._num_live -= 1
            _membership.pop(state, None)
            self._membership_changed = self._changed = True
            self.epoch += 1

    def has_states(self) -> bool:
        """Whether any live state is registered."""
        return self._num_live > 0

    def states(self) -> list[ScalingState]:
        """The live registered states in order (dropping references to dead ones)."""
        alive = [s for s in (ref() for ref in self._refs) if s is not None]
        if len(alive) != len(self._refs):
            self._refs = [ref for ref in self._refs if ref() is not None]
        return alive

    def _sync_pool(self) -> None:
        """Rebuild the pool if members changed or one of them replaced its buffers."""
        if not (self._membership_changed or self.pool.stale()):
            return
        states = self.states()
        moved = [s for s in states if s.device != self.device or s.pool_partition != self.partition]
        for state in moved:  # moved to another device since it ran here: it joins that registry
            self.discard(state)
        if moved:
            states = self.states()
        for state in states:
            # the module's own buffers back where functional_call left others (decision 0269)
            state.heal_or_refuse()
            # loaded with another L, or bound to another recipe, since it ran
            bind_state_if_needed(state, self.recipe)
        self.pool.sync(states)
        self._membership_changed = False

    def _layout(self, states: Sequence[ScalingState]) -> Layout:
        forward_slots = 0
        if self.direction == "backward":  # pad to the forward buffer (Layout.padding)
            place = None if self.device is None else (self.device, self.partition)
            forward = _registries.get((self.recipe, id(self.group), "forward", place))
            if forward is not None and forward._verified is not None:
                forward_slots = forward._verified.num_slots
        return Layout.of(self.direction, self.recipe, [s.num_slots for s in states], forward_slots)

    def _verify(self, states: Sequence[ScalingState], device: torch.device, pg: Any) -> Layout:
        layout = self._layout(states)
        distributed.check_layout(
            layout, self.group, distributed.collective_device(self.group, device)
        )
        self._verified, self._verified_pg, self._changed = layout, _weakly(pg), False
        self._trailers, self._buffers = {}, {}
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
            The reduced staging row (a view of the registry's reduction buffer for ``layout``,
            the same tensor at every event until the layout changes) and whether any rank
            flagged a changed registry.
        """
        trailer = self._trailer(layout, staging is None, device)
        buffer, row, reduced_trailer = self._buffer(layout, device)
        if staging is None:
            staging = torch.zeros(layout.num_slots, dtype=torch.float32, device=device)
        torch.cat([staging, trailer], out=buffer)
        distributed.all_reduce_max(buffer, self.group, self.direction)
        flag, high, neg_low = reduced_trailer.tolist()  # the event's one host read
        fp = float(layout.fingerprint)
        if high != fp or -neg_low != fp:
            distributed.raise_event_mismatch(layout, self.group)
        return row, flag > 0

    def _buffer(
        self, layout: Layout, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reduction buffer of ``layout`` on ``device`` (float32, staging row, padding and
        trailer), its staging-row view and its trailer view; made once per verified layout.

        An ordinary tensor even when the event runs under ``torch.inference_mode`` (a
        calibration pass): later training events write into it."""
        entry = self._buffers.get(device)
        size = layout.num_slots + layout.padding + _TRAILER
        if entry is None or entry[0].numel() != size:
            with torch.inference_mode(False):
                buffer = torch.empty(size, dtype=torch.float32, device=device)
            entry = (buffer, buffer[: layout.num_slots], buffer[-_TRAILER:])
            self._buffers[device] = entry
        return entry

    def _trailer(self, layout: Layout, changed: bool, device: torch.device) -> torch.Tensor:
        """``layout.padding`` zeros, then ``[changed flag, fingerprint, -fingerprint]`` of the
        verified layout, on ``device``; made once per layout (:meth:`_verify` forgets them).

        A tensor made from Python numbers at every event would be a copy from pageable host
        memory, which blocks the host on CUDA (docs/performance.md, "Host synchronisation")."""
        trailer = self._trailers.get((changed, device))
        if trailer is None:
            fp = float(layout.fingerprint)
            values = [0.0] * layout.padding + [1.0 if changed else 0.0, fp, -fp]
            trailer = torch.tensor(values, dtype=torch.float32, device=device)
            self._trailers[changed, device] = trailer
        return trailer

    def run_event(
        self, ran: Sequence[ScalingState], fmax: float, *, registered: bool = False
    ) -> None:
        """Register ``ran`` (the states that ran on this rank), reduce if needed, update all.

        ``registered``: the caller knows every state of ``ran`` is a member already.
        With reduction every rank of the group must call this at the same event.

        Raises:
            RuntimeError: another thread is running an event of this registry (FP8 training on
                several threads of one process at once, which the process-wide state does not
                support: the pool is rebuilt under the other thread's update).
        """
        if not self._in_event.acquire(blocking=False):
            raise RuntimeError(CONCURRENT_EVENTS)
        try:
            self._run_event(ran, fmax, registered)
        finally:
            self._in_event.release()

    def _run_event(self, ran: Sequence[ScalingState], fmax: float, registered: bool) -> None:
        """:meth:`run_event` while holding the event lock."""
        if not registered:
            for state in ran:
                self.register(state)
        reduce = distributed.reduction_active(self.recipe, self.group)
        if not ran and not reduce:  # nothing ran here and no collective to take part in
            return
        self._sync_pool()
        # The steady state: every member ran.
        if not reduce and len(ran) == self._num_live and self._prepared_event(fmax):
            return
        with torch.no_grad():
            mask = None
            if self._num_live:
                local = self.pool.history[0]
                if len(ran) < self._num_live:  # the others contribute 0; their staging is kept
                    mask = self.pool.slot_mask(ran)
            else:  # nothing registered here: still take part (the layout check names this rank)
                device = distributed.collective_device(self.group, torch.device("cpu"))
                local = torch.zeros(0, device=device)
            if reduce:
                staging = local if mask is None else torch.where(mask, local, 0.0)
                reduced = self._reduced(staging)
                if not self._num_live:
                    return
                if mask is None:
                    # Every member ran here, so the reduced row is at least the local one
                    # wherever that is not 0: taking it whole rolls exactly the slots that ran
                    # on some rank (the zero-skip rule skips the others), as the masked update.
                    # The bound kernel reads it where it is (and zeroes the rolled staging).
                    if self._prepared_event(fmax, reduced):
                        return
                    local.copy_(reduced)  # a callable algorithm reads the history's row 0
                else:
                    # A slot that ran on any rank rolls on every rank; one that ran nowhere
                    # keeps its own leftover staging.
                    mask = reduced != 0
                    local.copy_(torch.where(mask, reduced, local))
            apply_update(self.pool, self.recipe, fmax, mask)
            self._nonfinite.check(self.pool, self.states, self.direction, self.recipe)

    def _prepared_event(self, fmax: float, staging: torch.Tensor | None = None) -> bool:
        """Update every column with the pool's bound kernel (reading ``staging`` in place of
        the history's row 0 when given); False (nothing done) for callable algorithms, which
        take :func:`apply_update`."""
        update = prepared_update(self.pool, self.recipe, fmax, staging)
        if update is None:
            return False
        if update() != 0:  # an inf came in, or the count is unknown (None): look
            self._nonfinite.check(self.pool, self.states, self.direction, self.recipe)
        return True

    def _reduced(self, staging: torch.Tensor) -> torch.Tensor:
        """``staging`` all-reduced (MAX) over the group, checking layouts where they changed."""
        device = staging.device
        pg = distributed.resolve_group(self.group)
        if self._verified is None or self._verified_pg is None or self._verified_pg() is not pg:
            return self._reduce(staging, self._verify(self.states(), device, pg), device)[0]
        reduced, flagged = self._reduce(None if self._changed else staging, self._verified, device)
        if flagged:
            reduced, _ = self._reduce(staging, self._verify(self.states(), device, pg), device)
        return reduced

"""What an update event does to a pool of scaling states (docs/semantics.md sections 3, 9).

:func:`apply_update` runs the update rule in place over the columns of a
:class:`~fp8kit.torch.state.pool.StatePool` that take part in the event: one fused kernel for the
built-in algorithms, the torch rule of :mod:`fp8kit.torch.scaling` for callables (on the columns
that ran only); :func:`prepared_update` is the same
kernel with its arguments bound once, for the steady state. :class:`NonfiniteWatch` reports infinite
amaxes without a host synchronisation (docs/performance.md).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fp8kit.recipe import DelayedScaling
from fp8kit.slots import BwdSlot, FwdSlot
from fp8kit.torch.kernels import delayed_update_, prepare_delayed_update
from fp8kit.torch.scaling import update_scaling_state
from fp8kit.torch.state.buffers import ScalingState
from fp8kit.torch.state.pool import StatePool

__all__ = ["NonfiniteAmaxWarning", "NonfiniteWatch", "apply_update", "prepared_update"]


def prepared_update(
    pool: StatePool, recipe: DelayedScaling, fmax: float, staging: torch.Tensor | None = None
) -> Callable[[], int | None] | None:
    """``apply_update(pool, recipe, fmax, None)`` as a function of no arguments whose kernel
    arguments were checked and bound once (:func:`~fp8kit.torch.kernels.prepare_delayed_update`:
    it returns the number of +inf event values, or None where that is not known without a host
    sync), kept on the pool until its tensors are replaced; None for callable algorithms (their
    rule runs in torch). The steady-state event of a registry whose states all ran
    (docs/performance.md).

    ``staging``: a float32 ``(N,)`` row the event reads instead of the history's row 0 (the
    reduction buffer of a multi-rank event, which the registry keeps from event to event; a
    different tensor prepares the call again)."""
    key = ("update", recipe, fmax, staging is not None)
    prepared = pool.derived.get(key)
    if prepared is not None and prepared[0] is staging:  # type: ignore[index]
        return prepared[1]  # type: ignore[index, no-any-return]
    if not _builtin(recipe):
        return None
    tensors, rule = _kernel_args(pool, recipe, fmax)
    update = prepare_delayed_update(*tensors, staging=staging, **rule)
    pool.derived[key] = (staging, update)
    return update


def _builtin(recipe: DelayedScaling) -> bool:
    """Whether the recipe's update rule is the fused kernel's (no callable algorithm)."""
    return isinstance(recipe.amax_compute_algo, str) and recipe.scaling_factor_compute_algo is None


def _kernel_args(
    pool: StatePool, recipe: DelayedScaling, fmax: float
) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    """The update kernel's tensors (history, scale, scale_inv, count) and rule keywords
    (including the pool's non-finite counter) for ``pool`` under ``recipe``."""
    tensors = (pool.history, pool.scale, pool.scale_inv, pool.update_count)
    rule = {
        "fmax": fmax,
        "margin": recipe.margin,
        "interval": recipe.interval,
        "algo": recipe.amax_compute_algo,
        "power_2_scale": recipe.power_2_scale,
        "nonfinite_count": pool.nonfinite_count,
    }
    return tensors, rule


def apply_update(
    pool: StatePool, recipe: DelayedScaling, fmax: float, ran: torch.Tensor | None
) -> None:
    """Run the update rule on the whole pool, in place, with no host synchronisation, except
    for a callable algorithm with a ``ran`` mask that came out of an all-reduce (its columns are
    read with ``nonzero``: :meth:`StatePool.columns_of`).

    Args:
        pool: the pool; its history row 0 holds this event's staging row (after any reduction).
        recipe: the recipe; built-in algorithms run in one fused kernel
            (``delayed_update_``), callables through the torch rule of :mod:`fp8kit.torch.scaling`.
        fmax: largest finite value of the pool's format.
        ran: None when every column takes part in the event, else a boolean ``(N,)`` device mask;
            False columns are skipped and keep their staging value (e.g. a ``no_grad`` leftover).
    """
    if _builtin(recipe):
        tensors, rule = _kernel_args(pool, recipe, fmax)
        delayed_update_(*tensors, ran=ran, **rule)
        return
    if ran is None:
        _rule_update(pool, recipe, fmax, slice(None))
    else:  # the callable sees the columns that ran, and only those (SPEC section 3)
        _rule_update(pool, recipe, fmax, pool.columns_of(ran))


def _rule_update(
    pool: StatePool, recipe: DelayedScaling, fmax: float, columns: slice | torch.Tensor
) -> None:
    """The torch rule of :mod:`fp8kit.torch.scaling` on the pool's ``columns`` (a slice, or int64
    indices), in place; the other columns are left as they are."""
    history = pool.history[:, columns]
    pool.nonfinite_count[columns] += torch.isinf(history[0])
    new_history, new_scale, new_count = update_scaling_state(
        history, pool.scale[columns], pool.update_count[columns], recipe, fmax
    )
    pool.history[:, columns] = new_history
    pool.scale[columns] = new_scale
    pool.update_count[columns] = new_count
    pool.scale_inv[columns] = torch.reciprocal(new_scale)


GPU_CHECK_INTERVAL = 8
"""On CUDA, :class:`NonfiniteWatch` looks at the counts at every this many events: each look
is host work (an event query, an asynchronous copy, a comparison) of the order of a kernel
launch, too much for every event of a small model's step."""


class NonfiniteWatch:
    """Warns once per state when an infinite amax entered its history, without a host sync.

    On the CPU the counts are read in place after each event. On CUDA every
    :data:`GPU_CHECK_INTERVAL`-th event copies the pool's ``nonfinite_count`` to the host
    asynchronously (one pinned buffer and one event, reused), and a later check reads that copy
    once it has arrived (a copy taken before the pool was rebuilt is read against the columns it
    was taken from). So on CUDA the warning usually comes within about two intervals of events,
    later when the GPU runs more than an interval behind the host; it never waits for the GPU,
    and the other events cost a few attribute tests. The counts themselves are exact on the
    device at every event (docs/performance.md, "No host synchronisation").
    """

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None  # the counts' copy in flight, None when none is
        self._copied: torch.Tensor | None = None  # the count tensor that copy was taken from
        # that tensor's states in column order (weak) with their slot counts: a copy read after
        # the pool was rebuilt is reported against them
        self._copied_members: list[tuple[weakref.ref[ScalingState], int]] = []
        self._pinned: torch.Tensor | None = None  # CUDA: the pinned buffer the copies land in
        self._ready: Any = None  # CUDA event recorded after the copy (reused)
        self._seen = np.zeros(0, dtype=np.int64)  # counts already reported, per pool column
        # The pool's count tensor those columns describe: a rebuilt pool (members joined or
        # left) has new columns, so what was seen is forgotten (the once-per-state record in
        # _warned keeps a state from warning twice).
        self._tracked: torch.Tensor | None = None
        self._events_since_check = 0  # CUDA: events since the last look at the copy

    def check(
        self,
        pool: StatePool,
        members: Callable[[], Sequence[ScalingState]],
        direction: str,
        recipe: DelayedScaling,
    ) -> None:
        """Look at ``pool``'s counts after an event (see the class doc).

        ``members()`` lists the pool's states in column order (called to name a state, and on
        CUDA at each copy, which keeps them with the copy).
        """
        counts = pool.nonfinite_count
        if counts is not self._tracked:
            self._tracked = counts
            self._seen = np.zeros(counts.shape, dtype=np.int64)
        if counts.device.type == "cpu":
            values = counts.numpy()
            if self._report(values, self._seen, _with_slots(members), direction, recipe):
                self._seen = values.copy()
            return
        if counts.device.type != "cuda":
            return
        self._events_since_check += 1
        if self._events_since_check < GPU_CHECK_INTERVAL:
            return
        self._events_since_check = 0
        if self._host is not None and self._ready.query():
            values = self._host.numpy()
            copied = [(ref(), n) for ref, n in self._copied_members]
            if self._copied is counts:
                if self._report(values, self._seen, lambda: copied, direction, recipe):
                    self._seen = values.copy()
            else:  # taken before the pool was rebuilt: against its own columns, all unseen
                self._report(values, np.zeros_like(values), lambda: copied, direction, recipe)
            self._host = self._copied = None
        if self._host is None:
            # One pinned buffer and one event, reused: the copy is asynchronous on the counts'
            # device's current stream, and no copy starts before the last one has arrived. An
            # ordinary tensor even under torch.inference_mode (a calibration pass's event).
            if self._pinned is None or self._pinned.shape != counts.shape:
                with torch.inference_mode(False):
                    self._pinned = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
                self._ready = torch.cuda.Event()
            self._host, self._copied = self._pinned, counts
            self._copied_members = [(weakref.ref(m), m.num_slots) for m in members()]
            self._host.copy_(counts, non_blocking=True)
            self._ready.record(torch.cuda.current_stream(counts.device))

    @staticmethod
    def _report(
        values: np.ndarray,
        seen: np.ndarray,
        members: Callable[[], Sequence[tuple[ScalingState | None, int]]],
        direction: str,
        recipe: DelayedScaling,
    ) -> bool:
        """Warn for each state (``members()``: states in column order, None for a dead one, with
        their slot counts) whose counts in ``values`` grew past ``seen``; whether any grew."""
        if seen.shape != values.shape:
            seen = np.zeros_like(values)
        if not (values > seen).any():
            return False
        names = FwdSlot if direction == "forward" else BwdSlot
        offset = 0
        for state, num_slots in members():
            grew = np.nonzero(
                values[offset : offset + num_slots] > seen[offset : offset + num_slots]
            )[0]
            offset += num_slots
            if state is not None and grew.size and state not in _warned:
                _warned.add(state)
                slots = ", ".join(names(int(i) % len(names)).name for i in grew)
                warnings.warn(
                    f"fp8kit: an infinite amax entered the {direction} amax history of "
                    f"{state.label or 'an FP8 module'} (slot {slots}); as in Transformer Engine "
                    f"that slot keeps its scale while the value is in the window (up to "
                    f"amax_history_len={recipe.amax_history_len} update events). "
                    "fp8_meta.<direction>.nonfinite_count counts such events per slot; the "
                    "Inspector reports them. Warned once per module and direction (this "
                    f"state's uid: {state.uid}; f8.label_fp8_modules(model) names modules by "
                    "their path).",
                    NonfiniteAmaxWarning,
                    stacklevel=2,
                )
        return True


def _with_slots(
    members: Callable[[], Sequence[ScalingState]],
) -> Callable[[], list[tuple[ScalingState | None, int]]]:
    return lambda: [(state, state.num_slots) for state in members()]


class NonfiniteAmaxWarning(UserWarning):
    """An inf amax reached an FP8 slot's history (its scale is frozen while it is there)."""


_warned: weakref.WeakSet[ScalingState] = weakref.WeakSet()

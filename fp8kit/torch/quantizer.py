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
from fp8kit.recipe import Recipe
from fp8kit.slots import FwdSlot, fwd_slot
from fp8kit.torch.autocast import (
    enrol,
    event_of,
    register_forward_state,
    schedule_backward_update,
)
from fp8kit.torch.kernels import cast_fp8, cast_fp8_current
from fp8kit.torch.plan import RecipePlan, plan_for
from fp8kit.torch.quantization import Float8Tensor, nan_ignoring_amax
from fp8kit.torch.state import FP8Meta, ScalingState, bind_state_if_needed
from fp8kit.torch.state.buffers import state_by_uid

__all__ = ["FP8Run", "quantize_slot"]

# Numerics observer (fp8kit.torch.inspect): None unless an Inspector is attached, so the cost of
# the hook when off is one ``is not None`` test per cast. Called as
# ``_observer(x, q, recipe, state, slot, fmt)`` right after every slot cast.
_observer: Callable[..., None] | None = None


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
    views = state.slot_views(slot) if plan.delayed else None
    return _cast_into(x, plan, state, slot, views, backward, record, transpose, dbias)


def _cast_into(
    x: torch.Tensor,
    plan: RecipePlan,
    state: ScalingState,
    slot: int,
    views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    backward: bool,
    record: bool,
    transpose: bool,
    dbias: bool,
) -> tuple[Float8Tensor, torch.Tensor | None]:
    """:func:`quantize_slot` with the slot's ``(scale, staging entry, update count)`` one-element
    views given (None under current scaling): eager calls view the state's buffers, the compiled
    op the buffers its graph passes in."""
    if backward:
        dtype, fmt = plan.backward_dtype, plan.backward_format
    else:
        dtype, fmt = plan.forward_dtype, plan.forward_format
    observer = _observer
    if views is None:
        r = cast_fp8_current(
            x, dtype, power_2_scale=plan.power_2_scale, transpose=transpose, dbias=dbias
        )
    else:
        scale, staging, count = views
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
            staging.clamp_(min=r.amax)  # type: ignore[arg-type]
    q = Float8Tensor(r.data, r.scale_inv, r.amax, r.data_t)
    if observer is not None:
        observer(x, q, plan.recipe, state, slot, fmt)
    return q, r.dbias


# ---------------------------------------------------------------------------------------------
# The same cast as one torch.library op, for torch.compile (docs/decisions/0233-torch-compile.md)
# A traced graph runs no Python of ours, so the op carries what the eager call does around the
# kernel: which state and event it records for (integer keys), and the enrolment in that event.


# cudagraph_unsafe: the enrolment is host work that a CUDA graph replay would skip, so Inductor
# keeps this op out of its CUDA graphs (mode="reduce-overhead" graphs the rest around it).
_OP_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("fp8kit::quantize_slot", mutates_args=("amax_history",), tags=_OP_TAGS)
def _quantize_slot_op(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax_history: torch.Tensor,
    update_count: torch.Tensor,
    forward_uid: int,
    backward_uid: int,
    event_key: int,
    slot: int,
    backward: bool,
    record: bool,
    transpose: bool,
    dbias: bool,
    enrol_state: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_slot` for the module whose states have uids ``forward_uid`` /
    ``backward_uid`` (``backward`` picks one), binding both to the recipe first if needed, then
    enrolling the state in its next update event when ``enrol_state``.

    ``scale`` (n,), ``amax_history`` (L, n) and ``update_count`` (n,) are the state's buffers as
    the graph holds them; the staging entry ``amax_history[0, slot]`` is updated in place.
    Returns ``(data, data_t, scale_inv, dbias)``, with 0-element tensors for outputs not asked.
    """
    plan = plan_for(event_of(event_key)[0])
    state = state_by_uid(backward_uid if backward else forward_uid)
    views = None
    if plan.delayed:
        for uid in (forward_uid, backward_uid):
            bind_state_if_needed(state_by_uid(uid), plan.recipe)  # type: ignore[arg-type]
        if amax_history.shape != state.amax_history.shape:
            # Bound just now: the graph passed the history it read before the resize.
            amax_history = state.amax_history
        views = (
            scale[slot : slot + 1],
            amax_history[0, slot : slot + 1],
            update_count[slot : slot + 1],
        )
    q, db = _cast_into(x, plan, state, slot, views, backward, record, transpose, dbias)
    if enrol_state:
        enrol(state, event_key, backward)
    data_t = q.data_t if q.data_t is not None else x.new_empty(0, dtype=q.data.dtype)
    return q.data, data_t, q.scale_inv, db if db is not None else x.new_empty(0)


@_quantize_slot_op.register_fake
def _(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax_history: torch.Tensor,
    update_count: torch.Tensor,
    forward_uid: int,
    backward_uid: int,
    event_key: int,
    slot: int,
    backward: bool,
    record: bool,
    transpose: bool,
    dbias: bool,
    enrol_state: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = plan_for(event_of(event_key)[0])
    dtype = plan.backward_dtype if backward else plan.forward_dtype
    data = x.new_empty(x.shape, dtype=dtype)
    data_t = x.new_empty((x.shape[1], x.shape[0]) if transpose else (0,), dtype=dtype)
    db = x.new_empty(x.shape[1] if dbias else 0)
    return data, data_t, scale.new_empty(()), db


@torch.library.custom_op("fp8kit::record_slot", mutates_args=("amax_history",), tags=_OP_TAGS)
def _record_slot_op(
    x: torch.Tensor,
    amax_history: torch.Tensor,
    forward_uid: int,
    backward_uid: int,
    event_key: int,
    slot: int,
    enrol_state: bool,
) -> None:
    """:meth:`FP8Run.record_forward` in a compiled graph: bind (as :func:`_quantize_slot_op`),
    fold ``max |x|`` (NaN ignored) into ``amax_history[0, slot]``, enrol when ``enrol_state``."""
    recipe = event_of(event_key)[0]
    state = state_by_uid(forward_uid)
    for uid in (forward_uid, backward_uid):
        bind_state_if_needed(state_by_uid(uid), recipe)  # type: ignore[arg-type]
    if amax_history.shape != state.amax_history.shape:
        amax_history = state.amax_history
    amax_history[0, slot : slot + 1].clamp_(min=nan_ignoring_amax(x))
    if enrol_state:
        enrol(state, event_key, False)


@_record_slot_op.register_fake
def _(
    x: torch.Tensor,
    amax_history: torch.Tensor,
    forward_uid: int,
    backward_uid: int,
    event_key: int,
    slot: int,
    enrol_state: bool,
) -> None:
    return None


def _quantize_traced(
    run: FP8Run,
    x: torch.Tensor,
    slot: int,
    backward: bool,
    record: bool,
    transpose: bool,
    dbias: bool,
    enrol_state: bool,
) -> tuple[Float8Tensor, torch.Tensor | None]:
    """The cast of a compiled module call: one :func:`_quantize_slot_op` node in the graph."""
    meta = run.meta
    state = meta.backward if backward else meta.forward
    data, data_t, scale_inv, db = torch.ops.fp8kit.quantize_slot(
        x,
        state.scale,
        state.amax_history,
        state.update_count,
        meta.forward.uid,
        meta.backward.uid,
        run.event_key,
        slot,
        backward,
        record,
        transpose,
        dbias,
        enrol_state,
    )
    q = Float8Tensor(data, scale_inv, None, data_t if transpose else None)
    return q, db if dbias else None


@dataclass
class FP8Run:
    """Everything one FP8 forward call of a module needs: recipe plan, group and the module's meta.

    ``training``: grad mode (or calibration) at the module call: forward states roll only then.
    ``fp8``: False in a calibration-only region: GEMMs run in high precision and the module only
    records amaxes (:meth:`record_forward`).
    ``event_key``: the autocast's integer key of ``(recipe, group)`` (the compiled op's handle).
    """

    plan: RecipePlan
    group: Any
    meta: FP8Meta
    training: bool
    fp8: bool = True
    event_key: int = 0

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
        enrol_state = record and self.plan.delayed and self.training
        state = self.meta.forward
        if torch.compiler.is_compiling():
            return _quantize_traced(self, x, slot, False, record, transpose, False, enrol_state)[0]
        q, _ = quantize_slot(x, self.plan, state, slot, False, record, transpose)
        if enrol_state:
            register_forward_state(state, self.plan.recipe, self.group)  # type: ignore[arg-type]
        return q

    def record_forward(self, x: torch.Tensor, slot: int) -> None:
        """Fold ``max |x|`` (NaN ignored) into forward ``slot``'s staging entry, no cast."""
        meta, enrol_state = self.meta, self.plan.delayed and self.training
        if torch.compiler.is_compiling():
            torch.ops.fp8kit.record_slot(
                x.detach(),
                meta.forward.amax_history,
                meta.forward.uid,
                meta.backward.uid,
                self.event_key,
                slot,
                enrol_state,
            )
            return
        meta.forward.record_amax(slot, nan_ignoring_amax(x.detach()))
        if enrol_state:
            register_forward_state(meta.forward, self.plan.recipe, self.group)  # type: ignore[arg-type]

    def quantize_backward(
        self, x: torch.Tensor, slot: int, transpose: bool = False, dbias: bool = False
    ) -> tuple[Float8Tensor, torch.Tensor | None]:
        """Quantize a gradient into backward ``slot``; returns ``(q, dbias or None)``."""
        state = self.meta.backward
        if torch.compiler.is_compiling():
            return _quantize_traced(self, x, slot, True, True, transpose, dbias, self.plan.delayed)
        out = quantize_slot(x, self.plan, state, slot, True, True, transpose, dbias)
        if self.plan.delayed:
            schedule_backward_update(state, self.plan.recipe, self.group)  # type: ignore[arg-type]
        return out

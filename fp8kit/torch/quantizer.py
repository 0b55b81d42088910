"""One FP8 module call under the active recipe: :class:`FP8Run` quantizes into the module's slots
and enrols its states in their update events (docs/semantics.md section 3).

Eager calls run the kernels directly (:mod:`fp8kit.torch.slot_cast`); a call traced by
``torch.compile`` runs them through custom ops (:mod:`fp8kit.torch.slot_ops`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fp8kit.formats import FP8Format
from fp8kit.recipe import Recipe
from fp8kit.slots import FwdSlot, fwd_slot
from fp8kit.torch.autocast import register_forward_state, schedule_backward_update
from fp8kit.torch.plan import RecipePlan
from fp8kit.torch.quantization import Float8Tensor, nan_ignoring_amax
from fp8kit.torch.recompute import Replay, captures, note_cast
from fp8kit.torch.slot_cast import quantize_slot
from fp8kit.torch.slot_ops import quantize_traced, record_traced
from fp8kit.torch.state import FP8Meta, ScalingState

__all__ = ["FP8Run", "quantize_slot"]


@dataclass
class FP8Run:
    """Everything one FP8 forward call of a module needs: recipe plan, group and the module's meta.

    ``fp8``: False in a calibration-only region: GEMMs run in high precision and the module only
    records amaxes (:meth:`record_forward`).
    ``event_key``: the autocast's integer key of ``(recipe, group)`` (the compiled op's handle).
    ``forward_states``: the autocast's :attr:`~fp8kit.torch.autocast.FP8Settings.forward_states`
    (where forward enrolments go; None: look the queue up at each enrolment).
    ``replay``: set while an activation checkpoint recomputes: forward casts read the forward's
    scales from it, and nothing is recorded or enrolled (:mod:`fp8kit.torch.recompute`).
    ``binds``: in a traced call, whether its forward casts bind the module's states to the
    recipe: only a call that can update (grad on or calibrating at the module call, decided
    before the autograd Function's forward turns grad off), as eager's ``prepare_run``.
    """

    plan: RecipePlan
    group: Any
    meta: FP8Meta
    fp8: bool = True
    event_key: int = 0
    forward_states: dict[int, ScalingState] | None = None
    replay: Replay | None = None
    binds: bool = True

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

    def quantize_forward(self, x: torch.Tensor, slot: int, transpose: bool = False) -> Float8Tensor:
        """Quantize an activation or weight into forward ``slot`` (see :func:`quantize_slot`)."""
        state = self.meta.forward
        if self.replay is not None:
            return self.replay.quantize(x, self.plan, state, slot, transpose)
        # whatever the grad mode here: the autocast's exit decides (docs/semantics.md section 3)
        enrol_state = self.plan.delayed
        if torch.compiler.is_compiling():
            return quantize_traced(
                self.meta,
                self.event_key,
                x,
                slot,
                False,
                transpose,
                False,
                enrol_state,
                self.binds,
            )[0]
        if captures and self.plan.delayed:  # inside an activation_checkpoint's forward
            note_cast(state, self.plan.first_step_current)
        q, _ = quantize_slot(x, self.plan, state, slot, False, transpose)
        if enrol_state:
            register_forward_state(state, self.plan.recipe, self.group, self.forward_states)  # type: ignore[arg-type]
        return q

    def record_forward(self, x: torch.Tensor, slot: int) -> None:
        """Fold ``max |x|`` (NaN ignored) into forward ``slot``'s staging entry, no cast."""
        if self.replay is not None:  # a recomputation records nothing
            return
        meta, enrol_state = self.meta, self.plan.delayed
        if torch.compiler.is_compiling():
            record_traced(meta, self.event_key, x.detach(), slot, enrol_state)
            return
        meta.forward.record_amax(slot, nan_ignoring_amax(x.detach()))
        if enrol_state:
            register_forward_state(meta.forward, self.plan.recipe, self.group, self.forward_states)  # type: ignore[arg-type]

    def quantize_backward(
        self, x: torch.Tensor, slot: int, transpose: bool = False, dbias: bool = False
    ) -> tuple[Float8Tensor, torch.Tensor | None]:
        """Quantize a gradient into backward ``slot``; returns ``(q, dbias or None)``."""
        state = self.meta.backward
        if torch.compiler.is_compiling():
            return quantize_traced(
                self.meta,
                self.event_key,
                x,
                slot,
                True,
                transpose,
                dbias,
                self.plan.delayed,
                True,  # a backward cast trains by definition
            )
        out = quantize_slot(x, self.plan, state, slot, True, transpose, dbias)
        if self.plan.delayed:
            schedule_backward_update(state, self.plan.recipe, self.group)  # type: ignore[arg-type]
        return out

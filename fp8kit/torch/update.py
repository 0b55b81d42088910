"""Batched update of many modules' scaling states at one update event (SPEC sections 3 and 5).

All states that ran under one (recipe, group) are concatenated into one ``(L, N)`` buffer, their
staging rows are optionally all-reduced with MAX in one collective, the update rule runs once on
the whole buffer, and the results are copied back with one ``_foreach_copy_`` per tensor kind. The
number of tensor ops does not depend on how many modules there are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fp8kit.recipe import DelayedScaling
from fp8kit.torch import distributed
from fp8kit.torch.scaling import update_scaling_state
from fp8kit.torch.state import ScalingState

__all__ = ["reduce_staging", "update_states"]


def reduce_staging(staging: torch.Tensor, group: Any, slot_counts: list[int]) -> None:
    """All-reduce (MAX) the staging row in place over ``group`` when that means anything.

    ``slot_counts`` is the layout (slots per state, in order) the row was concatenated from.
    """
    distributed.all_reduce_amax(staging, group, slot_counts)


def update_states(
    states: Sequence[ScalingState],
    recipe: DelayedScaling,
    fmax: float,
    group: Any = None,
) -> None:
    """Run one update event for ``states`` (all of one direction, same history length and device).

    Args:
        states: the scaling states to update (in a fixed order: every rank must pass the same).
        recipe: the delayed-scaling recipe they ran under.
        fmax: largest finite value of the format these states quantize into.
        group: ``torch.distributed`` group for the amax reduction (None = WORLD), used only when
            ``recipe.reduce_amax`` is set and the group has more than one rank.
    """
    if not states:
        return
    histories = [s.amax_history for s in states]
    scales = [s.scale for s in states]
    counts = [s.update_count for s in states]
    sizes = [s.num_slots for s in states]
    with torch.no_grad():
        stacked = torch.cat(histories, dim=1)
        if recipe.reduce_amax:
            reduce_staging(stacked[0], group, sizes)
        new_history, new_scale, new_count = update_scaling_state(
            stacked, torch.cat(scales), torch.cat(counts), recipe, fmax
        )
        new_inv = torch.reciprocal(new_scale)
        torch._foreach_copy_(histories, new_history.split(sizes, dim=1))
        torch._foreach_copy_(scales, new_scale.split(sizes))
        torch._foreach_copy_(counts, new_count.split(sizes))
        torch._foreach_copy_([s.scale_inv for s in states], new_inv.split(sizes))

"""Amax reduction over ``torch.distributed`` (SPEC section 5)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["all_reduce_amax", "group_size"]


def group_size(group: Any) -> int:
    """Number of ranks in ``group`` (None = WORLD); 1 when torch.distributed is not initialised."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def all_reduce_amax(staging: torch.Tensor, group: Any, slot_counts: list[int]) -> None:
    """All-reduce ``staging`` (a contiguous float32 row) with MAX, in place, if ranks > 1.

    ``slot_counts``: slots per state in the order they were concatenated (the layout).
    """
    if group_size(group) > 1:
        torch.distributed.all_reduce(staging, op=torch.distributed.ReduceOp.MAX, group=group)

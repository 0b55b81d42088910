"""Where each tensor's scaling state lives: the slot layout shared by every frontend
(docs/semantics.md section 3).

A module with ``g`` GEMMs has a forward state of ``3 * g`` slots and a backward state of
``2 * g`` slots; GEMM ``k`` uses forward slots ``3k + FwdSlot`` and backward slots ``2k + BwdSlot``.
"""

from __future__ import annotations

import enum

__all__ = ["BwdSlot", "FwdSlot", "bwd_slot", "fwd_slot"]


class FwdSlot(enum.IntEnum):
    """Forward slot of GEMM ``g`` is ``3 * g + slot``."""

    INPUT = 0
    WEIGHT = 1
    OUTPUT = 2


class BwdSlot(enum.IntEnum):
    """Backward slot of GEMM ``g`` is ``2 * g + slot``."""

    GRAD_OUTPUT = 0
    GRAD_INPUT = 1


def fwd_slot(gemm: int, slot: FwdSlot) -> int:
    """Index of forward ``slot`` of GEMM ``gemm`` in a module's forward state."""
    return 3 * gemm + int(slot)


def bwd_slot(gemm: int, slot: BwdSlot) -> int:
    """Index of backward ``slot`` of GEMM ``gemm`` in a module's backward state."""
    return 2 * gemm + int(slot)

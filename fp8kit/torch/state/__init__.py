"""FP8 scaling state and its whole lifetime (docs/semantics.md sections 3, 5, 6).

- :mod:`.buffers`: :class:`ScalingState` / :class:`FP8Meta`, plain buffers in ``state_dict``.
- :mod:`.binding`: a recipe bound to a state (the history length is set there only).
- :mod:`.pool`: the contiguous storage of all states of one registry.
- :mod:`.apply`: what an update event does to a pool (fused kernel, non-finite watch).
- :mod:`.registry`: the persistent registries and the update event entry :func:`update_states`.

:mod:`fp8kit.torch.autocast` decides *when* events run; :mod:`fp8kit.torch.distributed` only
communicates.
"""

from fp8kit.torch.state.apply import NonfiniteAmaxWarning
from fp8kit.torch.state.binding import bind_history_len, bind_recipe, bind_state_if_needed
from fp8kit.torch.state.buffers import (
    DEFAULT_HISTORY_LEN,
    BwdSlot,
    FP8Meta,
    FwdSlot,
    ScalingState,
    buffer_generation,
    bwd_slot,
    fwd_slot,
    mark_owner_weights_kept,
    resize_history,
)
from fp8kit.torch.state.registry import (
    DIRECTIONS,
    StateRegistry,
    pool_states,
    registry_for,
    update_states,
)

__all__ = [
    "DEFAULT_HISTORY_LEN",
    "DIRECTIONS",
    "BwdSlot",
    "FP8Meta",
    "FwdSlot",
    "NonfiniteAmaxWarning",
    "ScalingState",
    "StateRegistry",
    "bind_history_len",
    "bind_recipe",
    "bind_state_if_needed",
    "buffer_generation",
    "bwd_slot",
    "fwd_slot",
    "mark_owner_weights_kept",
    "pool_states",
    "registry_for",
    "resize_history",
    "update_states",
]

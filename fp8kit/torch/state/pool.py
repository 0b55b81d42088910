"""Contiguous storage for the scaling states of one registry (docs/design.md principle 2).

A :class:`StatePool` holds ``history (L, N)``, ``scale (N,)``, ``scale_inv (N,)``,
``update_count (N,)`` and ``nonfinite_count (N,)`` for all its member states side by side;
each member's buffers are views of its columns. An update event then runs a fixed number of
tensor ops on the pool, with no per-module gather or scatter. A member whose buffers stop being
those views (moved to another device, loaded with another history length, resized) is noticed at
the next event (through :func:`~fp8kit.torch.state.buffers.buffer_generation`, without a pointer
from the state to its pool) and the pool is rebuilt from the members' current values.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from fp8kit.torch.state.buffers import ScalingState, buffer_generation

__all__ = ["StatePool", "host_to_device"]

_MAX_CACHED_MASKS = 64


def host_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of the Python ``values`` on ``device``, without making the host wait.

    A copy from pageable host memory to a GPU blocks the host until the GPU has run everything
    queued before it. On a CUDA device the values go through pinned memory with an asynchronous
    copy instead (torch's pinned-memory cache keeps the block until the copy has read it);
    elsewhere the tensor is made in place (docs/performance.md, "No host synchronisation")."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class StatePool:
    """The buffers of ``states`` (one device, one history length) laid side by side."""

    def __init__(self) -> None:
        self._members: list[weakref.ref[ScalingState]] = []  # weak: the pool keeps no module alive
        self._views: list[dict[str, torch.Tensor]] = []  # per member: the views it was given
        self._generation = -1  # buffer_generation() when the members last held those views
        self.history = torch.zeros(0, 0)
        self.scale = torch.ones(0)
        self.scale_inv = torch.ones(0)
        self.update_count = torch.zeros(0, dtype=torch.int64)
        self.nonfinite_count = torch.zeros(0, dtype=torch.int64)
        self._masks: dict[frozenset[int], torch.Tensor] = {}  # slot_mask cache (device tensors)
        # slot_mask's column indices by id of its mask; the mask lives in _masks (cleared together)
        # while its entry is here, so no other live mask has that id
        self._columns: dict[int, torch.Tensor] = {}
        # Anything derived from the pool's tensors by their users (the prepared update event of
        # fp8kit.torch.state.apply), dropped whenever the tensors are replaced.
        self.derived: dict[object, object] = {}
        self._synced_addresses = self._addresses()

    @property
    def num_slots(self) -> int:
        return self.scale.shape[0]

    def stale(self) -> bool:
        """Whether some :class:`ScalingState` replaced a buffer since the last :meth:`sync`
        (a member may no longer view its columns): one integer comparison."""
        return self._generation != buffer_generation()

    def _intact(self, states: Sequence[ScalingState]) -> bool:
        """Whether ``states`` are the members, in order, each still viewing its columns."""
        if len(states) != len(self._members):
            return False
        for state, ref, views in zip(states, self._members, self._views, strict=True):
            if state is not ref():
                return False
            buffers = state._buffers
            if any(buffers[name] is not view for name, view in views.items()):
                return False
        return True

    def sync(self, states: Sequence[ScalingState]) -> None:
        """Make the pool hold exactly ``states`` in this order, each one viewing its columns.

        Costs one identity check per state when nothing changed; otherwise copies the states'
        current values into new pool tensors (one ``cat`` per buffer kind).
        """
        if self._intact(states):
            if self._addresses() != self._synced_addresses:  # storage moved in place
                self.derived = {}
                self._synced_addresses = self._addresses()
            self._generation = buffer_generation()
            return
        if not states:
            self.__init__()  # type: ignore[misc]
            self._generation = buffer_generation()
            return
        devices = {s.device for s in states}
        if len(devices) > 1:
            raise RuntimeError(  # pragma: no cover - registries are per device
                f"fp8kit: states of one pool live on several devices: {sorted(map(str, devices))}"
            )
        lengths = {s.history_len for s in states}
        if len(lengths) > 1:  # pragma: no cover - states are resized before they join
            raise RuntimeError(f"fp8kit: states of one pool have history lengths {lengths}")
        # Ordinary tensors even when the event runs under torch.inference_mode (a calibration
        # pass): the states adopt these as their buffers and train with them afterwards.
        with torch.no_grad(), torch.inference_mode(False):
            self.history = torch.cat([s.amax_history for s in states], dim=1)
            self.scale = torch.cat([s.scale for s in states])
            self.scale_inv = torch.cat([s.scale_inv for s in states])
            self.update_count = torch.cat([s.update_count for s in states])
            self.nonfinite_count = torch.cat([s.nonfinite_count for s in states])
        self._masks = {}
        self._columns = {}
        self.derived = {}
        self._members = [weakref.ref(s) for s in states]
        self._views = []
        offset = 0
        for state in states:
            cols = slice(offset, offset + state.num_slots)
            views = {
                "amax_history": self.history[:, cols],
                "scale": self.scale[cols],
                "scale_inv": self.scale_inv[cols],
                "update_count": self.update_count[cols],
                "nonfinite_count": self.nonfinite_count[cols],
            }
            state.adopt_buffers(views)
            self._views.append(views)
            offset += state.num_slots
        self._synced_addresses = self._addresses()
        self._generation = buffer_generation()

    def _addresses(self) -> tuple[int, ...]:
        """Where the pool tensors' data lives: ``Module.share_memory()`` moves it in place,
        invalidating what :attr:`derived` prepared on the old addresses."""
        return tuple(
            t.data_ptr()
            for t in (
                self.history,
                self.scale,
                self.scale_inv,
                self.update_count,
                self.nonfinite_count,
            )
        )

    def slot_mask(self, chosen: Sequence[ScalingState]) -> torch.Tensor:
        """Boolean ``(N,)`` device mask of the columns of the ``chosen`` member states.

        Cached per set of states until the pool is rebuilt, so a recurring pattern (e.g. the
        same experts idle) is copied to the device once; a new pattern (routing that changes
        every step) costs two asynchronous copies (:func:`host_to_device`), no host wait.
        """
        wanted = frozenset(id(s) for s in chosen)
        mask = self._masks.get(wanted)
        if mask is None:
            flags = []
            for ref in self._members:
                state = ref()
                if state is not None:
                    flags += [id(state) in wanted] * state.num_slots
            device = self.history.device
            mask = host_to_device(flags, torch.bool, device)
            columns = host_to_device([i for i, f in enumerate(flags) if f], torch.int64, device)
            if len(self._masks) >= _MAX_CACHED_MASKS:  # patterns keep changing: stay bounded
                self._masks.clear()
                self._columns.clear()
            self._masks[wanted] = mask
            self._columns[id(mask)] = columns
        return mask

    def columns_of(self, mask: torch.Tensor) -> torch.Tensor:
        """int64 ``(K,)`` device indices of the True entries of a boolean ``(N,)`` ``mask``.

        Known without a host read for a mask :meth:`slot_mask` made; any other mask (one that
        came out of an all-reduce) is read with ``nonzero``, a host synchronisation on CUDA.
        """
        columns = self._columns.get(id(mask))
        return mask.nonzero().flatten() if columns is None else columns

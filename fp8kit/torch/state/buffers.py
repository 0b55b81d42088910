"""Per-module FP8 scaling state: amax histories, scales and event counts (docs/semantics.md
sections 3, 6).

A module owns an :class:`FP8Meta` with a forward and a backward :class:`ScalingState`. Both are
``nn.Module``\\ s holding plain buffers, so they move with ``.to()``, appear in ``state_dict`` with
fixed shapes (``fp8_meta.forward.amax_history`` ...) and load with ``weights_only=True``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import re
import threading
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from fp8kit.recipe import DelayedScaling, require_int
from fp8kit.slots import BwdSlot, FwdSlot, bwd_slot, fwd_slot

__all__ = [
    "BUFFER_NAMES",
    "BwdSlot",
    "FP8Meta",
    "FwdSlot",
    "ScalingState",
    "UnsupportedExtraState",
    "buffer_generation",
    "bwd_slot",
    "finish_fresh_state_summary",
    "fwd_slot",
    "mark_owner_weights_kept",
    "resize_history",
    "start_fresh_state_summary",
    "state_by_uid",
]

DEFAULT_HISTORY_LEN: int = DelayedScaling.__dataclass_fields__["amax_history_len"].default
BUFFER_NAMES = ("amax_history", "scale", "scale_inv", "update_count", "nonfinite_count")
_CAST_BUFFERS = ("amax_history", "scale", "update_count")  # what a cast reads and writes
_EXTRA_STATE_VERSION = 1
# State-dict keys of FP8 state (persistent buffers and the recorded recipe) under any prefix.
FP8_STATE_KEY = re.compile(
    r"(^|\.)fp8_meta\.(forward|backward)\.(amax_history|scale|update_count|_extra_state)$"
)

# Bumped whenever a ScalingState replaces a buffer tensor (assignment, .to(), load with another
# history length), so a pool can tell cheaply whether its members may have left it.
_generation = [0]


def buffer_generation() -> int:
    """A counter that changes whenever any :class:`ScalingState` replaces a buffer tensor."""
    return _generation[0]


def _buffers_replaced() -> None:
    _generation[0] += 1


# Every ScalingState gets a process-unique integer id, so a torch.library op (which takes ints,
# not Python objects) can name the state it quantizes for (docs/decisions/0233-torch-compile.md).
_uids = itertools.count(1)
_states_by_uid: weakref.WeakValueDictionary[int, ScalingState] = weakref.WeakValueDictionary()


def state_by_uid(uid: int) -> ScalingState:
    """The live :class:`ScalingState` whose ``uid`` is ``uid`` (KeyError if it is gone)."""
    return _states_by_uid[uid]


def resize_history(history: torch.Tensor, length: int) -> torch.Tensor:
    """Return ``history`` (L, n) resized to ``length`` rows, keeping the staging row 0.

    Shrinking keeps the newest completed entries (the last rows); growing pads zeros on the
    older side (right after the staging row).
    """
    old = history.shape[0]
    if length == old:
        return history
    out = torch.zeros((length, history.shape[1]), dtype=history.dtype, device=history.device)
    out[0] = history[0]
    keep = min(old, length) - 1
    if keep > 0:
        out[length - keep :] = history[old - keep :]
    return out


class UnsupportedExtraState(ValueError):
    """A checkpoint's ``_extra_state`` entry for a :class:`ScalingState` that this version of
    fp8kit cannot read."""


def _forget(former: dict[int, Any], key: int, _ref: Any) -> None:
    """Weakref callback: a formerly placed tensor is gone (its id may be reused)."""
    former.pop(key, None)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view the same elements (``b.detach()``, for one)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def _require_label(label: Any) -> None:
    if not isinstance(label, str):
        raise TypeError(f"label must be a str (names the owner in messages), got {label!r}")


class ScalingState(nn.Module):
    """Delayed-scaling state of one direction of one module.

    Buffers:
        amax_history: float32 ``(L, n)``; row 0 is the staging row (max of amaxes recorded since
            the last update), rows 1..L-1 the completed history, oldest first.
        scale: float32 ``(n,)``, the factor applied before casting to FP8.
        scale_inv: float32 ``(n,)``, ``1 / scale`` (derived, not saved).
        update_count: int64 ``(n,)``, number of non-skipped update events per slot.
        nonfinite_count: int64 ``(n,)``, number of update events whose amax was infinite (such a
            value freezes the slot's scale while it is in the window; diagnostic, not saved).
    """

    amax_history: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor
    update_count: torch.Tensor
    nonfinite_count: torch.Tensor

    def __init__(
        self,
        num_slots: int,
        history_len: int = DEFAULT_HISTORY_LEN,
        device: torch.device | str | None = None,
        label: str = "",
    ) -> None:
        require_int("num_slots", num_slots, 1)
        require_int("history_len", history_len, 1)
        _require_label(label)
        super().__init__()
        self.num_slots = num_slots
        self.label = label  # what owns this state, for messages (e.g. "Linear(64, 32).forward")
        self.uid = next(_uids)  # names this state in compiled graphs (see state_by_uid)
        _states_by_uid[self.uid] = self
        # Which pool of its (recipe, group, direction, device) the state shares: 0 is the common
        # one; a CUDA graph capture gives its states their own (docs/decisions/0234-cuda-graphs.md).
        self.pool_partition = 0
        kw: dict[str, Any] = {"dtype": torch.float32, "device": device}
        self.register_buffer("amax_history", torch.zeros(history_len, num_slots, **kw))
        self.register_buffer("scale", torch.ones(num_slots, **kw))
        self.register_buffer("scale_inv", torch.ones(num_slots, **kw), persistent=False)
        self.register_buffer(
            "update_count", torch.zeros(num_slots, dtype=torch.int64, device=device)
        )
        # Compiled casts declare this 0-element tensor mutated: a compiler then keeps each cast in
        # the forward graph and never drops it (docs/decisions/0233-torch-compile.md).
        self.register_buffer("op_token", torch.empty(0, **kw), persistent=False)
        self.register_buffer(
            "nonfinite_count",
            torch.zeros(num_slots, dtype=torch.int64, device=device),
            persistent=False,
        )
        self.recipe_data: dict[str, Any] | None = None
        self._slots_with_history: set[int] = set()
        # Per-slot views (scale, staging entry, update count) for the hot path, valid while the
        # buffers they view are the current ones (see slot_views).
        self._slot_views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._slot_views_of: tuple[torch.Tensor, ...] = ()
        self._slot_derived: dict[int, dict[Any, Any]] = {}
        self._note_placed()

    def _note_placed(self, *names: str) -> None:
        """Remember the buffer tensors a ScalingState placed itself (``names``, default all),
        which :meth:`slot_views` tells from tensors assigned into ``_buffers`` from outside,
        and those they replace (still the module's own, only out of date)."""
        placed = self.__dict__.setdefault("_placed", {})
        former = self.__dict__.setdefault("_formerly_placed", {})
        for name in names or _CAST_BUFFERS:
            old, new = placed.get(name), self._buffers[name]
            if old is not None and old is not new:
                key = id(old)
                former[key] = weakref.ref(old, functools.partial(_forget, former, key))
            placed[name] = new
        self._slot_views_of = ()  # the next cast rebuilds its views, checking them

    def heal_buffers(self) -> list[str]:
        """Put back the placed cast buffers where ``_buffers`` holds others, as
        ``torch.func.functional_call`` leaves them. Returns the names whose tensor there was
        not the module's own (neither one it placed before nor a view of the same memory):
        tensors from outside, whose amaxes the module's update event would lose."""
        placed = self._placed
        foreign = []
        for name in _CAST_BUFFERS:
            tensor, own = self._buffers[name], placed[name]
            if tensor is own or _same_memory(tensor, own):
                continue
            if not self._held_before(tensor):
                foreign.append(name)
            self._buffers[name] = own
        return foreign

    def _held_before(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is, or views the memory of, a buffer this state placed before."""
        for ref in list(self._formerly_placed.values()):
            old = ref()
            if old is not None and (old is tensor or _same_memory(tensor, old)):
                return True
        return False

    def heal_or_refuse(self) -> None:
        """:meth:`heal_buffers`, raising if ``_buffers`` held tensors from outside."""
        if self.heal_buffers():
            _buffers_replaced()  # the module's next call binds afresh
            raise RuntimeError(self.swapped_message())

    def __getstate__(self) -> dict[str, Any]:
        self.heal_or_refuse()  # a copy of the module's state, not of what functional_call left
        state = dict(self.__dict__)
        # rebuilt on use; the placed tensors are the copy's own buffers (__setstate__)
        state.update(
            _slot_views={}, _slot_views_of=(), _slot_derived={}, _placed={}, _formerly_placed={}
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.uid = next(_uids)  # a copy (deepcopy, unpickling) is a state of its own
        _states_by_uid[self.uid] = self
        self.pool_partition = 0  # and is in no CUDA graph
        self.__dict__["_placed"] = {}  # not the original's tensors
        self.__dict__["_formerly_placed"] = {}
        self._note_placed()

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in BUFFER_NAMES:
            _buffers_replaced()
            if name in _CAST_BUFFERS:
                self._note_placed(name)

    def placement(self) -> tuple[dict[str, torch.Tensor | None], int, dict[str, Any] | None]:
        """The buffer tensors themselves (not copies), the pool partition and the recorded
        recipe: what :meth:`restore_placement` puts back after a failed set-up moved them."""
        return dict(self._buffers), self.pool_partition, self.recipe_data

    def restore_placement(
        self, placement: tuple[dict[str, torch.Tensor | None], int, dict[str, Any] | None]
    ) -> None:
        """Undo everything since :meth:`placement`: rebinding, pooling, a partition."""
        buffers, self.pool_partition, self.recipe_data = placement
        self._buffers.update(buffers)
        _buffers_replaced()
        self._note_placed()

    def adopt_buffers(self, views: dict[str, torch.Tensor]) -> None:
        """Use ``views`` (same shapes and values, e.g. columns of a pool) as the buffers."""
        for name, view in views.items():
            self._buffers[name] = view
        self._note_placed(*(name for name in views if name in _CAST_BUFFERS))

    def _apply(self, fn: Any, recurse: bool = True) -> ScalingState:  # type: ignore[override]
        # FP8 metadata stays float32 / int64 whatever the model's dtype: follow device moves
        # only (``model.to(torch.bfloat16)`` must not round scales and histories).
        self.heal_or_refuse()  # move the module's state, not what functional_call left
        materialised = False
        for name, buf in self._buffers.items():
            if buf is None:
                continue
            moved = fn(buf)
            if moved.dtype != buf.dtype:
                moved = (
                    torch.empty_like(buf, device=moved.device)
                    if buf.is_meta
                    else buf.to(device=moved.device)
                )
            materialised |= buf.is_meta and not moved.is_meta
            if moved is not buf:
                self._buffers[name] = moved
                _buffers_replaced()
            else:
                # Perhaps moved in place (``share_memory_``): the same tensor at a new address,
                # which the prepared casts hold (docs/performance.md). Pooled buffers are views
                # of one storage that the first state's call moves for all, so no state can tell
                # from its own address: the prepared casts go (_note_placed below, a cold path).
                _buffers_replaced()
        self._note_placed()
        if materialised:
            # Off the meta device (``module.to_empty``, as FSDP2 / torchtitan initialise): a meta
            # buffer had no values, so the new memory gets the fresh state's.
            self.reset_values()
        return self

    @property
    def device(self) -> torch.device:
        """Where the buffers live (read without ``nn.Module.__getattr__``: events ask per state)."""
        return self._buffers["amax_history"].device

    @property
    def history_len(self) -> int:
        return self.amax_history.shape[0]

    def forward(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - not callable
        raise RuntimeError("ScalingState holds buffers only; it is not meant to be called")

    def slot_views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scale[slot], amax_history[0, slot], update_count[slot])`` as one-element views.

        The casting kernel reads the scale and folds the amax into the staging entry through
        them; they are made once per slot and buffer set (a few attribute reads per call).
        """
        bufs = self._buffers
        history, scale, count = bufs["amax_history"], bufs["scale"], bufs["update_count"]
        of = self._slot_views_of
        if not of or of[0] is not history or of[1] is not scale or of[2] is not count:
            placed = self._placed
            if (
                history is not placed["amax_history"]
                or scale is not placed["scale"]
                or count is not placed["update_count"]
            ):  # assigned into _buffers from outside (functional_call): heal, or refuse
                self.heal_or_refuse()
                history, scale, count = (placed[name] for name in _CAST_BUFFERS)
            self._slot_views, self._slot_views_of = {}, (history, scale, count)
            self._slot_derived = {}
        views = self._slot_views.get(slot)
        if views is None:
            views = self._slot_views[slot] = (
                scale[slot : slot + 1],
                history[0, slot : slot + 1],
                count[slot : slot + 1],
            )
        return views

    def swapped_message(self) -> str:
        """The refusal of FP8 state buffers assigned from outside (see :meth:`heal_buffers`)."""
        return (
            f"fp8kit: the FP8 state buffers of {self.label or 'an FP8 state'} were replaced from "
            "outside fp8kit (assigned into module._buffers, as torch.func.functional_call does "
            "with buffers passed in). The update event at the autocast exit updates the "
            "module's own state, so the amaxes cast into the replacements would be lost: pass "
            "only parameters to functional_call, or the module's own buffer tensors "
            "(docs/te_modules.md, 'Copies, EMA and stateless calls')"
        )

    def slot_derived(self, slot: int) -> dict[Any, Any]:
        """A dict for what callers derive from ``slot``'s views (a cast prepared on their
        addresses, docs/performance.md), emptied whenever :meth:`slot_views` rebuilds them."""
        self.slot_views(slot)
        derived = self._slot_derived.get(slot)
        if derived is None:
            derived = self._slot_derived[slot] = {}
        return derived

    def record_amax(self, slot: int, amax: torch.Tensor) -> None:
        """Fold ``amax`` (float32 0-d) into the staging row: ``H[0, slot] = max(H[0, slot], a)``."""
        self.amax_history[0, slot : slot + 1].clamp_(min=amax)

    def slot_has_history(self, slot: int) -> bool:
        """Whether ``slot`` has had at least one non-skipped update (syncs until it has)."""
        if slot in self._slots_with_history:
            return True
        if bool(self.update_count[slot] > 0):
            self._slots_with_history.add(slot)
            return True
        return False

    def is_pristine(self) -> bool:
        """True if no update ever completed (counts 0, completed history rows 0).

        The staging row does not count: resizing keeps it, so a state that has only recorded
        (e.g. a ``no_grad`` forward under a recipe with another history length) loses nothing.
        A state on the ``meta`` device holds no values: pristine.
        """
        if self.amax_history.is_meta:
            return True
        return not bool(self.update_count.any()) and not bool(self.amax_history[1:].any())

    def set_history_len(self, length: int, reason: str) -> None:
        """Resize the history to ``length`` rows, warning unless the state is still pristine."""
        self.heal_or_refuse()  # resize the module's own history, not one functional_call left
        if length == self.history_len:
            return
        if not self.is_pristine():
            warnings.warn(
                f"fp8kit: resizing an amax history from {self.history_len} to {length} entries "
                f"({self.label or 'an FP8 state'}, {reason}); "
                + (
                    "the oldest entries are dropped"
                    if length < self.history_len
                    else "zeros are padded on the older side"
                ),
                stacklevel=3,
            )
        with torch.inference_mode(False):  # a buffer, also when resized in an inference pass
            self.amax_history = resize_history(self.amax_history, length)

    def refresh_derived(self) -> None:
        """Recompute ``scale_inv`` and caches after the buffers were replaced from outside.

        The unsaved buffers follow the saved ones to their device: ``load_state_dict(...,
        assign=True)`` into a model built on ``meta`` assigns the checkpoint's tensors and leaves
        the others where they were."""
        device = self.amax_history.device
        with torch.no_grad(), torch.inference_mode(False):
            if self.nonfinite_count.device != device:
                self.nonfinite_count = torch.zeros_like(self.update_count, device=device)
            if self.op_token.device != device:
                self.op_token = torch.empty(0, dtype=torch.float32, device=device)
            scale_inv = self.scale_inv
            if scale_inv.shape == self.scale.shape and scale_inv.device == self.scale.device:
                scale_inv.copy_(torch.reciprocal(self.scale))  # in place: keeps pool views
            else:
                self.scale_inv = torch.reciprocal(self.scale)
        self._slots_with_history = set()

    def reset_values(self) -> None:
        """Fresh values in place (history 0, scale 1, counts 0); shape and recipe are kept."""
        self.heal_or_refuse()
        with torch.no_grad():
            self.amax_history.zero_()
            self.scale.fill_(1.0)
            self.update_count.zero_()
            self.nonfinite_count.zero_()
        self.refresh_derived()

    def get_extra_state(self) -> dict[str, Any]:
        return {"version": _EXTRA_STATE_VERSION, "recipe": self.recipe_data}

    def set_extra_state(self, state: Any) -> None:
        if _is_dcp_placeholder(state):  # the checkpoint has none: keep the recorded recipe
            return
        if not isinstance(state, dict) or state.get("version") != _EXTRA_STATE_VERSION:
            raise UnsupportedExtraState(
                f"fp8kit: unsupported ScalingState extra state {state!r} "
                f"(expected a dict with version {_EXTRA_STATE_VERSION}, as get_extra_state saves)"
            )
        self.recipe_data = state.get("recipe")

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        """Saved buffers are contiguous copies, not the pool views the state trains with
        (``keep_vars=True`` still gives the buffers themselves): a view of the pool's ``(L, N)``
        history is not contiguous, which ``torch.distributed``'s broadcasts of a state dict and
        safetensors do not take, and it would save the storage of the whole pool
        (docs/decisions/0242-review-fixes-seventh-session.md)."""
        self.heal_or_refuse()  # save the module's own state
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if keep_vars:
            return
        for name, buffer in self._buffers.items():
            key = prefix + name
            if buffer is not None and key in destination:
                destination[key] = buffer.detach().clone(memory_format=torch.contiguous_format)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # A checkpoint may carry another history length: adopt it (nothing is lost). The next
        # autocast resizes to its recipe's length, warning if that drops or pads entries.
        incoming = state_dict.get(prefix + "amax_history")
        if (
            isinstance(incoming, torch.Tensor)
            and incoming.dim() == 2
            and incoming.shape[1] == self.num_slots
            and incoming.shape[0] != self.history_len
        ):
            self.amax_history = torch.zeros(
                incoming.shape, dtype=torch.float32, device=self.amax_history.device
            )
        bufs = self._buffers
        before = {name: (bufs[name], bufs[name].data_ptr()) for name in _CAST_BUFFERS}
        try:
            super()._load_from_state_dict(
                state_dict,
                prefix,
                local_metadata,
                strict,
                missing_keys,
                unexpected_keys,
                error_msgs,
            )
        except UnsupportedExtraState as error:
            # torch sets the extra state last: the buffers are loaded. Reported as torch reports
            # a bad tensor, by key, when the whole load is done (also under strict=False).
            error_msgs.append(f"While loading {prefix}_extra_state: {error}")
        for name, (tensor, address) in before.items():
            if self._buffers[name] is tensor and tensor.data_ptr() != address:
                # assign=True under torch.__future__.set_swap_module_params_on_conversion: the
                # object kept, its contents swapped for the checkpoint's (no longer a view of
                # the pool). A new object makes the pool see it and take its values.
                setattr(self, name, tensor.detach())
        self.refresh_derived()

    def extra_repr(self) -> str:
        return f"num_slots={self.num_slots}, history_len={self.history_len}"


class FP8Meta(nn.Module):
    """The forward and backward scaling states of a module with ``num_gemms`` GEMMs.

    ``forward`` holds ``3 * num_gemms`` slots (:class:`FwdSlot`), ``backward`` ``2 * num_gemms``
    (:class:`BwdSlot`). Their ``state_dict`` keys are ``forward.*`` and ``backward.*``.
    """

    def __init__(
        self,
        num_gemms: int = 1,
        history_len: int = DEFAULT_HISTORY_LEN,
        device: torch.device | str | None = None,
        label: str = "",
    ) -> None:
        require_int("num_gemms", num_gemms, 1)
        _require_label(label)
        super().__init__()
        self.num_gemms = num_gemms
        # Registered under the names "forward"/"backward" so state_dict keys read like the
        # attribute paths; nn.Module.add_module refuses those names because of Module.forward.
        self._modules["forward"] = ScalingState(
            3 * num_gemms, history_len, device, f"{label}.forward" if label else "forward"
        )
        self._modules["backward"] = ScalingState(
            2 * num_gemms, history_len, device, f"{label}.backward" if label else "backward"
        )
        self.register_load_state_dict_post_hook(_missing_fp8_state_is_fresh_state)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # No key of this state in the checkpoint: the post hook makes it fresh state.
        absent = not any(key.startswith(prefix) for key in state_dict)
        if not absent:
            absent = _filled_in_by_dcp(self, state_dict, prefix)
        self.__dict__["_absent_in_load"] = prefix if absent else None

    def reset_values(self) -> None:
        """Fresh values in both states, in place (``reset_parameters``): shapes, the recorded
        recipe and the labels are kept, and so are the pools the buffers belong to."""
        self.forward.reset_values()
        self.backward.reset_values()

    def set_label(self, label: str) -> None:
        """Name the owner in messages (``convert_model`` uses the module's qualified name)."""
        _require_label(label)
        self.forward.label = f"{label}.forward"
        self.backward.label = f"{label}.backward"

    @property  # type: ignore[override]
    def forward(self) -> ScalingState:  # deliberately shadows Module.forward
        return self._modules["forward"]  # type: ignore[return-value]

    @property
    def backward(self) -> ScalingState:
        return self._modules["backward"]  # type: ignore[return-value]


def _is_dcp_placeholder(value: object) -> bool:
    """Whether ``value`` is the object ``torch.distributed.checkpoint.state_dict`` puts under
    an ``_extra_state`` key that a full state dict lacks (``set_model_state_dict`` with
    ``full_state_dict=True``): a marker of absence, not a saved state. Told by its class (a
    private one of torch's, so not imported)."""
    kind = type(value)
    return kind.__name__ == "_EXTRA_STATE" and kind.__module__.startswith("torch.distributed")


def _filled_in_by_dcp(meta: nn.Module, state_dict: dict[str, Any], prefix: str) -> bool:
    """Whether every key of ``meta`` in ``state_dict`` is what ``set_model_state_dict``
    (``full_state_dict=True``) fills in for a key the checkpoint lacks: its placeholder for each
    extra state and the module's own tensor for each buffer. Such a checkpoint has no FP8 state
    (docs/te_modules.md, "Checkpoints with plain PyTorch")."""
    for key, own in meta.state_dict(keep_vars=True).items():
        given = state_dict.get(prefix + key, own)
        if key.endswith("_extra_state"):
            if not _is_dcp_placeholder(given):
                return False
        elif given is not own:
            return False
    return True


def mark_owner_weights_kept(meta: nn.Module, kept: bool) -> None:
    """Tell ``meta``'s load post hook whether its owner's load left every weight as it was (each
    one missing or the module's own tensor, as ``set_model_state_dict`` fills in keys a full
    state dict lacks): an absent FP8 state then stays, as there are no new weights to restart
    it for. Called by the owner's load-state-dict pre hook, which runs before ``meta``'s load."""
    meta.__dict__["_owner_weights_kept"] = kept


# A load whose root asked for one summary line (fp8kit.torch.checkpoint.summarize_fresh_fp8_state)
# collects the FP8 states it found absent here: (that load's missing_keys list, their names).
_summary = threading.local()


def start_fresh_state_summary(missing_keys: list[str]) -> bool:
    """Collect the absent FP8 states of the load whose ``missing_keys`` list this is.

    Returns False when that load is already collected (a nested summarising module).
    """
    current = getattr(_summary, "load", None)
    if current is not None and current[0] is missing_keys:
        return False
    _summary.load = (missing_keys, [])
    return True


def finish_fresh_state_summary(missing_keys: list[str]) -> list[str] | None:
    """The names collected for the load of ``missing_keys`` (None if it is not collected)."""
    current = getattr(_summary, "load", None)
    if current is None or current[0] is not missing_keys:
        return None
    _summary.load = None
    return current[1]


def _missing_fp8_state_is_fresh_state(meta: nn.Module, incompatible: Any) -> None:
    """Load-state-dict post hook of :class:`FP8Meta` (docs/te_modules.md, checkpoints).

    A checkpoint without this FP8 state (a plain PyTorch model's) loads with ``strict=True``:
    its keys leave ``missing_keys`` and, when the owner's own weights were loaded (none missing,
    not all of them the module's own tensors), the state is reset to fresh (history 0, scale 1,
    counts 0; the old one belongs to other weights) and the reset is logged. An FP8 state the
    checkpoint holds in part, and every other missing key, stays missing.
    """
    prefix = meta.__dict__.pop("_absent_in_load", None)
    weights_kept = meta.__dict__.pop("_owner_weights_kept", False)
    if prefix is None:
        return
    own = {prefix + key for key in meta.state_dict(keep_vars=True)}
    missing = incompatible.missing_keys
    missing[:] = [key for key in missing if key not in own]
    owner = prefix[:-1].rpartition(".")[0]
    owner_prefix = f"{owner}." if owner else ""
    if weights_kept or any(key.startswith(owner_prefix) for key in missing):
        return  # the owner's weights are the ones the state was measured on
    for state in (meta.forward, meta.backward):
        state.reset_values()
    name = prefix[:-1] or "the FP8 state"
    current = getattr(_summary, "load", None)
    if current is not None and current[0] is missing:
        current[1].append(name)
    else:
        logging.getLogger("fp8kit").info(
            "fp8kit: the loaded state_dict has no FP8 state for %s: it starts fresh "
            "(amax history 0, scale 1)",
            name,
        )

"""The FP8 module casts as ``torch.library`` custom ops, for ``torch.compile``
(docs/decisions/0233-torch-compile.md).

A traced graph runs no Python of ours, so each op carries what the eager call does around the
kernel: binding the module's states to the recipe, the cast itself (:func:`quantize_slot`, the
same kernels as eager) and the enrolment of the state in its next update event. Ops take integers,
not Python objects: states are named by ``ScalingState.uid``, ``(recipe, group)`` by the
autocast's ``event_key``. The uids are read as unspecialized ints (:func:`_uids_unspecialized`),
so the instances of one block share a graph.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch._dynamo  # loaded by fp8kit.torch anyway (torch.compiler.assume_constant_result)

from fp8kit.torch.autocast import enrol, event_of
from fp8kit.torch.kernels._library import define_op
from fp8kit.torch.plan import plan_for
from fp8kit.torch.quantization import Float8Tensor, nan_ignoring_amax
from fp8kit.torch.recompute import check_not_checkpointed, check_not_recomputed
from fp8kit.torch.slot_cast import quantize_slot
from fp8kit.torch.state import FP8Meta, bind_state_if_needed
from fp8kit.torch.state.buffers import state_by_uid

__all__ = ["bind_traced", "quantize_traced", "record_traced"]

# cudagraph_unsafe: the enrolment is host work that a CUDA graph replay would skip, so Inductor
# keeps this op out of its CUDA graphs (mode="reduce-overhead" graphs the rest around it). Torch
# releases without the tag (before 2.8) get none.
_OP_TAGS: tuple[torch.Tag, ...] = (
    (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
)
# The ops' signature: the state's op token (declared mutated), the input, the two states' uids
# (SymInts: a graph can take them as inputs, see _uids_unspecialized), the autocast's event key
# and the packed call (:func:`_pack_call`).
_SLOT_ARGS = (
    "(Tensor(a!) token, Tensor x, SymInt forward_uid, SymInt backward_uid, int event_key, int call)"
)


def _can_unspecialize_uids() -> bool:
    """Whether this torch lets traced code unspecialize nn.Module int attributes for a while
    (``torch._dynamo.patch_dynamo_config`` accepting ``allow_unspec_int_on_nn_module``)."""
    patch = getattr(torch._dynamo, "patch_dynamo_config", None)
    if patch is None:
        return False
    try:
        patch(allow_unspec_int_on_nn_module=True)  # checks the key; enters nothing
    except (ValueError, AttributeError, TypeError):
        return False
    return True


_UNSPECIALIZE_UIDS = _can_unspecialize_uids()


# Dynamo takes an int attribute of an nn.Module (the states' uid) as a constant of the graph and
# guards on it, so every instance of a block would compile a graph of its own: a per-block
# compile (block.compile(), torchtitan's way) recompiled per block and hit Dynamo's recompile
# limit at the 9th (a hard error under fullgraph=True, eager blocks without). Read inside this
# context, the uids are unspecialized ints like a function's arguments: the first graph still
# holds them as constants, and automatic dynamic makes them graph inputs (SymInts) at the first
# recompile, so later blocks share that graph. The ops receive the exact uid at run time (a
# Python int input: no tensor, no host read, nothing a CUDA graph captures; Inductor's graph
# partitions hand it only to the partitions that run these cudagraph_unsafe ops). The patch
# changes tracing only: Dynamo restores the config at the block's end and guards on none of it.
# A torch without a traceable patch for this config keeps the uids constant (a graph each).
# compile(dynamic=False) does too: it turns automatic dynamic off.
def _uids_unspecialized() -> Any:
    if _UNSPECIALIZE_UIDS:
        return torch._dynamo.patch_dynamo_config(allow_unspec_int_on_nn_module=True)
    return contextlib.nullcontext()


# A call's slot and flags travel as one int. It was packed when the ops were ``custom_op``'s,
# whose Python ADInplaceOrView kernel re-read the schema once per argument on every call
# (docs/decisions/0252-first-gpu-run.md); the ops are now plain library ops (ADR 0254), and one
# int is still the fewest arguments to convert per call.
_BACKWARD, _TRANSPOSE, _DBIAS, _ENROL, _BIND = 1, 2, 4, 8, 16
_FLAG_BITS = 5


def _pack_call(
    slot: int,
    backward: bool = False,
    transpose: bool = False,
    dbias: bool = False,
    enrol_state: bool = False,
    bind: bool = True,
) -> int:
    """``slot << 5`` with one bit per flag (:data:`_BACKWARD` ... :data:`_BIND`)."""
    flags = (
        _BACKWARD * backward
        | _TRANSPOSE * transpose
        | _DBIAS * dbias
        | _ENROL * enrol_state
        | _BIND * bind
    )
    return slot << _FLAG_BITS | flags


# The ops fold into the staging entry of the *live* state (found by uid) instead of a buffer the
# graph holds: nothing in a graph reads a staging row, the scale changes only at update events
# (outside the graph) and a fold is a max (order-free, idempotent). So the graph guards on no FP8
# buffer: a pool re-laid or a history resized between steps (or between forward and backward)
# needs no recompile and cannot leave a graph writing into a stale tensor. What the ops declare
# mutated is the state's 0-element ``op_token``: that keeps every cast in the forward graph (the
# partitioner would otherwise move one that only the backward uses past the forward update
# event) and keeps a cast no GEMM uses from being dropped (docs/decisions/0233-torch-compile.md).
def _quantize_slot(
    token: torch.Tensor,
    x: torch.Tensor,
    forward_uid: int,
    backward_uid: int,
    event_key: int,
    call: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_slot` for the module whose states have uids ``forward_uid`` /
    ``backward_uid`` (the ``_BACKWARD`` flag picks one), binding both to the recipe first if
    needed and the ``_BIND`` flag is set, then enrolling the state in its next update event
    when ``_ENROL`` is set. ``call``: :func:`_pack_call` of the slot and the flags. ``token``:
    the state's ``op_token`` (its contents are never touched).

    Returns ``(data, data_t, scale_inv, dbias)``, with 0-element tensors for outputs not asked.
    """
    slot, backward = call >> _FLAG_BITS, bool(call & _BACKWARD)
    transpose, dbias = bool(call & _TRANSPOSE), bool(call & _DBIAS)
    if not backward:
        check_not_checkpointed("a torch.compile'd FP8 module")
        check_not_recomputed("torch.compile")
    plan = plan_for(event_of(event_key)[0])
    state = state_by_uid(backward_uid if backward else forward_uid)
    if plan.delayed and call & _BIND:
        # A forward cast binds both states, as eager's module call does (prepare_run); a
        # backward cast only the state it casts into, as eager's backward event does: the
        # module may have run under another recipe since its forward (decision 0247).
        for uid in (backward_uid,) if backward else (forward_uid, backward_uid):
            bind_state_if_needed(state_by_uid(uid), plan.recipe)  # type: ignore[arg-type]
    q, db = quantize_slot(x, plan, state, slot, backward, transpose, dbias)
    if call & _ENROL:
        enrol(state, event_key, backward)
    data_t = q.data_t if q.data_t is not None else x.new_empty(0, dtype=q.data.dtype)
    return q.data, data_t, q.scale_inv, db if db is not None else x.new_empty(0)


def _quantize_slot_fake(
    token: torch.Tensor,
    x: torch.Tensor,
    forward_uid: int,
    backward_uid: int,
    event_key: int,
    call: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = plan_for(event_of(event_key)[0])
    dtype = plan.backward_dtype if call & _BACKWARD else plan.forward_dtype
    data = x.new_empty(x.shape, dtype=dtype)
    data_t = x.new_empty((x.shape[1], x.shape[0]) if call & _TRANSPOSE else (0,), dtype=dtype)
    db = x.new_empty(x.shape[1] if call & _DBIAS else 0)
    return data, data_t, x.new_empty((), dtype=torch.float32), db


_quantize_slot_op = define_op(
    "quantize_slot",
    f"{_SLOT_ARGS} -> (Tensor, Tensor, Tensor, Tensor)",
    _quantize_slot,
    _quantize_slot_fake,
    _OP_TAGS,
)


def _record_slot(
    token: torch.Tensor,
    x: torch.Tensor,
    forward_uid: int,
    backward_uid: int,
    event_key: int,
    call: int,
) -> None:
    """:meth:`FP8Run.record_forward` in a compiled graph: bind (as :func:`_quantize_slot_op`),
    fold ``max |x|`` (NaN ignored) into the live forward state's staging entry of the slot of
    ``call`` (:func:`_pack_call`), enrol when its ``_ENROL`` flag is set. ``token``: the forward
    state's ``op_token``."""
    check_not_checkpointed("a torch.compile'd FP8 module")
    check_not_recomputed("torch.compile")
    recipe = event_of(event_key)[0]
    state = state_by_uid(forward_uid)
    for uid in (forward_uid, backward_uid):
        bind_state_if_needed(state_by_uid(uid), recipe)  # type: ignore[arg-type]
    state.record_amax(call >> _FLAG_BITS, nan_ignoring_amax(x))
    if call & _ENROL:
        enrol(state, event_key, False)


def _record_slot_fake(
    token: torch.Tensor,
    x: torch.Tensor,
    forward_uid: int,
    backward_uid: int,
    event_key: int,
    call: int,
) -> None:
    return None


_record_slot_op = define_op(
    "record_slot", f"{_SLOT_ARGS} -> ()", _record_slot, _record_slot_fake, _OP_TAGS
)


def quantize_traced(
    meta: FP8Meta,
    event_key: int,
    x: torch.Tensor,
    slot: int,
    backward: bool,
    transpose: bool,
    dbias: bool,
    enrol_state: bool,
    bind: bool,
) -> tuple[Float8Tensor, torch.Tensor | None]:
    """The cast of a traced module call into ``slot`` of ``meta``'s forward or backward state:
    one ``fp8kit::quantize_slot`` node; ``bind``: whether it binds the states to the recipe
    (:attr:`FP8Run.binds`). Returns ``(q, dbias or None)``; ``q.amax`` is None."""
    state = meta.backward if backward else meta.forward
    with _uids_unspecialized():  # the op call too: Dynamo may build the uids' variables there
        data, data_t, scale_inv, db = _quantize_slot_op(
            state.op_token,
            x,
            meta.forward.uid,
            meta.backward.uid,
            event_key,
            _pack_call(slot, backward, transpose, dbias, enrol_state, bind),
        )
    q = Float8Tensor(data, scale_inv, None, data_t if transpose else None)
    return q, db if dbias else None


def record_traced(
    meta: FP8Meta, event_key: int, x: torch.Tensor, slot: int, enrol_state: bool
) -> None:
    """The amax record of a traced calibration call: one ``fp8kit::record_slot`` node."""
    with _uids_unspecialized():
        _record_slot_op(
            meta.forward.op_token,
            x,
            meta.forward.uid,
            meta.backward.uid,
            event_key,
            _pack_call(slot, enrol_state=enrol_state),
        )


def _bind_states(token: torch.Tensor, forward_uid: int, backward_uid: int, event_key: int) -> None:
    """Bind both states of a module to the event's recipe, as eager's module call does, for a
    compiled call that casts nothing (every GEMM in high precision): no cast op binds there.
    ``token``: the forward state's ``op_token``."""
    recipe = event_of(event_key)[0]
    for uid in (forward_uid, backward_uid):
        bind_state_if_needed(state_by_uid(uid), recipe)  # type: ignore[arg-type]


def _bind_states_fake(
    token: torch.Tensor, forward_uid: int, backward_uid: int, event_key: int
) -> None:
    return None


_bind_states_op = define_op(
    "bind_states",
    "(Tensor(a!) token, SymInt forward_uid, SymInt backward_uid, int event_key) -> ()",
    _bind_states,
    _bind_states_fake,
    _OP_TAGS,
)


def bind_traced(meta: FP8Meta, event_key: int) -> None:
    """The binding of a traced module call that casts nothing: one ``fp8kit::bind_states``
    node (a history resize and the recorded recipe, as in eager)."""
    with _uids_unspecialized():
        _bind_states_op(meta.forward.op_token, meta.forward.uid, meta.backward.uid, event_key)

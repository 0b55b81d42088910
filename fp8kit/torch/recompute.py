"""Activation checkpointing of FP8 modules: :func:`activation_checkpoint` (docs/semantics.md
section 11).

``torch.utils.checkpoint`` runs a function again in backward to rebuild the activations it did
not keep. By then ``f8.autocast`` has exited and the forward update event has changed the scales,
so the recomputation would not give the forward's FP8 values. :func:`activation_checkpoint`
keeps, for each delayed-scaling cast of the forward, the scale (and update count) it read, and
recomputes under the forward's autocast settings with those scales. Its casts record no amax and
join no update event. The recomputed FP8 tensors are bit for bit those of the forward, and the
scaling state moves exactly as without checkpointing.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from fp8kit.torch.autocast import FP8Settings, active_replay, current_settings, replaying
from fp8kit.torch.kernels import cast_fp8, cast_fp8_current
from fp8kit.torch.plan import RecipePlan
from fp8kit.torch.quantization import Float8Tensor
from fp8kit.torch.state import ScalingState

__all__ = [
    "ForwardCasts",
    "Replay",
    "activation_checkpoint",
    "captures",
    "check_not_checkpointed",
    "check_not_recomputed",
    "check_not_rerun_in_backward",
    "note_cast",
    "warn_if_recomputed_without_fp8",
]

# Snapshot of one cast: (the state, float32 scale (n,), int64 update count (n,) or None).
_Snapshot = tuple[ScalingState, torch.Tensor, torch.Tensor | None]


class ForwardCasts:
    """The delayed-scaling casts of one checkpointed forward, per state in call order: what each
    read of the state's scale (and update count, with ``first_step_scaling="current"``)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.by_state: dict[int, list[_Snapshot]] = {}

    def add(self, snapshot: _Snapshot) -> None:
        self.by_state.setdefault(id(snapshot[0]), []).append(snapshot)


# The forward captures active now, in any thread (each notes only its own thread's casts). One
# list object for the life of the process: importers test its truth on the hot path.
captures: list[ForwardCasts] = []


def note_cast(state: ScalingState, first_step: bool) -> None:
    """Before a forward cast of ``state`` on this thread: keep copies of its scales (and update
    counts when ``first_step``, the recipe's ``first_step_scaling="current"``) in every capture
    of this thread. One copy serves them all."""
    me = threading.get_ident()
    snapshot = None
    for capture in captures:
        if capture.thread == me:
            if snapshot is None:
                count = state.update_count.clone() if first_step else None
                snapshot = (state, state.scale.clone(), count)
            capture.add(snapshot)


def warn_if_recomputed_without_fp8(module: torch.nn.Module, ran_in_fp8: bool) -> None:
    """Warn when an FP8 module that has run under an autocast (``ran_in_fp8``) now runs without
    one, with grad enabled, inside a backward pass: the recomputation of a plain (reentrant)
    ``torch.utils.checkpoint``, which runs it in high precision instead of the forward's FP8.
    A recomputation of :func:`activation_checkpoint` (``active_replay()``) runs as its forward
    did, so a forward without FP8 is recomputed without FP8, and without a warning."""
    if (
        ran_in_fp8
        and active_replay() is None
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()  # a trace cannot ask the engine (a graph break)
        and torch._C._current_graph_task_id() != -1
    ):
        warnings.warn(
            f"{type(module).__name__} ran without f8.autocast inside a backward pass: "
            "torch.utils.checkpoint recomputes it in high precision, not in the FP8 of its "
            "forward. Checkpoint FP8 modules with f8.activation_checkpoint "
            "(docs/semantics.md section 11)",
            UserWarning,
            stacklevel=3,
        )


def check_not_checkpointed(what: str) -> None:
    """Raise unless this thread is outside every :func:`activation_checkpoint` forward and
    recomputation: ``what`` (a compiled or CUDA-graphed FP8 cast) reads the live scales, so its
    recomputation would not give the forward's FP8 values."""
    if not captures and active_replay() is None:
        return
    me = threading.get_ident()
    if active_replay() is not None or any(capture.thread == me for capture in captures):
        raise RuntimeError(
            f"{what} ran inside f8.activation_checkpoint: its casts read the live scales, so the "
            "recomputation could not replay the forward's. Checkpoint eager FP8 modules only "
            "(docs/semantics.md section 11)"
        )


def check_not_recomputed(what: str) -> None:
    """Raise if a forward cast (``what``) runs inside a backward pass: a compiled graph that
    recomputes it there (``torch.utils.checkpoint`` inside the compiled function, or the
    partitioner's ``activation_memory_budget``) would read the scale the forward update event
    already changed and record its amax a second time (docs/semantics.md section 11)."""
    if torch._C._current_graph_task_id() != -1:
        raise RuntimeError(
            f"{what} recomputed an FP8 forward cast in the backward pass (torch.utils.checkpoint "
            "inside a compiled function, or torch._functorch.config.activation_memory_budget "
            "below 1): the recomputation would read the updated scales and record the amaxes "
            "again. Checkpoint eager FP8 modules with f8.activation_checkpoint instead "
            "(docs/semantics.md section 11)"
        )


def check_not_rerun_in_backward(module: torch.nn.Module) -> None:
    """Raise if ``module``, a delayed-scaling FP8 module outside any replay, runs its forward
    inside a backward pass: ``torch.utils.checkpoint`` (or a wrapper of it) recomputing it under
    an active ``f8.autocast`` (one entered in the checkpointed function, or around the backward
    call). The recomputation would cast with the scales the forward update event already
    changed, and record its amaxes again, silently (docs/semantics.md section 11). A
    recomputation runs with grad enabled; an evaluation under ``no_grad`` in a backward hook is
    not one. One C call."""
    if torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:
        raise RuntimeError(
            f"{type(module).__name__} ran an FP8 forward under f8.autocast inside a backward pass: "
            "torch.utils.checkpoint recomputing it would cast with the scales the forward update "
            "event already changed and record its amaxes again. Checkpoint FP8 modules with "
            "f8.activation_checkpoint, which replays the forward's scales "
            "(docs/semantics.md section 11)"
        )


def _note_replayed(snapshot: _Snapshot) -> None:
    """A replayed cast read ``snapshot``: a capture of this thread (a checkpoint nested in the
    one replaying) keeps the same copies."""
    me = threading.get_ident()
    for capture in captures:
        if capture.thread == me:
            capture.add(snapshot)


class Replay:
    """The casts of a recomputation: each delayed-scaling cast takes the next snapshot of its
    state from the forward's :class:`ForwardCasts`. Re-entering starts from the first again
    (a second backward through a retained graph recomputes again)."""

    def __init__(self, forward: ForwardCasts) -> None:
        self._forward = forward
        self._next: dict[int, int] = {}

    def restart(self) -> None:
        self._next = {}

    def quantize(
        self, x: torch.Tensor, plan: RecipePlan, state: ScalingState, slot: int, transpose: bool
    ) -> Float8Tensor:
        """Forward ``slot`` of ``state``: ``x`` cast as the forward cast it (no amax recorded)."""
        if not plan.delayed:  # current scaling: the scale comes from x alone
            r = cast_fp8_current(
                x, plan.forward_dtype, power_2_scale=plan.power_2_scale, transpose=transpose
            )
            return Float8Tensor(r.data, r.scale_inv, r.amax, r.data_t)
        taken = self._next.get(id(state), 0)
        snapshots = self._forward.by_state.get(id(state), [])
        if taken >= len(snapshots):
            raise RuntimeError(
                f"activation_checkpoint: the recomputation casts {state.label or 'a state'} "
                f"{taken + 1} time(s), its forward {len(snapshots)}: the checkpointed function "
                "must run the same FP8 modules with the same arguments each time"
            )
        self._next[id(state)] = taken + 1
        _, scale, count = snapshots[taken]
        if captures:
            _note_replayed(snapshots[taken])
        r = cast_fp8(
            x,
            scale[slot : slot + 1],
            plan.forward_dtype,
            transpose=transpose,
            first_step_current=None if count is None else count[slot : slot + 1],
        )
        return Float8Tensor(r.data, r.scale_inv, r.amax, r.data_t)


class _Capturing:
    """The forward context: ``forward`` notes the casts of this thread while it is entered."""

    def __init__(self, forward: ForwardCasts) -> None:
        self._forward = forward

    def __enter__(self) -> None:
        captures.append(self._forward)

    def __exit__(self, *exc: object) -> None:
        captures.remove(self._forward)


class _Recomputing:
    """The recomputation context: the forward's autocast settings, casts from ``replay``."""

    def __init__(self, settings: FP8Settings | None, replay: Replay) -> None:
        self._settings, self._replay = settings, replay
        self._active: Any = None

    def __enter__(self) -> None:
        self._replay.restart()
        self._active = replaying(self._settings, self._replay)
        self._active.__enter__()

    def __exit__(self, *exc: Any) -> None:
        active, self._active = self._active, None
        active.__exit__(*exc)


def activation_checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool = False,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    distribute_saved_activations: bool = False,
    get_rng_state_tracker: Any = None,
    tp_group: Any = None,
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)`` whose activations are recomputed in backward, FP8-aware
    (Transformer Engine's ``te.checkpoint``; fp8kit's ``checkpoint`` module holds the state-dict
    helpers).

    Call it where ``function`` would run: inside ``f8.autocast`` to run it in FP8, or outside with
    an autocast inside ``function``. The recomputation runs under the settings the forward had
    (recipe, group, enabled, calibrating), reads the scales each forward cast read, records no
    amax and joins no update event, so the recomputed FP8 values equal the forward's bit for bit.
    ``function`` must run the same FP8 modules in the same order each time (as
    ``torch.utils.checkpoint`` already requires of its saved tensors).

    Args:
        function: the region to recompute; args / kwargs are passed to it.
        use_reentrant: only False (PyTorch's recommended checkpoint; the reentrant one cannot
            run code around its recomputation).
        preserve_rng_state, determinism_check: as ``torch.utils.checkpoint.checkpoint``.
        distribute_saved_activations, get_rng_state_tracker, tp_group: ``te.checkpoint``'s
            tensor-parallel keywords, taken (not passed to ``function``) so a TE call runs
            unchanged: the first must be False and the second None (fp8kit has no tensor
            parallelism); ``tp_group`` is used by neither then, as in TE.

    Not inside a function that ``torch.compile`` traces, and not around CUDA-graphed or
    compiled FP8 modules (their casts read the live scales).
    """
    if use_reentrant is not False:
        raise ValueError(
            f"use_reentrant must be False, got {use_reentrant!r}: fp8kit recomputes FP8 modules "
            "with the non-reentrant torch.utils.checkpoint only"
        )
    if distribute_saved_activations is not False:
        raise ValueError(
            "distribute_saved_activations must be False, got "
            f"{distribute_saved_activations!r}: fp8kit has no tensor parallelism to distribute "
            "the saved activations over"
        )
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state must be a bool, got {preserve_rng_state!r}")
    if get_rng_state_tracker is not None:
        raise ValueError(
            "get_rng_state_tracker must be None: fp8kit has no tensor-parallel RNG tracker "
            "(preserve_rng_state=True restores torch's RNG state for the recomputation)"
        )
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "activation_checkpoint was called inside a function that torch.compile is tracing: "
            "call it in eager code"
        )
    settings = current_settings()
    forward = ForwardCasts()
    contexts = (_Capturing(forward), _Recomputing(settings, Replay(forward)))
    # The keywords go to ``function`` bound here: passed to torch's checkpoint, the ones it takes
    # itself (``early_stop``, ``debug``, ``context_fn``) would never reach the function.
    region = functools.partial(function, **kwargs) if kwargs else function
    return torch.utils.checkpoint.checkpoint(
        region,
        *args,
        use_reentrant=False,
        context_fn=lambda: contexts,
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
    )

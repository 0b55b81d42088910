"""``f8.autocast``: where FP8 is on, and when delayed-scaling states are updated (docs/semantics.md
sections 3, 8).

Forward states that ran inside the outermost enabled autocast (whatever the grad mode at the call)
are updated together when it exits, if grad mode is on (or it calibrates) at that moment.
Backward states are updated together once per backward pass, from an autograd-engine callback
that runs after the last backward node.

With amax reduction (``torch.distributed``, ``reduce_amax=True``) an update event is a collective,
so it must happen on every rank even where no module of that (recipe, group) ran: the outermost
autocast runs a forward event for every (recipe, group) of an enabled autocast entered in its body
(in order of first entry), and each forward event arms the backward event of its (recipe, group)
for every backward pass until the first training forward exit after one, which starts the next
step's set (decision 0248; see :mod:`fp8kit.torch.state.registry` for what an event reduces).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Recipe
from fp8kit.torch.distributed import check_reduction_group
from fp8kit.torch.plan import RecipePlan, plan_for
from fp8kit.torch.state import ScalingState, update_states

__all__ = [
    "Enrolment",
    "FP8Settings",
    "active_replay",
    "autocast",
    "current_recipe",
    "current_settings",
    "enrol",
    "event_of",
    "fp8_autocast",
    "is_fp8_enabled",
    "recording_enrolments",
    "replaying",
]


@dataclass
class _PendingUpdate:
    """States waiting for one update event of one direction under one (recipe, group)."""

    recipe: DelayedScaling
    group: Any
    direction: str  # "forward" or "backward"
    states: dict[int, ScalingState] = field(default_factory=dict)

    # Never traced: an event runs at an autocast exit or an autograd-engine callback, outside
    # any graph, but Dynamo's frame hook can still be installed there (a compiled function that
    # calls backward(), or a lenient compile around an autocast); compiling the event's
    # bookkeeping would add graphs and graph breaks every step (docs/decisions/0250).
    @torch.compiler.disable
    def run(self) -> None:
        fmt = self.recipe.fp8_format
        fmax = fmt.forward.max if self.direction == "forward" else fmt.backward.max
        update_states(
            list(self.states.values()), self.recipe, fmax, self.group, direction=self.direction
        )


_Pending = dict[tuple[DelayedScaling, int], _PendingUpdate]


def _pending_entry(
    pending: _Pending, recipe: DelayedScaling, group: Any, direction: str
) -> _PendingUpdate:
    """The entry of ``(recipe, group)`` in ``pending``, created (at the end) if absent."""
    key = (recipe, id(group))
    entry = pending.get(key)
    if entry is None:
        entry = pending[key] = _PendingUpdate(recipe, group, direction)
    return entry


@dataclass(frozen=True)
class FP8Settings:
    """What a module call needs from the innermost active autocast.

    Attributes:
        recipe: the recipe to quantize (or calibrate) with.
        group: the amax reduction group (None = WORLD).
        fp8: True when the GEMMs run in FP8; False in a calibration-only region
            (``enabled=False, calibrating=True``: high-precision GEMMs that record amaxes).
        calibrating: record amaxes and update forward scales even without grad.
        plan: ``plan_for(recipe)``.
        event_key: an integer naming ``(recipe, group)`` (:func:`event_of`), for compiled
            graphs, whose ops take ints rather than Python objects.
        forward_states: under delayed scaling, the states (by id) queued for the forward update
            event this body's quantizations join: this thread's queue of ``(recipe, group)``,
            which the outermost enabled autocast runs at its exit, so an enrolment is one dict
            insertion (:func:`register_forward_state`); None otherwise.
        replay: while an activation checkpoint recomputes (:func:`replaying`), the
            :class:`~fp8kit.torch.recompute.Replay` whose snapshots the casts read (they record
            no amax and join no event); None otherwise.

    Autocasts entered with the same arguments on one thread share one settings object.
    """

    recipe: Recipe
    group: Any
    fp8: bool
    calibrating: bool
    plan: RecipePlan
    event_key: int
    forward_states: dict[int, ScalingState] | None = field(default=None, compare=False)
    replay: Any = field(default=None, compare=False)


# (recipe, group) pairs by integer key, both ways (docs/decisions/0233-torch-compile.md); the
# key's entry also holds the recipe's plan, so entering an autocast makes one lookup.
_event_keys: dict[tuple[Recipe, int], tuple[RecipePlan, int]] = {}
_events: dict[int, tuple[Recipe, Any]] = {}


_event_keys_lock = threading.Lock()

# A (recipe, group) keeps its key for good (compiled graphs name it by that integer). A program
# that builds a recipe with a new callable each step (callables compare by identity) makes a new
# key each step; every this many new keys it is told so.
MANY_EVENT_KEYS = 64


def _event_facts(recipe: Recipe, group: Any) -> tuple[RecipePlan, int]:
    """``(plan_for(recipe), event key of (recipe, group))``."""
    facts = _event_keys.get((recipe, id(group)))
    if facts is None:
        with _event_keys_lock:  # threads entering autocasts at once get distinct keys
            facts = _event_keys.get((recipe, id(group)))
            if facts is None:
                key = len(_events) + 1
                _events[key] = (recipe, group)
                facts = _event_keys[(recipe, id(group))] = (plan_for(recipe), key)
                if key % MANY_EVENT_KEYS == 0:
                    warnings.warn(
                        f"fp8kit: f8.autocast has now seen {key} distinct (recipe, "
                        "amax_reduction_group) pairs. Recipes compare by value but their "
                        "callables by identity, so a recipe built with a new lambda (or a new "
                        "group) at each step is a new recipe at each step: fp8kit keeps every "
                        "one and torch.compile recompiles for each. Build the recipe once (a "
                        "sweep over recipes that differ by value on purpose can ignore this).",
                        UserWarning,
                        stacklevel=4,
                    )
    return facts


def event_of(event_key: int) -> tuple[Recipe, Any]:
    """The ``(recipe, group)`` of an :attr:`FP8Settings.event_key`."""
    return _events[event_key]


def enrol(state: ScalingState, event_key: int, backward: bool) -> None:
    """Queue ``state`` for the next update event of its direction under ``event_key``'s
    ``(recipe, group)`` (:func:`schedule_backward_update` or :func:`register_forward_state`)."""
    recipe, group = _events[event_key]
    if backward:
        schedule_backward_update(state, recipe, group)  # type: ignore[arg-type]
    else:
        register_forward_state(state, recipe, group)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Enrolment:
    """One state's place in the next update event of its direction under ``(recipe, group)``."""

    state: ScalingState
    recipe: DelayedScaling
    group: Any
    backward: bool


# While a CUDA graph is captured (fp8kit.torch.graphs) enrolments are recorded here instead of
# acted on, and no update event runs: a replay re-enrols what the capture recorded. Not
# thread-local: the autograd engine runs CUDA backward nodes on its own thread.
_recorders: list[list[Enrolment]] = []


@contextlib.contextmanager
def recording_enrolments() -> Iterator[list[Enrolment]]:
    """Record enrolments (in order, repeats included) instead of acting on them, and run no
    update event, inside the ``with`` body; yields the list they are appended to."""
    record: list[Enrolment] = []
    _recorders.append(record)
    try:
        yield record
    finally:
        _recorders.remove(record)


@dataclass
class _Frame:
    enabled: bool
    recipe: Recipe | None  # None only in a replay of a forward that ran without FP8
    group: Any
    owns_updates: bool
    settings: FP8Settings | None  # None: neither FP8 nor calibration in this body
    forward_pending: _Pending = field(default_factory=dict)


_SettingsEntry = tuple[FP8Settings, _PendingUpdate | None]


class _ThreadState(threading.local):
    """This thread's autocast stack, and what its autocasts reuse from one entry to the next
    (docs/performance.md, "Host time per call").

    ``queues``: the thread's forward queue of each ``(recipe, id(group))``. An outermost enabled
    autocast takes a queue into its ``forward_pending`` (emptied) when a body under it first
    enters that pair, and empties it again at its exit, so a queue holds states only while one
    body runs. ``settings``: the :class:`FP8Settings` of each ``(recipe, id(group), enabled,
    calibrating)`` with the queue it names. Settings are a function of that key, so a module
    knows the same settings from one step to the next (:func:`fp8kit.torch.linear.prepare_run`).
    """

    def __init__(self) -> None:
        self.stack: list[_Frame] = []
        self.queues: _Pending = {}
        self.settings: dict[tuple[Recipe, int, bool, bool], _SettingsEntry] = {}
        self.replay: Any = None  # the recomputation running on this thread (replaying)


_local = _ThreadState()


def _settings_for(recipe: Recipe, group: Any, enabled: bool, calibrating: bool) -> _SettingsEntry:
    """This thread's settings for an active autocast of these arguments, with the forward queue
    its ``forward_states`` belongs to (None for current scaling: no forward event)."""
    key = (recipe, id(group), enabled, calibrating)
    entry = _local.settings.get(key)
    if entry is None:
        queue = None
        if isinstance(recipe, DelayedScaling):
            queue = _forward_queue(recipe, group)
        plan, event_key = _event_facts(recipe, group)
        states = None if queue is None else queue.states
        settings = FP8Settings(recipe, group, enabled, calibrating, plan, event_key, states)
        entry = _local.settings[key] = (settings, queue)
    return entry


def _forward_queue(recipe: DelayedScaling, group: Any) -> _PendingUpdate:
    """This thread's forward queue of ``(recipe, group)`` (created on first use)."""
    return _pending_entry(_local.queues, recipe, group, "forward")


def _join(pending: _Pending, queue: _PendingUpdate) -> None:
    """Take ``queue`` into ``pending`` (the outermost frame's, in order of first entry), emptied,
    unless it is there already."""
    key = (queue.recipe, id(queue.group))
    if pending.get(key) is not queue:
        queue.states.clear()  # left by a body that ended without taking it into its event
        pending[key] = queue


def _active_frame() -> _Frame | None:
    stack = _local.stack
    if stack and stack[-1].enabled:
        return stack[-1]
    return None


def current_settings() -> FP8Settings | None:
    """The settings a module call runs under, or None when neither FP8 nor calibration is on.

    The innermost autocast decides: an enabled one runs FP8 (calibrating or not); a disabled one
    with ``calibrating=True`` runs high precision and records amaxes; a plain disabled one turns
    both off for its body.
    """
    stack = _local.stack
    return stack[-1].settings if stack else None


def is_fp8_enabled() -> bool:
    """Whether code running now is inside an enabled ``f8.autocast``."""
    return _active_frame() is not None


def current_recipe() -> Recipe | None:
    """The recipe of the innermost enabled autocast, or None outside FP8 regions."""
    frame = _active_frame()
    return frame.recipe if frame is not None else None


def register_forward_state(
    state: ScalingState,
    recipe: DelayedScaling,
    group: Any,
    queued: dict[int, ScalingState] | None = None,
) -> None:
    """Queue ``state`` for the forward update at the exit of the outermost enabled autocast.

    Called for every recording quantization, whatever the grad mode at the module call: the
    exit of the outermost enabled autocast runs the event when grad mode (or calibration) is on
    there, as Transformer Engine's does; under ``torch.no_grad()`` at the exit the staging row
    keeps accumulating and nothing rolls (docs/semantics.md section 3). ``queued``: the
    :attr:`FP8Settings.forward_states` of the autocast the call runs in (the same queue, found
    at its entry), or None to look it up.
    """
    if _recorders:
        _recorders[-1].append(Enrolment(state, recipe, group, False))
        return
    if queued is None:
        owner = _owner_frame()
        if owner is None:
            return
        queue = _forward_queue(recipe, group)
        _join(owner.forward_pending, queue)
        queued = queue.states
    queued.setdefault(id(state), state)


def _owner_frame(stack: list[_Frame] | None = None) -> _Frame | None:
    """The outermost enabled frame of ``stack`` (default: this thread's), which runs the
    forward updates at its exit."""
    for frame in _local.stack if stack is None else stack:
        if frame.owns_updates:
            return frame
    return None


class autocast(contextlib.ContextDecorator):
    """Run FP8-capable modules in FP8 inside this context.

    Args:
        enabled: False runs the modules in high precision (a nested ``enabled=False`` switches FP8
            off for its body).
        recipe: :class:`~fp8kit.recipe.DelayedScaling` (default ``DelayedScaling()``) or
            :class:`~fp8kit.recipe.Float8CurrentScaling`.
        amax_reduction_group: ``torch.distributed`` process group whose ranks share amaxes when
            ``recipe.reduce_amax`` is set (None = WORLD).
        calibrating: record amaxes and update the forward scales even under ``torch.no_grad()``
            (inference calibration). With ``enabled=False`` the GEMMs run in high precision while
            the amaxes of their inputs and weights are recorded, as Transformer Engine's
            calibration mode (docs/semantics.md section 3).

    At the exit of the outermost enabled (or calibrating) autocast, if grad mode is on or it
    calibrates, the forward states of all modules that ran are updated in one batched operation
    per (recipe, group). If the body raises, no update runs: what was recorded stays staged and
    joins the next update event.
    """

    def __init__(
        self,
        enabled: bool = True,
        recipe: Recipe | None = None,
        amax_reduction_group: Any = None,
        calibrating: bool = False,
    ) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {enabled!r}")
        if not isinstance(calibrating, bool):
            raise TypeError(f"calibrating must be a bool, got {calibrating!r}")
        recipe = _checked_recipe("recipe", recipe)
        if calibrating and not isinstance(recipe, DelayedScaling):
            raise ValueError(
                "calibrating=True needs a DelayedScaling recipe (current scaling keeps no scales "
                f"to calibrate), got {type(recipe).__name__}"
            )
        check_reduction_group("amax_reduction_group", amax_reduction_group)
        if amax_reduction_group is not None and isinstance(recipe, Float8CurrentScaling):
            warnings.warn(
                "fp8kit: amax_reduction_group has no effect with Float8CurrentScaling: each rank "
                "scales every tensor by its own amax (docs/semantics.md section 1)",
                # point at the user's line, also when the call came through fp8_autocast
                stacklevel=3 if sys._getframe(1).f_code is fp8_autocast.__code__ else 2,
            )
        self.enabled = enabled
        self.recipe = recipe
        self.group = amax_reduction_group
        self.calibrating = calibrating
        self._frames: list[_Frame] = []
        self._mha_fastpath: list[bool] = []

    def __enter__(self) -> autocast:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "f8.autocast was entered inside a function that torch.compile is tracing: enter "
                "it around the compiled call instead (its update events run at its exit, outside "
                "the graph; docs/decisions/0233-torch-compile.md)"
            )
        stack = _local.stack
        active = self.enabled or self.calibrating
        owner = _owner_frame(stack)
        replay = _local.replay
        owns = active and owner is None and replay is None
        forward_pending: _Pending = {}
        settings = None
        if active:
            settings, queue = _settings_for(self.recipe, self.group, self.enabled, self.calibrating)
            if replay is not None:  # a recomputation: no enrolment, no event (replaying)
                settings = _replayed(settings, replay)
            elif queue is not None:
                # Every rank enters the same autocasts, so this fixes the same events, in the
                # same order, on every rank, whichever modules run (needed when events are
                # collectives).
                _join(forward_pending if owner is None else owner.forward_pending, queue)
        frame = _Frame(self.enabled, self.recipe, self.group, owns, settings, forward_pending)
        stack.append(frame)
        self._frames.append(frame)
        # PyTorch's fused encoder fast path (nn.TransformerEncoderLayer in eval, no grad) calls
        # its kernel with the attention's parameters and would skip f8.MultiheadAttention's FP8
        # projections: it is off while FP8 or calibration is on (docs/te_modules.md).
        self._mha_fastpath.append(torch.backends.mha.get_fastpath_enabled())
        if active:
            torch.backends.mha.set_fastpath_enabled(False)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        frame = self._frames.pop()
        _pop_frame(frame)
        torch.backends.mha.set_fastpath_enabled(self._mha_fastpath.pop())
        if not frame.owns_updates:
            return
        try:
            if exc_type is None and not _recorders:
                training = torch.is_grad_enabled()
                if training or self.calibrating:
                    for pending in frame.forward_pending.values():
                        pending.run()
                        if training:
                            _arm_backward_update(pending.recipe, pending.group)
        finally:
            for pending in frame.forward_pending.values():
                pending.states.clear()  # the thread's queues hold no module between bodies


def _pop_frame(frame: _Frame) -> None:
    """Remove ``frame``, which must be the top of this thread's stack."""
    stack = _local.stack
    if not stack or stack[-1] is not frame:
        raise RuntimeError("fp8kit.torch.autocast contexts were exited out of order")
    stack.pop()


def _replayed(settings: FP8Settings, replay: Any) -> FP8Settings:
    """``settings`` for a recomputation: casts read ``replay``, nothing is enrolled."""
    return replace(settings, forward_states=None, replay=replay)


def active_replay() -> Any:
    """The recomputation running on this thread (:func:`replaying`), or None."""
    return _local.replay


@contextlib.contextmanager
def replaying(settings: FP8Settings | None, replay: Any) -> Iterator[None]:
    """Run the body as the recomputation of a forward that ran under ``settings`` (None: neither
    FP8 nor calibration), for :func:`fp8kit.torch.recompute.activation_checkpoint`.

    Module calls in the body get ``settings`` with ``replay`` attached: their casts read the
    forward's scales from it, record no amax and join no update event. An autocast entered in
    the body does the same with its own settings and runs no event at its exit.
    """
    frame = _Frame(
        settings is not None and settings.fp8,
        None if settings is None else settings.recipe,
        None if settings is None else settings.group,
        False,
        None if settings is None else _replayed(settings, replay),
    )
    outer_replay = _local.replay
    fastpath = torch.backends.mha.get_fastpath_enabled()
    _local.replay = replay
    _local.stack.append(frame)
    if settings is not None:
        torch.backends.mha.set_fastpath_enabled(False)  # as autocast.__enter__
    try:
        yield
    finally:
        _pop_frame(frame)
        _local.replay = outer_replay
        torch.backends.mha.set_fastpath_enabled(fastpath)


def _checked_recipe(name: str, recipe: Any) -> Recipe:
    """``recipe`` (``DelayedScaling()`` for None) if it is an fp8kit recipe, else a TypeError
    naming the parameter ``name``."""
    if recipe is None:
        return DelayedScaling()
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError(
            f"{name} must be None, a fp8kit.recipe.DelayedScaling or a "
            f"fp8kit.recipe.Float8CurrentScaling, got {type(recipe).__name__}"
        )
    return recipe


def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Recipe | None = None,
    fp8_group: Any = None,
) -> autocast:
    """Transformer Engine's spelling of :class:`autocast` (``te.fp8_autocast``).

    ``fp8_autocast(enabled, calibrating, fp8_recipe, fp8_group)`` is
    ``autocast(enabled, recipe=fp8_recipe, amax_reduction_group=fp8_group,
    calibrating=calibrating)``.
    """
    # named as the caller spelled them
    _checked_recipe("fp8_recipe", fp8_recipe)
    check_reduction_group("fp8_group", fp8_group)
    return autocast(
        enabled, recipe=fp8_recipe, amax_reduction_group=fp8_group, calibrating=calibrating
    )


# ---------------------------------------------------------------------------------------------
# Backward updates: one per backward pass, after the last FP8 backward node has run.

_backward_lock = threading.Lock()
# The (recipe, group) events every backward pass runs, in first-arming order, and the states each
# pass reached. An entry stays armed after its event, so every backward pass of a step runs the
# same events on every rank (several passes after one forward, or microbatches whose forwards all
# ran before their backwards); the first training forward exit after a pass starts the next
# step's set (decision 0248).
_backward_pending: _Pending = {}
_backward_pass_ran = False
# The autograd graph task (``torch._C._current_graph_task_id()``) whose end runs the pending
# backward events, None when no callback is queued. A pass that raised never runs its callback:
# the next pass, another task, queues its own, and its event takes the failed pass's staged
# amaxes too (as a forward body that raised leaves its amaxes for the next forward event).
_backward_callback_task: int | None = None


def _take_backward_events() -> list[_PendingUpdate]:
    """The armed events with the states staged for them, leaving each entry armed and empty.
    Call with ``_backward_lock`` held."""
    taken = list(_backward_pending.values())
    for key, entry in _backward_pending.items():
        _backward_pending[key] = _PendingUpdate(entry.recipe, entry.group, entry.direction)
    return taken


@torch.compiler.disable  # as _PendingUpdate.run
def _flush_backward_updates() -> None:
    global _backward_callback_task, _backward_pass_ran
    with _backward_lock:
        events = _take_backward_events()
        _backward_callback_task = None
        _backward_pass_ran = True
    for entry in events:
        entry.run()


def _arm_backward_update(recipe: DelayedScaling, group: Any) -> None:
    """Make the backward passes of this step run the backward event of ``(recipe, group)``.

    With amax reduction this keeps ranks in step when a backward pass reaches modules of
    ``(recipe, group)`` on some ranks only (the pass must reach some FP8 module on every rank).
    Without reduction an event with no states is a no-op.
    """
    global _backward_pass_ran
    with _backward_lock:
        if _backward_pass_ran:  # a new step: its forwards arm its events (staged states stay)
            for key in [k for k, entry in _backward_pending.items() if not entry.states]:
                del _backward_pending[key]
            _backward_pass_ran = False
        _pending_entry(_backward_pending, recipe, group, "backward")


def _in_compiled_autograd() -> bool:
    """Whether this backward pass runs as a compiled-autograd graph (looked up without importing
    torch._dynamo: it is imported by then if it does)."""
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(compiled_autograd, "in_compiled_autograd_region", False))


def schedule_backward_update(state: ScalingState, recipe: DelayedScaling, group: Any) -> None:
    """Queue ``state`` for the backward update that runs when this backward pass ends."""
    global _backward_callback_task
    if _recorders:
        _recorders[-1].append(Enrolment(state, recipe, group, True))
        return
    if _in_compiled_autograd():
        raise RuntimeError(
            "fp8kit: this backward pass runs under compiled autograd "
            "(torch._dynamo.config.compiled_autograd), which never runs the engine callback "
            "that holds fp8kit's backward update event, so the gradient scales would never "
            "update. Run the backward pass without compiled autograd (docs/semantics.md section "
            "11)"
        )
    task = torch._C._current_graph_task_id()
    with _backward_lock:
        _pending_entry(_backward_pending, recipe, group, "backward").states.setdefault(
            id(state), state
        )
        if _backward_callback_task == task:
            return
        _backward_callback_task = task
    try:
        torch.autograd.Variable._execution_engine.queue_callback(_flush_backward_updates)
    except RuntimeError:
        # Not inside the autograd engine (a backward called by hand): update right away.
        _flush_backward_updates()

"""CUDA graphs of FP8 modules: Transformer Engine's ``make_graphed_callables``
(docs/decisions/0234-cuda-graphs.md).

A CUDA graph replays kernels, not Python, so the host work of a delayed-scaling call (enrolling
each scaling state in its next update event) would be lost on replay. This module captures the
modules with :func:`torch.cuda.make_graphed_callables` inside an autocast while recording those
enrolments, then wraps each graphed module so a replay re-enrols what the capture recorded: the
forward states at the call, the backward states when the backward pass reaches the module. The
update events themselves run outside the graphs (autocast exit, end of backward) and change the
scales in place, which the graphs read on their next replay.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Recipe
from fp8kit.torch.autocast import (
    Enrolment,
    autocast,
    current_settings,
    recording_enrolments,
    register_forward_state,
    schedule_backward_update,
)
from fp8kit.torch.distributed import check_reduction_group
from fp8kit.torch.recompute import check_not_checkpointed
from fp8kit.torch.state import FP8Meta, ScalingState, bind_recipe, pool_states
from fp8kit.torch.state.buffers import buffer_generation

__all__ = ["make_graphed_callables"]

_CAPTURED_BUFFERS = ("amax_history", "scale", "update_count")  # what a graph reads or writes
_partitions = itertools.count(1)  # ScalingState.pool_partition of each capture's states


def make_graphed_callables(
    modules: nn.Module | tuple[nn.Module, ...],
    sample_args: tuple[Any, ...],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    *,
    fp8_enabled: bool = False,
    fp8_calibrating: bool = False,
    fp8_recipe: Recipe | None = None,
    fp8_group: Any = None,
    pool: Any = None,
) -> nn.Module | tuple[nn.Module, ...]:
    """CUDA-graph ``modules`` (forward and backward), FP8 modules included, as Transformer Engine's
    ``te.make_graphed_callables``.

    Args:
        modules: an ``nn.Module`` or a tuple of them (no hooks, as torch requires).
        sample_args: the positional CUDA tensors of one call (a tuple), or one such tuple per
            module when ``modules`` is a tuple. Replays must use the same shapes and dtypes.
        num_warmup_iters, allow_unused_input, pool: as :func:`torch.cuda.make_graphed_callables`.
        fp8_enabled: capture inside ``f8.autocast(recipe=fp8_recipe)`` (False: high precision).
        fp8_calibrating: capture with ``calibrating=True`` (TE's calibration mode).
        fp8_recipe: the recipe the graphs are captured with (default ``DelayedScaling()``).
        fp8_group: the amax reduction group of that recipe.

    Returns:
        The modules (or module), their ``forward`` replaced by graph replays. Call them inside
        an ``f8.autocast`` with the capture's settings (``enabled=fp8_enabled``,
        ``calibrating=fp8_calibrating``, ``recipe=fp8_recipe``, ``amax_reduction_group=fp8_group``;
        anything else raises, except for a high-precision capture, both flags False, which
        replays anywhere), so the update events run. The FP8 state is the same before and
        after this function (warm-up and capture leave no trace). A replay raises if the FP8
        buffers the graphs hold were replaced (``.to()``, a load with another history length);
        FP8 modules created later do not move them (they use other pools).
    """
    single = isinstance(modules, nn.Module)
    module_list = (modules,) if single else modules
    if not isinstance(module_list, tuple) or not all(isinstance(m, nn.Module) for m in module_list):
        raise TypeError(
            f"modules must be an nn.Module or a tuple of nn.Modules, got {type(modules).__name__}"
        )
    args_list = (sample_args,) if single else sample_args
    if (
        not isinstance(args_list, tuple)
        or len(args_list) != len(module_list)
        or not all(isinstance(a, tuple) for a in args_list)
    ):
        raise ValueError(
            f"sample_args must be a tuple of tensors for one module, or one such tuple per module "
            f"({len(module_list)}), got {type(sample_args).__name__}"
        )
    for name, flag in (("fp8_enabled", fp8_enabled), ("fp8_calibrating", fp8_calibrating)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    recipe = DelayedScaling() if fp8_recipe is None else fp8_recipe
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError(
            "fp8_recipe must be None, a DelayedScaling or a Float8CurrentScaling, got "
            f"{type(recipe).__name__}"
        )
    if fp8_calibrating and not isinstance(recipe, DelayedScaling):
        raise ValueError(
            "fp8_calibrating=True needs a DelayedScaling fp8_recipe (current scaling keeps no "
            f"scales to calibrate), got {type(recipe).__name__}"
        )

    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int):
        raise TypeError(f"num_warmup_iters must be an int >= 0, got {num_warmup_iters!r}")
    if num_warmup_iters < 0:
        raise ValueError(f"num_warmup_iters must be an int >= 0, got {num_warmup_iters}")
    if not isinstance(allow_unused_input, bool):
        raise TypeError(f"allow_unused_input must be a bool, got {allow_unused_input!r}")
    check_reduction_group("fp8_group", fp8_group)

    metas = [m for module in module_list for m in module.modules() if isinstance(m, FP8Meta)]
    states = [s for m in metas for s in (m.forward, m.backward)]
    placements = [state.placement() for state in states]  # put back if the capture fails
    if isinstance(recipe, DelayedScaling) and (fp8_enabled or fp8_calibrating):
        partition = next(_partitions)  # a pool no later module joins: the addresses stay put
        for meta in metas:
            bind_recipe(meta, recipe)
            meta.forward.pool_partition = meta.backward.pool_partition = partition
        pool_states([m.forward for m in metas], recipe, fp8_group, "forward")
        pool_states([m.backward for m in metas], recipe, fp8_group, "backward")
    saved = [[state._buffers[n].clone() for n in _CAPTURED_BUFFERS] for state in states]

    settings = {
        "enabled": fp8_enabled,
        "recipe": recipe,
        "amax_reduction_group": fp8_group,
        "calibrating": fp8_calibrating,
    }
    originals = [module.__dict__.get("forward") for module in module_list]
    for module in module_list:
        module.forward = _in_autocast(module.forward, settings)
    captured = False
    try:
        with recording_enrolments() as record:
            torch.cuda.make_graphed_callables(
                module_list,
                args_list,
                num_warmup_iters=num_warmup_iters,
                allow_unused_input=allow_unused_input,
                pool=pool,
            )
        captured = True
    except BaseException:
        for module, original in zip(module_list, originals, strict=True):
            _restore_forward(module, original)
        raise
    finally:
        # Warm-up and capture leave the FP8 state as it was; a failed capture also leaves the
        # buffers, pools and recipe binding it found.
        with torch.no_grad():
            for state, buffers, placement in zip(states, saved, placements, strict=True):
                if captured:
                    for name, value in zip(_CAPTURED_BUFFERS, buffers, strict=True):
                        state._buffers[name].copy_(value)
                else:
                    state.restore_placement(placement)
                state.refresh_derived()

    watch = _BufferWatch(states)
    for module in module_list:
        own = {
            id(s)
            for m in module.modules()
            if isinstance(m, FP8Meta)
            for s in (m.forward, m.backward)
        }
        mine = [e for e in record if id(e.state) in own]
        module.forward = _Replay(
            module.forward,
            _unique(mine, False),
            _unique(mine, True),
            (fp8_enabled, fp8_calibrating, recipe, fp8_group),
            watch,
        )
    return module_list[0] if single else module_list


def _in_autocast(forward: Callable[..., Any], settings: dict[str, Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with autocast(**settings):
            return forward(*args, **kwargs)

    return run


def _restore_forward(module: nn.Module, original: Callable[..., Any] | None) -> None:
    if original is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = original


def _unique(record: list[Enrolment], backward: bool) -> tuple[Enrolment, ...]:
    """The enrolments of one direction, first occurrence of each state kept, in order."""
    seen: dict[int, Enrolment] = {}
    for e in record:
        if e.backward is backward:
            seen.setdefault(id(e.state), e)
    return tuple(seen.values())


class _BufferWatch:
    """The FP8 buffers the graphs captured; :meth:`check` raises if any was replaced since."""

    def __init__(self, states: list[ScalingState]) -> None:
        self.generation = buffer_generation()
        self.buffers = [(s, [s._buffers[n] for n in _CAPTURED_BUFFERS]) for s in states]

    def check(self) -> None:
        if buffer_generation() == self.generation:  # nothing anywhere replaced a buffer
            return
        for state, captured in self.buffers:
            for name, tensor in zip(_CAPTURED_BUFFERS, captured, strict=True):
                if state._buffers[name] is not tensor:
                    raise RuntimeError(
                        f"fp8kit: the {name} buffer of {state.label or 'an FP8 state'} was "
                        "replaced after its CUDA graph was captured (.to(), a load with another "
                        "history length, or a graphed module deleted, which re-lays the pool), so "
                        "the graph would read stale scales: capture again with "
                        "make_graphed_callables"
                    )
        self.generation = buffer_generation()  # replaced buffers were not ours


class _Replay:
    """A graphed forward that re-enrols, on each replay, what its capture enrolled.

    ``settings``: ``(enabled, calibrating, recipe, group)`` of the capture's autocast; unless
    the capture ran in high precision, a replay needs an active autocast with exactly these.
    """

    def __init__(
        self,
        graphed: Callable[..., Any],
        forward: tuple[Enrolment, ...],
        backward: tuple[Enrolment, ...],
        settings: tuple[bool, bool, Recipe, Any],
        watch: _BufferWatch,
    ) -> None:
        self.graphed = graphed
        self.forward = forward
        self.backward = backward
        self.settings = settings
        self.watch = watch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        enabled, calibrating, recipe, group = self.settings
        if not (enabled or calibrating):  # a high-precision capture: nothing of fp8kit's to check
            return self.graphed(*args, **kwargs)
        check_not_checkpointed("a CUDA-graphed FP8 module")
        self.watch.check()
        active = current_settings()
        if (
            active is None
            or (active.fp8, active.calibrating) != (enabled, calibrating)
            or active.recipe != recipe
            or active.group is not group
        ):
            now = (
                "no f8.autocast is active"
                if active is None
                else f"the active one has enabled={active.fp8}, calibrating={active.calibrating}, "
                f"recipe={active.recipe!r}, amax_reduction_group={active.group!r}"
            )
            raise ValueError(
                "this module was graphed inside f8.autocast(enabled="
                f"{enabled}, calibrating={calibrating}, recipe={recipe!r}, "
                f"amax_reduction_group={group!r}), but {now}: call it under the settings it "
                "was captured with (the graph holds their FP8 casts)"
            )
        out = self.graphed(*args, **kwargs)
        grad = torch.is_grad_enabled()
        # As in an eager call, whatever the grad mode: the autocast's exit decides.
        for e in self.forward:
            register_forward_state(e.state, e.recipe, e.group)
        if not (grad and self.backward):
            return out
        # The replay runs no Python in backward: a hook on each output that takes a gradient
        # enrols the backward states when the gradient reaches it (idempotent per state).
        for t in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._enrol_backward)
        return out

    def _enrol_backward(self, grad: torch.Tensor) -> None:
        """Tensor hook: queue the capture's backward states for this backward pass's update
        event; the gradient passes unchanged."""
        for e in self.backward:
            schedule_backward_update(e.state, e.recipe, e.group)

"""Triton launches with less host work per call (docs/performance.md, "Host time").

``kernel[grid](*args)`` works out on every call what its compiled kernel is specialised on (each
argument's type, each pointer's 16-byte alignment, each integer's divisibility by 16 and equality
to 1), hashes that into its cache key and looks the kernel up: tens of microseconds of Python per
launch, measured on an H200's host (docs/benchmarks.md), for casts that take a few microseconds on
the device. A launch site that sees the same kinds of argument again and again (the modules' hot
path) can reuse what the first launch found: :func:`launch` keeps the compiled kernel's launcher
per key and calls it directly.

The key is finer than Triton's specialisation, so a hit never runs a kernel compiled under other
assumptions: the grid, the options, the device of the first tensor argument (a launch's tensors
share one device, the one its kernel runs on), each tensor's dtype and whether its address is a
multiple of 16, and every other argument's value (a new size is a new key). Building it costs a few
microseconds per launch (docs/decisions/0255-graphed-gpt-benchmark.md). A first launch whose result
is not a compiled kernel (the interpreter's, ``TRITON_INTERPRET=1``) keeps that key on the plain
path. A call site whose launches differ only in tensor addresses (a prepared cast, the update
event) takes a :class:`LaunchSite`, which builds a key only when an alignment changes. A kept
launcher that raises (a Triton release whose launchers take other arguments) turns the cache off
for the process with one :class:`NativeKernelWarning`, and that launch goes through Triton.
``FP8KIT_TRITON_FAST_LAUNCH=0`` in the environment turns it off.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from fp8kit.torch.kernels._native import NativeKernelWarning, env_flag

__all__ = [
    "MAX_ENTRIES",
    "LaunchSite",
    "bind",
    "clear",
    "fast_launch_enabled",
    "launch",
    "launch_key",
]

MAX_ENTRIES = 4096
"""Launchers kept before the cache starts over (a new size is a new key)."""

# key -> the compiled kernel's launcher for that grid, or None: launch this key the plain way
_launchers: dict[Hashable, Callable[..., Any] | None] = {}
_UNSEEN = object()
_enabled = env_flag("FP8KIT_TRITON_FAST_LAUNCH", True)
# Bumped by clear() and when the cache turns off: what a LaunchSite kept under an older
# generation is forgotten.
_generation = 0


def fast_launch_enabled() -> bool:
    """Whether :func:`launch` reuses compiled kernels' launchers (``FP8KIT_TRITON_FAST_LAUNCH``)."""
    return _enabled


def clear() -> None:
    """Forget every kept launcher, those of :class:`LaunchSite` objects included (the next
    launch of each key goes through Triton again)."""
    global _generation
    _generation += 1
    _launchers.clear()


# Python scalars are most of a launch's arguments; a set test of their class is several times
# cheaper than isinstance(arg, torch.Tensor), whose metaclass check costs about 0.1 us.
_SCALARS = frozenset((int, bool, float))


def _argument_key(arg: object) -> Hashable:
    """A non-scalar argument's part of the key: a tensor's dtype and 16-byte alignment, any
    other object itself."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    return arg


def _device(args: Sequence[object]) -> int:
    """The device index of the first tensor in ``args`` (-1 for a CPU tensor or none)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.get_device()
    return -1


def launch_key(
    kernel: Any,
    grid: tuple[int, ...],
    args: Sequence[object],
    options: dict[str, object],
    device: int | None = None,
) -> Hashable:
    """The key :func:`launch` keeps a launcher under (see the module docstring); ``device``:
    ``args``' device index when the caller has it already."""
    head = (kernel, grid, tuple(options.items()), _device(args) if device is None else device)
    try:  # the arguments of fp8kit's launches: Python scalars and tensors, inline
        return (
            *head,
            *[a if a.__class__ in _SCALARS else (a.dtype, a.data_ptr() % 16 == 0) for a in args],
        )
    except AttributeError:  # another kind of argument: the general form, same parts
        return (*head, *map(_argument_key, args))


def launch(kernel: Any, grid: tuple[int, ...], args: Sequence[object], **options: object) -> None:
    """``kernel[grid](*args, **options)``, through the kept launcher when this key ran before.

    Args:
        kernel: a ``triton.jit`` function.
        grid: program counts, 1 to 3 ints.
        args: every kernel parameter in order, the ``tl.constexpr`` ones included (what the
            compiled kernel's launcher takes): tensors, all on the device the kernel runs on,
            and Python scalars.
        options: launch options (``num_warps``, ``enable_fp_fusion``...), the same at a call site.

    Triton launches on the current CUDA device (its stream, the kernel loaded for it): a launch
    whose tensors are on another GPU makes their device current for the launch.
    """
    index = _device(args)
    if index >= 0 and index != torch.cuda.current_device():
        with torch.cuda.device(index):
            _launch_here(kernel, grid, args, options, index)
        return
    _launch_here(kernel, grid, args, options, index)


def _launch_here(
    kernel: Any,
    grid: tuple[int, ...],
    args: Sequence[object],
    options: dict[str, object],
    index: int,
) -> None:
    """:func:`launch` on the current device (``index``: the tensors' device)."""
    if not _enabled:
        kernel[grid](*args, **options)
        return
    key = launch_key(kernel, grid, args, options, index)
    launcher = _launchers.get(key, _UNSEEN)
    if launcher is _UNSEEN:
        compiled = kernel[grid](*args, **options)
        if len(_launchers) >= MAX_ENTRIES:
            _launchers.clear()
        # the compiled kernel's launcher reads three program counts
        full_grid = (*grid, 1, 1)[:3]
        _launchers[key] = compiled[full_grid] if hasattr(compiled, "launch_metadata") else None
    elif launcher is None:
        kernel[grid](*args, **options)
    else:
        try:
            launcher(*args)  # type: ignore[operator]
        except Exception as exc:  # a Triton whose launcher takes other arguments: its JIT path
            _give_up(exc)
            kernel[grid](*args, **options)


class LaunchSite:
    """The launches of one kernel from one call site: fixed grid and options, and arguments that
    keep their kinds and values from call to call except the addresses of some tensors (fresh
    outputs, a new input of the same shape). The caller passes those tensors' 16-byte
    alignments as ``aligned``; everything else in the key must not change.

    The first launch of an alignment pattern goes through :func:`launch`; the site then keeps
    that key's launcher, and later launches with the same pattern call it without building a key
    (several microseconds per launch, docs/decisions/0262-bound-triton-launches.md). A key that
    runs the plain way (the interpreter's) stays on :func:`launch`, as does every launch while
    the cache is off."""

    __slots__ = ("_grid", "_kept", "_kernel", "_options")

    def __init__(self, kernel: Any, grid: tuple[int, ...], **options: object) -> None:
        self._kernel, self._grid, self._options = kernel, grid, options
        # (generation, alignment pattern, launcher or None for a plain key, device index), one
        # tuple so that threads sharing the site never pair a launcher with another pattern
        self._kept: tuple[int, tuple[bool, ...], Callable[..., Any] | None, int] | None = None

    def __call__(self, args: tuple, aligned: tuple[bool, ...] = ()) -> None:
        kept = self._kept
        if kept is None or kept[0] != _generation or kept[1] != aligned or kept[2] is None:
            launch(self._kernel, self._grid, args, **self._options)
            if _enabled and (kept is None or kept[0] != _generation or kept[1] != aligned):
                key = launch_key(self._kernel, self._grid, args, self._options)
                self._kept = (_generation, aligned, _launchers.get(key), _device(args))
            return
        index = kept[3]
        if index >= 0 and index != torch.cuda.current_device():  # as launch does
            with torch.cuda.device(index):
                self._call_kept(kept[2], args)
        else:
            self._call_kept(kept[2], args)

    def _call_kept(self, launcher: Callable[..., Any], args: tuple) -> None:
        try:
            launcher(*args)
        except Exception as exc:  # as in launch: Triton's JIT path from now on
            _give_up(exc)
            self._kernel[self._grid](*args, **self._options)


def bind(
    kernel: Any, grid: tuple[int, ...], args: Sequence[object], **options: object
) -> Callable[[], None]:
    """:func:`launch` with every argument fixed, as a function of no arguments: a
    :class:`LaunchSite` whose arguments never change (the update event's bound tensors and
    rule). The tensors in ``args`` are held, so their storage outlives the function."""
    return functools.partial(LaunchSite(kernel, grid, **options), tuple(args))


def _give_up(exc: Exception) -> None:
    """Turn the cache off for this process, with one warning saying why."""
    global _enabled, _generation
    _enabled = False
    _generation += 1
    _launchers.clear()
    warnings.warn(
        "fp8kit: calling a compiled Triton kernel's launcher directly failed, so fp8kit launches "
        f"through Triton's JIT from now on (same kernels, more host time). Reason: "
        f"{type(exc).__name__}: {exc}",
        NativeKernelWarning,
        stacklevel=3,
    )

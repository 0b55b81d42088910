"""Triton launches with less host work per call (docs/performance.md, "Host time").

``kernel[grid](*args)`` works out on every call what its compiled kernel is specialised on
(each argument's type, each pointer's 16-byte alignment, each integer's divisibility by 16 and
equality to 1), hashes that into its cache key and looks the kernel up: tens of microseconds of
Python per launch, measured on an H200's host (docs/benchmarks.md), for casts that take a few
microseconds on the device. A launch site that sees the same kinds of argument again and again
(the modules' hot path) can reuse what the first launch found: :func:`launch` keeps the compiled
kernel's launcher per key and calls it directly.

The key is finer than Triton's specialisation, so a hit never runs a kernel compiled under other
assumptions: the grid, the options, each tensor's dtype, device and whether its address is a
multiple of 16, and every other argument's value (a new size is a new key). A first launch
whose result is not a compiled kernel (the interpreter's, ``TRITON_INTERPRET=1``) keeps that key
on the plain path. ``FP8KIT_TRITON_FAST_LAUNCH=0`` in the environment turns the cache off.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

__all__ = ["MAX_ENTRIES", "clear", "fast_launch_enabled", "launch"]

MAX_ENTRIES = 4096
"""Launchers kept before the cache starts over (a new size is a new key)."""

# key -> the compiled kernel's launcher for that grid, or None: launch this key the plain way
_launchers: dict[Hashable, Callable[..., Any] | None] = {}
_UNSEEN = object()
_enabled = os.environ.get("FP8KIT_TRITON_FAST_LAUNCH", "1") != "0"


def fast_launch_enabled() -> bool:
    """Whether :func:`launch` reuses compiled kernels' launchers (``FP8KIT_TRITON_FAST_LAUNCH``)."""
    return _enabled


def clear() -> None:
    """Forget every kept launcher (the next launch of each key goes through Triton again)."""
    _launchers.clear()


def _argument_key(arg: object) -> Hashable:
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.get_device(), arg.data_ptr() % 16 == 0)
    return arg  # ints, bools and floats: their values


def launch(kernel: Any, grid: tuple[int, ...], args: Sequence[object], **options: object) -> None:
    """``kernel[grid](*args, **options)``, through the kept launcher when this key ran before.

    Args:
        kernel: a ``triton.jit`` function.
        grid: program counts, 1 to 3 ints.
        args: every kernel parameter in order, the ``tl.constexpr`` ones included (what the
            compiled kernel's launcher takes).
        options: launch options (``num_warps``, ``enable_fp_fusion``...), the same at a call site.
    """
    if not _enabled:
        kernel[grid](*args, **options)
        return
    key = (kernel, grid, tuple(options.items()), *map(_argument_key, args))
    launcher = _launchers.get(key, _UNSEEN)
    if launcher is _UNSEEN:
        compiled = kernel[grid](*args, **options)
        if len(_launchers) >= MAX_ENTRIES:
            _launchers.clear()
        _launchers[key] = compiled[grid] if hasattr(compiled, "launch_metadata") else None
    elif launcher is None:
        kernel[grid](*args, **options)
    else:
        launcher(*args)  # type: ignore[operator]

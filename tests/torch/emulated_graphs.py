"""A CPU stand-in for ``torch.cuda.make_graphed_callables`` (tests of CUDA-graphed FP8 modules).

A CUDA graph replays kernels and none of our Python. The stand-in has that property: warm-up
runs as torch's (forward, and a backward with ones that leaves ``.grad`` alone), then every
"replay" runs the module's kernels with all fp8kit host work (enrolments, update events)
recorded and dropped, forward and backward. What makes graphed FP8 modules train with the
numbers of eager ones is then fp8kit's own wrapper (docs/decisions/0234-cuda-graphs.md).
Install it with the ``emulated_graphs`` fixture (``tests/torch/conftest.py``) or
``monkeypatch.setattr(torch.cuda, "make_graphed_callables", emulated_make_graphed_callables)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fp8kit.torch.autocast import recording_enrolments

__all__ = ["emulated_make_graphed_callables"]


class _EmulatedGraph(torch.autograd.Function):
    """Forward and backward of ``fn`` with fp8kit's host work dropped, as a graph replay."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], n_args: int, *flat: torch.Tensor) -> Any:  # type: ignore[override]
        args, params = flat[:n_args], flat[n_args:]
        with torch.enable_grad(), recording_enrolments():
            inputs = [a.detach().requires_grad_(a.requires_grad) for a in args]
            out = fn(*inputs)
        ctx.saved = (inputs, params, out)
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        inputs, params, out = ctx.saved
        wanted = [t for t in (*inputs, *params) if t.requires_grad]
        with recording_enrolments():
            grads = iter(torch.autograd.grad(out, wanted, grad))
        return (None, None, *(next(grads) if t.requires_grad else None for t in (*inputs, *params)))


def emulated_make_graphed_callables(
    callables: tuple[torch.nn.Module, ...],
    sample_args: tuple[tuple[torch.Tensor, ...], ...],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Any = None,
) -> tuple[torch.nn.Module, ...]:
    """``torch.cuda.make_graphed_callables`` in its tuple form (modules with one output)."""
    for module, args in zip(callables, sample_args, strict=True):
        params = tuple(p for p in module.parameters() if p.requires_grad)
        for _ in range(num_warmup_iters):  # as torch: forward and a backward with ones
            out = module(*args)
            torch.autograd.grad(out, params, torch.ones_like(out))
        eager = module.forward

        def replay(*a: torch.Tensor, fn: Callable[..., Any] = eager, ps: Any = params) -> Any:
            return _EmulatedGraph.apply(fn, len(a), *a, *ps)

        module.forward = replay
    return callables

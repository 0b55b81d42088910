"""A CPU stand-in for ``torch.cuda.make_graphed_callables`` (tests of CUDA-graphed FP8 modules),
and the state comparison those tests make.

A CUDA graph replays kernels and none of our Python. The stand-in has that property: warm-up
runs as torch's (forward, and a backward that leaves ``.grad`` alone; torch's output gradients
are uninitialised memory, the stand-in's ones), then every
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
from torch.utils._pytree import tree_flatten, tree_unflatten

from fp8kit.torch.autocast import recording_enrolments

__all__ = ["assert_same_state", "emulated_make_graphed_callables"]


class _EmulatedGraph(torch.autograd.Function):
    """Forward and backward of ``fn`` with fp8kit's host work dropped, as a graph replay; the
    outputs leave flat (the tensors of ``fn``'s output pytree), as torch's graphed function's."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], n_args: int, *flat: torch.Tensor) -> Any:  # type: ignore[override]
        args, params = flat[:n_args], flat[n_args:]
        with torch.enable_grad(), recording_enrolments():
            inputs = [a.detach().requires_grad_(a.requires_grad) for a in args]
            outs = tree_flatten(fn(*inputs))[0]
        ctx.saved = (inputs, params, outs)
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:  # type: ignore[override]
        inputs, params, outs = ctx.saved
        taken = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None]
        wanted = [t for t in (*inputs, *params) if t.requires_grad]
        with recording_enrolments():
            found = torch.autograd.grad(
                [o for o, _ in taken], wanted, [g for _, g in taken], allow_unused=True
            )
        grads_in = iter(found)
        return (
            None,
            None,
            *(next(grads_in) if t.requires_grad else None for t in (*inputs, *params)),
        )


def emulated_make_graphed_callables(
    callables: tuple[torch.nn.Module, ...],
    sample_args: tuple[tuple[torch.Tensor, ...], ...],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Any = None,
) -> tuple[torch.nn.Module, ...]:
    """``torch.cuda.make_graphed_callables`` in its tuple form (outputs: a tensor or a pytree of
    tensors, every one differentiable)."""
    for module, args in zip(callables, sample_args, strict=True):
        params = tuple(p for p in module.parameters() if p.requires_grad)
        for _ in range(num_warmup_iters):  # as torch: forward and a backward (with ones here)
            outs, spec = tree_flatten(module(*args))
            torch.autograd.grad(outs, params, [torch.ones_like(o) for o in outs], allow_unused=True)
        eager = module.forward

        def replay(
            *a: torch.Tensor, fn: Callable[..., Any] = eager, ps: Any = params, spec: Any = spec
        ) -> Any:
            return tree_unflatten(list(_EmulatedGraph.apply(fn, len(a), *a, *ps)), spec)

        module.forward = replay
    return callables


def assert_same_state(eager: torch.nn.Module, graphed: torch.nn.Module) -> None:
    """Every tensor of ``graphed``'s state dict (parameters, FP8 buffers) equals ``eager``'s bit
    for bit, key by key."""
    for (k, a), b in zip(eager.state_dict().items(), graphed.state_dict().values(), strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), k

"""The ``fp8kit`` operator namespace: ops that ``torch.compile`` graphs call, defined from a
schema with one Python kernel (docs/decisions/0254-library-ops-for-compiled-graphs.md).

``torch.library.custom_op`` would define them in one decorator, but every call of such an op runs
Python dispatch layers of its own (an autograd wrapper, a redispatch, an ADInplaceOrView kernel
re-reading the schema for a mutated argument): 44-66 us per call against 7-12 us for the same op
defined here, on a 2-core AMD EPYC (2026-11-28). These ops run only inside compiled graphs, where
AOTAutograd owns the gradients and the mutated arguments are tokens nothing reads, so torch's C++
fallbacks for the Autograd and ADInplaceOrView keys do all that is needed there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["define_op"]

_NAMESPACE = "fp8kit"
_LIBRARY = torch.library.Library(_NAMESPACE, "FRAGMENT")  # kept alive: it owns the registrations


def define_op(
    name: str,
    schema: str,
    kernel: Callable[..., Any],
    fake: Callable[..., Any],
    tags: Sequence[torch.Tag] = (),
) -> torch._ops.OpOverload:
    """Define ``fp8kit::name`` with ``schema`` (its signature, ``"(Tensor x, ...) -> Tensor"``):
    ``kernel`` runs it on every device (``CompositeExplicitAutograd``), ``fake`` gives its output
    shapes while a graph is traced. Returns the op's default overload."""
    _LIBRARY.define(f"{name}{schema}", tags=tuple(tags))
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{_NAMESPACE}::{name}", fake, lib=_LIBRARY)
    return getattr(getattr(torch.ops, _NAMESPACE), name).default

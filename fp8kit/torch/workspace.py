"""Float32 buffers the CPU FP8 GEMM reuses for its temporaries (docs/decisions/0259).

The CPU GEMM (``fp8kit.torch.gemm``, ADR 0001) upcasts both FP8 operands to float32 and, for a
16-bit output, accumulates in a float32 buffer before its epilogue. Allocated afresh at each
call, buffers of more than 32 MiB come from ``mmap`` under glibc's default settings, and the
first touch of their pages costs more than the work: a fresh 4096 x 2048 upcast took 10.6 ms
against 0.8 ms into a reused buffer (2-core Xeon, 2026-11-29). So each thread keeps one buffer
per role (:data:`ROLES`), grown to the largest request of at most :data:`MAX_ELEMENTS` elements.
A view of a buffer is valid until the next request for the same role on the same thread: the
GEMM uses its views within one call, and no view leaves it.

Larger requests get ``None`` (the caller allocates): the buffers this module keeps are at most
``len(ROLES) * MAX_ELEMENTS * 4`` bytes per thread (192 MiB), and a GEMM that large spends
relatively less on first touches (its multiply-adds grow with a third dimension).
:func:`clear` frees this thread's buffers.
"""

from __future__ import annotations

import math
import threading

import torch

__all__ = ["MAX_ELEMENTS", "ROLES", "clear", "view"]

ROLES = ("a", "b", "acc")
"""The GEMM's temporaries: the upcast operands A and B and the float32 accumulator."""

MAX_ELEMENTS = 1 << 24
"""The largest request (elements) served from a kept buffer: 64 MiB of float32."""

_local = threading.local()


def view(role: str, shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor | None:
    """A float32 CPU tensor of ``shape`` and ``stride`` on this thread's ``role`` buffer, or None
    when the request is larger than :data:`MAX_ELEMENTS` or ``torch.compile`` is tracing (a graph
    allocates its own). ``shape`` / ``stride`` must describe dense memory (every element of the
    first ``prod(shape)`` once, e.g. a row-major matrix or its transpose); the values are
    whatever the buffer held."""
    if torch.compiler.is_compiling():
        return None
    numel = math.prod(shape)
    if numel > MAX_ELEMENTS:
        return None
    buffers: dict[str, torch.Tensor] | None = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    buf = buffers.get(role)
    if buf is None or buf.numel() < numel:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        # an ordinary tensor even when first asked for under torch.inference_mode (later
        # in-place writes outside it would be refused)
        with torch.inference_mode(False):
            buf = buffers[role] = torch.empty(numel, dtype=torch.float32)
    return buf.as_strided(shape, stride)


def clear() -> None:
    """Free this thread's buffers (the next GEMM allocates them again)."""
    _local.buffers = {}

"""The numeric variants the demo trains, each a context manager around the forward pass.

``fp32``: plain float32. ``bf16``: ``torch.autocast`` with bfloat16 (the default on CUDA), or, where
this CPU's bfloat16 matmul is far slower than float32 (CPUs without bf16 units), an exact
emulation of what bf16 autocast computes for matmuls: operands rounded to bf16, float32
accumulation, the result rounded to bf16, and the same rounding applied to the gradients flowing
back through it.
``fp8-delayed`` and ``fp8-current``: ``f8.autocast`` with the two fp8kit recipes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format, Recipe

__all__ = [
    "VARIANTS",
    "Bf16Emulation",
    "Variant",
    "bf16_slowdown",
    "make_variant",
]

VARIANTS = ("fp32", "bf16", "fp8-delayed", "fp8-current")

DELAYED_RECIPE = DelayedScaling(
    fp8_format=Format.HYBRID, amax_history_len=1024, amax_compute_algo="max"
)
CURRENT_RECIPE = Float8CurrentScaling(fp8_format=Format.HYBRID)


class _RoundBf16(torch.autograd.Function):
    """Round to the nearest bfloat16 (kept in float32); the gradient is rounded the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.to(torch.bfloat16).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g.to(torch.bfloat16).to(g.dtype)


def _r(x: Any) -> Any:
    return _RoundBf16.apply(x) if isinstance(x, torch.Tensor) else x


class Bf16Emulation(TorchFunctionMode):
    """Emulate ``torch.autocast(dtype=torch.bfloat16)`` for the ops the demo model autocasts.

    ``linear``, ``matmul`` and ``scaled_dot_product_attention`` round their tensor operands to
    bf16, compute in float32 (float32 accumulation, as bf16 GEMM kernels do) and round the result
    to bf16. Backward, the incoming gradient and the operand gradients are rounded to bf16 too,
    which is what the bf16 backward kernels produce. Other ops see bf16-valued float32 tensors,
    as under autocast where they run on bf16 outputs (layer norm and the loss run in float32 in
    both cases). Differences: only inside fused kernels (e.g. the attention probabilities before
    the second attention matmul may stay float32 here).
    """

    _ROUNDED: ClassVar[frozenset[Callable[..., Any]]] = frozenset(
        {
            F.linear,
            torch.matmul,
            torch.Tensor.matmul,
            torch.Tensor.__matmul__,
            F.scaled_dot_product_attention,
        }
    )

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in self._ROUNDED:
            args = tuple(_r(a) for a in args)
            kwargs = {k: _r(v) for k, v in kwargs.items()}
            return _r(func(*args, **kwargs))
        return func(*args, **kwargs)


def bf16_slowdown(size: int = 256, repeats: int = 3) -> float:
    """Time of a ``size``-cube bf16 matmul over a float32 one on the CPU (best of ``repeats``)."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)

    def best(x: torch.Tensor, y: torch.Tensor) -> float:
        x @ y  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            x @ y
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(a.bfloat16(), b.bfloat16()) / max(best(a, b), 1e-9)


@dataclass(frozen=True)
class Variant:
    """One numeric variant: its name, a label for the report, and how to enter it.

    ``emulated``: the arithmetic is emulated, so the variant's tokens/s is not its real speed.
    """

    name: str
    label: str
    description: str
    recipe: Recipe | None
    context: Callable[[], contextlib.AbstractContextManager[Any]]
    emulated: bool = False


def make_variant(name: str, bf16_mode: str = "emulated", device_type: str = "cpu") -> Variant:
    """Build variant ``name`` (one of :data:`VARIANTS`).

    Args:
        name: the variant.
        bf16_mode: "native" (``torch.autocast``) or "emulated" (:class:`Bf16Emulation`).
        device_type: "cpu" or "cuda", the device type native bf16 autocast runs on.
    """
    if name == "fp32":
        return Variant(name, "fp32", "float32 everywhere", None, contextlib.nullcontext)
    if name == "bf16":
        if bf16_mode == "native":
            return Variant(
                name,
                "bf16 autocast",
                f"torch.autocast(device_type={device_type!r}, dtype=torch.bfloat16)",
                None,
                lambda: torch.autocast(device_type, dtype=torch.bfloat16),
            )
        return Variant(
            name,
            "bf16 (emulated)",
            "bf16 autocast emulated: matmul operands, outputs and gradients rounded to bf16, "
            "float32 accumulation (native bf16 matmul is too slow on this CPU)",
            None,
            Bf16Emulation,
            emulated=True,
        )
    if name == "fp8-delayed":
        return Variant(
            name,
            "FP8 delayed scaling",
            "f8.autocast(recipe=DelayedScaling(HYBRID, amax_history_len=1024, 'max'))",
            DELAYED_RECIPE,
            lambda: f8.autocast(recipe=DELAYED_RECIPE),
        )
    if name == "fp8-current":
        return Variant(
            name,
            "FP8 current scaling",
            "f8.autocast(recipe=Float8CurrentScaling(HYBRID))",
            CURRENT_RECIPE,
            lambda: f8.autocast(recipe=CURRENT_RECIPE),
        )
    raise ValueError(f"variant must be one of {list(VARIANTS)}, got {name!r}")

"""torch plumbing: a ``torch.autograd.Function`` whose backward writes the FP8 state directly.

Keras's torch backend runs eagerly, so every training call is its own update event: its
backward computes the gradients, then :meth:`Fp8State.observe` assigns the new histories,
scales and counts in place (no gradient carries them, no optimizer sees them).
"""

from __future__ import annotations

from typing import Any

import torch
from keras import ops

from fp8kit.keras import gemm
from fp8kit.keras.state import Fp8State
from fp8kit.matmul_args import SECOND_DERIVATIVE_ERROR

__all__ = ["fp8_einsum"]


class _Fp8Einsum(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        plan: gemm.GemmPlan,
        state: Fp8State,
        training: bool,
        out_dtype: str,
    ) -> torch.Tensor:
        fwd_scale, fwd_count, bwd_scale, bwd_count = state.read()
        needs = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]))
        y, saved, fwd_obs = gemm.forward(plan, x, w, fwd_scale, fwd_count, out_dtype, needs)
        ctx.plan, ctx.state, ctx.training, ctx.needs = plan, state, training, needs
        ctx.saved = saved
        # read() snapshots: a later call's event (eager: one per backward) cannot change these
        ctx.bwd = (bwd_scale, bwd_count)
        ctx.fwd_obs = fwd_obs
        ctx.dtypes = (x.dtype, w.dtype)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        with torch.no_grad():
            dx, dw = _Fp8Einsum.gradients(ctx, dy)
        if torch.is_grad_enabled():  # create_graph=True
            dx, dw = _differentiating_again_raises(dx, dw)
        return dx, dw, None, None, None, None

    @staticmethod
    def gradients(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """dx and dw from ``dy``; a training call's backward also updates the FP8 state."""
        x_dtype, w_dtype = ctx.dtypes
        dx, dw, bwd_obs = gemm.backward(
            ctx.plan,
            dy,
            ctx.saved,
            *ctx.bwd,
            _keras_dtype(x_dtype),
            _keras_dtype(w_dtype),
            ctx.needs,
        )
        if ctx.training:
            ctx.state.observe(ops.concatenate([ctx.fwd_obs, bwd_obs]))
        return dx, dw


_TWICE = SECOND_DERIVATIVE_ERROR.encode()


def _differentiating_again_raises(
    dx: torch.Tensor, dw: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dx`` and ``dw`` joined to one autograd node that raises when anything differentiates
    them (a backward under ``create_graph=True``).

    ``torch.autograd.function.once_differentiable`` adds that node only when the upstream
    gradient requires grad; the gradient of ``y.sum()`` does not, yet ``dx`` depends on the
    kernel, so a gradient penalty on ``dx`` would silently lose its kernel term."""
    joined = torch._C._functions.DelayedError(_TWICE, 2)(
        dx.detach().requires_grad_(), dw.detach().requires_grad_()
    )
    return joined[0], joined[1]


def _keras_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fp8_einsum(
    plan: gemm.GemmPlan,
    state: Fp8State,
    x: Any,
    w: Any,
    training: bool,
    out_dtype: str,
    kernel_trainable: bool = True,
) -> Any:
    """``einsum(plan.equation, x, w)`` in FP8; a training call's backward updates ``state``.
    Which gradients are needed comes from autograd (Keras keeps a frozen kernel's
    ``requires_grad`` False, so ``kernel_trainable`` adds nothing here). A call whose input
    and kernel need no gradient has no backward pass, so it records nothing, as on TensorFlow
    (docs/keras.md, "A call without a backward pass")."""
    return _Fp8Einsum.apply(x, w, plan, state, training, out_dtype)

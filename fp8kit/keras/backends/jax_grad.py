"""JAX plumbing: ``jax.custom_vjp`` with FP8 forward and backward GEMMs, state read-only.

Keras's JAX trainer differentiates the trainable variables only and returns non-trainable
updates from the forward pass; a backward pass has no way to deliver the output-gradient amax
except as the gradient of a trainable variable, which the optimizer would then see. fp8kit.keras
refuses that channel (``docs/decisions/0601-keras-update-events.md``): on the JAX backend the
layers run FP8 GEMMs with the current state (inference, fine-tuning with frozen scales,
benchmarks) and ``training=True`` raises. Delayed-scaling training in JAX is ``fp8kit.jax``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax

from fp8kit.keras import gemm
from fp8kit.keras.state import Fp8State
from fp8kit.matmul_args import SECOND_DERIVATIVE_ERROR

__all__ = ["TRAINING_ERROR", "fp8_einsum"]

TRAINING_ERROR = (
    "fp8kit.keras on the JAX backend cannot update FP8 state in a training step: Keras's JAX "
    "trainer only returns gradients of trainable variables, and the backward amaxes would have "
    "to pass through the optimizer. Train with the TensorFlow or torch Keras backend, or use "
    "fp8kit.jax (Flax) for JAX; call the layer with training=False to run FP8 GEMMs with the "
    "current (frozen) scales"
)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _frozen(
    plan: gemm.GemmPlan, out_dtype: str, x_dtype: str, w_dtype: str, x: Any, w: Any, scales: Any
) -> Any:
    return _frozen_fwd(plan, out_dtype, x_dtype, w_dtype, x, w, scales)[0]


def _frozen_fwd(
    plan: gemm.GemmPlan, out_dtype: str, x_dtype: str, w_dtype: str, x: Any, w: Any, scales: Any
) -> Any:
    fwd_scale, fwd_count, _, _ = scales
    y, saved, _ = gemm.forward(plan, x, w, fwd_scale, fwd_count, out_dtype)
    return y, (saved, scales)


def _frozen_bwd(
    plan: gemm.GemmPlan, out_dtype: str, x_dtype: str, w_dtype: str, res: Any, dy: Any
) -> Any:
    saved, scales = res
    _, _, bwd_scale, bwd_count = scales
    dx, dw, _ = gemm.backward(plan, dy, saved, bwd_scale, bwd_count, x_dtype, w_dtype)
    dx, dw = _first_derivatives_only(dx, dw, (dy, saved))
    return dx, dw, jax.tree_util.tree_map(jax.numpy.zeros_like, scales)


_frozen.defvjp(_frozen_fwd, _frozen_bwd)


@jax.custom_jvp
def _first_derivatives_only(dx: Any, dw: Any, inputs: Any) -> tuple[Any, Any]:
    """``dx`` and ``dw`` unchanged; differentiating them (``jax.grad`` of a gradient penalty)
    raises at trace time instead of differentiating the FP8 backward rule. ``inputs`` (``dy``
    and the saved FP8 operands) join so a tangent reaching the rule through any of them raises
    (docs/semantics.md section 4)."""
    return dx, dw


@_first_derivatives_only.defjvp
def _differentiating_again_raises(primals: Any, tangents: Any) -> Any:
    raise TypeError(SECOND_DERIVATIVE_ERROR)


def fp8_einsum(
    plan: gemm.GemmPlan,
    state: Fp8State,
    x: Any,
    w: Any,
    training: bool,
    out_dtype: str,
    kernel_trainable: bool = True,
) -> Any:
    """``einsum(plan.equation, x, w)`` in FP8 with the current scales (``training`` must be
    False, see the module doc; nothing is recorded, so ``kernel_trainable`` changes nothing)."""
    if training:
        raise NotImplementedError(TRAINING_ERROR)
    x_dtype, w_dtype = str(x.dtype), str(w.dtype)
    return _frozen(plan, out_dtype, x_dtype, w_dtype, x, w, tuple(state.read()))

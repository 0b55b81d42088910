"""Rules of an FP8 GEMM that every frontend shares: the arguments of the low-level
``fp8_matmul`` (docs/semantics.md section 7) and the error for a second derivative (section 4)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ACTIVATIONS", "SECOND_DERIVATIVE_ERROR", "check_activation", "check_matmul_args"]

SECOND_DERIVATIVE_ERROR = (
    "fp8kit: differentiate twice through an FP8 GEMM: its gradients come from FP8 copies saved "
    "in the forward, so no second derivative is available (docs/semantics.md section 4)"
)
"""What differentiating an FP8 GEMM's gradients (a gradient penalty) raises, in every frontend."""

ACTIVATIONS = ("relu", "gelu", "gelu_tanh")
"""Activations ``fp8_matmul`` can apply after the bias."""


def check_activation(activation: str | None) -> None:
    """Raise a ValueError unless ``activation`` is None or one of :data:`ACTIVATIONS`."""
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(
            f"activation must be None or one of {list(ACTIVATIONS)}, got {activation!r}"
        )


def check_matmul_args(
    a_shape: Sequence[int],
    b_shape: Sequence[int],
    activation: str | None,
    has_out_scale: bool,
    has_out_fp8_dtype: bool,
) -> tuple[int, int]:
    """Check the framework-free arguments of ``fp8_matmul(a, b)``; return ``(M, N)``.

    Args:
        a_shape / b_shape: shapes of the 2-D operands ``(M, K)`` and ``(K, N)``.
        activation: the requested activation.
        has_out_scale / has_out_fp8_dtype: whether those keyword arguments were given.
    """
    for name, shape in (("a", a_shape), ("b", b_shape)):
        if len(shape) != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(shape)}")
    if a_shape[1] != b_shape[0]:
        raise ValueError(f"a is {tuple(a_shape)} and b is {tuple(b_shape)}: inner sizes differ")
    check_activation(activation)
    if has_out_fp8_dtype and not has_out_scale:
        raise ValueError("out_fp8_dtype is given but out_scale is None: pass both for FP8 output")
    return a_shape[0], b_shape[1]

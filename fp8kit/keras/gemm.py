"""The FP8 GEMM of a Keras layer as backend-neutral ``keras.ops`` math (docs/semantics.md
sections 2-4).

:func:`forward` quantizes the input (INPUT slot) and the kernel (WEIGHT slot) into the recipe's
forward format with the layer's delayed scales and multiplies the dequantized float32 operands
(``float32(q) * scale_inv``, the pattern XLA rewrites into an FP8 GEMM on GPUs that have one;
elsewhere a float32 GEMM at full precision on those operands). :func:`backward` quantizes the
output gradient (GRAD_OUTPUT slot) into the backward format and runs dgrad and wgrad on FP8
operands; the forward pass saves the FP8 copies (1 byte per element), not the high-precision
input. ``override_linear_precision`` switches any of the three GEMMs to high precision.

Both return the amaxes they saw (``(3,)`` forward, ``(2,)`` backward, 0 = slot not quantized);
the backend modules (``fp8kit.keras.backends``) decide where they go. The GEMM is an einsum, so
one code path serves ``Dense`` (``"...i,ij->...j"``) and ``EinsumDense``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from keras import ops

from fp8kit.formats import FP8Format
from fp8kit.keras.quantization import cast_to_fp8, current_scale, dequantize, nan_ignoring_amax
from fp8kit.recipe import Float8CurrentScaling, Recipe
from fp8kit.slots import BwdSlot, FwdSlot

__all__ = ["GemmPlan", "Needs", "Saved", "backward", "forward", "plan_einsum"]


@dataclass(frozen=True)
class GemmPlan:
    """Static description of one FP8 GEMM ``y = einsum(equation, x, kernel)``.

    A leading ellipsis (``"...i,ij->...j"``) is run as one flattened axis (the first letter of
    :data:`_FLAT_LETTERS` the equation does not use): the input is reshaped to
    ``(prod(leading), ...)`` and the output back, so wgrad sums over every leading axis with an
    einsum that every backend accepts.

    Attributes:
        equation: the forward einsum ``"X,W->Y"`` (ellipsis replaced by the flat axis).
        dgrad_equation: ``"Y,W->X"``; wgrad_equation: ``"X,Y->W"``.
        recipe: the layer's recipe.
        flat_rank: number of trailing input axes after a leading ellipsis (None: no ellipsis).
    """

    equation: str
    dgrad_equation: str
    wgrad_equation: str
    recipe: Recipe
    flat_rank: int | None = None

    @property
    def fp8_gemms(self) -> tuple[bool, bool, bool]:
        """(fprop, dgrad, wgrad): True where that GEMM runs on FP8 operands."""
        fprop, dgrad, wgrad = self.recipe.override_linear_precision
        return not fprop, not dgrad, not wgrad


def plan_einsum(equation: str, recipe: Recipe) -> GemmPlan:
    """Build the plan of ``equation`` (``"X,W->Y"``), deriving the two gradient einsums.

    Raises a ValueError for equations whose gradients are not einsums of the other two operands:
    an input axis summed away without meeting the kernel, a kernel axis used by neither input nor
    output, a letter repeated within the input or the kernel (a diagonal, which a gradient
    einsum cannot write), or an ellipsis in the kernel.
    """
    if not isinstance(equation, str) or "->" not in equation or equation.count(",") != 1:
        raise ValueError(
            f"equation must have the form 'X,W->Y' (two operands and an output), got {equation!r}"
        )
    lhs, out = equation.replace(" ", "").split("->")
    x_axes, w_axes = lhs.split(",")
    if "..." in w_axes:
        raise ValueError(f"equation {equation!r}: the kernel cannot have an ellipsis")
    ellipsis = "..." in x_axes or "..." in out
    if ellipsis and not (x_axes.startswith("...") and out.startswith("...")):
        raise ValueError(
            f"equation {equation!r}: fp8kit.keras supports an ellipsis only at the start of both "
            "the input and the output (e.g. '...i,ij->...j')"
        )
    letters = lambda s: set(s.replace("...", ""))  # noqa: E731
    lonely_x = letters(x_axes) - letters(w_axes) - letters(out)
    lonely_w = letters(w_axes) - letters(x_axes) - letters(out)
    if lonely_x or lonely_w or ("..." in x_axes) != ("..." in out):
        raise ValueError(
            f"equation {equation!r} is not supported by fp8kit.keras: every input axis must meet "
            f"the kernel or the output (alone: {sorted(lonely_x)}), every kernel axis the input "
            f"or the output (alone: {sorted(lonely_w)}), and an ellipsis must be in both the "
            "input and the output"
        )
    for name, axes in (("input", x_axes), ("kernel", w_axes)):
        plain = axes.replace("...", "")
        repeated = sorted({a for a in plain if plain.count(a) > 1})
        if repeated:
            raise ValueError(
                f"equation {equation!r} is not supported by fp8kit.keras: the {name} repeats "
                f"{repeated} (a diagonal), and its gradient einsum would have to write a "
                "repeated letter; use each letter once per operand"
            )
    flat_rank = None
    if ellipsis:
        flat = next(a for a in _FLAT_LETTERS if a not in equation)
        x_axes, out = flat + x_axes[3:], flat + out[3:]
        flat_rank = len(x_axes) - 1
    return GemmPlan(
        equation=f"{x_axes},{w_axes}->{out}",
        dgrad_equation=f"{out},{w_axes}->{x_axes}",
        wgrad_equation=f"{x_axes},{out}->{w_axes}",
        recipe=recipe,
        flat_rank=flat_rank,
    )


# Letters for the flattened leading axes of an ellipsis equation: the first one the equation
# does not use (it uses a few of Keras's 52).
_FLAT_LETTERS = "ZYXWVUTSRQPONMLKJIHGFEDCBAzyxwvutsrqponmlkjihgfedcba"


def _flatten(t: Any, trailing: int) -> Any:
    """``t`` with every axis before its last ``trailing`` ones merged into one."""
    return ops.reshape(t, (-1, *t.shape[len(t.shape) - trailing :]))


def _leading_shape(t: Any, trailing: int) -> tuple[Any, ...]:
    """The sizes of ``t``'s axes before its last ``trailing`` ones (dynamic where unknown)."""
    return tuple(ops.shape(t)[: len(t.shape) - trailing])


def _unflatten(t: Any, lead: tuple[Any, ...]) -> Any:
    """``t`` ``(N, *rest)`` reshaped to ``(*lead, *rest)``."""
    return ops.reshape(t, (*lead, *t.shape[1:]))


Needs = tuple[bool, bool]
"""Whether a GEMM's backward pass must give ``(dx, dw)``: the input and the kernel are
differentiated."""


class Saved(NamedTuple):
    """What the forward pass keeps for the backward pass.

    ``x`` / ``w`` are ``(fp8 data, scale_inv)`` pairs where the gradient GEMM that needs them
    is FP8 (1 byte per element), else the high-precision tensors.
    """

    x: Any
    w: Any
    # The input's leading axes, which dx gets back: its shape only, so the high-precision input
    # itself is not kept alive for the backward pass.
    x_lead: tuple[Any, ...] = ()


def _operand(saved: Any) -> Any:
    """A saved operand as float32: dequantized FP8 or the cast high-precision tensor."""
    if isinstance(saved, tuple):
        return dequantize(*saved)
    return ops.cast(saved, "float32")


def _quantize(
    t: Any, scale: Any, count: Any, fmt: FP8Format, recipe: Recipe
) -> tuple[Any, Any, Any]:
    """(FP8 data, scale_inv, amax to record) of ``t`` for one slot.

    Current scaling records 0 (no history); ``first_step_scaling="current"`` casts a slot without
    history with ``fmax / amax`` of ``t`` itself (the recorded amax is the same).
    """
    amax = nan_ignoring_amax(t)
    if isinstance(recipe, Float8CurrentScaling):
        scale = current_scale(amax, fmt, recipe.power_2_scale)
        return cast_to_fp8(t, scale, fmt), ops.reciprocal(scale), ops.zeros_like(amax)
    if recipe.first_step_scaling == "current":
        scale = ops.where(ops.greater(count, 0.0), scale, current_scale(amax, fmt))
    return cast_to_fp8(t, scale, fmt), ops.reciprocal(scale), amax


def forward(
    plan: GemmPlan,
    x: Any,
    w: Any,
    fwd_scale: Any,
    fwd_count: Any,
    out_dtype: str,
    needs: Needs = (True, True),
) -> tuple[Any, Saved, Any]:
    """``einsum(plan.equation, x, w)`` with FP8 operands.

    Args:
        plan: the GEMM plan.
        x: input (high-precision float tensor); w: kernel.
        fwd_scale / fwd_count: float32 ``(3,)`` forward scales and event counts of the layer.
        out_dtype: dtype of the result.
        needs: whether the backward pass must give ``(dx, dw)``. ``x`` is cast (and its amax
            recorded) for an FP8 fprop, or for an FP8 wgrad only when ``dw`` is needed, as in
            fp8kit.torch and fp8kit.jax (a slot never quantized keeps history 0).

    Returns:
        ``(y, saved, amaxes)``: ``y`` of ``out_dtype``, the residuals, float32 ``(3,)`` amaxes
        (INPUT, WEIGHT, OUTPUT=0).
    """
    recipe = plan.recipe
    fmt = recipe.fp8_format.forward
    fprop, dgrad, wgrad = plan.fp8_gemms
    x_full = x
    if plan.flat_rank is not None:
        x = _flatten(x, plan.flat_rank)
    zero = ops.zeros((), "float32")
    x_amax = w_amax = zero
    xq = wq = None
    if fprop or (wgrad and needs[1]):
        i = int(FwdSlot.INPUT)
        x_data, x_inv, x_amax = _quantize(x, fwd_scale[i], fwd_count[i], fmt, recipe)
        xq = (x_data, x_inv)
    if fprop or dgrad:
        i = int(FwdSlot.WEIGHT)
        w_data, w_inv, w_amax = _quantize(w, fwd_scale[i], fwd_count[i], fmt, recipe)
        wq = (w_data, w_inv)
    if fprop:
        y = ops.einsum(plan.equation, _operand(xq), _operand(wq))
    else:
        y = ops.einsum(plan.equation, x, ops.cast(w, x.dtype))
    x_lead: tuple[Any, ...] = ()
    if plan.flat_rank is not None:
        x_lead = _leading_shape(x_full, plan.flat_rank)
        y = _unflatten(y, x_lead)
    saved = Saved(x=xq if wgrad and xq is not None else x, w=wq if dgrad else w, x_lead=x_lead)
    return ops.cast(y, out_dtype), saved, ops.stack([x_amax, w_amax, zero])


def backward(
    plan: GemmPlan,
    dy: Any,
    saved: Saved,
    bwd_scale: Any,
    bwd_count: Any,
    x_dtype: str,
    w_dtype: str,
    needs: Needs = (True, True),
) -> tuple[Any, Any, Any]:
    """Gradients of :func:`forward` for the output gradient ``dy``.

    ``needs`` is :func:`forward`'s: ``dy`` is cast (and its amax recorded) only for an FP8 GEMM
    whose gradient is needed. The gradient nobody needs is still returned (in high precision
    where its FP8 operand was not made), for the frameworks that ask for every input's.

    Returns:
        ``(dx, dw, amaxes)``: ``dx`` of ``x_dtype``, ``dw`` of ``w_dtype``, float32 ``(2,)``
        amaxes (GRAD_OUTPUT, GRAD_INPUT=0).
    """
    recipe = plan.recipe
    _, dgrad, wgrad = plan.fp8_gemms
    zero = ops.zeros((), "float32")
    dy_amax = zero
    if plan.flat_rank is not None:
        dy = _flatten(dy, len(plan.equation.split("->")[1]) - 1)
    dy32 = ops.cast(dy, "float32")
    dyq = dy32
    cast_dy = (dgrad and needs[0]) or (wgrad and needs[1])
    if cast_dy:
        i = int(BwdSlot.GRAD_OUTPUT)
        fmt = recipe.fp8_format.backward
        data, inv, dy_amax = _quantize(dy, bwd_scale[i], bwd_count[i], fmt, recipe)
        dyq = dequantize(data, inv)
    dx = ops.einsum(plan.dgrad_equation, dyq if dgrad else dy32, _operand(saved.w))
    dw = ops.einsum(plan.wgrad_equation, _operand(saved.x), dyq if wgrad else dy32)
    if plan.flat_rank is not None:
        dx = _unflatten(dx, saved.x_lead)
    return ops.cast(dx, x_dtype), ops.cast(dw, w_dtype), ops.stack([dy_amax, zero])

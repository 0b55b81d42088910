"""The delayed-scaling update rule (docs/semantics.md section 3) written with ``keras.ops``.

Pure functions, nothing owns state: :func:`update_scaling_state` runs one update event over a
stacked ``(L, N)`` buffer (a layer's forward and backward columns side by side) with a fixed
number of ops. The arithmetic is that of ``fp8kit.torch`` and ``fp8kit.jax`` bit for bit:
``float32(fmax * 2**-margin)`` rounded once from float64, one float32 division, FLT_MAX for an
overflowing ratio, the old scale kept for an unusable amax, exact power-of-two exponents.

Counts are float32 (every FP8 variable of a layer is float32, so one dtype policy and one
checkpoint format cover them): exact up to 2**24, wrapped by a multiple of ``interval`` before
that, which keeps both facts the rule needs (``count > 0`` and ``(count - 1) % interval``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from keras import ops

from fp8kit.formats import FLOAT32_MAX, scale_numerator
from fp8kit.recipe import CALLABLE_SHAPE_HINT, DelayedScaling

__all__ = [
    "COUNT_WRAP_LIMIT",
    "compute_scale",
    "count_wrap",
    "new_scale",
    "update_scaling_state",
    "window_amax",
]

COUNT_WRAP_LIMIT = 2**23
"""Counts stay at or below ``count_wrap(interval)`` (<= 2**23 for interval <= 2**22)."""

_POW2_MIN_EXPONENT = -126  # smallest normal float32 power of two (see power_2_scale below)
_POW2_CAP_EXPONENT = 127  # largest power of two in float32


def count_wrap(interval: int) -> int:
    """The largest multiple of ``interval`` not above 2**23 (at least ``interval``)."""
    return max(interval, interval * (COUNT_WRAP_LIMIT // interval))


def _numerator(fmax: Any, margin: float) -> np.ndarray:
    """:func:`fp8kit.formats.scale_numerator` of ``fmax`` (a float or one per column)."""
    fmax = np.asarray(fmax, np.float64)
    out = [scale_numerator(float(f), margin) for f in fmax.ravel()]
    return np.asarray(out, np.float32).reshape(fmax.shape)


def _frexp32(x: Any) -> tuple[Any, Any]:
    """Mantissa in [0.5, 1) (float32) and exponent (int32) of positive normal float32 ``x``."""
    bits = ops.view(ops.cast(x, "float32"), "int32")
    exponent = ops.subtract(ops.bitwise_and(ops.right_shift(bits, 23), 0xFF), 126)
    mantissa_bits = ops.bitwise_or(ops.bitwise_and(bits, 0x7FFFFF), 126 << 23)
    return ops.view(mantissa_bits, "float32"), exponent


def _pow2(exponent: Any) -> Any:
    """``2**exponent`` as float32 for int32 exponents in [-126, 127], built from the bits."""
    return ops.view(ops.left_shift(ops.add(exponent, 127), 23), "float32")


def compute_scale(
    amax: Any,
    old_scale: Any,
    fmax: float | np.ndarray,
    margin: float = 0,
    power_2_scale: bool = False,
) -> Any:
    """``fmax / amax / 2**margin`` per element, keeping ``old_scale`` where amax is 0 or not finite.

    Args:
        amax: float32 tensor (any shape) of absolute maxima.
        old_scale: float32 tensor of the same shape, returned where the amax is unusable.
        fmax: largest finite value of the target format: a float or a numpy array broadcastable
            to ``amax`` (one format per column).
        margin: the scale is divided by ``2**margin``.
        power_2_scale: ``2**(floor(log2(fmax / amax)) - margin)`` from the exact binary
            exponents, capped at ``2**127`` (and at ``2**-126`` below, see docs/keras.md).

    Returns:
        float32 tensor of ``amax``'s shape.
    """
    amax = ops.cast(amax, "float32")
    usable = ops.logical_and(ops.isfinite(amax), ops.greater(amax, 0.0))
    safe = ops.where(usable, amax, ops.ones_like(amax))
    if power_2_scale:
        # fmax = mf * 2**ef, amax = ma * 2**ea with mantissas in [0.5, 1):
        # floor(log2(fmax / amax)) = ef - ea - (mf < ma), exactly.
        mf, ef = np.frexp(np.asarray(fmax, np.float64))
        ma, ea = _frexp32(safe)
        below = ops.cast(ops.less(ops.convert_to_tensor(np.asarray(mf, np.float32)), ma), "int32")
        exponent = ops.subtract(
            ops.subtract(ops.convert_to_tensor(np.asarray(ef, np.int32)), ea), below
        )
        exponent = ops.subtract(exponent, int(margin))
        exponent = ops.clip(exponent, _POW2_MIN_EXPONENT, _POW2_CAP_EXPONENT)
        scale = _pow2(ops.cast(exponent, "int32"))
    else:
        scale = ops.divide(ops.convert_to_tensor(_numerator(fmax, margin)), safe)
        scale = ops.where(ops.isinf(scale), ops.full_like(scale, FLOAT32_MAX), scale)
    return ops.where(usable, scale, ops.cast(old_scale, "float32"))


def _checked_callable_output(name: str, result: Any, shape: tuple[int, ...]) -> Any:
    if not hasattr(result, "shape") or not hasattr(result, "dtype"):
        raise TypeError(f"{name} must return a tensor, got {type(result).__name__}")
    if tuple(result.shape) != shape:
        raise ValueError(
            f"{name} must return a tensor of shape {shape}, got {tuple(result.shape)} "
            f"({CALLABLE_SHAPE_HINT})"
        )
    return ops.cast(result, "float32")


def new_scale(amax: Any, old_scale: Any, fmax: Any, recipe: DelayedScaling) -> Any:
    """The recipe's scale for ``amax`` ``(N,)``: default rule, power of two, or the callable.

    A ``scaling_factor_compute_algo`` is called as ``f(amax, old_scale, fmax, recipe)`` with
    float32 backend tensors; where its result is not finite or not positive the old scale stays.
    """
    if recipe.scaling_factor_compute_algo is None:
        return compute_scale(amax, old_scale, fmax, recipe.margin, recipe.power_2_scale)
    fmax_np = np.asarray(fmax, np.float32)
    if fmax_np.size and np.all(fmax_np == fmax_np.flat[0]):
        fmax_np = fmax_np.flat[0]  # one format: a scalar, as fp8kit.torch passes it
    result = recipe.scaling_factor_compute_algo(
        amax, old_scale, ops.convert_to_tensor(fmax_np), recipe
    )
    result = _checked_callable_output("scaling_factor_compute_algo", result, tuple(amax.shape))
    good = ops.logical_and(ops.isfinite(result), ops.greater(result, 0.0))
    return ops.where(good, result, old_scale)


def window_amax(history: Any, recipe: DelayedScaling) -> Any:
    """The amax each slot's new scale comes from; ``history[0]`` holds the current amax.

    ``"max"``: NaN-ignoring maximum of the column; ``"most_recent"``: the current amax; a
    callable gets the whole ``(L, N)`` state.
    """
    algo = recipe.amax_compute_algo
    if algo == "max":
        clean = ops.where(ops.isnan(history), ops.zeros_like(history), history)
        return ops.max(clean, axis=0)
    if algo == "most_recent":
        return history[0]
    return _checked_callable_output("amax_compute_algo", algo(history), tuple(history.shape[1:]))


def update_scaling_state(
    history: Any, scale: Any, counts: Any, recipe: DelayedScaling, fmax: float | np.ndarray
) -> tuple[Any, Any, Any]:
    """One update event for every slot (column) of a stacked state.

    Args:
        history: float32 ``(L, N)``; row 0 is the staging row (current amax, 0 = did not run).
        scale: float32 ``(N,)``; counts: float32 ``(N,)`` non-skipped events so far (wrapped).
        recipe: the delayed-scaling recipe.
        fmax: largest finite value per column (float or numpy ``(N,)``).

    Returns:
        ``(history, scale, counts)`` after the event: slots whose staging value is 0 are
        unchanged; the others roll (``[0, H[2], ..., H[L-1], current]``), count one event and get
        a new scale at events ``1, 1 + interval, ...``.
    """
    current = history[0]
    ran = ops.not_equal(current, 0.0)
    amax = window_amax(history, recipe)
    zero = ops.zeros_like(current)[None]
    length = int(history.shape[0])
    rolled = ops.concatenate([zero, history[2:], current[None]], axis=0) if length > 1 else zero
    new_history = ops.where(ran[None], rolled, history)
    wrap = float(count_wrap(recipe.interval))
    new_counts = ops.add(counts, ops.cast(ran, "float32"))
    new_counts = ops.where(
        ops.greater(new_counts, wrap), ops.subtract(new_counts, wrap), new_counts
    )
    phase = ops.mod(ops.subtract(ops.cast(new_counts, "int32"), 1), recipe.interval)
    recompute = ops.logical_and(ran, ops.equal(phase, 0))
    new_scales = ops.where(recompute, new_scale(amax, scale, fmax, recipe), scale)
    return new_history, new_scales, new_counts

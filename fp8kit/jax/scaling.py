"""The delayed-scaling update rule (docs/semantics.md section 3) as pure functions on JAX arrays.

Nothing here owns state. :func:`update_scaling_state` runs one update event over a whole stacked
buffer ``(L, N)`` (every module of one recipe and direction side by side) with a fixed number of
array ops, so it traces to the same small program whatever the model size.

Counts are float32 (every FP8 meta leaf is a float so ``jax.grad`` accepts a whole Flax variable
dict): they are exact up to 2**24 and wrap by a multiple of ``interval`` before that, which keeps
both facts the rule needs (``count > 0`` and ``(count - 1) % interval``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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

_POW2_CAP_EXPONENT = 127  # largest power of two in float32
COUNT_WRAP_LIMIT = 2**23
"""Counts stay at or below ``count_wrap(interval)`` (<= 2**23 for interval <= 2**22)."""


def count_wrap(interval: int) -> int:
    """The largest multiple of ``interval`` not above 2**23 (at least ``interval``)."""
    return max(interval, interval * (COUNT_WRAP_LIMIT // interval))


def _numerator(fmax: Any, margin: float) -> np.ndarray:
    """:func:`fp8kit.formats.scale_numerator` of ``fmax`` (a float or one per column)."""
    fmax = np.asarray(fmax, np.float64)
    out = [scale_numerator(float(f), margin) for f in fmax.ravel()]
    return np.asarray(out, np.float32).reshape(fmax.shape)


def compute_scale(
    amax: jax.Array,
    old_scale: jax.Array,
    fmax: float | np.ndarray,
    margin: float = 0,
    power_2_scale: bool = False,
) -> jax.Array:
    """``fmax / amax / 2**margin`` per element, keeping ``old_scale`` where amax is 0 or not finite.

    Args:
        amax: float32 array (any shape) of absolute maxima.
        old_scale: float32 array of the same shape, returned where the amax is unusable.
        fmax: largest finite value of the target FP8 format: a float, or a numpy array
            broadcastable to ``amax`` (one format per column).
        margin: the scale is divided by ``2**margin``.
        power_2_scale: use ``2**(floor(log2(fmax / amax)) - margin)``, computed exactly from the
            binary exponents (no float64 needed), capped at ``2**127``.

    Returns:
        float32 array of ``amax``'s shape. The default rule is one correctly rounded float32
        division ``float32(fmax * 2**-margin) / amax``; an overflowing ratio becomes FLT_MAX.
    """
    amax = jnp.asarray(amax, jnp.float32)
    usable = jnp.isfinite(amax) & (amax > 0)
    safe = jnp.where(usable, amax, jnp.float32(1.0))
    if power_2_scale:
        # fmax = mf * 2**ef, amax = ma * 2**ea with mantissas in [0.5, 1):
        # floor(log2(fmax / amax)) = ef - ea - (mf < ma), exactly.
        mf, ef = np.frexp(np.asarray(fmax, np.float64))
        ma, ea = jnp.frexp(safe)
        below = (jnp.asarray(mf, jnp.float32) < ma).astype(jnp.int32)
        exponent = jnp.asarray(ef, jnp.int32) - ea.astype(jnp.int32) - below
        exponent = jnp.minimum(exponent - int(margin), _POW2_CAP_EXPONENT)
        scale = jnp.ldexp(jnp.ones_like(safe), exponent)
    else:
        # The barrier keeps XLA from turning a division by a broadcast amax (a callable algo
        # may return one) into a multiplication by its reciprocal, which rounds twice.
        scale = jnp.asarray(_numerator(fmax, margin)) / jax.lax.optimization_barrier(safe)
        scale = jnp.where(jnp.isinf(scale), jnp.float32(FLOAT32_MAX), scale)
    return jnp.where(usable, scale, jnp.asarray(old_scale, jnp.float32))


def _checked_callable_output(name: str, result: Any, shape: tuple[int, ...]) -> jax.Array:
    if not hasattr(result, "shape") or not hasattr(result, "dtype"):
        raise TypeError(f"{name} must return a JAX array, got {type(result).__name__}")
    if tuple(result.shape) != shape:
        raise ValueError(
            f"{name} must return an array of shape {shape}, got {tuple(result.shape)} "
            f"({CALLABLE_SHAPE_HINT})"
        )
    return jnp.asarray(result).astype(jnp.float32)


def new_scale(
    amax: jax.Array, old_scale: jax.Array, fmax: float | np.ndarray, recipe: DelayedScaling
) -> jax.Array:
    """The recipe's scale for ``amax`` ``(N,)``: default rule, power of two, or the callable.

    A ``scaling_factor_compute_algo`` is called as ``f(amax, old_scale, fmax, recipe)`` with
    float32 JAX arrays (it is traced under ``jax.jit``); where its result is not finite or not
    positive the old scale is kept.
    """
    if recipe.scaling_factor_compute_algo is None:
        return compute_scale(amax, old_scale, fmax, recipe.margin, recipe.power_2_scale)
    fmax_np = np.asarray(fmax, np.float32)
    if fmax_np.size and np.all(fmax_np == fmax_np.flat[0]):
        fmax_np = fmax_np.flat[0]  # one format: a scalar, as fp8kit.torch passes it
    fmax_arr = jnp.asarray(fmax_np, jnp.float32)
    result = recipe.scaling_factor_compute_algo(amax, old_scale, fmax_arr, recipe)
    result = _checked_callable_output("scaling_factor_compute_algo", result, amax.shape)
    return jnp.where(jnp.isfinite(result) & (result > 0), result, old_scale)


def window_amax(history: jax.Array, recipe: DelayedScaling) -> jax.Array:
    """The amax each slot's new scale comes from; ``history[0]`` holds the current amax.

    ``"max"`` is the NaN-ignoring maximum of the whole column (the L-1 completed entries and the
    current one), ``"most_recent"`` the current amax, a callable gets the whole ``(L, N)`` state.
    """
    algo = recipe.amax_compute_algo
    if algo == "max":
        return jnp.nanmax(history, axis=0)
    if algo == "most_recent":
        return history[0]
    result = algo(history)
    return _checked_callable_output("amax_compute_algo", result, history.shape[1:])


def update_scaling_state(
    history: jax.Array,
    scale: jax.Array,
    counts: jax.Array,
    recipe: DelayedScaling,
    fmax: float | np.ndarray,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One update event for every slot (column) of a stacked state.

    Args:
        history: float32 ``(L, N)``; row 0 is the staging row (current amax, 0 = did not run).
        scale: float32 ``(N,)`` current scales.
        counts: float32 ``(N,)`` number of non-skipped events so far (wrapped, see module doc).
        recipe: the delayed-scaling recipe.
        fmax: largest finite value of the FP8 format these slots quantize into (a float, or a
            numpy ``(N,)`` array when the buffer mixes formats).

    Returns:
        ``(history, scale, counts)`` after the event. Slots whose staging value is 0 are
        unchanged; the others roll (``[0, H[2], ..., H[L-1], current]``), count one event, and
        get a new scale at events ``1, 1 + interval, ...``.
    """
    key = float(fmax) if np.ndim(fmax) == 0 else tuple(float(v) for v in np.ravel(fmax))
    return _update_scaling_state(history, scale, counts, recipe, key)


@partial(jax.jit, static_argnums=(3, 4))
def _update_scaling_state(
    history: jax.Array,
    scale: jax.Array,
    counts: jax.Array,
    recipe: DelayedScaling,
    fmax_key: float | tuple[float, ...],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    fmax = fmax_key if isinstance(fmax_key, float) else np.asarray(fmax_key)
    current = history[0]
    ran = current != 0
    amax = window_amax(history, recipe)
    # [0, H[2], ..., H[L-1], current]: drop the oldest, append the current, clear staging
    zero = jnp.zeros_like(current)[None]
    rolled = jnp.concatenate([zero, history[2:], current[None]]) if len(history) > 1 else zero
    new_history = jnp.where(ran, rolled, history)
    wrap = count_wrap(recipe.interval)
    new_counts = counts + ran.astype(counts.dtype)
    new_counts = jnp.where(new_counts > wrap, new_counts - wrap, new_counts)
    phase = (new_counts.astype(jnp.int32) - 1) % recipe.interval
    recompute = ran & (phase == 0)
    new_scales = jnp.where(recompute, new_scale(amax, scale, fmax, recipe), scale)
    return new_history, new_scales, new_counts

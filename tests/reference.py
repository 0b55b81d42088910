"""Independent references written from docs/semantics.md with numpy and plain Python.

Nothing here imports fp8kit's frontends: FP8 rounding is derived from the encoding's bit layout,
the update rule is the per-slot pseudo-code of docs/semantics.md section 3 in scalar float32
arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fp8kit.formats import FLOAT32_MAX, FP8Format
from fp8kit.recipe import DelayedScaling


def fp8_round(values: np.ndarray, fmt: FP8Format) -> np.ndarray:
    """Round float64 values to the nearest FP8 value (ties to even), saturating at +-fmax.

    NaN stays NaN; +-inf saturates to +-fmax. Returns float64 values of the FP8 results.
    """
    v = np.asarray(values, dtype=np.float64)
    out = np.empty_like(v)
    for i, x in np.ndenumerate(v):
        if math.isnan(x):
            out[i] = math.nan
            continue
        a = abs(x)
        if a > fmt.max:
            r = fmt.max
        elif a == 0.0:
            r = 0.0
        else:
            # Exponent of a, clamped to the subnormal range's fixed exponent.
            e = max(math.floor(math.log2(a)), 1 - fmt.bias)
            if 2.0**e > a:  # log2 rounding guard
                e -= 1
            elif 2.0 ** (e + 1) <= a:
                e += 1
            e = max(e, 1 - fmt.bias)
            quantum = 2.0 ** (e - fmt.mantissa_bits)
            r = float(np.round(a / quantum)) * quantum  # np.round: ties to even
            r = min(r, fmt.max)
        out[i] = math.copysign(r, x)
    return out


def quantize_reference(x: np.ndarray, scale: float, fmt: FP8Format) -> tuple[np.ndarray, float]:
    """docs/semantics.md section 2: values of ``saturate(rne(float32(x) * float32(scale)))`` and
    NaN-ignoring amax."""
    x32 = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # inf saturates; NaN (even sNaN) stays
        scaled = (x32 * np.float32(scale)).astype(np.float64)  # one float32 rounding, as spec
    q = fp8_round(scaled, fmt)
    finite_or_inf = np.abs(x32[~np.isnan(x32)])
    amax = float(finite_or_inf.max()) if finite_or_inf.size else 0.0
    return q, amax


def new_scale_reference(
    amax: float, old_scale: float, fmax: float, recipe: DelayedScaling
) -> float:
    """docs/semantics.md section 3 ``new_scale`` for one slot, in float32 arithmetic."""
    a = np.float32(amax)
    if recipe.scaling_factor_compute_algo is not None:
        s = float(
            recipe.scaling_factor_compute_algo(
                np.float32(a), np.float32(old_scale), np.float32(fmax), recipe
            )
        )
        return s if math.isfinite(s) and s > 0 else float(np.float32(old_scale))
    if not (math.isfinite(float(a)) and a > 0):
        return float(np.float32(old_scale))
    if recipe.power_2_scale:
        ratio = fmax / float(a)  # float64, exact enough to take floor(log2(.)) correctly
        exponent = math.floor(math.log2(ratio))
        if 2.0**exponent > ratio:
            exponent -= 1
        elif 2.0 ** (exponent + 1) <= ratio:
            exponent += 1
        return float(min(2.0 ** (exponent - recipe.margin), 2.0**127))
    with np.errstate(over="ignore"):
        s = np.float32(fmax * 2.0 ** (-recipe.margin)) / a
    if math.isinf(float(s)):
        s = np.float32(FLOAT32_MAX)
    return float(s)


def update_reference(
    history: np.ndarray,
    scale: np.ndarray,
    counts: np.ndarray,
    recipe: DelayedScaling,
    fmax: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One update event of docs/semantics.md section 3 for every slot (column) of a ``(L, n)``
    history."""
    h = np.array(history, dtype=np.float32, copy=True)
    s = np.array(scale, dtype=np.float32, copy=True)
    c = np.array(counts, dtype=np.int64, copy=True)
    length, n = h.shape
    algo = recipe.amax_compute_algo
    callable_amax = None
    if callable(algo):
        callable_amax = np.asarray(algo(h.copy()), dtype=np.float32)
    for j in range(n):
        r = h[0, j]
        if r == 0:
            continue
        window = np.concatenate([h[1:, j], [r]])
        if algo == "max":
            seen = window[~np.isnan(window)]
            amax = np.float32(seen.max() if seen.size else np.nan)  # NaN ignored
        elif algo == "most_recent":
            amax = np.float32(r)
        else:
            amax = callable_amax[j]
        if length == 1:
            h[:, j] = [0.0]
        else:
            h[:, j] = np.concatenate([[0.0], h[2:, j], [r]])
        c[j] += 1
        if (c[j] - 1) % recipe.interval == 0:
            s[j] = new_scale_reference(float(amax), float(s[j]), fmax, recipe)
    return h, s, c


def scale_sequence(
    amaxes: Sequence[float | None], recipe: DelayedScaling, fmax: float
) -> tuple[list[float], np.ndarray]:
    """Scales after each event for one slot fed ``amaxes`` (None = the slot did not run)."""
    length = recipe.amax_history_len
    h = np.zeros((length, 1), np.float32)
    s = np.ones(1, np.float32)
    c = np.zeros(1, np.int64)
    out = []
    for a in amaxes:
        if a is not None:
            h[0, 0] = max(h[0, 0], np.float32(a))
        h, s, c = update_reference(h, s, c, recipe, fmax)
        out.append(float(s[0]))
    return out, h[:, 0]


def current_scale_reference(amax: float, fmax: float, power_2_scale: bool = False) -> float:
    """docs/semantics.md section 2 current scaling: ``fmax / amax`` (float32), or its power-of-two
    floor ``2**floor(log2(fmax / amax))``; 1 where the amax is 0 or not finite."""
    recipe = DelayedScaling(power_2_scale=power_2_scale)
    return new_scale_reference(amax, 1.0, fmax, recipe)


FLOAT32_UNIT_ROUNDOFF = 2.0**-24
"""``u`` of float32: one correctly rounded float32 operation has relative error <= u."""


def fp8_rounding_band(
    low: np.ndarray, high: np.ndarray, scale: float, fmt: FP8Format
) -> tuple[np.ndarray, np.ndarray]:
    """FP8 values (float64) between which ``rne(saturate(float32(v) * float32(scale)))`` must lie
    for any ``v`` in the interval ``[low, high]`` (elementwise).

    For a result computed in float32 that can only be bounded, not reproduced bit for bit (float32
    accumulation order, float32 activation functions), this is the tight check: RNE rounding and
    saturation are monotonic, so the FP8 code of every admissible ``v`` lies between the codes of
    the interval's two ends. The interval is widened by ``2u`` relative for the float32 rounding
    of ``v`` and of its product with the scale. Where the interval holds no rounding midpoint both
    ends give the same code, so the check is exact there.

    Args:
        low, high: float64 bounds (before scaling) of the computed values, same shape.
        scale: the quantization scale (rounded to float32 as the cast does).
        fmt: target FP8 format.

    Returns:
        ``(code_low, code_high)``: float64 FP8 values, elementwise ``code_low <= code_high``.
    """
    s = float(np.float32(scale))
    widen = 1.0 + 2.0 * FLOAT32_UNIT_ROUNDOFF
    lo = np.asarray(low, np.float64) * s
    hi = np.asarray(high, np.float64) * s
    lo = np.where(lo < 0, lo * widen, lo / widen)
    hi = np.where(hi > 0, hi * widen, hi / widen)
    return fp8_round(lo, fmt), fp8_round(hi, fmt)

"""Per-cast quantization statistics, computed on the tensor's device without a host sync.

Definitions (one FP8 cast of a high-precision tensor ``x`` with ``scale`` into a format whose
largest finite value is ``fmax``; ``q`` is the FP8 result, ``deq(q) = q * (1 / scale)``):

- ``amax``: ``max |x|`` with NaN elements ignored (the value delayed scaling records).
- ``scale``: the factor the cast multiplied ``x`` by.
- ``saturated``: ``count(|float32(x) * scale| > fmax) / numel``: elements clipped to ``+-fmax``
  (an infinite ``x`` counts; NaN never does).
- ``flushed``: ``count(x != 0 and q == 0) / numel``: non-zero elements that became zero. Both
  fractions use all elements as the denominator, so they are comparable and can be added.
- ``snr_db``: ``10 * log10(sum x^2 / sum (x - deq(q))^2)`` over the finite elements of ``x``
  (differences and squares of the float32 values computed and summed in float64, so both
  energies are finite for every finite ``x``); ``+inf`` when the cast was exact (no error at all,
  including an all-zero ``x``).

Several casts into one slot during one step combine as: amax = max, scale = the last cast's,
counts and both energy sums added (so ``snr_db`` is that of all cast elements together).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fp8kit.torch import kernels
from fp8kit.torch.quantization import Float8Tensor

__all__ = ["FIELDS", "CastTotals", "cast_statistics", "combine", "snr_db"]

# Layout of the float64 vector returned by :func:`cast_statistics`.
FIELDS = ("amax", "scale", "saturated_count", "flushed_count", "signal", "noise")


def cast_statistics(
    x: torch.Tensor, q: Float8Tensor, scale: torch.Tensor, fmax: float
) -> torch.Tensor:
    """Raw statistics of one cast as a float64 vector ``(len(FIELDS),)`` on ``x``'s device.

    Args:
        x: the high-precision tensor that was cast, any shape.
        q: its FP8 result (``data`` of ``x.shape``, ``scale_inv``, ``amax``).
        scale: float32 tensor with one element, the scale the cast used.
        fmax: largest finite value of ``q``'s format.

    ``deq(q)`` is computed in float32 (as ``Float8Tensor.dequantize()``); the differences,
    squares and sums in float64: relative error ~1e-16 per operation, and no finite input
    overflows (float32's largest square, ~1.2e77, is far inside float64's range). Everything
    else is exact. The counts and energies come from :func:`fp8kit.torch.kernels.cast_error_sums`:
    one native pass over ``x`` and ``q`` on the CPU, torch ops (float32 and float64
    temporaries) elsewhere (docs/decisions/0256-native-cast-error-sums.md).
    """
    with torch.no_grad():
        sums = kernels.cast_error_sums(x.detach(), q.data, scale.reshape(()), q.scale_inv, fmax)
        amax = q.amax if q.amax is not None else torch.zeros((), device=x.device)
        head = torch.stack([amax.reshape(()), scale.reshape(())]).to(torch.float64)
        return torch.cat([head, sums])


class CastTotals:
    """Statistics of one slot over one step (one or more casts), as plain Python numbers."""

    __slots__ = (
        "amax",
        "casts",
        "flushed_count",
        "noise",
        "numel",
        "saturated_count",
        "scale",
        "signal",
    )

    def __init__(self) -> None:
        self.casts = 0
        self.numel = 0
        self.amax = 0.0
        self.scale = math.nan
        self.saturated_count = 0
        self.flushed_count = 0
        self.signal = 0.0
        self.noise = 0.0

    def add(self, numel: int, values: Sequence[float]) -> None:
        """Fold in one cast's ``numel`` and its :data:`FIELDS` vector (as floats)."""
        amax, scale, sat, flush, signal, noise = values
        self.casts += 1
        self.numel += numel
        self.amax = max(self.amax, amax)  # NaN cannot occur: the amax ignores NaN
        self.scale = scale
        self.saturated_count += int(sat)
        self.flushed_count += int(flush)
        self.signal += signal
        self.noise += noise

    @property
    def saturated(self) -> float:
        return self.saturated_count / self.numel if self.numel else 0.0

    @property
    def flushed(self) -> float:
        return self.flushed_count / self.numel if self.numel else 0.0

    @property
    def snr_db(self) -> float:
        return snr_db(self.signal, self.noise)


def snr_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)`` in dB; ``+inf`` for zero noise (an exact cast).

    Both energies are float64 sums of squares of finite float32 values, hence finite.
    """
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def combine(entries: Sequence[tuple[int, Sequence[float]]]) -> CastTotals:
    """Totals of several ``(numel, FIELDS vector)`` casts of one slot."""
    totals = CastTotals()
    for numel, values in entries:
        totals.add(numel, values)
    return totals

"""float64 references for ``fp8_matmul``'s FP8 output (bias, activation, output cast).

Built on tests/reference.py; only the FP8 operands' bytes and scales are read from fp8kit.
"""

from __future__ import annotations

import math

import numpy as np
import torch

import fp8kit.torch as f8
from fp8kit.formats import FP8Format
from tests.reference import FLOAT32_UNIT_ROUNDOFF, fp8_rounding_band


def activation64(y: np.ndarray, activation: str | None) -> np.ndarray:
    """The activations of fp8_matmul in float64."""
    if activation is None:
        return y
    if activation == "relu":
        return np.maximum(y, 0.0)
    if activation == "gelu":
        return 0.5 * y * (1.0 + np.vectorize(math.erf)(y / math.sqrt(2.0)))
    inner = math.sqrt(2.0 / math.pi) * (y + 0.044715 * y**3)
    return 0.5 * y * (1.0 + np.tanh(inner))


def activation_image(
    low: np.ndarray, high: np.ndarray, activation: str | None
) -> tuple[np.ndarray, np.ndarray]:
    """Exact bounds of ``activation`` over ``[low, high]``: relu is monotonic; GELU (both forms)
    decreases, then increases, with one minimum near -0.75 (located here on a fine grid)."""
    ends = activation64(low, activation), activation64(high, activation)
    out_low, out_high = np.minimum(*ends), np.maximum(*ends)
    if activation in ("gelu", "gelu_tanh"):
        grid = np.linspace(-0.8, -0.7, 100_001)
        values = activation64(grid, activation)
        t_min, v_min = grid[values.argmin()], values.min()
        out_low = np.where((low <= t_min) & (t_min <= high), v_min, out_low)
    return out_low, out_high


def assert_fp8_matmul_output(
    q: f8.Float8Tensor,
    a: f8.Float8Tensor,
    b: f8.Float8Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    out_scale: float,
    fmt: FP8Format,
) -> None:
    """Every FP8 code of ``fp8_matmul(..., out_scale=...)`` and its amax against float64 math.

    Error bound of the float32 pre-activation ``y`` (u = 2^-24): the FP8 x FP8 products are
    exact in float32, so summing K of them in any order errs by at most (K-1)u sum|a||b|; the
    two scale_inv factors and the bias add are three more roundings: |y32 - y| <= (K+3)u
    (sum|a||b| sa sb + |bias|). The activation maps that interval to an interval (exact image,
    activation_image), and its own float32 evaluation adds at most 16u|y| (GELU's erf/tanh
    cancellation for negative y is relative to y, not to gelu(y); relu adds nothing). All of it
    is ~1e-5 relative at most, far below the FP8 quantum (2^-4 relative for E4M3, 2^-3 for
    E5M2), so each code equals the float64 reference's code except where the interval holds a
    rounding midpoint; there either neighbour is right (fp8_rounding_band).
    """
    u = FLOAT32_UNIT_ROUNDOFF
    k = a.shape[1]
    sa, sb = a.scale_inv.item(), b.scale_inv.item()
    a64, b64 = a.data.to(torch.float64).numpy(), b.data.to(torch.float64).numpy()
    bias64 = np.zeros(1) if bias is None else bias.to(torch.float64).numpy()
    y = (a64 @ b64) * sa * sb + bias64  # exact products, float64 sums: the reference
    err = (k + 3) * u * ((np.abs(a64) @ np.abs(b64)) * sa * sb + np.abs(bias64))
    low, high = activation_image(y - err, y + err, activation)
    if activation in ("gelu", "gelu_tanh"):
        low, high = low - 16 * u * np.abs(y), high + 16 * u * np.abs(y)
    code_low, code_high = fp8_rounding_band(low, high, out_scale, fmt)
    got = q.data.to(torch.float64).numpy()
    outside = (got < code_low) | (got > code_high)
    assert not outside.any(), (
        f"{int(outside.sum())} FP8 codes outside the float64 band, first at "
        f"{np.argwhere(outside)[0]}: got {got[outside][0]}, band [{code_low[outside][0]}, "
        f"{code_high[outside][0]}]"
    )
    # The band is tight where the output matters: among outputs above 1% of the largest, only
    # values within ~1e-5 of a midpoint may take either neighbour. (Below that, GELU of a
    # negative y is computed in float32 with few correct bits, 1 + erf cancelling, so the band
    # rightly spans several codes there.)
    post = np.maximum(np.abs(low), np.abs(high))
    large = post >= 0.01 * post.max()
    assert (code_low != code_high)[large].mean() < 0.02
    assert q.scale_inv.item() == np.float32(1.0) / np.float32(out_scale)
    # amax = max |activation output| in float32: within the bounds of the largest magnitude.
    amax_low = float(np.maximum(np.where(low > 0, low, 0), np.where(high < 0, -high, 0)).max())
    amax_high = float(np.maximum(np.abs(low), np.abs(high)).max())
    assert amax_low <= q.amax.item() <= amax_high, (q.amax.item(), amax_low, amax_high)

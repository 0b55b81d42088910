"""The delayed-scaling update event as ONE Triton kernel (docs/semantics.md section 3).

``_delayed_update_kernel``: each program owns 32 columns (slots) of the ``(L, N)`` history and
walks its rows top to bottom in tiles of up to 64 rows, so every access is a 128-byte row
segment (coalesced along N). Per column, in one pass: the event's value (staging row, or the
given staging vector, 0 where the ``ran`` mask is False), the zero-skip, the window amax
(``"max"``: running maximum over the rows; ``"most_recent"``: the value), the in-place roll
``[0, H2, ..., H(L-1), value]`` (each tile is stored one row up after a barrier: all threads
of the program have read the tile before any of them overwrites a row another thread read), the
count, the scale on events ``1, 1 + interval, ...`` with the shared scale rule
(:func:`.triton_cast.scale_from_amax`), ``scale_inv = div_rn(1, scale)`` and the optional
non-finite event counter.

Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (the tests check it bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fp8kit.torch.kernels._common import UpdateConfig
from fp8kit.torch.kernels.triton_cast import scale_from_amax, triton
from fp8kit.torch.kernels.triton_launch import bind, launch

if triton is not None:
    import triton.language as tl

__all__ = ["delayed_update", "prepare_delayed_update"]

_COLS = 32  # columns per program: one 128-byte segment of each history row
_MAX_ROWS = 64  # rows per tile

if triton is not None:

    @triton.jit
    def _delayed_update_kernel(
        h_ptr,
        scale_ptr,
        scale_inv_ptr,
        count_ptr,
        ran_ptr,
        staging_ptr,
        nonfinite_ptr,
        L,
        N,
        interval,
        numerator,
        fmax_exp,
        fmax_mant,
        margin,
        ALGO: tl.constexpr,
        POW2: tl.constexpr,
        HAS_RAN: tl.constexpr,
        HAS_STAGING: tl.constexpr,
        HAS_NONFINITE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        if HAS_STAGING:
            r = tl.load(staging_ptr + cols, mask=cmask, other=0.0)
        else:
            r = tl.load(h_ptr + cols, mask=cmask, other=0.0)
        if HAS_RAN:
            ran = tl.load(ran_ptr.to(tl.pointer_type(tl.uint8), bitcast=True) + cols, mask=cmask)
            r = tl.where(ran != 0, r, 0.0)
        run = (r != 0.0) & cmask
        amax = tl.where(r == r, r, 0.0)  # NaN ignored (docs/semantics.md section 3)
        for i0 in range(1, L, ROWS):
            rows = i0 + tl.arange(0, ROWS)
            rmask = rows < L
            ptrs = h_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
            tile = tl.load(ptrs, mask=rmask[:, None] & cmask[None, :], other=0.0)
            if ALGO == 0:
                clean = tl.where(tile == tile, tile, 0.0)  # whatever tl.maximum does with NaN
                amax = tl.maximum(amax, tl.max(clean, axis=0))
            tl.debug_barrier()  # the tile is read by every thread before rows are overwritten
            tl.store(ptrs - N, tile, mask=(rows[:, None] >= 2) & rmask[:, None] & run[None, :])
        if L >= 2:
            tl.store(h_ptr + (L - 1).to(tl.int64) * N + cols, r, mask=run)
        tl.store(h_ptr + cols, tl.zeros_like(r), mask=run)
        count = tl.load(count_ptr + cols, mask=cmask, other=0) + run.to(tl.int64)
        tl.store(count_ptr + cols, count, mask=cmask)
        recompute = run & ((count - 1) % interval == 0)
        old = tl.load(scale_ptr + cols, mask=cmask, other=1.0)
        fresh = scale_from_amax(amax, old, numerator, fmax_exp, fmax_mant, margin, POW2)
        scale = tl.where(recompute, fresh, old)
        tl.store(scale_ptr + cols, scale, mask=cmask)
        tl.store(scale_inv_ptr + cols, tl.math.div_rn(1.0, scale), mask=cmask)
        if HAS_NONFINITE:
            is_inf = run & (r.to(tl.int32, bitcast=True) == 0x7F800000)
            counter = tl.load(nonfinite_ptr + cols, mask=cmask, other=0)
            tl.store(nonfinite_ptr + cols, counter + is_inf.to(tl.int64), mask=cmask)


def _launch_parts(
    history: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    count: torch.Tensor,
    config: UpdateConfig,
    ran: torch.Tensor | None,
    staging: torch.Tensor | None,
    nonfinite_count: torch.Tensor | None,
) -> tuple[tuple[int, ...], tuple, dict[str, object]] | None:
    """The kernel's ``(grid, args, options)`` for one event, or None when there is no column."""
    length, n = history.shape
    if n == 0:
        return None
    rows = min(_MAX_ROWS, 1 << max(0, (length - 2).bit_length()))  # >= L - 1, a power of 2
    args = (
        history,
        scale,
        scale_inv,
        count,
        ran if ran is not None else history,
        staging if staging is not None else history,
        nonfinite_count if nonfinite_count is not None else count,
        length,
        n,
        config.interval,
        config.numerator,
        config.fmax_exp,
        config.fmax_mant,
        config.margin_int,
        config.algo_id,
        config.power_2_scale,
        ran is not None,
        staging is not None,
        nonfinite_count is not None,
        _COLS,
        rows,
    )
    options = {"num_warps": 4 if rows * _COLS <= 1024 else 8, "enable_fp_fusion": False}
    return (-(-n // _COLS),), args, options


def delayed_update(
    history: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    count: torch.Tensor,
    config: UpdateConfig,
    ran: torch.Tensor | None,
    staging: torch.Tensor | None,
    nonfinite_count: torch.Tensor | None,
) -> None:
    """:func:`fp8kit.torch.kernels.delayed_update_` as one Triton kernel (in place)."""
    parts = _launch_parts(history, scale, scale_inv, count, config, ran, staging, nonfinite_count)
    if parts is not None:
        grid, args, options = parts
        launch(_delayed_update_kernel, grid, args, **options)


def _no_columns() -> None:
    """The event of a history without columns: nothing to launch."""


def prepare_delayed_update(
    history: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    count: torch.Tensor,
    config: UpdateConfig,
    ran: torch.Tensor | None,
    staging: torch.Tensor | None,
    nonfinite_count: torch.Tensor | None,
) -> Callable[[], None]:
    """:func:`delayed_update` on fixed tensors, as a function of no arguments: the launch is
    bound once (:func:`~fp8kit.torch.kernels.triton_launch.bind`); the tensors are held."""
    parts = _launch_parts(history, scale, scale_inv, count, config, ran, staging, nonfinite_count)
    if parts is None:
        return _no_columns
    grid, args, options = parts
    return bind(_delayed_update_kernel, grid, args, **options)

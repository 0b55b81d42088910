"""The CPU backend: every kernel is one call into the native library (``fp8_cast.cpp``).

A ctypes call runs no aten operator, so a cast costs only the ``torch.empty`` allocations of its
outputs in aten ops (see :func:`fp8kit.torch.kernels.cast_fp8` for the count). The library is
built and loaded by :mod:`._native`; the functions here assume it loaded and that
:mod:`.dispatch` checked the arguments (CPU tensors, dtypes, shapes).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from fp8kit.torch.kernels._common import (
    CastResult,
    CastSpec,
    UpdateConfig,
    cast_spec,
    dense,
    empty,
)
from fp8kit.torch.kernels._native import (
    _FP8_FMT_IDS,
    ISA_AUTO,
    _Lib,
    _raise_status,
    dequantize_unchecked,
    load_native,
)

__all__ = [
    "PreparedCast",
    "amax",
    "cast",
    "cast_current",
    "cast_error_sums",
    "delayed_update",
    "dequantize",
    "gemm_epilogue",
    "prepare_delayed_update",
    "small_fp8_gemm",
]

_F32 = torch.float32
_IN_IDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_MODE_GIVEN, _MODE_CURRENT, _MODE_FIRST_STEP = 0, 1, 2


def _run(
    x: torch.Tensor,
    spec: CastSpec,
    mode: int,
    scale: torch.Tensor | None,
    count: torch.Tensor | None,
    config: UpdateConfig,
    transpose: bool,
    amax_out: torch.Tensor | None,
    dbias: bool,
) -> CastResult:
    rule = _cast_rule(
        spec,
        mode,
        None if scale is None else scale.data_ptr(),
        None if count is None else count.data_ptr(),
        config,
    )
    amax_ptr = None if amax_out is None else amax_out.data_ptr()
    return _launch(load_native(), x, spec, rule, amax_ptr, transpose, dbias)


def _cast_rule(
    spec: CastSpec, mode: int, scale_ptr: int | None, count_ptr: int | None, config: UpdateConfig
) -> tuple:
    """``cast_fused``'s arguments from the format id to the scale rule (nine, in its order)."""
    return (spec.fmt_id, ISA_AUTO, mode, scale_ptr, count_ptr, config.numerator,
            config.power_2_scale, config.fmax_exp, config.fmax_mant)  # fmt: skip


def _launch(
    lib: _Lib,
    x: torch.Tensor,
    spec: CastSpec,
    rule: tuple,
    amax_ptr: int | ctypes.c_void_p | None,
    transpose: bool,
    dbias: bool,
) -> CastResult:
    """One ``cast_fused`` call: allocates the outputs, passes the given addresses.

    ``rule`` is :func:`_cast_rule`'s tuple, as Python values or as ctypes values converted once
    (:class:`PreparedCast`); ``amax_ptr`` None asks for the amax as a new tensor. Outputs are
    allocated with sizes as separate ints, the form torch parses fastest (:func:`empty`)."""
    x = dense(x)
    if transpose or dbias:
        m, n = x.shape
    else:
        m, n = 1, x.numel()
    fp8_dtype = spec.fp8_dtype
    data = empty(x.shape, fp8_dtype)
    data_t = torch.empty(n, m, dtype=fp8_dtype) if transpose else None
    amax_res = torch.empty(size=(), dtype=_F32) if amax_ptr is None else None
    scale_inv = torch.empty(size=(), dtype=_F32)
    bias = torch.empty(n, dtype=x.dtype) if dbias else None
    status = lib.cast_fused(
        x.data_ptr(),
        spec.in_id,
        m,
        n,
        *rule,
        data.data_ptr(),
        None if data_t is None else data_t.data_ptr(),
        amax_ptr,
        None if amax_res is None else amax_res.data_ptr(),
        scale_inv.data_ptr(),
        None if bias is None else bias.data_ptr(),
    )
    if status:
        _raise_status(status, "fp8kit native cast")
    return CastResult(data, data_t, amax_res, scale_inv, bias)


class PreparedCast:
    """:func:`cast` for one fixed ``(scale, fp8 dtype, amax_out, first_step_count)``: their
    addresses and the format's constants are bound, converted to ctypes values once, so a call
    resolves only ``x``. An ``x`` the bound call cannot take (not a CPU float32 / bfloat16 /
    float16 tensor, empty, or not 2-D with ``transpose`` / ``dbias``), or a call inside a
    ``torch.compile`` trace, goes to ``fallback``, the
    checked API with the same arguments. Holds the bound tensors, so their storage outlives
    it."""

    __slots__ = ("_amax_ptr", "_fallback", "_lib", "_rules", "_tensors")

    def __init__(
        self,
        scale: torch.Tensor,
        fp8_dtype: torch.dtype,
        amax_out: torch.Tensor | None,
        first_step_count: torch.Tensor | None,
        fallback: Callable[[torch.Tensor, bool, bool], CastResult],
    ) -> None:
        self._lib = load_native()
        mode = _MODE_GIVEN if first_step_count is None else _MODE_FIRST_STEP
        scale_ptr = scale.data_ptr()
        count_ptr = None if first_step_count is None else first_step_count.data_ptr()
        rule_types = self._lib.cast_fused.argtypes[4:13]
        self._rules = {}
        for dtype in _IN_IDS:
            spec = cast_spec(fp8_dtype, torch.empty(0, dtype=dtype))
            rule = _cast_rule(spec, mode, scale_ptr, count_ptr, spec.current_rules[False])
            self._rules[dtype] = (spec, _as_ctypes(rule_types, rule))
        self._amax_ptr = None if amax_out is None else ctypes.c_void_p(amax_out.data_ptr())
        self._tensors = (scale, amax_out, first_step_count)
        self._fallback = fallback

    def __call__(self, x: torch.Tensor, transpose: bool, dbias: bool) -> CastResult:
        rule = self._rules.get(x.dtype)
        if (
            rule is None
            or not x.is_cpu
            or not x.numel()
            or ((transpose or dbias) and x.dim() != 2)
            or torch.compiler.is_compiling()  # a trace takes cast_fp8's reference
        ):
            return self._fallback(x, transpose, dbias)
        return _launch(self._lib, x, rule[0], rule[1], self._amax_ptr, transpose, dbias)


def _as_ctypes(types: list, values: tuple) -> tuple:
    """``values`` converted once to the ctypes values of their ``types`` (a foreign call then
    passes them without converting them again: about 0.1 us per argument)."""
    return tuple(t(v) for t, v in zip(types, values, strict=True))


def cast(
    x: torch.Tensor,
    scale: torch.Tensor,
    spec: CastSpec,
    transpose: bool,
    amax_out: torch.Tensor | None,
    dbias: bool,
    first_step_count: torch.Tensor | None,
) -> CastResult:
    """:func:`fp8kit.torch.kernels.cast_fp8` in one native call."""
    mode = _MODE_GIVEN if first_step_count is None else _MODE_FIRST_STEP
    config = spec.current_rules[False]
    return _run(x, spec, mode, scale, first_step_count, config, transpose, amax_out, dbias)


def cast_current(
    x: torch.Tensor, spec: CastSpec, power_2_scale: bool, transpose: bool, dbias: bool
) -> CastResult:
    """:func:`fp8kit.torch.kernels.cast_fp8_current` in one native call (amax pass + cast)."""
    config = spec.current_rules[power_2_scale]
    return _run(x, spec, _MODE_CURRENT, None, None, config, transpose, None, dbias)


def amax(x: torch.Tensor, amax_out: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`fp8kit.torch.kernels.compute_amax` in one native call."""
    lib = load_native()
    x = dense(x)
    out = torch.empty(size=(), dtype=_F32) if amax_out is None else None
    status = lib.amax_fused(
        x.data_ptr(),
        _IN_IDS[x.dtype],
        x.numel(),
        ISA_AUTO,
        None if amax_out is None else amax_out.data_ptr(),
        None if out is None else out.data_ptr(),
    )
    if status:
        _raise_status(status, "fp8kit native amax")
    return out


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
    """:func:`fp8kit.torch.kernels.delayed_update_` in one native call (in place)."""
    args = _update_args(history, scale, scale_inv, count, config, ran, staging, nonfinite_count)
    status = load_native().delayed_update(*args, None)
    if status:
        _raise_status(status, "fp8kit native delayed_update_")


def _update_args(
    history: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    count: torch.Tensor,
    config: UpdateConfig,
    ran: torch.Tensor | None,
    staging: torch.Tensor | None,
    nonfinite_count: torch.Tensor | None,
) -> tuple:
    """The native update's arguments up to its last (the +inf count out-pointer)."""
    length, n = history.shape
    return (
        history.data_ptr(),
        length,
        n,
        scale.data_ptr(),
        scale_inv.data_ptr(),
        count.data_ptr(),
        None if ran is None else ran.data_ptr(),
        None if staging is None else staging.data_ptr(),
        None if nonfinite_count is None else nonfinite_count.data_ptr(),
        config.algo_id,
        config.interval,
        config.numerator,
        config.power_2_scale,
        config.fmax_exp,
        config.fmax_mant,
        config.margin_int,
    )


class _PreparedUpdate:
    """The native update call with its arguments bound; holds the tensors whose addresses it
    passes, so they outlive it. A call returns the number of +inf event values."""

    __slots__ = ("_args", "_infinite", "_kernel", "_tensors")

    def __init__(self, kernel: Callable[..., int], args: tuple, tensors: tuple) -> None:
        self._infinite = ctypes.c_int64(0)
        self._kernel, self._tensors = kernel, tensors
        self._args = (*args, ctypes.byref(self._infinite))

    def __call__(self) -> int:
        status = self._kernel(*self._args)
        if status:
            _raise_status(status, "fp8kit native delayed_update_")
        return self._infinite.value


def prepare_delayed_update(
    history: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    count: torch.Tensor,
    config: UpdateConfig,
    staging: torch.Tensor | None,
    nonfinite_count: torch.Tensor | None,
) -> Callable[[], int]:
    """:func:`fp8kit.torch.kernels.prepare_delayed_update` as one native call with its
    arguments bound."""
    lib = load_native()
    args = _update_args(history, scale, scale_inv, count, config, None, staging, nonfinite_count)
    args = _as_ctypes(lib.delayed_update.argtypes[: len(args)], args)
    tensors = (history, scale, scale_inv, count, staging, nonfinite_count)
    return _PreparedUpdate(lib.delayed_update, args, tensors)


def dequantize(
    data: torch.Tensor,
    scale: torch.Tensor | None,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`fp8kit.torch.kernels.dequantize_fp8` in one native call (``dtype`` float32 or
    bfloat16; ``out`` as checked there)."""
    return dequantize_unchecked(load_native(), data, scale, dtype, ISA_AUTO, out)


def gemm_epilogue(
    acc: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    isa: int = ISA_AUTO,
) -> torch.Tensor:
    """:func:`fp8kit.torch.kernels.gemm_epilogue` in one native call (in place for float32;
    ``isa`` forces a loop, for the tests: every loop gives the same bits)."""
    lib = load_native()
    m, n = acc.shape
    out = acc if out_dtype is _F32 else torch.empty(m, n, dtype=out_dtype)
    if bias is not None:
        bias = dense(bias)
    status = lib.gemm_epilogue(
        acc.data_ptr(),
        m,
        n,
        a_scale.data_ptr(),
        b_scale.data_ptr(),
        None if bias is None else bias.data_ptr(),
        -1 if bias is None else _IN_IDS[bias.dtype],
        out.data_ptr(),
        _IN_IDS[out_dtype],
        isa,
    )
    if status:
        _raise_status(status, "fp8kit native gemm_epilogue")
    return out


def small_fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    isa: int = ISA_AUTO,
    b_transposed: bool = False,
) -> torch.Tensor:
    """:func:`fp8kit.torch.kernels.small_fp8_gemm` in one native call (``isa`` forces a loop,
    for the tests; ``b_transposed``: ``b`` holds ``B^T``, ``(N, K)``, read through its
    strides)."""
    lib = load_native()
    m, k = a.shape
    if b_transposed:
        n = b.shape[0]
        b_sn, b_sk = b.stride()
    else:
        n = b.shape[1]
        b_sk, b_sn = b.stride()
    out = torch.empty(m, n, dtype=out_dtype)
    if bias is not None:
        bias = dense(bias)
    a_sm, a_sk = a.stride()
    status = lib.small_gemm(
        a.data_ptr(),
        _FP8_FMT_IDS[a.dtype],
        a_sm,
        a_sk,
        b.data_ptr(),
        _FP8_FMT_IDS[b.dtype],
        b_sk,
        b_sn,
        m,
        n,
        k,
        a_scale.data_ptr(),
        b_scale.data_ptr(),
        None if bias is None else bias.data_ptr(),
        -1 if bias is None else _IN_IDS[bias.dtype],
        out.data_ptr(),
        _IN_IDS[out_dtype],
        isa,
    )
    if status:
        _raise_status(status, "fp8kit native small_fp8_gemm")
    return out


def cast_error_sums(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    fmax: float,
    isa: int = ISA_AUTO,
) -> torch.Tensor:
    """:func:`fp8kit.torch.kernels.cast_error_sums` in one native call (``isa`` forces a loop,
    for the tests: every loop gives the same bits)."""
    x, q = dense(x), dense(q)
    out = torch.empty(4, dtype=torch.float64)
    status = load_native().cast_error_sums(
        x.data_ptr(),
        _IN_IDS[x.dtype],
        q.data_ptr(),
        _FP8_FMT_IDS[q.dtype],
        x.numel(),
        scale.data_ptr(),
        scale_inv.data_ptr(),
        fmax,
        isa,
        out.data_ptr(),
    )
    if status:
        _raise_status(status, "fp8kit native cast_error_sums")
    return out

"""The FP8 kernel API and the one place that picks a backend for it.

Backends (``docs/decisions/0210-kernel-api-and-dispatch.md``):

- ``"native"`` for CPU tensors: the C++ library (:mod:`.native`, built on first use by
  :mod:`._native`). One ctypes call per kernel, so zero aten ops beyond the outputs'
  ``torch.empty``.
- ``"triton"`` for CUDA tensors: :mod:`.triton_cast` / :mod:`.triton_update`, imported on the
  first CUDA call (``triton`` is optional and takes a third of a second to import, so a CPU-only
  process never pays for it).
- ``"reference"`` (:mod:`.reference`, pure torch, same results bit for bit) for anything else:
  other devices, ``torch.compile`` tracing, a native library that could not be built (one
  :class:`NativeKernelWarning`), a missing ``triton``, or a Triton kernel that failed once (one
  warning, then the reference for the rest of the process).

Every public function checks its arguments once, cheaply (dictionary lookups and attribute
reads), and raises a clear error naming the parameter; the backends trust them. ``backend=``
forces one backend (tests, benchmarks); None (the default) picks as above.
"""

from __future__ import annotations

import functools
import importlib
import math
import numbers
import warnings
from collections.abc import Callable
from types import ModuleType

import torch

from fp8kit.formats import FP8Format
from fp8kit.torch.kernels import native, native_ops, reference
from fp8kit.torch.kernels._common import (
    INPUT_DTYPES,
    CastResult,
    cast_spec,
    update_config,
)
from fp8kit.torch.kernels._native import (
    NativeKernelWarning,
    load_native,
    native_available,
    native_build_error,
    native_cast_transpose,
)

__all__ = [
    "BACKENDS",
    "CastResult",
    "backend_for",
    "cast_error_sums",
    "cast_fp8",
    "cast_fp8_current",
    "cast_to_fp8_transpose",
    "compute_amax",
    "delayed_update_",
    "dequantize_fp8",
    "gemm_epilogue",
    "prepare_cast",
    "prepare_delayed_update",
    "small_fp8_gemm",
    "small_fp8_gemm_unchecked",
    "triton_available",
    "triton_error",
    "try_triton_cast",
]

BACKENDS = ("native", "triton", "reference")
"""Names accepted by ``backend=``."""

_F32 = torch.float32
_I64 = torch.int64
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_TRITON_MODULES = ("fp8kit.torch.kernels.triton_cast", "fp8kit.torch.kernels.triton_update")
# The Triton backend: None until the first CUDA call, then a namespace of its functions, or
# False when triton cannot be imported or one of its kernels failed.
_triton_state: dict[str, object] = {"backend": None, "error": None}


class _TritonBackend:
    """The Triton modules' functions under the backend names (see :mod:`.triton_cast`)."""

    def __init__(self, cast_module: ModuleType, update_module: ModuleType) -> None:
        self.cast = cast_module.cast
        self.cast_current = cast_module.cast_current
        self.amax = cast_module.amax
        self.delayed_update = update_module.delayed_update
        self.prepare_delayed_update = update_module.prepare_delayed_update
        self.prepared_slot_cast = cast_module.PreparedSlotCast
        self.triton_cast = cast_module.triton_cast
        self.triton_cast_transpose = cast_module.triton_cast_transpose


def _load_triton() -> _TritonBackend | None:
    """The Triton backend, importing it on first use (None without triton or after a failure)."""
    backend = _triton_state["backend"]
    if backend is None:
        cast_module = importlib.import_module(_TRITON_MODULES[0])  # lazy: triton is optional
        if cast_module.triton_available():
            backend = _TritonBackend(cast_module, importlib.import_module(_TRITON_MODULES[1]))
        else:
            backend = False
            _triton_state["error"] = "triton is not installed"
        _triton_state["backend"] = backend
    return backend or None  # type: ignore[return-value]


def triton_available() -> bool:
    """True when the Triton backend can run: ``triton`` imports and no kernel has failed."""
    return _load_triton() is not None


def triton_error() -> str | None:
    """Why the Triton backend is off: not installed, or the first kernel failure that switched
    CUDA tensors to the torch kernels for this process (None while it is on or never tried)."""
    return None if _triton_state["backend"] else _triton_state["error"]  # type: ignore[return-value]


def _triton_failed(exc: Exception) -> None:
    """Disable the Triton backend for this process with one warning (later calls use torch)."""
    _triton_state["backend"] = False
    _triton_state["error"] = f"{type(exc).__name__}: {exc}"
    warnings.warn(
        "fp8kit: a Triton FP8 kernel failed, so fp8kit uses its pure-torch kernels for CUDA "
        f"tensors from now on (same results). Reason: {str(_triton_state['error'])[-2000:]}",
        NativeKernelWarning,
        stacklevel=4,
    )


def backend_for(x: torch.Tensor) -> str:
    """The backend the automatic dispatch runs for tensors like ``x`` (``"native"``,
    ``"triton"`` or ``"reference"``); loads the native library or imports triton if needed."""
    return _auto(x)[0]


def _auto(x: torch.Tensor) -> tuple[str, object]:
    if x.is_cuda:
        if not torch.compiler.is_compiling():
            triton_backend = _load_triton()
            if triton_backend is not None:
                return "triton", triton_backend
    elif x.is_cpu and not torch.compiler.is_compiling() and load_native() is not None:
        return "native", native
    return "reference", reference


def _forced(name: str) -> object:
    if name == "reference":
        return reference
    if name == "native":
        if load_native() is None:
            raise RuntimeError(
                f"backend='native': the native library is unavailable ({native_build_error()})"
            )
        return native
    if name == "triton":
        triton_backend = _load_triton()
        if triton_backend is None:
            raise RuntimeError(f"backend='triton' is unavailable: {_triton_state['error']}")
        return triton_backend
    raise ValueError(f"backend must be None or one of {BACKENDS}, got {name!r}")


def _call(x: torch.Tensor, backend: str | None, method: str, *args: object) -> object:
    """Run ``method`` of the chosen backend; a Triton failure falls back to the reference."""
    if backend is None:
        name, impl = _auto(x)
    else:
        if backend == "native" and not x.is_cpu:  # the call's fault first, then the machine's
            raise ValueError(f"backend='native' runs on CPU tensors only, got x on {x.device}")
        name, impl = backend, _forced(backend)
    if name != "triton" or backend is not None:
        return getattr(impl, method)(*args)
    try:
        return getattr(impl, method)(*args)
    except Exception as exc:  # compile / launch failure: the reference from now on
        _triton_failed(exc)
        return getattr(reference, method)(*args)


# ---------------------------------------------------------------------------------------------
# Argument checks (cheap; they run on every call)


def _describe(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


def _check_one(name: str, t: object, dtype: torch.dtype, x: torch.Tensor) -> None:
    """``t`` must be a one-element ``dtype`` tensor on ``x``'s device."""
    if isinstance(t, torch.Tensor) and t.dtype is dtype and t.numel() == 1 and t.device == x.device:
        return
    raise TypeError(
        f"{name} must be a {dtype} tensor with one element on x's device ({x.device}), "
        f"got {_describe(t)}"
    )


def _check_2d(x: torch.Tensor, what: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{what} needs a 2-D x of shape (M, N), got shape {tuple(x.shape)}")


# ---------------------------------------------------------------------------------------------
# The API


def cast_fp8(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype | FP8Format,
    *,
    transpose: bool = False,
    amax_out: torch.Tensor | None = None,
    dbias: bool = False,
    first_step_current: torch.Tensor | None = None,
    backend: str | None = None,
) -> CastResult:
    """Cast ``x`` to FP8 with ``scale`` (delayed scaling) in one read of ``x``.

    ``q = saturate(round_nearest_even(float32(x) * scale))`` (NaN stays NaN, +-inf saturates to
    +-fmax), bit for bit :func:`.reference.cast_to_fp8_reference`.

    Args:
        x: float32 / bfloat16 / float16 tensor, any shape (2-D for ``transpose`` / ``dbias``).
            A non-contiguous ``x`` is copied to row-major first.
        scale: float32 one-element tensor on ``x``'s device.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (or ``E4M3`` / ``E5M2``).
        transpose: also write ``data_t``, the ``(N, M)`` row-major transpose.
        amax_out: float32 one-element tensor on ``x``'s device (typically a view of one element
            of a state's staging row, any strides): the kernel folds the amax into it in place,
            ``amax_out = max(amax_out, max|x|)`` (an atomic max on CUDA), and ``result.amax``
            is None (no allocation, no fill kernel).
        dbias: also compute the column sums of ``x`` (float32, rounded to ``x.dtype``).
        first_step_current: the slot's int64 one-element update-count tensor: where it is 0
            the cast uses the current scale ``fmax / max|x|`` (margin 0, not a power of two;
            1 for an amax of 0 or inf) instead of ``scale``, decided on the device
            (``DelayedScaling(first_step_scaling="current")``); ``scale_inv`` is that of the
            scale used. None: always ``scale``.
        backend: None (automatic) or one of :data:`BACKENDS`.

    Returns:
        :class:`CastResult` ``(data, data_t, amax, scale_inv, dbias)``.

    Cost: CUDA (Triton) 1 kernel (+1 amax pass with ``first_step_current``, +1 reduction with
    ``dbias``, +1 fill when ``amax_out`` is None), no host synchronisation; CPU one native call
    and 2-5 ``aten::empty`` (data, data_t, amax, scale_inv, dbias), no other aten op for a
    contiguous ``x``.
    """
    spec = cast_spec(fp8_dtype, x)
    _check_one("scale", scale, _F32, x)
    if transpose:
        _check_2d(x, "transpose=True")
    if dbias:
        _check_2d(x, "dbias=True")
    if amax_out is not None:
        _check_one("amax_out", amax_out, _F32, x)
    if first_step_current is not None:
        _check_one("first_step_current", first_step_current, _I64, x)
    if x.numel() == 0:
        backend = "reference"
    return _call(x, backend, "cast", x, scale, spec, transpose, amax_out, dbias, first_step_current)  # type: ignore[return-value]


def prepare_cast(
    scale: torch.Tensor,
    fp8_dtype: torch.dtype | FP8Format,
    *,
    amax_out: torch.Tensor | None = None,
    first_step_current: torch.Tensor | None = None,
) -> Callable[[torch.Tensor, bool, bool], CastResult]:
    """:func:`cast_fp8` with ``scale``, ``fp8_dtype``, ``amax_out`` and ``first_step_current``
    checked and resolved once, for a caller that casts into the same slot again and again (the
    modules' hot path, docs/performance.md).

    Returns ``cast(x, transpose, dbias)``, equal to ``cast_fp8(x, scale, fp8_dtype,
    transpose=transpose, amax_out=amax_out, dbias=dbias, first_step_current=...)`` bit for bit.
    On the CPU with the native library it is one native call with the bound tensors' addresses
    (they must keep their storage; the function holds them); on CUDA with Triton, the Triton
    launch with the bound tensors, after the checks that depend on ``x``; elsewhere, and for an
    ``x`` the bound call cannot take, it is :func:`cast_fp8` itself (its checks and backends).
    """
    if not (isinstance(scale, torch.Tensor) and scale.dtype is _F32 and scale.numel() == 1):
        raise TypeError(
            f"scale must be a torch.float32 tensor with one element, got {_describe(scale)}"
        )
    dtype = cast_spec(fp8_dtype, scale).fp8_dtype  # a float32 "x": only fp8_dtype can fail
    if amax_out is not None:
        _check_one("amax_out", amax_out, _F32, scale)
    if first_step_current is not None:
        _check_one("first_step_current", first_step_current, _I64, scale)

    def fallback(x: torch.Tensor, transpose: bool, dbias: bool) -> CastResult:
        return cast_fp8(
            x,
            scale,
            dtype,
            transpose=transpose,
            amax_out=amax_out,
            dbias=dbias,
            first_step_current=first_step_current,
        )

    name, impl = _auto(scale)
    if name == "native":
        return native.PreparedCast(scale, dtype, amax_out, first_step_current, fallback)
    if name == "triton":
        return _PreparedTritonCast(impl, scale, dtype, amax_out, first_step_current, fallback)  # type: ignore[arg-type]
    return fallback


class _PreparedTritonCast:
    """:func:`prepare_cast`'s function on CUDA: the Triton cast with the slot's tensors and
    format bound, so a call checks only what depends on ``x`` (its dtype, device, size and
    rank) before the launch. An ``x`` it cannot take, or a call inside a ``torch.compile``
    trace, goes to ``fallback`` (:func:`cast_fp8`,
    whose checks raise the clear errors); a failing launch switches the process to the torch
    kernels, as :func:`cast_fp8` does (:func:`_triton_failed`)."""

    __slots__ = (
        "_amax_out", "_backend", "_count", "_cuda", "_device", "_fallback", "_scale", "_slot",
        "_specs",
    )  # fmt: skip

    def __init__(
        self,
        backend: _TritonBackend,
        scale: torch.Tensor,
        fp8_dtype: torch.dtype,
        amax_out: torch.Tensor | None,
        first_step_count: torch.Tensor | None,
        fallback: Callable[[torch.Tensor, bool, bool], CastResult],
    ) -> None:
        self._backend = backend
        self._scale, self._amax_out, self._count = scale, amax_out, first_step_count
        self._cuda, self._device = scale.is_cuda, scale.get_device()
        self._specs = {dt: cast_spec(fp8_dtype, torch.empty(0, dtype=dt)) for dt in INPUT_DTYPES}
        self._fallback = fallback
        # a delayed-scaling slot's cast: launches planned per input kind (ADR 0262)
        self._slot = None
        if amax_out is not None and first_step_count is None:
            self._slot = backend.prepared_slot_cast(scale, amax_out)

    def __call__(self, x: torch.Tensor, transpose: bool, dbias: bool) -> CastResult:
        spec = self._specs.get(x.dtype)
        if (
            spec is None
            or _triton_state["backend"] is not self._backend  # a kernel failed since
            or x.is_cuda is not self._cuda
            or x.get_device() != self._device
            or torch.compiler.is_compiling()  # a trace takes cast_fp8's reference
            or not x.numel()
            or ((transpose or dbias) and x.dim() != 2)
        ):
            return self._fallback(x, transpose, dbias)
        try:
            if self._slot is not None:
                return self._slot(x, spec, transpose, dbias)  # type: ignore[no-any-return]
            return self._backend.cast(  # type: ignore[no-any-return]
                x, self._scale, spec, transpose, self._amax_out, dbias, self._count
            )
        except Exception as exc:  # compile / launch failure: the torch kernels from now on
            _triton_failed(exc)
            return self._fallback(x, transpose, dbias)


def cast_fp8_current(
    x: torch.Tensor,
    fp8_dtype: torch.dtype | FP8Format,
    *,
    power_2_scale: bool = False,
    transpose: bool = False,
    dbias: bool = False,
    backend: str | None = None,
) -> CastResult:
    """Current scaling: cast ``x`` with ``scale = fmax / max|x|`` computed on the device.

    The scale rule is the delayed-scaling one with margin 0 (``compute_scale``): an amax of 0
    or inf gives scale 1, an overflowing ratio FLT_MAX, ``power_2_scale`` rounds down to a power
    of two. Results equal ``fp8kit.torch.quantization.quantize_current`` bit for bit.

    Args:
        x: float32 / bfloat16 / float16 tensor (2-D for ``transpose`` / ``dbias``).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        power_2_scale: round the scale down to a power of two.
        transpose, dbias, backend: as in :func:`cast_fp8`.

    Returns:
        :class:`CastResult`; ``amax`` is ``max|x|`` (NaN ignored), ``scale_inv`` ``1 / scale``.

    Cost: CUDA 2 kernels (amax partials, then the cast, whose programs each reduce the partials
    and compute the scale; +1 with ``dbias``), no host synchronisation; CPU one native call
    (amax pass + cast) and 3-5 ``aten::empty``.
    """
    spec = cast_spec(fp8_dtype, x)
    if not isinstance(power_2_scale, bool):
        raise TypeError(f"power_2_scale must be a bool, got {power_2_scale!r}")
    if transpose:
        _check_2d(x, "transpose=True")
    if dbias:
        _check_2d(x, "dbias=True")
    if x.numel() == 0:
        backend = "reference"
    return _call(x, backend, "cast_current", x, spec, power_2_scale, transpose, dbias)  # type: ignore[return-value]


def compute_amax(
    x: torch.Tensor, *, amax_out: torch.Tensor | None = None, backend: str | None = None
) -> torch.Tensor | None:
    """``max |x|`` with NaN ignored (0 for an empty or all-NaN ``x``), in one read.

    Args:
        x: float32 / bfloat16 / float16 tensor, any shape.
        amax_out: as in :func:`cast_fp8`: fold the amax into it in place and return None.
        backend: None (automatic) or one of :data:`BACKENDS`.

    Returns:
        A float32 0-d tensor, or None with ``amax_out``. CUDA: 1 kernel (+1 fill without
        ``amax_out``); CPU: one native call.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in INPUT_DTYPES:
        raise TypeError(f"x must be a float32, bfloat16 or float16 tensor, got {_describe(x)}")
    if amax_out is not None:
        _check_one("amax_out", amax_out, _F32, x)
    if x.numel() == 0:
        backend = "reference"
    return _call(x, backend, "amax", x, amax_out)  # type: ignore[return-value]


def delayed_update_(
    history: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    count: torch.Tensor,
    *,
    fmax: float,
    margin: float = 0,
    interval: int = 1,
    algo: str = "max",
    power_2_scale: bool = False,
    ran: torch.Tensor | None = None,
    staging: torch.Tensor | None = None,
    nonfinite_count: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """One delayed-scaling update event (docs/semantics.md section 3) for every column, in place.

    Column ``j``'s event value is ``r = staging[j]`` (``history[0, j]`` when ``staging`` is
    None), or 0 where ``ran[j]`` is False. Where ``r == 0`` the column is skipped: nothing of it
    changes (its ``history[0, j]`` keeps any staging value). Elsewhere: window amax (``"max"``:
    max of ``history[1:, j]`` and ``r``; ``"most_recent"``: ``r``), history becomes
    ``[0, H2, ..., H(L-1), r]`` (``[0]`` when ``L == 1``), ``count += 1``, and on events
    ``1, 1 + interval, ...`` (``(count - 1) % interval == 0``) a new scale by the rule of
    ``compute_scale``: ``float32(fmax * 2**-margin) / amax`` (inf -> FLT_MAX), or the power of
    two ``2**(floor(log2(fmax / amax)) - margin)``, the old scale where the amax is 0 or not
    finite. Then ``scale_inv = 1 / scale`` (correctly rounded) for every column, and
    ``nonfinite_count[j] += 1`` where ``r`` is +inf.

    Args:
        history: float32 ``(L, N)`` contiguous; row 0 is the staging row.
        scale, scale_inv: float32 ``(N,)`` contiguous.
        count: int64 ``(N,)`` contiguous, the non-skipped events so far.
        fmax: the format's largest value (448.0 or 57344.0).
        margin, interval, power_2_scale: the recipe's.
        algo: ``"max"`` or ``"most_recent"`` (callables run in torch, outside the kernels).
        ran: optional bool ``(N,)``: False columns are treated as not run (skipped).
        staging: optional float32 ``(N,)``: the event's values (e.g. after an all-reduce)
            instead of ``history[0]``; rolled columns still get ``history[0] = 0``.
        nonfinite_count: optional int64 ``(N,)`` counter of +inf events.
        backend: None (automatic) or one of :data:`BACKENDS`.

    Cost: CUDA 1 kernel; CPU 1 native call (no aten op); no host synchronisation.
    """
    config = update_config(fmax, margin, interval, algo, power_2_scale)
    _check_update(history, scale, scale_inv, count, ran, staging, nonfinite_count)
    _call(
        history,
        backend,
        "delayed_update",
        history,
        scale,
        scale_inv,
        count,
        config,
        ran,
        staging,
        nonfinite_count,
    )


def prepare_delayed_update(
    history: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    count: torch.Tensor,
    *,
    fmax: float,
    margin: float = 0,
    interval: int = 1,
    algo: str = "max",
    power_2_scale: bool = False,
    staging: torch.Tensor | None = None,
    nonfinite_count: torch.Tensor | None = None,
    backend: str | None = None,
) -> Callable[[], int | None]:
    """:func:`delayed_update_` over every column (no ``ran`` mask), checked and resolved once:
    returns a function of no arguments that runs one event, for a caller that runs the same
    event on the same tensors again and again (docs/performance.md).

    The tensors are held by the returned function and must keep their storage (the CPU
    function calls the kernel on their addresses). Arguments as in :func:`delayed_update_`;
    a ``staging`` row (the reduced row of a multi-rank event) is read at each call.

    The function returns the number of columns whose event value was +inf where that costs no
    host synchronisation (the native CPU kernel), else None (read ``nonfinite_count`` then).
    Cost per call: CPU one native call (no aten op, no allocation); CUDA 1 kernel.
    """
    config = update_config(fmax, margin, interval, algo, power_2_scale)
    _check_update(history, scale, scale_inv, count, None, staging, nonfinite_count)
    if backend is not None:
        _forced(backend)  # an unknown or unavailable backend fails here, not at the first event
    if (backend or _auto(history)[0]) == "native":
        return native.prepare_delayed_update(
            history, scale, scale_inv, count, config, staging, nonfinite_count
        )
    args = (history, scale, scale_inv, count, config, None, staging, nonfinite_count)
    if backend is None and _auto(history)[0] == "triton":
        return _PreparedTritonUpdate(_load_triton(), args)  # type: ignore[arg-type]
    return functools.partial(_call, history, backend, "delayed_update", *args)


class _PreparedTritonUpdate:
    """:func:`prepare_delayed_update`'s function on CUDA: the Triton kernel's launch bound once
    (:func:`fp8kit.torch.kernels.triton_update.prepare_delayed_update`), so an event builds no
    launch key (docs/decisions/0262-bound-triton-launches.md). After a Triton failure (this
    event's or another kernel's) the events run the torch kernels, as :func:`_call` does."""

    __slots__ = ("_args", "_backend", "_launch")

    def __init__(self, backend: _TritonBackend, args: tuple) -> None:
        self._backend, self._args = backend, args
        self._launch = backend.prepare_delayed_update(*args)

    def __call__(self) -> None:
        # a kernel failed since, or a trace (which takes the torch kernels): as _call decides
        if _triton_state["backend"] is not self._backend or torch.compiler.is_compiling():
            _call(self._args[0], None, "delayed_update", *self._args)
            return
        try:
            self._launch()
        except Exception as exc:  # compile / launch failure: the torch kernels from now on
            _triton_failed(exc)
            reference.delayed_update(*self._args)


def _check_update(
    history: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    count: torch.Tensor,
    ran: torch.Tensor | None,
    staging: torch.Tensor | None,
    nonfinite_count: torch.Tensor | None,
) -> None:
    if not (
        isinstance(history, torch.Tensor)
        and history.dtype is _F32
        and history.dim() == 2
        and history.shape[0] >= 1
        and history.is_contiguous()
    ):
        raise TypeError(
            f"history must be a contiguous float32 (L, N) tensor with L >= 1, got "
            f"{_describe(history)}"
        )
    n = history.shape[1]
    columns = (
        ("scale", scale, _F32),
        ("scale_inv", scale_inv, _F32),
        ("count", count, _I64),
        ("ran", ran, torch.bool),
        ("staging", staging, _F32),
        ("nonfinite_count", nonfinite_count, _I64),
    )
    for name, t, dtype in columns:
        if t is None and name in ("ran", "staging", "nonfinite_count"):
            continue
        if not (
            isinstance(t, torch.Tensor)
            and t.dtype is dtype
            and t.shape == (n,)
            and t.is_contiguous()
            and t.device == history.device
        ):
            raise TypeError(
                f"{name} must be a contiguous {dtype} tensor of shape ({n},) on history's "
                f"device ({history.device}), got {_describe(t)}"
            )


# ---------------------------------------------------------------------------------------------
# The older entry points, kept for fp8kit.torch.quantization (cast_to_fp8, quantize_with_scale)


def try_triton_cast(
    x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Cast a CUDA tensor with the Triton kernel (data laid out like ``torch.empty_like(x)``);
    None when triton is missing or failed before (one warning at the first failure)."""
    triton_backend = _load_triton()
    if triton_backend is None:
        return None
    try:
        return triton_backend.triton_cast(x, scale, fmt)
    except Exception as exc:  # compile / launch failure: use the torch path from now on
        _triton_failed(exc)
        return None


def cast_to_fp8_transpose(
    x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor and also produce its transpose, in one read when a kernel exists.

    Args:
        x: float32 / bfloat16 / float16 tensor of shape ``(M, N)`` (other dtypes: the torch
            reference).
        scale: float32 tensor with one element on ``x``'s device.
        fmt: target format.

    Returns:
        ``(data, data_t, amax)``: FP8 ``(M, N)`` and ``(N, M)`` row-major tensors with
        ``data_t == data.t()``, and the float32 0-d ``max |x|`` (NaN ignored), all equal to
        ``cast_to_fp8_reference`` bit for bit.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a 2-D tensor, got {shape}")
    if x.dtype in INPUT_DTYPES and _scale_ok(x, scale) and not torch.compiler.is_compiling():
        if x.is_cpu and load_native() is not None:
            return native_cast_transpose(x, scale, fmt)
        if x.is_cuda:
            triton_backend = _load_triton()
            if triton_backend is not None:
                try:
                    return triton_backend.triton_cast_transpose(x, scale, fmt)
                except Exception as exc:
                    _triton_failed(exc)
    data, amax = reference.cast_to_fp8_reference(x, scale, fmt)
    return data.contiguous(), data.t().contiguous(), amax


def _scale_ok(x: torch.Tensor, scale: torch.Tensor) -> bool:
    return (
        isinstance(scale, torch.Tensor)
        and scale.dtype == torch.float32
        and scale.numel() == 1
        and scale.device == x.device
    )


def dequantize_fp8(
    data: torch.Tensor,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``data.to(torch.float32) * scale`` (or the exact ``data.to(torch.float32)`` when ``scale``
    is None), cast to ``dtype``: the native kernel where it applies, torch otherwise.

    The kernel runs for CPU ``float8_e4m3fn`` / ``float8_e5m2`` data with no scale or a float32
    CPU scale of one element and at most ``data.dim()`` dimensions (so the result has
    ``data.shape``) that needs no autograd, outside ``torch.compile`` tracing. Either way the
    values are the same bit for bit (NaN stays NaN): one float32 multiply; a bfloat16 ``dtype``
    rounds the float32 result to nearest even (the kernel writes it directly), a float16 one is
    torch's cast of the kernel's float32 result.

    Args:
        data: FP8 tensor, any shape and strides.
        scale: None, or the float32 factor (``scale_inv``), a tensor with one element.
        dtype: ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``.
        out: None, or the tensor to write the result into (no allocation: the CPU GEMM's reused
            operand buffers, ``fp8kit.torch.workspace``): ``dtype``, on ``data``'s device, with
            ``data``'s shape and strides, no autograd; ``data`` dense (contiguous, or the
            transpose of a contiguous matrix).

    Returns:
        Tensor of ``dtype`` and ``data``'s shape, laid out as torch's elementwise result
        (``out`` itself when given).
    """
    _check_dequant(data, scale, dtype)
    if out is not None:
        _check_dequant_out(data, dtype, out)
    if _dequant_native_ok(data, scale):
        if dtype != torch.float16:
            return native.dequantize(data, scale, dtype, out)
        result = native.dequantize(data, scale, _F32).to(torch.float16)
    else:
        result = data.to(torch.float32)
        if scale is not None:
            result = result * scale
        result = result if dtype == torch.float32 else result.to(dtype)
    return result if out is None else out.copy_(result)


def _check_dequant(data: object, scale: object, dtype: object) -> None:
    """Raise unless :func:`dequantize_fp8` takes these arguments (its docstring's contract)."""
    if not (isinstance(data, torch.Tensor) and data.dtype in _FP8_DTYPES):
        raise TypeError(
            f"data must be a torch.float8_e4m3fn or torch.float8_e5m2 tensor, got {_describe(data)}"
        )
    if dtype not in INPUT_DTYPES:
        raise TypeError(
            f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}"
        )
    if scale is not None and not (_scale_ok(data, scale) and scale.dim() <= data.dim()):
        raise TypeError(
            f"scale must be None or a torch.float32 tensor with one element, at most "
            f"data.dim() = {data.dim()} dimensions (the result has data's shape), on data's "
            f"device ({data.device}), got {_describe(scale)}"
        )


def _check_dequant_out(data: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> None:
    """Raise unless ``out`` can hold ``dequantize_fp8(data, dtype=dtype)`` in place."""
    dense = isinstance(data, torch.Tensor) and (
        data.is_contiguous() or (data.dim() == 2 and data.t().is_contiguous())
    )
    if not (
        dense
        and isinstance(out, torch.Tensor)
        and out.dtype == dtype
        and out.device == data.device
        and out.shape == data.shape
        and out.stride() == data.stride()
        and not out.requires_grad
    ):
        want = (
            f"a {dtype} tensor on {data.device} of shape {tuple(data.shape)} and strides "
            f"{data.stride()} that needs no grad"
            if dense
            else "None: data is not dense (contiguous, or a transposed contiguous matrix)"
        )
        got = _describe(out)
        if isinstance(out, torch.Tensor):
            got += f", strides {out.stride()}, requires_grad={out.requires_grad}"
        raise ValueError(f"out must be {want}, got {got}")


def gemm_epilogue(
    acc: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Finish an FP8 GEMM computed as a float32 product of the unscaled operands:
    ``round_out(acc * (a_scale * b_scale) + bias)``, the CPU GEMM's epilogue (docs/performance.md).

    The scale product is one float32 multiply, the bias is added in float32 (none added without
    one, so -0 stays -0), then one rounding to ``out_dtype`` (nearest even): bit for bit the
    torch ops ``acc.mul_(a_scale * b_scale).add_(bias).to(out_dtype)``.

    Args:
        acc: float32 ``(M, N)`` contiguous accumulator; the native kernel overwrites it (the
            result for float32), the reference leaves it.
        a_scale, b_scale: float32 one-element tensors on ``acc``'s device (the operands'
            ``scale_inv``).
        out_dtype: ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``.
        bias: None or an ``(N,)`` float32 / bfloat16 / float16 tensor on ``acc``'s device.
        backend: None (automatic: native on the CPU, torch elsewhere), ``"native"`` or
            ``"reference"``.

    Returns:
        ``(M, N)`` tensor of ``out_dtype`` (native: ``acc`` itself for float32). CPU: one
        native call and at most one ``aten::empty``.
    """
    if not (
        isinstance(acc, torch.Tensor)
        and acc.dtype is _F32
        and acc.dim() == 2
        and acc.is_contiguous()
    ):
        raise TypeError(f"acc must be a contiguous float32 (M, N) tensor, got {_describe(acc)}")
    _check_one("a_scale", a_scale, _F32, acc)
    _check_one("b_scale", b_scale, _F32, acc)
    if out_dtype not in INPUT_DTYPES:
        raise TypeError(
            f"out_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {out_dtype}"
        )
    if bias is not None and not (
        isinstance(bias, torch.Tensor)
        and bias.dtype in INPUT_DTYPES
        and bias.shape == acc.shape[1:]
        and bias.device == acc.device
    ):
        raise TypeError(
            f"bias must be None or a float32 / bfloat16 / float16 tensor of shape "
            f"({acc.shape[1]},) on acc's device ({acc.device}), got {_describe(bias)}"
        )
    if backend == "triton":
        raise ValueError(
            "gemm_epilogue has no Triton kernel: backend must be None, 'native' or 'reference'"
        )
    if backend is None:
        backend = "native" if acc.numel() and _auto(acc)[0] == "native" else "reference"
    return _call(acc, backend, "gemm_epilogue", acc, a_scale, b_scale, out_dtype, bias)  # type: ignore[return-value]


def _native_or_reference(kernel: str, backend: str | None, name: str, t: torch.Tensor) -> str:
    """The backend of a kernel with a native and a reference form only: automatic (native for
    CPU tensors where the library is built, else the reference), or ``backend`` checked: an
    unknown name, ``"native"`` for a non-CPU ``t`` (named ``name``), then ``"native"`` without
    the library, each raise and say so."""
    if backend is None:
        return "native" if t.is_cpu and native_available() else "reference"
    if backend not in ("native", "reference"):
        raise ValueError(
            f"{kernel} has no {backend!r} kernel: backend must be None, 'native' or 'reference'"
        )
    if backend == "native":
        if not t.is_cpu:
            raise ValueError(f"backend='native' needs CPU tensors, got {name} on {t.device}")
        _forced(backend)  # the library is built, or this raises saying why not
    return backend


def small_fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """An FP8 GEMM in one call, for shapes where the call overhead outweighs the arithmetic
    (the CPU's small GEMMs, docs/performance.md "CPU GEMM").

    ``round_out(acc * (a_scale * b_scale) + bias)`` with ``acc[i, j]`` the float32 sum over
    ``k = 0, 1, ..., K-1`` *in that order*, starting from +0, of ``float(a[i, k]) *
    float(b[k, j])``. Each product of two FP8 values is exact in float32, so each step is one
    rounded add and the bits are fixed by the order: the native loops (scalar and AVX2, which
    AVX-512 CPUs run too) and the torch reference agree bit for bit. A BLAS GEMM sums in an
    order of its own, so its last bits may differ. The epilogue is :func:`gemm_epilogue`'s. The
    native kernel is serial: meant for a few million multiply-adds, not more.

    Args:
        a: FP8 ``(M, K)``, any strides; b: FP8 ``(K, N)``, any strides (E4M3 / E5M2 each).
        a_scale, b_scale: float32 one-element tensors on ``a``'s device (``scale_inv``).
        out_dtype: ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``.
        bias: None or an ``(N,)`` float32 / bfloat16 / float16 tensor on ``a``'s device.
        backend: None (automatic: native on the CPU, a ``torch.library`` op wrapping it inside
            a ``torch.compile`` trace, the torch reference elsewhere), ``"native"`` or
            ``"reference"``.

    Returns:
        ``(M, N)`` tensor of ``out_dtype``. CPU: one native call and one ``aten::empty``.
    """
    for name, t in (("a", a), ("b", b)):
        if not (isinstance(t, torch.Tensor) and t.dtype in _FP8_DTYPES and t.dim() == 2):
            raise TypeError(
                f"{name} must be a 2-D torch.float8_e4m3fn or torch.float8_e5m2 tensor, "
                f"got {_describe(t)}"
            )
    if b.shape[0] != a.shape[1] or b.device != a.device:
        raise ValueError(
            f"b must be (K, N) with K = a.shape[1] = {a.shape[1]} on a's device ({a.device}), "
            f"got {_describe(b)}"
        )
    _check_one("a_scale", a_scale, _F32, a)
    _check_one("b_scale", b_scale, _F32, a)
    if out_dtype not in INPUT_DTYPES:
        raise TypeError(
            f"out_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {out_dtype}"
        )
    if bias is not None and not (
        isinstance(bias, torch.Tensor)
        and bias.dtype in INPUT_DTYPES
        and bias.shape == (b.shape[1],)
        and bias.device == a.device
    ):
        raise TypeError(
            f"bias must be None or a float32 / bfloat16 / float16 tensor of shape "
            f"({b.shape[1]},) on a's device ({a.device}), got {_describe(bias)}"
        )
    if _native_or_reference("small_fp8_gemm", backend, "a", a) == "native":
        return small_fp8_gemm_unchecked(a, b, a_scale, b_scale, out_dtype, bias)
    return reference.small_fp8_gemm(a, b, a_scale, b_scale, out_dtype, bias)


def small_fp8_gemm_unchecked(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    b_transposed: bool = False,
) -> torch.Tensor:
    """:func:`small_fp8_gemm` on the native kernel without its argument checks, for callers
    that meet its contract by construction (``fp8kit.torch.gemm._dequant_mm``, the modules'
    hot path): CPU tensors, the native library loaded. ``b_transposed``: ``b`` holds ``B^T``,
    ``(N, K)`` (the native call reads it through its strides: no transposed view is made).
    Inside a ``torch.compile`` trace it is the ``fp8kit::small_fp8_gemm`` op."""
    if torch.compiler.is_compiling():
        b = b.t() if b_transposed else b
        return native_ops.small_fp8_gemm_op(a, b, a_scale, b_scale, out_dtype, bias)
    return native.small_fp8_gemm(a, b, a_scale, b_scale, out_dtype, bias, b_transposed=b_transposed)


def cast_error_sums(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    fmax: float,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """How far one FP8 cast is from its input, in one read of both (the numerics inspector's
    statistics, :mod:`fp8kit.torch.inspect.stats`).

    Returns the float64 vector ``(saturated, flushed, signal, noise)``:

    - ``saturated = count(|float32(x)| * scale > fmax)`` (a float32 multiply and compare: an
      infinite ``x`` counts, NaN never does);
    - ``flushed = count(x != 0 and float32(q) == 0)``;
    - ``signal = sum x^2`` and ``noise = sum (x - float32(q) * scale_inv)^2`` over the finite
      elements of ``x``: the dequantized value is one float32 multiply (as
      ``Float8Tensor.dequantize()``), the differences, squares and sums are float64.

    The counts are exact on every backend. The sums are float64 sums of the same terms in an order
    of each backend's own, so backends agree to float64 rounding (relative 1e-12), not bit for
    bit; a ``torch.compile`` graph runs the native kernel as the op ``fp8kit::cast_error_sums``,
    so compiled and eager CPU numbers are the same bits
    (docs/decisions/0256-native-cast-error-sums.md).

    Args:
        x: the float32 / bfloat16 / float16 tensor that was cast, any shape and strides.
        q: its FP8 cast (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``), ``x``'s shape and
            device.
        scale: float32 one-element tensor on ``x``'s device, the scale the cast multiplied by.
        scale_inv: float32 one-element tensor on ``x``'s device, the dequantization factor.
        fmax: the FP8 format's largest finite value (a positive finite number).
        backend: None (automatic: native on the CPU, torch ops elsewhere), ``"native"`` or
            ``"reference"``.

    Returns:
        float64 ``(4,)`` tensor on ``x``'s device. CPU: one native call, one ``aten::empty``.
    """
    if not (isinstance(x, torch.Tensor) and x.dtype in INPUT_DTYPES):
        raise TypeError(
            f"x must be a torch.float32, torch.bfloat16 or torch.float16 tensor, got {_describe(x)}"
        )
    if not (
        isinstance(q, torch.Tensor)
        and q.dtype in _FP8_DTYPES
        and q.shape == x.shape
        and q.device == x.device
    ):
        raise TypeError(
            f"q must be a torch.float8_e4m3fn or torch.float8_e5m2 tensor of x's shape "
            f"{tuple(x.shape)} on x's device ({x.device}), got {_describe(q)}"
        )
    _check_one("scale", scale, _F32, x)
    _check_one("scale_inv", scale_inv, _F32, x)
    if isinstance(fmax, bool) or not isinstance(fmax, numbers.Real) or not 0 < fmax < math.inf:
        raise ValueError(f"fmax must be a positive finite number, got {fmax!r}")
    fmax = float(fmax)
    if _native_or_reference("cast_error_sums", backend, "x", x) == "reference":
        return reference.cast_error_sums(x, q, scale, scale_inv, fmax)
    if torch.compiler.is_compiling():
        return native_ops.cast_error_sums_op(x, q, scale, scale_inv, fmax)
    return native.cast_error_sums(x, q, scale, scale_inv, fmax)


def _dequant_native_ok(data: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether the native kernel computes :func:`dequantize_fp8` of checked arguments."""
    if data.device.type != "cpu":
        return False
    if scale is not None and scale.requires_grad and torch.is_grad_enabled():
        return False  # torch's result has a grad_fn
    return not torch.compiler.is_compiling() and load_native() is not None

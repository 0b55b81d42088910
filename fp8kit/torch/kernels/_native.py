"""Build, cache and call the native CPU cast kernel (``fp8_cast.cpp``).

The C++ source is compiled with :func:`torch.utils.cpp_extension.load` the first time a kernel is
needed (never at import) and cached on disk, so later processes only load the shared library.
The cache lives in ``$FP8KIT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/fp8kit`` or
``~/.cache/fp8kit``), in a folder keyed by a hash of the source, the compiler flags, the torch
version and the architecture. The library exports a small C ABI on raw pointers, called through
:mod:`ctypes` (no torch operator headers: the build takes seconds, not half a minute).

If the build fails (no C++ compiler, no ninja, broken headers) or ``FP8KIT_DISABLE_NATIVE=1`` is
set, :func:`native_available` is False, fp8kit uses its pure-torch path, and one
:class:`NativeKernelWarning` says why (none when disabled on purpose). The reason is kept in
:func:`native_build_error`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import sys
import threading
import warnings
from pathlib import Path

import torch

from fp8kit.formats import E4M3, E5M2, FP8Format

__all__ = [
    "ISA_AUTO",
    "ISA_AVX2",
    "ISA_AVX512",
    "ISA_SCALAR",
    "NativeKernelWarning",
    "cache_dir",
    "load_native",
    "native_amax",
    "native_available",
    "native_build_error",
    "native_cast",
    "native_cast_transpose",
    "native_dequantize",
    "native_isa",
    "native_isa_level",
]

_log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fp8_cast.cpp")
_LIB_PREFIX = "fp8kit_native_cast"
# -fopenmp: at::parallel_reduce is inline and only runs in parallel when compiled with OpenMP;
# the GOMP symbols resolve to the libgomp that libtorch_cpu already loaded.
# -ffp-contract=off: x * scale must stay one rounded multiply (never fused into an FMA).
_EXTRA_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math")
_FMT_IDS = {E4M3.name: 0, E5M2.name: 1}

ISA_AUTO = 0
"""Let the kernel pick the best loop the CPU has (AVX-512F, else AVX2, else scalar)."""
ISA_SCALAR = 1
"""Force the portable scalar loop (the tests check every loop against the reference)."""
ISA_AVX2 = 2
"""Force the AVX2 loop (an error on a CPU without AVX2/FMA/F16C)."""
ISA_AVX512 = 3
"""Force the AVX-512F loop (an error on a CPU without AVX-512F)."""
_ISA_NAMES = {ISA_SCALAR: "scalar", ISA_AVX2: "avx2", ISA_AVX512: "avx512"}


class NativeKernelWarning(UserWarning):
    """The native FP8 cast kernel could not be built; fp8kit runs its pure-torch path."""


_lock = threading.Lock()
_state: dict[str, object] = {"loaded": False, "lib": None, "error": None}


_ENV_ON, _ENV_OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """The on/off environment variable ``name`` (README, "Environment variables"): ``default``
    when unset or empty.

    Raises:
        ValueError: a value outside ``1/true/yes/on`` and ``0/false/no/off`` (any case), naming
            the variable and the accepted values.
    """
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value not in _ENV_ON + _ENV_OFF:
        raise ValueError(
            f"{name} must be one of {_ENV_ON} or {_ENV_OFF[1:]} (or unset), got {raw!r}"
        )
    return default if value == "" else value in _ENV_ON


def _disabled_by_env() -> bool:
    return env_flag("FP8KIT_DISABLE_NATIVE", False)


def cache_dir() -> Path:
    """Folder holding the compiled extension for this source, flags, torch and Python."""
    root = os.environ.get("FP8KIT_CACHE_DIR")
    if root:
        base = Path(root).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "fp8kit"
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(" ".join(_EXTRA_CFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(platform.machine().encode())
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}"
    return base / "native" / f"{tag}-{digest.hexdigest()[:16]}"


class _Lib:
    """The loaded shared library with typed entry points (see the C ABI in ``fp8_cast.cpp``)."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
        self.cast = lib.fp8kit_cast
        self.cast.argtypes = [vp, i32, vp, i64, vp, i32, i32, vp]
        self.cast.restype = i32
        self.cast_transpose = lib.fp8kit_cast_transpose
        self.cast_transpose.argtypes = [vp, i32, vp, vp, i64, i64, vp, i32, i32, vp]
        self.cast_transpose.restype = i32
        self.amax = lib.fp8kit_amax
        self.amax.argtypes = [vp, i32, i64, i32, vp]
        self.amax.restype = i32
        self.dequant = lib.fp8kit_dequant
        self.dequant.argtypes = [vp, i32, vp, i32, i64, vp, i32]
        self.dequant.restype = i32
        f32, u32 = ctypes.c_float, ctypes.c_uint32
        self.cast_fused = lib.fp8kit_cast_fused
        self.cast_fused.argtypes = [
            *(vp, i32, i64, i64, i32, i32, i32, vp, vp),  # src .. count
            *(f32, i32, i32, u32),  # scale rule: numerator, power2, fmax exponent, mantissa
            *(vp, vp, vp, vp, vp, vp),  # dst, dst_t, amax_fold, amax_res, scale_inv, dbias
        ]
        self.cast_fused.restype = i32
        self.amax_fused = lib.fp8kit_amax_fused
        self.amax_fused.argtypes = [vp, i32, i64, i32, vp, vp]
        self.amax_fused.restype = i32
        self.delayed_update = lib.fp8kit_delayed_update
        self.delayed_update.argtypes = [
            *(vp, i64, i64, vp, vp, vp, vp, vp, vp),  # hist .. nonfinite
            *(i32, i64, f32, i32, i32, u32, i32),  # algo, interval, scale rule
            vp,  # infinite: the number of +inf event values (int64 out, may be null)
        ]
        self.delayed_update.restype = i32
        self.gemm_epilogue = lib.fp8kit_gemm_epilogue
        self.gemm_epilogue.argtypes = [vp, i64, i64, vp, vp, vp, i32, vp, i32, i32]
        self.gemm_epilogue.restype = i32
        self.small_gemm = lib.fp8kit_small_gemm
        self.small_gemm.argtypes = [
            *(vp, i32, i64, i64, vp, i32, i64, i64),  # A and B: data, format, element strides
            *(i64, i64, i64, vp, vp, vp, i32, vp, i32, i32),  # m, n, k, scales, bias, out, isa
        ]
        self.small_gemm.restype = i32
        self.cast_error_sums = lib.fp8kit_cast_error_sums
        self.cast_error_sums.argtypes = [vp, i32, vp, i32, i64, vp, vp, f32, i32, vp]
        self.cast_error_sums.restype = i32
        self.best_isa = lib.fp8kit_best_isa
        self.best_isa.argtypes = []
        self.best_isa.restype = i32
        self.path = path


def _build() -> _Lib:
    """Compile (or load the cached build of) the extension and bind its C entry points."""
    from torch.utils import cpp_extension  # heavy import: only when a build is needed

    build_dir = cache_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    # One library name per build folder: cpp_extension's in-process versioner renames (and
    # rebuilds) a name it has already seen with another folder or source.
    name = f"{_LIB_PREFIX}_{hashlib.sha256(str(build_dir).encode()).hexdigest()[:12]}"
    # cpp_extension runs `ninja` from PATH: make the one installed next to this interpreter (the
    # ninja wheel puts it in the environment's bin folder) visible without activating the venv.
    extra_paths = [os.path.dirname(sys.executable)]
    try:
        import ninja  # type: ignore[import-not-found]

        extra_paths.insert(0, ninja.BIN_DIR)
    except ImportError:
        pass
    old_path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([*extra_paths, old_path])
    try:
        if not any(build_dir.glob("*.so")):
            _log.info("fp8kit: compiling the native FP8 cast kernel into %s (one time)", build_dir)
        path = cpp_extension.load(
            name=name,
            sources=[str(SOURCE)],
            extra_cflags=list(_EXTRA_CFLAGS),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=os.environ.get("FP8KIT_VERBOSE_BUILD", "") == "1",
        )
    finally:
        os.environ["PATH"] = old_path
    if not isinstance(path, str):  # older torch returns None: the library has the default name
        path = str(build_dir / f"{name}.so")
    lib = _Lib(path)
    if lib.best_isa() not in _ISA_NAMES:
        raise RuntimeError(f"unexpected answer from {path}: best_isa() = {lib.best_isa()}")
    return lib


def load_native() -> _Lib | None:
    """Return the loaded native library (building it on first use), or None if unavailable.

    Thread-safe; the build is attempted once per process. A failure emits one
    :class:`NativeKernelWarning` and is remembered (see :func:`native_build_error`).
    """
    if _state["loaded"]:
        return _state["lib"]  # type: ignore[return-value]
    with _lock:
        if _state["loaded"]:
            return _state["lib"]  # type: ignore[return-value]
        if _disabled_by_env():
            _state["error"] = "disabled by FP8KIT_DISABLE_NATIVE"
        else:
            try:
                _state["lib"] = _build()
            except Exception as exc:  # any build or load failure means: use the torch path
                _state["error"] = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    "fp8kit: the native FP8 cast kernel could not be built, so fp8kit uses its "
                    "slower pure-torch cast (same results). Set FP8KIT_DISABLE_NATIVE=1 to "
                    "silence this. Reason: " + str(_state["error"])[-2000:],
                    NativeKernelWarning,
                    stacklevel=3,
                )
        _state["loaded"] = True
        return _state["lib"]  # type: ignore[return-value]


# Constant for the process once asked; torch.compile calls it while tracing instead of tracing
# into load_native's lock, which fails a fullgraph trace that is the process's first use
# (docs/decisions/0233-torch-compile.md).
@torch.compiler.assume_constant_result
def native_available() -> bool:
    """True when the native CPU kernel is built and loaded (builds it on first call)."""
    return load_native() is not None


def native_build_error() -> str | None:
    """Why the native kernel is unavailable (None when it loaded, or before the first attempt)."""
    return _state["error"]  # type: ignore[return-value]


def native_isa() -> str | None:
    """Best instruction set of the native kernel on this CPU (``"avx512"``, ``"avx2"``,
    ``"scalar"``), which :data:`ISA_AUTO` uses; None when the kernel is unavailable."""
    lib = load_native()
    if lib is None:
        return None
    return _ISA_NAMES[lib.best_isa()]


def native_isa_level() -> int:
    """:data:`ISA_SCALAR` / :data:`ISA_AVX2` / :data:`ISA_AVX512`: what :data:`ISA_AUTO` runs."""
    return _require_lib().best_isa()


_IN_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ONE = torch.ones((), dtype=torch.float32)  # placeholder scale for argument checks
_FP8_DTYPES = {0: torch.float8_e4m3fn, 1: torch.float8_e5m2}
_FP8_FMT_IDS = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
_DEQUANT_OUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_STATUS = {
    1: "x must be float32, bfloat16 or float16",
    2: "fmt must be fp8kit.formats.E4M3 or E5M2",
    3: "isa must be ISA_AUTO (0), ISA_SCALAR (1), ISA_AVX2 (2) or ISA_AVX512 (3)",
    4: "the requested isa is not supported by this CPU (see native_isa())",
    5: "negative size",
    6: "internal error in the native kernel",
}


def _fmt_id(fmt: FP8Format) -> int:
    try:
        return _FMT_IDS[fmt.name]
    except (KeyError, AttributeError):
        raise TypeError(f"fmt must be fp8kit.formats.E4M3 or E5M2, got {fmt!r}") from None


def _require_lib() -> _Lib:
    lib = load_native()
    if lib is None:
        raise RuntimeError(f"fp8kit native kernel unavailable: {native_build_error()}")
    return lib


def _check_args(x: torch.Tensor, scale: torch.Tensor, isa: int) -> None:
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
        where = x.device if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a CPU tensor, got {where}")
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if (
        not isinstance(scale, torch.Tensor)
        or scale.dtype != torch.float32
        or scale.numel() != 1
        or scale.device.type != "cpu"
    ):
        desc = (
            f"{scale.dtype} on {scale.device} with {scale.numel()} elements"
            if isinstance(scale, torch.Tensor)
            else type(scale).__name__
        )
        raise TypeError(f"scale must be a float32 CPU tensor with one element, got {desc}")
    if isa not in (ISA_AUTO, ISA_SCALAR, ISA_AVX2, ISA_AVX512):
        raise ValueError(
            f"isa must be ISA_AUTO (0), ISA_SCALAR (1), ISA_AVX2 (2) or ISA_AVX512 (3), got {isa!r}"
        )


def _plain(x: torch.Tensor) -> torch.Tensor:
    """x with a lazily negated view (``torch._neg_view``) materialised: the kernels read raw
    memory, which such a view does not hold in its final form."""
    return x.resolve_neg() if x.is_neg() else x


def _raise_status(status: int, what: str, messages: dict[int, str] | None = None) -> None:
    if status != 0:
        msg = {**_STATUS, **(messages or {})}.get(status, f"status {status}")
        raise RuntimeError(f"{what}: {msg}")


def native_cast(
    x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format, isa: int = ISA_AUTO
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-pass FP8 cast on the CPU: ``(data, amax)`` exactly as ``cast_to_fp8_reference``.

    Args:
        x: CPU float32 / bfloat16 / float16 tensor, any shape and strides.
        scale: float32 CPU tensor with one element.
        fmt: target format (:data:`fp8kit.formats.E4M3` or :data:`~fp8kit.formats.E5M2`).
        isa: :data:`ISA_AUTO` (the best this CPU has), or force :data:`ISA_SCALAR`,
            :data:`ISA_AVX2` or :data:`ISA_AVX512` (tests check every loop).

    Returns:
        ``data``: FP8 tensor of ``x.shape`` laid out like ``torch.empty_like(x)`` (as torch's
        elementwise ops lay out their results); ``amax``: float32 0-d tensor, ``max |x|`` with
        NaN ignored (0 when empty or all NaN).
    """
    lib = _require_lib()
    _check_args(x, scale, isa)
    fmt_id = _fmt_id(fmt)
    x = _plain(x)
    out = torch.empty_like(x, dtype=_FP8_DTYPES[fmt_id])
    src = x
    if x.stride() != out.stride():
        # Not dense in empty_like's layout (a slice, an expanded view, ...): densify in that
        # layout so input and output walk memory in the same order.
        src = torch.empty_like(x)
        src.copy_(x)
    amax = torch.empty((), dtype=torch.float32)
    status = lib.cast(
        src.data_ptr(),
        _IN_DTYPES[x.dtype],
        out.data_ptr(),
        x.numel(),
        scale.data_ptr(),
        fmt_id,
        isa,
        amax.data_ptr(),
    )
    _raise_status(status, "fp8kit native cast")
    return out, amax


def native_cast_transpose(
    x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format, isa: int = ISA_AUTO
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-pass FP8 cast of a 2-D CPU tensor that also writes the transposed copy.

    Args:
        x: CPU float32 / bfloat16 / float16 tensor of shape ``(M, N)`` (any strides).
        scale: float32 CPU tensor with one element.
        fmt: target format.
        isa: as in :func:`native_cast`.

    Returns:
        ``(data, data_t, amax)``: ``data`` (M, N) and ``data_t`` (N, M), both row-major FP8, with
        ``data_t == data.t()`` elementwise, and the float32 0-d amax.
    """
    lib = _require_lib()
    _check_args(x, scale, isa)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    fmt_id = _fmt_id(fmt)
    src = _plain(x).contiguous()
    m, n = x.shape
    dtype = _FP8_DTYPES[fmt_id]
    out = torch.empty((m, n), dtype=dtype)
    out_t = torch.empty((n, m), dtype=dtype)
    amax = torch.empty((), dtype=torch.float32)
    status = lib.cast_transpose(
        src.data_ptr(),
        _IN_DTYPES[x.dtype],
        out.data_ptr(),
        out_t.data_ptr(),
        m,
        n,
        scale.data_ptr(),
        fmt_id,
        isa,
        amax.data_ptr(),
    )
    _raise_status(status, "fp8kit native cast_transpose")
    return out, out_t, amax


def native_amax(x: torch.Tensor, isa: int = ISA_AUTO) -> torch.Tensor:
    """``max |x|`` with NaN ignored, in one read, as a float32 0-d CPU tensor (0 if empty/all NaN).

    Same value as :func:`fp8kit.torch.quantization.nan_ignoring_amax`; the first read of current
    scaling.

    Args:
        x: CPU float32 / bfloat16 / float16 tensor, any shape and strides.
        isa: as in :func:`native_cast`.
    """
    lib = _require_lib()
    _check_args(x, _ONE, isa)
    x = _plain(x)
    src = x
    if x.stride() != torch.empty_like(x, device="meta").stride():  # not dense: copy
        src = x.contiguous()
    amax = torch.empty((), dtype=torch.float32)
    status = lib.amax(src.data_ptr(), _IN_DTYPES[x.dtype], x.numel(), isa, amax.data_ptr())
    _raise_status(status, "fp8kit native amax")
    return amax


def native_dequantize(
    data: torch.Tensor,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    isa: int = ISA_AUTO,
) -> torch.Tensor:
    """FP8 -> ``float32(data) * scale`` on the CPU, bit for bit ``data.to(torch.float32) * scale``.

    Args:
        data: CPU ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` tensor, any shape and strides.
        scale: None (no multiply: the exact values) or a float32 CPU tensor with one element
            (``scale_inv`` of a :class:`~fp8kit.torch.quantization.Float8Tensor`), applied with
            one float32 multiply.
        out_dtype: ``torch.float32``, or ``torch.bfloat16``: the float32 result rounded to
            nearest even, as ``.to(torch.bfloat16)`` rounds it (exact when ``scale`` is None:
            every FP8 value is a bfloat16 value); a NaN stays NaN.
        isa: as in :func:`native_cast`.

    Returns:
        Tensor of ``data.shape`` and ``out_dtype`` laid out like ``torch.empty_like(data)``, as
        torch's conversion lays out its result (a transposed input gives a transposed output).
        NaN codes give the NaN bits torch's conversion gives (``0x7FF00000`` with the sign for
        E4M3fn; with a bfloat16 output, or a NaN ``scale``, only "a NaN" is promised).
    """
    lib = _require_lib()
    if not isinstance(data, torch.Tensor) or data.device.type != "cpu":
        where = data.device if isinstance(data, torch.Tensor) else type(data).__name__
        raise TypeError(f"data must be a CPU tensor, got {where}")
    if data.dtype not in _FP8_FMT_IDS:
        raise TypeError(f"data must be torch.float8_e4m3fn or torch.float8_e5m2, got {data.dtype}")
    if out_dtype not in _DEQUANT_OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.float32 or torch.bfloat16, got {out_dtype}")
    if scale is not None:
        _check_args(torch.empty(0), scale, isa)
    elif isa not in (ISA_AUTO, ISA_SCALAR, ISA_AVX2, ISA_AVX512):
        _check_args(torch.empty(0), _ONE, isa)  # raises the isa error
    return dequantize_unchecked(lib, data, scale, out_dtype, isa)


def dequantize_unchecked(
    lib: _Lib,
    data: torch.Tensor,
    scale: torch.Tensor | None,
    out_dtype: torch.dtype,
    isa: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`native_dequantize` on arguments it would accept (the caller checked them); ``out``:
    None, or the result's storage, with ``data``'s strides over dense memory (the caller
    checked)."""
    if out is None:
        out = torch.empty_like(data, dtype=out_dtype)
    src = data
    if data.stride() != out.stride():
        # Not dense in empty_like's layout (a slice, an expanded view, ...): densify the bytes
        # in that layout so input and output walk memory in the same order.
        src = torch.empty_like(data)
        src.copy_(data)
    status = lib.dequant(
        src.data_ptr(),
        _FP8_FMT_IDS[data.dtype],
        out.data_ptr(),
        _DEQUANT_OUT_DTYPES[out_dtype],
        data.numel(),
        None if scale is None else scale.data_ptr(),
        isa,
    )
    _raise_status(status, "fp8kit native dequantize", {1: "out_dtype must be float32 or bfloat16"})
    return out

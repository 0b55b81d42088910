"""FP8 quantization for PyTorch: :class:`Float8Tensor`, :func:`quantize` and the fused cast.

Numerics (docs/semantics.md section 2): ``q = saturate(rne(float32(x) * scale))`` in the target FP8
type, NaN stays NaN, ``scale_inv = 1 / scale`` (float32, correctly rounded), and the recorded amax
is ``max |x|`` of the unscaled input with NaN ignored (0 for an empty or all-NaN tensor).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from fp8kit.formats import E4M3, E5M2, FP8Format, check_scale_number
from fp8kit.torch import kernels
from fp8kit.torch.kernels import reference
from fp8kit.torch.kernels._library import define_op
from fp8kit.torch.kernels.reference import cast_to_fp8_reference
from fp8kit.torch.scaling import compute_scale

__all__ = [
    "HIGH_PRECISION_DTYPES",
    "Float8Tensor",
    "as_scale_tensor",
    "cast_to_fp8",
    "cast_to_fp8_reference",
    "check_float8_tensor",
    "current_scale",
    "dequantize",
    "dequantize_unchecked",
    "fp8_format_of",
    "quantize",
    "quantize_current",
    "quantize_with_scale",
    "torch_dtype_of",
]

_TORCH_DTYPES: dict[str, torch.dtype] = {
    E4M3.name: torch.float8_e4m3fn,
    E5M2.name: torch.float8_e5m2,
}
_FORMATS_BY_DTYPE: dict[torch.dtype, FP8Format] = {
    torch.float8_e4m3fn: E4M3,
    torch.float8_e5m2: E5M2,
}
HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def torch_dtype_of(fmt: FP8Format) -> torch.dtype:
    """The torch dtype of an FP8 format (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``)."""
    return _TORCH_DTYPES[fmt.name]


def fp8_format_of(dtype: torch.dtype | FP8Format, name: str = "fp8_dtype") -> FP8Format:
    """Map a torch FP8 dtype (or an :class:`FP8Format`) to its format; anything else raises."""
    if isinstance(dtype, FP8Format):
        return dtype
    try:
        return _FORMATS_BY_DTYPE[dtype]
    except (KeyError, TypeError):
        allowed = ", ".join(f"torch.{d}".replace("torch.torch.", "torch.") for d in _TORCH_DTYPES)
        raise TypeError(f"{name} must be one of {allowed}, got {dtype!r}") from None


def check_high_precision(x: torch.Tensor, name: str = "x") -> None:
    """Raise a TypeError unless ``x`` is a float32 / bfloat16 / float16 tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"{name} must have dtype torch.float32, torch.bfloat16 or torch.float16, got {x.dtype}"
        )


@dataclass
class Float8Tensor:
    """FP8 data with the float32 factor that turns it back into real values.

    Attributes:
        data: the FP8 payload (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``), any shape.
        scale_inv: float32 0-d tensor; real value = ``data * scale_inv``.
        amax: float32 0-d tensor, ``max |x|`` of the high-precision input (None if unknown).
        data_t: for 2-D data from a transposing cast, a row-major copy of ``data.t()`` (the
            layout a GEMM needs when this tensor is its transposed operand), else None.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    amax: torch.Tensor | None = None
    data_t: torch.Tensor | None = None

    @property
    def fp8_format(self) -> FP8Format:
        return fp8_format_of(self.data.dtype, "data.dtype")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Real values ``data * scale_inv`` (computed in float32, then cast to ``dtype``)."""
        return dequantize(self, dtype)

    def t(self) -> Float8Tensor:
        """The transposed view of a 2-D tensor (no copy; same scale)."""
        return Float8Tensor(self.data.t(), self.scale_inv, self.amax)


def dequantize(t: Float8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``t.data * t.scale_inv`` in float32, cast to ``dtype`` (float32, bfloat16 or float16).

    One float32 multiply of the exact float32 values, as ``t.data.to(torch.float32) *
    t.scale_inv``; on the CPU the native kernel (:func:`fp8kit.torch.kernels.dequantize_fp8`)
    computes the same bits in one pass (and rounds to bfloat16 in the same pass).
    """
    check_float8_tensor(t, "t")
    if dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}"
        )
    return dequantize_unchecked(t, dtype)


def dequantize_unchecked(t: Float8Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`dequantize` without its argument checks, for a ``t`` fp8kit built itself and a
    high-precision ``dtype`` (the FP8 output and input-gradient paths of a module call)."""
    scale_inv = t.scale_inv.reshape(())  # one element: it must not broadcast into the shape
    if torch.compiler.is_compiling():  # one opaque op: Inductor would drop the final rounding
        return _dequantize_op(t.data, scale_inv, dtype)
    return _dequantize(t.data, scale_inv, dtype)


def _dequantize(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``float32(data) * scale_inv`` rounded once to ``dtype`` (0-d ``scale_inv``)."""
    if data.device.type == "cpu":
        return kernels.dequantize_fp8(data, scale_inv, dtype)  # torch where no kernel fits
    out = data.to(torch.float32) * scale_inv
    return out if dtype == torch.float32 else out.to(dtype)


def _dequantize_fake(
    data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    return torch.empty_like(data, dtype=dtype)


_dequantize_op = define_op(
    "dequantize",
    "(Tensor data, Tensor scale_inv, ScalarType dtype) -> Tensor",
    _dequantize,
    _dequantize_fake,
)
"""``fp8kit::dequantize``: :func:`dequantize_unchecked` as one op of a compiled graph. As torch
ops, Inductor fused the rounding to a 16-bit ``dtype`` into a following upcast (an FP8 output or
input gradient then parted from eager's bits; decision 0268)."""


def nan_ignoring_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over all elements with NaN ignored, as a float32 0-d tensor (0 if none).

    CPU float32 / bfloat16 / float16 tensors go through the native one-read kernel
    (:func:`fp8kit.torch.kernels.native_amax`, same value bit for bit; like the cast kernel's
    amax it carries no autograd history) where it is built; torch (three passes) otherwise.
    """
    if (
        x.device.type == "cpu"
        and x.dtype in HIGH_PRECISION_DTYPES
        and not torch.compiler.is_compiling()
        and kernels.load_native() is not None
    ):
        return kernels.native_amax(x)
    return reference.nan_ignoring_amax(x)


def cast_to_fp8(
    x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale, saturate and round ``x`` into ``fmt``; also return ``max |x|`` (NaN ignored).

    Args:
        x: float32 / bfloat16 / float16 tensor, any shape.
        scale: float32 tensor with one element (the quantization scale).
        fmt: target FP8 format.

    Returns:
        ``(data, amax)``: FP8 tensor of ``x.shape`` (laid out like ``torch.empty_like(x)``) and a
        float32 0-d tensor on ``x``'s device.

    Uses the fused one-pass kernels of :mod:`fp8kit.torch.kernels` (C++ on the CPU, Triton on
    CUDA) when they cover the inputs, else :func:`cast_to_fp8_reference`; the results are the
    same bit for bit either way.
    """
    if (
        x.dtype in HIGH_PRECISION_DTYPES
        and isinstance(scale, torch.Tensor)
        and scale.dtype == torch.float32
        and scale.numel() == 1
        and scale.device == x.device
        and not torch.compiler.is_compiling()
    ):
        if x.device.type == "cpu":
            if kernels.load_native() is not None:
                return kernels.native_cast(x, scale, fmt)
        elif x.device.type == "cuda":
            out = kernels.try_triton_cast(x, scale, fmt)
            if out is not None:
                return out
    return cast_to_fp8_reference(x, scale, fmt)


def as_scale_tensor(
    scale: torch.Tensor | float, device: torch.device, name: str = "scale"
) -> torch.Tensor:
    """``scale`` as a float32 0-d tensor on ``device``: a Python number checked by
    :func:`~fp8kit.formats.check_scale_number`, or a float32 one-element tensor already there
    (not read on the host, so not range-checked). ``name`` is the argument named in errors."""
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):  # numpy scalars too
        return torch.tensor(check_scale_number(scale, name), dtype=torch.float32, device=device)
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a number or a float32 tensor, got {type(scale).__name__}")
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise TypeError(
            f"{name} must be a float32 tensor with one element, got dtype {scale.dtype} and "
            f"shape {tuple(scale.shape)}"
        )
    if scale.device != device:
        raise ValueError(
            f"{name} is on {scale.device} but the data is on {device}: put both on one device"
        )
    return scale.reshape(())


def check_float8_tensor(t: object, name: str) -> None:
    """Raise a TypeError unless ``t`` is a :class:`Float8Tensor` with FP8 ``data`` and a float32
    one-element ``scale_inv``."""
    if not isinstance(t, Float8Tensor):
        raise TypeError(f"{name} must be a Float8Tensor, got {type(t).__name__}")
    fp8_format_of(t.data.dtype, f"{name}.data's dtype")
    inv = t.scale_inv
    if not isinstance(inv, torch.Tensor) or inv.dtype != torch.float32 or inv.numel() != 1:
        got = (
            f"dtype {inv.dtype}, shape {tuple(inv.shape)}"
            if isinstance(inv, torch.Tensor)
            else (type(inv).__name__)
        )
        raise TypeError(f"{name}.scale_inv must be a float32 tensor with one element, got {got}")


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    fp8_dtype: torch.dtype | FP8Format,
    scale_inv: torch.Tensor | None = None,
) -> Float8Tensor:
    """Quantize ``x`` with a given (delayed) ``scale``; one read of ``x`` yields data and amax.

    Args:
        x: float32 / bfloat16 / float16 tensor, any shape.
        scale: float or float32 one-element tensor, the factor ``x`` is multiplied by before
            the cast (``fmax / amax`` for delayed scaling; a divide-by scale such as seed 001's
            ``amax / fmax`` is ``scale_inv``, docs/semantics.md section 7). A Python number
            must lie in ``[2**-126, FLT_MAX]`` (ValueError otherwise, see
            :func:`fp8kit.formats.check_scale_number`); a tensor scale is not read on the host
            and therefore not checked.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        scale_inv: optional precomputed ``1 / scale`` (float or float32 one-element tensor, the
            same rules as ``scale``); it is trusted to be the reciprocal.

    Not differentiable: the result carries no gradient to ``x`` (FP8 data has none); training
    goes through the FP8 modules, whose backward passes treat each cast as the identity.
    """
    check_high_precision(x)
    fmt = fp8_format_of(fp8_dtype)
    scale_t = as_scale_tensor(scale, x.device)
    inv = (
        torch.reciprocal(scale_t)
        if scale_inv is None
        else as_scale_tensor(scale_inv, x.device, "scale_inv")
    )
    data, amax = cast_to_fp8(x, scale_t, fmt)
    return Float8Tensor(data, inv, amax)


def current_scale(amax: torch.Tensor, fmt: FP8Format, power_2_scale: bool = False) -> torch.Tensor:
    """Current-scaling factor ``fmax / amax`` (float32), 1 where amax is 0 or not finite."""
    one = torch.ones_like(amax)
    return compute_scale(amax, one, fmt.max, margin=0, power_2_scale=power_2_scale)


def quantize_with_scale(
    x: torch.Tensor,
    scale: torch.Tensor,
    fmt: FP8Format,
    scale_inv: torch.Tensor,
    transpose: bool = False,
) -> Float8Tensor:
    """:func:`cast_to_fp8` into a :class:`Float8Tensor`; with ``transpose`` (2-D ``x`` only) the
    same read of ``x`` also writes ``data_t``, the row-major transpose a GEMM operand needs."""
    if transpose:
        data, data_t, amax = kernels.cast_to_fp8_transpose(x, scale, fmt)
        return Float8Tensor(data, scale_inv, amax, data_t)
    data, amax = cast_to_fp8(x, scale, fmt)
    return Float8Tensor(data, scale_inv, amax)


def quantize_current(
    x: torch.Tensor,
    fp8_dtype: torch.dtype | FP8Format,
    power_2_scale: bool = False,
    transpose: bool = False,
) -> Float8Tensor:
    """Current scaling: quantize ``x`` with ``fmax / max|x|`` (two reads of ``x``).

    ``transpose`` (2-D ``x``): also produce ``data_t`` in the casting pass. Not differentiable,
    as :func:`quantize`.
    """
    check_high_precision(x)
    for name, flag in (("power_2_scale", power_2_scale), ("transpose", transpose)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    fmt = fp8_format_of(fp8_dtype)
    amax = nan_ignoring_amax(x)
    scale = current_scale(amax, fmt, power_2_scale)
    q = quantize_with_scale(x, scale, fmt, torch.reciprocal(scale), transpose)
    q.amax = amax
    return q

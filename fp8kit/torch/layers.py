"""Transformer building blocks whose GEMMs run in FP8: ``LayerNormLinear`` and ``LayerNormMLP``.

Both follow the Transformer Engine module contract: a normalisation (LayerNorm or RMSNorm) fused
in front of one or two FP8 GEMMs, with the same autocast, checkpoint and distributed behaviour as
:class:`fp8kit.torch.Linear`. Every GEMM goes through :func:`fp8kit.torch.linear.fp8_linear`
with its own slots of the module's :class:`FP8Meta` (docs/semantics.md section 3: forward
``(L, 3g)``, backward ``(L, 2g)`` for ``g`` GEMMs).

The normalised activation is handed straight to the GEMM, which casts it to FP8 (INPUT slot) and
keeps only the FP8 copy for its weight gradient; eager PyTorch cannot fuse the norm and the cast
into one kernel, so "same pass" means no high-precision copy of the normalised output is kept.

Outside an enabled :class:`fp8kit.torch.autocast` each block computes exactly the composition of
plain PyTorch functions (``F.layer_norm``/``F.rms_norm``, ``F.linear``, the activation).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fp8kit.torch.linear import (
    FP8StateOwner,
    InitMethod,
    cached_fp8_weights,
    check_bool,
    check_features,
    check_init_method,
    check_is_first_microbatch,
    fp8_linear,
    fp8_run_for,
    init_linear,
    resolve_params_dtype,
)
from fp8kit.torch.quantization import Float8Tensor
from fp8kit.torch.quantizer import FP8Run
from fp8kit.torch.state import FP8Meta

__all__ = ["ACTIVATIONS", "NORMALIZATIONS", "LayerNormLinear", "LayerNormMLP"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("gelu", "relu", "swiglu")


# ---------------------------------------------------------------------------------------------
# Argument checks (errors at the boundary, naming the parameter)


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {list(choices)}, got {value!r}")
    for choice in choices:
        if value.lower() == choice.lower():
            return choice
    raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_eps(value: Any, name: str = "eps") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a positive float, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite float, got {value!r}")
    return float(value)


# ---------------------------------------------------------------------------------------------
# Pieces shared by the blocks


def normalize(
    x: torch.Tensor, kind: str, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """``LayerNorm`` or ``RMSNorm`` of ``x`` over its last dimension (shape unchanged)."""
    if kind == "LayerNorm":
        return F.layer_norm(x, weight.shape, weight, bias, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def activate(h: torch.Tensor, kind: str) -> torch.Tensor:
    """Apply ``kind`` to fc1's output ``h``.

    ``"gelu"`` is the exact (erf) GELU of ``torch.nn.GELU()``; ``"swiglu"`` splits ``h``
    ``(*, 2F)`` into ``a, b`` (first and second half) and returns ``silu(a) * b`` ``(*, F)``.
    """
    if kind == "gelu":
        return F.gelu(h)
    if kind == "relu":
        return F.relu(h)
    a, b = h.chunk(2, dim=-1)
    return F.silu(a) * b


class _FP8Block(FP8StateOwner, nn.Module):
    """Base of the blocks: owns ``fp8_meta`` and the per-GEMM FP8 weight cache.

    Subclasses set :attr:`fp8_gemm_names` (one name per GEMM, used by the inspector) and call
    :meth:`_fp8_run` / :meth:`_cached_weights` in ``forward``.
    """

    fp8_gemm_names: tuple[str, ...] = ()

    def _init_fp8(self, device: torch.device | str | None, *sizes: int) -> None:
        """Create ``fp8_meta``, labelled by type and ``sizes`` until a path names it."""
        label = f"{type(self).__name__}({', '.join(map(str, sizes))})"
        self.fp8_meta = FP8Meta(num_gemms=len(self.fp8_gemm_names), device=device, label=label)
        self._weight_cache: list[Float8Tensor | None] = [None] * len(self.fp8_gemm_names)
        self._init_fp8_owner()

    def _reset_norm(self) -> None:
        """Norm weight 1 and (LayerNorm) bias 0."""
        nn.init.ones_(self.layer_norm_weight)
        if self.layer_norm_bias is not None:
            nn.init.zeros_(self.layer_norm_bias)

    def _reset_fp8(self) -> None:
        """Fresh FP8 state values (``reset_parameters``); the states themselves are kept."""
        if "fp8_meta" in self._modules:
            self.fp8_meta.reset_values()
            self._weight_cache = [None] * len(self.fp8_gemm_names)

    def _fp8_run(
        self, inp: torch.Tensor, in_features: int, ref: torch.Tensor, width_name: str
    ) -> FP8Run | None:
        """The FP8 run for this call, or None to take the plain high-precision path
        (``width_name``: the attribute holding ``in_features``, for messages)."""
        return fp8_run_for(self, inp, in_features, ref, "inp", width_name)

    def _cached_weights(
        self, run: FP8Run, is_first_microbatch: bool | None, weights: list[torch.Tensor]
    ) -> list[Float8Tensor | None]:
        """FP8 weights to reuse per GEMM (``is_first_microbatch`` semantics of docs/semantics.md
        section 4)."""
        return cached_fp8_weights(run, is_first_microbatch, weights, self._weight_cache)


# ---------------------------------------------------------------------------------------------
# LayerNormLinear


class LayerNormLinear(_FP8Block):
    """Normalisation followed by a Linear whose GEMMs run in FP8 inside ``f8.autocast``.

    ``y = norm(x) W^T + b`` with ``norm`` = LayerNorm (``layer_norm_weight``, ``layer_norm_bias``)
    or RMSNorm (``layer_norm_weight`` only), over the last dimension.

    Args:
        in_features: size of the last dimension of ``x``.
        out_features: size of the last dimension of ``y``.
        eps: added to the variance (mean square for RMSNorm) for stability (third positional
            argument, as in Transformer Engine; the others are keywords).
        bias: learn the Linear's additive bias ``b``.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``.
        init_method: fills ``weight`` in place, and ``b`` starts at 0 (TE's ``init_method``);
            None: ``torch.nn.Linear``'s initialisation (TE's default differs:
            docs/te_modules.md).
        device, dtype: of the parameters and FP8 state (``params_dtype``: TE's name for dtype).

    Shapes: ``inp`` ``(*, in_features)`` -> ``y`` ``(*, out_features)``.
    State: ``fp8_meta`` with one GEMM (forward ``(L, 3)``, backward ``(L, 2)``), as
    :class:`fp8kit.torch.Linear`. ``forward(inp, is_first_microbatch=None)`` caches the FP8 weight
    across microbatches like ``Linear``.
    """

    fp8_gemm_names = ("",)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        *,
        bias: bool = True,
        normalization: str = "LayerNorm",
        init_method: InitMethod | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dtype = resolve_params_dtype(dtype, params_dtype)
        self.in_features = check_features("in_features", in_features)
        self.out_features = check_features("out_features", out_features)
        check_bool("bias", bias)
        self.normalization = check_choice("normalization", normalization, NORMALIZATIONS)
        self.eps = check_eps(eps)
        self.init_method = check_init_method("init_method", init_method)
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.layer_norm_weight = nn.Parameter(torch.empty(in_features, **kw))
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.empty(in_features, **kw))
        else:
            self.register_parameter("layer_norm_bias", None)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **kw))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        self._init_fp8(device, self.in_features, self.out_features)

    def reset_parameters(self) -> None:
        """Norm weight 1, norm bias 0, the Linear by ``init_method`` (bias 0) or as
        ``torch.nn.Linear``; fresh FP8 state."""
        self._reset_norm()
        # __dict__: a module pickled before init_method existed has none
        init_linear(self.weight, self.bias, self.__dict__.get("init_method"))
        self._reset_fp8()

    def forward(  # type: ignore[override]
        self, inp: torch.Tensor, is_first_microbatch: bool | None = None
    ) -> torch.Tensor:
        """``(*, in_features)`` -> ``(*, out_features)`` (``inp``: Transformer Engine's name)."""
        check_is_first_microbatch(is_first_microbatch)
        run = self._fp8_run(inp, self.in_features, self.weight, "in_features")
        h = normalize(
            inp, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps
        )
        if run is None:
            return F.linear(h, self.weight, self.bias)
        (cached,) = self._cached_weights(run, is_first_microbatch, [self.weight])
        return fp8_linear(h, self.weight, self.bias, run, gemm=0, cached_weight=cached)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, normalization={self.normalization}, eps={self.eps}"
        )


# ---------------------------------------------------------------------------------------------
# LayerNormMLP


class LayerNormMLP(_FP8Block):
    """Normalisation, fc1, activation, fc2: a transformer MLP whose two GEMMs run in FP8.

    ``y = fc2(act(fc1(norm(x))))`` where fc1 maps ``hidden_size`` to ``ffn_hidden_size``
    (``2 * ffn_hidden_size`` for SwiGLU, whose activation is ``silu(a) * b`` of the two halves)
    and fc2 maps ``ffn_hidden_size`` back to ``hidden_size``.

    Args:
        hidden_size: size of the last dimension of ``x`` and ``y``.
        ffn_hidden_size: width of the hidden (post-activation) layer.
        eps: added to the variance (mean square for RMSNorm); third positional argument, as in
            Transformer Engine (the others are keywords).
        bias: learn ``fc1_bias`` and ``fc2_bias``.
        activation: ``"gelu"`` (exact erf form), ``"relu"`` or ``"swiglu"``.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``.
        init_method / output_layer_init_method: fill ``fc1_weight`` / ``fc2_weight`` in place,
            with the bias at 0 (TE's); None: ``torch.nn.Linear``'s initialisation.
        device, dtype: of the parameters and FP8 state (``params_dtype``: TE's name for dtype).

    Parameters: ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only), ``fc1_weight``
    ``(ffn or 2*ffn, hidden)``, ``fc1_bias``, ``fc2_weight`` ``(hidden, ffn)``, ``fc2_bias``.
    State: ``fp8_meta`` with two GEMMs, forward ``(L, 6)`` (fc1 slots 0-2, fc2 slots 3-5) and
    backward ``(L, 4)`` (fc1 slots 0-1, fc2 slots 2-3). The activation output is fc2's INPUT.
    """

    fp8_gemm_names = ("fc1", "fc2")

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        *,
        bias: bool = True,
        activation: str = "gelu",
        normalization: str = "LayerNorm",
        init_method: InitMethod | None = None,
        output_layer_init_method: InitMethod | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dtype = resolve_params_dtype(dtype, params_dtype)
        self.hidden_size = check_features("hidden_size", hidden_size)
        self.ffn_hidden_size = check_features("ffn_hidden_size", ffn_hidden_size)
        check_bool("bias", bias)
        self.activation = check_choice("activation", activation, ACTIVATIONS)
        self.normalization = check_choice("normalization", normalization, NORMALIZATIONS)
        self.eps = check_eps(eps)
        self.init_method = check_init_method("init_method", init_method)
        self.output_layer_init_method = check_init_method(
            "output_layer_init_method", output_layer_init_method
        )
        fc1_out = 2 * ffn_hidden_size if self.activation == "swiglu" else ffn_hidden_size
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.layer_norm_weight = nn.Parameter(torch.empty(hidden_size, **kw))
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.empty(hidden_size, **kw))
        else:
            self.register_parameter("layer_norm_bias", None)
        self.fc1_weight = nn.Parameter(torch.empty(fc1_out, hidden_size, **kw))
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, **kw))
        if bias:
            self.fc1_bias = nn.Parameter(torch.empty(fc1_out, **kw))
            self.fc2_bias = nn.Parameter(torch.empty(hidden_size, **kw))
        else:
            self.register_parameter("fc1_bias", None)
            self.register_parameter("fc2_bias", None)
        self.reset_parameters()
        self._init_fp8(device, self.hidden_size, self.ffn_hidden_size)

    def reset_parameters(self) -> None:
        """Norm weight 1, norm bias 0, fc1 by ``init_method`` and fc2 by
        ``output_layer_init_method`` (biases 0), or as ``torch.nn.Linear``; fresh FP8 state."""
        self._reset_norm()
        # __dict__: a module pickled before these existed has none
        init_linear(self.fc1_weight, self.fc1_bias, self.__dict__.get("init_method"))
        output_init = self.__dict__.get("output_layer_init_method")
        init_linear(self.fc2_weight, self.fc2_bias, output_init)
        self._reset_fp8()

    def forward(  # type: ignore[override]
        self, inp: torch.Tensor, is_first_microbatch: bool | None = None
    ) -> torch.Tensor:
        """``(*, hidden_size)`` -> ``(*, hidden_size)`` (``inp``: Transformer Engine's name)."""
        check_is_first_microbatch(is_first_microbatch)
        run = self._fp8_run(inp, self.hidden_size, self.fc1_weight, "hidden_size")
        h = normalize(
            inp, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps
        )
        if run is None:
            h = F.linear(h, self.fc1_weight, self.fc1_bias)
            return F.linear(activate(h, self.activation), self.fc2_weight, self.fc2_bias)
        w1, w2 = self._cached_weights(run, is_first_microbatch, [self.fc1_weight, self.fc2_weight])
        h = fp8_linear(h, self.fc1_weight, self.fc1_bias, run, gemm=0, cached_weight=w1)
        h = activate(h, self.activation)
        return fp8_linear(h, self.fc2_weight, self.fc2_bias, run, gemm=1, cached_weight=w2)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"bias={self.fc1_bias is not None}, activation={self.activation}, "
            f"normalization={self.normalization}, eps={self.eps}"
        )

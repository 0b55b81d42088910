"""``f8.Linear``: a drop-in ``torch.nn.Linear`` whose three GEMMs run in FP8 (docs/semantics.md
section 4).

fprop ``y = x W^T``, dgrad ``dX = dY W`` and wgrad ``dW = dY^T x`` are FP8 GEMMs with float32
accumulation (E4M3 x E4M3 forward, E5M2 x E4M3 backward under HYBRID); the bias and every output
stay in high precision. Backward keeps the FP8 copies of x and W (1 byte per element), not the
high-precision input.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fp8kit.matmul_args import SECOND_DERIVATIVE_ERROR
from fp8kit.recipe import DelayedScaling, Recipe
from fp8kit.torch.autocast import FP8Settings, current_settings
from fp8kit.torch.gemm import GEMM_ALIGNMENT, cublaslt_fuses_bias, fp8_gemm_bias_t, padded_mm
from fp8kit.torch.kernels._library import define_op
from fp8kit.torch.kernels.reference import column_sums
from fp8kit.torch.quantization import (
    HIGH_PRECISION_DTYPES,
    Float8Tensor,
    check_high_precision,
    dequantize_unchecked,
)
from fp8kit.torch.quantizer import FP8Run
from fp8kit.torch.recompute import check_not_rerun_in_backward, warn_if_recomputed_without_fp8
from fp8kit.torch.slot_ops import bind_traced
from fp8kit.torch.state import (
    BwdSlot,
    FP8Meta,
    FwdSlot,
    bind_recipe,
    buffer_generation,
    bwd_slot,
    fwd_slot,
    mark_owner_weights_kept,
)

__all__ = [
    "FP8StateOwner",
    "InitMethod",
    "Linear",
    "cached_fp8_weights",
    "check_init_method",
    "check_is_first_microbatch",
    "fp8_linear",
    "fp8_run_for",
    "init_linear",
    "prepare_run",
    "resolve_params_dtype",
    "torch_autocast_dtype",
]


class FP8StateOwner:
    """Mixin of the modules that own an ``fp8_meta`` and a ``_run_cache`` (:func:`prepare_run`);
    put it before the ``nn.Module`` base and call :meth:`_init_fp8_owner` after creating
    ``fp8_meta``.

    - A copy made by ``copy.deepcopy``, pickling or ``torch.save(module)`` starts with an empty
      cache. The cache holds the last autocast's settings, including its recipe (whose callables
      may be lambdas) and amax reduction group (a ``ProcessGroup``): neither pickles, and neither
      belongs to the copy, which binds its own on its first call.
    - A module built on ``meta`` and given its weights by ``load_state_dict(assign=True)`` from a
      checkpoint without FP8 state gets fresh FP8 state on its weights' device (the state had no
      memory, and the checkpoint none to assign). docs/decisions/0246-review-fixes.md.
    """

    _run_cache: dict[str, Any]
    fp8_meta: FP8Meta

    def _init_fp8_owner(self) -> None:
        self._run_cache = {}
        self.register_load_state_dict_pre_hook(_note_weights_kept)  # type: ignore[attr-defined]
        self.register_load_state_dict_post_hook(_fresh_fp8_state_beside_the_weights)  # type: ignore[attr-defined]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # type: ignore[misc]  # nn.Module's: a copy, uncompiled
        state["_run_cache"] = {}
        return state


def _note_weights_kept(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """Load-state-dict pre hook of an :class:`FP8StateOwner` (it runs before ``fp8_meta`` is
    loaded): tell ``fp8_meta`` whether this load keeps every weight.
    ``set_model_state_dict(full_state_dict=True)`` fills the keys a checkpoint lacks with the
    module's own tensors, so a checkpoint of other modules still reaches this one."""
    own = itertools.chain(module.named_parameters(), module.named_buffers())
    kept = all(
        state_dict.get(prefix + name, tensor) is tensor
        for name, tensor in own
        if not name.startswith("fp8_meta.")
    )
    mark_owner_weights_kept(module.fp8_meta, kept)


def _fresh_fp8_state_beside_the_weights(module: nn.Module, incompatible: Any) -> None:
    """Load-state-dict post hook of an :class:`FP8StateOwner` (it runs after ``fp8_meta``'s
    own): the run cache is emptied, so that the next training call binds the loaded state to
    its recipe (it may record another one, with the same history length), as a compiled call
    does; and FP8 state still on ``meta`` after its owner's parameters were assigned real
    tensors is materialised, fresh, on their device."""
    module._run_cache.clear()
    meta = module.fp8_meta
    if not isinstance(meta, FP8Meta) or meta.forward.device.type != "meta":
        return
    device = next((p.device for p in module.parameters() if not p.is_meta), None)
    if device is not None:
        meta.to_empty(device=device)  # ScalingState._apply gives materialised buffers fresh values


def prepare_run(meta: FP8Meta, settings: FP8Settings, cache: dict[str, Any]) -> FP8Run:
    """Bring ``meta`` in line with the recipe of ``settings`` (history length, recorded recipe)
    and return a run.

    ``cache`` (the module's ``_run_cache``) remembers the last recipe, so the history length and
    recorded recipe are bound once per recipe, and the last run: an autocast entered with the
    same arguments gives the same settings object each step (:class:`FP8Settings`), so the
    steady state returns that run after a few identity tests. A buffer replaced since (a
    checkpoint loaded with another L) makes a new run. A call that cannot update (grad off, not
    calibrating: an evaluation) binds nothing: an evaluation under another recipe leaves the
    history and the recorded recipe as training left them, on every rank alike (an event of
    the recipe a state trains under binds it; docs/semantics.md section 6). In a graph traced by
    ``torch.compile`` nothing is bound or cached here (binding reads device values and replaces
    buffers): the compiled cast binds at run time (docs/decisions/0233-torch-compile.md).
    """
    recipe = settings.recipe
    if torch.compiler.is_compiling() or settings.replay is not None:
        # not kept: a replay's run holds its copies
        binds = _can_update(settings)
        plan = settings.plan
        if binds and plan.delayed and not any(plan.fp8_gemms) and settings.replay is None:
            bind_traced(meta, settings.event_key)  # no cast op will bind (all high precision)
        return _new_run(meta, settings, binds)
    last = cache.get("run")
    if (
        last is not None
        and last[0] is settings
        and last[1] is meta
        and last[2] == buffer_generation()
        and (last[4] or not _can_update(settings))
    ):
        return last[3]  # a run cached by an evaluation is not one that bound (last[4])
    binds = _can_update(settings)
    if binds:
        _bind(meta, recipe, cache)
    run = _new_run(meta, settings)
    cache["run"] = (settings, meta, buffer_generation(), run, binds)
    return run


def _can_update(settings: FP8Settings) -> bool:
    """Whether a module call under ``settings`` can lead to an update event of its state: grad
    on, or calibrating (an evaluation cannot, and binds nothing)."""
    return torch.is_grad_enabled() or settings.calibrating


def _bind(meta: FP8Meta, recipe: Recipe, cache: dict[str, Any]) -> None:
    """Bind ``meta`` to ``recipe`` unless the module's last binding was to it (and no checkpoint
    of another history length was loaded since)."""
    if cache.get("recipe") is not recipe:
        if isinstance(recipe, DelayedScaling):
            bind_recipe(meta, recipe)
        cache["recipe"] = recipe
    elif isinstance(recipe, DelayedScaling) and (
        meta.forward.history_len != recipe.amax_history_len
    ):  # loaded from a checkpoint with another L since the last call
        bind_recipe(meta, recipe)


def _new_run(meta: FP8Meta, settings: FP8Settings, binds: bool = True) -> FP8Run:
    return FP8Run(
        settings.plan,
        settings.group,
        meta,
        settings.fp8,
        settings.event_key,
        settings.forward_states,
        settings.replay,
        binds,
    )


def resolve_params_dtype(
    dtype: torch.dtype | None, params_dtype: torch.dtype | None
) -> torch.dtype | None:
    """``dtype``, or Transformer Engine's spelling ``params_dtype`` of the same argument: a
    floating-point ``torch.dtype`` (parameters must be able to require gradients) or None."""
    for name, value in (("dtype", dtype), ("params_dtype", params_dtype)):
        if isinstance(value, torch.dtype) and (not value.is_floating_point or value.itemsize == 1):
            raise TypeError(
                f"{name} must be a floating-point torch.dtype for the parameters (float32, "
                f"bfloat16 or float16 for FP8 GEMMs), got {value}"
            )
    for name, value in (("dtype", dtype), ("params_dtype", params_dtype)):
        if value is not None and not isinstance(value, torch.dtype):
            raise TypeError(
                f"{name} must be a torch.dtype (torch.float32, torch.bfloat16 or torch.float16) "
                f"or None, got {value!r}"
            )
    if params_dtype is None:
        return dtype
    if dtype is not None and dtype != params_dtype:
        raise ValueError(
            f"dtype={dtype} and params_dtype={params_dtype} disagree: params_dtype is Transformer "
            "Engine's name for dtype, give one of them"
        )
    return params_dtype


def check_features(name: str, value: Any) -> int:
    """``value`` if it is a positive int (not a bool); else a TypeError / ValueError naming
    ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool; else a TypeError naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_probability(name: str, value: Any, *, one_allowed: bool = False) -> float:
    """``value`` as a float if it is a probability in [0, 1) ([0, 1] with ``one_allowed``);
    else a TypeError / ValueError naming ``name``."""
    interval = "[0, 1]" if one_allowed else "[0, 1)"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float in {interval}, got {value!r}")
    if not (0.0 <= value <= 1.0 if one_allowed else 0.0 <= value < 1.0):
        raise ValueError(f"{name} must be a float in {interval}, got {value!r}")
    return float(value)


def check_is_first_microbatch(value: object) -> None:
    """Raise a TypeError unless ``value`` is None, True or False."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"is_first_microbatch must be None, True or False, got {value!r}")


def _same_device(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a.device == b.device`` without building the two device objects (CPU and CUDA)."""
    if a.is_cpu:
        return b.is_cpu
    if a.is_cuda:
        return b.is_cuda and a.get_device() == b.get_device()
    return a.device == b.device


def fp8_run_for(
    module: nn.Module,
    x: torch.Tensor,
    in_features: int,
    param: torch.Tensor,
    name: str = "x",
    width_name: str = "in_features",
) -> FP8Run | None:
    """Validate ``x`` for an FP8 module call and return its run, or None for high precision.

    ``module`` owns ``fp8_meta`` and ``_run_cache``; ``param`` is one of its parameters (for the
    device check); ``name`` is the forward argument ``x`` is and ``width_name`` the module's
    attribute holding ``in_features``, for messages. None when neither FP8 nor calibration is on
    (no autocast, or a plain disabled one) and for empty inputs; in a calibration-only region
    the run has ``fp8=False``.
    """
    # checked in high precision too, so a wrong input gets these messages on both paths
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.shape[-1:] != (in_features,):
        raise ValueError(
            f"{name} must have shape (*, {in_features}) for this {type(module).__name__} "
            f"({width_name}={in_features}), got {tuple(x.shape)}"
        )
    settings = current_settings()
    if settings is None:
        # len(), not bool(): torch 2.11's compiler cannot trace bool() of a dict (decision 0249)
        warn_if_recomputed_without_fp8(module, len(module._run_cache) > 0)
        return None
    check_high_precision(x, name)
    if param.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"this {type(module).__name__}'s parameters have dtype {param.dtype}; FP8 GEMMs take "
            "torch.float32, torch.bfloat16 or torch.float16 parameters (convert the model with "
            ".float() or .to(torch.bfloat16))"
        )
    if not _same_device(x, param):
        raise ValueError(
            f"{name} is on {x.device} but the parameters are on {param.device}: move one of them"
        )
    if x.numel() == 0:
        return None
    if settings.replay is None and settings.plan.delayed and not torch.compiler.is_compiling():
        check_not_rerun_in_backward(module)  # (a compiled cast checks itself, slot_ops.py)
    return prepare_run(module.fp8_meta, settings, module._run_cache)


def cached_fp8_weights(
    run: FP8Run,
    is_first_microbatch: bool | None,
    weights: list[torch.Tensor],
    cache: list[Float8Tensor | None],
) -> list[Float8Tensor | None]:
    """FP8 weights to reuse, one per GEMM (``is_first_microbatch`` semantics, docs/semantics.md
    section 4).

    None: nothing cached (every call quantizes and records). True: quantize now, record, and keep
    in ``cache`` (updated in place). False: reuse ``cache`` without recording. A calibration-only
    run (``run.fp8`` False) uses no FP8 weight: True and False cache and reuse nothing there, and
    every call records the weight's amax.
    """
    if is_first_microbatch is None:
        if cache.count(None) != len(cache):  # written only when it held weights: a traced
            cache[:] = [None] * len(weights)  # call then has no Python side effect here
    elif not run.fp8:
        return [None] * len(weights)
    elif is_first_microbatch:
        cache[:] = [run.quantize_weight(w.detach(), g) for g, w in enumerate(weights)]
    else:
        fprop, dgrad, _ = run.fp8_gemms
        if (fprop or dgrad) and (len(cache) != len(weights) or any(w is None for w in cache)):
            raise ValueError(
                "is_first_microbatch=False reuses the FP8 weights cached by an earlier call with "
                "is_first_microbatch=True, but there are none: pass True on the first microbatch"
            )
    return cache


InitMethod = Callable[[torch.Tensor], Any]
"""Transformer Engine's ``init_method``: called on a GEMM weight ``(out, in)`` to fill it in
place."""


def check_init_method(name: str, value: InitMethod | None) -> InitMethod | None:
    """``value`` if it is None or callable, else a TypeError naming ``name``."""
    if value is not None and not callable(value):
        raise TypeError(
            f"{name} must be None or a callable that fills a weight in place (Transformer "
            f"Engine's init_method), got {type(value).__name__}"
        )
    return value


def init_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, init_method: InitMethod | None = None
) -> None:
    """``init_method(weight)`` and a zero bias, as Transformer Engine initialises a GEMM given
    one; without it ``torch.nn.Linear``'s default (uniform, bound from the fan-in) for both
    (docs/te_modules.md, "Initialisation")."""
    if init_method is not None:
        with torch.no_grad():
            init_method(weight)
        if bias is not None:
            nn.init.zeros_(bias)
        return
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1.0 / math.sqrt(weight.shape[1]) if weight.shape[1] > 0 else 0.0
        nn.init.uniform_(bias, -bound, bound)


def _aligned(m: int, k: int, n: int) -> bool:
    return not (m % GEMM_ALIGNMENT or k % GEMM_ALIGNMENT or n % GEMM_ALIGNMENT)


def _gemm(
    a: torch.Tensor,
    b_t: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    fast_accum: bool,
) -> torch.Tensor:
    """``a @ b_t.T * a_scale_inv * b_scale_inv (+ bias)`` rounded once to ``out_dtype``.

    ``a`` (M, K) and ``b_t`` (N, K) row-major FP8 (``b_t.t()`` is the column-major B). Aligned
    shapes take one GEMM with the bias fused where the backend can
    (:func:`~fp8kit.torch.gemm.fp8_gemm_bias_t`). Unaligned shapes are zero-padded
    (:func:`padded_mm`); the bias is fused there for a bfloat16/float16 output of its dtype,
    else added in float32 and the sum rounded once.
    """
    if _aligned(a.shape[0], a.shape[1], b_t.shape[0]):
        return fp8_gemm_bias_t(a, b_t, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accum)
    fuse = bias is not None and cublaslt_fuses_bias(out_dtype, bias)
    gemm_dtype = out_dtype if bias is None or fuse else torch.float32
    gemm_bias = bias if fuse else None
    y = padded_mm(
        Float8Tensor(a, a_scale_inv),
        Float8Tensor(b_t.t(), b_scale_inv),
        gemm_dtype,
        bias=gemm_bias,
        use_fast_accum=fast_accum,
    )
    if bias is not None and not fuse:
        y = y + bias  # out of place: docs/decisions/0249 (torch 2.11 compiled autograd.Function)
        if out_dtype != torch.float32:
            y = y.to(out_dtype)
    return y


class _LinearFunction(torch.autograd.Function):
    """Autograd function of one FP8 Linear on a 2-D input ``(M, K)``.

    Kernels per call on CUDA (FP8 GEMMs, delayed scaling, bias of the activation dtype): forward
    = cast x (FP8 x, x^T, amax into its staging entry) + cast W (skipped for a cached weight) +
    one GEMM with the bias fused; backward = cast dY (FP8 dY, dY^T, amax, bias gradient) + two
    GEMMs. See docs/performance.md.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        run: FP8Run,
        gemm: int,
        cached_weight: Float8Tensor | None,
        fp8_output: bool,
        fp8_grad: bool,
    ) -> torch.Tensor:
        fprop_fp8, dgrad_fp8, wgrad_fp8 = run.fp8_gemms
        wgrad_fp8 = wgrad_fp8 and weight.requires_grad
        x = x.contiguous()
        x_fp8 = None
        if fprop_fp8 or wgrad_fp8:
            # wgrad reads x^T row-major: written by the same pass as the FP8 copy of x.
            x_fp8 = run.quantize_forward(x, fwd_slot(gemm, FwdSlot.INPUT), transpose=wgrad_fp8)
        w_fp8 = cached_weight if cached_weight is not None else run.quantize_weight(weight, gemm)
        if fprop_fp8:
            y = _gemm(
                x_fp8.data,  # type: ignore[union-attr]
                w_fp8.data,  # type: ignore[union-attr]
                x_fp8.scale_inv,  # type: ignore[union-attr]
                w_fp8.scale_inv,  # type: ignore[union-attr]
                x.dtype,
                bias,
                run.plan.fast_accum[0],
            )
        else:
            y = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        if fp8_output:
            y_fp8 = run.quantize_forward(y, fwd_slot(gemm, FwdSlot.OUTPUT))
            y = dequantize_unchecked(y_fp8, y.dtype)

        ctx.run = run
        ctx.gemm = gemm
        ctx.fp8_grad = fp8_grad
        # db leaves in the bias input's dtype: under torch.autocast that is the autocast dtype,
        # and autograd's own conversion of the bias takes it to the parameter's dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.x_dtype = x.dtype
        ctx.x_scale_inv = None if x_fp8 is None else x_fp8.scale_inv
        ctx.w_scale_inv = None if w_fp8 is None else w_fp8.scale_inv
        # Saved: FP8 x^T (wgrad), FP8 W^T (dgrad), both row-major; x itself only for a
        # high-precision wgrad.
        ctx.save_for_backward(
            x_fp8.data_t if wgrad_fp8 else None,  # type: ignore[union-attr]
            x if not run.fp8_gemms[2] else None,
            w_fp8.data_t if dgrad_fp8 else None,  # type: ignore[union-attr]
            weight,
        )
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():
            # create_graph=True: the gradients come from FP8 GEMMs of saved FP8 copies, so a
            # second derivative through them would be wrong; differentiating them must raise.
            return _differentiating_again_raises(ctx, dy)
        return _LinearFunction.gradients(ctx, dy)

    @staticmethod
    def gradients(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        """dX, dW and db (and None for the other inputs of ``forward``) from ``dy``."""
        x_t, x_hp, w_t, weight = ctx.saved_tensors
        run: FP8Run = ctx.run
        _, dgrad_fp8, wgrad_fp8 = run.fp8_gemms
        _, fast_dgrad, fast_wgrad = run.plan.fast_accum
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        need_db = need_db and ctx.bias_dtype is not None
        dy = dy.contiguous()
        dy_fp8 = db = None
        if (dgrad_fp8 and need_dx) or (wgrad_fp8 and need_dw):
            slot = bwd_slot(ctx.gemm, BwdSlot.GRAD_OUTPUT)
            dy_fp8, db = run.quantize_backward(
                dy, slot, transpose=wgrad_fp8 and need_dw, dbias=need_db
            )

        dx = dw = None
        if need_dx:
            if dgrad_fp8:
                # B = W (N, K) column-major: its transpose is the row-major W^T.
                dx = _gemm(
                    dy_fp8.data,  # type: ignore[union-attr]
                    w_t,
                    dy_fp8.scale_inv,  # type: ignore[union-attr]
                    ctx.w_scale_inv,
                    ctx.x_dtype,
                    None,
                    fast_dgrad,
                )
            else:
                dx = _float32_mm(dy, weight, ctx.x_dtype)
            if ctx.fp8_grad:
                slot = bwd_slot(ctx.gemm, BwdSlot.GRAD_INPUT)
                dx = dequantize_unchecked(run.quantize_backward(dx, slot)[0], dx.dtype)
        if need_dw:
            if wgrad_fp8:
                # A = dY^T (N, M) row-major; B = x (M, K) column-major: its transpose is x^T.
                dw = _gemm(
                    dy_fp8.data_t,  # type: ignore[union-attr]
                    x_t,
                    dy_fp8.scale_inv,  # type: ignore[union-attr]
                    ctx.x_scale_inv,
                    weight.dtype,
                    None,
                    fast_wgrad,
                )
            else:
                dw = _float32_mm(dy.t(), x_hp, weight.dtype)
        if need_db:
            if db is None:  # dY was not cast (both GEMMs high precision or not needed):
                # the fused cast's rule, so the override gives the same db (docs/semantics.md 4)
                db = _column_sum(dy)
            if db.dtype != ctx.bias_dtype:
                db = db.to(ctx.bias_dtype)
        else:
            db = None
        return dx, dw, db, None, None, None, None, None


def _float32_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` in float32, rounded once to ``out_dtype``: a high-precision gradient GEMM
    (``override_linear_precision``), float32 also when backward() runs inside
    ``torch.autocast``, as the FP8 GEMMs' products are. One library op in a compiled graph."""
    if torch.compiler.is_compiling():
        return _float32_mm_op(a, b, out_dtype)
    return _float32_mm_eager(a, b, out_dtype)


def _float32_mm_eager(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    with torch.autocast(a.device.type, enabled=False):
        return (a.to(torch.float32) @ b.to(torch.float32)).to(out_dtype)


def _float32_mm_fake(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _column_sum(dy: torch.Tensor) -> torch.Tensor:
    """The bias gradient of a ``dy`` no FP8 cast summed, by the fused cast's rule (the reference
    kernel's :func:`~fp8kit.torch.kernels.reference.column_sums`). One library op in a compiled
    graph."""
    if torch.compiler.is_compiling():
        return _column_sum_op(dy)
    return column_sums(dy)


def _column_sum_fake(dy: torch.Tensor) -> torch.Tensor:
    return dy.new_empty(dy.shape[1:])


# As torch ops, Inductor reordered the float32 sum and fused the roundings to a 16-bit dtype
# into the next upcast, so overridden GEMMs' gradients parted from eager's bits (decision 0268).
_float32_mm_op = define_op(
    "float32_mm",
    "(Tensor a, Tensor b, ScalarType out_dtype) -> Tensor",
    _float32_mm_eager,
    _float32_mm_fake,
)
_column_sum_op = define_op("column_sum", "(Tensor dy) -> Tensor", column_sums, _column_sum_fake)


_TWICE = SECOND_DERIVATIVE_ERROR.encode()


def _differentiating_again_raises(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    """:meth:`_LinearFunction.gradients` under ``create_graph=True``: computed without a graph,
    then joined to one node that raises when anything differentiates them.

    ``torch.autograd.function.once_differentiable`` adds that node only when ``dy`` requires
    grad. A ``dy`` that does not (the gradient of ``y.sum()``) still leaves ``dx`` depending on
    the weight, so a gradient penalty on ``dx`` would silently lose its weight term."""
    with torch.no_grad():
        grads = _LinearFunction.gradients(ctx, dy)
    tensors = [g for g in grads if isinstance(g, torch.Tensor)]
    if not tensors:
        return grads
    joined = torch._C._functions.DelayedError(_TWICE, len(tensors))(
        *[g.detach().requires_grad_() for g in tensors]
    )
    raising = iter(joined if isinstance(joined, tuple) else (joined,))
    return tuple(next(raising) if isinstance(g, torch.Tensor) else g for g in grads)


def torch_autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype of the ``torch.autocast`` active for ``x``'s device, or None (none active, or a
    device without autocast, such as ``meta``)."""
    device_type = x.device.type
    # torch 2.11's compiler cannot trace is_autocast_available (decision 0249); a compiled
    # graph runs on a device with autocast (cpu, cuda, ...)
    available = torch.compiler.is_compiling() or torch.amp.is_autocast_available(device_type)
    if available and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    run: FP8Run,
    *,
    gemm: int = 0,
    cached_weight: Float8Tensor | None = None,
    fp8_output: bool = False,
    fp8_grad: bool = False,
) -> torch.Tensor:
    """``x @ weight.T + bias`` as an FP8 GEMM using slots of GEMM ``gemm`` of ``run.meta``.

    Args:
        x: ``(*, K)`` high-precision input; weight: ``(N, K)``; bias: ``(N,)`` or None.
        run: from :func:`prepare_run` for the calling module.
        gemm: which GEMM of the module this is (forward slots ``3*gemm + FwdSlot``, backward
            slots ``2*gemm + BwdSlot``).
        cached_weight: FP8 weight to reuse (its amax is not recorded again).
        fp8_output / fp8_grad: pass the output / input gradient through FP8 (see ``Linear``).

    Returns:
        ``(*, N)`` tensor of ``x.dtype``, or of the autocast dtype inside ``torch.autocast``.
    """
    dtype = torch_autocast_dtype(x)
    if dtype is not None:
        # Under torch.autocast the GEMM computes in its dtype, as nn.Linear does there and
        # Transformer Engine's modules do: input and bias are cast to it, so the output (and
        # the FP8 input's amax) are those of the autocast-dtype input (docs/te_modules.md).
        x = x.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    if not run.fp8:  # calibration without FP8: record the amaxes, compute in high precision
        run.record_forward(x, fwd_slot(gemm, FwdSlot.INPUT))
        if cached_weight is None:
            run.record_forward(weight, fwd_slot(gemm, FwdSlot.WEIGHT))
        y = F.linear(x, weight, bias)
        if fp8_output:
            run.record_forward(y, fwd_slot(gemm, FwdSlot.OUTPUT))
        return y
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    y = _LinearFunction.apply(x2d, weight, bias, run, gemm, cached_weight, fp8_output, fp8_grad)
    # Reshape only when needed: a view of a custom Function's output upsets FSDP2's hooks.
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])


class Linear(FP8StateOwner, nn.Linear):
    """Drop-in replacement for ``torch.nn.Linear`` that runs in FP8 inside ``f8.autocast``.

    Args:
        in_features, out_features, bias, device, dtype: as ``torch.nn.Linear``.
        params_dtype: Transformer Engine's name for ``dtype`` (give one of them).
        fp8_output: also pass the output through FP8 (E4M3, forward OUTPUT slot) and record its
            amax; the returned tensor is the dequantized high-precision value.
        fp8_grad: likewise for the input gradient (E5M2 under HYBRID, backward GRAD_INPUT slot).
        init_method: fills ``weight`` in place, and the bias starts at 0 (Transformer Engine's
            ``init_method``); None: ``torch.nn.Linear``'s initialisation.

    Outside an enabled autocast it computes exactly what ``torch.nn.Linear`` computes (a bad
    input raises fp8kit's TypeError / ValueError naming the argument). Any input shape
    ``(*, in_features)`` and any feature sizes work (GEMM operands are zero-padded to multiples
    of 16 where needed). ``fp8_meta.forward`` / ``.backward`` hold the delayed-scaling state.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        params_dtype: torch.dtype | None = None,
        fp8_output: bool = False,
        fp8_grad: bool = False,
        init_method: InitMethod | None = None,
    ) -> None:
        dtype = resolve_params_dtype(dtype, params_dtype)
        check_features("in_features", in_features)
        check_features("out_features", out_features)
        for name, flag in (("bias", bias), ("fp8_output", fp8_output), ("fp8_grad", fp8_grad)):
            check_bool(name, flag)
        # Read by reset_parameters, which nn.Linear.__init__ calls (a plain attribute may be
        # set before Module.__init__).
        self.init_method = check_init_method("init_method", init_method)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.fp8_output = fp8_output
        self.fp8_grad = fp8_grad
        self.fp8_meta = FP8Meta(
            num_gemms=1, device=device, label=f"Linear({in_features}, {out_features})"
        )
        self._weight_cache: list[Float8Tensor | None] = [None]
        self._init_fp8_owner()

    def reset_parameters(self) -> None:
        if self.__dict__.get("init_method") is None:  # also a module pickled before it existed
            super().reset_parameters()
        else:
            init_linear(self.weight, self.bias, self.init_method)
        if "fp8_meta" in self._modules:  # not yet while nn.Linear.__init__ runs
            self.fp8_meta.reset_values()
            self._weight_cache = [None]

    def forward(  # type: ignore[override]
        self, input: torch.Tensor, is_first_microbatch: bool | None = None
    ) -> torch.Tensor:
        """``input @ weight.T + bias``, ``(..., in_features) -> (..., out_features)``: FP8 GEMMs
        inside an enabled ``f8.autocast``, ``nn.Linear`` outside (the argument keeps
        ``nn.Linear``'s name, so ``layer(input=x)`` works for both)."""
        check_is_first_microbatch(is_first_microbatch)
        run = fp8_run_for(self, input, self.in_features, self.weight, "input")
        if run is None:
            return super().forward(input)
        (cached,) = cached_fp8_weights(run, is_first_microbatch, [self.weight], self._weight_cache)
        return fp8_linear(
            input,
            self.weight,
            self.bias,
            run,
            cached_weight=cached,
            fp8_output=self.fp8_output,
            fp8_grad=self.fp8_grad,
        )

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        if self.fp8_output:
            extra += ", fp8_output=True"
        if self.fp8_grad:
            extra += ", fp8_grad=True"
        return extra

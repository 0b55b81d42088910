"""The FP8 ``dot_general`` with a custom VJP that *observes* amaxes (docs/semantics.md
sections 2-4).

Forward: the lhs (INPUT slot) and rhs (WEIGHT slot) are quantized into the recipe's forward format
(E4M3 under HYBRID) with the meta's delayed scales and multiplied by
:func:`fp8kit.jax.gemm.scaled_dot_general`: a ``dot_general`` on the FP8 arrays whose result is
written in the compute dtype and multiplied by the two ``scale_inv`` factors, the form XLA runs as
one cuBLASLt FP8 GEMM on GPUs (docs/jax.md, "Lowering"). Backward: the output gradient
(GRAD_OUTPUT slot) is quantized into the backward format (E5M2 under HYBRID); dgrad (dY x W) and
wgrad (x x dY) are FP8 GEMMs on the saved FP8 copies, expressed through dimension numbers (no
transposed copies). ``override_linear_precision`` switches any of the three GEMMs to high
precision (float32 accumulation and result).

How amaxes get out without the optimizer: the op takes the module's :class:`Fp8Meta` and returns
it unchanged (an identity), and its backward rule returns, as the *cotangent of the meta*, the
amaxes it saw: history row 0 = ``max(incoming, this call's amaxes)`` and ``step = max(incoming,
1)``. Calls on the same meta are chained (each call takes the previous call's output meta), so
their observations combine with **max** along the chain instead of being summed by JAX:

* :func:`dot_general_chained` returns the output meta: thread it yourself (e.g. through a scan
  carry).
* :func:`dot_general` remembers, per meta object and per JAX trace, the latest output meta, so
  every call of one meta inside one traced function joins one chain (a layer reused, a Flax
  module called twice, several ``apply`` calls in one loss).

Where JAX would still sum (one meta closed over by a ``lax.scan`` body or broadcast by ``vmap``,
separately computed gradients added together), the ``step`` cotangent counts the chains and
:func:`fp8kit.jax.update` refuses the result. See ``docs/decisions/0101-jax-observations.md``.

Under ``shard_map`` the backward rule all-reduces (``pmax``) the call's amaxes over
``meta.amax_reduction_axes`` or, when that is None, over every mesh axis the amax varies over, so
the meta stays replicated. Under ``jax.jit`` with sharded global arrays the amax is global anyway.
"""

from __future__ import annotations

import functools
import operator
import weakref
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.extend import core as jex_core

from fp8kit.formats import FP8Format
from fp8kit.jax.gemm import gemm_dtype, scaled_dot_general
from fp8kit.jax.meta import (
    BwdSlot,
    Fp8Meta,
    FwdSlot,
    ScalingState,
    bwd_slot,
    check_meta_dtypes,
    fwd_slot,
)
from fp8kit.jax.quantization import (
    cast_to_fp8,
    check_high_precision,
    current_scale,
    high_precision_dtype,
    nan_ignoring_amax,
)
from fp8kit.matmul_args import SECOND_DERIVATIVE_ERROR
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Recipe
from fp8kit.unset import UNSET

__all__ = ["chain_ends", "dot_general", "dot_general_chained", "varying_axes"]

DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], ...]]


@dataclass(frozen=True)
class _Config:
    """Static description of one FP8 GEMM call (hashable: part of the trace)."""

    dimension_numbers: DimensionNumbers
    gemm: int
    fp8_output: bool
    fp8_grad: bool
    out_dtype: np.dtype
    precision: Any
    lhs_shape: tuple[int, ...]
    lhs_dtype: np.dtype
    rhs_shape: tuple[int, ...]
    rhs_dtype: np.dtype
    bias_shape: tuple[int, ...] | None
    bias_dtype: np.dtype | None
    lhs_vma: frozenset[str]
    rhs_vma: frozenset[str]
    bias_vma: frozenset[str]


# --- quantization of one slot ------------------------------------------------------------------


def _quantize_slot(
    x: jax.Array, state: ScalingState, slot: int, fmt: FP8Format, recipe: Recipe
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Quantize ``x`` for ``slot`` of ``state``; returns (fp8 data, scale_inv, amax to record).

    The recorded amax is None for current scaling (no history). With ``first_step_scaling=
    "current"`` a slot without history is cast with ``fmax / amax`` of ``x`` itself.
    """
    if isinstance(recipe, Float8CurrentScaling):
        amax = nan_ignoring_amax(x)
        scale = current_scale(amax, fmt, recipe.power_2_scale)
        data, _ = cast_to_fp8(x, scale, fmt)
        return data, jnp.reciprocal(scale), None
    scale = state.scale[slot]
    if recipe.first_step_scaling == "current":
        own = current_scale(nan_ignoring_amax(x), fmt)
        scale = jnp.where(state.update_count[slot] > 0, scale, own)
    data, amax = cast_to_fp8(x, scale, fmt)
    return data, jnp.reciprocal(scale), amax


def _dequant(data: jax.Array, scale_inv: jax.Array) -> jax.Array:
    return data.astype(jnp.float32) * scale_inv


# An operand of a GEMM: FP8 data with its scale_inv, or a high-precision array.
Operand = tuple[jax.Array, jax.Array] | jax.Array


def _gemm(a: Operand, b: Operand, dims: DimensionNumbers, cfg: _Config, out_dtype: Any) -> Any:
    """One of the three GEMMs. FP8 operands (tuples): an FP8 GEMM whose result has the GEMM
    dtype of ``out_dtype`` (:func:`fp8kit.jax.gemm.gemm_dtype`). High-precision operands: a
    float32 GEMM at the layer's ``precision`` with a float32 result."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return scaled_dot_general(a[0], a[1], b[0], b[1], dims, gemm_dtype(out_dtype))
    assert not isinstance(a, tuple) and not isinstance(b, tuple)
    return lax.dot_general(
        a,
        b,
        dims,
        precision=cfg.precision,
        preferred_element_type=jnp.float32,
    )


def _flags(recipe: Recipe) -> tuple[bool, bool, bool]:
    """(fprop, dgrad, wgrad): True where that GEMM runs in FP8."""
    fprop, dgrad, wgrad = recipe.override_linear_precision
    return not fprop, not dgrad, not wgrad


# --- distribution ------------------------------------------------------------------------------


def varying_axes(x: jax.Array) -> frozenset[str]:
    """Mesh axes over which ``x`` differs between devices inside ``shard_map`` (else empty)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(vma or ())


def _reduce(amaxes: jax.Array, meta_ct: jax.Array, recipe: Recipe, axes: Any) -> jax.Array:
    """All-reduce (MAX) a call's amaxes so they match the (replicated) meta."""
    varying = varying_axes(amaxes) - varying_axes(meta_ct)
    if isinstance(recipe, DelayedScaling) and not recipe.reduce_amax:
        if varying:
            raise ValueError(
                "recipe.reduce_amax=False, but the amaxes differ across mesh axes "
                f"{sorted(varying)} while the FP8 meta is the same on every device: give each "
                "device its own meta (shard it over those axes) or set reduce_amax=True"
            )
        return amaxes
    if axes is None:
        names = tuple(sorted(varying))
    else:
        missing = varying - set(axes)
        if missing:
            raise ValueError(
                f"amax_reduction_axes={axes} misses mesh axes {sorted(missing)} over which the "
                "amaxes differ; the replicated meta needs them reduced too"
            )
        # never over an axis the meta itself differs on (one meta per stage or device)
        names = tuple(a for a in axes if a not in varying_axes(meta_ct))
        try:
            return lax.pmax(amaxes, names) if names else amaxes
        except NameError as err:  # JAX's "unbound axis name"
            raise ValueError(
                f"amax_reduction_axes={axes} (the layer's field, fp8kit.jax.autocast or "
                f"init_meta) names mesh axes that are not bound here: run under jax.shard_map "
                f"(or pmap) over them, or leave amax_reduction_axes unset ({err})"
            ) from None
    return lax.pmax(amaxes, names) if names else amaxes


# --- the transposed GEMMs ----------------------------------------------------------------------


def _free(ndim: int, *used: tuple[int, ...]) -> list[int]:
    taken = set().union(*used)
    return [d for d in range(ndim) if d not in taken]


def _permute(x: jax.Array, permutation: tuple[int, ...]) -> jax.Array:
    return x if permutation == tuple(range(x.ndim)) else lax.transpose(x, permutation)


def _dgrad(dy: Operand, w: Operand, cfg: _Config) -> jax.Array:
    """d(lhs) of ``y = dot_general(lhs, w)``: contract ``dy`` with ``w`` over w's free axes.

    Returns the GEMM result (GEMM dtype of the lhs dtype) laid out like the lhs."""
    (lc, rc), (lb, rb) = cfg.dimension_numbers
    nx, nw, nb = len(cfg.lhs_shape), len(cfg.rhs_shape), len(lb)
    x_free = _free(nx, lc, lb)
    w_free = _free(nw, rc, rb)
    y_wfree = tuple(range(nb + len(x_free), nb + len(x_free) + len(w_free)))
    dims = ((y_wfree, tuple(w_free)), (tuple(range(nb)), rb))
    res = _gemm(dy, w, dims, cfg, cfg.lhs_dtype)
    # res axes: batch, then lhs free axes, then lhs contracted axes ordered like sorted(rc).
    order = sorted(rc)
    position = {d: k for k, d in enumerate(lb)}
    position.update({d: nb + m for m, d in enumerate(x_free)})
    position.update({d: nb + len(x_free) + order.index(r) for d, r in zip(lc, rc, strict=True)})
    return _permute(res, tuple(position[d] for d in range(nx)))


def _wgrad(x: Operand, dy: Operand, cfg: _Config) -> jax.Array:
    """d(rhs) of ``y = dot_general(x, rhs)``: contract ``x`` with ``dy`` over x's free axes.

    Returns the GEMM result (GEMM dtype of the rhs dtype) laid out like the rhs."""
    (lc, rc), (lb, rb) = cfg.dimension_numbers
    nx, nw, nb = len(cfg.lhs_shape), len(cfg.rhs_shape), len(lb)
    x_free = _free(nx, lc, lb)
    w_free = _free(nw, rc, rb)
    y_xfree = tuple(range(nb, nb + len(x_free)))
    dims = ((tuple(x_free), y_xfree), (lb, tuple(range(nb))))
    res = _gemm(x, dy, dims, cfg, cfg.rhs_dtype)
    # res axes: batch, then rhs contracted axes ordered like sorted(lc), then rhs free axes.
    order = sorted(lc)
    position = {d: k for k, d in enumerate(rb)}
    position.update({r: nb + order.index(d) for d, r in zip(lc, rc, strict=True)})
    position.update({d: nb + len(lc) + m for m, d in enumerate(w_free)})
    return _permute(res, tuple(position[d] for d in range(nw)))


def _psum_to(ct: jax.Array, primal_vma: frozenset[str]) -> jax.Array:
    extra = tuple(sorted(varying_axes(ct) - primal_vma))
    return lax.psum(ct, extra) if extra else ct


# --- the custom VJP ----------------------------------------------------------------------------


def _check_meta(meta: Fp8Meta, gemm: int) -> None:
    if not isinstance(meta, Fp8Meta):
        raise TypeError(f"meta must be an fp8kit.jax.Fp8Meta, got {type(meta).__name__}")
    check_meta_dtypes(meta)
    if meta.step.shape != ():
        raise ValueError(
            f"meta must be the state of one module (no leading axes), got step shape "
            f"{tuple(meta.step.shape)}: slice a stacked meta (e.g. inside a scan) first"
        )
    if not 0 <= gemm < meta.num_gemms:
        raise ValueError(f"gemm must be in [0, {meta.num_gemms}) for this meta, got {gemm}")
    # No GEMM is ever E5M2 x E5M2: recipes refuse fp8_format E5M2 (fp8kit.recipe).


# The rules are jitted so that an eager (un-jitted) training step compiles two programs instead of
# one per primitive; inside an outer jax.jit they are simply inlined.
@partial(jax.jit, static_argnums=(0, 5))
def _fp8_dot_fwd(
    cfg: _Config,
    lhs: jax.Array,
    rhs: jax.Array,
    bias: jax.Array | None,
    meta: Fp8Meta,
    rhs_differentiated: bool = True,
) -> tuple[tuple[jax.Array, Fp8Meta], tuple[Any, ...]]:
    """The forward GEMM and its residuals. ``rhs_differentiated``: whether wgrad will run; the
    input is cast for an FP8 wgrad only then (as fp8kit.torch does for a frozen weight), so a
    slot no GEMM reads keeps history 0."""
    recipe = meta.recipe
    fmt = recipe.fp8_format.forward
    fprop_fp8, dgrad_fp8, wgrad_fp8 = _flags(recipe)
    g = cfg.gemm
    obs = jnp.zeros(meta.forward.scale.shape, jnp.float32)

    def record(slot: int, amax: jax.Array | None) -> None:
        nonlocal obs
        if amax is not None:
            obs = obs.at[slot].set(amax)

    x_q = w_q = None
    if fprop_fp8 or (wgrad_fp8 and rhs_differentiated):
        x_q = _quantize_slot(lhs, meta.forward, fwd_slot(g, FwdSlot.INPUT), fmt, recipe)
        record(fwd_slot(g, FwdSlot.INPUT), x_q[2])
    if fprop_fp8 or dgrad_fp8:
        w_q = _quantize_slot(rhs, meta.forward, fwd_slot(g, FwdSlot.WEIGHT), fmt, recipe)
        record(fwd_slot(g, FwdSlot.WEIGHT), w_q[2])

    if fprop_fp8:
        assert x_q is not None and w_q is not None
        y = _gemm(x_q[:2], w_q[:2], cfg.dimension_numbers, cfg, cfg.out_dtype)
    else:  # a layer's float32 master kernel rounded to its 16-bit compute dtype first, as in
        # torch, Keras and Flax; a functional call keeps its promoted dtype (no rounding)
        rhs_hp = rhs.astype(jnp.promote_types(lhs.dtype, cfg.out_dtype))
        y = _gemm(lhs, rhs_hp, cfg.dimension_numbers, cfg, cfg.out_dtype)
    if bias is not None:
        y = y + bias.astype(y.dtype)  # in the GEMM's dtype: XLA fuses it into the FP8 GEMM
    y = y.astype(cfg.out_dtype)
    if cfg.fp8_output:
        slot = fwd_slot(g, FwdSlot.OUTPUT)
        y_data, y_inv, y_amax = _quantize_slot(y, meta.forward, slot, fmt, recipe)
        y = _dequant(y_data, y_inv).astype(cfg.out_dtype)
        record(slot, y_amax)

    # Saved for backward: the FP8 copies (1 byte per element) where that gradient GEMM is FP8.
    x_saved = (x_q[0], x_q[1]) if wgrad_fp8 and x_q is not None else lhs
    w_saved = (w_q[0], w_q[1]) if dgrad_fp8 and w_q is not None else rhs
    return (y, meta), (x_saved, w_saved, obs, meta.backward)


@partial(jax.jit, static_argnums=0)
def _fp8_dot_bwd(
    cfg: _Config, res: tuple[Any, ...], cts: tuple[jax.Array, Fp8Meta]
) -> tuple[Any, ...]:
    x_saved, w_saved, obs_fwd, bwd_state = res
    dy, meta_ct = cts
    recipe: Recipe = meta_ct.recipe
    fmt = recipe.fp8_format.backward
    _, dgrad_fp8, wgrad_fp8 = _flags(recipe)
    g = cfg.gemm
    obs_bwd = jnp.zeros(bwd_state.scale.shape, jnp.float32)
    dy32 = None if dy is None else dy.astype(jnp.float32)  # None: the output was not used

    # A residual is None where nobody differentiates that operand (the fwd rule drops it): that
    # GEMM, and dY's cast when no FP8 GEMM needs it, do not run (as in fp8kit.torch).
    need_dx, need_dw = w_saved is not None, x_saved is not None
    dy_op: Operand = dy32
    if (dgrad_fp8 and need_dx) or (wgrad_fp8 and need_dw):
        slot = bwd_slot(g, BwdSlot.GRAD_OUTPUT)
        dy_data, dy_inv, dy_amax = _quantize_slot(dy, bwd_state, slot, fmt, recipe)
        dy_op = (dy_data, dy_inv)
        if dy_amax is not None:
            obs_bwd = obs_bwd.at[slot].set(dy_amax)

    # dgrad and wgrad: the transposes of the forward dot, each an FP8 GEMM where the recipe says
    # so (the saved operand is then the FP8 copy) and a float32 GEMM otherwise.
    dx = dw = None
    if need_dx:
        w_op = w_saved if isinstance(w_saved, tuple) else w_saved.astype(jnp.float32)
        dx = _dgrad(dy_op if dgrad_fp8 else dy32, w_op, cfg).astype(cfg.lhs_dtype)
    if need_dw:
        x_op = x_saved if isinstance(x_saved, tuple) else x_saved.astype(jnp.float32)
        dw = _wgrad(x_op, dy_op if wgrad_fp8 else dy32, cfg).astype(cfg.rhs_dtype)
    db = None
    if cfg.bias_shape is not None and dy32 is not None:
        lead = dy32.ndim - len(cfg.bias_shape)
        summed = tuple(range(lead)) + tuple(
            lead + i for i, n in enumerate(cfg.bias_shape) if n == 1 and dy32.shape[lead + i] != 1
        )
        db = jnp.sum(dy32, axis=summed).reshape(cfg.bias_shape).astype(cfg.bias_dtype)
    # Under shard_map a replicated operand's gradient is the sum over the devices it was
    # replicated on (what JAX's own transpose of the implicit pvary does).
    if dx is not None:
        dx = _psum_to(dx, cfg.lhs_vma)
    if cfg.fp8_grad and dx is not None:  # the lhs gradient whole: after the sum of its parts
        slot = bwd_slot(g, BwdSlot.GRAD_INPUT)
        dx_data, dx_inv, dx_amax = _quantize_slot(dx, bwd_state, slot, fmt, recipe)
        dx = _dequant(dx_data, dx_inv).astype(cfg.lhs_dtype)
        if dx_amax is not None:
            obs_bwd = obs_bwd.at[slot].set(dx_amax)
    if dw is not None:
        dw = _psum_to(dw, cfg.rhs_vma)
    if db is not None:
        db = _psum_to(db, cfg.bias_vma)

    # One collective for this call's amaxes (3 forward + 2 backward), then max into the chain.
    both = _reduce(
        jnp.concatenate([obs_fwd, obs_bwd]), meta_ct.step, recipe, meta_ct.amax_reduction_axes
    )
    n_fwd = obs_fwd.shape[0]
    fwd_h = meta_ct.forward.amax_history
    bwd_h = meta_ct.backward.amax_history
    meta_in_ct = replace(
        meta_ct,
        forward=replace(meta_ct.forward, amax_history=fwd_h.at[0].max(both[:n_fwd])),
        backward=replace(meta_ct.backward, amax_history=bwd_h.at[0].max(both[n_fwd:])),
        # One chain. The 1 is derived from this call's amaxes so that it carries their batch
        # dimension: where JAX sums the amaxes (a meta broadcast by vmap), it sums the count
        # too, and f8.update refuses the sum (docs/jax.md, "Reuse, scan, remat, microbatches").
        step=jnp.maximum(meta_ct.step, jnp.where(both[0] >= 0, 1.0, 1.0)),
    )
    dx, dw, db = _first_derivatives_only(dx, dw, db, (dy, x_saved, w_saved))
    return dx, dw, db, meta_in_ct


@jax.custom_jvp
def _first_derivatives_only(
    dx: jax.Array | None, dw: jax.Array | None, db: jax.Array | None, inputs: Any
) -> tuple[jax.Array | None, jax.Array | None, jax.Array | None]:
    """The gradients unchanged; differentiating them (``jax.grad`` of a gradient penalty) raises
    at trace time: JAX would otherwise differentiate the FP8 backward rule itself, a silently
    wrong second derivative (docs/semantics.md section 4). ``inputs`` (the backward rule's
    ``dy`` and residuals) join so that a tangent reaching the rule through any of them raises,
    also where the FP8 casts would have zeroed it."""
    return dx, dw, db


@_first_derivatives_only.defjvp
def _differentiating_again_raises(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> Any:
    raise TypeError(SECOND_DERIVATIVE_ERROR)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_dot(
    cfg: _Config, lhs: jax.Array, rhs: jax.Array, bias: jax.Array | None, meta: Fp8Meta
) -> tuple[jax.Array, Fp8Meta]:
    return _fp8_dot_fwd(cfg, lhs, rhs, bias, meta)[0]


def _fp8_dot_fwd_rule(
    cfg: _Config, lhs: Any, rhs: Any, bias: Any, meta: Any
) -> tuple[tuple[jax.Array, Fp8Meta], tuple[Any, ...]]:
    """The fwd rule with symbolic zeros: the primals come wrapped with whether they are
    differentiated; the residual of an operand nobody differentiates is dropped
    (:func:`_dropped`)."""
    meta_value = _values(meta)
    out, (x_saved, w_saved, obs, bwd_state) = _fp8_dot_fwd(
        cfg, lhs.value, rhs.value, _values(bias), meta_value, rhs.perturbed
    )
    saved = (
        x_saved if rhs.perturbed else _dropped(x_saved),  # wgrad's operand
        w_saved if lhs.perturbed else _dropped(w_saved),  # dgrad's operand
        obs,
        bwd_state,
    )
    return out, (saved, meta_value)


def _dropped(residual: Any) -> Any:
    """A dropped residual: the same tree with every leaf an empty bool array. The tree must not
    depend on which operands are differentiated: JAX may pair one call's residuals with another
    call's residual tree (``jax.checkpoint`` reuses one traced body for equal input shapes;
    decision 0248)."""
    return jax.tree.map(lambda _: jnp.zeros((0,), jnp.bool_), residual)


def _is_dropped(residual: Any) -> bool:
    return all(leaf.dtype == jnp.bool_ and leaf.shape == (0,) for leaf in jax.tree.leaves(residual))


def _fp8_dot_bwd_rule(cfg: _Config, res: tuple[Any, ...], cts: tuple[Any, Any]) -> tuple[Any, ...]:
    """The bwd rule with symbolic zeros. An unused output (zero ``dy``) needs no gradient GEMM
    or cast; an unused meta output gets zeros like the meta itself (which keep its
    ``shard_map`` variance, what ``_reduce`` compares the amaxes with)."""
    (x_saved, w_saved, *rest), meta_value = res
    saved = tuple(None if _is_dropped(r) else r for r in (x_saved, w_saved)) + tuple(rest)
    dy, meta_ct = cts
    meta_ct = jax.tree.map(
        lambda c, p: jnp.zeros_like(p) if isinstance(c, SymbolicZero) else c,
        meta_ct,
        meta_value,
        is_leaf=lambda c: isinstance(c, SymbolicZero),
    )
    if isinstance(dy, SymbolicZero):
        dy = None
        saved = (None, None, *saved[2:])  # nothing flows back: no dX, no dW
    return _fp8_dot_bwd(cfg, saved, (dy, meta_ct))


def _values(tree: Any) -> Any:
    return jax.tree.map(lambda p: p.value, tree, is_leaf=lambda p: isinstance(p, CustomVJPPrimal))


_fp8_dot.defvjp(_fp8_dot_fwd_rule, _fp8_dot_bwd_rule, symbolic_zeros=True)


# --- public entry points -----------------------------------------------------------------------


def _check_dimensions(
    lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...], dims: DimensionNumbers
) -> tuple[int, ...]:
    """The result shape of ``lax.dot_general`` with ``dims``, after a ValueError naming
    ``dimension_numbers`` for an axis out of range or repeated, or sizes that differ."""
    (lc, rc), (lb, rb) = dims
    for side, shape, axes in (("lhs", lhs_shape, lc + lb), ("rhs", rhs_shape, rc + rb)):
        bad = [a for a in axes if not 0 <= a < len(shape)]
        if bad or len(set(axes)) != len(axes):
            raise ValueError(
                f"dimension_numbers name {side} axes {axes}: each must be in [0, "
                f"{len(shape)}) for {side} of shape {tuple(shape)}, once"
            )
    for kind, la, ra in (("contracting", lc, rc), ("batch", lb, rb)):
        sizes = ([lhs_shape[a] for a in la], [rhs_shape[a] for a in ra])
        if sizes[0] != sizes[1]:
            raise ValueError(
                f"dimension_numbers pair {kind} axes of different sizes: lhs axes {la} have "
                f"{sizes[0]} (lhs shape {tuple(lhs_shape)}), rhs axes {ra} have {sizes[1]} "
                f"(rhs shape {tuple(rhs_shape)})"
            )
    free = (
        [lhs_shape[a] for a in range(len(lhs_shape)) if a not in lc + lb],
        [rhs_shape[a] for a in range(len(rhs_shape)) if a not in rc + rb],
    )
    return (*[lhs_shape[a] for a in lb], *free[0], *free[1])


def _broadcast_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """NumPy's broadcast of two shapes, or None when they do not broadcast."""
    try:
        return tuple(np.broadcast_shapes(a, b))
    except ValueError:
        return None


def _axes(axes: Any) -> tuple[int, ...]:
    """``axes`` as a tuple of ints. A bool, float or string axis raises ``TypeError``: it is
    not truncated or read as 0 / 1."""
    if isinstance(axes, str) or any(isinstance(a, bool) for a in axes):
        raise TypeError(axes)
    return tuple(operator.index(a) for a in axes)


def _config(
    lhs: jax.Array,
    rhs: jax.Array,
    bias: jax.Array | None,
    dimension_numbers: Any,
    gemm: int,
    fp8_output: bool,
    fp8_grad: bool,
    preferred_element_type: Any,
    precision: Any,
) -> _Config:
    for name, flag in (("fp8_output", fp8_output), ("fp8_grad", fp8_grad)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if isinstance(gemm, bool) or not isinstance(gemm, int):
        raise TypeError(f"gemm must be an int, got {gemm!r}")
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        contracting = (_axes(lc), _axes(rc))
        dims = (contracting, (_axes(lb), _axes(rb)))
    except (TypeError, ValueError):
        raise ValueError(
            "dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, "
            "rhs_batch)) of int axes as for jax.lax.dot_general, got "
            f"{dimension_numbers!r}"
        ) from None
    out_shape = _check_dimensions(lhs.shape, rhs.shape, dims)
    if bias is not None and _broadcast_shape(out_shape, tuple(bias.shape)) != out_shape:
        raise ValueError(
            f"bias must broadcast to the result's shape {out_shape} without changing it, got "
            f"shape {tuple(bias.shape)}"
        )
    out = jnp.result_type(lhs, rhs) if preferred_element_type is None else preferred_element_type
    high_precision_dtype(out, "preferred_element_type")
    if isinstance(precision, list):  # hashable: the config is a static jit argument
        precision = tuple(precision)
    _check_precision(precision)
    return _Config(
        dimension_numbers=dims,
        gemm=gemm,
        fp8_output=fp8_output,
        fp8_grad=fp8_grad,
        out_dtype=np.dtype(out),
        precision=precision,
        lhs_shape=tuple(lhs.shape),
        lhs_dtype=np.dtype(lhs.dtype),
        rhs_shape=tuple(rhs.shape),
        rhs_dtype=np.dtype(rhs.dtype),
        bias_shape=None if bias is None else tuple(bias.shape),
        bias_dtype=None if bias is None else np.dtype(bias.dtype),
        lhs_vma=varying_axes(lhs),
        rhs_vma=varying_axes(rhs),
        bias_vma=frozenset() if bias is None else varying_axes(bias),
    )


@functools.lru_cache(maxsize=64)
def _check_precision(precision: Any) -> None:
    """Raise what ``lax.dot_general`` raises for an invalid ``precision`` (None, a
    ``lax.Precision`` or its name, a pair of them, or a dot algorithm): FP8 GEMMs never use it,
    so it would otherwise be ignored. Checked once per value, by tracing one tiny dot."""
    one = jax.ShapeDtypeStruct((1, 1), jnp.float32)
    try:
        jax.eval_shape(
            lambda a: lax.dot_general(a, a, (((1,), (0,)), ((), ())), precision=precision), one
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"precision: {err}") from None


def dot_general_chained(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    meta: Fp8Meta,
    *,
    bias: jax.Array | None = None,
    gemm: int = 0,
    fp8_output: bool = False,
    fp8_grad: bool = False,
    preferred_element_type: Any = None,
    precision: Any = None,
) -> tuple[jax.Array, Fp8Meta]:
    """FP8 ``lax.dot_general(lhs, rhs)`` (+ bias) returning ``(out, meta_out)``.

    ``meta_out`` has the values of ``meta``; pass it to the next call that uses the same module
    state so both calls' amaxes combine with max (see module doc).

    Args:
        lhs: the activation (INPUT slot), a high-precision float array.
        rhs: the weight (WEIGHT slot), a high-precision float array.
        dimension_numbers: as for ``jax.lax.dot_general``.
        meta: the module's :class:`Fp8Meta` (one module: no leading axes).
        bias: optional, broadcastable to the output without changing its shape; added in the
            GEMM's result dtype (bfloat16 for a bfloat16 output, float32 otherwise), before an
            FP8 output.
        gemm: which GEMM of the module this is (slots ``3*gemm + FwdSlot``, ``2*gemm + BwdSlot``).
        fp8_output / fp8_grad: also pass the output / the lhs gradient through FP8 (OUTPUT and
            GRAD_INPUT slots), returning the dequantized values.
        preferred_element_type: output dtype (default: the promoted dtype of lhs and rhs).
        precision: ``jax.lax.Precision`` for GEMMs the recipe keeps in high precision.

    Returns:
        ``(out, meta_out)``; ``out`` has ``preferred_element_type``.
    """
    lhs = check_high_precision(lhs, "lhs")
    rhs = check_high_precision(rhs, "rhs")
    if bias is not None:
        bias = check_high_precision(bias, "bias")
    _check_meta(meta, gemm)
    cfg = _config(
        lhs,
        rhs,
        bias,
        dimension_numbers,
        gemm,
        fp8_output,
        fp8_grad,
        preferred_element_type,
        precision,
    )
    return _fp8_dot(cfg, lhs, rhs, bias, meta)


# Per meta object: (trace it was last used in, the meta returned by that call).
_CHAINS: weakref.WeakKeyDictionary[Fp8Meta, tuple[Any, Fp8Meta]] = weakref.WeakKeyDictionary()


def _chain_end(meta: Fp8Meta, trace: Any) -> Fp8Meta:
    """The meta returned by the last call of ``meta``'s chain in ``trace`` (``meta`` itself
    when no call used it there)."""
    head = meta
    seen = _CHAINS.get(head)
    while seen is not None and seen[0] == trace:
        head = seen[1]
        seen = _CHAINS.get(head)
    return head


def chain_ends(metas: list[Fp8Meta]) -> list[Fp8Meta]:
    """For each of ``metas`` that an FP8 call used in the current trace, the meta its chain's
    last call returned (:func:`fp8kit.jax.value_and_grad` ties these to the loss, so that every
    call's backward rule runs and reports its amaxes, docs/decisions/0264)."""
    trace = jex_core.get_opaque_trace_state(convention="fp8kit")
    ends = [_chain_end(m, trace) for m in metas]
    return [end for end, m in zip(ends, metas, strict=True) if end is not m]


def dot_general(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    meta: Fp8Meta,
    *,
    bias: jax.Array | None = None,
    gemm: int = 0,
    fp8_output: bool = False,
    fp8_grad: bool = False,
    preferred_element_type: Any = None,
    precision: Any = None,
) -> jax.Array:
    """FP8 ``lax.dot_general`` observing amaxes into ``meta``'s cotangent (see module doc).

    Same arguments as :func:`dot_general_chained`; returns only the output. Every call with the
    same ``meta`` object inside one traced function joins one max-combining chain.
    """
    return dot_general_joined(
        lhs,
        rhs,
        dimension_numbers,
        meta,
        bias=bias,
        gemm=gemm,
        fp8_output=fp8_output,
        fp8_grad=fp8_grad,
        preferred_element_type=preferred_element_type,
        precision=precision,
    )[0]


def dot_general_joined(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    meta: Fp8Meta,
    *,
    amax_reduction_axes: Any = UNSET,
    **kwargs: Any,
) -> tuple[jax.Array, Fp8Meta]:
    """:func:`dot_general_chained` continuing the chain that ``meta`` started or passed
    through earlier in this traced function (one max-combining chain per state, however the
    calls reach it: the same object, or a meta returned by an earlier call of the chain, as a
    mutable Linen collection hands it on within one ``apply`` but not to the next ``apply``).

    ``amax_reduction_axes`` (a layer's field; UNSET: the meta's) replaces the meta's for this
    call only: the meta returned keeps the meta's own (a static field, part of the state's
    tree)."""
    trace = jex_core.get_opaque_trace_state(convention="fp8kit")
    head = _chain_end(meta, trace) if isinstance(meta, Fp8Meta) else meta
    # not a meta: dot_general_chained names the wrong argument
    run = head.with_reduction_axes(amax_reduction_axes) if isinstance(head, Fp8Meta) else head
    out, meta_out = dot_general_chained(lhs, rhs, dimension_numbers, run, **kwargs)
    if run is not head:
        meta_out = replace(meta_out, amax_reduction_axes=head.amax_reduction_axes)
    if isinstance(meta, Fp8Meta):
        _CHAINS[meta] = _CHAINS[head] = (trace, meta_out)
    return out, meta_out

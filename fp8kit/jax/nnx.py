"""Flax NNX FP8 layer: :class:`Linear`, with its state in an :class:`Fp8MetaVariable`.

``Fp8MetaVariable`` is its own variable type (not an ``nnx.Param``), so ``nnx.Optimizer(model,
tx, wrt=nnx.Param)`` and anything else filtered on ``nnx.Param`` never touches FP8 state. Take
gradients with :func:`value_and_grad` (parameter gradients and observations come back apart) and
apply the observations in place with :func:`update`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen.dtypes import promote_dtype
from jax import lax

from fp8kit.jax.autocast import resolve_defaults
from fp8kit.jax.dot import dot_general_chained
from fp8kit.jax.grad import check_grad_args, split_grads, tie_chain_ends
from fp8kit.jax.meta import Fp8Meta, init_meta
from fp8kit.jax.quantization import check_high_precision, master_weight
from fp8kit.jax.updates import update as _update_tree
from fp8kit.recipe import require_int
from fp8kit.unset import UNSET

__all__ = ["Fp8MetaVariable", "Linear", "update", "value_and_grad"]


_DEFAULT_KERNEL_INIT = nnx.initializers.lecun_normal()
_DEFAULT_BIAS_INIT = nnx.initializers.zeros_init()


class Fp8MetaVariable(nnx.Variable):
    """Holds one module's :class:`fp8kit.jax.Fp8Meta`; deliberately not an ``nnx.Param``."""


class Linear(nnx.Module):
    """FP8 drop-in for ``flax.nnx.Linear``: ``y = x @ kernel + bias``.

    Args:
        in_features, out_features, use_bias, dtype, param_dtype, precision, kernel_init,
            bias_init, rngs, kernel_metadata, bias_metadata: as ``flax.nnx.Linear`` (the
            metadata, e.g. ``sharding_names``, goes to the ``nnx.Param``). Flax's
            ``dot_general``, ``promote_dtype`` and ``preferred_element_type`` are not taken:
            the FP8 GEMM is the dot_general.
        recipe: DelayedScaling / Float8CurrentScaling, None for high precision, or UNSET to
            take the :func:`fp8kit.jax.autocast` active at construction (high precision outside).
        amax_reduction_axes: mesh axes for the amax all-reduce under ``shard_map``.
        fp8_output / fp8_grad: also pass the output / input gradient through FP8.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Callable[..., Any] = _DEFAULT_KERNEL_INIT,
        bias_init: Callable[..., Any] = _DEFAULT_BIAS_INIT,
        recipe: Any = UNSET,
        amax_reduction_axes: Any = UNSET,
        fp8_output: bool = False,
        fp8_grad: bool = False,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    ) -> None:
        require_int("in_features", in_features, 1)
        require_int("out_features", out_features, 1)
        for name, flag in (("use_bias", use_bias), ("fp8_output", fp8_output),
                           ("fp8_grad", fp8_grad)):  # fmt: skip
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        recipe, axes = resolve_defaults(recipe, amax_reduction_axes)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.fp8_output = fp8_output
        self.fp8_grad = fp8_grad
        shape = (in_features, out_features)
        self.kernel = nnx.Param(kernel_init(rngs.params(), shape, param_dtype), **kernel_metadata)
        self.bias = (
            nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype), **bias_metadata)
            if use_bias
            else None
        )
        enabled = recipe is not UNSET and recipe is not None
        self.fp8_meta: Fp8MetaVariable | None = (
            Fp8MetaVariable(
                init_meta(1, recipe, amax_reduction_axes=None if axes is UNSET else axes)
            )
            if enabled
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x`` ``(..., in_features)`` -> ``(..., out_features)``."""
        kernel_param = self.kernel[...]
        bias = None if self.bias is None else self.bias[...]
        if self.fp8_meta is not None:  # before promotion, which would turn integer ids into floats
            check_high_precision(x, "x")
        x, kernel, bias = promote_dtype(x, kernel_param, bias, dtype=self.dtype)
        dims = (((x.ndim - 1,), (0,)), ((), ()))
        if self.fp8_meta is None:
            y = lax.dot_general(x, kernel, dims, precision=self.precision)
            return y if bias is None else y + bias
        meta = self.fp8_meta.get_value()
        y, meta_out = dot_general_chained(
            x,
            master_weight(kernel_param, kernel),
            dims,
            meta,
            bias=bias,
            fp8_output=self.fp8_output,
            fp8_grad=self.fp8_grad,
            preferred_element_type=x.dtype,
            precision=self.precision,
        )
        # The next call of this layer continues the chain, so reuse combines amaxes with max.
        self.fp8_meta.set_value(meta_out)
        return y


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any, Any]]:
    """``nnx.value_and_grad`` over ``nnx.Param`` *and* FP8 meta, returned apart.

    Returns a function giving ``(value, grads, observations)``: ``grads`` is an ``nnx.State`` of
    the ``nnx.Param`` gradients only (what ``nnx.Optimizer(..., wrt=nnx.Param).update`` takes),
    ``observations`` the FP8 observations for :func:`update`. With several ``argnums`` both
    are tuples; an argument that is not an NNX graph node (an array) gets its plain gradient
    and ``None`` observations. An argument holding modules in a container (a tuple, list or
    dict of them, as ``nnx.value_and_grad`` takes) gets both in that container, one entry per
    module: ``update(model_i, observations[i])``.
    """
    nums = check_grad_args(fun, argnums, has_aux)
    diff = tuple(nnx.DiffState(n, nnx.Any(nnx.Param, Fp8MetaVariable)) for n in nums)

    @functools.wraps(fun)
    def observed(*args: Any, **kwargs: Any) -> Any:
        # The layers wrote each chain's last meta back into their variables: tie those to the
        # loss, so every call reports its amaxes (docs/decisions/0264).
        result = fun(*args, **kwargs)
        ends = [
            var.get_value()
            for n in nums
            for module in _modules_in(args[n])
            for _, var in nnx.to_flat_state(nnx.state(module, Fp8MetaVariable))
        ]
        return tie_chain_ends(result, ends, has_aux)

    inner = nnx.value_and_grad(
        observed, argnums=diff[0] if isinstance(argnums, int) else diff, has_aux=has_aux
    )

    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
        value, grads = inner(*args, **kwargs)
        if isinstance(argnums, int):
            params, obs = _split(grads)
        else:
            pairs = [_split(g) for g in grads]
            params, obs = tuple(p for p, _ in pairs), tuple(o for _, o in pairs)
        return value, params, obs

    return wrapped


def _is_state(value: Any) -> bool:
    return isinstance(value, nnx.State)


def _split_state(state: nnx.State) -> tuple[Any, Any]:
    """One module's gradient state as (its ``nnx.Param`` gradients, its FP8 observations)."""
    params, metas = nnx.split_state(state, nnx.Param, Fp8MetaVariable)
    _, obs = split_grads({path: var.get_value() for path, var in nnx.to_flat_state(metas)})
    return params, obs


def _split(grad: Any) -> tuple[Any, Any]:
    """A module's gradient state split by :func:`_split_state`; a container of them split entry
    by entry; an argument that is not a graph node (an array, a pytree of arrays) has a plain
    gradient and holds no FP8 state: None, as fp8kit.jax.value_and_grad gives."""
    leaves, treedef = jax.tree_util.tree_flatten(grad, is_leaf=_is_state)
    if not any(_is_state(leaf) for leaf in leaves):
        return grad, None
    pairs = [_split_state(leaf) if _is_state(leaf) else (leaf, None) for leaf in leaves]
    return treedef.unflatten([p for p, _ in pairs]), treedef.unflatten([o for _, o in pairs])


def _modules_in(arg: Any) -> list[nnx.Module]:
    """The NNX modules a differentiated argument holds: itself, or those in a container."""
    leaves = jax.tree_util.tree_leaves(arg, is_leaf=lambda x: isinstance(x, nnx.Module))
    return [leaf for leaf in leaves if isinstance(leaf, nnx.Module)]


def _metas(model: nnx.Module) -> dict[Any, Fp8Meta]:
    state = nnx.state(model, Fp8MetaVariable)
    return {path: var.get_value() for path, var in nnx.to_flat_state(state)}


def update(model: nnx.Module, observations: Any, *, check_chains: bool = True) -> None:
    """Apply one update event to every :class:`Fp8MetaVariable` of ``model``, in place.

    ``observations`` is the third result of :func:`value_and_grad` (keyed by variable path).
    """
    metas = _metas(model)
    if not metas and observations is None:
        raise ValueError(
            "update found no Fp8MetaVariable in model and got no observations, so it would do "
            "nothing: pass the module built from fp8kit.jax.nnx layers"
        )
    new = _update_tree(metas, observations, check_chains=check_chains)
    state = nnx.state(model, Fp8MetaVariable)
    for path, var in nnx.to_flat_state(state):
        var.set_value(new[path])
    nnx.update(model, state)

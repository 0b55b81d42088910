"""Flax Linen FP8 layers: drop-in :class:`Dense` and :class:`DenseGeneral`.

Parameters (``"params"``: ``kernel``, ``bias``) have the names, shapes and initialisation of
``flax.linen.Dense`` / ``DenseGeneral``. FP8 state lives in its own collection ``"fp8_meta"``
(one :class:`fp8kit.jax.Fp8Meta` per layer, under the name ``"meta"``), which an optimizer never
sees: take gradients with :func:`fp8kit.jax.value_and_grad` (or ``jax.value_and_grad`` over the
whole variable dict) and apply the observations with :func:`fp8kit.jax.update`.

The recipe is fixed when the layer's state is created: the ``recipe`` field, else the
:func:`fp8kit.jax.autocast` active when the layer object was constructed. After that the state
carries it (static pytree metadata, part of every jit cache key); a layer whose own recipe
differs from its state's raises instead of silently mixing recipes. Without any recipe and without
state a layer is exactly its ``flax.linen`` counterpart in high precision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta
from flax.linen.dtypes import promote_dtype
from jax import lax

from fp8kit.jax.autocast import resolve_defaults
from fp8kit.jax.dot import dot_general, dot_general_joined
from fp8kit.jax.meta import Fp8Meta, init_meta
from fp8kit.jax.quantization import check_high_precision, master_weight
from fp8kit.unset import UNSET

__all__ = ["FP8_COLLECTION", "Dense", "DenseGeneral"]

FP8_COLLECTION = "fp8_meta"
_META_NAME = "meta"
_default_kernel_init = nn.initializers.lecun_normal()


class _Fp8Layer(nn.Module):
    """Shared behaviour: autocast defaults at construction, state lookup, the FP8 GEMM."""

    def __post_init__(self) -> None:
        _check_features(self.features)  # type: ignore[attr-defined]
        for name in ("fp8_output", "fp8_grad", "use_bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        recipe, axes = resolve_defaults(
            self.recipe,  # type: ignore[attr-defined]
            self.amax_reduction_axes,  # type: ignore[attr-defined]
        )
        object.__setattr__(self, "recipe", recipe)
        object.__setattr__(self, "amax_reduction_axes", axes)
        super().__post_init__()

    def _fp8_state(self) -> tuple[Fp8Meta | None, bool]:
        """(the meta to run with or None for high precision, whether it can be written back)."""
        recipe = self.recipe  # type: ignore[attr-defined]
        axes = self.amax_reduction_axes  # type: ignore[attr-defined]
        has = self.has_variable(FP8_COLLECTION, _META_NAME)
        mutable = self.is_mutable_collection(FP8_COLLECTION)
        if not has:
            if recipe is UNSET or recipe is None:
                return None, False
            if not mutable:
                fix = (
                    f"the collection is read-only in this init: inside nn.scan, nn.vmap or "
                    f"another lifted transform, list it in variable_axes (e.g. "
                    f"variable_axes={{'params': 0, {FP8_COLLECTION!r}: 0}})"
                    if self.is_initializing()
                    else f"pass the variables returned by init (or apply with "
                    f"mutable=[{FP8_COLLECTION!r}] to create it)"
                )
                raise ValueError(
                    f"{self.__class__.__name__} {self._where()!r} has recipe {recipe} but the "
                    f"variables hold no {FP8_COLLECTION!r} state for it: {fix}"
                )
            init_axes = None if axes is UNSET else axes
            var = self.variable(
                FP8_COLLECTION,
                _META_NAME,
                lambda: init_meta(1, recipe, amax_reduction_axes=init_axes),
            )
            return var.value, True
        meta = self.get_variable(FP8_COLLECTION, _META_NAME)
        if not isinstance(meta, Fp8Meta):
            raise TypeError(
                f"variables[{FP8_COLLECTION!r}] of {self._where()!r} must hold an "
                f"fp8kit.jax.Fp8Meta under {_META_NAME!r}, got {type(meta).__name__}"
            )
        if meta.num_gemms != 1:
            raise ValueError(
                f"variables[{FP8_COLLECTION!r}] of {self._where()!r} hold the state of a module "
                f"with {meta.num_gemms} GEMMs; a {self.__class__.__name__} has one"
            )
        if recipe is None:
            raise ValueError(
                f"{self._where()!r} runs with FP8 disabled (recipe=None, or an "
                f"autocast(enabled=False) where it was constructed or around this call) but the "
                f"variables hold FP8 state for it: to run in high precision, apply without the "
                f"{FP8_COLLECTION!r} collection"
            )
        if recipe is not UNSET and recipe != meta.recipe:
            raise ValueError(
                f"{self._where()!r} runs with recipe {recipe} (its recipe= field, or the "
                f"f8.autocast where it was constructed or around this call) but its FP8 state "
                f"belongs to {meta.recipe}; convert the state with fp8kit.jax.with_recipe"
            )
        return meta, mutable

    def _where(self) -> str:
        return "/" + "/".join(self.scope.path) if self.scope is not None else "<unbound>"

    def _gemm(
        self,
        x: jax.Array,
        kernel_param: jax.Array,
        bias: jax.Array | None,
        dims: Any,
    ) -> jax.Array:
        """``x`` (the input) and ``kernel_param`` (the parameter) are promoted to the compute
        dtype as Flax's layers promote them, except the kernel an FP8 GEMM quantizes
        (:func:`~fp8kit.jax.quantization.master_weight`)."""
        meta, writable = self._fp8_state()
        if meta is not None:  # before promotion, which would turn integer ids into floats
            check_high_precision(x, "inputs")
        x, kernel, bias = promote_dtype(x, kernel_param, bias, dtype=self.dtype)  # type: ignore[attr-defined]
        precision = self.precision  # type: ignore[attr-defined]
        if meta is None:
            y = lax.dot_general(x, kernel, dims, precision=precision)
            return y if bias is None else y + bias
        kernel = master_weight(kernel_param, kernel)
        kwargs = {
            "bias": bias,
            "fp8_output": self.fp8_output,  # type: ignore[attr-defined]
            "fp8_grad": self.fp8_grad,  # type: ignore[attr-defined]
            "preferred_element_type": x.dtype,
            "precision": precision,
        }
        # The axes are configuration, not state: the field (or its autocast) wins over the axes
        # the state was created with, for this call; the state keeps its own (docs/jax.md,
        # "Distribution"; decision 0248).
        axes = self.amax_reduction_axes  # type: ignore[attr-defined]
        if writable and not self.is_initializing():
            # A mutable collection carries the chain itself (e.g. through an nn.scan carry);
            # another apply on the same variables in this trace joins it too.
            y, meta_out = dot_general_joined(
                x, kernel, dims, meta, amax_reduction_axes=axes, **kwargs
            )
            self.put_variable(FP8_COLLECTION, _META_NAME, meta_out)
            return y
        return dot_general(x, kernel, dims, meta.with_reduction_axes(axes), **kwargs)


class Dense(_Fp8Layer):
    """FP8 drop-in for ``flax.linen.Dense``: ``y = x @ kernel + bias`` over the last axis.

    Attributes:
        features, use_bias, dtype, param_dtype, precision, kernel_init, bias_init: as
            ``flax.linen.Dense`` (``precision`` applies to GEMMs kept in high precision).
        recipe: DelayedScaling / Float8CurrentScaling, None for high precision, or left UNSET to
            take the :func:`fp8kit.jax.autocast` active at construction (or the state's recipe).
        amax_reduction_axes: mesh axes for the amax all-reduce under ``shard_map`` (None: every
            axis the amax varies over).
        fp8_output / fp8_grad: also pass the output / input gradient through FP8.
    """

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Any = _default_kernel_init
    bias_init: Any = nn.initializers.zeros_init()
    recipe: Any = UNSET
    amax_reduction_axes: Any = UNSET
    fp8_output: bool = False
    fp8_grad: bool = False

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """``inputs`` ``(..., in_features)`` -> ``(..., features)``."""
        kernel = self.param(
            "kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype
        )
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias
            else None
        )
        dims = (((inputs.ndim - 1,), (0,)), ((), ()))
        return self._gemm(inputs, kernel, bias, dims)


def _reshaped(value: Any, shape: tuple[int, ...]) -> Any:
    """``value`` reshaped to ``shape``, inside its box when an initializer wrapped with
    ``nn.with_partitioning`` (or other axis metadata) returned one, as Flax's DenseGeneral does."""
    if isinstance(value, meta.AxisMetadata):
        return meta.replace_boxed(value, jnp.reshape(value.unbox(), shape))
    return jnp.reshape(value, shape)


def _check_features(features: Any) -> None:
    """Raise unless ``features`` is an int >= 1 or a non-empty sequence of them."""
    sizes = features if isinstance(features, Sequence) and not isinstance(features, str) else None
    values = (features,) if sizes is None else tuple(sizes)
    message = (
        f"features must be an int >= 1 (Dense) or a non-empty sequence of them (DenseGeneral), "
        f"got {features!r}"
    )
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise TypeError(message)
    if not values or min(values) < 1:
        raise ValueError(message)


def _as_tuple(x: int | Sequence[int]) -> tuple[int, ...]:
    return tuple(x) if isinstance(x, Sequence) else (x,)


def _normalize_axes(name: str, axes: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    """``axes`` of an ``ndim``-dimensional input as sorted non-negative indices (as Flax's
    ``DenseGeneral``, so its parameters have Flax's shapes); out-of-range or repeated axes raise."""
    given = _as_tuple(axes)
    for a in given:
        if not -ndim <= a < ndim:
            raise ValueError(f"{name} {a} is out of range for an input of {ndim} dimensions")
    normalized = tuple(sorted(a % ndim for a in given))
    if len(set(normalized)) != len(normalized):
        raise ValueError(f"{name} {tuple(given)} names an axis twice")
    return normalized


class DenseGeneral(_Fp8Layer):
    """FP8 drop-in for ``flax.linen.DenseGeneral`` (flexible contracting and batch axes).

    Attributes:
        features: int or tuple of output feature sizes.
        axis: int or tuple of input axes contracted with the kernel.
        batch_dims: leading input axes that the kernel is batched over (consecutive from 0).
        use_bias, dtype, param_dtype, precision, kernel_init, bias_init: as in Flax.
        recipe, amax_reduction_axes, fp8_output, fp8_grad: as in :class:`Dense`.

    The kernel has shape ``batch_shape + contracted_shape + features`` and is initialised as a
    2-D ``(fan_in, fan_out)`` matrix then reshaped, like Flax's.
    """

    features: int | Sequence[int]
    axis: int | Sequence[int] = -1
    batch_dims: Sequence[int] = ()
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Any = _default_kernel_init
    bias_init: Any = nn.initializers.zeros_init()
    recipe: Any = UNSET
    amax_reduction_axes: Any = UNSET
    fp8_output: bool = False
    fp8_grad: bool = False

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Contract ``axis`` of ``inputs`` with the kernel; output = kept axes + features."""
        features = _as_tuple(self.features)
        ndim = inputs.ndim
        axis = _normalize_axes("axis", self.axis, ndim)
        batch_dims = _normalize_axes("batch_dims", self.batch_dims, ndim)
        if batch_dims and set(batch_dims) != set(range(max(batch_dims) + 1)):
            raise ValueError(
                f"batch_dims must be consecutive leading axes starting at 0, got {self.batch_dims}"
            )
        if set(axis) & set(batch_dims):
            raise ValueError(f"axis {self.axis} and batch_dims {self.batch_dims} overlap")
        n_batch, n_axis = len(batch_dims), len(axis)
        batch_shape = tuple(inputs.shape[b] for b in batch_dims)
        contracted = tuple(inputs.shape[a] for a in axis)

        def init_kernel(rng: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Any:
            fan_in = int(np.prod(shape[:n_batch])) * int(np.prod(contracted))
            flat = self.kernel_init(rng, (fan_in, int(np.prod(features))), dtype)
            return _reshaped(flat, shape)

        def init_bias(rng: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Any:
            flat = self.bias_init(rng, (int(np.prod(shape)),), dtype)
            return _reshaped(flat, shape)

        kernel = self.param(
            "kernel", init_kernel, batch_shape + contracted + features, self.param_dtype
        )
        bias = (
            self.param("bias", init_bias, batch_shape + features, self.param_dtype)
            if self.use_bias
            else None
        )
        kernel_batch = tuple(range(n_batch))
        kernel_contract = tuple(range(n_batch, n_batch + n_axis))
        dims = ((axis, kernel_contract), (batch_dims, kernel_batch))
        if bias is not None:
            # Output axes: batch dims, then the input's free axes, then features.
            kept = [d for d in range(ndim) if d not in axis]
            shape = tuple(inputs.shape[d] if d in batch_dims else 1 for d in kept) + features
            bias = jnp.reshape(bias, shape)
        return self._gemm(inputs, kernel, bias, dims)

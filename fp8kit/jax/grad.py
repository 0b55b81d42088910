"""``fp8kit.jax.value_and_grad``: loss, parameter gradients and FP8 observations, kept apart.

``jax.grad`` over a pytree that contains :class:`Fp8Meta` nodes returns, at those nodes, the
observations the FP8 GEMMs made (see :mod:`fp8kit.jax.dot`). This wrapper splits them off, so
the gradients handed to an optimizer contain no FP8 leaf at all: FP8 state never reaches optax,
gradient clipping, weight decay or a gradient norm.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fp8kit.jax.dot import chain_ends
from fp8kit.jax.meta import Fp8Meta, is_meta, observations_of

__all__ = [
    "check_grad_args",
    "split_grads",
    "tie_chain_ends",
    "tie_to_loss",
    "value_and_grad",
    "with_chain_ends",
]


def _drop_empty(tree: Any) -> Any:
    """Remove dict entries that hold nothing (None or empty mappings), recursively."""
    if isinstance(tree, Mapping) and not hasattr(tree, "_fields"):
        kept = {}
        for key, value in tree.items():
            value = _drop_empty(value)
            if value is None or (isinstance(value, Mapping) and len(value) == 0):
                continue
            kept[key] = value
        if isinstance(tree, dict):
            return kept
        try:
            return type(tree)(kept)  # FrozenDict and friends
        except TypeError:
            return kept
    return tree


def split_grads(grads: Any) -> tuple[Any, Any]:
    """Split a gradient pytree into (parameter gradients, observations).

    Every :class:`Fp8Meta` cotangent becomes an :class:`fp8kit.jax.Observations` in the second
    tree and disappears from the first (dict entries left empty are removed, other containers
    keep a None). Both trees keep the paths of the original, so ``update(variables, obs)`` and
    ``optax`` on ``grads["params"]`` line up.
    """
    params = jax.tree_util.tree_map(
        lambda x: None if isinstance(x, Fp8Meta) else x, grads, is_leaf=is_meta
    )
    obs = jax.tree_util.tree_map(
        lambda x: observations_of(x) if isinstance(x, Fp8Meta) else None, grads, is_leaf=is_meta
    )
    return _drop_empty(params), _drop_empty(obs)


def check_grad_args(fun: Any, argnums: Any, has_aux: Any) -> tuple[int, ...]:
    """Check the arguments of a ``value_and_grad`` at the call, as ``jax.value_and_grad`` does;
    returns ``argnums`` as a tuple of positions. Clear errors for a ``fun`` that is not callable,
    an ``argnums`` other than an int or ints, and a ``has_aux`` other than a bool."""
    if not callable(fun):
        raise TypeError(f"fun must be a callable (the loss function), got {fun!r}")
    nums = (argnums,) if isinstance(argnums, int) else argnums
    if (
        not isinstance(nums, Sequence)
        or isinstance(nums, str)
        or not nums
        or any(isinstance(n, bool) or not isinstance(n, int) for n in nums)
    ):
        raise TypeError(
            f"argnums must be an int or a non-empty sequence of ints (argument positions), "
            f"got {argnums!r}"
        )
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be a bool, got {has_aux!r}")
    return tuple(nums)


@jax.custom_vjp
def with_chain_ends(loss: jax.Array, ends: list[Any]) -> jax.Array:
    """``loss`` itself, made to depend on the chain ends ``ends`` for differentiation only: their
    cotangent is zeros (never a symbolic zero), so the backward rule of each chain's last call
    runs, and reports its forward amaxes, even when that call's output reaches the loss through
    ``stop_gradient`` only, or the aux output (docs/decisions/0264)."""
    return loss


def _with_chain_ends_fwd(loss: jax.Array, ends: list[Fp8Meta]) -> tuple[jax.Array, Any]:
    return loss, ends


def _with_chain_ends_bwd(ends: list[Fp8Meta], g: jax.Array) -> tuple[jax.Array, Any]:
    return g, jax.tree_util.tree_map(jnp.zeros_like, ends)


with_chain_ends.defvjp(_with_chain_ends_fwd, _with_chain_ends_bwd)


def tie_to_loss(loss: Any, outputs: Any) -> Any:
    """``loss`` itself, made to depend on ``outputs`` for differentiation only.

    ``outputs`` get a cotangent of zeros (never a symbolic zero), so the FP8 calls that made them
    run their backward rules and report their forward amaxes, even when nothing else of theirs
    reaches the loss. :func:`value_and_grad` does this by itself for calls traced in the loss
    function; tie what a Flax Linen lifted transform (``nn.scan``, ``nn.remat``, ``nn.jit``,
    ``jax.checkpoint`` around ``apply``) computes out of its sight: the ``"fp8_meta"``
    collection an ``apply(..., mutable=["fp8_meta"])`` returns, or a teacher pass's output
    (docs/jax.md, "Reuse, scan, remat, microbatches"). Gradients are unchanged.

    Args:
        loss: the scalar loss, a floating-point array of shape ``()``.
        outputs: a pytree of floating-point arrays and :class:`Fp8Meta`.

    Returns:
        ``loss``, with the same value.
    """
    if not isinstance(loss, jax.Array) or loss.shape != () or not _inexact(loss):
        raise TypeError(
            f"loss must be a scalar floating-point JAX array (the loss), got {_describe(loss)}"
        )
    leaves = jax.tree_util.tree_leaves(outputs, is_leaf=is_meta)
    if not leaves:
        raise ValueError("outputs holds no array: pass the outputs or the collection to tie")
    for leaf in leaves:
        if not isinstance(leaf, Fp8Meta) and not (isinstance(leaf, jax.Array) and _inexact(leaf)):
            raise TypeError(
                "outputs must hold floating-point JAX arrays and Fp8Meta only (what has a "
                f"gradient), got {_describe(leaf)}"
            )
    return with_chain_ends(loss, leaves)


def _inexact(x: jax.Array) -> bool:
    return bool(jnp.issubdtype(x.dtype, jnp.inexact))


def _describe(x: Any) -> str:
    if isinstance(x, jax.Array):
        return f"an array of dtype {x.dtype} and shape {x.shape}"
    return repr(x) if len(repr(x)) < 80 else f"a {type(x).__name__}"


def tie_chain_ends(result: Any, ends: list[Fp8Meta], has_aux: bool) -> Any:
    """The loss function's ``result`` (``loss`` or ``(loss, aux)``) with the loss tied to the
    chain ends ``ends`` (:func:`with_chain_ends`; unchanged when there are none)."""
    if not ends:
        return result
    if has_aux:
        loss, aux = result
        return with_chain_ends(loss, ends), aux
    return with_chain_ends(result, ends)


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any, Any]]:
    """Like ``jax.value_and_grad``, returning ``(value, grads, observations)``.

    Args:
        fun: the loss; the arguments in ``argnums`` may contain FP8 meta anywhere (e.g. a Flax
            variable dict with an ``"fp8_meta"`` collection, or a ``(params, meta)`` tuple).
        argnums, has_aux: as for ``jax.value_and_grad``.

    Returns:
        A function returning ``(value, grads, observations)``: ``value`` is ``loss`` or
        ``(loss, aux)``; ``grads`` has no FP8 leaves; ``observations`` mirrors the differentiated
        arguments with an ``Observations`` at every meta, ready for :func:`fp8kit.jax.update`.
    """
    nums = check_grad_args(fun, argnums, has_aux)

    @functools.wraps(fun)
    def observed(*args: Any, **kwargs: Any) -> Any:
        result = fun(*args, **kwargs)
        metas = [
            leaf
            for i in nums
            for leaf in jax.tree_util.tree_leaves(args[i], is_leaf=is_meta)
            if isinstance(leaf, Fp8Meta)
        ]
        return tie_chain_ends(result, chain_ends(metas), has_aux)

    inner = jax.value_and_grad(observed, argnums=argnums, has_aux=has_aux)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
        value, grads = inner(*args, **kwargs)
        params, obs = split_grads(grads)
        return value, params, obs

    return wrapped

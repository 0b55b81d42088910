"""FP8 meta: the per-module delayed-scaling state as a plain pytree (docs/semantics.md sections 3
and 6).

:class:`Fp8Meta` holds a forward and a backward :class:`ScalingState` (float32 arrays, the same
``(L, n)`` layout as ``fp8kit.torch``) and a float32 ``step`` counter. Its recipe and amax
reduction axes are *static* pytree metadata: they are part of every ``jax.jit`` cache key, and a
module always runs with the recipe its state was created with.

:class:`Observations` is what one training step saw: the current amax of every slot (combined
with max over every call of the module) and ``chains``, the number of independent observation
chains that reached this meta (1 when everything is right; see ``fp8kit.jax.dot``).

The cotangent JAX computes for an :class:`Fp8Meta` *is* an observation: its history row 0 (the
staging row) holds the amaxes and its ``step`` holds the chain count. fp8kit never hands it to an
optimizer: :func:`fp8kit.jax.value_and_grad` splits it off, and :func:`fp8kit.jax.update`
consumes it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8kit.jax.scaling import COUNT_WRAP_LIMIT
from fp8kit.recipe import (
    DelayedScaling,
    Float8CurrentScaling,
    Recipe,
    recipe_from_dict,
    require_int,
)
from fp8kit.slots import BwdSlot, FwdSlot, bwd_slot, fwd_slot
from fp8kit.unset import UNSET

__all__ = [
    "STEP_WRAP",
    "BwdSlot",
    "Fp8Meta",
    "FwdSlot",
    "Observations",
    "ScalingState",
    "bwd_slot",
    "check_meta_dtypes",
    "check_recipe",
    "fwd_slot",
    "init_meta",
    "is_meta",
    "no_meta_error",
    "observations_of",
    "resize_history",
    "with_recipe",
    "zero_observations",
]

STEP_WRAP = 2**24
"""``Fp8Meta.step`` counts update events modulo 2**24 (float32 is exact below that)."""


def check_recipe(recipe: Any, name: str = "recipe") -> Recipe:
    """Return ``recipe`` if it is a DelayedScaling or Float8CurrentScaling, else raise."""
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError(
            f"{name} must be an fp8kit DelayedScaling or Float8CurrentScaling, "
            f"got {type(recipe).__name__}"
        )
    if isinstance(recipe, DelayedScaling) and recipe.interval > COUNT_WRAP_LIMIT // 2:
        raise ValueError(
            f"{name}.interval must be <= {COUNT_WRAP_LIMIT // 2} in fp8kit.jax (float32 event "
            f"counts), got {recipe.interval}"
        )
    return recipe


def _history_len(recipe: Recipe) -> int:
    return recipe.amax_history_len if isinstance(recipe, DelayedScaling) else 1


def _check_axes(axes: Any) -> tuple[str, ...] | None:
    if axes is None:
        return None
    if isinstance(axes, str):
        return (axes,)
    if not isinstance(axes, (tuple, list)) or not all(isinstance(a, str) for a in axes):
        raise TypeError(
            f"amax_reduction_axes must be None (every mesh axis the amax varies over) or a tuple "
            f"of mesh axis names, got {axes!r}"
        )
    return tuple(axes)


@jax.tree_util.register_dataclass
@dataclass(frozen=True, eq=False)
class ScalingState:
    """Delayed-scaling state of one direction of one module (leading axes allowed, e.g. scan).

    Attributes:
        amax_history: float32 ``(..., L, n)``; row 0 is the staging row, rows 1..L-1 the
            completed history, oldest first.
        scale: float32 ``(..., n)``, the factor applied before casting to FP8.
        update_count: float32 ``(..., n)``, non-skipped update events per slot (wrapped).
    """

    amax_history: jax.Array
    scale: jax.Array
    update_count: jax.Array

    @property
    def num_slots(self) -> int:
        return int(self.scale.shape[-1])

    @property
    def history_len(self) -> int:
        return int(self.amax_history.shape[-2])


@jax.tree_util.register_dataclass
@dataclass(frozen=True, eq=False)
class Fp8Meta:
    """FP8 state of one module with ``num_gemms`` GEMMs (a pytree of float32 arrays).

    Attributes:
        forward: ``3 * num_gemms`` slots (:class:`FwdSlot`): INPUT, WEIGHT, OUTPUT per GEMM.
        backward: ``2 * num_gemms`` slots (:class:`BwdSlot`): GRAD_OUTPUT, GRAD_INPUT per GEMM.
        step: float32 ``(...)``, update events applied so far (modulo :data:`STEP_WRAP`), so a
            training loop that drops the returned state is detectable (:func:`check_step`).
        recipe: static; the recipe this state belongs to.
        amax_reduction_axes: static; mesh axes over which amaxes are all-reduced (MAX) under
            ``shard_map``; None = every axis the amax varies over.

    Equality is identity (``eq=False``): compare leaves, not metas.
    """

    forward: ScalingState
    backward: ScalingState
    step: jax.Array
    recipe: Recipe = field(metadata={"static": True}, default=DelayedScaling())
    amax_reduction_axes: tuple[str, ...] | None = field(metadata={"static": True}, default=None)

    @property
    def num_gemms(self) -> int:
        return self.forward.num_slots // 3

    @property
    def history_len(self) -> int:
        return self.forward.history_len

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """Leading axes (e.g. the layer axis of a scanned stack); () for one module."""
        return tuple(self.step.shape)

    def with_reduction_axes(self, axes: Any) -> Fp8Meta:
        """This meta reducing over ``axes`` (a layer's field; UNSET: its own), itself when they
        are the same. The axes are configuration, not state (docs/jax.md, "Distribution")."""
        if axes is UNSET or axes == self.amax_reduction_axes:
            return self
        return replace(self, amax_reduction_axes=axes)


def is_meta(x: Any) -> bool:
    return isinstance(x, Fp8Meta)


def check_meta_dtypes(meta: Fp8Meta, where: str = "meta") -> None:
    """Raise a TypeError unless every array of ``meta`` is float32.

    A cast of the whole variable tree (``jax.tree.map(lambda a: a.astype(jnp.bfloat16), v)``)
    would round scales and histories and stop ``step`` at 256 (bfloat16 counts no further)."""
    for name, leaf in (
        ("forward.amax_history", meta.forward.amax_history),
        ("forward.scale", meta.forward.scale),
        ("forward.update_count", meta.forward.update_count),
        ("backward.amax_history", meta.backward.amax_history),
        ("backward.scale", meta.backward.scale),
        ("backward.update_count", meta.backward.update_count),
        ("step", meta.step),
    ):
        dtype = getattr(leaf, "dtype", None)
        if dtype != jnp.float32:
            raise TypeError(
                f"{where}.{name} must be float32 (FP8 state keeps float32 whatever the model's "
                f"dtype: cast only the params), got {dtype}"
            )


def init_meta(
    num_gemms: int = 1,
    recipe: Recipe | None = None,
    *,
    amax_reduction_axes: tuple[str, ...] | None = None,
) -> Fp8Meta:
    """Fresh state: histories 0, scales 1, counts 0, step 0.

    Args:
        num_gemms: GEMMs of the module (a Dense has 1).
        recipe: DelayedScaling (default ``DelayedScaling()``) or Float8CurrentScaling (history
            length 1, never updated).
        amax_reduction_axes: see :class:`Fp8Meta`.
    """
    require_int("num_gemms", num_gemms, 1)
    recipe = check_recipe(DelayedScaling() if recipe is None else recipe)
    length = _history_len(recipe)

    # Built in numpy and transferred: no XLA computation per new shape.
    def state(n: int) -> ScalingState:
        return ScalingState(
            amax_history=jnp.asarray(np.zeros((length, n), np.float32)),
            scale=jnp.asarray(np.ones((n,), np.float32)),
            update_count=jnp.asarray(np.zeros((n,), np.float32)),
        )

    return Fp8Meta(
        forward=state(3 * num_gemms),
        backward=state(2 * num_gemms),
        step=jnp.asarray(np.float32(0)),
        recipe=recipe,
        amax_reduction_axes=_check_axes(amax_reduction_axes),
    )


@jax.tree_util.register_dataclass
@dataclass(frozen=True, eq=False)
class Observations:
    """What one step saw for one module (leading axes as in its :class:`Fp8Meta`).

    Attributes:
        forward: float32 ``(..., 3 * num_gemms)`` current amaxes (0 = slot did not run).
        backward: float32 ``(..., 2 * num_gemms)``.
        chains: float32 ``(...)``; 1 if the amaxes were combined with max, 0 if the module did
            not run, > 1 if JAX summed several observation chains (an error, see ``update``).
    """

    forward: jax.Array
    backward: jax.Array
    chains: jax.Array


def is_observation(x: Any) -> bool:
    return isinstance(x, (Observations, Fp8Meta))


def observations_of(x: Observations | Fp8Meta) -> Observations:
    """An :class:`Observations` from itself or from the cotangent of an :class:`Fp8Meta`."""
    if isinstance(x, Observations):
        return x
    if isinstance(x, Fp8Meta):
        return Observations(
            forward=x.forward.amax_history[..., 0, :],
            backward=x.backward.amax_history[..., 0, :],
            chains=x.step,
        )
    raise TypeError(f"expected Observations or an Fp8Meta cotangent, got {type(x).__name__}")


def zero_observations(meta: Fp8Meta) -> Observations:
    """Observations of a module that did not run (all zero) with ``meta``'s shapes."""
    if not isinstance(meta, Fp8Meta):
        raise TypeError(f"meta must be an Fp8Meta, got {type(meta).__name__}")
    return Observations(
        forward=jnp.zeros(meta.forward.scale.shape, jnp.float32),
        backward=jnp.zeros(meta.backward.scale.shape, jnp.float32),
        chains=jnp.zeros(meta.step.shape, jnp.float32),
    )


def resize_history(history: jax.Array, length: int) -> jax.Array:
    """``history`` ``(..., L, n)`` resized to ``length`` rows, keeping the staging row 0.

    Shrinking keeps the newest completed entries; growing pads zeros on the older side.
    """
    old = history.shape[-2]
    if length == old:
        return history
    keep = min(old, length) - 1
    lead = history.shape[:-2]
    pad = jnp.zeros((*lead, length - 1 - keep, history.shape[-1]), history.dtype)
    parts = [history[..., :1, :], pad]
    if keep > 0:
        parts.append(history[..., old - keep :, :])
    return jnp.concatenate(parts, axis=-2)


def _is_pristine(meta: Fp8Meta) -> bool:
    leaves = (meta.forward.amax_history, meta.backward.amax_history, meta.step)
    try:
        return not any(bool(np.any(np.asarray(x))) for x in leaves)
    except jax.errors.TracerArrayConversionError:
        return False


def with_recipe(meta_tree: Any, recipe: Recipe) -> Any:
    """Every :class:`Fp8Meta` in ``meta_tree`` re-labelled with ``recipe``.

    The histories are resized to the recipe's ``amax_history_len`` (a warning says so unless the
    state is still untouched); scales and counts are kept.
    """
    recipe = check_recipe(recipe)
    length = _history_len(recipe)

    def convert(meta: Any) -> Any:
        if not isinstance(meta, Fp8Meta):
            return meta
        if meta.history_len != length and not _is_pristine(meta):
            how = (
                "the oldest entries are dropped"
                if length < meta.history_len
                else "zeros are padded on the older side"
            )
            warnings.warn(
                f"fp8kit: resizing an amax history from {meta.history_len} to {length} "
                f"entries ({how})",
                stacklevel=3,
            )
        fwd = replace(meta.forward, amax_history=resize_history(meta.forward.amax_history, length))
        bwd = replace(
            meta.backward, amax_history=resize_history(meta.backward.amax_history, length)
        )
        return replace(meta, forward=fwd, backward=bwd, recipe=recipe)

    if not any(
        isinstance(x, Fp8Meta) for x in jax.tree_util.tree_leaves(meta_tree, is_leaf=is_meta)
    ):
        raise no_meta_error("with_recipe", "meta_tree")
    return jax.tree_util.tree_map(convert, meta_tree, is_leaf=is_meta)


def no_meta_error(caller: str, argument: str, consequence: str = "") -> ValueError:
    """The error of a call given a tree without any :class:`Fp8Meta`, where it would do nothing
    (most often ``variables["params"]`` instead of the whole variable dict)."""
    return ValueError(
        f"{caller} found no Fp8Meta in {argument}{consequence}: pass the tree that holds the FP8 "
        "state (e.g. the whole Flax variable dict, with its 'fp8_meta' collection, not "
        "variables['params'])"
    )


# --- checkpoints -------------------------------------------------------------------------------
# Orbax and other array checkpointers see the leaves only (the recipe is static metadata).
# flax.serialization (msgpack) additionally stores the recipe as JSON-compatible data (never
# pickle), and on restore adopts the target's recipe, resizing a history of another length.


def _state_dict(meta: Fp8Meta) -> dict[str, Any]:
    def direction(s: ScalingState) -> dict[str, Any]:
        return {"amax_history": s.amax_history, "scale": s.scale, "update_count": s.update_count}

    return {
        "forward": direction(meta.forward),
        "backward": direction(meta.backward),
        "step": meta.step,
        "recipe": meta.recipe.to_dict(),
    }


def _from_state_dict(target: Fp8Meta, state: dict[str, Any]) -> Fp8Meta:
    if not isinstance(state, dict) or not {"forward", "backward", "step"} <= set(state):
        raise ValueError(
            f"fp8kit: an Fp8Meta checkpoint needs 'forward', 'backward' and 'step', "
            f"got {sorted(state) if isinstance(state, dict) else type(state).__name__}"
        )
    saved = state.get("recipe")
    if isinstance(saved, dict):
        try:
            saved_recipe = recipe_from_dict(saved)
        except (TypeError, ValueError):
            saved_recipe = None
        if saved_recipe is not None and saved_recipe != target.recipe:
            warnings.warn(
                f"fp8kit: restoring FP8 state saved under {saved_recipe} into a model whose "
                f"recipe is {target.recipe}; the model's recipe is kept",
                stacklevel=2,
            )

    def direction(t: ScalingState, s: dict[str, Any]) -> ScalingState:
        hist = jnp.asarray(s["amax_history"], jnp.float32)
        if hist.shape[-1] != t.num_slots:
            raise ValueError(
                f"fp8kit: checkpoint amax_history has {hist.shape[-1]} slots, the model "
                f"{t.num_slots}"
            )
        if hist.shape[-2] != t.history_len:
            warnings.warn(
                f"fp8kit: checkpoint amax history has {hist.shape[-2]} entries, the recipe "
                f"{t.history_len}; resizing",
                stacklevel=3,
            )
            hist = resize_history(hist, t.history_len)
        scale = jnp.asarray(s["scale"], jnp.float32)
        count = jnp.asarray(s["update_count"], jnp.float32)
        for name, value, like in (
            ("scale", scale, t.scale),
            ("update_count", count, t.update_count),
        ):
            if value.shape != like.shape:
                raise ValueError(
                    f"fp8kit: checkpoint {name} has shape {tuple(value.shape)}, the model "
                    f"{tuple(like.shape)}"
                )
        return ScalingState(amax_history=hist, scale=scale, update_count=count)

    return replace(
        target,
        forward=direction(target.forward, state["forward"]),
        backward=direction(target.backward, state["backward"]),
        step=jnp.asarray(state["step"], jnp.float32),
    )


try:  # flax is part of the `jax` extra, but the functional core does not need it
    from flax import serialization as _serialization
except ImportError:  # pragma: no cover
    pass
else:
    _serialization.register_serialization_state(
        Fp8Meta, _state_dict, _from_state_dict, override=True
    )

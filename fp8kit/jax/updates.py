"""Applying observations to FP8 meta: :func:`update`, :func:`stage`, :func:`combine_observations`.

``update(meta, observations)`` is one update event of docs/semantics.md section 3 for every
:class:`Fp8Meta` in a pytree (a Flax variable dict, a tuple ``(params, meta)``, a stacked scan of
layers...). All metas of one (recipe, direction) are concatenated into a single ``(L, N)`` buffer
and updated by one call of the rule, so the traced program has a fixed number of ops whatever the
model size, and a callable ``amax_compute_algo`` sees the whole state at once, as in
``fp8kit.torch``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8kit.jax.meta import (
    STEP_WRAP,
    Fp8Meta,
    Observations,
    ScalingState,
    check_meta_dtypes,
    check_recipe,
    is_meta,
    is_observation,
    no_meta_error,
    observations_of,
)
from fp8kit.jax.scaling import update_scaling_state
from fp8kit.recipe import DelayedScaling

__all__ = ["SummedObservationsError", "check_step", "combine_observations", "stage", "update"]


class SummedObservationsError(ValueError):
    """Raised when observations are not amaxes: JAX summed several observation chains of one
    meta instead of taking the max, or a gradient transformation scaled them; also when a meta's
    ``step`` shows that something other than :func:`update` changed it (an optimizer)."""


_SUMMED_HELP = (
    "fp8kit: the observations of {where} were summed by JAX over {n} independent uses of the same "
    "FP8 meta, so they are not amaxes. This happens when one meta reaches the loss by separate "
    "paths that fp8kit cannot chain: summing per-microbatch gradients that include the meta "
    "cotangent (combine them with fp8kit.jax.combine_observations instead), jax.lax.scan / vmap "
    "closing over one meta (give each iteration its own meta, or carry it through the scan with "
    "dot_general_chained), one meta used inside and outside one jax.checkpoint region, or a "
    "Flax Linen layer inside a lifted transform (nn.scan, nn.remat, nn.jit) that runs more than "
    "once in the step: called twice, or the model applied twice (make every call in one "
    "apply(..., mutable=['fp8_meta']) and tie the collection it returns to the loss with "
    "fp8kit.jax.tie_to_loss; docs/jax.md, 'Reuse, scan, remat, microbatches')."
)


_SCALED_HELP = (
    "fp8kit: the observations of {where} were scaled (their chain count is not a whole number), "
    "so they are not amaxes. This happens when the FP8 meta cotangent went through a gradient "
    "transformation: dividing summed microbatch gradients by their number, gradient clipping or "
    "any scaling of the whole gradient tree. Split the observations off before transforming the "
    "gradients (fp8kit.jax.value_and_grad or fp8kit.jax.split_grads), and combine microbatches "
    "with fp8kit.jax.combine_observations."
)

_STEPPED_HELP = (
    "fp8kit: the FP8 meta at {where} has a step that is not a whole number, so something other "
    "than fp8kit.jax.update changed it: most often an optimizer given the whole variable dict "
    "(e.g. flax.training.train_state.TrainState.create(params=variables)) or the raw gradients of "
    "it. Give the optimizer variables['params'] only, and the observations to fp8kit.jax.update "
    "(fp8kit.jax.value_and_grad splits them off)."
)


def _path_str(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def _match(
    meta_tree: Any, observations: Any, caller: str
) -> tuple[list[Any], Any, list[Observations | None]]:
    """Flatten ``meta_tree`` down to its metas and pair each with its observation by path.

    A tree without any Fp8Meta and no observations raises: the call would do nothing, which is
    the mistake of passing ``variables["params"]`` (a model without FP8 layers gets observations
    without any entry from :func:`fp8kit.jax.value_and_grad`, and passes).
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(meta_tree, is_leaf=is_meta)
    metas = [(p, x) for p, x in flat if isinstance(x, Fp8Meta)]
    if not metas and observations is None:
        raise no_meta_error(
            caller, "its first argument", " and got no observations, so it would do nothing"
        )
    for path, meta in metas:
        check_meta_dtypes(meta, f"meta{_path_str(path)}")
    obs_list: list[Observations | None] = []
    if observations is None:
        return flat, treedef, [None] * len(metas)
    obs_flat = jax.tree_util.tree_flatten_with_path(observations, is_leaf=is_observation)[0]
    by_path = {p: observations_of(o) for p, o in obs_flat if is_observation(o)}
    missing = [_path_str(p) for p, _ in metas if p not in by_path]
    extra = sorted(set(map(_path_str, by_path)) - {_path_str(p) for p, _ in metas})
    if missing or extra:
        raise ValueError(
            "observations must have one entry at the path of every Fp8Meta in meta "
            f"(missing: {missing or 'none'}; without a meta: {extra or 'none'}); pass the same "
            "tree (e.g. the variables) that the observations were computed for"
        )
    for path, meta in metas:
        obs = by_path[path]
        for name, got, want in (
            ("forward", obs.forward.shape, meta.forward.scale.shape),
            ("backward", obs.backward.shape, meta.backward.scale.shape),
            ("chains", obs.chains.shape, meta.step.shape),
        ):
            if tuple(got) != tuple(want):
                raise ValueError(
                    f"observations{_path_str(path)}.{name} has shape {tuple(got)}, its meta "
                    f"needs {tuple(want)}"
                )
        obs_list.append(obs)
    return flat, treedef, obs_list


def _clean(amax: jax.Array) -> jax.Array:
    """Observed amaxes as float32 with NaN (never a valid amax) treated as 'did not run'."""
    amax = jnp.asarray(amax, jnp.float32)
    return jnp.where(jnp.isnan(amax), 0.0, amax)


def _staged(state: ScalingState, amax: jax.Array | None) -> jax.Array:
    hist = state.amax_history
    if amax is None:
        return hist
    row0 = jnp.maximum(hist[..., :1, :], _clean(amax)[..., None, :])
    return jnp.concatenate([row0, hist[..., 1:, :]], axis=-2)


def stage(meta_tree: Any, observations: Any, *, check_chains: bool = True) -> Any:
    """Fold observations into the staging rows (``H[0] = max(H[0], amax)``) without an event.

    Several stages followed by one :func:`update` leave the maximum (docs/semantics.md section 3).
    ``check_chains`` refuses observations that JAX summed, as :func:`update` does.
    """
    flat, treedef, obs_list = _match(meta_tree, observations, "stage")
    if check_chains:
        _check_chains([_path_str(p) for p, x in flat if isinstance(x, Fp8Meta)], obs_list)
    it = iter(obs_list)
    out = []
    for _, x in flat:
        if isinstance(x, Fp8Meta):
            obs = next(it)
            if obs is None:
                raise ValueError(
                    "stage needs the observations of every Fp8Meta in meta_tree (from "
                    "f8.value_and_grad or f8.observations_of), got None"
                )
            x = replace(
                x,
                forward=replace(x.forward, amax_history=_staged(x.forward, obs.forward)),
                backward=replace(x.backward, amax_history=_staged(x.backward, obs.backward)),
            )
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


def _concrete(x: jax.Array) -> np.ndarray | None:
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _raise_bad_chains(worst: Any, other: Any, stepped: Any, where: str) -> None:
    """Raise for a meta whose ``step`` is not a whole number (``stepped``), for chain counts
    that are not whole numbers >= 0 (``other``: scaled observations) or above 1 (``worst``, the
    largest: summed ones)."""
    if bool(np.asarray(stepped)):
        raise SummedObservationsError(_STEPPED_HELP.format(where=where))
    n = float(np.asarray(worst))
    if bool(np.asarray(other)):
        raise SummedObservationsError(_SCALED_HELP.format(where=where))
    if n > 1:
        raise SummedObservationsError(_SUMMED_HELP.format(where=where, n=int(n)))


def _chain_faults(chains: Any) -> tuple[Any, Any]:
    """``(largest count, whether any count is not a whole number >= 0)`` of one meta's chain
    counts (numpy or traced)."""
    flat = jnp.ravel(chains) if isinstance(chains, jax.Array) else np.ravel(chains)
    lib = jnp if isinstance(flat, jax.Array) else np
    worst = lib.max(flat, initial=0.0)
    other = lib.any(~((flat >= 0) & (flat == lib.round(flat))))
    return worst, other


def _check_chains(
    paths: list[str], obs_list: list[Observations | None], metas: list[Fp8Meta] | None = None
) -> None:
    """Refuse chain counts other than 0 and 1 (summed or scaled observations) and, with
    ``metas``, a meta whose ``step`` is not a whole number (changed by an optimizer). Concrete
    values raise here; under ``jax.jit`` one ``lax.cond`` raises from a host callback, only
    when something is wrong (docs/jax.md, "Lowering")."""
    pairs = [(p, o.chains) for p, o in zip(paths, obs_list, strict=True) if o is not None]
    steps = [] if metas is None else [(p, m.step) for p, m in zip(paths, metas, strict=True)]
    if not pairs and not steps:
        return
    values = [_concrete(v) for _, v in pairs + steps]
    if all(v is not None for v in values):
        for (path, _), chains in zip(pairs, values, strict=False):
            worst, other = _chain_faults(chains)
            _raise_bad_chains(worst, other, False, path)
        for (path, _), step in zip(steps, values[len(pairs) :], strict=True):
            if not np.all(step == np.round(step)):
                _raise_bad_chains(0.0, False, True, path)
        return
    # Traced (under jit): report from the host only when something is wrong.
    faults = [_chain_faults(c) for _, c in pairs] or [(jnp.float32(0), jnp.bool_(False))]
    worst = jnp.max(jnp.stack([jnp.asarray(w, jnp.float32) for w, _ in faults]))
    other = jnp.any(jnp.stack([jnp.asarray(o) for _, o in faults]))
    stepped = jnp.bool_(False)
    for _, step in steps:
        stepped = stepped | jnp.any(step != jnp.round(step))
    named = {p for p, _ in pairs} | {p for p, _ in steps}
    where = "a module in this update" if len(named) > 1 else next(iter(named))
    jax.lax.cond(
        (worst > 1) | other | stepped,
        lambda w, o, s: jax.debug.callback(_raise_bad_chains, w, o, s, where),
        lambda w, o, s: None,
        worst,
        other,
        stepped,
    )


def _batched_event(
    states: list[ScalingState],
    staged: list[jax.Array],
    recipe: DelayedScaling,
    fmax: np.ndarray,
) -> list[ScalingState]:
    """One event for many states of one recipe, as one ``(L, N)`` buffer (``fmax`` per column)."""
    length = staged[0].shape[-2]
    cols = [jnp.moveaxis(h, -2, 0).reshape(length, -1) for h in staged]
    sizes = [c.shape[1] for c in cols]
    hist, scale, count = update_scaling_state(
        jnp.concatenate(cols, axis=1),
        jnp.concatenate([s.scale.reshape(-1) for s in states]),
        jnp.concatenate([s.update_count.reshape(-1) for s in states]),
        recipe,
        fmax,
    )
    out = []
    start = 0
    for state, h_old, size in zip(states, staged, sizes, strict=True):
        stop = start + size
        lead_n = h_old.shape[:-2] + h_old.shape[-1:]
        h = jnp.moveaxis(hist[:, start:stop].reshape(length, *lead_n), 0, -2)
        out.append(
            ScalingState(
                amax_history=h,
                scale=scale[start:stop].reshape(state.scale.shape),
                update_count=count[start:stop].reshape(state.update_count.shape),
            )
        )
        start = stop
    return out


def update(
    meta: Any, observations: Any = None, recipe: Any = None, *, check_chains: bool = True
) -> Any:
    """One delayed-scaling update event for every :class:`Fp8Meta` in ``meta`` (pure).

    Args:
        meta: a pytree containing Fp8Meta nodes (other leaves, e.g. params, pass through).
        observations: a pytree with an :class:`Observations` (or the raw Fp8Meta cotangent from
            ``jax.grad``) at the path of every meta, e.g. the third result of
            :func:`fp8kit.jax.value_and_grad` or the plain ``grads`` of ``jax.value_and_grad``
            taken over the whole variable dict. None: only what was staged before.
        recipe: optional; if given it must equal every meta's recipe (use
            :func:`fp8kit.jax.with_recipe` to change the recipe of existing state).
        check_chains: refuse observations that JAX summed or that a gradient transformation
            scaled, and metas whose ``step`` an optimizer changed (see
            :class:`SummedObservationsError`; under ``jax.jit`` the error is raised from a host
            callback when the step runs).

    Returns:
        ``meta`` with every Fp8Meta advanced by one event (staging cleared, histories rolled where
        a slot ran, scales recomputed per the recipe, ``step + 1``).
    """
    if not isinstance(check_chains, bool):
        raise TypeError(f"check_chains must be a bool, got {check_chains!r}")
    flat, treedef, obs_list = _match(meta, observations, "update")
    metas = [(p, x) for p, x in flat if isinstance(x, Fp8Meta)]
    if recipe is not None:
        check_recipe(recipe)
        for path, m in metas:
            if m.recipe != recipe:
                raise ValueError(
                    f"recipe {recipe} differs from the recipe of the meta at "
                    f"{_path_str(path)} ({m.recipe}); convert the state with "
                    "fp8kit.jax.with_recipe(meta, recipe) first"
                )
    for path, m in metas:
        for state in (m.forward, m.backward):
            if isinstance(m.recipe, DelayedScaling) and (
                state.history_len != m.recipe.amax_history_len
            ):
                raise ValueError(
                    f"the meta at {_path_str(path)} has amax history length "
                    f"{state.history_len} but its recipe amax_history_len="
                    f"{m.recipe.amax_history_len}; use fp8kit.jax.with_recipe to resize"
                )
    if check_chains:
        _check_chains([_path_str(p) for p, _ in metas], obs_list, [m for _, m in metas])

    new_metas = iter(_events([m for _, m in metas], obs_list))
    out = [next(new_metas) if isinstance(x, Fp8Meta) else x for _, x in flat]
    return jax.tree_util.tree_unflatten(treedef, out)


def _group_key(recipe: DelayedScaling, direction: str) -> tuple[Any, str]:
    """States sharing a key are updated as one buffer.

    With built-in algorithms both directions share a buffer (each column carries its format's
    fmax). A user callable sees exactly one direction's states, as in fp8kit.torch.
    """
    builtin = isinstance(recipe.amax_compute_algo, str) and (
        recipe.scaling_factor_compute_algo is None
    )
    return (recipe, "both" if builtin else direction)


@jax.jit
def _events(metas: list[Fp8Meta], obs_list: list[Observations | None]) -> list[Fp8Meta]:
    """One event for every meta; the states of a group (see :func:`_group_key`) as one."""
    groups: dict[tuple[Any, str], list[tuple[int, str]]] = {}
    staged: dict[tuple[int, str], jax.Array] = {}
    for i, (m, obs) in enumerate(zip(metas, obs_list, strict=True)):
        for direction in ("forward", "backward"):
            state: ScalingState = getattr(m, direction)
            staged[i, direction] = _staged(state, None if obs is None else getattr(obs, direction))
            if isinstance(m.recipe, DelayedScaling):
                groups.setdefault(_group_key(m.recipe, direction), []).append((i, direction))

    new_states: dict[tuple[int, str], ScalingState] = {}
    for (rec, _), members in groups.items():
        states = [getattr(metas[i], d) for i, d in members]
        fmax = np.concatenate(
            [
                np.full(
                    s.amax_history[..., 0, :].size,
                    rec.fp8_format.forward.max if d == "forward" else rec.fp8_format.backward.max,
                )
                for s, (_, d) in zip(states, members, strict=True)
            ]
        )
        results = _batched_event(states, [staged[k] for k in members], rec, fmax)
        for k, st in zip(members, results, strict=True):
            new_states[k] = st

    out = []
    for i, m in enumerate(metas):
        step = m.step + 1.0
        out.append(
            replace(
                m,
                forward=new_states.get((i, "forward"), m.forward),
                backward=new_states.get((i, "backward"), m.backward),
                step=jnp.where(step >= STEP_WRAP, step - STEP_WRAP, step),
            )
        )
    return out


def combine_observations(*observations: Any) -> Any:
    """Combine observation trees of the same structure with max (microbatches, devices)."""
    if not observations:
        raise ValueError("combine_observations needs at least one observation tree")

    def norm(tree: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda x: observations_of(x) if is_observation(x) else x,
            tree,
            is_leaf=is_observation,
        )

    trees = [norm(t) for t in observations]

    def combine(path: Any, *xs: Any) -> Any:
        if xs[0] is None:
            return None
        if not isinstance(xs[0], Observations):
            # a parameter gradient: its microbatches add up, a max would corrupt it
            raise TypeError(
                "combine_observations takes observation trees (the third result of "
                "fp8kit.jax.value_and_grad, or split_grads(grads)[1]), got a "
                f"{type(xs[0]).__name__} at {_path_str(path)}: combine parameter gradients "
                "with a sum or a mean, and only the observations with this function"
            )
        return jax.tree_util.tree_map(lambda *a: jnp.max(jnp.stack(a), axis=0), *xs)

    return jax.tree_util.tree_map_with_path(
        combine, *trees, is_leaf=lambda x: isinstance(x, Observations) or x is None
    )


def check_step(meta: Any, expected: int) -> None:
    """Raise a ValueError naming every meta whose ``step`` is not ``expected`` (host-side).

    A training loop that forgot to keep the state returned by :func:`update` shows up here: its
    metas stay behind the optimizer's step count.
    """
    if isinstance(expected, bool) or not isinstance(expected, int):
        raise TypeError(f"expected must be an int >= 0 (the number of updates), got {expected!r}")
    if expected < 0:
        raise ValueError(f"expected must be an int >= 0 (the number of updates), got {expected}")
    flat = jax.tree_util.tree_flatten_with_path(meta, is_leaf=is_meta)[0]
    want = expected % STEP_WRAP
    if not any(isinstance(x, Fp8Meta) for _, x in flat):
        raise no_meta_error("check_step", "meta")
    bad = []
    for path, x in flat:
        if isinstance(x, Fp8Meta):
            steps = np.asarray(x.step)
            if steps.size and not np.all(steps == want):
                bad.append(f"{_path_str(path)} (step {np.unique(steps).tolist()})")
    if bad:
        raise ValueError(
            f"fp8kit: FP8 meta out of step, expected {expected} update(s): {', '.join(bad)}; "
            "keep the meta returned by fp8kit.jax.update for the next step"
        )

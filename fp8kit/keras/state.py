"""A Keras layer's FP8 state: non-trainable float32 variables, and the update event on them.

Layout (docs/semantics.md section 3), for a layer with ``g`` GEMMs and history length ``L``:

================================  ============  ==========================================
variable                          shape         meaning
================================  ============  ==========================================
``fp8_fwd_amax_history``          ``(L, 3g)``   row 0 staging, rows 1..L-1 completed history
``fp8_fwd_scale``                 ``(3g,)``     INPUT, WEIGHT, OUTPUT scales
``fp8_fwd_count``                 ``(3g,)``     non-skipped update events per slot
``fp8_bwd_amax_history``          ``(L, 2g)``   GRAD_OUTPUT, GRAD_INPUT
``fp8_bwd_scale``                 ``(2g,)``
``fp8_bwd_count``                 ``(2g,)``
``fp8_microbatch``                ``()``        backward passes since the last event
================================  ============  ==========================================

Every variable is created with ``trainable=False`` (the optimizer, loss scaling, gradient
clipping and weight decay never see it), ``autocast=False`` (float32 under a mixed policy) and
``aggregation="only_first_replica"`` (under ``tf.distribute`` every replica holds the same,
already max-reduced values). :meth:`Fp8State.observe` folds one backward pass's amaxes into the
staging rows and, at every ``accumulation_steps``-th pass, runs one update event for both
directions: one ``(L, 5g)`` buffer with the built-in algorithms, one buffer per direction when
the recipe has a callable (see ``docs/decisions/0601-keras-update-events.md``).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from keras import ops

from fp8kit.keras.autocast import check_accumulation_steps, check_recipe, check_steps_apply
from fp8kit.keras.scaling import update_scaling_state
from fp8kit.recipe import DelayedScaling, Recipe, require_int

__all__ = ["STATE_VARIABLES", "Fp8State", "resize_history"]

STATE_VARIABLES = (
    "fp8_fwd_amax_history",
    "fp8_fwd_scale",
    "fp8_fwd_count",
    "fp8_bwd_amax_history",
    "fp8_bwd_scale",
    "fp8_bwd_count",
    "fp8_microbatch",
)
"""Names of a layer's FP8 variables, in checkpoint order."""


def resize_history(history: np.ndarray, length: int) -> np.ndarray:
    """``history`` ``(L, n)`` resized to ``length`` rows, keeping the staging row 0.

    Shrinking keeps the newest completed entries; growing pads zeros on the older side
    (docs/semantics.md section 6).
    """
    old = history.shape[0]
    if old == length:
        return history
    keep = min(old, length) - 1
    out = np.zeros((length, history.shape[1]), np.float32)
    out[0] = history[0]
    if keep > 0:
        out[length - keep :] = history[old - keep :]
    return out


def _select(due: Any, if_due: tuple[Any, ...], if_not: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(ops.where(due, a, b) for a, b in zip(if_due, if_not, strict=True))


class Fp8State:
    """The FP8 variables of one layer and the event that updates them.

    Args:
        layer: the Keras layer that owns the variables (``add_weight`` is called on it).
        recipe: the layer's recipe (its history length sets ``L``; current scaling keeps L=1
            and is never updated).
        num_gemms: GEMMs of the layer (1 for Dense / EinsumDense).
        accumulation_steps: backward passes per update event (gradient accumulation: the
            amaxes of the passes in between combine with max in the staging rows).
    """

    def __init__(self, layer: Any, recipe: Recipe, num_gemms: int, accumulation_steps: int):
        if check_recipe(recipe) is None:
            raise TypeError(
                "recipe must be an fp8kit.recipe.DelayedScaling / Float8CurrentScaling (a layer "
                "without FP8 has no Fp8State), got None"
            )
        require_int("num_gemms", num_gemms, 1)
        self.recipe = recipe
        self.num_gemms = num_gemms
        self.accumulation_steps = check_accumulation_steps(accumulation_steps)
        check_steps_apply(recipe, self.accumulation_steps)
        length = recipe.amax_history_len if isinstance(recipe, DelayedScaling) else 1
        n_fwd, n_bwd = 3 * num_gemms, 2 * num_gemms

        def var(name: str, shape: tuple[int, ...], init: str) -> Any:
            v = layer.add_weight(
                name=name,
                shape=shape,
                initializer=init,
                dtype="float32",
                trainable=False,
                autocast=False,
                aggregation="only_first_replica",
            )
            # also a layer attribute: TensorFlow checkpoints track variables by attribute name
            setattr(layer, name, v)
            return v

        self.fwd_history = var("fp8_fwd_amax_history", (length, n_fwd), "zeros")
        self.fwd_scale = var("fp8_fwd_scale", (n_fwd,), "ones")
        self.fwd_count = var("fp8_fwd_count", (n_fwd,), "zeros")
        self.bwd_history = var("fp8_bwd_amax_history", (length, n_bwd), "zeros")
        self.bwd_scale = var("fp8_bwd_scale", (n_bwd,), "ones")
        self.bwd_count = var("fp8_bwd_count", (n_bwd,), "zeros")
        self.microbatch = var("fp8_microbatch", (), "zeros")

    @property
    def variables(self) -> tuple[Any, ...]:
        """The variables in :data:`STATE_VARIABLES` order."""
        return (
            self.fwd_history,
            self.fwd_scale,
            self.fwd_count,
            self.bwd_history,
            self.bwd_scale,
            self.bwd_count,
            self.microbatch,
        )

    @property
    def num_observations(self) -> int:
        """Length of one observation vector: forward slots then backward slots (``5g``)."""
        return 5 * self.num_gemms

    def read(self) -> tuple[Any, Any, Any, Any]:
        """Current ``(fwd_scale, fwd_count, bwd_scale, bwd_count)`` as tensors: copies, not the
        variables.

        A call's backward quantizes with the scales current at its forward even when another
        call's update event has assigned the variables in between (eager TensorFlow would
        otherwise read the variable at backward time, and a torch tensor would see the in-place
        assign). In a TensorFlow graph the copies are the reads that the event's writes wait
        for (:mod:`fp8kit.keras.backends.tf_grad`); ``ops.convert_to_tensor`` would return the
        variable itself there, read later inside the custom gradient.
        """
        return (
            ops.copy(self.fwd_scale),
            ops.copy(self.fwd_count),
            ops.copy(self.bwd_scale),
            ops.copy(self.bwd_count),
        )

    def observe(self, amaxes: Any) -> None:
        """Fold one backward pass's amaxes ``(5g,)`` into the staging rows; maybe run an event.

        ``amaxes`` holds the forward slots then the backward slots (0 = not quantized, NaN is
        treated as 0). Must be called once per backward pass with the max over every call of
        the layer in that pass, already reduced across replicas.
        """
        shape = tuple(getattr(amaxes, "shape", ()))
        if len(shape) != 1 or shape[0] not in (None, self.num_observations):  # None: traced
            raise ValueError(
                f"amaxes must have shape ({self.num_observations},): the {3 * self.num_gemms} "
                f"forward then {2 * self.num_gemms} backward slots, got shape {shape}"
            )
        if not isinstance(self.recipe, DelayedScaling):
            return  # current scaling: no history, nothing to update
        amaxes = ops.cast(amaxes, "float32")
        amaxes = ops.where(ops.isnan(amaxes), ops.zeros_like(amaxes), amaxes)
        n_fwd = 3 * self.num_gemms
        staged = []
        for hist_var, obs in (
            (self.fwd_history, amaxes[:n_fwd]),
            (self.bwd_history, amaxes[n_fwd:]),
        ):
            hist = ops.convert_to_tensor(hist_var)
            row0 = ops.maximum(hist[0], obs)
            staged.append(ops.concatenate([row0[None], hist[1:]], axis=0))
        fwd_h, bwd_h = staged
        scales = (ops.convert_to_tensor(self.fwd_scale), ops.convert_to_tensor(self.bwd_scale))
        counts = (ops.convert_to_tensor(self.fwd_count), ops.convert_to_tensor(self.bwd_count))
        new_fwd, new_bwd = self._event(fwd_h, bwd_h, scales, counts)
        if self.accumulation_steps > 1:
            micro = ops.add(ops.convert_to_tensor(self.microbatch), 1.0)
            due = ops.equal(ops.mod(micro, float(self.accumulation_steps)), 0.0)
            self.microbatch.assign(ops.where(due, ops.zeros_like(micro), micro))
            # between events only the staging rows change (max over the microbatches)
            new_fwd = _select(due, new_fwd, (fwd_h, scales[0], counts[0]))
            new_bwd = _select(due, new_bwd, (bwd_h, scales[1], counts[1]))
        targets = (
            self.fwd_history,
            self.fwd_scale,
            self.fwd_count,
            self.bwd_history,
            self.bwd_scale,
            self.bwd_count,
        )
        for var, value in zip(targets, (*new_fwd, *new_bwd), strict=True):
            var.assign(value)

    def _event(
        self,
        fwd_h: Any,
        bwd_h: Any,
        scales: tuple[Any, Any],
        counts: tuple[Any, Any],
    ) -> tuple[tuple[Any, Any, Any], tuple[Any, Any, Any]]:
        """One update event of both directions (docs/semantics.md section 3) on staged histories."""
        recipe = self.recipe
        assert isinstance(recipe, DelayedScaling)
        f_max, b_max = recipe.fp8_format.forward.max, recipe.fp8_format.backward.max
        n_fwd = 3 * self.num_gemms
        builtin = isinstance(recipe.amax_compute_algo, str) and (
            recipe.scaling_factor_compute_algo is None
        )
        if not builtin:  # a user callable sees one direction at a time, as in fp8kit.torch
            return (
                update_scaling_state(fwd_h, scales[0], counts[0], recipe, f_max),
                update_scaling_state(bwd_h, scales[1], counts[1], recipe, b_max),
            )
        fmax = np.array([f_max] * n_fwd + [b_max] * (2 * self.num_gemms), np.float64)
        hist, scale, count = update_scaling_state(
            ops.concatenate([fwd_h, bwd_h], axis=1),
            ops.concatenate(list(scales)),
            ops.concatenate(list(counts)),
            recipe,
            fmax,
        )
        return (
            (hist[:, :n_fwd], scale[:n_fwd], count[:n_fwd]),
            (hist[:, n_fwd:], scale[n_fwd:], count[n_fwd:]),
        )

    def reset(self) -> None:
        """Fresh values (histories and counts 0, scales 1, no microbatch pending): the state of
        a newly built layer, for weights that arrive without FP8 state."""
        scales = (self.fwd_scale, self.bwd_scale)
        for var in self.variables:
            fill = 1.0 if any(var is scale for scale in scales) else 0.0
            var.assign(np.full(var.shape, fill, np.float32))

    def load(self, values: list[np.ndarray], where: str) -> None:
        """Assign saved values (``STATE_VARIABLES`` order), resizing histories of another length."""
        for var, name, value in zip(self.variables, STATE_VARIABLES, values, strict=True):
            value = np.asarray(value, np.float32)
            want = tuple(var.shape)
            resizable = name.endswith("amax_history") and value.ndim == 2
            if resizable and value.shape[0] != want[0] and value.shape[1] == want[1]:
                warnings.warn(
                    f"fp8kit: {where}: saved {name} has {value.shape[0]} entries, the recipe "
                    f"{want[0]}; resizing (newest entries kept)",
                    stacklevel=3,
                )
                value = resize_history(value, want[0])
            if value.shape != want:
                raise ValueError(
                    f"fp8kit: {where}: saved {name} has shape {value.shape}, the layer needs {want}"
                )
            var.assign(value)

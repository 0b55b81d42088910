"""``convert_model``: a copy of a Functional or Sequential Keras model with FP8 Dense layers."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from fp8kit.keras.autocast import resolve
from fp8kit.keras.layers import Dense, EinsumDense
from fp8kit.unset import UNSET

__all__ = ["convert_model"]

LayerFilter = Callable[[keras.layers.Layer], bool]

_FP8_CLASS: dict[type, type] = {
    keras.layers.Dense: Dense,
    keras.layers.EinsumDense: EinsumDense,
}


def _copy_weights(old: keras.layers.Layer, new: keras.layers.Layer) -> None:
    """Assign ``old``'s kernel and bias to the FP8 layer it became (fresh FP8 state), or every
    weight to a layer with the same variables: a copy of its own class (an FP8 layer keeps its
    trained FP8 state) or a ``recipe=None`` layer (Keras's variables, LoRA factors included)."""
    if type(old) in _FP8_CLASS and isinstance(new, (Dense, EinsumDense)) and new.recipe is not None:
        new.kernel.assign(old.kernel)
        if old.bias is not None:
            new.bias.assign(old.bias)
        return
    new.set_weights(old.get_weights())


def _selected(layer_filter: LayerFilter | None, layer: keras.layers.Layer) -> bool:
    """Whether ``layer_filter`` selects ``layer`` (no filter: every layer); a result other than
    a bool raises, as a filter that forgot its ``return`` would select nothing."""
    if layer_filter is None:
        return True
    keep = layer_filter(layer)
    if not isinstance(keep, (bool, np.bool_)):  # a comparison of NumPy values gives np.bool_
        raise TypeError(f"layer_filter must return a bool, got {keep!r} for layer {layer.name!r}")
    return bool(keep)


def convert_model(
    model: keras.Model,
    *,
    layer_filter: LayerFilter | None = None,
    recipe: Any = UNSET,
    gradient_accumulation_steps: Any = UNSET,
) -> keras.Model:
    """A new model in which every ``keras.layers.Dense`` / ``EinsumDense`` is the FP8 layer.

    Args:
        model: a Functional or Sequential ``keras.Model`` (subclassed models cannot be cloned by
            Keras: build them from :class:`fp8kit.keras.Dense` directly).
        layer_filter: ``layer -> bool``; a layer is converted only if it returns True. Only
            layers whose type is exactly ``keras.layers.Dense`` / ``EinsumDense`` are converted.
        recipe, gradient_accumulation_steps: for the new layers, as in
            :class:`fp8kit.keras.Dense` (unset: the autocast active now, else
            ``DelayedScaling()``). Layers that already are fp8kit layers are copied with
            their own recipe, steps and FP8 state.

    Returns:
        A new, uncompiled model with the same architecture and the weights of ``model``
        (kernels and biases are copied; the new FP8 layers start with fresh FP8 state). Compile
        it (a new optimizer) before ``fit``.

    Raises:
        ValueError: a layer to convert has LoRA enabled and ``recipe`` is not None (skip it
            with ``layer_filter``, or convert with ``recipe=None``).
        TypeError: ``model`` is not a Functional or Sequential Keras model, ``layer_filter`` is
            not callable, or it returned something other than a bool.

    Warns:
        UserWarning: naming the Dense / EinsumDense layers left in high precision: subclasses
            of them (their ``call`` may differ) and layers nested inside other layers.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a keras.Model, got {type(model).__name__}")
    if not isinstance(model, (keras.Sequential, keras.Model)) or (
        type(model) is not keras.Sequential
        and not getattr(model, "_is_graph_network", False)
        and type(model).__name__ != "Functional"
    ):
        raise TypeError(
            f"convert_model needs a Functional or Sequential model, got the subclassed model "
            f"{type(model).__name__}: construct it with fp8kit.keras.Dense / EinsumDense instead"
        )
    if layer_filter is not None and not callable(layer_filter):
        raise TypeError("layer_filter must be None or a callable (layer) -> bool")
    recipe, steps = resolve(recipe, gradient_accumulation_steps)
    pairs: list[tuple[keras.layers.Layer, keras.layers.Layer]] = []
    subclasses: list[str] = []

    def clone(layer: keras.layers.Layer) -> keras.layers.Layer:
        fp8_class = _FP8_CLASS.get(type(layer))
        config = layer.get_config()
        if fp8_class is not None and _selected(layer_filter, layer):
            if recipe is not None and (layer.lora_enabled or layer.lora_rank):
                raise ValueError(
                    f"convert_model: layer {layer.name!r} has LoRA enabled (rank "
                    f"{layer.lora_rank}), which cannot be combined with an FP8 recipe; leave it "
                    "in high precision with layer_filter=, or convert with recipe=None"
                )
            new = fp8_class.from_config(
                {**config, "recipe": recipe, "gradient_accumulation_steps": steps}
            )
        else:
            subclass = isinstance(layer, tuple(_FP8_CLASS)) and fp8_class is None
            if subclass and not isinstance(layer, (Dense, EinsumDense)):
                subclasses.append(f"{layer.name} ({type(layer).__name__})")
            new = layer.__class__.from_config(config)
        if isinstance(layer, keras.layers.Layer):  # not an operation (``h + x``, keras.ops.relu)
            pairs.append((layer, new))
        return new

    converted = keras.models.clone_model(model, clone_function=clone, recursive=True)
    for old, new in pairs:
        if old.built and new.built:
            _copy_weights(old, new)
    if subclasses:
        warnings.warn(
            f"fp8kit.keras.convert_model: {len(subclasses)} layer(s) subclassing Dense / "
            f"EinsumDense stay in high precision ({', '.join(subclasses)}): only those exact "
            "types are swapped, a subclass's call may compute something else; build it on "
            "fp8kit.keras.Dense / EinsumDense instead",
            stacklevel=2,
        )
    _warn_about_nested_layers(converted, {id(new) for _, new in pairs})
    return converted


def _warn_about_nested_layers(model: keras.Model, cloned: set[int]) -> None:
    """Warn about Dense / EinsumDense layers that live inside other layers (the projections of
    ``MultiHeadAttention``, a ``TimeDistributed`` wrapper's layer): Keras clones a model's
    layers, not their sublayers, so those stay in high precision."""
    nested = [
        layer.name
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if type(layer) in _FP8_CLASS and id(layer) not in cloned
    ]
    if nested:
        warnings.warn(
            f"fp8kit.keras.convert_model: {len(nested)} Dense / EinsumDense layer(s) inside "
            f"other layers stay in high precision ({', '.join(nested)}): only a model's own "
            "layers can be swapped; build such blocks from fp8kit.keras.Dense / EinsumDense",
            stacklevel=2,
        )

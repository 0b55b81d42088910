"""Frozen FP8 layers in training (docs/keras.md, "A frozen layer"), shared by
tests/keras/test_frozen.py (TensorFlow) and backend_smoke.py (torch, JAX).

Imports keras, so the Keras backend is whatever the importing process chose; ``torch_reference``
imports torch lazily (in a TensorFlow process conftest.py has loaded it first).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

import fp8kit.keras as f8

HISTORY = 4
SIZES = ((6, 5), (5, 4), (4, 3))  # a -> b -> c
NAMES = "abc"
LR = 0.1


def data() -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((8, 6)).astype(np.float32) * 2.0**k for k in range(2)]
    ys = [rng.standard_normal((8, 3)).astype(np.float32) for _ in range(2)]
    return xs, ys


def recipe(wgrad_high_precision: bool) -> f8.DelayedScaling:
    return f8.DelayedScaling(
        amax_history_len=HISTORY, override_linear_precision=(False, False, wgrad_high_precision)
    )


def state(layer: Any) -> list[np.ndarray]:
    return [keras.ops.convert_to_numpy(v) for v in layer.fp8_state.variables]


def frozen_prefix_model(freeze: str, wgrad_high_precision: bool) -> keras.Model:
    """Sequential a -> b -> c of FP8 Dense layers, a and b frozen: ``freeze="layer"`` sets their
    ``trainable`` (they then run as inference), ``"variables"`` freezes their kernel and bias
    variables only (the layers stay trainable: training calls with frozen weights)."""
    keras.utils.set_random_seed(0)
    r = recipe(wgrad_high_precision)
    layers = [f8.Dense(o, recipe=r, name=n) for n, (_, o) in zip(NAMES, SIZES, strict=True)]
    model = keras.Sequential([keras.Input((6,)), *layers])
    for name in "ab":
        layer = model.get_layer(name)
        if freeze == "layer":
            layer.trainable = False
        else:
            layer.kernel.trainable = False
            layer.bias.trainable = False
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    return model


def weights(model: keras.Model) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {
        n: tuple(keras.ops.convert_to_numpy(v) for v in (layer.kernel, layer.bias))
        for n, layer in ((n, model.get_layer(n)) for n in NAMES)
    }


def torch_reference(
    w: dict[str, tuple[np.ndarray, np.ndarray]], wgrad_high_precision: bool
) -> dict[str, list[np.ndarray]]:
    """fp8kit.torch on the same weights and batches, a and b with ``requires_grad_(False)`` run
    as an evaluation pass (``torch.no_grad()`` and an autocast of their own, which runs no
    event: docs/semantics.md section 3), as Keras runs them (a frozen layer, or calls without
    a backward pass: docs/keras.md): per layer (fwd history, scale, count, bwd history, scale,
    count)."""
    import torch

    import fp8kit.torch as f8t

    lins = {}
    for n, (fi, fo) in zip(NAMES, SIZES, strict=True):
        lin = f8t.Linear(fi, fo)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(w[n][0].T.copy()))
            lin.bias.copy_(torch.from_numpy(w[n][1]))
        lins[n] = lin
    lins["a"].requires_grad_(False)
    lins["b"].requires_grad_(False)
    opt = torch.optim.SGD(lins["c"].parameters(), lr=LR)
    r = recipe(wgrad_high_precision)
    for x, y in zip(*data(), strict=True):
        with torch.no_grad(), f8t.autocast(recipe=r):
            h = lins["b"](lins["a"](torch.from_numpy(x)))
        with f8t.autocast(recipe=r):
            out = lins["c"](h)
        loss = ((out - torch.from_numpy(y)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    ref = {}
    for n, lin in lins.items():
        fw, bw = lin.fp8_meta.forward, lin.fp8_meta.backward
        tensors = (fw.amax_history, fw.scale, fw.update_count)
        tensors = (*tensors, bw.amax_history, bw.scale, bw.update_count)
        ref[n] = [t.detach().numpy().astype(np.float32) for t in tensors]
    return ref


def check_frozen_prefix(freeze: str, wgrad_high_precision: bool) -> None:
    """Two ``train_on_batch`` steps. a and b keep their fresh state either way: frozen layers
    run as inference, and with frozen weights their calls have no backward pass (nothing they
    compute needs a gradient), which in Keras records nothing. c against fp8kit.torch: its
    input needs no gradient, so it casts dY only for an FP8 wgrad. Histories may differ in the
    last bit (c's input comes from GEMMs whose operands Keras scales first, docs/keras.md
    platform notes); counts are exact."""
    model = frozen_prefix_model(freeze, wgrad_high_precision)
    fresh = {n: state(model.get_layer(n)) for n in NAMES}
    ref = torch_reference(weights(model), wgrad_high_precision)
    for x, y in zip(*data(), strict=True):
        model.train_on_batch(x, y)
    for n in NAMES:
        ours = state(model.get_layer(n))
        if n in "ab":
            for got, want in zip(ours, fresh[n], strict=True):
                np.testing.assert_array_equal(got, want, err_msg=f"frozen layer {n} changed")
            continue
        for k, (got, want) in enumerate(zip(ours[:6], ref[n], strict=True)):
            msg = f"layer {n}, {freeze}, wgrad hp {wgrad_high_precision}, variable {k}"
            if k in (2, 5):  # counts
                np.testing.assert_array_equal(got, want, err_msg=msg)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=msg)


def frozen_base_model() -> tuple[keras.Model, keras.Model]:
    """Keras's transfer-learning idiom: a frozen FP8 sub-model called with training=False in a
    Functional model, between a trainable adapter and a trainable head (all plain Keras layers,
    so the JAX backend can train it). Returns (model, base)."""
    keras.utils.set_random_seed(0)
    r = f8.DelayedScaling(amax_history_len=3)
    base = keras.Sequential(
        [
            keras.Input((6,)),
            f8.Dense(5, recipe=r, name="a"),
            f8.Dense(4, recipe=r, name="b"),
            keras.layers.BatchNormalization(name="bn"),
        ],
        name="base",
    )
    base.trainable = False
    inputs = keras.Input((6,))
    adapted = keras.layers.Dense(6, name="adapter")(inputs)
    features = base(adapted, training=False)  # Keras 3's Functional graph replaces this by True
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(features))
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    return model, base


def check_frozen_base() -> None:
    """fit leaves every variable of the frozen base as it was (FP8 state, BatchNorm statistics,
    weights), while the gradient still flows through it to the adapter (its FP8 dgrad runs)."""
    model, base = frozen_base_model()
    before = {v.path: keras.ops.convert_to_numpy(v).copy() for v in base.weights}
    adapter = keras.ops.convert_to_numpy(model.get_layer("adapter").kernel).copy()
    xs, ys = data()
    x = np.concatenate(xs)
    y = np.concatenate(ys)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    for v in base.weights:
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), before[v.path], v.path)
    moved = keras.ops.convert_to_numpy(model.get_layer("adapter").kernel)
    assert not np.array_equal(moved, adapter), "no gradient reached the adapter"

"""Shared helpers of the Keras tests (TensorFlow backend)."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

import fp8kit.keras as f8


def state_arrays(layer: Any) -> list[np.ndarray]:
    """A layer's FP8 variables as numpy arrays, in ``f8.STATE_VARIABLES`` order."""
    return [np.array(v.numpy()) for v in layer.fp8_state.variables]


def train_step_fn(layer: Any, jit_compile: bool = True):
    """``step(x, g) -> (y, dx, dkernel, dbias)``: one training call and its gradients for the
    output gradient ``g`` (the loss is ``sum(y * g)``), as a ``tf.function``."""

    @tf.function(jit_compile=jit_compile)
    def step(x: tf.Tensor, g: tf.Tensor) -> tuple[tf.Tensor, ...]:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * g)
        dx, dk, db = tape.gradient(loss, [x, layer.kernel, layer.bias])
        return y, dx, dk, db

    return step


def dense(units: int, w: np.ndarray, b: np.ndarray, recipe: Any, **kwargs: Any) -> Any:
    """A built ``f8.Dense`` with kernel ``w`` ``(in, units)`` and bias ``b``."""
    layer = f8.Dense(units, recipe=recipe, **kwargs)
    layer.build((None, w.shape[0]))
    layer.kernel.assign(w)
    layer.bias.assign(b)
    return layer


def random_fp8_friendly(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0):
    """float32 normals spread over several binades (no float32 subnormals)."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-4, 4, shape)) * scale
    return x.astype(np.float32)

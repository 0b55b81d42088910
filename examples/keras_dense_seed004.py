"""Seed 004 with fp8kit.keras: swap ``tf.keras.layers.Dense`` for an FP8 ``Dense`` inside a
``tf.function(jit_compile=True)`` training step, delayed scaling over an amax history.

The seed's one-liner ``y = fp8_module.Dense(16)(x)`` becomes ``f8.Dense(16)`` here (a drop-in
subclass of ``keras.layers.Dense``); the recipe comes from ``f8.autocast`` at construction. The
same model is then trained with ``model.fit``. FP8 state (amax histories, scales) lives in
non-trainable variables that the optimizer never sees, updated at the end of every step.

Run: ``KERAS_BACKEND=tensorflow python examples/keras_dense_seed004.py``
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import tensorflow as tf

import fp8kit.keras as f8


def build_model(features: int = 32) -> keras.Model:
    with f8.autocast(recipe=f8.DelayedScaling(amax_history_len=16)):
        return keras.Sequential(
            [
                keras.Input((features,)),
                # y = tf.keras.layers.Dense(16)(x)
                f8.Dense(16, activation="relu"),
                f8.Dense(1),
            ]
        )


def data(n: int = 256, features: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype(np.float32)
    w = rng.standard_normal((features, 1)).astype(np.float32) / np.sqrt(features)
    return x, np.tanh(x @ w) + 0.5


def main(steps: int = 40, verbose: bool = True) -> dict[str, list[float]]:
    """Train with a jit_compile'd GradientTape step, then with model.fit; return the losses."""
    x, y = data()
    model = build_model()
    optimizer = keras.optimizers.Adam(1e-2)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function(jit_compile=True)
    def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_weights)  # kernels and biases only
        optimizer.apply(grads, model.trainable_weights)
        return loss

    tape_losses = []
    for step in range(steps):
        batch = slice(32 * (step % 8), 32 * (step % 8) + 32)
        tape_losses.append(float(train_step(tf.constant(x[batch]), tf.constant(y[batch]))))
    first = model.layers[0]
    if verbose:
        print(f"GradientTape + XLA: loss {tape_losses[0]:.4f} -> {tape_losses[-1]:.4f}")
        print(f"  first layer scales (x, W, -): {first.fp8_state.fwd_scale.numpy()}")
        print(f"  first layer dY scale: {first.fp8_state.bwd_scale.numpy()[0]:.1f}")

    fitted = build_model()
    fitted.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=True)
    history = fitted.fit(x, y, batch_size=32, epochs=max(1, steps // 8), verbose=0)
    fit_losses = [float(v) for v in history.history["loss"]]
    if verbose:
        print(f"model.fit: loss per epoch {[round(v, 4) for v in fit_losses]}")
    return {"tape": tape_losses, "fit": fit_losses}


if __name__ == "__main__":
    main()

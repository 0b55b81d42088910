"""Frozen FP8 layers in training, TensorFlow backend (the torch and JAX backends run the same
cases in backend_smoke.py): a layer with trainable=False runs as inference, like
BatchNormalization; frozen weights are read behind a stop-gradient, so a call records what its
backward pass needs (dY only for a gradient GEMM whose result is needed) and a call without one
records nothing (docs/keras.md)."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import fp8kit.keras as f8
from tests.keras import frozen_cases
from tests.keras.helpers import dense, random_fp8_friendly, state_arrays

pytest.importorskip("torch")


@pytest.mark.parametrize("wgrad_hp", [False, True], ids=["fp8", "wgrad_hp"])
@pytest.mark.parametrize("freeze", ["variables", "layer"])
def test_frozen_prefix_matches_fp8kit_torch(freeze, wgrad_hp) -> None:
    """a -> b -> c, a and b frozen, two fit steps: a and b never change (frozen layers run as
    inference; with frozen weights their calls have no backward pass), and c, whose input then
    needs no gradient, casts dY only for an FP8 wgrad. The old code recorded a's and b's
    forward amaxes and cast dY in b and c for dgrads whose dX nobody needs (a tape watches a
    frozen TensorFlow variable)."""
    frozen_cases.check_frozen_prefix(freeze, wgrad_hp)


def test_frozen_base_called_with_training_false_keeps_its_state() -> None:
    """Keras's transfer-learning idiom in a Functional model: Keras passes the outer
    training=True to the nested base, and only ``trainable`` says it is frozen."""
    frozen_cases.check_frozen_base()


@pytest.mark.parametrize("traced", [False, True])
def test_frozen_layer_in_the_middle_passes_its_fp8_dgrad(rng, traced) -> None:
    """A frozen layer whose input needs a gradient: dX is the FP8 dgrad with the current
    (unit) scales, E5M2(dY) @ E4M3(W)^T, and the state does not change."""
    w = random_fp8_friendly(rng, (16, 8))
    layer = dense(8, w, np.zeros(8, np.float32), f8.DelayedScaling(amax_history_len=2))
    layer.trainable = False
    x = tf.constant(random_fp8_friendly(rng, (4, 16)))
    g = tf.constant(random_fp8_friendly(rng, (4, 8), 1e-2))
    before = state_arrays(layer)

    def step(x, g):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, training=True) * g)
        return tape.gradient(loss, x)

    dx = (tf.function(step) if traced else step)(x, g)
    wq = tf.cast(tf.cast(w, "float8_e4m3fn"), tf.float32)
    gq = tf.cast(tf.cast(g, "float8_e5m2"), tf.float32)
    np.testing.assert_allclose(dx.numpy(), (gq @ tf.transpose(wq)).numpy(), rtol=1e-6)
    for a, b in zip(before, state_arrays(layer), strict=True):
        np.testing.assert_array_equal(a, b)


def test_no_training_unset_warning_while_keras_builds_a_subclassed_model() -> None:
    """Keras builds a lazily built subclassed model by a symbolic call inside fit's tape, with
    training unset: no warning there, and the warn-once flag is left for a real such call."""

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.a = f8.Dense(5, recipe=f8.DelayedScaling(amax_history_len=4), name="a")

        def call(self, x, training=None):
            return self.a(x)

    xs, ys = frozen_cases.data()
    model = Net()
    model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(xs[0], ys[0][:, :1].repeat(5, axis=1), batch_size=8, verbose=0)
    assert not [w for w in caught if "training unset" in str(w.message)]
    np.testing.assert_array_equal(model.a.fp8_state.fwd_count.numpy(), [1, 1, 0])
    with pytest.warns(UserWarning, match="training unset"), tf.GradientTape():
        model.a(xs[0])


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("frozen", ["layer", "weights", "none"])
def test_a_teacher_under_stop_gradient_records_nothing(rng, traced, frozen) -> None:
    """docs/keras.md, "A call without a backward pass records nothing": a teacher called with
    training=True under tf.stop_gradient inside the student's tape, whether the teacher, its
    weights or nothing is frozen (a review found frozen weights made it record)."""
    r = f8.DelayedScaling(amax_history_len=2)
    teacher = dense(8, random_fp8_friendly(rng, (16, 8)), np.zeros(8, np.float32), r)
    student = dense(8, random_fp8_friendly(rng, (16, 8)), np.zeros(8, np.float32), r)
    if frozen == "layer":
        teacher.trainable = False
    elif frozen == "weights":
        teacher.kernel.trainable = False
        teacher.bias.trainable = False
    x = tf.constant(random_fp8_friendly(rng, (4, 16)))
    before = state_arrays(teacher)

    def step(x):
        with tf.GradientTape() as tape:
            target = tf.stop_gradient(teacher(x, training=True))
            loss = tf.reduce_sum((student(x, training=True) - target) ** 2)
        return tape.gradient(loss, student.trainable_variables)

    (tf.function(step) if traced else step)(x)
    for a, b in zip(before, state_arrays(teacher), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(student.fp8_state.fwd_count.numpy(), [1, 1, 0])

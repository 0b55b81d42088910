"""fp8kit.keras in real training: model.fit, optimizer isolation, .keras files and TF
checkpoints, MirroredStrategy on two logical CPUs, convert_model."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import fp8kit.keras as f8
from tests.keras.helpers import dense, random_fp8_friendly, state_arrays, train_step_fn

RECIPE = f8.DelayedScaling(amax_history_len=4)


def mlp(recipe=RECIPE, seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((12,))
    h = f8.Dense(16, activation="relu", recipe=recipe, name="fc1")(inputs)
    outputs = f8.Dense(4, recipe=recipe, name="fc2")(h)
    return keras.Model(inputs, outputs)


def batches(rng, n: int, size: int = 8) -> tuple[np.ndarray, np.ndarray]:
    x = np.concatenate([random_fp8_friendly(rng, (size, 12), 2.0**k) for k in range(n)])
    return x, random_fp8_friendly(rng, (n * size, 4))


def test_fit_runs_one_event_per_step_and_never_reaches_the_optimizer(rng) -> None:
    x, y = batches(rng, 3)
    model = mlp()
    opt = keras.optimizers.AdamW(1e-3, weight_decay=0.5, global_clipnorm=1e-3)
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(opt),
        loss="mse",
        jit_compile=True,
        steps_per_execution=2,
    )
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    fc1 = model.get_layer("fc1")
    hist_f, scale_f, count_f, hist_b, _, count_b, _ = state_arrays(fc1)
    # three steps, three events; the input slot holds each batch's max|x| (the model input)
    np.testing.assert_array_equal(count_f, [3, 3, 0])
    np.testing.assert_array_equal(count_b, [3, 0])
    np.testing.assert_array_equal(
        hist_f[1:, 0], [np.abs(x[8 * k : 8 * k + 8]).max() for k in range(3)]
    )
    assert scale_f[0] == np.float32(448) / np.float32(np.abs(x).max())
    assert np.all(hist_b[1:, 0] > 0)
    fp8_ids = {id(v) for layer in model.layers for v in getattr(layer, "non_trainable_weights", [])}
    assert not any(id(v) in fp8_ids for v in model.trainable_weights)
    assert all(v.shape not in ((4, 3), (4, 2)) for v in opt.variables)  # no slots for FP8 state
    assert len(model.trainable_weights) == 4


def test_fit_equals_a_custom_tape_loop_bit_for_bit(rng) -> None:
    """The same batches through model.fit (SGD) and through a GradientTape loop give the same
    weights and FP8 state: fit updates at the same events (graph mode here; XLA is covered by
    the fit test above and the parity tests)."""
    x, y = batches(rng, 3)
    fitted = mlp(seed=1)
    fitted.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    fitted.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    looped = mlp(seed=1)
    opt = keras.optimizers.SGD(0.1)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, looped(xb, training=True))
        grads = tape.gradient(loss, looped.trainable_weights)
        opt.apply(grads, looped.trainable_weights)

    for k in range(3):
        step(tf.constant(x[8 * k : 8 * k + 8]), tf.constant(y[8 * k : 8 * k + 8]))
    for a, b in zip(fitted.weights, looped.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7, err_msg=a.path)
    for name in ("fc1", "fc2"):
        for a, b in zip(
            state_arrays(fitted.get_layer(name)), state_arrays(looped.get_layer(name)), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_keras_file_and_tf_checkpoint_keep_the_state(rng, tmp_path) -> None:
    x, y = batches(rng, 4)
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x[:16], y[:16], batch_size=8, shuffle=False, verbose=0)
    model.save(tmp_path / "m.keras")
    tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))

    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.get_layer("fc1").recipe == RECIPE
    restored = mlp(seed=5)
    tf.train.Checkpoint(model=restored).read(
        str(tmp_path / "ckpt")
    ).assert_existing_objects_matched()
    for other in (loaded, restored):
        for name in ("fc1", "fc2"):
            for a, b in zip(
                state_arrays(model.get_layer(name)),
                state_arrays(other.get_layer(name)),
                strict=True,
            ):
                np.testing.assert_array_equal(a, b)
    # resuming: the next steps are the same as without the save
    restored.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    for m in (model, loaded, restored):
        m.fit(x[16:], y[16:], batch_size=8, shuffle=False, verbose=0)
    for other in (loaded, restored):
        for a, b in zip(model.weights, other.weights, strict=True):
            np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


def test_weights_of_the_plain_keras_model_load_into_the_fp8_one(rng, tmp_path) -> None:
    """The drop-in swap: weights saved from the same model built with keras.layers.Dense load
    into the f8.Dense model (kernels and biases), whose FP8 state starts fresh, also after it
    trained (the state used to stay, measured on other weights, while the log said fresh)."""

    def build(layer: type) -> keras.Model:
        return keras.Sequential([keras.Input((8,)), layer(6, activation="relu"), layer(2)])

    plain = build(keras.layers.Dense)
    plain.save_weights(tmp_path / "plain.weights.h5")
    with f8.autocast(recipe=RECIPE):
        fp8 = build(f8.Dense)
    fp8.compile(optimizer="sgd", loss="mse")
    x = rng.standard_normal((16, 8)).astype(np.float32)
    fp8.fit(x, rng.standard_normal((16, 2)).astype(np.float32), batch_size=8, verbose=0)
    assert state_arrays(fp8.layers[0])[2].any()  # trained: counts moved
    fp8.load_weights(tmp_path / "plain.weights.h5")
    for a, b in zip(plain.layers, fp8.layers, strict=True):
        np.testing.assert_array_equal(a.kernel.numpy(), b.kernel.numpy())
        np.testing.assert_array_equal(a.bias.numpy(), b.bias.numpy())
        history, scale, count, bwd_history, bwd_scale, bwd_count, micro = state_arrays(b)
        assert not history.any() and not count.any() and scale.tolist() == [1.0, 1.0, 1.0]
        assert not bwd_history.any() and not bwd_count.any() and bwd_scale.tolist() == [1.0, 1.0]
        assert micro == 0


def test_weights_of_another_history_length_are_resized_with_a_warning(rng, tmp_path) -> None:
    model = mlp()
    step = train_step_fn(model.get_layer("fc2"))
    for k in range(5):
        step(tf.constant(random_fp8_friendly(rng, (4, 16), 2.0**k)), tf.ones((4, 4)))
    model.save_weights(tmp_path / "w.weights.h5")
    longer = mlp(f8.DelayedScaling(amax_history_len=6))
    with pytest.warns(UserWarning, match="has 4 entries, the recipe 6; resizing"):
        longer.load_weights(tmp_path / "w.weights.h5")
    old = model.get_layer("fc2").fp8_state.fwd_history.numpy()
    new = longer.get_layer("fc2").fp8_state.fwd_history.numpy()
    np.testing.assert_array_equal(new[3:], old[1:])  # newest entries kept, zeros on the older side
    np.testing.assert_array_equal(new[1:3], 0)


def test_mirrored_strategy_reduces_amaxes_with_max(rng) -> None:
    cpus = tf.config.list_logical_devices("CPU")
    if len(cpus) < 2:
        pytest.skip("two logical CPU devices could not be configured (runtime already started)")
    strategy = tf.distribute.MirroredStrategy([d.name for d in cpus[:2]])
    w = random_fp8_friendly(rng, (12, 6), 0.1)
    b = np.zeros(6, np.float32)
    with strategy.scope():
        mirrored = dense(6, w, b, RECIPE)
    single = dense(6, w, b, RECIPE)
    single_step = train_step_fn(single)

    @tf.function
    def dist_step(xs, gs):
        def replica(x, g):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(mirrored(x, training=True) * g)
            return tape.gradient(loss, mirrored.kernel)

        return strategy.run(replica, args=(xs, gs))

    for k in range(3):
        # replica 0 holds the large inputs, replica 1 the large gradients: max must mix both
        parts_x = [random_fp8_friendly(rng, (4, 12), 2.0**k), random_fp8_friendly(rng, (4, 12))]
        parts_g = [random_fp8_friendly(rng, (4, 6)), random_fp8_friendly(rng, (4, 6), 8.0)]
        fn = lambda parts: lambda ctx: tf.constant(parts[ctx.replica_id_in_sync_group])  # noqa: E731
        dist_step(
            strategy.experimental_distribute_values_from_function(fn(parts_x)),
            strategy.experimental_distribute_values_from_function(fn(parts_g)),
        )
        single_step(tf.constant(np.concatenate(parts_x)), tf.constant(np.concatenate(parts_g)))
        for a, c in zip(state_arrays(single)[:6], state_arrays(mirrored)[:6], strict=True):
            np.testing.assert_array_equal(c, a)
    for v in mirrored.fp8_state.variables[:6]:  # every replica holds the same values
        values = [t.numpy() for t in strategy.experimental_local_results(v.value)]
        np.testing.assert_array_equal(values[0], values[1])

    # model.fit under the strategy: each global batch is split over the replicas, and the
    # recorded input amax is the global batch's
    with strategy.scope():
        model = keras.Sequential([keras.Input((12,)), f8.Dense(6, recipe=RECIPE)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.concatenate([random_fp8_friendly(rng, (8, 12), 2.0**k) for k in range(2)])
    model.fit(x, np.zeros((16, 6), np.float32), batch_size=8, shuffle=False, verbose=0)
    fwd = model.layers[0].fp8_state
    np.testing.assert_array_equal(fwd.fwd_count.numpy(), [2, 2, 0])
    np.testing.assert_array_equal(fwd.fwd_history.numpy()[2:, 0], np.abs(x).reshape(2, -1).max(1))

    with strategy.scope():
        no_reduce = dense(6, w, b, f8.DelayedScaling(reduce_amax=False))

    def replica_no_reduce():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(no_reduce(tf.ones((2, 12)), training=True))
        return tape.gradient(loss, no_reduce.kernel)

    with pytest.raises(ValueError, match=r"reduce_amax=False under a tf.distribute strategy"):
        strategy.run(tf.function(replica_no_reduce))

    # The gradient in a tf.function nested inside the replica function: TensorFlow refuses the
    # backward pass's cross-replica step there; the error says which step and what to do
    # (it was TensorFlow's bare merge_call error, decision 0248).
    @tf.function
    def nested_gradient(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(mirrored(x, training=True))
        return tape.gradient(loss, mirrored.kernel)

    @tf.function
    def outer_step():
        return strategy.run(lambda: nested_gradient(tf.ones((2, 12))))

    with pytest.raises(RuntimeError, match=r"fp8kit.keras: an FP8 layer's backward pass reduces"):
        outer_step()


def test_convert_model_keeps_the_trained_state_of_fp8_layers(rng) -> None:
    """Converting a model that already has FP8 layers (a second pass with another filter)
    copies their FP8 state with the weights, instead of starting it fresh."""
    layers = [keras.Input((12,)), f8.Dense(8, recipe=RECIPE), keras.layers.Dense(2)]
    model = keras.Sequential(layers)
    model.compile(optimizer="sgd", loss="mse")
    x = random_fp8_friendly(rng, (8, 12))
    model.fit(x, np.zeros((8, 2), np.float32), batch_size=4, epochs=2, verbose=0)
    trained = state_arrays(model.layers[0])
    assert trained[2].max() == 4  # four update events: not the fresh state
    again = f8.convert_model(model, recipe=RECIPE)
    for a, b in zip(trained, state_arrays(again.layers[0]), strict=True):
        np.testing.assert_array_equal(a, b)
    assert isinstance(again.layers[1], f8.Dense)


def test_convert_model_names_the_dense_layers_it_cannot_reach() -> None:
    inputs = keras.Input((5, 16))
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(inputs, inputs)
    h = keras.layers.TimeDistributed(keras.layers.Dense(16, name="inner"))(h)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(h))
    with pytest.warns(UserWarning, match=r"5 Dense / EinsumDense layer\(s\) inside other") as got:
        converted = f8.convert_model(model, recipe=RECIPE)
    message = str(got[0].message)
    assert all(name in message for name in ("query", "key", "value", "attention_output", "inner"))
    assert isinstance(converted.get_layer("head"), f8.Dense)


def test_lora_with_an_fp8_recipe_is_refused_by_name() -> None:
    """Refused where LoRA enters (the constructor, enable_lora) with a ValueError, which
    keras.Sequential does not swallow while it builds (a NotImplementedError it does, and the
    layer trained in high precision)."""
    with pytest.raises(ValueError, match=r"'lo': lora_rank=2 \(LoRA\) cannot be combined"):
        f8.Dense(2, lora_rank=2, recipe=RECIPE, name="lo")
    with pytest.raises(ValueError, match="cannot be combined with an FP8 recipe"):
        keras.Sequential([keras.Input((8,)), f8.EinsumDense("ab,bc->ac", 4, lora_rank=2)])
    built = f8.Dense(2, recipe=RECIPE)
    built.build((None, 3))
    with pytest.raises(ValueError, match=r"enable_lora\(rank=4\) \(LoRA\) cannot be combined"):
        built.enable_lora(4)
    assert not built.lora_enabled
    plain_lora = f8.Dense(2, lora_rank=2, recipe=None)
    plain_lora.build((None, 3))
    assert plain_lora.lora_enabled


def test_a_layer_whose_fp8_build_failed_refuses_to_run_in_high_precision() -> None:
    layer = f8.Dense(2, recipe=RECIPE, dtype="int8_from_float32")
    with pytest.raises(ValueError, match="Keras quantization mode"):
        layer.build((None, 3))
    with pytest.raises(RuntimeError, match="has an FP8 recipe but no FP8 state"):
        f8.Dense.call(layer, np.ones((1, 3), np.float32))


def test_convert_model_with_lora_layers(rng) -> None:
    """A LoRA Dense: refused by name with a recipe (layer_filter= skips it), converted with
    recipe=None keeping its kernel, bias and LoRA factors."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(6, name="proj", lora_rank=2)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(h))
    model.get_layer("proj").lora_kernel_b.assign(random_fp8_friendly(rng, (2, 6)))
    with pytest.raises(ValueError, match=r"layer 'proj' has LoRA enabled.*layer_filter="):
        f8.convert_model(model, recipe=RECIPE)
    skipped = f8.convert_model(model, recipe=RECIPE, layer_filter=lambda layer: not layer.lora_rank)
    assert isinstance(skipped.get_layer("head"), f8.Dense)
    assert not isinstance(skipped.get_layer("proj"), f8.Dense)
    plain = f8.convert_model(model, recipe=None)
    assert isinstance(plain.get_layer("proj"), f8.Dense) and plain.get_layer("proj").lora_enabled
    x = random_fp8_friendly(rng, (3, 8))
    np.testing.assert_array_equal(plain(x).numpy(), model(x).numpy())


def test_convert_model_names_the_dense_subclasses_it_leaves(rng) -> None:
    class MyDense(keras.layers.Dense):
        pass

    inputs = keras.Input((8,))
    model = keras.Model(inputs, MyDense(4, name="mine")(keras.layers.Dense(8)(inputs)))
    with pytest.warns(UserWarning, match=r"1 layer\(s\) subclassing Dense.*mine \(MyDense\)"):
        converted = f8.convert_model(model, recipe=RECIPE)
    assert type(converted.get_layer("mine")) is MyDense
    assert isinstance(converted.layers[1], f8.Dense)


def test_convert_model_takes_a_functional_model_with_keras_ops_on_tensors(rng) -> None:
    """Operators and keras.ops calls on symbolic tensors (a residual ``h + relu(h)``) are
    operations, not layers, in the model graph: they are cloned, and only layers swapped."""
    keras.utils.set_random_seed(4)
    inputs = keras.Input((12,))
    h = keras.layers.Dense(8)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(h * 2.0 + keras.ops.relu(h)))
    converted = f8.convert_model(model, recipe=None)
    x = random_fp8_friendly(rng, (4, 12))
    np.testing.assert_array_equal(converted(x).numpy(), model(x).numpy())
    assert sum(isinstance(layer, f8.Dense) for layer in converted.layers) == 2


def test_convert_model_swaps_dense_layers_and_keeps_weights(rng) -> None:
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5, 12))
    h = keras.layers.Dense(16, activation="gelu")(inputs)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.EinsumDense("abc,cd->abd", (5, 8), bias_axes="d")(h)
    outputs = keras.layers.Dense(3)(keras.layers.Flatten()(h))
    functional = keras.Model(inputs, outputs)
    sequential = keras.Sequential(
        [keras.Input((12,)), keras.layers.Dense(8), keras.layers.Dense(2)]
    )
    x = random_fp8_friendly(rng, (4, 5, 12))
    for model, data in ((functional, x), (sequential, x[:, 0])):
        exact = f8.convert_model(model, recipe=None)
        np.testing.assert_array_equal(exact(data).numpy(), model(data).numpy())
        converted = f8.convert_model(model, recipe=RECIPE)
        plain = (keras.layers.Dense, keras.layers.EinsumDense)
        old = [layer for layer in model.layers if type(layer) in plain]
        new = [layer for layer in converted.layers if isinstance(layer, (f8.Dense, f8.EinsumDense))]
        assert len(new) == len(old) > 0 and all(layer.recipe == RECIPE for layer in new)
        for o, n in zip(old, new, strict=True):
            np.testing.assert_array_equal(o.kernel.numpy(), n.kernel.numpy())
        ref = model(data).numpy()
        # Three FP8 layers at their first step (unity scales: small activations land in E4M3's
        # subnormal range, up to 2^-10 absolute error, on top of 2^-4 relative for normal
        # values). Norm-wise the output stayed within 0.11 of high precision over 25 seeds;
        # single elements near a cancellation err more, so no element-wise bound.
        diff = np.linalg.norm(converted(data).numpy() - ref) / np.linalg.norm(ref)
        assert diff < 0.2, diff
    for answer in (None, "no", 1):  # a filter that forgot its return converted nothing
        with pytest.raises(TypeError, match=rf"^layer_filter must return a bool, got {answer!r}"):
            f8.convert_model(sequential, layer_filter=lambda layer, answer=answer: answer)
    only_last = f8.convert_model(sequential, layer_filter=lambda layer: np.int64(layer.units) == 2)
    assert [type(layer).__name__ for layer in only_last.layers] == ["Dense", "Dense"]
    assert not isinstance(only_last.layers[0], f8.Dense) and isinstance(
        only_last.layers[1], f8.Dense
    )

    class Sub(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(TypeError, match="needs a Functional or Sequential model"):
        f8.convert_model(Sub())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f8.convert_model(sequential)  # no warning on the normal path


def test_eager_fit_updates_once_per_step(rng) -> None:
    x, y = batches(rng, 2)
    model = mlp()
    model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    hist_f, _, count_f, _, _, count_b, _ = state_arrays(model.get_layer("fc1"))
    np.testing.assert_array_equal(count_f, [2, 2, 0])
    np.testing.assert_array_equal(count_b, [2, 0])
    np.testing.assert_array_equal(hist_f[2:, 0], np.abs(x).reshape(2, -1).max(1))


def test_fit_with_optimizer_gradient_accumulation_takes_the_max(rng) -> None:
    """Optimizer and layers both accumulate 2 batches: one event per optimizer step, recording
    the max over its two batches."""
    x, y = batches(rng, 4)
    with f8.autocast(recipe=RECIPE, gradient_accumulation_steps=2):
        model = mlp(recipe=f8.UNSET)
    model.compile(optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=2), loss="mse")
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    hist_f, _, count_f, _, _, count_b, micro = state_arrays(model.get_layer("fc1"))
    np.testing.assert_array_equal(count_f, [2, 2, 0])
    np.testing.assert_array_equal(count_b, [2, 0])
    np.testing.assert_array_equal(hist_f[2:, 0], np.abs(x).reshape(2, -1).max(1))
    assert micro == 0


def test_recompute_grad_trains_bit_for_bit_like_the_plain_step(rng) -> None:
    """``tf.recompute_grad`` runs the forward again inside the same step, before its update
    event: the scales have not moved and a second amax record is a max of equal values, so the
    step needs nothing like torch's activation_checkpoint (docs/keras.md)."""
    xs = [random_fp8_friendly(rng, (8, 12), 2.0**k) for k in range(3)]
    ys = [random_fp8_friendly(rng, (8, 4)) for _ in range(3)]

    def train(remat: bool) -> list[np.ndarray]:
        model, opt = mlp(seed=1), keras.optimizers.SGD(0.1)

        def forward(x):
            return model(x, training=True)

        run = tf.recompute_grad(forward) if remat else forward

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((run(x) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_weights)
            opt.apply(grads, model.trainable_weights)

        for x, y in zip(xs, ys, strict=True):
            step(tf.constant(x), tf.constant(y))
        return [w.numpy() for w in model.weights]  # kernels, biases and FP8 state

    for a, b in zip(train(False), train(True), strict=True):
        np.testing.assert_array_equal(a, b)


def test_convert_model_copies_trained_biases(rng) -> None:
    inputs = keras.Input((5, 12))
    h = keras.layers.Dense(16, name="d")(inputs)
    outputs = keras.layers.EinsumDense("abc,cd->abd", (5, 8), bias_axes="d", name="e")(h)
    model = keras.Model(inputs, outputs)
    for layer in model.layers[1:]:  # biases as after training: not Keras's zero init
        layer.bias.assign(random_fp8_friendly(rng, tuple(layer.bias.shape)))
    converted = f8.convert_model(model, recipe=RECIPE)
    for name in ("d", "e"):
        old, new = model.get_layer(name), converted.get_layer(name)
        assert isinstance(new, (f8.Dense, f8.EinsumDense)) and new.recipe == RECIPE
        np.testing.assert_array_equal(new.kernel.numpy(), old.kernel.numpy())
        np.testing.assert_array_equal(new.bias.numpy(), old.bias.numpy())

"""fp8kit.keras Dense / EinsumDense on the TensorFlow backend: the GEMM against a float64
reference, drop-in behaviour, training=False, reuse, gradient accumulation, bad input."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import fp8kit.keras as f8
from fp8kit.formats import E4M3, E5M2
from tests.keras.helpers import dense, random_fp8_friendly, state_arrays, train_step_fn
from tests.reference import quantize_reference, update_reference


def qdq(x: np.ndarray, scale: float, fmt) -> np.ndarray:
    """Dequantized float64 values of quantize(x, scale) (bit-layout reference)."""
    q, _ = quantize_reference(x, scale, fmt)
    return q * float(np.float32(1.0) / np.float32(scale))


def close(actual: np.ndarray, reference: np.ndarray) -> None:
    """Equal up to float32 accumulation of exact FP8 products (relative to the magnitude)."""
    np.testing.assert_allclose(actual, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())


def test_dense_gemm_and_gradients_match_the_float64_reference(rng) -> None:
    """y = Q(x) Q(W) + b, dX = Q(dY) Q(W)^T, dW = Q(x)^T Q(dY) with E4M3 operands forward and
    E5M2 for dY, at the layer's current (non-unity) scales, on 3-D input."""
    recipe = f8.DelayedScaling(amax_history_len=2)
    w = random_fp8_friendly(rng, (24, 12), 0.1)
    b = random_fp8_friendly(rng, (12,))
    layer = dense(12, w, b, recipe)
    fs, bs = np.float32([37.5, 900.25, 1.0]), np.float32([3.0e3, 1.0])
    layer.fp8_state.fwd_scale.assign(fs)
    layer.fp8_state.bwd_scale.assign(bs)
    x = random_fp8_friendly(rng, (2, 5, 24))
    g = random_fp8_friendly(rng, (2, 5, 12), 0.01)
    y, dx, dk, db = train_step_fn(layer, jit_compile=False)(tf.constant(x), tf.constant(g))
    xq, wq, gq = qdq(x, fs[0], E4M3), qdq(w, fs[1], E4M3), qdq(g, bs[0], E5M2)
    close(y.numpy(), xq @ wq + b)
    close(dx.numpy(), gq @ wq.T)
    close(dk.numpy(), np.einsum("abi,abj->ij", xq, gq))
    np.testing.assert_allclose(db.numpy(), g.sum(axis=(0, 1)), rtol=1e-6, atol=1e-7)
    # that training step observed max|x|, max|W|, max|dY| and ran one event
    hist_f, _, count_f, hist_b, _, count_b, _ = state_arrays(layer)
    np.testing.assert_array_equal(hist_f[1], [np.abs(x).max(), np.abs(w).max(), 0])
    np.testing.assert_array_equal(hist_b[1], [np.abs(g).max(), 0])
    np.testing.assert_array_equal(count_f, [1, 1, 0])
    np.testing.assert_array_equal(count_b, [1, 0])


def _einsum_step(
    rng: np.random.Generator, layer: f8.EinsumDense, x_shape: tuple[int, ...]
) -> tuple:
    """One taped training call of ``layer`` on a random FP8-friendly input: ``(x, kernel, g, y,
    dx, dkernel)`` as NumPy arrays / tensors, with the loss ``sum(y * g)``."""
    x = random_fp8_friendly(rng, x_shape)
    g = random_fp8_friendly(rng, tuple(layer(x).shape), 0.1)  # the first call builds the layer
    w = layer.kernel.numpy()
    with tf.GradientTape() as tape:
        xt = tf.constant(x)
        tape.watch(xt)
        y = layer(xt, training=True)
        loss = tf.reduce_sum(y * g)
    dx, dk = tape.gradient(loss, [xt, layer.kernel])
    return x, w, g, y, dx, dk


@pytest.mark.parametrize(
    "equation,out_shape,bias_axes,x_shape",
    [("abc,cd->abd", (None, 6), "d", (2, 3, 8)), ("...b,bc->...c", 6, None, (2, 3, 8)),
     ("abc,bcd->ad", 6, "d", (2, 3, 8))],
)  # fmt: skip
def test_einsum_dense_matches_the_reference(rng, equation, out_shape, bias_axes, x_shape) -> None:
    layer = f8.EinsumDense(equation, out_shape, bias_axes=bias_axes, recipe=f8.DelayedScaling())
    x, w, g, y, dx, dk = _einsum_step(rng, layer, x_shape)
    y_shape = g.shape
    eq = equation.replace("...", "Z") if "..." in equation else equation
    xr, yr = (
        (x.reshape(-1, x_shape[-1]), g.reshape(-1, g.shape[-1])) if "..." in equation else (x, g)
    )
    xq, wq, gq = qdq(xr, 1.0, E4M3), qdq(w, 1.0, E4M3), qdq(yr, 1.0, E5M2)
    lhs, out = eq.split("->")
    xs, ws = lhs.split(",")
    bias = 0.0 if layer.bias is None else layer.bias.numpy()
    y_ref = np.einsum(eq, xq, wq).reshape(y_shape) + bias
    close(y.numpy(), y_ref)
    close(dx.numpy(), np.einsum(f"{out},{ws}->{xs}", gq, wq).reshape(x_shape))
    close(dk.numpy(), np.einsum(f"{xs},{out}->{ws}", xq, gq))
    assert layer.fp8_state.fwd_count.numpy()[0] == 1


def test_any_letter_works_beside_an_ellipsis(rng) -> None:
    """The flattened ellipsis used the letter Z, so '...bZ,Zd->...bd', legal in Keras, was
    refused; it now trains exactly as the same equation spelled with other letters."""
    x = tf.constant(random_fp8_friendly(rng, (2, 3, 8)))
    g = tf.constant(random_fp8_friendly(rng, (2, 3, 6), 0.1))
    results = []
    for equation in ("...bZ,Zd->...bd", "...bk,kd->...bd"):
        layer = f8.EinsumDense(equation, (3, 6), bias_axes="d", recipe=f8.DelayedScaling())
        layer.build(x.shape)
        layer.kernel.assign(random_fp8_friendly(np.random.default_rng(0), (8, 6)))
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, training=True) * g)
        results.append([*tape.gradient(loss, [x, layer.kernel]), loss, *state_arrays(layer)])
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_recipe_none_is_exactly_keras_dense(rng) -> None:
    x = random_fp8_friendly(rng, (4, 10))
    ref = keras.layers.Dense(7, activation="relu", kernel_regularizer="l2", name="d")
    ours = f8.Dense(7, activation="relu", kernel_regularizer="l2", name="d", recipe=None)
    ref.build((None, 10))
    ours.build((None, 10))
    ours.set_weights(ref.get_weights())
    np.testing.assert_array_equal(ours(x).numpy(), ref(x).numpy())
    assert ours.fp8_state is None and [v.path for v in ours.weights] == [
        v.path for v in ref.weights
    ]
    assert len(ours.losses) == len(ref.losses) == 1  # the regularizer


def test_drop_in_arguments_config_and_mixed_bfloat16(rng) -> None:
    layer = f8.Dense(
        5,
        activation="gelu",
        kernel_initializer="he_normal",
        bias_initializer="ones",
        kernel_constraint=keras.constraints.MaxNorm(2.0),
        dtype="mixed_bfloat16",
        recipe=f8.DelayedScaling(amax_history_len=8, margin=1),
    )
    x = random_fp8_friendly(rng, (3, 6))
    y = layer(x, training=False)
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    assert all(v.dtype == "float32" for v in layer.fp8_state.variables)
    np.testing.assert_array_equal(layer.bias.numpy(), np.ones(5, np.float32))
    config = layer.get_config()
    clone = f8.Dense.from_config(config)
    assert clone.recipe == layer.recipe and clone.dtype_policy.name == "mixed_bfloat16"
    assert {v.path.split("/")[-1] for v in layer.non_trainable_weights} == set(f8.STATE_VARIABLES)
    assert {v.path.split("/")[-1] for v in layer.trainable_weights} == {"kernel", "bias"}
    step = train_step_fn(layer)
    step(tf.constant(x), tf.constant(np.ones((3, 5), np.float32)))
    assert layer.fp8_state.fwd_count.numpy()[0] == 1


def test_mixed_bfloat16_quantizes_the_float32_master_kernel(rng) -> None:
    """Under mixed_bfloat16 the kernel's FP8 cast reads the float32 master copy, as under the
    float32 policy (and as fp8kit.torch under torch.autocast): the same output, WEIGHT amax and
    float32 kernel gradient. Keras's autocast rounded it to bfloat16 first: 1.0625 + 2**-12 went
    to 1.0625 (an E4M3 tie, to 1.0) instead of 1.125, and dW came back bfloat16-rounded."""
    w = np.array([[1.0625 + 2**-12, 0.3], [0.0, -2.7]], np.float32)
    x = np.array([[1.0, 0.0], [0.37, 1.5]], np.float32)
    g = np.array([[1.0, 0.3], [0.1, 1.9]], np.float32)
    out = {}
    for policy in ("float32", "mixed_bfloat16"):
        layer = f8.Dense(2, use_bias=False, dtype=policy, recipe=f8.DelayedScaling())
        layer.build((None, 2))
        layer.kernel.assign(w)
        with tf.GradientTape() as tape:
            y = layer(tf.constant(x), training=True)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * g)
        dw = tape.gradient(loss, layer.kernel)
        hist = layer.fp8_state.fwd_history.numpy()
        out[policy] = (tf.cast(y, tf.float32).numpy(), hist[-1, 1], dw)
    (y32, amax32, dw32), (y16, amax16, dw16) = out["float32"], out["mixed_bfloat16"]
    assert y32[0, 0] == 1.125 and y16[0, 0] == 1.125
    assert amax16 == amax32 == np.abs(w).max()
    assert dw16.dtype == tf.float32
    np.testing.assert_array_equal(dw16.numpy(), dw32.numpy())


def test_training_false_and_inference_leave_state_unchanged(rng) -> None:
    layer = dense(6, random_fp8_friendly(rng, (8, 6)), np.zeros(6, np.float32), f8.DelayedScaling())
    x = tf.constant(random_fp8_friendly(rng, (4, 8)))
    train_step_fn(layer)(x, tf.ones((4, 6)))
    before = state_arrays(layer)

    @tf.function(jit_compile=True)
    def eval_grad(x):
        with tf.GradientTape() as tape:
            y = layer(x, training=False)
            loss = tf.reduce_sum(y)
        return tape.gradient(loss, layer.kernel)

    eval_grad(x)
    layer(x)
    model = keras.Sequential([keras.Input((8,)), layer])
    model.predict(x.numpy(), verbose=0)
    model.compile(loss="mse")
    model.evaluate(x.numpy(), np.zeros((4, 6), np.float32), verbose=0)
    for a, b in zip(before, state_arrays(layer), strict=True):
        np.testing.assert_array_equal(a, b)


def test_reused_layer_records_the_max_of_its_calls_in_one_event(rng) -> None:
    """A layer called twice in one traced step: one event, input amax = max of both inputs, dY
    amax = max of both output gradients (docs/semantics.md section 3 staging row), whatever the
    backward order."""
    recipe = f8.DelayedScaling(amax_history_len=3)
    w = random_fp8_friendly(rng, (8, 8), 0.1)
    layer = dense(8, w, np.zeros(8, np.float32), recipe)
    a, c = random_fp8_friendly(rng, (4, 8)), random_fp8_friendly(rng, (4, 8), 4.0)
    ga, gc = random_fp8_friendly(rng, (4, 8)), random_fp8_friendly(rng, (4, 8), 0.25)

    @tf.function(jit_compile=True)
    def step(a, c):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(a, training=True) * ga) + tf.reduce_sum(
                layer(c, training=True) * gc
            )
        return tape.gradient(loss, layer.kernel)

    step(tf.constant(a), tf.constant(c))
    hist_f, scale_f, count_f, hist_b, _, count_b, _ = state_arrays(layer)
    want_f = [max(np.abs(a).max(), np.abs(c).max()), np.abs(w).max(), 0]
    want_b = [max(np.abs(ga).max(), np.abs(gc).max()), 0]
    np.testing.assert_array_equal(hist_f[-1], np.float32(want_f))
    np.testing.assert_array_equal(hist_b[-1], np.float32(want_b))
    np.testing.assert_array_equal(count_f, [1, 1, 0])
    np.testing.assert_array_equal(count_b, [1, 0])
    np.testing.assert_array_equal(scale_f[:2], np.float32(448) / np.float32(want_f[:2]))


@pytest.mark.parametrize("target_first", [False, True])
def test_a_reused_layers_target_call_under_stop_gradient_is_observed(rng, target_first) -> None:
    """A target branch (``tf.stop_gradient`` on one call's output) records its input amax in
    the step's event whatever the call order: the chain carries the running max of its calls'
    forward amaxes to the head's backward (ADR 0264). Before, a target call made last was lost.
    Its output gradient, never computed, adds nothing to the backward amax."""
    recipe = f8.DelayedScaling(amax_history_len=2)
    w = random_fp8_friendly(rng, (8, 8), 0.1)
    layer = dense(8, w, np.zeros(8, np.float32), recipe)
    a, c = random_fp8_friendly(rng, (4, 8)), random_fp8_friendly(rng, (4, 8), 8.0)
    ga = random_fp8_friendly(rng, (4, 8))

    @tf.function(jit_compile=True)
    def step(a, c):
        with tf.GradientTape() as tape:
            if target_first:
                target = tf.stop_gradient(layer(c, training=True))
                y = layer(a, training=True)
            else:
                y = layer(a, training=True)
                target = tf.stop_gradient(layer(c, training=True))
            loss = tf.reduce_sum((y - target) * ga)
        return tape.gradient(loss, layer.kernel)

    step(tf.constant(a), tf.constant(c))
    hist_f, _, count_f, hist_b, _, _, _ = state_arrays(layer)
    want_f = [max(np.abs(a).max(), np.abs(c).max()), np.abs(w).max(), 0]
    np.testing.assert_array_equal(hist_f[-1], np.float32(want_f))
    np.testing.assert_array_equal(hist_b[-1], np.float32([np.abs(ga).max(), 0]))
    np.testing.assert_array_equal(count_f, [1, 1, 0])


def test_training_left_out_under_a_tape_warns_once(rng) -> None:
    """A custom loop that leaves ``training`` out runs the layer as inference, and its FP8 state
    never updates: a call a GradientTape records says so once per layer. An explicit flag, or
    no tape (prediction), says nothing."""
    layer = dense(4, random_fp8_friendly(rng, (8, 4)), np.zeros(4, np.float32), f8.DelayedScaling())
    x = tf.constant(random_fp8_friendly(rng, (2, 8)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x)
        with tf.GradientTape():
            layer(x, training=False)
            layer(x, training=True)
    with tf.GradientTape(), pytest.warns(UserWarning, match="called with training unset while"):
        layer(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tf.GradientTape():
            layer(x)  # once per layer
    assert float(np.asarray(layer.fp8_state.fwd_count)[0]) == 0.0


def test_eager_reused_layer_backward_keeps_its_forward_scales() -> None:
    """Eager TF runs one update event per call's backward. In ``f(0.3 * f(x))`` the outer
    call's backward runs first (dY = 1000: scale 1, E5M2 1024, then its event sets the scale to
    57344/1024); the inner call's backward must quantize its dY (1024 * 0.3 = 307.2) with the
    scale current at its forward, 1: E5M2(307.2) = 320, not 285.71 at the new scale.
    Fp8State.read() hands out snapshots, not the variables."""
    layer = f8.Dense(2, use_bias=False, recipe=f8.DelayedScaling(amax_history_len=1))
    layer.build((None, 2))
    layer.kernel.assign(np.eye(2, dtype=np.float32))
    x = tf.ones((1, 2))
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(layer(x, training=True) * 0.3, training=True)
        loss = tf.reduce_sum(y * 1000.0)
    np.testing.assert_array_equal(tape.gradient(loss, x).numpy(), [[320.0, 320.0]])


def test_gradient_accumulation_takes_the_max_and_updates_every_k_passes(rng) -> None:
    recipe = f8.DelayedScaling(amax_history_len=4)
    w = random_fp8_friendly(rng, (8, 4))
    layer = dense(4, w, np.zeros(4, np.float32), recipe, gradient_accumulation_steps=3)
    step = train_step_fn(layer)
    h = np.zeros((4, 5), np.float32)
    s, c = np.ones(5, np.float32), np.zeros(5, np.int64)
    fmax = np.array([448] * 3 + [57344] * 2, np.float64)
    for k in range(6):
        x = random_fp8_friendly(rng, (2, 8), 2.0**k)
        g = random_fp8_friendly(rng, (2, 4), 2.0**-k)
        step(tf.constant(x), tf.constant(g))
        h[0] = np.maximum(h[0], [np.abs(x).max(), np.abs(w).max(), 0, np.abs(g).max(), 0])
        if k % 3 == 2:  # reference: one event (docs/semantics.md) per fmax group, staged max
            hf, sf, cf = update_reference(h[:, :3], s[:3], c[:3], recipe, 448.0)
            hb, sb, cb = update_reference(h[:, 3:], s[3:], c[3:], recipe, 57344.0)
            h, s, c = (
                np.concatenate([hf, hb], 1),
                np.concatenate([sf, sb]),
                np.concatenate([cf, cb]),
            )
        hist_f, scale_f, count_f, hist_b, scale_b, count_b, micro = state_arrays(layer)
        np.testing.assert_array_equal(np.concatenate([hist_f, hist_b], 1), h, err_msg=f"pass {k}")
        np.testing.assert_array_equal(np.concatenate([scale_f, scale_b]), s)
        np.testing.assert_array_equal(np.concatenate([count_f, count_b]), c)
        assert micro == (k + 1) % 3
    assert fmax.size == 5


def test_bad_input_raises_clear_errors(rng, tmp_path) -> None:
    with pytest.raises(
        TypeError,
        match=r"recipe must be None \(high precision\) or an fp8kit.recipe.DelayedScaling",
    ):
        f8.Dense(4, recipe="hybrid")
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be an int >= 1"):
        f8.Dense(4, gradient_accumulation_steps=0)
    assert f8.Dense(4, gradient_accumulation_steps=np.int64(2)).gradient_accumulation_steps == 2
    with pytest.raises(TypeError, match="gradient_accumulation_steps must be an int"):
        f8.autocast(gradient_accumulation_steps=1.5).__enter__()
    with pytest.raises(TypeError, match="amax_history_len must be an int"):
        f8.DelayedScaling(amax_history_len="4")
    layer = f8.Dense(4)
    allowed = r"\(float16, bfloat16, float32, float64\)"
    with pytest.raises(
        TypeError, match=rf"inputs must have a high-precision float dtype {allowed}"
    ):
        layer(tf.ones((2, 3), tf.int32))
    with pytest.raises(TypeError, match="training must be None, a bool or a 0-d boolean tensor"):
        layer(tf.ones((2, 3)), training="False")  # was a training call
    layer(tf.ones((2, 3)), training=tf.constant(False))  # as Keras's own layers take it
    traced = tf.function(lambda x, flag: layer(x, training=flag))
    with pytest.raises(TypeError, match=r"training must be a Python bool or a concrete tensor"):
        traced(tf.ones((2, 3)), tf.constant(False))  # symbolic: which step it is is not known
    # (FP8 inputs are cast to the compute dtype by Keras itself, exactly, before call())
    with pytest.raises(ValueError, match="cannot be combined with fp8kit's FP8 GEMM"):
        f8.Dense(4, dtype="float8_from_float32")(tf.ones((2, 3)))
    with pytest.raises(ValueError, match="every input axis must meet the kernel"):
        f8.EinsumDense("abc,cd->ad", 5)(tf.ones((2, 3, 4)))
    with pytest.raises(ValueError, match="ellipsis only at the start"):
        f8.EinsumDense("ab...,bc->ac...", (5, 4))(tf.ones((2, 3, 4)))
    # a repeated letter in an operand (a diagonal) built and ran forward, then failed in the
    # backward pass with TensorFlow's error about a gradient equation nobody wrote
    for equation, shape in (("aab,bc->ac", (3, 3, 4)), ("ab,bbc->ac", (3, 4))):
        with pytest.raises(ValueError, match=r"repeats \['b'\]|repeats \['a'\]"):
            f8.EinsumDense(equation, 5)(tf.ones(shape))
    # a recipe whose callable a saved config cannot name: refused when saving, not at load
    lambda_recipe = f8.DelayedScaling(amax_compute_algo=lambda h: h[0])
    model = keras.Sequential([keras.Input((3,)), f8.Dense(4, recipe=lambda_recipe, name="d")])
    with pytest.raises(ValueError, match=r"Dense 'd' config: recipe\.amax_compute_algo .*<lambda>"):
        model.save(str(tmp_path / "m.keras"))


def test_dense_refuses_a_bool_unit_count() -> None:
    """Keras reads True as 1 unit."""
    with pytest.raises(TypeError, match=r"^units must be an int >= 1, got True"):
        f8.Dense(True, recipe=f8.DelayedScaling())


def test_fp8_state_checks_its_arguments_and_observations() -> None:
    """Fp8State is public: a bad recipe, GEMM count or accumulation count is refused when it is
    made (a string recipe used to be kept and never update), and observe() names a vector of
    the wrong length (it failed inside a broadcast)."""
    owner = keras.layers.Dense(4)
    with pytest.raises(TypeError, match=r"^recipe must be None \(high precision\) or an fp8kit"):
        f8.Fp8State(owner, "not a recipe", 1, 1)
    with pytest.raises(TypeError, match=r"^recipe must be an fp8kit\.recipe\.DelayedScaling"):
        f8.Fp8State(owner, None, 1, 1)
    with pytest.raises(TypeError, match=r"^num_gemms must be an int >= 1, got '1'"):
        f8.Fp8State(owner, f8.DelayedScaling(), "1", 1)
    with pytest.raises(ValueError, match=r"^gradient_accumulation_steps must be an int >= 1"):
        f8.Fp8State(owner, f8.DelayedScaling(), 1, 0)
    state = f8.Fp8State(owner, f8.DelayedScaling(amax_history_len=2), 1, 1)
    with pytest.raises(ValueError, match=r"^amaxes must have shape \(5,\): the 3 forward then 2"):
        state.observe(np.ones(3, np.float32))
    state.observe(np.ones(5, np.float32))  # the right length runs the event
    assert float(np.asarray(state.fwd_count)[0]) == 1.0


def test_keras_quantization_of_an_fp8_layer_is_refused_and_leaves_it_fp8() -> None:
    """``Model.quantize("float8", type_check=False)`` stacked Keras's float8 variables and
    quantization mode on an fp8kit layer; now the layer refuses, ``Model.quantize`` warns as it
    does for any layer it cannot quantize, and a ``recipe=None`` layer quantizes as Keras's."""
    for cls, args in ((f8.Dense, (4,)), (f8.EinsumDense, ("ab,bc->ac", 4))):
        layer = cls(*args)
        model = keras.Sequential([keras.Input((8,)), layer])
        n_weights = len(layer.weights)
        for mode in ("float8", "int8"):
            with pytest.warns(UserWarning, match=f"Keras quantization mode '{mode}' cannot"):
                model.quantize(mode, type_check=False)
            with pytest.raises(NotImplementedError, match="construct the layer with recipe=None"):
                layer.quantize(mode)
        assert layer.quantization_mode is None and len(layer.weights) == n_weights
        model.predict(np.ones((2, 8), np.float32), verbose=0)


@pytest.mark.parametrize("mode", ["int8", "float8"])
def test_a_recipe_none_layer_takes_keras_quantization_as_keras_dense_does(tmp_path, mode) -> None:
    """With recipe=None the layers are Keras's: ``quantize`` (layer or model, default
    type_check), a quantized dtype policy at construction, and a ``.keras`` round trip of the
    quantized model work and compute what ``keras.layers.Dense`` computes. Keras's subclass
    check refused all but ``Model.quantize(type_check=False)``, and a quantized policy raised
    at build (so such a file could not be loaded)."""
    x = np.linspace(-2.0, 2.0, 16, dtype=np.float32).reshape(2, 8)
    kernel = np.linspace(-1.0, 1.0, 32, dtype=np.float32).reshape(8, 4)
    bias = np.ones(4, np.float32)

    def quantized(cls: Any, how: str) -> keras.Model:
        layer = cls(4)
        model = keras.Sequential([keras.Input((8,)), layer])
        layer.set_weights([kernel, bias])
        if how == "layer":
            layer.quantize(mode)
        else:
            model.quantize(mode)
        assert layer.quantization_mode == mode
        return model

    want = quantized(keras.layers.Dense, "model")(x).numpy()
    for how in ("layer", "model"):
        model = quantized(lambda n: f8.Dense(n, recipe=None), how)
        np.testing.assert_array_equal(model(x).numpy(), want)
    path = str(tmp_path / "quantized.keras")
    model.save(path)
    np.testing.assert_array_equal(keras.models.load_model(path)(x).numpy(), want)
    policy = {"int8": "int8_from_float32", "float8": "float8_from_float32"}[mode]
    built = f8.Dense(4, recipe=None, dtype=policy)
    assert built(x).shape == (2, 4) and built.quantization_mode == mode


def test_autocast_sets_construction_defaults_only() -> None:
    recipe = f8.DelayedScaling(amax_history_len=7)
    with f8.autocast(recipe=recipe, gradient_accumulation_steps=2):
        inside = f8.Dense(3)
        explicit = f8.Dense(3, recipe=None)
    with f8.autocast(enabled=False):
        disabled = f8.Dense(3)
    outside = f8.Dense(3)
    assert inside.recipe == recipe and inside.gradient_accumulation_steps == 2
    assert explicit.recipe is None and disabled.recipe is None
    assert outside.recipe == f8.DelayedScaling() and outside.gradient_accumulation_steps == 1
    inside.build((None, 4))
    assert inside.fp8_state.fwd_history.shape == (7, 3)


def test_accumulation_steps_are_refused_where_no_update_event_uses_them() -> None:
    """Float8CurrentScaling has no update events: a count > 1 given for it would be ignored, so
    it is refused where it enters; a current-scaling layer in a delayed-scaling block that
    counts microbatches takes 1, not the block's count."""
    current = f8.Float8CurrentScaling()
    message = r"gradient_accumulation_steps=3 has no effect with Float8CurrentScaling"
    with pytest.raises(ValueError, match=message):
        f8.Dense(4, recipe=current, gradient_accumulation_steps=3)
    with pytest.raises(ValueError, match=message):
        f8.autocast(recipe=current, gradient_accumulation_steps=3).__enter__()
    with pytest.raises(ValueError, match=message):
        f8.Fp8State(keras.layers.Layer(), current, 1, 3)
    with f8.autocast(recipe=f8.DelayedScaling(), gradient_accumulation_steps=3):
        mixed = f8.Dense(4, recipe=current)
        delayed = f8.Dense(4)
    assert mixed.gradient_accumulation_steps == 1 and delayed.gradient_accumulation_steps == 3
    assert f8.Dense(4, recipe=current, gradient_accumulation_steps=1).recipe == current
    # a layer without FP8 keeps what it was given (its config round-trips unchanged)
    assert f8.Dense(4, recipe=None, gradient_accumulation_steps=3).gradient_accumulation_steps == 3


def test_current_scaling_quantizes_with_its_own_amax_and_keeps_no_history(rng) -> None:
    w = random_fp8_friendly(rng, (16, 8))
    layer = dense(8, w, np.zeros(8, np.float32), f8.Float8CurrentScaling())
    x = random_fp8_friendly(rng, (4, 16), 30.0)
    g = random_fp8_friendly(rng, (4, 8), 1e-3)
    y, dx, _, _ = train_step_fn(layer)(tf.constant(x), tf.constant(g))
    own = lambda t, fmt: float(np.float32(fmt.max) / np.float32(np.abs(t).max()))  # noqa: E731
    xq, wq = qdq(x, own(x, E4M3), E4M3), qdq(w, own(w, E4M3), E4M3)
    close(y.numpy(), xq @ wq)
    close(dx.numpy(), qdq(g, own(g, E5M2), E5M2) @ wq.T)
    assert layer.fp8_state.fwd_history.shape == (1, 3)
    for value, init in zip(state_arrays(layer), (0, 1, 0, 0, 1, 0, 0), strict=True):
        np.testing.assert_array_equal(value, init)


def test_callable_algorithms_run_inside_the_compiled_step(rng) -> None:
    """A callable amax_compute_algo / scaling_factor_compute_algo receives backend tensors in
    the jit_compile'd step; written as "max" and the default rule they give the same state."""
    builtin = f8.DelayedScaling(amax_history_len=3, margin=1)
    custom = f8.DelayedScaling(
        amax_history_len=3,
        amax_compute_algo=lambda h: keras.ops.max(h, axis=0),
        scaling_factor_compute_algo=lambda amax, old, fmax, r: fmax / 2.0 / amax,
    )
    w = random_fp8_friendly(rng, (8, 4))
    layers = [dense(4, w, np.zeros(4, np.float32), r) for r in (builtin, custom)]
    steps = [train_step_fn(layer) for layer in layers]
    for k in range(3):
        x = tf.constant(random_fp8_friendly(rng, (2, 8), 2.0**k))
        g = tf.constant(random_fp8_friendly(rng, (2, 4)))
        for step in steps:
            step(x, g)
        for a, c in zip(state_arrays(layers[0]), state_arrays(layers[1]), strict=True):
            np.testing.assert_array_equal(a, c)
    assert layers[1].fp8_state.fwd_count.numpy()[0] == 3


def test_a_callable_returning_one_value_for_every_column_is_refused(rng) -> None:
    """A 0-d result (TE's per-module ``h.max()``) is refused as in fp8kit.torch and fp8kit.jax,
    where it would give every module of the event one amax."""
    whole = f8.DelayedScaling(amax_history_len=2, amax_compute_algo=lambda h: keras.ops.max(h))
    layer = dense(4, random_fp8_friendly(rng, (8, 4)), np.zeros(4, np.float32), whole)
    x, g = random_fp8_friendly(rng, (2, 8)), random_fp8_friendly(rng, (2, 4))
    with pytest.raises(ValueError, match=r"amax_compute_algo must return a tensor of shape"):
        train_step_fn(layer, jit_compile=False)(tf.constant(x), tf.constant(g))


def test_a_training_call_outside_any_tape_neither_observes_nor_blocks_the_step(rng) -> None:
    """``layer(x, training=True)`` without a GradientTape (e.g. a teacher pass) leaves the state
    alone, and the taped call after it in the same traced step still runs its event."""
    layer = dense(4, random_fp8_friendly(rng, (8, 4)), np.zeros(4, np.float32), f8.DelayedScaling())
    big = random_fp8_friendly(rng, (2, 8), 64.0)
    x = random_fp8_friendly(rng, (2, 8))

    @tf.function(jit_compile=True)
    def step(big, x):
        teacher = layer(big, training=True)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x, training=True)) + 0.0 * tf.reduce_sum(teacher)
        return tape.gradient(loss, layer.kernel)

    step(tf.constant(big), tf.constant(x))
    hist_f, _, count_f, _, _, _, _ = state_arrays(layer)
    np.testing.assert_array_equal(count_f, [1, 1, 0])
    assert hist_f[-1, 0] == np.abs(x).max()  # the teacher's larger input was not observed


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_a_second_derivative_raises(rng, mode: str) -> None:
    """A gradient penalty through an FP8 Dense with nested tapes: the first derivatives equal a
    plain tape's; differentiating them raises, where the outer tape silently dropped the kernel
    term (the FP8 copies the backward uses are made where no tape records them)."""
    w = random_fp8_friendly(rng, (3, 2))
    layer = dense(2, w, np.zeros(2, np.float32), f8.DelayedScaling())
    x = tf.constant(random_fp8_friendly(rng, (2, 3)))

    def first(x: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, training=False))
        return tape.gradient(loss, x)

    def penalty(x: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                inner.watch(x)
                loss = tf.reduce_sum(layer(x, training=True))
            dx = inner.gradient(loss, x)
            total = loss + tf.reduce_sum(dx**2)
        return outer.gradient(total, layer.kernel)

    run = tf.function(penalty) if mode == "function" else penalty
    w_fp8 = quantize_reference(w, 1.0, E4M3)[0]  # scale 1: dY = 1 is exact in E5M2
    np.testing.assert_allclose(first(x).numpy(), np.ones((2, 2)) @ w_fp8.T, rtol=1e-6)
    with pytest.raises(TypeError, match="differentiate twice through an FP8 GEMM"):
        run(x)


def test_a_function_traced_without_a_tape_still_updates_when_a_tape_records_it(rng) -> None:
    """A tf.function whose first trace ran with no tape (a warm-up call), later called under a
    GradientTape: its backward runs an update event per taped call. The untaped first trace
    used to bake in the frozen path, so the scales never moved."""
    layer = dense(2, random_fp8_friendly(rng, (3, 2)), np.zeros(2, np.float32), f8.DelayedScaling())
    x = tf.constant(random_fp8_friendly(rng, (4, 3)))
    forward = tf.function(lambda t: layer(t, training=True))
    forward(x)  # traced here, with no tape: no event (nothing records its backward)
    np.testing.assert_array_equal(layer.fp8_state.fwd_count.numpy(), [0, 0, 0])
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(forward(x))
        assert tape.gradient(loss, layer.kernel) is not None
    np.testing.assert_array_equal(layer.fp8_state.fwd_count.numpy(), [3, 3, 0])
    assert forward.experimental_get_tracing_count() == 1  # the untaped trace was reused


@pytest.mark.parametrize("order", ["interleaved", "forwards first"])
def test_two_tapes_in_one_step_give_one_event_each_in_any_order(rng, order: str) -> None:
    """One layer under two GradientTapes in a traced step (a GAN-style loop): an event per tape,
    each with its own call's amaxes, also when both forward passes run before either gradient.
    There the second call used to chain to the first tape's call, which its tape never
    recorded, so its backward amax was lost and its forward amax joined the first event."""
    layer = dense(
        2,
        np.full((4, 2), 0.5, np.float32),
        np.zeros(2, np.float32),
        f8.DelayedScaling(amax_history_len=4),
    )
    x1, x2 = tf.fill((2, 4), 3.0), tf.fill((2, 4), 5.0)
    g1, g2 = tf.fill((2, 2), 1.0), tf.fill((2, 2), 8.0)

    @tf.function
    def step() -> None:
        if order == "interleaved":
            with tf.GradientTape() as tape_a:
                loss_a = tf.reduce_sum(layer(x1, training=True) * g1)
            tape_a.gradient(loss_a, layer.kernel)
            with tf.GradientTape() as tape_b:
                loss_b = tf.reduce_sum(layer(x2, training=True) * g2)
            tape_b.gradient(loss_b, layer.kernel)
        else:
            with tf.GradientTape() as tape_a:
                loss_a = tf.reduce_sum(layer(x1, training=True) * g1)
            with tf.GradientTape() as tape_b:
                loss_b = tf.reduce_sum(layer(x2, training=True) * g2)
            tape_a.gradient(loss_a, layer.kernel)
            tape_b.gradient(loss_b, layer.kernel)

    step()
    hist_f, _, count_f, hist_b, _, count_b, _ = state_arrays(layer)
    np.testing.assert_array_equal(count_f, [2, 2, 0])
    np.testing.assert_array_equal(count_b, [2, 0])
    np.testing.assert_array_equal(hist_f[-2:, 0], [3.0, 5.0])  # INPUT, one entry per tape
    np.testing.assert_array_equal(hist_b[-2:, 0], [1.0, 8.0])  # GRAD_OUTPUT


@pytest.mark.parametrize("jit_compile", [False, True])
def test_matrix_vector_gemms_round_to_nearest_even_under_xla(rng, jit_compile: bool) -> None:
    """One output unit (the README's head) or one row: TensorFlow's XLA on the CPU emits a
    matrix-vector product with the FP8 cast fused in, rounding through float16 first (0.84355807
    became 0.875 in E4M3 where SPEC gives 0.8125; 19 of 20 random heads differed). Values are
    now put on the FP8 grid before the cast (docs/decisions/0267)."""
    tie_below = np.float32(0.8435580730438232)  # float16 rounds it onto an E4M3 tie
    w = np.concatenate([[[tie_below]], random_fp8_friendly(rng, (15, 1))]).astype(np.float32)
    layer = dense(1, w, np.zeros(1, np.float32), f8.DelayedScaling())  # fresh: scale 1
    x = random_fp8_friendly(rng, (16, 16))
    g = random_fp8_friendly(rng, (16, 1))
    y, dx, dk, _ = train_step_fn(layer, jit_compile=jit_compile)(tf.constant(x), tf.constant(g))
    qx, _ = quantize_reference(x, 1.0, E4M3)
    qw, _ = quantize_reference(w, 1.0, E4M3)
    qg, _ = quantize_reference(g, 1.0, E5M2)
    np.testing.assert_allclose(y.numpy(), qx.astype(np.float64) @ qw, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx.numpy(), qg @ qw.T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dk.numpy(), qx.T @ qg, rtol=1e-6, atol=1e-6)
    kernel = np.array([[tie_below, 0], [0, 1]], np.float32)
    one_row = dense(2, kernel, np.zeros(2, np.float32), f8.DelayedScaling())
    call = tf.function(lambda t: one_row(t, training=False), jit_compile=jit_compile)
    assert call(tf.ones((1, 2))).numpy()[0, 0] == 0.8125


@pytest.mark.parametrize(
    "equation,out_shape,x_shape",
    [("...ab,abc->...c", 6, (2, 3, 4, 8)), ("...a,abc->...bc", (4, 6), (2, 3, 8))],
    ids=["two axes in, one out", "one axis in, two out"],
)
def test_an_ellipsis_with_other_trailing_ranks_in_and_out(rng, equation, out_shape, x_shape):
    """The input and the output keep different numbers of axes beside the ellipsis: dY is
    flattened by the output's trailing axes, dX unflattened to the input's shape."""
    layer = f8.EinsumDense(equation, out_shape, recipe=f8.DelayedScaling())
    x, w, g, y, dx, dk = _einsum_step(rng, layer, x_shape)
    y_shape = g.shape
    lhs, out = equation.replace("...", "Z").split("->")
    xs, ws = lhs.split(",")
    xr = x.reshape(-1, *x_shape[len(x_shape) - (len(xs) - 1) :])
    gr = g.reshape(-1, *y_shape[len(y_shape) - (len(out) - 1) :])
    xq, wq, gq = qdq(xr, 1.0, E4M3), qdq(w, 1.0, E4M3), qdq(gr, 1.0, E5M2)
    close(y.numpy(), np.einsum(f"{xs},{ws}->{out}", xq, wq).reshape(y_shape))
    close(dx.numpy(), np.einsum(f"{out},{ws}->{xs}", gq, wq).reshape(x_shape))
    close(dk.numpy(), np.einsum(f"{xs},{out}->{ws}", xq, gq))
    np.testing.assert_array_equal(layer.fp8_state.bwd_count.numpy(), [1, 0])


@pytest.mark.parametrize("traced", [False, True])
def test_training_left_out_runs_as_inference_also_through_the_backward(rng, traced) -> None:
    """docs/keras.md: with ``training`` unset Keras runs the layer as inference, so its FP8
    state never updates, also when a tape differentiates the call (it warns, and its gradients
    use the current scales)."""
    layer = dense(4, random_fp8_friendly(rng, (8, 4)), np.zeros(4, np.float32), f8.DelayedScaling())
    x = tf.constant(random_fp8_friendly(rng, (2, 8)))
    before = state_arrays(layer)

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x))
        return tape.gradient(loss, [x, layer.kernel])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "called with training unset"
        dx, dk = (tf.function(step) if traced else step)(x)
    assert dx is not None and dk is not None
    for a, b in zip(before, state_arrays(layer), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("differentiated", [(True, False), (False, True)], ids=["x", "kernel"])
@pytest.mark.parametrize("override", list(itertools.product([False, True], repeat=3)))
def test_only_operands_an_fp8_gemm_reads_are_cast(rng, override, differentiated) -> None:
    """fp8kit.torch's rule (tests/torch/test_linear.py has the same table): x is cast for an
    FP8 fprop, or an FP8 wgrad that runs (the kernel trainable); W for an FP8 fprop or dgrad;
    dY for an FP8 dgrad whose dX is needed (x watched) or an FP8 wgrad whose dW is."""
    need_dx, need_dw = differentiated
    recipe = f8.DelayedScaling(amax_history_len=2, override_linear_precision=override)
    layer = dense(8, random_fp8_friendly(rng, (24, 8)), np.zeros(8, np.float32), recipe)
    layer.kernel.trainable = need_dw  # a trainable=False layer would run as inference
    x = tf.constant(random_fp8_friendly(rng, (12, 24)))
    with tf.GradientTape() as tape:
        if need_dx:
            tape.watch(x)
        loss = tf.reduce_sum(layer(x, training=True))
    tape.gradient(loss, [x] if need_dx else layer.trainable_weights)
    fprop, dgrad, wgrad = (not hp for hp in override)
    _, _, count_f, _, _, count_b, _ = state_arrays(layer)
    assert bool(count_f[0]) == (fprop or (wgrad and need_dw))
    assert bool(count_f[1]) == (fprop or dgrad)
    assert bool(count_b[0]) == ((dgrad and need_dx) or (wgrad and need_dw))

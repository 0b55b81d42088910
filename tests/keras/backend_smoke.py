"""Run as ``KERAS_BACKEND=torch|jax python -m tests.keras.backend_smoke``; exits non-zero on
failure. Keras fixes its backend at import, so test_backends.py runs this in a subprocess."""

from __future__ import annotations

import os
import sys

import numpy as np

BACKEND = os.environ["KERAS_BACKEND"]
if BACKEND == "torch":
    import torch  # noqa: F401  (before keras: torch's LLVM users load first)

import keras  # noqa: E402

import fp8kit.keras as f8  # noqa: E402
from tests.keras import frozen_cases  # noqa: E402

RECIPE = f8.DelayedScaling(amax_history_len=3)


def data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((16, 8)) * 0.1).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    x = (rng.standard_normal((4, 16)) * 3).astype(np.float32)
    g = (rng.standard_normal((4, 8)) * 1e-2).astype(np.float32)
    return w, b, x, g


def layer_with(w: np.ndarray, b: np.ndarray) -> f8.Dense:
    layer = f8.Dense(8, recipe=RECIPE)
    layer.build((None, 16))
    layer.kernel.assign(w)
    layer.bias.assign(b)
    return layer


def state(layer: f8.Dense) -> list[np.ndarray]:
    return [keras.ops.convert_to_numpy(v) for v in layer.fp8_state.variables]


def torch_backend() -> None:
    import torch

    import fp8kit.torch as f8t

    w, b, x, g = data(0)
    layer = layer_with(w, b)
    lin = f8t.Linear(16, 8)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w.T.copy()))
        lin.bias.copy_(torch.from_numpy(b))
    for step in range(3):
        xs = x * 2.0**step
        xt = torch.from_numpy(xs).requires_grad_(True)
        y = layer(xt, training=True)
        y.backward(torch.from_numpy(g))
        with f8t.autocast(recipe=RECIPE):
            yt = lin(torch.from_numpy(xs))
        yt.backward(torch.from_numpy(g))
        ours = state(layer)
        fw, bw = lin.fp8_meta.forward, lin.fp8_meta.backward
        theirs = (fw.amax_history, fw.scale, fw.update_count)
        theirs = (*theirs, bw.amax_history, bw.scale, bw.update_count)
        for a, t in zip(ours[:6], theirs, strict=True):
            np.testing.assert_array_equal(a, t.detach().numpy().astype(np.float32))
        np.testing.assert_allclose(y.detach().numpy(), yt.detach().numpy(), rtol=1e-5, atol=1e-5)
    before = state(layer)
    layer(torch.from_numpy(x), training=False)
    for a, c in zip(before, state(layer), strict=True):
        np.testing.assert_array_equal(a, c)
    model = keras.Sequential([keras.Input((16,)), f8.Dense(8, recipe=RECIPE)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.concatenate([x, x]), np.zeros((8, 8), np.float32), batch_size=4, verbose=0)
    counts = keras.ops.convert_to_numpy(model.layers[0].fp8_state.fwd_count)
    np.testing.assert_array_equal(counts, [2, 2, 0])
    reused_layer_backward_keeps_its_forward_scales()
    backward_keeps_no_high_precision_input()
    differentiating_twice_raises()
    frozen_layers()
    only_operands_an_fp8_gemm_reads_are_cast()


def only_operands_an_fp8_gemm_reads_are_cast() -> None:
    """The rule of tests/keras/test_layers.py's table, from autograd here: with fprop in high
    precision, a frozen kernel (no wgrad) leaves x uncast; with wgrad in high precision, an input
    that needs no gradient (no dgrad) leaves dY uncast."""
    import torch

    _, _, x, g = data(3)
    cases = (
        ((True, False, False), True, True, "fwd_count"),
        ((False, False, True), False, False, "bwd_count"),
    )
    for override, frozen, x_grad, slot in cases:
        recipe = f8.DelayedScaling(amax_history_len=3, override_linear_precision=override)
        layer = f8.Dense(8, recipe=recipe)
        layer.build((None, 16))
        layer.kernel.trainable = not frozen  # a frozen layer would run as inference
        y = layer(torch.from_numpy(x).requires_grad_(x_grad), training=True)
        y.backward(torch.from_numpy(g))
        counts = keras.ops.convert_to_numpy(getattr(layer.fp8_state, slot))
        assert counts[0] == 0, (override, slot, counts)


def reused_layer_backward_keeps_its_forward_scales() -> None:
    """One layer called twice, then one backward: eager torch runs an update event per call's
    backward, so the second call's event must not change the scale the first call's backward
    quantizes dY with (scale 1 here: E5M2(0.3) = 0.3125, not 0.3 at the new scale)."""
    import torch

    layer = f8.Dense(2, use_bias=False, recipe=f8.DelayedScaling(amax_history_len=1))
    layer.build((None, 2))
    layer.kernel.assign(np.eye(2, dtype=np.float32))
    x1, x2 = (torch.ones(1, 2, requires_grad=True) for _ in range(2))
    y1, y2 = layer(x1, training=True), layer(x2, training=True)
    ((y1 * 0.3).sum() + (y2 * 1000.0).sum()).backward()
    np.testing.assert_array_equal(x1.grad.numpy(), [[0.3125, 0.3125]])


def backward_keeps_no_high_precision_input() -> None:
    """SPEC section 4: only FP8 copies are saved for backward, not the input itself (a 3-D
    input, which the GEMM flattens and dx gets its shape back from)."""
    import gc
    import weakref

    import torch

    layer = f8.Dense(32, use_bias=False, recipe=RECIPE)
    layer.build((None, 5, 16))
    x = torch.randn(4, 5, 16)
    alive = weakref.ref(x)
    y = layer(x, training=True)
    del x
    gc.collect()
    assert alive() is None, "the high-precision input is kept for the backward pass"
    y.sum().backward()


def differentiating_twice_raises() -> None:
    """A gradient penalty through an FP8 Dense (``create_graph=True``): the first derivatives
    equal a plain backward's; differentiating them again raises, also when the upstream
    gradient is a constant (that of ``y.sum()``), where the kernel term was silently lost."""
    import torch

    w, b, x, _ = data(2)
    layer = layer_with(w, b)
    xt = torch.from_numpy(x).requires_grad_(True)
    plain = torch.autograd.grad(layer(xt, training=False).sum(), xt)[0]
    y = layer(xt, training=False)
    (dx,) = torch.autograd.grad(y.sum(), xt, create_graph=True)
    np.testing.assert_array_equal(dx.detach().numpy(), plain.numpy())
    try:
        (y.sum() + dx.square().sum()).backward()
    except RuntimeError as err:
        assert "differentiate twice" in str(err), err
    else:
        raise AssertionError("a second derivative through an FP8 GEMM must raise")


def jax_backend() -> None:
    import jax
    import jax.numpy as jnp

    w, b, x, g = data(1)
    layer = layer_with(w, b)
    y = layer(jnp.asarray(x))
    assert y.shape == (4, 8)
    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]

    def loss(tv, xin):
        out, _ = layer.stateless_call(tv, non_trainable, xin, training=False)
        return jnp.sum(out * g)

    (dk, db), dx = jax.grad(loss, argnums=(0, 1))(trainable, jnp.asarray(x))
    # scale 1 everywhere: the E5M2 dY and E4M3 operands, multiplied exactly
    wq = np.asarray(jnp.asarray(w).astype(jnp.float8_e4m3fn).astype(jnp.float32))
    gq = np.asarray(jnp.asarray(g).astype(jnp.float8_e5m2).astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(dx), gq @ wq.T, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(db), g.sum(0), rtol=1e-6)
    assert dk.shape == (16, 8)

    # a gradient penalty (grad of a function of grad) raises instead of differentiating the
    # FP8 backward rule
    def penalty(tv):
        return jnp.sum(jax.grad(loss, argnums=1)(tv, jnp.asarray(x)) ** 2)

    try:
        jax.grad(penalty)(trainable)
    except TypeError as err:
        assert "differentiate twice through an FP8 GEMM" in str(err), err
    else:
        raise AssertionError("a second derivative through an FP8 GEMM must raise")
    try:
        layer(jnp.asarray(x), training=True)
    except NotImplementedError as err:
        assert "JAX backend cannot update FP8 state" in str(err)
    else:
        raise AssertionError("training=True on the JAX backend must raise")
    # a frozen FP8 base runs as inference, so fit trains the model around it (it raised)
    frozen_cases.check_frozen_base()


def frozen_layers() -> None:
    """tests/keras/test_frozen.py's cases: a frozen prefix (frozen layers or frozen weights: a
    and b untouched, c as fp8kit.torch), and a frozen base called with training=False in a
    Functional model."""
    for freeze in ("variables", "layer"):
        for wgrad_hp in (False, True):
            frozen_cases.check_frozen_prefix(freeze, wgrad_hp)
    frozen_cases.check_frozen_base()


if __name__ == "__main__":
    {"torch": torch_backend, "jax": jax_backend}[BACKEND]()
    print(f"backend smoke {BACKEND}: ok")
    sys.exit(0)

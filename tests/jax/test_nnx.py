"""Flax NNX Linear: FP8 state in Fp8MetaVariable, untouched by nnx.Optimizer(wrt=nnx.Param)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fp8kit.jax as f8
from fp8kit.jax.nnx import Fp8MetaVariable, Linear, update, value_and_grad
from tests.jax.helpers import random_fp8_friendly

RECIPE = f8.DelayedScaling(amax_history_len=4)
DIMS = (((1,), (0,)), ((), ()))


class _Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        with f8.autocast(recipe=RECIPE):
            self.a = Linear(8, 16, rngs=rngs)
            self.b = Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.a(x))
        return self.b(h) + self.b(h * 2)  # b is used twice


def _meta_state(model):
    return {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, Fp8MetaVariable))}


def test_linear_matches_the_functional_op_and_reuse_gives_max() -> None:
    rng = np.random.default_rng(5)
    x = jnp.asarray(random_fp8_friendly(rng, (6, 8)))
    model = _Model(nnx.Rngs(0))

    def loss_fn(model):
        return jnp.sum(model(x) ** 2)

    loss, grads, obs = nnx.jit(value_and_grad(loss_fn))(model)
    # the same computation through the functional core
    metas = {k[0]: m for k, m in _meta_state(model).items()}

    def ref(ka, ba, kb, bb, ma, mb):
        h = jax.nn.relu(f8.dot_general(x, ka, DIMS, ma, bias=ba))
        return jnp.sum(
            (
                f8.dot_general(h, kb, DIMS, mb, bias=bb)
                + f8.dot_general(h * 2, kb, DIMS, mb, bias=bb)
            )
            ** 2
        )

    params = (model.a.kernel[...], model.a.bias[...], model.b.kernel[...], model.b.bias[...])
    ref_loss, ref_grads, ref_obs = jax.jit(f8.value_and_grad(ref, argnums=(0, 1, 2, 3, 4, 5)))(
        *params, metas["a"], metas["b"]
    )
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(grads["b"]["kernel"][...]), np.asarray(ref_grads[2]), rtol=1e-5, atol=1e-6
    )
    got = obs[("b", "fp8_meta")]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref_obs[5]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(got.chains) == 1.0
    assert float(got.forward[0]) == float(jnp.max(jnp.abs(2 * jax.nn.relu(model.a(x)))))


def test_bfloat16_compute_quantizes_the_float32_kernel() -> None:
    """``dtype=jnp.bfloat16`` with float32 parameters: the WEIGHT cast reads the float32 kernel
    (its amax is not the bfloat16-rounded one) and the kernel gradient is the float32 wgrad
    result, as in fp8kit.torch under ``torch.autocast`` (docs/jax.md, "Dtypes")."""
    with f8.autocast(recipe=RECIPE):
        layer = Linear(32, 16, use_bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    kernel = np.asarray(layer.kernel[...]) * np.float32(0.5) / np.abs(layer.kernel[...]).max()
    kernel[0, 0] = 1.0625 + 2.0**-12  # no bfloat16 value
    layer.kernel[...] = jnp.asarray(kernel)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((8, 32)), jnp.bfloat16)
    _, grads, obs = nnx.jit(value_and_grad(lambda m: jnp.sum(m(x).astype(jnp.float32))))(layer)
    assert float(obs[("fp8_meta",)].forward[1]) == np.float32(1.0625 + 2.0**-12)
    dw = np.asarray(grads["kernel"][...])
    assert dw.dtype == np.float32
    assert not np.array_equal(dw, dw.astype(jnp.bfloat16).astype(np.float32))


def test_optimizer_filtered_on_param_never_touches_meta() -> None:
    rng = np.random.default_rng(6)
    x = jnp.asarray(random_fp8_friendly(rng, (6, 8)))
    y = jnp.asarray(rng.standard_normal((6, 4)).astype(np.float32))
    model = _Model(nnx.Rngs(1))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.5))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads, obs = value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        before = nnx.state(model, Fp8MetaVariable)
        optimizer.update(model, grads)  # only nnx.Param
        after = nnx.state(model, Fp8MetaVariable)
        update(model, obs)
        return loss, before, after

    losses = []
    for _ in range(4):
        loss, before, after = train_step(model, optimizer, x, y)
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    metas = _meta_state(model)
    f8.check_step(metas, 4)
    for meta in metas.values():
        assert float(meta.forward.update_count[0]) == 4.0
        assert float(meta.forward.scale[0]) != 1.0
    # the optimizer state holds no FP8 leaf
    opt_leaves = jax.tree.leaves(nnx.state(optimizer))
    meta_shapes = {a.shape for a in jax.tree.leaves(metas)} - {()}
    assert not meta_shapes & {a.shape for a in opt_leaves}


def test_without_recipe_it_is_a_plain_linear() -> None:
    x = jnp.ones((2, 3))
    ours = Linear(3, 5, rngs=nnx.Rngs(0))
    theirs = nnx.Linear(3, 5, rngs=nnx.Rngs(0))
    assert ours.fp8_meta is None
    np.testing.assert_array_equal(np.asarray(ours(x)), np.asarray(theirs(x)))
    with pytest.raises(ValueError, match="in_features"):
        Linear(0, 5, rngs=nnx.Rngs(0))


def test_flax_metadata_and_attributes_are_taken_as_flax_takes_them() -> None:
    """``kernel_metadata`` / ``bias_metadata`` (how NNX users attach sharding names) reach the
    Params, and the attributes Flax keeps are there, with and without a recipe."""
    for recipe in (RECIPE, None):
        ours = Linear(
            3, 5, recipe=recipe, kernel_metadata={"tag": "k"}, bias_metadata={"tag": "b"},
            param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
        )  # fmt: skip
        theirs = nnx.Linear(
            3, 5, kernel_metadata={"tag": "k"}, bias_metadata={"tag": "b"},
            param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
        )  # fmt: skip
        for name in ("kernel", "bias"):
            mine, flax_param = getattr(ours, name), getattr(theirs, name)
            assert mine.get_metadata()["tag"] == flax_param.get_metadata()["tag"]
            np.testing.assert_array_equal(np.asarray(mine[...]), np.asarray(flax_param[...]))
        assert (ours.use_bias, ours.param_dtype) == (theirs.use_bias, theirs.param_dtype)


def test_value_and_grad_over_a_model_and_an_array() -> None:
    # An array argument has a plain gradient and no FP8 state; this raised AttributeError.
    x = jnp.asarray(random_fp8_friendly(np.random.default_rng(3), (4, 3)))
    model = Linear(3, 5, recipe=RECIPE, rngs=nnx.Rngs(0))

    def loss(m, inputs):
        return jnp.sum(m(inputs) ** 2)

    value, (g_model, g_x), (obs_model, obs_x) = value_and_grad(loss, argnums=(0, 1))(model, x)
    value_0, g_0, obs_0 = value_and_grad(loss)(model, x)
    assert float(value) == float(value_0)
    assert obs_x is None  # as fp8kit.jax.value_and_grad gives for an array
    for a, b in zip(
        jax.tree.leaves((g_model, obs_model)), jax.tree.leaves((g_0, obs_0)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # dX is the FP8 backward's: the same as the functional op's for this state
    meta = model.fp8_meta.get_value()
    kernel, bias = model.kernel[...], model.bias[...]
    ref_dx = jax.grad(lambda v: jnp.sum(f8.dot_general(v, kernel, DIMS, meta, bias=bias) ** 2))(x)
    np.testing.assert_array_equal(np.asarray(g_x), np.asarray(ref_dx))


@pytest.mark.parametrize("argnums", ["0", (), (0, True), 1.0, None])
def test_value_and_grad_refuses_bad_argnums(argnums) -> None:
    with pytest.raises(TypeError, match="argnums must be an int or a non-empty sequence"):
        value_and_grad(lambda m: 0.0, argnums=argnums)


def test_a_teacher_pass_under_stop_gradient_is_observed() -> None:
    """A layer's second call feeds the loss only through ``stop_gradient`` (a target): its
    amaxes are observed all the same (ADR 0264); before, the chain's last call was lost."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(random_fp8_friendly(rng, (6, 8)))
    with f8.autocast(recipe=RECIPE):
        layer = Linear(8, 8, rngs=nnx.Rngs(0))

    def loss_fn(layer):
        return jnp.mean((layer(x) - jax.lax.stop_gradient(layer(10 * x))) ** 2)

    _, _, obs = value_and_grad(loss_fn)(layer)
    got = obs[("fp8_meta",)]
    assert float(got.forward[0]) == float(jnp.max(jnp.abs(10 * x)))
    assert float(got.chains) == 1.0


@pytest.mark.parametrize("box", ["tuple", "list", "dict"])
def test_modules_in_a_container_are_observed_like_separate_arguments(box: str) -> None:
    """``nnx.value_and_grad`` takes a container of modules as one argument. Their FP8
    observations were dropped (None), the meta cotangents left among the param gradients, and
    an update with them rolled nothing: scales stuck at 1. Now each module's gradients and
    observations sit in the same container, equal to passing the modules separately, a
    stop_gradient call made last included."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(random_fp8_friendly(rng, (4, 6)))
    with f8.autocast(recipe=RECIPE):
        first, second = Linear(6, 6, rngs=nnx.Rngs(0)), Linear(6, 6, rngs=nnx.Rngs(1))

    def apart(a, b):
        return jnp.sum(a(x) ** 2) + jnp.sum(jax.lax.stop_gradient(b(3 * x)))

    pack = {"tuple": lambda a, b: (a, b), "list": lambda a, b: [a, b]}
    pack["dict"] = lambda a, b: {"a": a, "b": b}
    unpack = (lambda m: (m["a"], m["b"])) if box == "dict" else tuple

    def boxed(models):
        return apart(*unpack(models))

    _, (g_a, g_b), (o_a, o_b) = value_and_grad(apart, argnums=(0, 1))(first, second)
    _, grads, obs = value_and_grad(boxed)(pack[box](first, second))
    for got, want in ((unpack(grads), (g_a, g_b)), (unpack(obs), (o_a, o_b))):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(
        "fp8_meta" not in str(path) for g in unpack(grads) for path, _ in nnx.to_flat_state(g)
    )
    got_b = unpack(obs)[1][("fp8_meta",)]
    assert float(got_b.forward[0]) == float(jnp.max(jnp.abs(3 * x)))  # the stop_gradient call
    update(second, unpack(obs)[1])
    assert float(second.fp8_meta.get_value().forward.scale[0]) != 1.0


def test_an_nnx_jit_factory_follows_the_autocast_around_each_call() -> None:
    """A module built inside ``nnx.jit`` reads the autocast while traced; the autocast is part
    of the jit cache key, so a second call under another one builds with that one's recipe."""
    other = f8.DelayedScaling(amax_history_len=8)

    @nnx.jit
    def build() -> Linear:
        return Linear(4, 4, rngs=nnx.Rngs(0))

    with f8.autocast(recipe=f8.DelayedScaling(amax_history_len=4)):
        assert build().fp8_meta.get_value().history_len == 4
    with f8.autocast(recipe=other):
        assert build().fp8_meta.get_value().recipe == other
    with f8.autocast(enabled=False):
        assert build().fp8_meta is None


def test_the_output_has_the_compute_dtype_like_flax(rng) -> None:
    """float32 input and params with ``dtype=bfloat16``: nnx.Linear returns bfloat16, and so
    does the FP8 Linear; its values are the FP8 GEMM's result rounded to bfloat16."""
    x = jnp.asarray(random_fp8_friendly(rng, (4, 16)))
    with f8.autocast(recipe=RECIPE):
        layer = Linear(16, 8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    plain = nnx.Linear(16, 8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    meta = nnx.state(layer, Fp8MetaVariable)["fp8_meta"].get_value()
    kernel, bias = layer.kernel[...], layer.bias[...]
    y = layer(x)
    assert y.dtype == plain(x).dtype == jnp.bfloat16
    want = f8.dot_general(
        x.astype(jnp.bfloat16), kernel, DIMS, meta, bias=bias.astype(jnp.bfloat16),
        preferred_element_type=jnp.bfloat16,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))

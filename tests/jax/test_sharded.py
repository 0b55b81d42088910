"""Distribution: global amaxes under jit with sharded arrays, pmax under shard_map,
docs/semantics.md section 10.14.

These need eight host devices. tests/jax/conftest.py asks XLA for them before jax starts; if a
backend was already running with fewer devices, each test re-runs itself in a fresh subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fp8kit.jax as f8
from fp8kit.formats import E4M3, E5M2
from fp8kit.jax.linen import Dense
from fp8kit.slots import BwdSlot, bwd_slot
from tests.jax.helpers import qdq_reference

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DIMS = (((1,), (0,)), ((), ()))


@pytest.fixture(autouse=True)
def eight_devices(request):
    if jax.device_count() >= 8:
        yield
        return
    if os.environ.get("FP8KIT_SHARDED_SUBPROCESS"):
        pytest.fail("still fewer than 8 devices in the subprocess")
    env = dict(os.environ, FP8KIT_SHARDED_SUBPROCESS="1")
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    pytest.skip("ran in a subprocess with 8 devices (passed)")


def _mesh(shape=(2, 4), names=("data", "model")):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


class _Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Dense(16, name="hidden")(x)


def _train(recipe, v, x, t, steps, shard=None):
    model = _Model()

    @jax.jit
    def step(v, x, t):
        def loss_fn(v):
            return jnp.mean((model.apply(v, x) - t) ** 2)

        _, grads, obs = f8.value_and_grad(loss_fn)(v)
        params = jax.tree.map(lambda p, g: p - 2.0**-6 * g, v["params"], grads["params"])
        return f8.update({"params": params, "fp8_meta": v["fp8_meta"]}, obs)

    if shard is not None:
        v, x, t = shard(v, x, t)
    history = []
    for _ in range(steps):
        v = step(v, x, t)
        history.append(jax.tree.map(np.asarray, v))
    return history


def _setup(recipe):
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.integers(-8, 9, (16, 32)).astype(np.float32))
    t = jnp.asarray(rng.integers(-2, 3, (16, 16)).astype(np.float32))
    with f8.autocast(recipe=recipe):
        v = jax.jit(_Model().init)(jax.random.key(0), x)
    v = {
        "params": jax.tree.map(lambda a: jnp.round(a * 8) / 8, v["params"]),
        "fp8_meta": v["fp8_meta"],
    }
    return v, x, t


def _shard_2x4(v, x, t):
    mesh = _mesh()

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    params = {
        "hidden": {
            "kernel": put(v["params"]["hidden"]["kernel"], P(None, "model")),
            "bias": put(v["params"]["hidden"]["bias"], P("model")),
        },
    }
    meta = jax.tree.map(lambda a: put(a, P()), v["fp8_meta"])
    return {"params": params, "fp8_meta": meta}, put(x, P("data", None)), put(t, P("data", None))


def test_jit_on_a_2x4_mesh_equals_the_single_device_run() -> None:
    recipe = f8.DelayedScaling(amax_history_len=4, power_2_scale=True)
    v, x, t = _setup(recipe)
    single = _train(recipe, v, x, t, 4)
    sharded = _train(recipe, v, x, t, 4, shard=_shard_2x4)
    for a, b in zip(single, sharded, strict=True):
        for p, q in zip(
            jax.tree.leaves(a["fp8_meta"]), jax.tree.leaves(b["fp8_meta"]), strict=True
        ):
            np.testing.assert_array_equal(p, q)  # global amaxes: bit-identical state
        for p, q in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"]), strict=True):
            np.testing.assert_allclose(p, q, rtol=1e-6, atol=1e-7)
    meta = single[-1]["fp8_meta"]["hidden"]["meta"]
    assert float(meta.forward.amax_history[-1, 0]) == 8.0  # the global max |x|
    assert np.asarray(meta.backward.amax_history[1:, 0]).all()


def test_shard_map_reduces_observations_with_pmax() -> None:
    mesh = _mesh()
    rng = np.random.default_rng(12)
    w = jnp.asarray(rng.standard_normal((32, 8)).astype(np.float32) * 0.2)
    x = jnp.asarray(rng.standard_normal((16, 32)).astype(np.float32))
    g = jnp.asarray(rng.standard_normal((16, 8)).astype(np.float32))
    x = x.at[13, 5].set(9.0)  # the global max lives on one device only
    recipe = f8.DelayedScaling(amax_history_len=4)

    def loss(w, meta, x, g):
        return jnp.sum(f8.dot_general(x, w, DIMS, meta) * g)

    meta = f8.init_meta(1, recipe)  # scales 1
    xq, ax = qdq_reference(np.asarray(x), 1.0, E4M3)
    _, aw = qdq_reference(np.asarray(w), 1.0, E4M3)
    gq, ag = qdq_reference(np.asarray(g), 1.0, E5M2)
    o_ref = f8.Observations(
        jnp.asarray([ax, aw, 0.0], jnp.float32), jnp.asarray([ag, 0.0], jnp.float32), jnp.float32(1)
    )
    dw_ref = xq.T @ gq  # the global weight gradient

    def body(w, meta, x, g):
        _, grads, obs = f8.value_and_grad(loss, argnums=(0, 1))(w, meta, x, g)
        return grads[0], obs[1], f8.update(meta, obs[1])

    dp = P(("data", "model"))
    auto = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), dp, dp), out_specs=(P(), P(), P()))
    )
    dw, obs, new_meta = auto(w, meta, x, g)
    for a, b in zip(jax.tree.leaves(obs), jax.tree.leaves(o_ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # global amaxes
    assert float(obs.forward[0]) == 9.0
    np.testing.assert_allclose(np.asarray(dw), dw_ref, rtol=1e-5, atol=1e-5 * np.abs(dw_ref).max())
    want = f8.update(meta, o_ref)
    for a, b in zip(jax.tree.leaves(new_meta), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # without JAX's replication typing, the configured axes do the same
    configured = f8.init_meta(1, recipe, amax_reduction_axes=("data", "model"))
    manual = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P(), dp, dp), out_specs=(P(), P(), P()), check_vma=False
        )
    )
    _, obs2, _ = manual(w, configured, x, g)
    np.testing.assert_array_equal(np.asarray(obs2.forward), np.asarray(o_ref.forward))
    np.testing.assert_array_equal(np.asarray(obs2.backward), np.asarray(o_ref.backward))


def test_spec10_14_two_ranks() -> None:
    """Input amax 2 on rank 0 and 5 on rank 1: reduce_amax makes both append 5 (scale 89.6);
    without it, each rank keeps its own meta: 224 and 89.6."""
    mesh = _mesh((2,), ("rank",))
    x = jnp.zeros((2, 4)).at[0, 1].set(2.0).at[1, 2].set(-5.0)  # one row per rank
    w = jnp.ones((4, 4)) * 0.25

    def body(meta, x):
        def loss(meta):
            return jnp.sum(f8.dot_general(x, w, DIMS, meta))

        return f8.update(meta, jax.grad(loss)(meta))

    reduced = f8.init_meta(1, f8.DelayedScaling(amax_history_len=2))
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("rank")), out_specs=P()))
    out = run(reduced, x)
    assert float(out.forward.amax_history[-1, 0]) == 5.0
    assert float(out.forward.scale[0]) == np.float32(448) / np.float32(5)

    local = f8.init_meta(1, f8.DelayedScaling(amax_history_len=2, reduce_amax=False))
    per_rank = jax.tree.map(lambda a: jnp.stack([a, a]), local)

    def body_local(meta, x):
        meta = jax.tree.map(lambda a: a[0], meta)
        return jax.tree.map(lambda a: a[None], body(meta, x))

    run_local = jax.jit(
        jax.shard_map(body_local, mesh=mesh, in_specs=(P("rank"), P("rank")), out_specs=P("rank"))
    )
    out = run_local(per_rank, x)
    np.testing.assert_array_equal(np.asarray(out.forward.amax_history[:, -1, 0]), [2.0, 5.0])
    np.testing.assert_array_equal(
        np.asarray(out.forward.scale[:, 0]), [224.0, np.float32(448) / np.float32(5)]
    )
    # reduce_amax=False with one replicated meta cannot hold two answers: refused
    with pytest.raises(ValueError, match="reduce_amax=False"):
        run_bad = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("rank")), out_specs=P()))
        run_bad(local, x)


def test_linen_axes_field_and_autocast_override_the_state_axes() -> None:
    """A Dense whose state was created without axes (an init outside the mesh, a checkpoint),
    applied under shard_map(check_vma=False) with the axes given on the layer or by the
    autocast it was built in: the amax is reduced over them. The field used to be ignored
    there, recording device 0's amax 0 for a global amax 5 (decision 0248)."""
    mesh = _mesh((4,), ("data",))
    recipe = f8.DelayedScaling(amax_history_len=4)
    x = jnp.zeros((8, 16)).at[7, 0].set(5.0)  # the global max sits on the last device only
    variables = Dense(8, recipe=recipe).init(jax.random.key(0), x)
    assert variables["fp8_meta"]["meta"].amax_reduction_axes is None
    with f8.autocast(recipe=recipe, amax_reduction_axes=("data",)):
        from_autocast = Dense(8)
    with f8.autocast(recipe=recipe):  # an autocast without axes leaves the state's axes
        unset = Dense(8)
    layers = {"field": Dense(8, recipe=recipe, amax_reduction_axes=("data",))}
    layers |= {"autocast": from_autocast, "state": unset}

    def recorded(layer, mutable=False):
        def apply(v, shard):  # a mutable apply takes the chained path (dot_general_joined)
            if mutable:
                return layer.apply(v, shard, mutable=["fp8_meta"])[0]
            return layer.apply(v, shard)

        def body(v, shard):
            _, _, obs = f8.value_and_grad(lambda v: jnp.sum(apply(v, shard)))(v)
            return f8.update(v, obs)

        run = jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False
        )
        return float(jax.jit(run)(variables, x)["fp8_meta"]["meta"].forward.amax_history[-1, 0])

    assert recorded(layers["field"]) == recorded(layers["field"], mutable=True) == 5.0
    assert recorded(layers["autocast"]) == 5.0
    assert recorded(layers["state"]) == 0.0  # no axes anywhere: device 0's own amax, as documented
    # A state created with axes keeps them under an autocast that gives none
    variables = Dense(8, recipe=recipe, amax_reduction_axes=("data",)).init(jax.random.key(0), x)
    assert recorded(unset) == 5.0
    # A mutable apply writes the state back with its own axes: the collection's tree is unchanged
    # (a scan carrying the variables needs that), whichever axes the layer reduced over.
    plain = Dense(8, recipe=recipe).init(jax.random.key(0), x)
    _, written = layers["field"].apply(plain, x, mutable=["fp8_meta"])
    assert jax.tree.structure(written["fp8_meta"]) == jax.tree.structure(plain["fp8_meta"])


def test_tensor_parallel_fp8_grad_casts_the_summed_input_gradient() -> None:
    """Column-parallel (w split over "model", x replicated): each device's dX is a part of the
    sum; fp8_grad must cast (and record the amax of) the whole dX, as one device would. Inputs
    are exact in FP8 and float32, so the parallel run equals the single-device one bit for
    bit."""
    mesh = _mesh()
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.integers(-4, 5, (8, 16)).astype(np.float32))
    w = jnp.asarray((rng.integers(-8, 9, (16, 8)) / 8).astype(np.float32))
    g = jnp.asarray(rng.integers(-3, 4, (8, 8)).astype(np.float32))
    meta = f8.init_meta(1, f8.DelayedScaling(amax_history_len=2))

    def grads(x, w, meta, g):
        def loss(x, meta):
            return jnp.sum(f8.dot_general(x, w, DIMS, meta, fp8_grad=True) * g)

        return jax.grad(loss, argnums=(0, 1))(x, meta)

    dx_one, obs_one = jax.jit(grads)(x, w, meta, g)
    split = P(None, "model")
    parallel = jax.jit(
        jax.shard_map(grads, mesh=mesh, in_specs=(P(), split, P(), split), out_specs=(P(), P()))
    )
    dx_tp, obs_tp = parallel(x, w, meta, g)
    exact = np.abs(np.asarray(g, np.float64) @ np.asarray(w, np.float64).T).max()
    grad_input = bwd_slot(0, BwdSlot.GRAD_INPUT)
    assert float(obs_one.backward.amax_history[0, grad_input]) == exact
    assert float(obs_tp.backward.amax_history[0, grad_input]) == exact
    np.testing.assert_array_equal(np.asarray(dx_tp), np.asarray(dx_one))


def test_explicit_reduction_axes_skip_the_axes_the_meta_differs_on() -> None:
    """One meta per pipeline stage ("data" here), batch split over "model": amax_reduction_axes
    naming both axes reduces over "model" only, as with the axes left unset (docs/jax.md,
    "Distribution")."""
    mesh = _mesh()
    x = jnp.ones((8, 2, 16)).at[:, 0].multiply(2.0).at[:, 1].multiply(7.0)  # stage inputs
    x = x.at[5, 1, 3].set(-9.0)  # stage 1's largest value sits on one device of "model"
    w = jnp.ones((2, 16, 8)) * 0.125
    for axes in (None, ("model",), ("data", "model")):
        meta = f8.init_meta(1, f8.DelayedScaling(amax_history_len=2), amax_reduction_axes=axes)
        metas = jax.tree.map(lambda a: jnp.stack([a, a]), meta)

        def body(w, metas, x):
            w, x = w[0], x[:, 0]
            meta = jax.tree.map(lambda a: a[0], metas)
            loss = lambda w, m: jnp.sum(f8.dot_general(x, w, DIMS, m))  # noqa: E731
            _, _, obs = f8.value_and_grad(loss, argnums=(0, 1))(w, meta)
            return jax.tree.map(lambda a: a[None], f8.update(meta, obs[1]))

        specs = (P("data"), P("data"), P("model", "data"))
        run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("data")))
        out = run(w, metas, x)
        np.testing.assert_array_equal(np.asarray(out.forward.amax_history[:, -1, 0]), [2.0, 9.0])

"""The observing FP8 dot_general: numerics against numpy references, observations combined with
max under reuse, scan, remat; summed observations refused."""

from __future__ import annotations

import itertools
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8kit.jax as f8
from fp8kit.formats import E4M3, E5M2
from tests.jax.helpers import qdq_reference, random_fp8_friendly
from tests.reference import current_scale_reference

DIMS = (((1,), (0,)), ((), ()))
F32 = np.float32


def close(actual, desired, rtol: float = 2e-6) -> None:
    """float32 accumulation vs float64: relative, plus an absolute floor for cancellation."""
    desired = np.asarray(desired, np.float64)
    atol = 1e-5 * float(np.abs(desired).max())
    np.testing.assert_allclose(np.asarray(actual, np.float64), desired, rtol=rtol, atol=atol)


def _meta(recipe, fwd_scales=(1.0, 1.0, 1.0), bwd_scales=(1.0, 1.0), num_gemms=1, counts=0.0):
    meta = f8.init_meta(num_gemms, recipe)
    fs = np.tile(np.asarray(fwd_scales, F32), num_gemms)
    bs = np.tile(np.asarray(bwd_scales, F32), num_gemms)
    return replace(
        meta,
        forward=replace(
            meta.forward,
            scale=jnp.asarray(fs),
            update_count=jnp.full(fs.shape, counts, jnp.float32),
        ),
        backward=replace(
            meta.backward,
            scale=jnp.asarray(bs),
            update_count=jnp.full(bs.shape, counts, jnp.float32),
        ),
    )


def _grads(meta, x, w, g, **kw):
    """(y, dx, dw, observations) of loss = sum(y * g), so dy = g exactly."""

    def loss(x, w, meta):
        y = f8.dot_general(x, w, DIMS, meta, **kw)
        return jnp.sum(y.astype(jnp.float32) * g), y

    (_, y), (dx, dw, dmeta) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, meta)
    return y, dx, dw, f8.observations_of(dmeta)


@pytest.fixture
def operands(rng):
    x = random_fp8_friendly(rng, (12, 24))
    w = random_fp8_friendly(rng, (24, 8), 0.1)
    g = random_fp8_friendly(rng, (12, 8), 1e-3)
    return x, w, g


def test_forward_and_backward_match_numpy_reference(operands) -> None:
    x, w, g = operands
    recipe = f8.DelayedScaling(amax_history_len=4)
    sx, sw, sg = 448 / 7.0, 448 / 0.9, 57344 / 0.011
    meta = _meta(recipe, (sx, sw, 1.0), (sg, 1.0))
    y, dx, dw, obs = jax.jit(_grads)(meta, x, w, g)
    xq, ax = qdq_reference(x, F32(sx), E4M3)
    wq, aw = qdq_reference(w, F32(sw), E4M3)
    gq, ag = qdq_reference(g, F32(sg), E5M2)
    close(y, xq @ wq)
    close(dx, gq @ wq.T)
    close(dw, xq.T @ gq)
    np.testing.assert_array_equal(np.asarray(obs.forward), [ax, aw, 0.0])
    np.testing.assert_array_equal(np.asarray(obs.backward), [ag, 0.0])
    assert float(obs.chains) == 1.0
    # FP8 actually happened: the result differs from the float32 product
    assert np.abs(np.asarray(y) - x.astype(np.float64) @ w).max() > 1e-4


@pytest.mark.parametrize(
    "override", [(True, False, False), (False, True, False), (False, False, True), (True,) * 3]
)
def test_override_linear_precision(operands, override) -> None:
    x, w, g = operands
    recipe = f8.DelayedScaling(amax_history_len=2, override_linear_precision=override)
    meta = _meta(recipe, (8.0, 64.0, 1.0), (2.0**14, 1.0))
    y, dx, dw, obs = _grads(meta, x, w, g)
    xq = qdq_reference(x, 8.0, E4M3)[0]
    wq = qdq_reference(w, 64.0, E4M3)[0]
    gq = qdq_reference(g, 2.0**14, E5M2)[0]
    x64, w64, g64 = (a.astype(np.float64) for a in (x, w, g))
    fprop, dgrad, wgrad = override
    close(y, (x64 @ w64) if fprop else xq @ wq)
    close(dx, (g64 @ w64.T) if dgrad else gq @ wq.T)
    close(dw, (x64.T @ g64) if wgrad else xq.T @ gq)
    x_needed = not (fprop and wgrad)
    w_needed = not (fprop and dgrad)
    g_needed = not (dgrad and wgrad)
    assert (float(obs.forward[0]) > 0) == x_needed
    assert (float(obs.forward[1]) > 0) == w_needed
    assert (float(obs.backward[0]) > 0) == g_needed


def test_fp8_output_and_grad_with_bias(operands, rng) -> None:
    x, w, g = operands
    b = random_fp8_friendly(rng, (8,), 0.1)
    recipe = f8.DelayedScaling(amax_history_len=2)
    so, sgi = 64.0, 2.0**10
    meta = _meta(recipe, (8.0, 64.0, so), (2.0**14, sgi))

    def run(fp8_io):
        def loss(x, w, b, meta):
            y = f8.dot_general(x, w, DIMS, meta, bias=b, fp8_output=fp8_io, fp8_grad=fp8_io)
            return jnp.sum(y * g), y

        grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
        (_, y), (dx, dw, db, dm) = jax.jit(grad)(x, w, b, meta)
        return y, dx, dw, db, f8.observations_of(dm)

    y_pre, dx_pre, dw0, db0, _ = run(False)
    y, dx, dw, db, obs = run(True)
    xq = qdq_reference(x, 8.0, E4M3)[0]
    wq = qdq_reference(w, 64.0, E4M3)[0]
    close(y_pre, xq @ wq + b.astype(np.float64))
    # the output and the input gradient go through FP8 exactly as quantize() would do it
    want_y, ay = qdq_reference(np.asarray(y_pre), so, E4M3)
    np.testing.assert_array_equal(np.asarray(y), want_y.astype(F32))
    want_dx, adx = qdq_reference(np.asarray(dx_pre), sgi, E5M2)
    np.testing.assert_array_equal(np.asarray(dx), want_dx.astype(F32))
    assert not np.array_equal(np.asarray(y), np.asarray(y_pre))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(dw0))  # straight-through
    np.testing.assert_allclose(np.asarray(db), g.astype(np.float64).sum(0), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(db), np.asarray(db0))
    assert float(obs.forward[2]) == ay
    assert float(obs.backward[0]) == np.abs(g).max()
    assert float(obs.backward[1]) == adx


def test_first_step_current_scaling(operands) -> None:
    x, w, g = operands
    recipe = f8.DelayedScaling(amax_history_len=2, first_step_scaling="current")
    fresh = _meta(recipe, (1.0, 1.0, 1.0), (1.0, 1.0), counts=0.0)
    y, _, dw, obs = _grads(fresh, x, w, g)
    ax, aw, ag = (float(np.abs(a).max()) for a in (x, w, g))
    xq = qdq_reference(x, F32(448) / F32(ax), E4M3)[0]
    wq = qdq_reference(w, F32(448) / F32(aw), E4M3)[0]
    gq = qdq_reference(g, F32(57344) / F32(ag), E5M2)[0]
    close(y, xq @ wq)
    close(dw, xq.T @ gq)
    np.testing.assert_array_equal(np.asarray(obs.forward), [ax, aw, 0])  # still recorded
    warm = _meta(recipe, (8.0, 64.0, 1.0), (2.0**14, 1.0), counts=1.0)
    y2 = _grads(warm, x, w, g)[0]
    xq2, wq2 = qdq_reference(x, 8.0, E4M3)[0], qdq_reference(w, 64.0, E4M3)[0]
    close(y2, xq2 @ wq2)


@pytest.mark.parametrize("power_2_scale", [False, True])
def test_current_scaling_recipe(operands, power_2_scale: bool) -> None:
    """Each operand is cast with fmax / amax of itself, or (power_2_scale) that ratio's
    power-of-two floor; nothing is observed."""
    x, w, g = operands
    meta = f8.init_meta(1, f8.Float8CurrentScaling(power_2_scale=power_2_scale))
    y, dx, dw, obs = _grads(meta, x, w, g)

    def refs(power_2: bool) -> dict[str, np.ndarray]:
        sx, sw = (current_scale_reference(np.abs(a).max(), 448.0, power_2) for a in (x, w))
        sg = current_scale_reference(np.abs(g).max(), 57344.0, power_2)
        xq, wq = qdq_reference(x, sx, E4M3)[0], qdq_reference(w, sw, E4M3)[0]
        gq = qdq_reference(g, sg, E5M2)[0]
        return {"y": xq @ wq, "dx": gq @ wq.T, "dw": xq.T @ gq}

    want, other = refs(power_2_scale), refs(not power_2_scale)
    for name, got in (("y", y), ("dx", dx), ("dw", dw)):
        close(got, want[name])
        # the other scale rule moves FP8 operands by a quantum: far outside close()'s bound
        assert np.abs(want[name] - other[name]).max() > 1e-3 * np.abs(want[name]).max(), name
    assert not np.asarray(obs.forward).any() and not np.asarray(obs.backward).any()


def test_low_precision_dtypes(operands) -> None:
    x, w, g = operands
    meta = _meta(f8.DelayedScaling(amax_history_len=2), (8.0, 64.0, 1), (2.0**14, 1))
    xb = jnp.asarray(x, jnp.bfloat16)
    y, dx, dw, obs = _grads(meta, xb, w, g, preferred_element_type=jnp.bfloat16)
    assert y.dtype == jnp.bfloat16 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    assert float(obs.forward[0]) == float(jnp.max(jnp.abs(xb.astype(jnp.float32))))


def test_second_gemm_uses_its_own_slots(operands) -> None:
    x, w, g = operands
    meta = f8.init_meta(2, f8.DelayedScaling(amax_history_len=2))
    _, _, _, obs = _grads(meta, x, w, g, gemm=1)
    f, b = np.asarray(obs.forward), np.asarray(obs.backward)
    assert not f[:3].any() and f[3] == np.abs(x).max() and f[4] == np.abs(w).max()
    assert not b[:2].any() and b[2] == np.abs(g).max()


def test_reuse_records_the_max_not_the_sum(operands) -> None:
    x, w, g = operands
    meta = f8.init_meta(1, f8.DelayedScaling(amax_history_len=2))

    def loss(w, meta):
        a = f8.dot_general(x, w, DIMS, meta)
        b = f8.dot_general(x * 4, w, DIMS, meta)
        c = f8.dot_general(x * 2, w, DIMS, meta)
        return jnp.sum(a * g) + jnp.sum(b * g * 3) + jnp.sum(c * g * 2)

    _, _, obs = f8.value_and_grad(loss, argnums=(0, 1))(w, meta)
    o = obs[1]
    assert float(o.forward[0]) == 4 * np.abs(x).max()
    assert float(o.forward[1]) == np.abs(w).max()
    assert float(o.backward[0]) == pytest.approx(3 * np.abs(g).max(), rel=1e-7)
    assert float(o.chains) == 1.0

    # explicit threading gives the same
    def loss2(w, meta):
        a, m = f8.dot_general_chained(x, w, DIMS, meta)
        b, m = f8.dot_general_chained(x * 4, w, DIMS, m)
        c, _ = f8.dot_general_chained(x * 2, w, DIMS, m)
        return jnp.sum(a * g) + jnp.sum(b * g * 3) + jnp.sum(c * g * 2)

    _, _, obs2 = jax.jit(f8.value_and_grad(loss2, argnums=(0, 1)))(w, meta)
    for a, b in zip(jax.tree.leaves(obs), jax.tree.leaves(obs2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_summed_observations_are_refused(operands) -> None:
    x, w, g = operands
    meta = f8.init_meta(1, f8.DelayedScaling(amax_history_len=2))

    def loss(meta, x):
        return jnp.sum(f8.dot_general(x, w, DIMS, meta) * g)

    # the classic microbatch mistake: adding two gradients that include the meta cotangent
    g1 = jax.grad(loss)(meta, x)
    g2 = jax.grad(loss)(meta, 2 * x)
    summed = jax.tree.map(jnp.add, g1, g2)
    assert float(f8.observations_of(summed).chains) == 2.0
    with pytest.raises(f8.SummedObservationsError, match="summed by JAX over 2"):
        f8.update(meta, summed)
    # under jit the check runs in a host callback: JAX re-raises its error with the text
    with pytest.raises(
        jax.errors.JaxRuntimeError, match=r"SummedObservationsError: .* summed by JAX over 2 "
    ):
        jax.block_until_ready(jax.jit(f8.update)(meta, summed))
    # staging them first, then an update without observations, was a way around the check
    with pytest.raises(f8.SummedObservationsError, match="summed by JAX over 2"):
        f8.stage(meta, summed)
    good = f8.combine_observations(g1, g2)
    out = f8.update(meta, good)
    assert float(out.forward.amax_history[-1, 0]) == 2 * np.abs(x).max()


def test_scaled_observations_are_refused(operands) -> None:
    """A gradient transformation applied to a tree that still holds the meta cotangent (a mean
    of microbatch gradients, clipping, any scaling) makes the chain count fractional: its
    amaxes are no amaxes, so ``update`` refuses them, eagerly and under jit (ADR 0264). The
    exact mean of n summed chains gives a count of 1 again and cannot be told apart."""
    x, w, g = operands
    meta = f8.init_meta(1, f8.DelayedScaling(amax_history_len=2))

    def loss(meta, x):
        return jnp.sum(f8.dot_general(x, w, DIMS, meta) * g)

    grads = jax.grad(loss)(meta, x)
    for factor in (0.5, 1 / 3, 1.5):
        scaled = jax.tree.map(lambda t, f=factor: t * f, grads)
        with pytest.raises(f8.SummedObservationsError, match="were scaled"):
            f8.update(meta, scaled)
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"were scaled"):
            jax.block_until_ready(jax.jit(f8.update)(meta, scaled))
    doubled = jax.tree.map(lambda t: t * 2, grads)  # a whole count: read as two summed chains
    with pytest.raises(f8.SummedObservationsError, match="summed by JAX over 2"):
        f8.update(meta, doubled)
    f8.update(meta, grads)  # the untouched cotangent passes


def test_a_meta_changed_by_an_optimizer_is_refused(operands) -> None:
    """An optimizer given the whole variable tree (TrainState.create(params=variables), raw
    gradients) moves the meta's leaves: a step that is no whole number says so, and ``update``
    refuses it (ADR 0264)."""
    x, w, g = operands
    meta = f8.init_meta(1, f8.DelayedScaling(amax_history_len=2))

    def loss(meta, x):
        return jnp.sum(f8.dot_general(x, w, DIMS, meta) * g)

    grads = jax.grad(loss)(meta, x)
    moved = jax.tree.map(lambda p, d: p - 1e-3 * d, meta, grads)  # one SGD step on everything
    with pytest.raises(f8.SummedObservationsError, match="step that is not a whole number"):
        f8.update(moved, grads)
    with pytest.raises(jax.errors.JaxRuntimeError, match="step that is not a whole number"):
        jax.block_until_ready(jax.jit(f8.update)(moved, grads))
    assert float(f8.update(meta, grads).step) == 1.0


def test_a_meta_broadcast_by_vmap_is_refused(operands) -> None:
    """vmap over examples with one meta closed over: JAX sums the per-example amaxes (1 + 7 is
    no amax) and, since the chain count carries the batch dimension, the count as well."""
    _, w, _ = operands
    meta = f8.init_meta(1, f8.DelayedScaling(amax_history_len=3))
    x = jnp.stack([jnp.ones((2, w.shape[0])), 7 * jnp.ones((2, w.shape[0]))])

    def loss(meta, w):
        return jnp.sum(jax.vmap(lambda xi: f8.dot_general(xi, w, DIMS, meta))(x))

    _, _, obs = jax.jit(f8.value_and_grad(loss))(meta, w)
    assert float(obs.forward[0]) == 8.0 and float(obs.chains) == 2.0
    with pytest.raises(f8.SummedObservationsError, match="summed by JAX over 2"):
        f8.update(meta, obs)


def test_scan_with_per_layer_meta_equals_unrolled(rng) -> None:
    n = 3
    ws = jnp.asarray(random_fp8_friendly(rng, (n, 16, 16), 0.2))
    x = jnp.asarray(random_fp8_friendly(rng, (4, 16)))
    recipe = f8.DelayedScaling(amax_history_len=3)
    metas = jax.tree.map(lambda *a: jnp.stack(a), *[f8.init_meta(1, recipe)] * n)

    def scanned(ws, metas):
        def body(h, wm):
            w, m = wm
            return jnp.tanh(f8.dot_general(h, w, DIMS, m)), None

        h, _ = jax.lax.scan(body, x, (ws, metas))
        return jnp.sum(h**2)

    def unrolled(ws, metas):
        h = x
        for i in range(n):
            m = jax.tree.map(lambda a, i=i: a[i], metas)
            h = jnp.tanh(f8.dot_general(h, ws[i], DIMS, m))
        return jnp.sum(h**2)

    a = jax.jit(f8.value_and_grad(scanned, argnums=(0, 1)))(ws, metas)
    b = jax.jit(f8.value_and_grad(unrolled, argnums=(0, 1)))(ws, metas)
    for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(p), np.asarray(q), rtol=1e-6, atol=1e-7)
    obs = a[2][1]
    assert obs.forward.shape == (n, 3) and np.asarray(obs.chains).tolist() == [1, 1, 1]
    np.testing.assert_array_equal(np.asarray(obs.forward), np.asarray(b[2][1].forward))
    updated = f8.update(metas, a[2][1])
    assert updated.forward.amax_history.shape == (n, 3, 3)
    np.testing.assert_array_equal(updated.forward.amax_history[:, -1], obs.forward)


def test_weight_shared_scan_carries_the_chain(rng) -> None:
    w = jnp.asarray(random_fp8_friendly(rng, (8, 8), 0.3))
    xs = jnp.asarray(random_fp8_friendly(rng, (5, 2, 8)))
    meta = f8.init_meta(1, f8.DelayedScaling(amax_history_len=2))

    def carried(w, meta):
        def body(carry, x):
            h, m = carry
            step_input = x + h
            y, m = f8.dot_general_chained(step_input, w, DIMS, m)
            return (jnp.tanh(y), m), step_input

        (h, _), step_inputs = jax.lax.scan(body, (jnp.zeros((2, 8)), meta), xs)
        return jnp.sum(h), step_inputs

    (_, step_inputs), _, obs = jax.jit(f8.value_and_grad(carried, argnums=(0, 1), has_aux=True))(
        w, meta
    )
    o = obs[1]
    assert float(o.chains) == 1.0
    # exactly the max over the five steps' inputs (a sum of the steps' amaxes is ~5x that)
    assert float(o.forward[0]) == float(jnp.max(jnp.abs(step_inputs)))
    assert float(o.forward[1]) == float(jnp.max(jnp.abs(w)))  # same weight five times

    def closed_over(w, meta):
        def body(h, x):
            return jnp.tanh(f8.dot_general(x + h, w, DIMS, meta)), None

        h, _ = jax.lax.scan(body, jnp.zeros((2, 8)), xs)
        return jnp.sum(h)

    _, _, bad = jax.jit(f8.value_and_grad(closed_over, argnums=(0, 1)))(w, meta)
    assert float(bad[1].chains) == 5.0  # JAX summed five iterations: refused by update
    with pytest.raises(f8.SummedObservationsError):
        f8.update(meta, bad[1])


def test_checkpoint_does_not_double_count(operands) -> None:
    x, w, g = operands
    meta = f8.init_meta(1, f8.DelayedScaling(amax_history_len=2))

    def block(w, meta, x):
        h = jnp.tanh(f8.dot_general(x, w, DIMS, meta))
        return h + f8.dot_general(x * 2, w, DIMS, meta)  # two calls inside the remat region

    def loss(w, meta, remat):
        fn = jax.checkpoint(block) if remat else block
        return jnp.sum(fn(w, meta, x) * g)

    plain = jax.jit(f8.value_and_grad(lambda w, m: loss(w, m, False), argnums=(0, 1)))(w, meta)
    remat = jax.jit(f8.value_and_grad(lambda w, m: loss(w, m, True), argnums=(0, 1)))(w, meta)
    # observations: identical (a recomputed forward is not observed twice)
    for p, q in zip(jax.tree.leaves(plain[2]), jax.tree.leaves(remat[2]), strict=True):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(q))
    assert float(remat[2][1].chains) == 1.0
    assert float(remat[2][1].forward[0]) == 2 * np.abs(x).max()
    assert float(remat[2][1].backward[0]) == np.abs(g).max()  # max(|g (1 - tanh^2)|, |g|)
    # gradients: equal up to XLA's float32 scheduling of the recomputed program
    for p, q in zip(jax.tree.leaves(plain[1]), jax.tree.leaves(remat[1]), strict=True):
        np.testing.assert_allclose(np.asarray(p), np.asarray(q), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("jit", [False, True])
def test_layers_rematerialised_one_after_another(jit: bool) -> None:
    """Two FP8 layers, each in the same ``jax.checkpoint`` function, the first one fed the data
    (not differentiated): JAX pairs the first call's residuals with the second call's residual
    tree, which failed with a bare AssertionError while a dropped residual changed the tree
    (decision 0248). Observations, including the first layer's skipped GRAD_INPUT, match the
    same model without remat bit for bit."""
    rng = np.random.default_rng(11)
    x = random_fp8_friendly(rng, (4, 16))
    ws = tuple(random_fp8_friendly(rng, (16, 16), 2.0**-3) for _ in range(2))
    recipe = f8.DelayedScaling(amax_history_len=4)
    metas = (f8.init_meta(1, recipe), f8.init_meta(1, recipe))

    def layer(w, meta, h):
        return f8.dot_general(h, w, DIMS, meta, fp8_grad=True)

    def loss(ws, metas, remat):
        fn = jax.checkpoint(layer) if remat else layer
        return jnp.sum(fn(ws[1], metas[1], jnp.tanh(fn(ws[0], metas[0], x))))

    run = {remat: f8.value_and_grad(partial(loss, remat=remat), argnums=(0, 1)) for remat in (0, 1)}
    if jit:
        run = {k: jax.jit(f) for k, f in run.items()}
    (_, plain_grads, plain_obs), (_, remat_grads, remat_obs) = (run[k](ws, metas) for k in (0, 1))
    for p, q in zip(jax.tree.leaves(plain_obs), jax.tree.leaves(remat_obs), strict=True):
        np.testing.assert_array_equal(np.asarray(q), np.asarray(p))
    first_backward = np.asarray(remat_obs[1][0].backward)
    assert first_backward[1] == 0.0 and first_backward[0] > 0.0  # no dX: GRAD_INPUT skipped
    assert np.asarray(remat_obs[1][1].backward)[1] > 0.0  # the second layer's dX is cast
    for p, q in zip(jax.tree.leaves(plain_grads), jax.tree.leaves(remat_grads), strict=True):
        np.testing.assert_allclose(np.asarray(q), np.asarray(p), rtol=1e-5, atol=1e-8)


def test_bad_arguments_are_reported(operands) -> None:
    x, w, _ = operands
    meta = f8.init_meta(1)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), meta)
    with pytest.raises(ValueError, match="no leading axes"):
        f8.dot_general(x, w, DIMS, stacked)
    with pytest.raises(ValueError, match="gemm must be in"):
        f8.dot_general(x, w, DIMS, meta, gemm=1)
    with pytest.raises(TypeError, match="meta must be"):
        f8.dot_general(x, w, DIMS, {"not": "a meta"})
    with pytest.raises(ValueError, match="dimension_numbers"):
        f8.dot_general(x, w, "rows", meta)
    with pytest.raises(TypeError, match="fp8_output must be a bool"):
        f8.dot_general(x, w, DIMS, meta, fp8_output=1)
    with pytest.raises(TypeError, match="lhs must have"):
        f8.dot_general(x.astype(np.int32), w, DIMS, meta)
    # Accepted before: an int32 result of the FP8 GEMM, and a precision nothing looked at.
    for dtype in (jnp.int32, jnp.float8_e4m3fn, "rows"):
        with pytest.raises(TypeError, match="preferred_element_type must be a high-precision"):
            f8.dot_general(x, w, DIMS, meta, preferred_element_type=dtype)
    with pytest.raises(ValueError, match="precision: Precision argument must be one of"):
        f8.dot_general(x, w, DIMS, meta, precision="bogus")
    f8.dot_general(x, w, DIMS, meta, precision=["highest", "default"])  # as lax.dot_general
    # Reduction axes outside shard_map: JAX's "unbound axis name" did not name the setting.
    sharded = f8.init_meta(1, amax_reduction_axes=("data",))
    with pytest.raises(ValueError, match=r"amax_reduction_axes=\('data',\) .* not bound here"):
        jax.grad(lambda x: jnp.sum(f8.dot_general(x, w, DIMS, sharded)))(x)
    with pytest.raises(ValueError, match="num_gemms"):
        f8.init_meta(0)
    with pytest.raises(TypeError, match="recipe must be"):
        f8.init_meta(1, "hybrid")


def test_differentiating_the_gradients_raises(operands) -> None:
    """A gradient penalty (``jax.grad`` of a function of ``jax.grad``) through an FP8 GEMM: the
    first derivatives are those of a plain ``jax.grad``; differentiating them raises, as in
    fp8kit.torch, where JAX differentiated the FP8 backward rule, a silently wrong answer (39%
    off the high-precision one in review). Forward-over-reverse (``jax.jvp`` of a gradient) too."""
    x, w, g = operands
    meta = f8.init_meta(1, f8.DelayedScaling(amax_history_len=2))

    def loss(x, w):
        return jnp.sum(jnp.tanh(f8.dot_general(x, w, DIMS, meta)))

    def linear(x, w):  # dY = g exactly, eager and jitted (XLA's tanh' differs by ulps, which
        return jnp.sum(f8.dot_general(x, w, DIMS, meta) * g)  # can flip an E5M2 rounding)

    close(jax.jit(jax.grad(linear))(x, w), jax.grad(linear)(x, w))  # under jit too
    jax.grad(loss)(x, w)  # first derivatives through tanh: as a plain jax.grad

    def penalty(w):
        return jnp.sum(jax.grad(loss)(x, w) ** 2)

    with pytest.raises(TypeError, match="differentiate twice through an FP8 GEMM"):
        jax.grad(penalty)(w)
    with pytest.raises(TypeError, match="differentiate twice through an FP8 GEMM"):
        jax.jvp(lambda w: jax.grad(loss, argnums=1)(x, w), (w,), (jnp.ones_like(w),))


@pytest.mark.parametrize(
    "contracting", [((0, 1), (1, 0)), ((1, 0), (0, 1))], ids=["rhs unsorted", "lhs unsorted"]
)
def test_contracting_axes_paired_out_of_order_give_the_right_gradients(rng, contracting) -> None:
    """Two contracted axes of equal size paired crosswise (lhs axis 0 with rhs axis 1): dgrad
    and wgrad must put each gradient axis back where its operand had it. A transposed layout
    has the right shape here, so only the values can tell."""
    x = random_fp8_friendly(rng, (4, 4, 6))  # (a, b, m)
    w = random_fp8_friendly(rng, (4, 4, 5), 0.1)  # (p, q, n)
    g = random_fp8_friendly(rng, (6, 5), 1e-3)  # (m, n)
    dims = (contracting, ((), ()))
    sx, sw, sg = 8.0, 64.0, 2.0**14
    meta = _meta(f8.DelayedScaling(amax_history_len=2), (sx, sw, 1.0), (sg, 1.0))

    def loss(x, w, meta):
        y = f8.dot_general(x, w, dims, meta)
        return (y * g).sum(), y

    (_, y), (dx, dw, _) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, meta)
    xq = qdq_reference(x, F32(sx), E4M3)[0]
    wq = qdq_reference(w, F32(sw), E4M3)[0]
    gq = qdq_reference(g, F32(sg), E5M2)[0]
    # both pairings contract x's axis 0 with w's axis 1 and x's axis 1 with w's axis 0
    close(y, np.einsum("abm,ban->mn", xq, wq))
    close(dx, np.einsum("mn,ban->abm", gq, wq))
    close(dw, np.einsum("abm,mn->ban", xq, gq))


def test_a_meta_in_a_later_argnum_is_tied_to_the_loss(rng) -> None:
    """value_and_grad ties the chain ends of every differentiated argument, not only the
    first: a teacher pass (output under stop_gradient) on a meta passed as the second argument
    still records its forward amaxes as one chain (docs/decisions/0264)."""
    x = random_fp8_friendly(rng, (8, 16))
    w = random_fp8_friendly(rng, (16, 8), 0.1)
    teacher = f8.init_meta(1, f8.DelayedScaling(amax_history_len=2))

    def loss(w, meta):
        target = jax.lax.stop_gradient(f8.dot_general(x, w, DIMS, meta))
        return jnp.sum(w**2) + 0.0 * jnp.sum(target)

    _, (dw, _), (none, obs) = f8.value_and_grad(loss, argnums=(0, 1))(w, teacher)
    assert none is None
    np.testing.assert_array_equal(np.asarray(dw), 2 * w)
    np.testing.assert_array_equal(np.asarray(obs.forward), [np.abs(x).max(), np.abs(w).max(), 0.0])
    assert float(obs.chains) == 1.0


@pytest.mark.parametrize("differentiated", [(True, False), (False, True)], ids=["x", "w"])
@pytest.mark.parametrize("override", list(itertools.product([False, True], repeat=3)))
def test_only_operands_an_fp8_gemm_reads_are_cast(operands, override, differentiated) -> None:
    """fp8kit.torch's rule, in every frontend: x is cast for an FP8 fprop, or an FP8 wgrad that
    runs (the kernel differentiated); W for an FP8 fprop or dgrad; dY for an FP8 dgrad whose dX
    is needed or an FP8 wgrad whose dW is. A slot nothing casts records no amax."""
    x, w, g = operands
    recipe = f8.DelayedScaling(amax_history_len=2, override_linear_precision=override)
    meta = _meta(recipe)
    need_dx, need_dw = differentiated
    argnums = (0, 2) if need_dx else (1, 2)

    def loss(x, w, meta):
        return jnp.sum(f8.dot_general(x, w, DIMS, meta).astype(jnp.float32) * g)

    dmeta = jax.grad(loss, argnums=argnums)(x, w, meta)[1]
    obs = f8.observations_of(dmeta)
    fprop, dgrad, wgrad = (not hp for hp in override)
    assert (float(obs.forward[0]) > 0) == (fprop or (wgrad and need_dw))
    assert (float(obs.forward[1]) > 0) == (fprop or dgrad)
    assert (float(obs.backward[0]) > 0) == ((dgrad and need_dx) or (wgrad and need_dw))


def test_high_precision_fprop_of_mixed_operands_keeps_the_promoted_dtype(rng) -> None:
    """A functional call with a bfloat16 lhs and a float32 rhs under an fprop override
    multiplies in the promoted float32, as ``jnp.dot`` does; only a layer's 16-bit compute
    dtype (its output dtype) rounds the kernel (tests/jax/test_linen.py)."""
    recipe = f8.DelayedScaling(override_linear_precision=(True, False, False))
    x = jnp.asarray(random_fp8_friendly(rng, (4, 8))).astype(jnp.bfloat16)
    w = jnp.asarray(random_fp8_friendly(rng, (8, 4)) * (1 + 2**-12))  # not bfloat16 values
    y = f8.dot_general(x, w, DIMS, f8.init_meta(1, recipe))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert y.dtype == jnp.float32
    close(y, want)

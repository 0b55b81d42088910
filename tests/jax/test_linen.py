"""Flax Linen Dense / DenseGeneral: drop-in behaviour, the "fp8_meta" collection, the seed 003
example, reuse, nn.scan, remat, jit, optimizer isolation, microbatches, checkpoints, inference."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization

import fp8kit.jax as f8
from fp8kit.jax.linen import Dense, DenseGeneral
from tests.jax.helpers import random_fp8_friendly

RECIPE = f8.DelayedScaling(amax_history_len=8)


def leaves_equal(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def init(model, x, recipe=RECIPE, seed: int = 0):
    """``model.init`` under ``autocast(recipe)``, jitted (one compile instead of one per op)."""
    with f8.autocast(recipe=recipe):
        return jax.jit(model.init)(jax.random.key(seed), x)


def metas(variables) -> list[f8.Fp8Meta]:
    return jax.tree.leaves(variables["fp8_meta"], is_leaf=lambda x: isinstance(x, f8.Fp8Meta))


@pytest.mark.slow  # eager, as the seed writes it: one compilation per primitive
def test_seed_003_example_as_written_plus_the_update() -> None:
    recipe = f8.DelayedScaling(margin=0, amax_history_len=1024, amax_compute_algo="max")
    with f8.autocast(enabled=True, recipe=recipe):
        # Initialize layer and data
        layer = DenseGeneral(features=64)
        key = jax.random.PRNGKey(0)
        x = jax.random.normal(key, (4, 16, 32), dtype=jnp.bfloat16)
        var_collect = layer.init(key, x)

        # Forward and backward pass
        def loss_fn(var_collect):
            output = layer.apply(var_collect, x)
            return output.sum()

        loss, grads = jax.value_and_grad(loss_fn)(var_collect)
    var_collect = f8.update(var_collect, grads)  # the one added step

    meta = var_collect["fp8_meta"]["meta"]
    ax = float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    aw = float(jnp.max(jnp.abs(var_collect["params"]["kernel"])))
    np.testing.assert_array_equal(meta.forward.amax_history[-1], [ax, aw, 0])
    np.testing.assert_array_equal(meta.backward.amax_history[-1], [1.0, 0])  # d(sum)/dy = 1
    want = np.float32(448) / np.array([ax, aw], np.float32)
    np.testing.assert_array_equal(meta.forward.scale, [want[0], want[1], 1.0])
    assert float(meta.backward.scale[0]) == 57344.0 and float(meta.step) == 1.0
    assert set(grads) == {"params", "fp8_meta"}
    assert grads["params"]["kernel"].shape == (32, 64)
    assert np.isfinite(float(loss))


def test_params_and_high_precision_path_match_flax() -> None:
    key = jax.random.key(3)
    x = jax.random.normal(key, (2, 3, 6, 7))
    general = {"features": (4, 5), "axis": (1, -1), "batch_dims": (0,)}
    unsorted = {"features": 4, "axis": (-1, 1)}  # Flax sorts the axes: its kernel is (3, 7, 4)
    for ours, theirs in (
        (Dense(5), nn.Dense(5)),
        (DenseGeneral(**general), nn.DenseGeneral(**general)),
        (DenseGeneral(**unsorted), nn.DenseGeneral(**unsorted)),
    ):
        v_ours = ours.init(key, x)
        v_theirs = theirs.init(key, x)
        assert "fp8_meta" not in v_ours  # no recipe, no autocast: plain high precision
        leaves_equal(v_ours, v_theirs)
        np.testing.assert_array_equal(
            np.asarray(ours.apply(v_ours, x)), np.asarray(theirs.apply(v_theirs, x))
        )


def test_partitioned_initializers_box_like_flax() -> None:
    """``nn.with_partitioning`` initializers, as sharded Flax models use them: the same boxed
    values and partition specs as Flax's DenseGeneral (fp8kit's reshaped the box and raised)."""
    key = jax.random.key(4)
    x = jax.random.normal(key, (2, 3, 8))
    kernel_init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model", None))
    bias_init = nn.with_partitioning(nn.initializers.normal(), ("model", None))
    kw = {"features": (2, 3), "kernel_init": kernel_init, "bias_init": bias_init}
    with f8.autocast(recipe=f8.DelayedScaling(amax_history_len=2)):
        ours = DenseGeneral(**kw).init(key, x)
    theirs = nn.DenseGeneral(**kw).init(key, x)
    assert nn.get_partition_spec(ours)["params"] == nn.get_partition_spec(theirs)["params"]
    leaves_equal(nn.unbox(ours["params"]), nn.unbox(theirs["params"]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"axis": 4}, "axis 4 is out of range for an input of 4 dimensions"),
        ({"axis": -1, "batch_dims": (5,)}, "batch_dims 5 is out of range"),
        ({"axis": (1, -3)}, r"axis \(1, -3\) names an axis twice"),
    ],
)
def test_dense_general_refuses_bad_axes(kwargs, match) -> None:
    x = jnp.ones((2, 3, 6, 7))
    with pytest.raises(ValueError, match=match):
        DenseGeneral(features=4, **kwargs).init(jax.random.key(0), x)


def test_dense_refuses_the_state_of_another_module() -> None:
    """A 2-GEMM meta (an MLP's) under a Dense ran, and f8.update rolled its whole history."""
    x = jnp.ones((4, 16))
    layer = Dense(4, recipe=RECIPE)
    v = jax.jit(layer.init)(jax.random.key(0), x)
    wrong = {**v, "fp8_meta": {"meta": f8.init_meta(2, RECIPE)}}
    with pytest.raises(ValueError, match="hold the state of a module with 2 GEMMs; a Dense has"):
        layer.apply(wrong, x)


def test_dense_on_one_unbatched_example_trains() -> None:
    """A 1-D input (as flax.linen.Dense takes): wgrad contracts nothing, an outer product.
    First step (scales 1): x = k/16 and dY = 1 are exact in E4M3 / E5M2, so dW is exactly
    outer(x, 1) and db = 1, from numpy; the same example as a batch of one gives the same."""
    x = jnp.arange(16, dtype=jnp.float32) / 16
    layer = Dense(8, recipe=RECIPE)
    v = layer.init(jax.random.key(0), x)
    _, g1, obs1 = f8.value_and_grad(lambda v: jnp.sum(layer.apply(v, x)))(v)
    _, g2, obs2 = f8.value_and_grad(lambda v: jnp.sum(layer.apply(v, x[None])))(v)
    expected = np.outer(np.arange(16) / 16, np.ones(8))
    np.testing.assert_array_equal(np.asarray(g1["params"]["kernel"]), expected)
    np.testing.assert_array_equal(np.asarray(g1["params"]["bias"]), np.ones(8))
    leaves_equal(g1["params"], g2["params"])
    leaves_equal(obs1, obs2)


def test_dense_general_fp8_matches_the_functional_op() -> None:
    key = jax.random.key(4)
    x = jax.random.normal(key, (3, 4, 6, 5))
    layer = DenseGeneral((2, 3), axis=(1, -1), batch_dims=(0,), recipe=RECIPE)
    v = layer.init(key, x)
    meta = metas(v)[0]
    kernel, bias = v["params"]["kernel"], v["params"]["bias"]
    assert kernel.shape == (3, 4, 5, 2, 3) and bias.shape == (3, 2, 3)

    def loss(v):
        return jnp.sum(layer.apply(v, x) ** 2)

    def reference(kernel, bias, meta):
        dims = (((1, 3), (1, 2)), ((0,), (0,)))
        y = f8.dot_general(x, kernel, dims, meta, bias=bias.reshape(3, 1, 2, 3))
        return jnp.sum(y**2)

    _, g, obs = jax.jit(f8.value_and_grad(loss))(v)
    _, g_ref, obs_ref = jax.jit(f8.value_and_grad(reference, argnums=(0, 1, 2)))(kernel, bias, meta)
    np.testing.assert_array_equal(np.asarray(g["params"]["kernel"]), np.asarray(g_ref[0]))
    np.testing.assert_array_equal(np.asarray(g["params"]["bias"]), np.asarray(g_ref[1]))
    leaves_equal(obs["fp8_meta"]["meta"], obs_ref[2])
    assert float(obs_ref[2].forward[0]) == float(jnp.max(jnp.abs(x)))


class _Bf16Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = Dense(16, use_bias=False, dtype=jnp.bfloat16, name="l1")(x)
        return Dense(8, use_bias=False, dtype=jnp.bfloat16, name="l2")(jnp.tanh(h) * 3.1)


def test_a_jitted_bfloat16_step_records_what_the_same_step_records_op_by_op(rng) -> None:
    """Layer 2's input and both dY are bfloat16 results computed in the same program as their
    casts; XLA's excess precision made the jitted step cast (and record amaxes of) the unrounded
    float32 values, so its observations differed from the op-by-op step's (docs/jax.md,
    "Dtypes")."""
    x = jnp.asarray(rng.standard_normal((8, 16)), jnp.bfloat16)
    model = _Bf16Mlp()
    v = init(model, x)

    def observe(v, x):
        loss = lambda v: jnp.mean((model.apply(v, x).astype(jnp.float32) - 0.37) ** 2)  # noqa: E731
        return f8.value_and_grad(loss)(v)[2]

    leaves_equal(jax.jit(observe)(v, x), observe(v, x))


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Dense(8)(x)


class _Reused(nn.Module):
    """One Dense called twice, and a compact parent whose Dense is rebuilt on each call."""

    @nn.compact
    def __call__(self, x):
        dense = Dense(8, name="shared")
        block = _Block()
        return dense(x) + dense(3 * x) + block(x) + block(2 * x)


def test_a_layer_used_twice_records_the_max_not_the_sum() -> None:
    model = _Reused()
    x = jnp.asarray(random_fp8_friendly(np.random.default_rng(0), (4, 8)))
    v = init(model, x)
    (_, grads, obs) = jax.jit(f8.value_and_grad(lambda v: jnp.sum(model.apply(v, x) * 2)))(v)

    def amax(a):
        return float(jnp.max(jnp.abs(a)))

    shared = obs["fp8_meta"]["shared"]["meta"]
    block = obs["fp8_meta"]["_Block_0"]["Dense_0"]["meta"]
    assert float(shared.forward[0]) == amax(3 * x) and float(block.forward[0]) == amax(2 * x)
    assert float(shared.backward[0]) == 2.0 and float(block.backward[0]) == 2.0  # not 4
    assert float(shared.chains) == 1.0 and float(block.chains) == 1.0
    assert "fp8_meta" not in grads
    # several apply calls on the same variables inside one loss chain as well
    d = Dense(8, recipe=RECIPE)
    vd = jax.jit(d.init)(jax.random.key(1), x)
    two_applies = f8.value_and_grad(lambda v: jnp.sum(d.apply(v, x)) + jnp.sum(d.apply(v, 5 * x)))
    _, _, o = jax.jit(two_applies)(vd)
    assert float(o["fp8_meta"]["meta"].forward[0]) == amax(5 * x)
    assert float(o["fp8_meta"]["meta"].chains) == 1.0
    # ... also with a mutable collection (docs/jax.md's nn.remat workaround), the shared Dense
    # called twice in the first apply: the second apply joins the end of that chain (it started
    # a second chain, which JAX summed and f8.update refused)
    for mutable in (["fp8_meta"], True):

        def loss(v, m=mutable):
            return jnp.sum(model.apply(v, x, mutable=m)[0]) + jnp.sum(
                model.apply(v, 5 * x, mutable=m)[0]
            )

        _, _, o = jax.jit(f8.value_and_grad(loss))(v)
        shared = o["fp8_meta"]["shared"]["meta"]
        assert float(shared.forward[0]) == amax(3 * (5 * x)), mutable
        assert float(shared.chains) == 1.0, mutable
        f8.update(v, o)  # no SummedObservationsError


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(Dense(16, name="dense")(x)), None


class _Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            nn.remat(_Layer),  # remat'ed layers: the recomputed forward is not observed twice
            variable_axes={"params": 0, "fp8_meta": 0},
            split_rngs={"params": True},
            length=2,
        )
        return stack(name="stack")(x, None)[0]


class _Unrolled(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = _Layer(name=f"layer{i}")(x, None)[0]
        return x


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("kind", ["target after", "target before", "aux only"])
def test_a_call_whose_output_reaches_the_loss_only_through_stop_gradient_is_observed(
    kind: str, jit: bool
) -> None:
    """A target or teacher pass (``stop_gradient``) and a call that feeds only the aux output
    record their amaxes like any other call, whatever their place in the chain: value_and_grad
    ties every chain's last meta to the loss (ADR 0264). Before, the last call of a chain whose
    output had no cotangent was lost, so the result depended on the call order."""
    x = jnp.asarray(random_fp8_friendly(np.random.default_rng(3), (8, 16)))
    with f8.autocast(recipe=f8.DelayedScaling(amax_history_len=4)):
        layer = DenseGeneral(features=16)
        variables = layer.init(jax.random.PRNGKey(1), x)

    def loss(v):
        if kind == "target before":
            target = jax.lax.stop_gradient(layer.apply(v, 10 * x))
            return jnp.mean((layer.apply(v, x) - target) ** 2)
        y, target = layer.apply(v, x), layer.apply(v, 10 * x)
        if kind == "aux only":
            return jnp.mean(y**2), target
        return jnp.mean((y - jax.lax.stop_gradient(target)) ** 2)

    grad_fn = f8.value_and_grad(loss, has_aux=kind == "aux only")
    _, grads, obs = (jax.jit(grad_fn) if jit else grad_fn)(variables)
    meta_obs = jax.tree.leaves(obs, is_leaf=lambda o: isinstance(o, f8.Observations))[0]
    assert float(meta_obs.forward[0]) == float(jnp.max(jnp.abs(10 * x)))
    assert float(meta_obs.chains) == 1.0  # one chain, as for any reused layer
    _, want, _ = f8.value_and_grad(lambda v: jnp.mean(layer.apply(v, x) ** 2))(variables)
    if kind == "aux only":  # the gradients themselves are those of the loss alone
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_scan_without_fp8_meta_in_variable_axes_says_so_at_init() -> None:
    """The usual ``variable_axes={"params": 0}`` of a converted stack leaves the FP8 collection
    read-only inside the scan: init's error says where to add it (it asked for init's
    variables, which the user was creating)."""

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(
                _Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2
            )
            return scan(name="stack")(x, None)[0]

    with pytest.raises(ValueError, match=r"variable_axes=\{'params': 0, 'fp8_meta': 0\}"):
        init(Stack(), jnp.ones((2, 16)))


@pytest.mark.slow
def test_scan_over_layers_equals_unrolled_with_per_layer_meta() -> None:
    x = jnp.asarray(random_fp8_friendly(np.random.default_rng(1), (4, 16)))
    vs = init(_Scanned(), x)
    # the unrolled model gets the same parameters and meta, layer by layer
    vu = {
        "params": {
            f"layer{i}": jax.tree.map(lambda a, i=i: np.asarray(a)[i], vs["params"]["stack"])
            for i in range(2)
        },
        "fp8_meta": {
            f"layer{i}": jax.tree.map(lambda a, i=i: np.asarray(a)[i], vs["fp8_meta"]["stack"])
            for i in range(2)
        },
    }

    def step(model):
        @jax.jit
        def run(v):
            loss, grads, obs = f8.value_and_grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(v)
            return loss, grads, f8.update(v, obs)

        return run

    ls, gs, vs2 = step(_Scanned())(vs)
    lu, gu, vu2 = step(_Unrolled())(vu)
    np.testing.assert_allclose(float(ls), float(lu), rtol=1e-6)
    for i in range(2):
        scanned_meta = jax.tree.map(lambda a, i=i: np.asarray(a)[i], vs2["fp8_meta"]["stack"])
        leaves_equal(scanned_meta, vu2["fp8_meta"][f"layer{i}"])  # bit-identical per layer
        np.testing.assert_allclose(
            np.asarray(gs["params"]["stack"]["dense"]["kernel"][i]),
            np.asarray(gu["params"][f"layer{i}"]["dense"]["kernel"]),
            rtol=1e-5,
            atol=1e-7,
        )
    hist = vs2["fp8_meta"]["stack"]["dense"]["meta"].forward.amax_history
    assert hist.shape == (2, 8, 3) and len(set(np.asarray(hist[:, -1, 0]).tolist())) == 2


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(Dense(32)(x))
        return Dense(4)(x)


_STEPS: dict[str, tuple] = {}  # per optimizer, plus "data": one shared (x, y, variables)


def _train_setup(opt: str):
    """A small FP8 MLP and a jitted train step per optimizer, built once per test session."""
    if opt not in _STEPS:
        txs = {
            "adam": optax.adam(1e-2),
            "clip_adamw": optax.chain(
                optax.clip_by_global_norm(1e-3), optax.adamw(1e-1, weight_decay=0.5)
            ),
            "sgd0": optax.sgd(0.0),
        }
        tx = txs[opt]
        model = _MLP()
        if "data" not in _STEPS:
            rng = np.random.default_rng(2)
            x = jnp.asarray(random_fp8_friendly(rng, (16, 8)))
            y = jnp.asarray(rng.standard_normal((16, 4)).astype(np.float32))
            _STEPS["data"] = (x, y, init(model, x))
        x, y, v = _STEPS["data"]
        traces: list[int] = []

        @jax.jit
        def train_step(v, opt_state, x, y):
            traces.append(1)

            def loss_fn(v):
                return jnp.mean((model.apply(v, x) - y) ** 2)

            loss, grads, obs = f8.value_and_grad(loss_fn)(v)
            updates, opt_state = tx.update(grads["params"], opt_state, v["params"])
            v = {"params": optax.apply_updates(v["params"], updates), "fp8_meta": v["fp8_meta"]}
            return f8.update(v, obs), opt_state, loss, grads

        _STEPS[opt] = (model, v, tx.init(v["params"]), x, y, train_step, traces)
    return _STEPS[opt]


def test_twenty_jitted_steps_compile_once_and_train() -> None:
    _, v, opt_state, x, y, train_step, traces = _train_setup("adam")
    n_traces = len(traces)
    losses = []
    for i in range(20):
        xi = x * (1 + 0.01 * i)  # new values, same shapes
        v, opt_state, loss, _ = train_step(v, opt_state, xi, y)
        losses.append(float(loss))
    assert len(traces) - n_traces <= 1 and train_step._cache_size() == 1
    f8.check_step(v["fp8_meta"], 20)
    assert losses[-1] < losses[0]
    for m in metas(v):
        assert np.count_nonzero(np.asarray(m.forward.amax_history[:, 0])) == 7  # L - 1 kept
        assert float(m.forward.update_count[0]) == 20


def test_optimizer_never_touches_fp8_state() -> None:
    _, v, st_full, x, y, step_full, _ = _train_setup("clip_adamw")
    _, _, st_zero, _, _, step_zero, _ = _train_setup("sgd0")
    v_full, _, _, grads = step_full(v, st_full, x, y)
    v_zero, _, _, _ = step_zero(v, st_zero, x, y)
    leaves_equal(v_full["fp8_meta"], v_zero["fp8_meta"])  # bit-identical meta
    assert set(grads) == {"params"}  # the optimizer only ever saw parameters
    # no optimizer state (moments, counts) was created for any FP8 leaf
    meta_shapes = {tuple(a.shape) for a in jax.tree.leaves(v["fp8_meta"])}
    param_shapes = {tuple(a.shape) for a in jax.tree.leaves(v["params"])}
    opt_shapes = {tuple(a.shape) for a in jax.tree.leaves(st_full)}
    assert opt_shapes <= param_shapes | {()} and not (meta_shapes - {()}) & opt_shapes
    assert not jnp.array_equal(
        v_full["params"]["Dense_0"]["kernel"], v["params"]["Dense_0"]["kernel"]
    )


def test_microbatch_accumulation_equals_one_big_batch() -> None:
    model, v, _, x, y, _, _ = _train_setup("sgd0")

    def loss_fn(v, x, y):
        return jnp.sum((model.apply(v, x) - y) ** 2)  # a sum: per-sample gradients add up

    grad_fn = jax.jit(f8.value_and_grad(loss_fn))
    _, g_big, o_big = grad_fn(v, x, y)
    g_acc, o_acc = None, None
    for i in range(4):
        sl = slice(4 * i, 4 * i + 4)
        _, g, o = grad_fn(v, x[sl], y[sl])
        g_acc = g if g_acc is None else jax.tree.map(jnp.add, g_acc, g)
        o_acc = o if o_acc is None else f8.combine_observations(o_acc, o)
    leaves_equal(o_acc, o_big)  # max over microbatches == the big batch's amax, bit for bit
    for a, b in zip(jax.tree.leaves(g_acc), jax.tree.leaves(g_big), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    leaves_equal(f8.update(v, o_acc), f8.update(v, o_big))


def test_checkpoint_restore_resumes_bit_identically(tmp_path) -> None:
    _, v, opt_state, x, y, train_step, _ = _train_setup("adam")
    template_v, template_opt = v, opt_state  # a fresh model's variables, as a restore target
    for _ in range(3):
        v, opt_state, _, _ = train_step(v, opt_state, x, y)
    path = tmp_path / "ckpt.msgpack"
    path.write_bytes(serialization.to_bytes({"v": v, "opt": opt_state}))
    a_v, a_opt = v, opt_state
    for _ in range(3):
        a_v, a_opt, _, _ = train_step(a_v, a_opt, x, y)
    restored = serialization.from_bytes({"v": template_v, "opt": template_opt}, path.read_bytes())
    b_v, b_opt = restored["v"], restored["opt"]
    f8.check_step(b_v["fp8_meta"], 3)
    for _ in range(3):
        b_v, b_opt, _, _ = train_step(b_v, b_opt, x, y)
    leaves_equal(a_v, b_v)
    leaves_equal(a_opt, b_opt)
    # the recipe is stored as JSON-compatible data beside the arrays (never pickle)
    state = serialization.to_state_dict(v)
    assert state["fp8_meta"]["Dense_0"]["meta"]["recipe"]["amax_history_len"] == 8
    # a checkpoint with another history length is resized with a warning
    small = init(_MLP(), x, f8.DelayedScaling(amax_history_len=4))
    with pytest.warns(UserWarning, match="resizing"), pytest.warns(UserWarning, match="is kept"):
        resized = serialization.from_state_dict(small, state)
    got = metas(resized)[0].forward.amax_history
    np.testing.assert_array_equal(got[1:], metas(v)[0].forward.amax_history[-3:])
    # a scale or count of another size is refused, naming it
    meta_state = state["fp8_meta"]["Dense_0"]["meta"]
    meta_state["forward"]["scale"] = np.ones(5, np.float32)
    with pytest.raises(ValueError, match=r"checkpoint scale has shape \(5,\), the model \(3,\)"):
        serialization.from_state_dict(v, state)


def test_inference_leaves_meta_unchanged() -> None:
    model, v, _, x, _, _, _ = _train_setup("sgd0")
    before = jax.tree.map(np.asarray, v["fp8_meta"])
    y1 = jax.jit(model.apply)(v, x)
    y2 = model.apply(v, x)
    leaves_equal(v["fp8_meta"], before)
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), rtol=1e-6)
    # mutable fp8_meta threads the chain through the collection and returns the same state
    y3, mutated = model.apply(v, x, mutable=["fp8_meta"])
    leaves_equal(mutated["fp8_meta"], before)
    np.testing.assert_array_equal(np.asarray(y3), np.asarray(y2))
    # FP8 really ran: high precision (no fp8_meta collection) gives other numbers
    y_hp = model.apply({"params": v["params"]}, x)
    assert not np.allclose(np.asarray(y_hp), np.asarray(y2), rtol=1e-4)


def test_autocast_only_sets_construction_defaults() -> None:
    x = jnp.ones((2, 4))
    with f8.autocast(recipe=RECIPE):
        layer = Dense(3)
    assert layer.recipe == RECIPE
    v = layer.init(jax.random.key(0), x)  # outside the autocast: the field decides
    assert metas(v)[0].recipe == RECIPE
    with f8.autocast(enabled=False):
        off = Dense(3)
    assert off.recipe is None and "fp8_meta" not in off.init(jax.random.key(0), x)
    other = f8.DelayedScaling(amax_history_len=4)
    with pytest.raises(ValueError, match="belongs to"):
        Dense(3, recipe=other).apply(v, x)
    with pytest.raises(ValueError, match="FP8 disabled"):
        off.apply(v, x)
    with pytest.raises(ValueError, match=r"hold no .fp8_meta."):
        layer.apply({"params": v["params"]}, x)
    # a layer with no recipe of its own takes its state's recipe (what compact children do)
    plain = Dense(3)
    np.testing.assert_array_equal(np.asarray(plain.apply(v, x)), np.asarray(layer.apply(v, x)))
    # the recipe is part of the jit cache key through the state's treedef
    f = jax.jit(plain.apply)
    f(v, x)
    v_other = {"params": v["params"], "fp8_meta": f8.with_recipe(v["fp8_meta"], other)}
    f(v_other, x)
    assert f._cache_size() == 2
    with pytest.raises(TypeError, match="recipe must be"):
        Dense(3, recipe="hybrid")
    with pytest.raises(TypeError, match="enabled must be a bool"), f8.autocast(enabled="yes"):
        pass


def test_a_layer_built_outside_any_autocast_takes_the_one_around_init_and_apply() -> None:
    """Flax constructs a module again for each init and apply, so a layer built outside any
    autocast runs with the autocast around the call, as compact children do and as Transformer
    Engine's fp8_autocast works (docs/jax.md, "Where the recipe comes from"); the errors say
    where the recipe came from instead of "was constructed with"."""
    x = jnp.ones((2, 4))
    layer = Dense(3)
    assert "fp8_meta" not in layer.init(jax.random.key(0), x)  # no autocast: high precision
    with f8.autocast(recipe=RECIPE):
        v = layer.init(jax.random.key(0), x)
    assert metas(v)[0].recipe == RECIPE
    assert layer.apply(v, x).shape == (2, 3)  # outside any autocast: the state's recipe
    other = f8.autocast(recipe=f8.DelayedScaling(amax_history_len=4))
    with pytest.raises(ValueError, match=r"runs with recipe .* or around this call\) but"), other:
        layer.apply(v, x)
    with pytest.raises(ValueError, match="runs with FP8 disabled"), f8.autocast(enabled=False):
        layer.apply(v, x)
    params = {"params": v["params"]}  # high precision: the params alone
    want = np.asarray(layer.apply(params, x))
    with f8.autocast(enabled=False):
        np.testing.assert_array_equal(np.asarray(layer.apply(params, x)), want)


def test_a_jitted_init_and_apply_follow_the_autocast_around_each_call() -> None:
    """The autocast is part of the jit cache key: ``jax.jit(layer.init)`` traced under one
    autocast traces again under another (it kept the first recipe, and FP8 under
    ``enabled=False``), and a jitted apply raises under another recipe as the eager one does."""
    x = jnp.ones((2, 4))
    layer = Dense(3)
    other = f8.DelayedScaling(amax_history_len=8, margin=1)
    init, apply = jax.jit(layer.init), jax.jit(layer.apply)
    with f8.autocast(recipe=RECIPE):
        v = init(jax.random.key(0), x)
    with f8.autocast(recipe=other):
        assert metas(init(jax.random.key(0), x))[0].recipe == other
    with f8.autocast(enabled=False):
        assert "fp8_meta" not in init(jax.random.key(0), x)
    assert metas(v)[0].recipe == RECIPE
    apply(v, x)  # traced outside any autocast: the state's recipe
    with pytest.raises(ValueError, match=r"runs with recipe .* but"), f8.autocast(recipe=other):
        apply(v, x)


class _SharedStep(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(Dense(16, name="shared")(h)) * 2.0, None


class _WeightSharedScan(nn.Module):
    """One Dense applied three times by nn.scan: params broadcast, FP8 state carried."""

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(
            _SharedStep,
            variable_broadcast="params",
            variable_carry="fp8_meta",
            split_rngs={"params": False},
            length=3,
        )
        return scan(name="scan")(x, None)[0]


class _WeightSharedLoop(nn.Module):
    @nn.compact
    def __call__(self, x):
        step = _SharedStep(name="scan")
        for _ in range(3):
            x = step(x, None)[0]
        return x


def test_a_weight_shared_scan_carries_the_chain_in_the_collection(rng) -> None:
    """The carried collection passes each iteration's returned meta to the next, so the three
    calls form one chain (max, chains == 1), exactly as the same layer called three times in a
    Python loop; without it JAX sums the iterations' observations and update refuses them."""
    x = jnp.asarray(random_fp8_friendly(rng, (4, 16)))
    # nn.scan cannot create a carried collection at init: the unrolled loop's variables have
    # the same tree (params broadcast, state carried, both without a layer axis)
    v = init(_WeightSharedLoop(), x)

    def observe(model):
        def loss(v):
            y, _ = model.apply(v, x, mutable=["fp8_meta"])
            return jnp.mean(y**2)

        return jax.jit(f8.value_and_grad(loss))(v)

    _, _, obs = observe(_WeightSharedScan())
    _, _, obs_loop = observe(_WeightSharedLoop())
    got = jax.tree.leaves(obs, is_leaf=lambda o: isinstance(o, f8.Observations))[0]
    want = jax.tree.leaves(obs_loop, is_leaf=lambda o: isinstance(o, f8.Observations))[0]
    assert float(got.chains) == float(want.chains) == 1.0
    np.testing.assert_array_equal(np.asarray(got.forward), np.asarray(want.forward))
    np.testing.assert_array_equal(np.asarray(got.backward), np.asarray(want.backward))
    assert float(got.forward[0]) >= float(jnp.max(jnp.abs(x)))
    f8.update(v, obs)  # one chain: accepted


@pytest.mark.parametrize("where", ["field", "autocast"])
def test_a_reused_layer_with_reduction_axes_set_records_the_max(rng, where: str) -> None:
    """Reduction axes given (None: every axis the amax varies over) and equal to those of the
    state the layer created: two applies in one loss are one chain, as without the setting."""
    x = jnp.asarray(random_fp8_friendly(rng, (4, 8)))
    axes = {"amax_reduction_axes": None}
    with f8.autocast(recipe=RECIPE, **(axes if where == "autocast" else {})):
        d = Dense(8, **(axes if where == "field" else {}))
        v = jax.jit(d.init)(jax.random.key(1), x)
    loss = lambda v: jnp.sum(d.apply(v, x)) + jnp.sum(d.apply(v, 5 * x))  # noqa: E731
    _, _, obs = jax.jit(f8.value_and_grad(loss))(v)
    meta_obs = obs["fp8_meta"]["meta"]
    assert float(meta_obs.chains) == 1.0
    assert float(meta_obs.forward[0]) == float(jnp.max(jnp.abs(5 * x)))
    assert float(meta_obs.backward[0]) == 1.0  # dY of each call is ones: max 1, not a sum 2
    f8.update(v, obs)  # no SummedObservationsError


@pytest.mark.parametrize("make", [
    lambda dtype: Dense(8, dtype=dtype),
    lambda dtype: DenseGeneral((2, 4), dtype=dtype),
], ids=["Dense", "DenseGeneral"])  # fmt: skip
def test_the_output_has_the_layers_compute_dtype_like_flax(rng, make) -> None:
    """float32 inputs and params, ``dtype=bfloat16``: Flax's layer returns bfloat16, and so
    does the FP8 one; its values are the FP8 GEMM's result rounded to bfloat16 (the functional
    op with the same operands and ``preferred_element_type``)."""
    x = jnp.asarray(random_fp8_friendly(rng, (4, 16)))
    layer = make(jnp.bfloat16)
    v = init(layer, x)
    flax_y = getattr(nn, type(layer).__name__)(layer.features, dtype=jnp.bfloat16).apply(
        {"params": v["params"]}, x
    )
    y = jax.jit(layer.apply)(v, x)
    assert y.dtype == flax_y.dtype == jnp.bfloat16
    kernel = v["params"]["kernel"].reshape(16, 8)
    bias = v["params"]["bias"].reshape(8).astype(jnp.bfloat16)
    want = jax.jit(
        lambda: f8.dot_general(
            x.astype(jnp.bfloat16), kernel, (((1,), (0,)), ((), ())), metas(v)[0],
            bias=bias, preferred_element_type=jnp.bfloat16,
        )
    )()  # fmt: skip
    np.testing.assert_array_equal(
        np.asarray(y, np.float32).reshape(4, 8), np.asarray(want, np.float32)
    )


def test_high_precision_fprop_multiplies_by_the_kernel_in_the_compute_dtype() -> None:
    """``override_linear_precision`` fprop with float32 parameters and ``dtype=bfloat16``: the
    GEMM takes the kernel rounded to bfloat16, as Flax's Dense, torch under torch.autocast and
    Keras's mixed_bfloat16 do; the float32 master serves only the FP8 WEIGHT cast. 1 + 5 * 2^-10
    is 1 + 2^-7 in bfloat16, so x . w = 2^-7 (the master would give 5 * 2^-10)."""
    recipe = f8.DelayedScaling(amax_history_len=1, override_linear_precision=(True, False, False))
    w = np.array([[1 + 5 * 2**-10], [-1.0]], np.float32)
    layer = Dense(1, use_bias=False, recipe=recipe, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    v = {"params": {"kernel": jnp.asarray(w)}, "fp8_meta": {"meta": f8.init_meta(1, recipe)}}
    y = layer.apply(v, jnp.ones((1, 2), jnp.float32))
    flax_y = nn.Dense(1, use_bias=False, dtype=jnp.bfloat16).apply(v, jnp.ones((1, 2)))
    assert y.dtype == jnp.bfloat16
    assert float(y[0, 0]) == float(flax_y[0, 0]) == 2.0**-7


def _lifted(kind: str) -> nn.Module:
    """Two tanh(Dense) layers (a ``stack`` under ``nn.scan``, else one ``layer`` under ``nn.remat``
    or ``nn.jit`` applied twice), called on ``h`` and, when given, on a ``teacher`` input."""

    class Model(nn.Module):
        @nn.compact
        def __call__(self, h, teacher=None):
            if kind == "nn.scan":
                scan = nn.scan(
                    _Layer,
                    variable_axes={"params": 0, "fp8_meta": 0},
                    split_rngs={"params": True},
                    length=2,
                )
                stack = scan(name="stack")
                run = lambda h: stack(h, None)[0]  # noqa: E731
            else:
                layer = {"nn.remat": nn.remat, "nn.jit": nn.jit}[kind](_Layer)(name="layer")
                run = lambda h: layer(layer(h, None)[0], None)[0]  # noqa: E731
            return run(h) if teacher is None else (run(h), run(teacher))

    return Model()


def _unlifted_variables(kind: str, variables):
    """The variables of :func:`_lifted`'s model for the same computation without the transform:
    the scanned stack unstacked into ``l0``, ``l1`` (the remat / jit layer's stay as they are)."""
    if kind != "nn.scan":
        return variables
    return {
        col: {f"l{i}": jax.tree.map(lambda a, i=i: a[i], tree["stack"]) for i in range(2)}
        for col, tree in variables.items()
    }


class _UnrolledWithTeacher(nn.Module):
    @nn.compact
    def __call__(self, h, teacher=None):
        layers = [_Layer(name=f"l{i}") for i in range(2)]

        def run(h):
            for layer in layers:
                h = layer(h, None)[0]
            return h

        return run(h) if teacher is None else (run(h), run(teacher))


class _Twice(nn.Module):
    @nn.compact
    def __call__(self, h, teacher=None):
        layer = _Layer(name="layer")
        run = lambda h: layer(layer(h, None)[0], None)[0]  # noqa: E731
        return run(h) if teacher is None else (run(h), run(teacher))


@pytest.mark.parametrize("kind", ["nn.scan", "nn.remat", "nn.jit"])
def test_lifted_transforms_observe_a_teacher_pass_tied_to_the_loss(kind: str) -> None:
    """docs/jax.md, Linen lifted transforms: a teacher pass made last (its output only under
    stop_gradient) inside nn.scan / nn.remat / nn.jit, in one apply with a mutable collection
    tied to the loss by f8.tie_to_loss, gives the observations, meta and gradients of the same
    computation without the transform, bit for bit. Untied, the teacher's amaxes are lost."""
    x = jnp.asarray(random_fp8_friendly(np.random.default_rng(5), (4, 16)))
    model = _lifted(kind)
    plain = _UnrolledWithTeacher() if kind == "nn.scan" else _Twice()
    variables = init(model, x, f8.DelayedScaling(amax_history_len=4))
    unlifted = _unlifted_variables(kind, variables)

    def loss_of(m, tie):
        def loss(v):
            (y, t), updated = m.apply(v, x, 10 * x, mutable=["fp8_meta"])
            value = jnp.mean((y - jax.lax.stop_gradient(t)) ** 2)
            return f8.tie_to_loss(value, updated["fp8_meta"]) if tie else value

        return jax.jit(f8.value_and_grad(loss))

    value, grads, obs = loss_of(model, True)(variables)
    want_value, want_grads, want_obs = loss_of(plain, False)(unlifted)
    assert float(value) == float(want_value)
    leaves_equal(_unlifted_variables(kind, grads), want_grads)
    leaves_equal(_unlifted_variables(kind, obs), want_obs)
    leaves_equal(
        _unlifted_variables(kind, f8.update(variables, obs)), f8.update(unlifted, want_obs)
    )
    first = jax.tree.leaves(want_obs, is_leaf=lambda o: isinstance(o, f8.Observations))[0]
    assert float(first.forward[0]) == float(jnp.max(jnp.abs(10 * x)))  # the teacher's input
    _, _, untied = loss_of(model, False)(variables)
    lost = jax.tree.leaves(untied, is_leaf=lambda o: isinstance(o, f8.Observations))[0]
    assert float(np.ravel(lost.forward[..., 0])[0]) == float(jnp.max(jnp.abs(x)))


@pytest.mark.parametrize("kind", ["nn.scan", "nn.jit"])
def test_a_lifted_layer_run_in_two_applies_is_refused_with_the_fix(kind: str) -> None:
    """Each apply starts the lifted layer from the same meta, so JAX adds the observations:
    refused, and the message names the fix (one apply, f8.tie_to_loss)."""
    x = jnp.ones((4, 16))
    model = _lifted(kind)
    variables = init(model, x)
    loss = lambda v: jnp.sum(model.apply(v, x)) + jnp.sum(model.apply(v, 2 * x))  # noqa: E731
    _, _, obs = jax.jit(f8.value_and_grad(loss))(variables)
    with pytest.raises(f8.SummedObservationsError, match=r"lifted transform .*tie_to_loss"):
        f8.update(variables, obs)


def test_tie_to_loss_names_a_bad_argument() -> None:
    loss, out = jnp.float32(1.0), jnp.ones(3)
    with pytest.raises(TypeError, match="loss must be a scalar floating-point JAX array"):
        f8.tie_to_loss(jnp.ones(2), out)
    with pytest.raises(TypeError, match="loss must be a scalar floating-point JAX array"):
        f8.tie_to_loss(1.0, out)
    with pytest.raises(TypeError, match="outputs must hold floating-point JAX arrays and Fp8Meta"):
        f8.tie_to_loss(loss, {"a": out, "b": jnp.arange(3)})
    with pytest.raises(ValueError, match="outputs holds no array"):
        f8.tie_to_loss(loss, {})
    assert float(f8.tie_to_loss(loss, [out])) == 1.0
    grad = jax.grad(lambda w: f8.tie_to_loss(jnp.sum(w**2), w * 3))(jnp.arange(3.0))
    np.testing.assert_array_equal(np.asarray(grad), [0.0, 2.0, 4.0])  # gradients unchanged

"""docs/semantics.md section 3 and worked numbers 1-10 and 13 through fp8kit.jax.update (pure,
batched)."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8kit.jax as f8
from fp8kit.formats import E4M3, E5M2
from fp8kit.jax.scaling import count_wrap, update_scaling_state
from tests.reference import scale_sequence, update_reference

F32 = np.float32


def _obs(meta: f8.Fp8Meta, forward=None, backward=None) -> f8.Observations:
    fwd = np.zeros(meta.forward.scale.shape, F32)
    bwd = np.zeros(meta.backward.scale.shape, F32)
    if forward is not None:
        fwd[..., 0] = forward
    if backward is not None:
        bwd[..., 0] = backward
    chains = np.ones(meta.step.shape, F32)
    return f8.Observations(jnp.asarray(fwd), jnp.asarray(bwd), jnp.asarray(chains))


INF = float("inf")
BELOW_448 = float(np.nextafter(F32(448), F32(0)))
ABOVE_448 = float(np.nextafter(F32(448), F32(1e9)))
P2 = {"power_2_scale": True}

# docs/semantics.md section 10, numbers 1-10: name -> (amaxes per event (None = did not run),
# recipe, direction)
SPEC_CASES = {
    "1": ([1, 2, 8, 3, 0.5, 0.5, 0.5, 0.5], f8.DelayedScaling(amax_history_len=4), "forward"),
    "2": (
        [1, 2, 8, 3, 0.5, 0.5, 0.5, 0.5],
        f8.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent"),
        "forward",
    ),
    "3+": ([1, 3], f8.DelayedScaling(amax_history_len=2, margin=1), "forward"),
    "3-": ([1, 3], f8.DelayedScaling(amax_history_len=2, margin=-1), "forward"),
    "4": ([1, 3, 0.001], f8.DelayedScaling(amax_history_len=2), "backward"),
    "5": ([0, 0, 5], f8.DelayedScaling(amax_history_len=3), "forward"),
    "6": ([8, 1, None], f8.DelayedScaling(amax_history_len=2), "forward"),
    "7max": ([1, INF, 2, 2, 2], f8.DelayedScaling(amax_history_len=3), "forward"),
    "7recent": (
        [1, INF, 2, 2, 2],
        f8.DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent"),
        "forward",
    ),
    "8tiny": ([1e-37], f8.DelayedScaling(amax_history_len=1), "forward"),
    "8small": ([1e-30], f8.DelayedScaling(amax_history_len=1), "forward"),
    "8huge": ([3e38], f8.DelayedScaling(amax_history_len=1), "forward"),
    "8seq": ([4, 2, 0, 16], f8.DelayedScaling(amax_history_len=1), "forward"),
    "9": ([3], f8.DelayedScaling(**P2), "forward"),
    "9margin": ([3], f8.DelayedScaling(margin=1, **P2), "forward"),
    "9small": ([0.001], f8.DelayedScaling(**P2), "forward"),
    "9cap": ([1e-37], f8.DelayedScaling(**P2), "forward"),
    "9fmax": ([448], f8.DelayedScaling(**P2), "forward"),
    "9below": ([BELOW_448], f8.DelayedScaling(**P2), "forward"),
    "9above": ([ABOVE_448], f8.DelayedScaling(**P2), "forward"),
    "10": ([1, 2, 8, 3], f8.DelayedScaling(amax_history_len=4, interval=2), "forward"),
}


@pytest.fixture(scope="module")
def spec_runs():
    """Every worked-number case side by side in one tree: one update() call (one program) per
    event."""
    metas = {name: f8.init_meta(1, recipe) for name, (_, recipe, _) in SPEC_CASES.items()}
    steps = max(len(a) for a, _, _ in SPEC_CASES.values())
    out = {name: {"scales": [], "states": []} for name in SPEC_CASES}
    for k in range(steps):
        obs = {}
        for name, (amaxes, _, direction) in SPEC_CASES.items():
            a = amaxes[k] if k < len(amaxes) and amaxes[k] is not None else 0.0
            obs[name] = _obs(metas[name], **{direction: a})
        metas = f8.update(metas, obs)
        for name, (amaxes, _, direction) in SPEC_CASES.items():
            if k < len(amaxes):
                state = getattr(metas[name], direction)
                out[name]["scales"].append(float(state.scale[0]))
                out[name]["states"].append(jax.tree.map(np.asarray, state))
    return out


def test_spec10_1_and_2_max_and_most_recent(spec_runs) -> None:
    scales, states = spec_runs["1"]["scales"], spec_runs["1"]["states"]
    assert scales == [448, 224, 56, 56, 56, 56, F32(448) / F32(3), 896]
    assert scales[6] == pytest.approx(149.33333, rel=1e-7)
    np.testing.assert_array_equal(states[3].amax_history[:, 0], [0, 2, 8, 3])
    np.testing.assert_array_equal(states[7].amax_history[:, 0], [0, 0.5, 0.5, 0.5])
    assert spec_runs["2"]["scales"] == [448, 224, 56, F32(448) / F32(3), 896, 896, 896, 896]


def test_spec10_3_margin(spec_runs) -> None:
    plus, minus = spec_runs["3+"]["scales"], spec_runs["3-"]["scales"]
    assert plus == [224, F32(224) / F32(3)] and plus[1] == pytest.approx(74.666664)
    assert minus == [896, F32(896) / F32(3)] and minus[1] == pytest.approx(298.66666)


def test_spec10_4_e5m2_backward_under_hybrid(spec_runs) -> None:
    scales = spec_runs["4"]["scales"]
    assert scales == [57344, F32(57344) / F32(3), F32(57344) / F32(3)]
    assert scales[1] == pytest.approx(19114.666)


def test_spec10_5_and_6_zero_skip(spec_runs) -> None:
    scales, states = spec_runs["5"]["scales"], spec_runs["5"]["states"]
    assert not states[1].amax_history.any() and states[1].update_count[0] == 0
    assert scales == [1, 1, F32(448) / F32(5)] and scales[2] == pytest.approx(89.6)
    np.testing.assert_array_equal(states[2].amax_history[:, 0], [0, 0, 5])
    assert spec_runs["6"]["scales"] == [56, 56, 56]
    np.testing.assert_array_equal(spec_runs["6"]["states"][2].amax_history[:, 0], [0, 1])


def test_spec10_7_inf(spec_runs) -> None:
    assert spec_runs["7max"]["scales"] == [448, 448, 448, 448, 224]
    assert spec_runs["7recent"]["scales"] == [448, 448, 224, 224, 224]


def test_spec10_8_history_len_one_and_guards(spec_runs) -> None:
    assert spec_runs["8tiny"]["scales"] == [np.finfo(F32).max]
    assert spec_runs["8small"]["scales"] == [F32(448) / F32(1e-30)]
    assert spec_runs["8small"]["scales"][0] == pytest.approx(4.48e32)
    assert spec_runs["8huge"]["scales"] == [F32(448) / F32(3e38)]
    assert spec_runs["8huge"]["scales"][0] == pytest.approx(1.4933333e-36)
    assert spec_runs["8seq"]["scales"] == [112, 224, 224, 28]


def test_spec10_9_power_of_two(spec_runs) -> None:
    assert spec_runs["9"]["scales"] == [128]
    assert spec_runs["9margin"]["scales"] == [64]
    assert spec_runs["9small"]["scales"] == [262144]
    # capped at 2**127; exact at the boundaries where a float32 log2 would round
    assert spec_runs["9cap"]["scales"] == [2.0**127]
    assert spec_runs["9fmax"]["scales"] == [1.0]
    assert spec_runs["9below"]["scales"] == [1.0]
    assert spec_runs["9above"]["scales"] == [0.5]


def test_spec10_10_interval(spec_runs) -> None:
    assert spec_runs["10"]["scales"] == [448, 448, 56, 56]


def test_spec10_13_several_quantizations_before_one_update() -> None:
    """Three observations of one slot staged before one event leave one history entry, 5."""
    meta = f8.init_meta(1, f8.DelayedScaling(amax_history_len=4))
    for a in (3.0, 5.0, 2.0):
        meta = f8.stage(meta, _obs(meta, forward=a))
    assert float(meta.forward.amax_history[0, 0]) == 5.0
    meta = f8.update(meta)
    np.testing.assert_array_equal(meta.forward.amax_history[:, 0], [0, 0, 0, 5])
    assert float(meta.forward.scale[0]) == F32(448) / F32(5)  # SPEC's 89.6, to the bit
    # the same through combine_observations (what microbatches and devices use)
    meta2 = f8.init_meta(1, f8.DelayedScaling(amax_history_len=4))
    obs = f8.combine_observations(*(_obs(meta2, forward=a) for a in (3.0, 5.0, 2.0)))
    meta2 = f8.update(meta2, obs)
    np.testing.assert_array_equal(meta2.forward.amax_history, meta.forward.amax_history)


RECIPES = [
    f8.DelayedScaling(amax_history_len=1),
    f8.DelayedScaling(amax_history_len=5),
    f8.DelayedScaling(amax_history_len=5, amax_compute_algo="most_recent", margin=2),
    f8.DelayedScaling(amax_history_len=3, margin=-1.5),
    f8.DelayedScaling(amax_history_len=4, power_2_scale=True, margin=1),
    f8.DelayedScaling(amax_history_len=6, interval=3),
    f8.DelayedScaling(amax_history_len=4, fp8_format="E4M3"),
    f8.DelayedScaling(amax_history_len=4, fp8_format="hybrid", interval=2),
]


def _random_amaxes(rng: np.random.Generator, n: int) -> np.ndarray:
    a = np.exp(rng.uniform(-40, 40, n)).astype(F32)
    a[rng.random(n) < 0.2] = 0.0  # did not run
    a[rng.random(n) < 0.03] = np.inf
    return a


def test_random_sequences_match_reference_bit_for_bit(rng: np.random.Generator) -> None:
    """Every recipe of RECIPES, several modules each (batched buffers, one update program),
    against the per-slot scalar reference over 12 events."""
    metas = {
        (i, name): f8.init_meta(g, recipe)
        for i, recipe in enumerate(RECIPES)
        for name, g in (("a", 2), ("b", 1))
    }
    ref = {}
    for key, m in metas.items():
        for d in ("forward", "backward"):
            st = getattr(m, d)
            ref[key, d] = [
                np.asarray(st.amax_history),
                np.asarray(st.scale),
                np.zeros(st.num_slots),
            ]
    for _ in range(12):
        obs = {}
        for key, m in metas.items():
            recipe = RECIPES[key[0]]
            fwd = _random_amaxes(rng, m.forward.num_slots)
            bwd = _random_amaxes(rng, m.backward.num_slots)
            obs[key] = f8.Observations(jnp.asarray(fwd), jnp.asarray(bwd), jnp.float32(1))
            for d, a in (("forward", fwd), ("backward", bwd)):
                fmt = recipe.fp8_format.forward if d == "forward" else recipe.fp8_format.backward
                h, s, c = ref[key, d]
                h = h.copy()
                h[0] = np.maximum(h[0], a)
                ref[key, d] = list(update_reference(h, s, c, recipe, fmt.max))
        metas = f8.update(metas, obs)
        for key, m in metas.items():
            for d in ("forward", "backward"):
                st = getattr(m, d)
                h, s, c = ref[key, d]
                msg = f"recipe {RECIPES[key[0]]}, module {key[1]}, {d}"
                np.testing.assert_array_equal(np.asarray(st.amax_history), h, err_msg=msg)
                np.testing.assert_array_equal(np.asarray(st.scale), s.astype(F32), err_msg=msg)
                np.testing.assert_array_equal(np.asarray(st.update_count), c, err_msg=msg)


def test_callables_see_the_whole_state_and_are_guarded() -> None:
    seen = []

    def algo(history):
        seen.append(history.shape)
        return jnp.mean(history, axis=0)

    def bad_scale(amax, old, fmax, recipe):
        return jnp.where(amax > 2, jnp.nan, -1.0) * 0 + jnp.where(amax > 2, jnp.inf, fmax / amax)

    r = f8.DelayedScaling(amax_history_len=3, amax_compute_algo=algo)
    metas = [f8.init_meta(1, r), f8.init_meta(2, r)]
    obs = [_obs(metas[0], forward=4.0), _obs(metas[1], forward=2.0)]
    out = f8.update(metas, obs)
    assert (3, 9) in seen  # forward slots of both modules in one (L, N) buffer
    want, _ = scale_sequence([4.0], r, 448.0)
    assert float(out[0].forward.scale[0]) == want[0]
    r2 = f8.DelayedScaling(amax_history_len=2, scaling_factor_compute_algo=bad_scale)
    meta = f8.init_meta(1, r2)
    m1 = f8.update(meta, _obs(meta, forward=1.0))
    assert float(m1.forward.scale[0]) == 448.0
    m2 = f8.update(m1, _obs(m1, forward=3.0))
    assert float(m2.forward.scale[0]) == 448.0  # inf result: old scale kept

    def wrong_shape(history):
        return jnp.zeros((7,))

    for algo in (wrong_shape, jnp.max):  # a 0-d result is not spread over the columns either
        r3 = f8.DelayedScaling(amax_history_len=2, amax_compute_algo=algo)
        meta = f8.init_meta(1, r3)
        with pytest.raises(ValueError, match="amax_compute_algo must return an array of shape"):
            f8.update(meta, _obs(meta, forward=1.0))


def test_stage_needs_observations() -> None:
    meta = f8.init_meta(1, f8.DelayedScaling(amax_history_len=2))
    with pytest.raises(ValueError, match="stage needs the observations of every Fp8Meta"):
        f8.stage(meta, None)


def test_fp8_state_that_is_not_float32_is_refused() -> None:
    """A whole-tree cast to bfloat16 (``jax.tree.map(lambda a: a.astype(bf16), variables)``)
    rounded scales and stopped ``step`` at 256, so check_step later blamed dropped state."""
    meta = f8.init_meta(1, f8.DelayedScaling(amax_history_len=2))
    cast = jax.tree.map(lambda a: a.astype(jnp.bfloat16), {"layer": meta})
    with pytest.raises(TypeError, match=r"meta\['layer'\]\.forward\.amax_history must be float32"):
        f8.update(cast)
    with pytest.raises(TypeError, match=r"meta\.forward\.amax_history must be float32 .* bfloat16"):
        f8.dot_general(jnp.ones((2, 4)), jnp.ones((4, 4)), (((1,), (0,)), ((), ())), cast["layer"])
    step_only = dataclasses.replace(meta, step=meta.step.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match=r"step must be float32"):
        f8.update(step_only)


def test_a_broadcast_amax_from_a_callable_is_divided_once() -> None:
    """A callable returning one shared amax (a broadcast scalar): the scale is still the one
    correctly rounded float32 division, 448 / 3 = 149.33333 (SPEC section 9), under jit too;
    XLA may not turn it into a multiplication by 1/3 (149.33334)."""

    def shared(history):
        return jnp.broadcast_to(jnp.max(history), history.shape[1:])

    r = f8.DelayedScaling(amax_history_len=2, amax_compute_algo=shared)
    meta = f8.init_meta(1, r)
    out = jax.jit(f8.update)(meta, _obs(meta, forward=3.0))
    want = float(np.float32(448) / np.float32(3))
    assert float(out.forward.scale[0]) == want


def test_counts_wrap_keeps_the_interval_phase() -> None:
    r = f8.DelayedScaling(amax_history_len=2, interval=3)
    wrap = count_wrap(3)
    assert wrap % 3 == 0 and wrap <= 2**23
    hist = jnp.zeros((2, 1)).at[0, 0].set(4.0)
    counts = jnp.asarray([wrap], jnp.float32)  # the next event is number wrap + 1 -> recompute
    h, s, c = update_scaling_state(hist, jnp.ones(1), counts, r, 448.0)
    assert float(c[0]) == 1.0 and float(s[0]) == 112.0
    h, s, c = update_scaling_state(h.at[0, 0].set(1.0), s, c, r, 448.0)
    assert float(c[0]) == 2.0 and float(s[0]) == 112.0  # not a recompute event


def test_step_counter_detects_dropped_state() -> None:
    meta = {"layer": f8.init_meta(1, f8.DelayedScaling(amax_history_len=2))}
    obs = {"layer": _obs(meta["layer"], forward=1.0)}
    kept = meta
    for _ in range(3):
        kept = f8.update(kept, obs)
        f8.update(meta, obs)  # result dropped: a bug
    f8.check_step(kept, 3)
    with pytest.raises(ValueError, match=r"\['layer'\].*step \[0.0\]"):
        f8.check_step(meta, 3)
    with pytest.raises(ValueError, match=r"^expected must be an int >= 0 .*got -1"):
        f8.check_step(meta, -1)  # a range error (decision 0267)
    with pytest.raises(TypeError, match=r"^expected must be an int >= 0 .*got 1\.0"):
        f8.check_step(meta, 1.0)


def test_update_rejects_mismatches() -> None:
    r = f8.DelayedScaling(amax_history_len=2)
    meta = {"a": f8.init_meta(1, r)}
    with pytest.raises(ValueError, match="missing"):
        f8.update(meta, {"b": _obs(meta["a"], forward=1.0)})
    with pytest.raises(ValueError, match="has shape"):
        f8.update(meta, {"a": f8.Observations(jnp.zeros(4), jnp.zeros(2), jnp.float32(1))})
    with pytest.raises(ValueError, match="differs from the recipe"):
        f8.update(meta, None, f8.DelayedScaling(amax_history_len=3))
    f8.update(meta, None, r)  # the same recipe is fine


def test_with_recipe_resizes_history() -> None:
    r = f8.DelayedScaling(amax_history_len=4)
    meta = f8.init_meta(1, r)
    for a in (1.0, 2.0, 3.0):
        meta = f8.update(meta, _obs(meta, forward=a))
    with pytest.warns(UserWarning, match="oldest entries are dropped"):
        small = f8.with_recipe(meta, f8.DelayedScaling(amax_history_len=2))
    np.testing.assert_array_equal(small.forward.amax_history[:, 0], [0, 3])
    with pytest.warns(UserWarning, match="zeros are padded"):
        big = f8.with_recipe(meta, f8.DelayedScaling(amax_history_len=6))
    np.testing.assert_array_equal(big.forward.amax_history[:, 0], [0, 0, 0, 1, 2, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an untouched state is resized silently
        f8.with_recipe(f8.init_meta(1, r), f8.DelayedScaling(amax_history_len=2))


def test_nan_observation_counts_as_not_run() -> None:
    meta = f8.init_meta(1, f8.DelayedScaling(amax_history_len=2))
    out = f8.update(meta, _obs(meta, forward=np.nan))
    assert float(out.forward.scale[0]) == 1.0 and not np.asarray(out.forward.amax_history).any()


def test_current_scaling_meta_is_never_rolled() -> None:
    meta = f8.init_meta(1, f8.Float8CurrentScaling())
    assert meta.history_len == 1
    out = f8.update(meta, _obs(meta, forward=3.0))
    assert float(out.forward.scale[0]) == 1.0 and float(out.step) == 1.0


def test_eager_and_jit_agree(rng: np.random.Generator) -> None:
    r = f8.DelayedScaling(amax_history_len=3, margin=1)
    meta = f8.init_meta(2, r)
    obs = f8.Observations(
        jnp.asarray(_random_amaxes(rng, 6)), jnp.asarray(_random_amaxes(rng, 4)), jnp.float32(1)
    )
    a = f8.update(meta, obs)
    b = jax.jit(f8.update)(meta, obs)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert E4M3.max == 448 and E5M2.max == 57344


def test_check_chains_false_lowers_without_a_host_conditional() -> None:
    """The summed-observation check is a lax.cond around a host callback, which XLA's GPU
    runtime evaluates by waiting for the stream (docs/jax.md, "Lowering"); check_chains=False
    is the way to a step without it, and compiles to neither."""
    dims = (((1,), (0,)), ((), ()))
    params = {"w": jnp.ones((16, 8)), "meta": f8.init_meta()}
    x = jnp.ones((4, 16))

    def loss(p, x):
        return f8.dot_general(x, p["w"], dims, p["meta"]).sum()

    def compiled_text(check: bool) -> str:
        def step(p, x):
            _, grads, obs = f8.value_and_grad(loss)(p, x)
            return f8.update({**p, "w": p["w"] - 1e-3 * grads["w"]}, obs, check_chains=check)

        return jax.jit(step).lower(params, x).compile().as_text()

    checked, unchecked = compiled_text(True), compiled_text(False)
    assert "conditional(" in checked and "callback" in checked
    assert "conditional(" not in unchecked and "callback" not in unchecked


@pytest.mark.parametrize("result", ["zero", "negative"])
def test_a_callable_scale_of_zero_or_below_keeps_the_old_scale(result: str) -> None:
    """SPEC section 9: no scale is 0 or negative; the old scale stays, the event counts."""

    def bad(amax, old_scale, fp8_max, recipe):
        return jnp.zeros_like(amax) if result == "zero" else -fp8_max / amax

    r = f8.DelayedScaling(amax_history_len=2, scaling_factor_compute_algo=bad)
    hist = jnp.asarray([[4.0], [0.0]])
    h, s, c = update_scaling_state(hist, jnp.asarray([3.0]), jnp.zeros(1), r, 448.0)
    assert s.tolist() == [3.0] and c.tolist() == [1.0] and h[:, 0].tolist() == [0.0, 4.0]


@pytest.mark.parametrize(
    ("column", "scale", "rolled"),
    [([1.0, np.nan, 2.0], 224.0, [0.0, 2.0, 1.0]), ([1.0, np.nan, np.nan], 448.0, None)],
)
def test_max_window_ignores_nan_entries_of_a_loaded_history(column, scale, rolled) -> None:
    """A NaN reaches a history only by a load or an edit; "max" ignores it (SPEC section 3),
    as fp8kit.torch does: window [NaN, 2, current 1] -> 2, [NaN, NaN, 1] -> 1."""
    r = f8.DelayedScaling(amax_history_len=3)
    hist = jnp.asarray(column, jnp.float32)[:, None]
    h, s, _ = update_scaling_state(hist, jnp.ones(1), jnp.zeros(1), r, 448.0)
    assert s.tolist() == [scale]
    if rolled is not None:
        assert h[:, 0].tolist() == rolled


@pytest.mark.parametrize("interval", [1, 3])
def test_a_count_reaching_the_wrap_value_stays_positive(interval: int) -> None:
    """The count wraps only past ``count_wrap``: one landing on it is still a slot with
    history (0 would mean none, and first-step current scaling would start again)."""
    r = f8.DelayedScaling(amax_history_len=2, interval=interval)
    wrap = count_wrap(interval)
    hist = jnp.zeros((2, 1)).at[0, 0].set(4.0)
    _, _, c = update_scaling_state(hist, jnp.ones(1), jnp.asarray([wrap - 1.0]), r, 448.0)
    assert c.tolist() == [float(wrap)]

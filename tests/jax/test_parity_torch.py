"""Cross-framework parity: fp8kit.jax and fp8kit.torch give the same FP8 bytes and the same
scale sequences (histories, scales, counts) for the same inputs and history."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fp8kit.jax as f8j  # noqa: E402
import fp8kit.torch as f8t  # noqa: E402
from fp8kit.formats import E4M3, E5M2  # noqa: E402
from fp8kit.jax.linen import Dense  # noqa: E402
from fp8kit.jax.scaling import update_scaling_state as jax_update  # noqa: E402
from fp8kit.torch.scaling import update_scaling_state as torch_update  # noqa: E402
from tests.jax.helpers import bits, edge_values, random_fp8_friendly  # noqa: E402

ml_bf16 = ml_dtypes.bfloat16

FORMATS = [
    (E4M3, jnp.float8_e4m3fn, torch.float8_e4m3fn),
    (E5M2, jnp.float8_e5m2, torch.float8_e5m2),
]


def torch_bits(t) -> np.ndarray:
    return t.view(torch.uint8).numpy()


@pytest.mark.parametrize("fmt,jdt,tdt", FORMATS, ids=["e4m3", "e5m2"])
def test_quantize_bytes_are_identical(rng, fmt, jdt, tdt) -> None:
    x = np.concatenate(
        [random_fp8_friendly(rng, (4000,)), random_fp8_friendly(rng, (1000,), 1e-4)]
        + [edge_values(fmt)] * 3
    ).astype(np.float32)
    amax = float(np.abs(x[np.isfinite(x)]).max())
    scales = [1.0, float(np.float32(fmt.max) / np.float32(amax)), float(rng.uniform(1e-3, 1e3))]
    for scale in scales:
        s = np.float32(scale)
        qj = f8j.quantize(x, jnp.float32(s), jdt)
        qt = f8t.quantize(torch.from_numpy(x.copy()), torch.tensor(s), tdt)
        np.testing.assert_array_equal(bits(qj.data), torch_bits(qt.data))
        assert np.float32(qj.scale_inv) == np.float32(qt.scale_inv.item())
        assert float(qj.amax) == float(qt.amax)
    for dt_j, dt_t in ((jnp.bfloat16, torch.bfloat16), (jnp.float16, torch.float16)):
        xl = np.clip(x[:5000], -6e4, 6e4)
        qj = f8j.quantize(jnp.asarray(xl, dt_j), 3.5, jdt)
        qt = f8t.quantize(torch.from_numpy(xl.copy()).to(dt_t), 3.5, tdt)
        np.testing.assert_array_equal(bits(qj.data), torch_bits(qt.data))
        assert float(qj.amax) == float(qt.amax)


# (recipe, which state's fmax): the last case is a backward (E5M2 under HYBRID) state.
UPDATE_RECIPES = [
    (f8j.DelayedScaling(amax_history_len=1), "forward"),
    (f8j.DelayedScaling(amax_history_len=6), "forward"),
    (f8j.DelayedScaling(amax_history_len=5, amax_compute_algo="most_recent", margin=3), "forward"),
    (f8j.DelayedScaling(amax_history_len=4, margin=-0.5), "forward"),
    (f8j.DelayedScaling(amax_history_len=4, power_2_scale=True, margin=2), "forward"),
    (f8j.DelayedScaling(amax_history_len=4, interval=3), "backward"),
    # float32(fmax * 2**-margin) overflows: every scale is capped at FLT_MAX
    (f8j.DelayedScaling(amax_history_len=2, margin=-130), "forward"),
    (f8j.DelayedScaling(amax_history_len=2, margin=-1100.5), "backward"),
]
# Amaxes at the ends of the scale rule: the FLT_MAX cap (1e-37), just inside it, the largest.
EDGE_AMAXES = np.float32([1e-37, 5.2e-36, 1e-30, 3e38, 3.4028235e38])


@pytest.mark.parametrize(
    ("recipe", "direction"), UPDATE_RECIPES, ids=lambda v: repr(getattr(v, "amax_history_len", v))
)
def test_update_rule_is_bit_identical(rng, recipe, direction) -> None:
    n = 7
    fmax = getattr(recipe.fp8_format, direction).max
    hj, sj, cj = jnp.zeros((recipe.amax_history_len, n)), jnp.ones(n), jnp.zeros(n)
    ht = torch.zeros(recipe.amax_history_len, n)
    st, ct = torch.ones(n), torch.zeros(n, dtype=torch.int64)
    for _ in range(10):
        a = np.exp(rng.uniform(-60, 60, n)).astype(np.float32)
        a[rng.random(n) < 0.25] = 0
        a[rng.random(n) < 0.05] = np.inf
        a[rng.random(n) < 0.2] = rng.choice(EDGE_AMAXES)
        hj, sj, cj = jax_update(hj.at[0].max(a), sj, cj, recipe, fmax)
        ht[0] = torch.maximum(ht[0], torch.from_numpy(a))
        ht, st, ct = torch_update(ht, st, ct, recipe, fmax)
        np.testing.assert_array_equal(np.asarray(hj), ht.numpy())
        np.testing.assert_array_equal(np.asarray(sj), st.numpy())
        np.testing.assert_array_equal(np.asarray(cj), ct.numpy().astype(np.float32))


def _torch_steps(recipe, w, b, xs, gs, fp8_output, fp8_grad, x_grad=True, w_grad=True):
    lin = f8t.Linear(w.shape[1], w.shape[0], fp8_output=fp8_output, fp8_grad=fp8_grad)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
        lin.bias.copy_(torch.from_numpy(b))
    lin.weight.requires_grad_(w_grad)
    out = []
    for x, g in zip(xs, gs, strict=True):
        xt = torch.from_numpy(x).requires_grad_(x_grad)
        scales = (lin.fp8_meta.forward.scale.clone(), lin.fp8_meta.backward.scale.clone())
        with f8t.autocast(recipe=recipe):
            y = lin(xt)
        y.backward(torch.from_numpy(g))
        fw, bw = lin.fp8_meta.forward, lin.fp8_meta.backward
        state = [t.detach().clone().numpy() for t in (fw.amax_history, fw.scale, bw.amax_history)]
        state += [bw.scale.detach().clone().numpy()]
        state += [
            fw.update_count.numpy().astype(np.float32),
            bw.update_count.numpy().astype(np.float32),
        ]
        w_grad_t = None if lin.weight.grad is None else lin.weight.grad.T
        grads = tuple(None if t is None else t.numpy() for t in (xt.grad, w_grad_t, lin.bias.grad))
        lin.weight.grad = None
        lin.bias.grad = None
        out.append((y.detach().numpy(), grads, state, scales))
    return out


def _jax_steps(recipe, w, b, xs, gs, fp8_output, fp8_grad, x_grad=True, w_grad=True):
    layer = Dense(w.shape[0], recipe=recipe, fp8_output=fp8_output, fp8_grad=fp8_grad)
    v = {  # what layer.init would create, with the torch layer's parameters
        "params": {"kernel": jnp.asarray(w.T), "bias": jnp.asarray(b)},
        "fp8_meta": {"meta": f8j.init_meta(1, recipe)},
    }

    @jax.jit
    def step(v, x, g):
        def loss(v, kernel, x):
            y = layer.apply({**v, "params": {**v["params"], "kernel": kernel}}, x)
            return jnp.sum(y * g), y

        argnums = (0,) + ((1,) if w_grad else ()) + ((2,) if x_grad else ())
        (_, y), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(
            v, v["params"]["kernel"], x
        )
        gv, gw, gx = grads[0], grads[1] if w_grad else None, grads[-1] if x_grad else None
        return y, (gx, gw, gv["params"]["bias"]), f8j.update(v, gv)

    out = []
    for x, g in zip(xs, gs, strict=True):
        meta = v["fp8_meta"]["meta"]
        scales = (np.asarray(meta.forward.scale), np.asarray(meta.backward.scale))
        y, grads, v = step(v, jnp.asarray(x), jnp.asarray(g))
        m = v["fp8_meta"]["meta"]
        state = [
            m.forward.amax_history,
            m.forward.scale,
            m.backward.amax_history,
            m.backward.scale,
            m.forward.update_count,
            m.backward.update_count,
        ]
        grads = tuple(None if a is None else np.asarray(a) for a in grads)
        out.append((np.asarray(y), grads, list(map(np.asarray, state)), scales))
    return out


PARITY_RECIPES = [
    f8j.DelayedScaling(amax_history_len=4),
    f8j.DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent", margin=1),
    f8j.DelayedScaling(amax_history_len=4, interval=2, fp8_format="E4M3"),
    f8j.DelayedScaling(amax_history_len=4, first_step_scaling="current"),
]


@pytest.mark.parametrize("recipe", PARITY_RECIPES, ids=["max", "most_recent", "interval", "first"])
def test_linear_and_dense_give_identical_scale_sequences(rng, recipe) -> None:
    """Random float data: histories, scales and counts bit-identical after every step; the FP8
    bytes of x, W and dY at every step identical; outputs and gradients equal up to the float32
    accumulation order of the two GEMM backends."""
    steps = 6
    w = random_fp8_friendly(rng, (24, 40), 0.05)
    b = random_fp8_friendly(rng, (24,), 0.1)
    xs = [random_fp8_friendly(rng, (16, 40), 2.0 ** (i - 2)) for i in range(steps)]
    gs = [random_fp8_friendly(rng, (16, 24), 1e-3 * (i + 1)) for i in range(steps)]
    t_out = _torch_steps(recipe, w, b, xs, gs, False, False)
    j_out = _jax_steps(recipe, w, b, xs, gs, False, False)
    fwd_fmt = (jnp.float8_e4m3fn, torch.float8_e4m3fn)
    bwd_fmt = (
        (jnp.float8_e4m3fn, torch.float8_e4m3fn)
        if recipe.fp8_format.name == "E4M3"
        else (jnp.float8_e5m2, torch.float8_e5m2)
    )
    for k, ((yt, gt, st, sct), (yj, gj, sj, scj)) in enumerate(zip(t_out, j_out, strict=True)):
        for a, c in zip(st, sj, strict=True):
            np.testing.assert_array_equal(c, a, err_msg=f"step {k}")
        for a, c in zip(sct, scj, strict=True):
            np.testing.assert_array_equal(c, a.numpy())
        # the operands each framework quantized at this step, byte for byte
        for arr, s, fmts in (
            (xs[k], scj[0][0], fwd_fmt),
            (w, scj[0][1], fwd_fmt),
            (gs[k], scj[1][0], bwd_fmt),
        ):
            if recipe.first_step_scaling == "current" and k == 0:
                break
            qj = f8j.quantize(arr, jnp.float32(s), fmts[0])
            qt = f8t.quantize(torch.from_numpy(arr.copy()), torch.tensor(s), fmts[1])
            np.testing.assert_array_equal(bits(qj.data), torch_bits(qt.data))
        np.testing.assert_allclose(yj, yt, rtol=1e-5, atol=1e-5 * np.abs(yt).max())
        for a, c in zip(gt, gj, strict=True):
            np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-5 * np.abs(a).max())
    assert float(j_out[-1][2][1][0]) != 1.0  # scales moved


def test_exact_data_gives_bit_identical_everything(rng) -> None:
    """Power-of-two scales and small-integer data make every GEMM exact in both frameworks, so
    outputs, gradients and the OUTPUT / GRAD_INPUT slots (fp8_output, fp8_grad) match bit for
    bit."""
    recipe = f8j.DelayedScaling(amax_history_len=3, power_2_scale=True)
    steps = 5
    w = (rng.integers(-8, 9, (16, 32)) / 8).astype(np.float32)
    b = (rng.integers(-4, 5, (16,)) / 4).astype(np.float32)
    xs = [rng.integers(-8, 9, (8, 32)).astype(np.float32) * 2.0 ** (i - 2) for i in range(steps)]
    gs = [rng.integers(-4, 5, (8, 16)).astype(np.float32) * 2.0**-i for i in range(steps)]
    t_out = _torch_steps(recipe, w, b, xs, gs, True, True)
    j_out = _jax_steps(recipe, w, b, xs, gs, True, True)
    for (yt, gt, st, _), (yj, gj, sj, _) in zip(t_out, j_out, strict=True):
        np.testing.assert_array_equal(yj, yt)
        for a, c in zip(gt, gj, strict=True):
            np.testing.assert_array_equal(c, a)
        for a, c in zip(st, sj, strict=True):
            np.testing.assert_array_equal(c, a)
    last = j_out[-1][2]
    assert np.asarray(last[0])[:, 2].any() and np.asarray(last[2])[:, 1].any()  # OUTPUT, GRAD_INPUT


@pytest.mark.parametrize(("x_grad", "w_grad"), [(False, True), (True, False), (False, False)])
def test_undifferentiated_operands_record_what_torch_records(rng, x_grad, w_grad) -> None:
    """A first layer (input not differentiated) with fp8_grad, a frozen weight, or both (only
    the bias trains): the backward casts and GEMMs nobody needs do not run, so the GRAD_INPUT
    (and, with both, GRAD_OUTPUT) slots skip their events as in fp8kit.torch; the state matches
    bit for bit (JAX recorded a GRAD_INPUT amax for an input nobody differentiated before)."""
    recipe = f8j.DelayedScaling(amax_history_len=3, power_2_scale=True)
    w = (rng.integers(-8, 9, (16, 32)) / 8).astype(np.float32)
    b = (rng.integers(-4, 5, (16,)) / 4).astype(np.float32)
    xs = [rng.integers(-8, 9, (8, 32)).astype(np.float32) * 2.0 ** (i - 2) for i in range(4)]
    gs = [rng.integers(-4, 5, (8, 16)).astype(np.float32) * 2.0**-i for i in range(4)]
    t_out = _torch_steps(recipe, w, b, xs, gs, False, True, x_grad, w_grad)
    j_out = _jax_steps(recipe, w, b, xs, gs, False, True, x_grad, w_grad)
    for (yt, gt, st, _), (yj, gj, sj, _) in zip(t_out, j_out, strict=True):
        np.testing.assert_array_equal(yj, yt)
        for a, c in zip(gt, gj, strict=True):
            assert (a is None) == (c is None)
            if a is not None:
                np.testing.assert_array_equal(c, a)
        for a, c in zip(st, sj, strict=True):
            np.testing.assert_array_equal(c, a)
    backward_history = np.asarray(j_out[-1][2][2])
    assert backward_history[:, 1].any() == x_grad  # GRAD_INPUT: only if dX was computed
    assert backward_history[:, 0].any() == (x_grad or w_grad)  # GRAD_OUTPUT: if a GEMM needed dY


def test_bfloat16_compute_casts_the_float32_master_weight_as_torch_does(rng) -> None:
    """``Dense(dtype=bfloat16)`` with float32 parameters (Flax's usual mixed precision) against
    ``f8.Linear`` under ``torch.autocast(bfloat16)``: both quantize the float32 weight itself
    (Flax's ``promote_dtype`` used to round it to bfloat16 first), so the histories and scales
    match bit for bit and the weight gradient is float32, not bfloat16 values."""
    recipe = f8j.DelayedScaling(amax_history_len=3)
    w = random_fp8_friendly(rng, (16, 32))
    w *= np.float32(0.5) / np.abs(w).max()
    w.flat[0] = 1.0625 + 2.0**-12  # no bfloat16 value: it is the weight's amax
    xs = [random_fp8_friendly(rng, (8, 32), 2.0**i).astype(ml_bf16) for i in range(3)]
    gs = [random_fp8_friendly(rng, (8, 16), 1e-2).astype(ml_bf16) for _ in range(3)]

    lin = f8t.Linear(32, 16, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
    layer = Dense(16, use_bias=False, dtype=jnp.bfloat16, recipe=recipe)
    v = {"params": {"kernel": jnp.asarray(w.T)}, "fp8_meta": {"meta": f8j.init_meta(1, recipe)}}

    @jax.jit
    def step(v, x, g):
        loss = lambda v: jnp.sum((layer.apply(v, x) * g).astype(jnp.float32))  # noqa: E731
        _, grads, obs = f8j.value_and_grad(loss)(v)
        return grads["params"]["kernel"], f8j.update(v, obs)

    for x, g in zip(xs, gs, strict=True):
        xt = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16), f8t.autocast(recipe=recipe):
            y = lin(xt)
        y.backward(torch.from_numpy(g.astype(np.float32)).to(torch.bfloat16))
        dw_j, v = step(v, jnp.asarray(x), jnp.asarray(g))
        meta, fw, bw = v["fp8_meta"]["meta"], lin.fp8_meta.forward, lin.fp8_meta.backward
        for j, t in ((meta.forward, fw), (meta.backward, bw)):
            np.testing.assert_array_equal(np.asarray(j.amax_history), t.amax_history.numpy())
            np.testing.assert_array_equal(np.asarray(j.scale), t.scale.numpy())
        assert dw_j.dtype == jnp.float32 and lin.weight.grad.dtype == torch.float32
        np.testing.assert_allclose(
            np.asarray(dw_j), lin.weight.grad.T.numpy(), rtol=1e-5, atol=1e-6
        )
        lin.weight.grad = None
    assert float(meta.forward.amax_history[1, 1]) == np.float32(1.0625 + 2.0**-12)

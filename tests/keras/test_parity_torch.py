"""Cross-framework parity: fp8kit.keras (TensorFlow backend) and fp8kit.torch give the same FP8
bytes, histories, scales and counts for the same inputs and output gradients, at the same
update events (forward and backward state both advanced by every training step)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import fp8kit.keras as f8
from fp8kit.formats import E4M3, E5M2
from fp8kit.keras.quantization import cast_to_fp8, nan_ignoring_amax
from fp8kit.keras.scaling import update_scaling_state as keras_update
from tests.keras.helpers import dense, random_fp8_friendly, state_arrays, train_step_fn

torch = pytest.importorskip("torch")

import fp8kit.torch as f8t  # noqa: E402
from fp8kit.torch.scaling import update_scaling_state as torch_update  # noqa: E402

TORCH_DTYPES = {E4M3.name: torch.float8_e4m3fn, E5M2.name: torch.float8_e5m2}


def keras_bits(x: np.ndarray, scale: float, fmt) -> np.ndarray:
    data = cast_to_fp8(tf.constant(x), tf.constant(np.float32(scale)), fmt)
    return tf.bitcast(tf.cast(data, tf.float32), tf.uint32).numpy(), data.numpy().view(np.uint8)


def torch_bits(x: np.ndarray, scale: float, fmt) -> np.ndarray:
    q = f8t.quantize(
        torch.from_numpy(x.copy()), torch.tensor(np.float32(scale)), TORCH_DTYPES[fmt.name]
    )
    return q.data.view(torch.uint8).numpy()


def same_fp8_bytes(keras_u8: np.ndarray, torch_u8: np.ndarray, fmt) -> None:
    """Equal bytes; E5M2 NaN is S.11111.10 in TensorFlow and S.11111.11 in PyTorch (both NaN,
    decision 0602), so those two encodings are compared as NaN."""
    if fmt is E5M2:
        nan_k = (keras_u8 & 0x7F) > 0x7C
        nan_t = (torch_u8 & 0x7F) > 0x7C
        np.testing.assert_array_equal(nan_k, nan_t)
        keras_u8 = np.where(nan_k, 0, keras_u8)
        torch_u8 = np.where(nan_t, 0, torch_u8)
    np.testing.assert_array_equal(keras_u8, torch_u8)


def edge_values(fmt) -> np.ndarray:
    sub = fmt.min_subnormal
    return np.array(
        [0.0, -0.0, fmt.max, -fmt.max, fmt.max * 1.0625, np.inf, -np.inf, np.nan, sub, -sub,
         sub / 2, sub * 1.5, fmt.min_normal, 3.0 * 2.0**-10, 1e-4,
         1.0 + 2.0 ** -(fmt.mantissa_bits + 1), 1.0 + 3 * 2.0 ** -(fmt.mantissa_bits + 1)],
        np.float32,
    )  # fmt: skip


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_bytes_and_amax_match_torch(rng, fmt) -> None:
    x = np.concatenate(
        [
            random_fp8_friendly(rng, (3000,)),
            random_fp8_friendly(rng, (500,), 1e-4),
            edge_values(fmt),
        ]
    )
    amax = float(np.abs(x[np.isfinite(x)]).max())
    for scale in (
        1.0,
        float(np.float32(fmt.max) / np.float32(amax)),
        float(rng.uniform(1e-3, 1e3)),
    ):
        _, k = keras_bits(x, scale, fmt)
        same_fp8_bytes(k, torch_bits(x, scale, fmt), fmt)
    # the recorded amax ignores NaN; inf counts
    assert float(nan_ignoring_amax(tf.constant(x))) == np.inf
    finite = x[np.isfinite(x)]
    assert float(nan_ignoring_amax(tf.constant(finite))) == float(np.abs(finite).max())
    assert float(nan_ignoring_amax(tf.constant([np.nan, np.nan], tf.float32))) == 0.0


# (recipe, direction): the backward case runs the rule with E5M2's fmax (HYBRID gradients).
UPDATE_RECIPES = [
    (f8.DelayedScaling(amax_history_len=1), "forward"),
    (f8.DelayedScaling(amax_history_len=6), "forward"),
    (f8.DelayedScaling(amax_history_len=5, amax_compute_algo="most_recent", margin=3), "forward"),
    (f8.DelayedScaling(amax_history_len=4, margin=-0.5), "forward"),
    (f8.DelayedScaling(amax_history_len=4, power_2_scale=True, margin=2), "forward"),
    (f8.DelayedScaling(amax_history_len=4, interval=3), "backward"),
    # float32(fmax * 2**-margin) overflows: every scale is capped at FLT_MAX
    (f8.DelayedScaling(amax_history_len=2, margin=-130), "forward"),
    (f8.DelayedScaling(amax_history_len=2, margin=-1100.5), "backward"),
]
# Amaxes at the ends of the scale rule: the FLT_MAX cap (1e-37), just inside it, the largest.
EDGE_AMAXES = np.float32([1e-37, 5.2e-36, 1e-30, 3e38, 3.4028235e38])


@pytest.mark.parametrize(
    ("recipe", "direction"), UPDATE_RECIPES, ids=lambda v: repr(getattr(v, "amax_history_len", v))
)
def test_update_rule_is_bit_identical(rng, recipe, direction) -> None:
    n = 7
    fmt = recipe.fp8_format
    fmax = fmt.forward.max if direction == "forward" else fmt.backward.max
    hk, sk, ck = (
        np.zeros((recipe.amax_history_len, n), np.float32),
        np.ones(n, np.float32),
        np.zeros(n, np.float32),
    )
    ht, st, ct = (
        torch.zeros(recipe.amax_history_len, n),
        torch.ones(n),
        torch.zeros(n, dtype=torch.int64),
    )
    for _ in range(10):
        a = np.exp(rng.uniform(-60, 60, n)).astype(np.float32)
        a[rng.random(n) < 0.25] = 0
        a[rng.random(n) < 0.05] = np.inf
        a[rng.random(n) < 0.2] = rng.choice(EDGE_AMAXES)
        hk[0] = np.maximum(hk[0], a)
        hk, sk, ck = (
            np.asarray(t)
            for t in keras_update(tf.constant(hk), tf.constant(sk), tf.constant(ck), recipe, fmax)
        )
        hk = hk.copy()
        ht[0] = torch.maximum(ht[0], torch.from_numpy(a))
        ht, st, ct = torch_update(ht, st, ct, recipe, fmax)
        np.testing.assert_array_equal(hk, ht.numpy())
        np.testing.assert_array_equal(sk, st.numpy())
        np.testing.assert_array_equal(ck, ct.numpy().astype(np.float32))


def _torch_steps(recipe, w, b, xs, gs):
    lin = f8t.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
        lin.bias.copy_(torch.from_numpy(b))
    out = []
    for x, g in zip(xs, gs, strict=True):
        xt = torch.from_numpy(x).requires_grad_(True)
        with f8t.autocast(recipe=recipe):
            y = lin(xt)
        y.backward(torch.from_numpy(g))
        fw, bw = lin.fp8_meta.forward, lin.fp8_meta.backward
        state = [
            fw.amax_history.detach().clone().numpy(),
            fw.scale.detach().clone().numpy(),
            fw.update_count.numpy().astype(np.float32),
            bw.amax_history.detach().clone().numpy(),
            bw.scale.detach().clone().numpy(),
            bw.update_count.numpy().astype(np.float32),
        ]
        grads = (xt.grad.numpy(), lin.weight.grad.numpy().T.copy(), lin.bias.grad.numpy())
        lin.weight.grad = None
        lin.bias.grad = None
        out.append((y.detach().numpy(), grads, state))
    return out


def _keras_steps(recipe, w, b, xs, gs):
    layer = dense(w.shape[0], w.T.copy(), b, recipe)
    step = train_step_fn(layer, jit_compile=True)
    out = []
    for x, g in zip(xs, gs, strict=True):
        scales = (
            layer.fp8_state.fwd_scale.numpy().copy(),
            layer.fp8_state.bwd_scale.numpy().copy(),
        )
        y, dx, dk, db = step(tf.constant(x), tf.constant(g))
        state = state_arrays(layer)[:6]
        out.append((y.numpy(), (dx.numpy(), dk.numpy(), db.numpy()), state, scales))
    return out


PARITY_RECIPES = [
    f8.DelayedScaling(amax_history_len=4),
    f8.DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent", margin=1),
    f8.DelayedScaling(
        amax_history_len=4, interval=2, fp8_format="E4M3", first_step_scaling="current"
    ),
]


@pytest.mark.parametrize("recipe", PARITY_RECIPES, ids=["max", "most_recent", "interval_first"])
def test_dense_and_torch_linear_give_identical_state_and_bytes(rng, recipe) -> None:
    """Six training steps under XLA: histories, scales and counts bit-identical after every
    step; the FP8 bytes of x, W and dY each step identical; outputs and gradients equal up to
    the float32 accumulation order of the two GEMMs."""
    steps = 6
    w = random_fp8_friendly(rng, (24, 40), 0.05)
    b = random_fp8_friendly(rng, (24,), 0.1)
    xs = [random_fp8_friendly(rng, (16, 40), 2.0 ** (i - 2)) for i in range(steps)]
    gs = [random_fp8_friendly(rng, (16, 24), 1e-3 * (i + 1)) for i in range(steps)]
    t_out = _torch_steps(recipe, w, b, xs, gs)
    k_out = _keras_steps(recipe, w, b, xs, gs)
    fwd, bwd = recipe.fp8_format.forward, recipe.fp8_format.backward
    for k, ((yt, gt, st), (yk, gk, sk, scales)) in enumerate(zip(t_out, k_out, strict=True)):
        for a, c in zip(st, sk, strict=True):
            np.testing.assert_array_equal(c, a, err_msg=f"step {k}")
        if not (recipe.first_step_scaling == "current" and k == 0):
            for arr, s, fmt in (
                (xs[k], scales[0][0], fwd),
                (w, scales[0][1], fwd),
                (gs[k], scales[1][0], bwd),
            ):
                same_fp8_bytes(keras_bits(arr, s, fmt)[1], torch_bits(arr, s, fmt), fmt)
        np.testing.assert_allclose(yk, yt, rtol=1e-5, atol=1e-5 * np.abs(yt).max())
        for a, c in zip(gt, gk, strict=True):
            np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-5 * np.abs(a).max())
    assert float(k_out[-1][2][1][0]) != 1.0 and float(k_out[-1][2][4][0]) != 1.0  # scales moved


def test_exact_data_gives_bit_identical_outputs_and_gradients(rng) -> None:
    """Power-of-two scales and small-integer data make every GEMM exact in both frameworks."""
    recipe = f8.DelayedScaling(amax_history_len=3, power_2_scale=True)
    steps = 4
    w = (rng.integers(-8, 9, (16, 32)) / 8).astype(np.float32)
    b = (rng.integers(-4, 5, (16,)) / 4).astype(np.float32)
    xs = [rng.integers(-8, 9, (8, 32)).astype(np.float32) * 2.0 ** (i - 2) for i in range(steps)]
    gs = [rng.integers(-4, 5, (8, 16)).astype(np.float32) * 2.0**-i for i in range(steps)]
    for (yt, gt, st), (yk, gk, sk, _) in zip(
        _torch_steps(recipe, w, b, xs, gs), _keras_steps(recipe, w, b, xs, gs), strict=True
    ):
        np.testing.assert_array_equal(yk, yt)
        for a, c in zip(gt, gk, strict=True):
            np.testing.assert_array_equal(c, a)
        for a, c in zip(st, sk, strict=True):
            np.testing.assert_array_equal(c, a)

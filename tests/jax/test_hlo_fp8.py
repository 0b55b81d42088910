"""CPU gate for the GPU lowering (docs/jax.md, "Lowering"): in the lowered (StableHLO) jitted
train step of every FP8 layer, each GEMM is one ``dot_general`` on FP8 operands that writes the
compute dtype (the weight gradient: the parameters' dtype) and is scaled by one scalar
multiply: the form XLA's GPU compiler runs as a cuBLASLt FP8 GEMM (``__cublas$lt$matmul$f8``).
A float32 GEMM on dequantized operands, an E5M2 x E5M2 GEMM or an unaligned contraction fails
here, without a GPU."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import fp8kit.jax as f8
from fp8kit.jax import nnx as f8nnx
from fp8kit.jax.linen import Dense, DenseGeneral
from tests.jax.stablehlo_dots import Dot, dots

RECIPE = f8.DelayedScaling(amax_history_len=4)
E4M3, E5M2 = "f8E4M3FN", "f8E5M2"
HLO_DTYPE = {jnp.float32: "f32", jnp.bfloat16: "bf16"}
# fprop x*W (E4M3 x E4M3), dgrad dY*W (E5M2 x E4M3), wgrad x*dY (E4M3 x E5M2)
GEMMS_PER_LAYER = Counter({(E4M3, E4M3): 1, (E5M2, E4M3): 1, (E4M3, E5M2): 1})


class _Gain(nn.Module):
    """A learned per-feature gain in front of the FP8 layers, so that the first layer's input
    gradient (its dgrad) is part of the train step too."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return x * self.param("gain", nn.initializers.ones, x.shape[-1:]).astype(x.dtype)


class _LinenNet(nn.Module):
    kind: str
    dtype: object

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = _Gain()(x)
        if self.kind == "dense":  # (tokens, 40) -> 24 -> 8
            return Dense(8, dtype=self.dtype)(nn.relu(Dense(24, dtype=self.dtype)(h)))
        if self.kind == "general":  # (2, 3, 5, 8): contract the last two axes twice
            h = DenseGeneral((3, 8), axis=(-2, -1), dtype=self.dtype)(h)
            return DenseGeneral(8, axis=(-2, -1), dtype=self.dtype)(nn.relu(h))
        # "batched": (heads 2, tokens 12, 40), one kernel per head over batch axis 0
        h = DenseGeneral(24, batch_dims=(0,), dtype=self.dtype)(h)
        return DenseGeneral(8, batch_dims=(0,), dtype=self.dtype)(nn.relu(h))


INPUT_SHAPES = {"dense": (24, 40), "general": (2, 3, 5, 8), "batched": (2, 12, 40)}


def _linen_step_text(kind: str, dtype) -> str:
    x = jnp.ones(INPUT_SHAPES[kind], dtype)
    model = _LinenNet(kind, dtype)
    with f8.autocast(recipe=RECIPE):
        variables = model.init(jax.random.PRNGKey(0), x)
    tx = optax.sgd(1e-2)

    def step(variables, opt_state, x):
        def loss_fn(v):
            return jnp.mean(model.apply(v, x).astype(jnp.float32) ** 2)

        loss, grads, obs = f8.value_and_grad(loss_fn)(variables)
        updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
        params = optax.apply_updates(variables["params"], updates)
        return f8.update({**variables, "params": params}, obs), opt_state, loss

    opt_state = tx.init(variables["params"])
    return jax.jit(step).lower(variables, opt_state, x).as_text()


class _NnxNet(nnx.Module):
    def __init__(self, dtype, rngs: nnx.Rngs) -> None:
        self.gain = nnx.Param(jnp.ones((40,)))
        with f8.autocast(recipe=RECIPE):
            self.a = f8nnx.Linear(40, 24, dtype=dtype, rngs=rngs)
            self.b = f8nnx.Linear(24, 8, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x * self.gain[...].astype(x.dtype)
        return self.b(nnx.relu(self.a(h)))


def _nnx_step_text(dtype) -> str:
    model = _NnxNet(dtype, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    x = jnp.ones((24, 40), dtype)

    def step(state, x):
        model = nnx.merge(graphdef, state)
        loss_fn = lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2)  # noqa: E731
        loss, grads, obs = f8nnx.value_and_grad(loss_fn)(model)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p, g: p - 1e-2 * g, params, grads))
        f8nnx.update(model, obs)
        return nnx.state(model), loss

    return jax.jit(step).lower(state, x).as_text()


def _assert_fp8_gemms(found: list[Dot], layers: int, compute: str, params: str = "f32") -> None:
    """``compute``: the layers' compute dtype; ``params``: their parameters' dtype, which the
    weight-gradient GEMM (E4M3 x E5M2) writes (``master_weight``)."""
    assert found, "no dot_general in the lowered step"
    for d in found:
        out = params if d.operands == (E4M3, E5M2) else compute
        assert d.lhs_type in (E4M3, E5M2) and d.rhs_type in (E4M3, E5M2), (
            f"a GEMM on {d.operands} operands, not FP8: {d.text}"
        )
        assert d.operands != (E5M2, E5M2), f"E5M2 x E5M2 GEMM: {d.text}"
        assert d.out_type == out, f"GEMM writes {d.out_type}, want {out}: {d.text}"
        assert d.contraction % 16 == 0, f"contraction {d.contraction} not aligned: {d.text}"
        assert d.scaled_by_scalar, f"GEMM result is not scaled by one scalar multiply: {d.text}"
    pairs = Counter(d.operands for d in found)
    want = Counter({k: v * layers for k, v in GEMMS_PER_LAYER.items()})
    assert pairs == want, f"FP8 GEMMs by operand types {dict(pairs)}, want {dict(want)}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kind", ["dense", "general", "batched"])
def test_linen_train_step_has_only_fp8_gemms(kind: str, dtype) -> None:
    found = dots(_linen_step_text(kind, dtype))
    _assert_fp8_gemms(found, layers=2, compute=HLO_DTYPE[dtype])
    if kind == "general":  # every GEMM contracts two axes but layer 2's dgrad (8 features)
        assert sorted(len(d.lhs_contracting) for d in found) == [1, 2, 2, 2, 2, 2]
    if kind == "batched":
        assert all(len(d.lhs_batch) == 1 for d in found)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_nnx_train_step_has_only_fp8_gemms(dtype) -> None:
    _assert_fp8_gemms(dots(_nnx_step_text(dtype)), layers=2, compute=HLO_DTYPE[dtype])


def test_unaligned_contractions_are_padded_to_16() -> None:
    # layer 1 (24 x 40 -> 24): fprop K=40 -> 48, dgrad N=24 -> 32, wgrad M=24 -> 32;
    # layer 2 (24 x 24 -> 8): fprop 24 -> 32, dgrad 8 -> 16, wgrad 24 -> 32.
    found = dots(_linen_step_text("dense", jnp.float32))
    assert sorted(d.contraction for d in found) == [16, 32, 32, 32, 32, 48]


def _load_example(name: str):
    path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_seed_001_example_gemm_is_fp8() -> None:
    example = _load_example("jax_low_level_delayed_scaling")
    meta = f8.init_meta(1, f8.DelayedScaling(amax_history_len=4))
    a, b = jnp.ones((16, 64)), jnp.ones((64, 16))
    (gemm,) = dots(example.matmul_fp8.lower(a, b, meta).as_text())
    assert gemm.operands == (E4M3, E4M3) and gemm.out_type == "f32" and gemm.scaled_by_scalar


def test_the_gate_rejects_a_dequantized_float32_gemm() -> None:
    """The gate's reader sees through what the old lowering did: a float32 dot on
    dequantized operands (``convert(q) * scale_inv`` feeding the dot)."""

    def old(a, sa, b, sb):
        return jax.lax.dot_general(
            a.astype(jnp.float32) * sa, b.astype(jnp.float32) * sb, (((1,), (0,)), ((), ()))
        )

    q = jnp.ones((16, 32), jnp.float8_e4m3fn)
    text = jax.jit(old).lower(q, jnp.float32(2), q.T, jnp.float32(3)).as_text()
    with pytest.raises(AssertionError, match="not FP8"):
        _assert_fp8_gemms(dots(text), layers=1, compute="f32")


def test_e5m2_recipe_is_refused_before_it_makes_e5m2_x_e5m2_gemms() -> None:
    """Every GEMM of an E5M2 recipe would be E5M2 x E5M2 (no cuBLASLt kernel): the recipe
    itself is refused, so no layer can lower one."""
    with pytest.raises(ValueError, match="multiply two E5M2 operands"):
        f8.DelayedScaling(fp8_format="E5M2")

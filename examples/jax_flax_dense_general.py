"""Seed 003 in fp8kit.jax: a Flax ``DenseGeneral`` under ``autocast``, then a jitted train loop.

Part 1 is the Transformer Engine example as written (with fp8kit's names) plus the one step that
applies the FP8 update. Part 2 is the same layer in a jitted training step with optax: the
optimizer sees ``grads["params"]`` only; FP8 observations go to ``fp8kit.jax.update``.

Run: ``python examples/jax_flax_dense_general.py [--full]`` (``--full`` uses the seed's sizes).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import optax

import fp8kit.jax as f8
from fp8kit.jax.linen import DenseGeneral
from fp8kit.recipe import DelayedScaling


def seed_example(batch: int = 32, seq: int = 128, hidden: int = 1024) -> dict:
    # Create FP8 Delayed Scaling recipe
    recipe = DelayedScaling(
        margin=0,  # Margin for scaling factor computation (default: 0)
        amax_history_len=1024,  # Length of amax history window (default: 1024)
        amax_compute_algo="max",  # How to compute amax from history (default: "max")
    )
    with f8.autocast(enabled=True, recipe=recipe):
        # Initialize layer and data
        layer = DenseGeneral(features=hidden)
        key = jax.random.PRNGKey(0)
        x = jax.random.normal(key, (batch, seq, hidden), dtype=jnp.bfloat16)
        var_collect = layer.init(key, x)

        # Forward and backward pass
        def loss_fn(var_collect):
            output = layer.apply(var_collect, x)
            return output.sum()

        loss, grads = jax.value_and_grad(loss_fn)(var_collect)
    # The one added step: apply the FP8 observations (grads["fp8_meta"]) to the FP8 state.
    var_collect = f8.update(var_collect, grads)
    # An optimizer gets grads["params"] only.
    return {"loss": loss, "variables": var_collect, "param_grads": grads["params"]}


def train(steps: int = 30, verbose: bool = True) -> list[float]:
    recipe = DelayedScaling(amax_history_len=16)
    with f8.autocast(recipe=recipe):
        layer = DenseGeneral(features=(4, 8), axis=-1)
    key = jax.random.PRNGKey(1)
    x = jax.random.normal(key, (64, 32))
    target = jnp.tanh(x[:, :32].reshape(64, 4, 8) * 2)
    variables = layer.init(key, x)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-2, weight_decay=1e-4))
    opt_state = tx.init(variables["params"])

    @jax.jit
    def train_step(variables, opt_state):
        def loss_fn(variables):
            return jnp.mean((layer.apply(variables, x) - target) ** 2)

        loss, grads, observations = f8.value_and_grad(loss_fn)(variables)
        updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
        params = optax.apply_updates(variables["params"], updates)
        variables = f8.update({"params": params, "fp8_meta": variables["fp8_meta"]}, observations)
        return variables, opt_state, loss

    losses = []
    for step in range(steps):
        variables, opt_state, loss = train_step(variables, opt_state)
        losses.append(float(loss))
        if verbose and step % 10 == 0:
            scale = variables["fp8_meta"]["meta"].forward.scale
            print(f"step {step:3d}  loss {losses[-1]:.4f}  input/weight scales {scale[:2]}")
    f8.check_step(variables["fp8_meta"], steps)  # the FP8 state advanced once per step
    return losses


if __name__ == "__main__":
    full = "--full" in sys.argv
    out = seed_example() if full else seed_example(4, 16, 64)
    meta = out["variables"]["fp8_meta"]["meta"]
    print("seed example: loss", float(out["loss"]), "new forward scales", meta.forward.scale)
    train()

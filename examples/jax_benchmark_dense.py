"""Jitted train step of an FP8 Flax MLP (fp8kit.jax.linen.Dense) vs the same MLP in float32.

Both variants run in one process, alternately (round robin), and the script prints the median
step time of each and their ratio. Numbers on a shared CPU are noisy: compare ratios, not times.

Run: ``python examples/jax_benchmark_dense.py [tokens hidden ffn repeats]``
(default 4096 1024 4096 5, the MLP of /work/shared/MEASUREMENTS.md).
"""

from __future__ import annotations

import statistics
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import fp8kit.jax as f8
from fp8kit.jax.linen import Dense


class MLP(nn.Module):
    hidden: int
    ffn: int
    fp8: bool

    @nn.compact
    def __call__(self, x):
        layer = Dense if self.fp8 else nn.Dense
        return layer(self.hidden)(nn.gelu(layer(self.ffn)(x)))


def make_step(model: MLP, tx: optax.GradientTransformation):
    @jax.jit
    def step(variables, opt_state, x, y):
        def loss_fn(v):
            return jnp.mean((model.apply(v, x) - y) ** 2)

        loss, grads, obs = f8.value_and_grad(loss_fn)(variables)
        updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
        new = dict(variables, params=optax.apply_updates(variables["params"], updates))
        if "fp8_meta" in variables:
            new = f8.update(new, obs)
        return new, opt_state, loss

    return step


def main(tokens: int = 4096, hidden: int = 1024, ffn: int = 4096, repeats: int = 5) -> dict:
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (tokens, hidden))
    y = jax.random.normal(jax.random.PRNGKey(1), (tokens, hidden))
    tx = optax.sgd(1e-3)
    runs = {}
    for name, fp8 in (("fp32", False), ("fp8", True)):
        model = MLP(hidden, ffn, fp8)
        with f8.autocast(enabled=fp8, recipe=f8.DelayedScaling(amax_history_len=16)):
            variables = jax.jit(model.init)(key, x)
        step = make_step(model, tx)
        state = (variables, tx.init(variables["params"]))
        state = step(*state, x, y)[:2]  # compile + warm up
        jax.block_until_ready(state)
        runs[name] = {"step": step, "state": state, "times": []}
    for _ in range(repeats):
        for run in runs.values():
            t0 = time.perf_counter()
            out = run["step"](*run["state"], x, y)
            jax.block_until_ready(out)
            run["times"].append(time.perf_counter() - t0)
            run["state"] = out[:2]
    med = {k: statistics.median(v["times"]) * 1e3 for k, v in runs.items()}
    ratio = med["fp8"] / med["fp32"]
    print(
        f"MLP {tokens} tok x {hidden}->{ffn}->{hidden}, jitted train step, median of {repeats} "
        f"(round robin), {jax.devices()[0].platform} x{jax.device_count()}:\n"
        f"  fp32 {med['fp32']:.0f} ms   fp8kit.jax FP8 {med['fp8']:.0f} ms   ratio {ratio:.2f}x"
    )
    return {"fp32_ms": med["fp32"], "fp8_ms": med["fp8"], "ratio": ratio}


def _arguments(argv: list[str]) -> list[int]:
    """``tokens hidden ffn repeats`` from the command line: up to four integers >= 1."""
    names = ("tokens", "hidden", "ffn", "repeats")
    if len(argv) > len(names):
        raise SystemExit(f"usage: jax_benchmark_dense.py [{' '.join(names)}], got {len(argv)} args")
    values = []
    for name, text in zip(names, argv, strict=False):
        if not (text.isdigit() and int(text) >= 1):
            raise SystemExit(f"{name} must be an integer >= 1, got {text!r}")
        values.append(int(text))
    return values


if __name__ == "__main__":
    main(*_arguments(sys.argv[1:]))

"""Keras train-step benchmark: fp8kit.keras vs Keras's own float8 vs float32, TF and JAX.

One ``Dense`` layer (default 4096 tokens x 2048 -> 2048, float32 master weights), one training
step = forward, loss ``sum(y * dY)``, backward, SGD update, compiled with XLA:
``tf.function(jit_compile=True)`` on TensorFlow, ``jax.jit`` over ``stateless_call`` on JAX.
Each backend runs in its own process (Keras fixes its backend at import); the variants of one
backend are timed round-robin in one process and reported as medians and ratios to float32.

Variants: ``float32`` (``keras.layers.Dense``), ``keras float8`` (``layer.quantize("float8")``:
delayed scaling through overwrite-with-gradient variables), ``fp8kit.keras`` (``f8.Dense``,
``DelayedScaling()``). On the JAX backend fp8kit.keras cannot update its state in a training
step (docs/decisions/0601-keras-update-events.md), so its JAX row times FP8 GEMMs with frozen
scales (``training=False``; the update event it omits is a few tiny ops).

Run: ``python -m benchmarks.bench_keras`` (``--quick`` for small shapes, ``--backend``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("tensorflow", "jax")
VARIANTS = ("float32", "keras float8", "fp8kit.keras")


def _layer(variant: str, units: int) -> Any:
    import keras

    import fp8kit.keras as f8

    if variant == "fp8kit.keras":
        return f8.Dense(units, recipe=f8.DelayedScaling())
    return keras.layers.Dense(units)


def _model(variant: str, d_in: int, d_out: int) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((d_in,)), _layer(variant, d_out)])
    if variant == "keras float8":
        model.layers[0].quantize("float8")
    return model


def _tf_step(model: Any, x: Any, g: Any) -> Any:
    import keras
    import tensorflow as tf

    opt = keras.optimizers.SGD(1e-6)
    opt.build(model.trainable_weights)

    @tf.function(jit_compile=True)
    def step(x: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) * g)
        opt.apply(tape.gradient(loss, model.trainable_weights), model.trainable_weights)
        return loss

    xt, gt = tf.constant(x), tf.constant(g)
    return lambda: step(xt, gt).numpy()


def _jax_step(model: Any, variant: str, x: Any, g: Any) -> Any:
    import jax
    import jax.numpy as jnp
    import keras

    opt = keras.optimizers.SGD(1e-6)
    opt.build(model.trainable_variables)
    training = variant != "fp8kit.keras"  # frozen scales on JAX (module doc)

    @jax.jit
    def step(state: tuple[Any, ...], x: jax.Array, g: jax.Array) -> tuple[Any, ...]:
        tv, ntv, ov = state

        def loss(tv: Any) -> Any:
            y, new_ntv = model.stateless_call(tv, ntv, x, training=training)
            return jnp.sum(y * g), new_ntv

        (_, new_ntv), grads = jax.value_and_grad(loss, has_aux=True)(tv)
        tv, ov = opt.stateless_apply(ov, grads, tv)
        return tv, new_ntv, ov

    state = [
        (
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in opt.variables],
        )
    ]
    xj, gj = jnp.asarray(x), jnp.asarray(g)

    def run() -> None:
        state[0] = step(state[0], xj, gj)
        jax.block_until_ready(state[0])

    return run


def measure(backend: str, tokens: int, d_in: int, d_out: int, repeats: int) -> dict[str, Any]:
    """Median seconds per train step of every variant on ``backend`` (this process's)."""
    import numpy as np

    from benchmarks.common import cpu_model, loadavg, round_robin

    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, d_in)).astype(np.float32)
    g = (rng.standard_normal((tokens, d_out)) * 1e-3).astype(np.float32)
    steps = {}
    for variant in VARIANTS:
        model = _model(variant, d_in, d_out)
        steps[variant] = (
            _tf_step(model, x, g) if backend == "tensorflow" else _jax_step(model, variant, x, g)
        )
    medians = round_robin(steps, repeats=repeats, warmup=2)
    return {
        "backend": backend,
        "shape": f"{tokens} tok x {d_in}->{d_out}",
        "seconds": medians,
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, load average {loadavg()}",
    }


def _run_backend(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    """``measure`` in a fresh process with ``KERAS_BACKEND=backend``."""
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    cmd = [sys.executable, "-m", "benchmarks.bench_keras", "--backend", backend, "--json"]
    cmd += ["--tokens", str(args.tokens), "--features", str(args.features)]
    cmd += ["--repeats", str(args.repeats)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench_keras on {backend} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: list[dict[str, Any]]) -> str:
    from benchmarks.common import markdown_table

    rows = []
    for res in results:
        base = res["seconds"]["float32"]
        for variant in VARIANTS:
            t = res["seconds"][variant]
            label = variant + (" (frozen scales)" if variant == "fp8kit.keras" and
                               res["backend"] == "jax" else "")  # fmt: skip
            rows.append([res["backend"], label, res["shape"], f"{t * 1e3:.1f}", f"{t / base:.2f}x"])
    header = ["backend", "variant", "shape", "median ms / step", "vs float32"]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    parser.add_argument("--backend", choices=(*BACKENDS, "all"), default="all")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--features", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON line (one backend)")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.features, args.repeats = 256, 256, 3
    if args.json:
        if os.environ.get("KERAS_BACKEND") != args.backend:
            raise SystemExit("--json measures this process's backend: set KERAS_BACKEND too")
        res = measure(args.backend, args.tokens, args.features, args.features, args.repeats)
        print(json.dumps(res))
        return ""
    backends = BACKENDS if args.backend == "all" else (args.backend,)
    results = [_run_backend(b, args) for b in backends]
    out = table(results) + f"\n\nMachine: {results[0]['machine']}"
    print(out)
    return out


if __name__ == "__main__":
    main()

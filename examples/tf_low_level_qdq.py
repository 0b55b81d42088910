"""Seed 001 in TensorFlow: the delayed-scaling FP8 GEMM loop with an FP8 output.

Each step quantizes ``a`` and ``b`` into E4M3 with the scales the previous step produced, runs
the GEMM inside ``tf.function(jit_compile=True)`` on dequantized operands (the pattern XLA turns
into an FP8 GEMM on Hopper GPUs), writes its result ``c`` as FP8 with a *delayed* output scale,
and returns the amaxes so the next step's scales come from an amax history (docs/semantics.md
section 3): slots INPUT (``a``), WEIGHT (``b``) and OUTPUT (``c``) of one forward state ``(L, 3)``.
The quantization and the update rule are fp8kit.keras's: the FP8 bytes equal fp8kit.torch's, and
amaxes of ``c`` may differ from torch's by a float32 rounding (docs/keras.md, "Platform notes").

Run: ``KERAS_BACKEND=tensorflow python examples/tf_low_level_qdq.py``
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import tensorflow as tf

import fp8kit.keras as f8
from fp8kit.formats import E4M3
from fp8kit.keras.quantization import cast_to_fp8, dequantize, nan_ignoring_amax
from fp8kit.keras.scaling import update_scaling_state

RECIPE = f8.DelayedScaling(amax_history_len=4, margin=1)  # 2x headroom for growing data
A, B, C = int(f8.FwdSlot.INPUT), int(f8.FwdSlot.WEIGHT), int(f8.FwdSlot.OUTPUT)


@tf.function(jit_compile=True)
def matmul_fp8(a: tf.Tensor, b: tf.Tensor, scale: tf.Tensor) -> tuple[tf.Tensor, ...]:
    """``c = a @ b`` with E4M3 operands and an E4M3 output, all at delayed ``scale`` (3,).

    Returns the FP8 ``c``, its ``scale_inv`` and the amaxes ``(3,)`` seen this step.
    """
    a_fp8 = cast_to_fp8(a, scale[A], E4M3)
    b_fp8 = cast_to_fp8(b, scale[B], E4M3)
    c = tf.matmul(dequantize(a_fp8, 1.0 / scale[A]), dequantize(b_fp8, 1.0 / scale[B]))
    c_fp8 = cast_to_fp8(c, scale[C], E4M3)  # clipped to +-448, NaN kept
    amaxes = tf.stack([nan_ignoring_amax(a), nan_ignoring_amax(b), nan_ignoring_amax(c)])
    return c_fp8, 1.0 / scale[C], amaxes


@tf.function(jit_compile=True)
def update(history: tf.Tensor, scale: tf.Tensor, count: tf.Tensor, amaxes: tf.Tensor):
    """One update event: stage the amaxes in row 0, roll, recompute the scales."""
    staged = tf.concat([tf.maximum(history[:1], amaxes[None]), history[1:]], axis=0)
    return update_scaling_state(staged, scale, count, RECIPE, E4M3.max)


def main(steps: int = 8, verbose: bool = True) -> list[dict[str, float]]:
    """Run the loop on data whose range changes, returning per-step numbers."""
    history = tf.zeros((RECIPE.amax_history_len, 3))
    scale, count = tf.ones(3), tf.zeros(3)
    rng = np.random.default_rng(42)
    rows = []
    for step in range(steps):
        growth = 1.0 + 0.5 * (step % 3)  # the data range changes over the steps
        a = tf.constant(rng.uniform(size=(16, 64)).astype(np.float32) * growth)
        b = tf.constant(rng.uniform(size=(64, 16)).astype(np.float32))
        used = float(scale[C])
        c_fp8, c_inv, amaxes = matmul_fp8(a, b, scale)
        history, scale, count = update(history, scale, count, amaxes)
        exact = (a @ b).numpy()
        c = dequantize(c_fp8, c_inv).numpy()
        rows.append(
            {
                "step": step,
                "c_amax": float(amaxes[C]),
                "c_scale_used": used,
                "c_scale_next": float(scale[C]),
                "saturated": float(np.mean(np.abs(tf.cast(c_fp8, tf.float32).numpy()) == 448.0)),
                "rel_err": float(np.max(np.abs(c - exact)) / np.max(np.abs(exact))),
            }
        )
        if verbose:
            r = rows[-1]
            print(
                f"step {step}: amax(c) {r['c_amax']:9.3f}  scale used {r['c_scale_used']:9.4f}  "
                f"next {r['c_scale_next']:9.4f}  saturated {r['saturated']:.1%}  "
                f"max rel err {r['rel_err']:.3f}"
            )
    return rows


if __name__ == "__main__":
    main()

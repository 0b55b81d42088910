"""Seed 001 in fp8kit.jax: the delayed-scaling FP8 GEMM loop with an FP8 output.

Each step quantizes ``a`` and ``b`` into E4M3 with the scales the previous step produced, runs
the GEMM, writes its result ``c`` as FP8 with a *delayed* output scale, and returns ``c``'s amax
so the next step's output scale can be computed. The scales come from an amax history
(docs/semantics.md section 3) kept in an ``Fp8Meta``: slots INPUT (``a``), WEIGHT (``b``) and OUTPUT
(``c``).

Run: ``python examples/jax_low_level_delayed_scaling.py``
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import fp8kit.jax as f8

E4M3 = jnp.float8_e4m3fn


@jax.jit
def matmul_fp8(a: jax.Array, b: jax.Array, meta: f8.Fp8Meta) -> tuple[f8.Float8Array, f8.Fp8Meta]:
    """``c = a @ b`` in FP8 with delayed scales; returns the FP8 ``c`` and the updated meta."""
    scale = meta.forward.scale  # (3,): a, b, c
    a_fp8 = f8.quantize(a, scale[f8.FwdSlot.INPUT], E4M3)
    b_fp8 = f8.quantize(b, scale[f8.FwdSlot.WEIGHT], E4M3)
    # FP8 output quantized with the (delayed) output scale; .amax is the high-precision amax.
    c_fp8 = f8.fp8_matmul(a_fp8, b_fp8, out_scale=scale[f8.FwdSlot.OUTPUT], out_fp8_dtype=E4M3)
    seen = f8.Observations(
        forward=jnp.stack([a_fp8.amax, b_fp8.amax, c_fp8.amax]),
        backward=jnp.zeros(2, jnp.float32),
        chains=jnp.float32(1),
    )
    return c_fp8, f8.update(meta, seen)  # new scales for the next step


def main(steps: int = 8, verbose: bool = True) -> list[dict[str, float]]:
    """Run the loop on data whose range changes, returning per-step numbers."""
    # margin=1 leaves 2x headroom for data that grows between steps; every scale starts at 1
    meta = f8.init_meta(1, f8.DelayedScaling(amax_history_len=4, margin=1))
    key = jax.random.PRNGKey(42)
    rows = []
    for step in range(steps):
        key, ka, kb = jax.random.split(key, 3)
        growth = 1.0 + 0.5 * (step % 3)  # the data range changes over the steps
        a = jax.random.uniform(ka, (16, 64), jnp.float32) * growth
        b = jax.random.uniform(kb, (64, 16), jnp.float32)
        used = float(meta.forward.scale[f8.FwdSlot.OUTPUT])
        c_fp8, meta = matmul_fp8(a, b, meta)
        exact = a @ b
        err = float(jnp.max(jnp.abs(c_fp8.dequantize() - exact)) / jnp.max(jnp.abs(exact)))
        rows.append(
            {
                "step": step,
                "c_amax": float(c_fp8.amax),
                "c_scale_used": used,
                "c_scale_next": float(meta.forward.scale[f8.FwdSlot.OUTPUT]),
                "saturated": float(jnp.mean(jnp.abs(c_fp8.data.astype(jnp.float32)) == 448.0)),
                "rel_err": err,
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

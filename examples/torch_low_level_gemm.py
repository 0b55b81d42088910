"""Seed 001's delayed-scaling FP8 GEMM loop with fp8kit's low-level PyTorch API.

Each step quantizes A and B with the scales derived from their amax histories, multiplies them
in FP8 with a fused bias + ReLU, and writes the result C in FP8 with a *delayed* output scale;
the amaxes observed in this step (A, B and C) feed the next step's scales through the same
update rule the modules use. Run: ``python examples/torch_low_level_gemm.py``.
"""

from __future__ import annotations

import torch

import fp8kit.torch as f8
from fp8kit.formats import E4M3
from fp8kit.recipe import DelayedScaling
from fp8kit.torch.scaling import update_scaling_state

A_SLOT, B_SLOT, C_SLOT = 0, 1, 2


def main(steps: int = 8, seed: int = 0) -> list[float]:
    torch.manual_seed(seed)
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo="max")
    history = torch.zeros(recipe.amax_history_len, 3)  # (L, slots): row 0 = this step's amax
    scale = torch.ones(3)
    counts = torch.zeros(3, dtype=torch.int64)
    bias = torch.randn(64)
    errors = []
    print(f"{'step':>4} {'scale A':>10} {'scale B':>10} {'scale C':>10} {'rel. err C':>10}")
    for step in range(steps):
        growth = 1.5**step  # data whose range drifts, as activations do during training
        a = torch.randn(128, 256) * growth
        b = torch.randn(256, 64) / growth
        a8 = f8.quantize(a, scale[A_SLOT], torch.float8_e4m3fn)
        b8 = f8.quantize(b, scale[B_SLOT], torch.float8_e4m3fn)
        c8 = f8.fp8_matmul(a8, b8, bias=bias, activation="relu", out_scale=scale[C_SLOT])
        exact = torch.relu(a @ b + bias)
        errors.append(((c8.dequantize() - exact).norm() / exact.norm()).item())
        print(
            f"{step:>4} {scale[A_SLOT]:>10.4g} {scale[B_SLOT]:>10.4g} {scale[C_SLOT]:>10.4g}"
            f" {errors[-1]:>10.4f}"
        )
        # Observe, then update once: the amaxes of this step set the next step's scales.
        history[0] = torch.stack([a8.amax, b8.amax, c8.amax])
        history, scale, counts = update_scaling_state(history, scale, counts, recipe, E4M3.max)
    return errors


if __name__ == "__main__":
    main()

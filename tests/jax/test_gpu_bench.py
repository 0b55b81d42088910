"""benchmarks/gpu_jax.py: on a machine without a CUDA GPU it says so and exits 0; its train
steps (all three layer kinds) build and run on the CPU at toy sizes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from benchmarks import gpu_jax

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="this machine has a GPU backend")
def test_without_a_gpu_it_skips_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "gpu_jax.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_jax", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "skipped: no GPU JAX backend here (JAX backend: cpu)" in done.stdout
    assert "needs a CUDA GPU" in done.stdout
    saved = json.loads(out.read_text())
    assert saved["status"] == "skipped" and "no GPU" in saved["reason"]


def test_every_variant_trains_at_toy_sizes() -> None:
    # every layer kind in the MLP; the transformer block (shared by all kinds) with fp8kit's
    mlp = gpu_jax.run_case("mlp", gpu_jax.MlpShape(tokens=32, width=32), warmup=1, repeats=1)
    shape = gpu_jax.TransformerShape(blocks=1, width=32, heads=2, mlp=64, batch=2, seq=16)
    block = gpu_jax.run_case("transformer", shape, warmup=1, repeats=1, variants=("fp8kit",))
    assert set(mlp["variants"]) == set(gpu_jax.VARIANTS) and block["dense_gemms"] == 12
    for case in (mlp, block):
        for variant, r in case["variants"].items():
            if r["status"] == "n/a":
                assert variant == "flax-fp8"
                continue
            assert r["status"] == "ok" and math.isfinite(r["loss"]), (case["case"], variant)
            assert r["gemms"]["f8"] == 0  # no cuBLAS on a CPU
    hlo = 'custom_call_target="__cublas$lt$matmul$f8" custom_call_target="__cublas$gemm"'
    assert gpu_jax.count_gemms(hlo)["f8"] == 1 and gpu_jax.count_gemms(hlo)["cublas"] == 2

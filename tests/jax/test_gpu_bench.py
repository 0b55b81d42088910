"""benchmarks/gpu_jax.py: on a machine without a CUDA GPU it says so and exits 0; its train
steps (all three layer kinds) run on the CPU at toy sizes and lower to the GEMMs it counts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import fp8kit.jax as f8
from benchmarks import gpu_jax
from tests.jax.stablehlo_dots import dots

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


def test_every_variant_trains_at_toy_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    # every layer kind in the MLP; the transformer block (shared by all kinds) with fp8kit's
    mlp = gpu_jax.run_case("mlp", gpu_jax.MlpShape(tokens=32, width=32), warmup=1, repeats=1)
    printed = capsys.readouterr().out.splitlines()
    for variant in ("flax-bf16", "fp8kit"):  # each phase as it ends, before the variant's line
        labels = [line.strip().split(":")[0] for line in printed]
        phases = [label for label in labels if variant in label.split()]
        want = [f"{variant} init", f"{variant} compile", f"{variant} warm-up (1 steps)"]
        assert phases == [*want, f"mlp {variant}"], printed
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


@pytest.mark.parametrize("variant", gpu_jax.VARIANTS)
def test_mlp_step_lowers_to_six_gemms_of_the_variants_kind(variant: str) -> None:
    """What the GPU counts (6 ``__cublas$lt$matmul$f8`` in the MLP step) starts here: 6 dots,
    on FP8 operands for both FP8 variants, on bf16 for Flax's Dense; bf16 results, except
    fp8kit's weight gradients, written in the float32 of the parameters (``master_weight``)."""
    dense = gpu_jax.dense_factory(variant)
    if dense is None:
        pytest.skip("this Flax has no Fp8DirectDotGeneralOp")
    model = gpu_jax.Mlp(dense, 32)
    x = jnp.ones((32, 32), jnp.bfloat16)
    with f8.autocast(enabled=variant == "fp8kit", recipe=f8.DelayedScaling()):
        variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), x)
    found = dots(gpu_jax.make_step(model, variant).lower(variables, x, x).as_text())
    wgrad = ("f8E4M3FN", "f8E5M2")
    want = ["f32" if variant == "fp8kit" and d.operands == wgrad else "bf16" for d in found]
    assert len(found) == 6 and [d.out_type for d in found] == want
    fp8 = variant != "flax-bf16"
    assert all((d.lhs_type.startswith("f8") and d.rhs_type.startswith("f8")) == fp8 for d in found)


def test_the_compile_probe_times_a_real_compile() -> None:
    seconds = gpu_jax.compile_probe_s()
    assert isinstance(seconds, float) and seconds > 0

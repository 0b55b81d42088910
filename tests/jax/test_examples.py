"""The JAX examples run and do what they say; importing fp8kit.jax never imports torch."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np

import fp8kit.jax as f8
from tests.reference import scale_sequence

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_seed_001_low_level_loop() -> None:
    rows = _load("jax_low_level_delayed_scaling").main(steps=7, verbose=False)
    amaxes = [r["c_amax"] for r in rows]
    want, _ = scale_sequence(amaxes, f8.DelayedScaling(amax_history_len=4, margin=1), 448.0)
    assert [r["c_scale_next"] for r in rows] == [float(np.float32(s)) for s in want]
    assert [r["c_scale_used"] for r in rows[1:]] == [r["c_scale_next"] for r in rows[:-1]]
    assert all(r["saturated"] == 0.0 for r in rows)  # margin 1 absorbs the data's growth
    assert all(r["rel_err"] < 0.08 for r in rows)  # E4M3 output: ~3 bits of mantissa


def test_flax_example_trains() -> None:
    # (its seed_example part is the code of test_linen.test_seed_003_example_as_written...)
    losses = _load("jax_flax_dense_general").train(steps=12, verbose=False)
    assert losses[-1] < 0.5 * losses[0]


def test_imports_stay_separate() -> None:
    code = (
        "import sys, fp8kit; assert 'jax' not in sys.modules, 'fp8kit imported jax'; "
        "import fp8kit.jax; assert 'torch' not in sys.modules, 'fp8kit.jax imported torch'; "
        "import fp8kit.jax.linen, fp8kit.jax.nnx; assert 'torch' not in sys.modules"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]

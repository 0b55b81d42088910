"""The Keras JAX and torch backends, each in its own process (Keras fixes its backend at
import): torch trains with the same state as fp8kit.torch, JAX runs FP8 GEMMs with frozen
scales and refuses training=True with a clear error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_backend_smoke(backend: str) -> None:
    pytest.importorskip(backend)
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    done = subprocess.run(
        [sys.executable, "-m", "tests.keras.backend_smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"backend smoke {backend}: ok" in done.stdout

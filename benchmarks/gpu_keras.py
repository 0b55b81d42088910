"""The Keras train-step benchmark (``bench_keras``) on a CUDA GPU, results as JSON.

``main(out_json_path)`` runs each Keras backend that sees a GPU (TensorFlow, JAX) in its own
process at the default size and larger ones, writes the medians to ``out_json_path`` and returns
them. Without a GPU (e.g. ``tensorflow-cpu``) it prints why and returns ``{"skipped": reason}``,
exit status 0. On a GPU, XLA rewrites fp8kit.keras's dequantize-dot pattern into FP8 GEMMs
(``tests/keras/test_xla_gate.py`` checks the pattern on the CPU).

Run: ``python -m benchmarks.gpu_keras [out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from benchmarks.bench_keras import BACKENDS, ROOT, _run_backend, table

SIZES = ((4096, 2048), (8192, 4096))

_PROBE = {
    "tensorflow": (
        "import keras, tensorflow as tf; print(len(tf.config.list_physical_devices('GPU')))"
    ),
    "jax": "import keras, jax; print(sum(d.platform == 'gpu' for d in jax.devices()))",
}


def gpu_backends() -> tuple[list[str], dict[str, str]]:
    """The Keras backends whose framework sees at least one CUDA GPU in this environment, and
    for each other backend why not (its probe's last error line, or no GPU seen)."""
    found, why_not = [], {}
    for backend in BACKENDS:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
        done = subprocess.run(
            [sys.executable, "-c", _PROBE[backend]],
            cwd=ROOT, env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines and lines[-1].isdigit() and int(lines[-1]) > 0:
            found.append(backend)
        elif done.returncode != 0:
            errors = done.stderr.strip().splitlines()
            why_not[backend] = errors[-1] if errors else f"exit status {done.returncode}"
        else:
            why_not[backend] = "no CUDA GPU visible (a CPU build?)"
    return found, why_not


def main(out_json_path: str) -> dict[str, Any]:
    """Benchmark on every backend with a GPU; write and return the results."""
    backends, why_not = gpu_backends()
    if not backends:
        reason = "; ".join(f"{b}: {why}" for b, why in why_not.items())
        print(f"gpu_keras: skipped: {reason}")
        return {"skipped": reason}
    results = []
    for tokens, features in SIZES:
        args = argparse.Namespace(tokens=tokens, features=features, repeats=20)
        results += [_run_backend(b, args) for b in backends]
    print(table(results))
    out = {"results": results}
    with open(out_json_path, "w") as f:
        json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpu_keras.json")

"""JAX test setup: eight host CPU devices for the mesh tests, set before jax starts a backend.

If a backend was started earlier in this process (another test module imported jax first), the
flag comes too late; the sharded tests then run themselves in a subprocess (see test_sharded.py).
"""

from __future__ import annotations

import os

# Eight host devices for the (2, 4) mesh tests. LLVM optimisation level 0 halves XLA's CPU compile
# time, which dominates these tests (tiny arrays, many small programs); IEEE float semantics are
# the same at every level (XLA never enables fast-math here).
_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0")
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh, differently seeded generator per test (seed printed on failure)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"numpy seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def key(rng: np.random.Generator) -> jax.Array:
    return jax.random.key(int(rng.integers(0, 2**31 - 1)))

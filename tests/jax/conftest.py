"""JAX test setup: eight host CPU devices for the mesh tests, set before jax starts a backend.

If a backend was started earlier in this process (another test module imported jax first), the
flag comes too late; the sharded tests then run themselves in a subprocess (see test_sharded.py).
"""

from __future__ import annotations

import os

# Eight host devices for the (2, 4) mesh tests. LLVM optimisation level 0 halves XLA's CPU compile
# time, which dominates these tests (tiny arrays, many small programs). XLA never enables
# fast-math, but only its default level contracts a multiply and an add into one fused
# multiply-add (one rounding instead of two): a test of jitted against op-by-op bits where that
# can happen runs in a process of its own at the default level (test_gemm.py).
_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0")
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Fresh random inputs per test, reproducible from a failure's report (tests/README.md): the
# ``rng`` fixture and the hook that reports its seed, activated by importing them here.
from tests.seeding import pytest_runtest_makereport, rng  # noqa: E402, F401


@pytest.fixture
def key(request: pytest.FixtureRequest) -> jax.Array:
    """A JAX PRNG key drawn from the test's ``rng``: the reported seed reproduces it too."""
    generator: np.random.Generator = request.getfixturevalue("rng")
    return jax.random.key(int(generator.integers(0, 2**31 - 1)))
